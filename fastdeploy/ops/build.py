"""Build the C++ ops in custom_ops/ once, cache the library, and load it.

The library is compiled with paddle.utils.cpp_extension (CppExtension + BuildExtension, in a child
process) into ~/.cache/fastdeploy/ops/<digest>/, where the digest covers the sources, the compiler
flags, the Paddle version and the Python version: a fresh clone builds once (~20 s), later processes
only register the cached library (milliseconds). Concurrent processes (tensor-parallel ranks) take a
file lock, so one builds and the others wait and reuse it.

`library()` never raises: when the build or the load fails, or the CPU lacks AVX2, it logs one warning
and returns None, and every wrapper in fastdeploy.ops then runs its pure-Paddle reference.
"""
from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import paddle
from paddle import _C_ops

logger = logging.getLogger(__name__)

# The checkout's custom_ops/ (editable installs), else the copy setup.py ships in the package.
_CHECKOUT_SOURCES = Path(__file__).resolve().parents[2] / "custom_ops"
SOURCE_DIR = _CHECKOUT_SOURCES if _CHECKOUT_SOURCES.is_dir() else Path(__file__).resolve().parent / "csrc"
SOURCES = ("ops_paddle.cc", "ops_paddle_packed.cc", "dispatch.cc", "embedding.cc", "decoder_step.cc", "isa_avx512.cc",
           "isa_avx2.cc")
LIB_NAME = "fastdeploy_cpu_ops"
# -ffp-contract=off: only the kernels' explicit FMAs fuse, so results match the references' rounding
# where intended and are identical across the AVX2 and AVX-512 builds. -g0 and -fno-wrapv override the -g
# and -fwrapv that setuptools takes from Python's own build flags: with wrapping signed arithmetic GCC gave
# up optimisations in the kernels' loops (the AVX2 bf16 GEMMs of 16 rows took 1.2-1.3x the time).
CXX_FLAGS = ["-O3", "-g0", "-fno-wrapv", "-std=c++17", "-fopenmp", "-ffp-contract=off", "-w"]
LD_FLAGS = ["-fopenmp"]
ISA_NAMES = {0: "none", 1: "avx2", 2: "avx512", 3: "avx512_bf16"}


@dataclass(slots=True)
class OpsLibrary:
    path: Path
    ops: frozenset[str]
    # paddle's own generated custom-op wrappers call this entry point; calling it directly skips their
    # per-call Python layer. Returns the op's outputs as a list.
    call: Callable[..., list[paddle.Tensor]] = field(default=_C_ops._run_custom_op, repr=False)


class BuildError(RuntimeError):
    pass


def default_cache_root() -> Path:
    return Path.home() / ".cache" / "fastdeploy" / "ops"


def source_digest(source_dir: Path) -> str:
    h = hashlib.sha256()
    if not source_dir.is_dir():
        raise BuildError(f"custom op sources not found at {source_dir}")
    files = sorted(p for p in source_dir.iterdir() if p.suffix in (".cc", ".h", ".inc"))
    for p in files:
        h.update(p.name.encode())
        h.update(p.read_bytes())
    h.update(repr((CXX_FLAGS, LD_FLAGS, paddle.__version__, sys.version_info[:2])).encode())
    return h.hexdigest()[:16]


_SETUP_TEMPLATE = textwrap.dedent("""\
    from paddle.utils.cpp_extension import BuildExtension, CppExtension, setup

    setup(
        name={name!r},
        ext_modules=[CppExtension(sources={sources!r}, extra_compile_args={{"cxx": {cxx!r}}},
                                  extra_link_args={ld!r})],
        cmdclass={{"build_ext": BuildExtension.with_options(output_dir={out!r}, no_python_abi_suffix=True)}},
    )
""")


def _compile(source_dir: Path, work: Path) -> Path:
    """Compile into `work` (a fresh directory); returns the shared library's path."""
    sources = []
    for name in SOURCES:
        src = source_dir / name
        if not src.is_file():
            raise BuildError(f"missing source {src}")
        sources.append(str(src))
    out = work / "lib"
    setup_py = work / "setup_ops.py"
    setup_py.write_text(_SETUP_TEMPLATE.format(name=LIB_NAME, sources=sources, cxx=CXX_FLAGS, ld=LD_FLAGS,
                                               out=str(out)))
    proc = subprocess.run([sys.executable, str(setup_py), "build"], cwd=work, capture_output=True, text=True)
    lib = out / f"{LIB_NAME}.so"
    if proc.returncode != 0 or not lib.is_file():
        tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-15:])
        raise BuildError(f"compiling custom_ops failed (exit {proc.returncode}):\n{tail}")
    return lib


def build_library(source_dir: Path | None = None, cache_root: Path | None = None) -> Path:
    """Path of the compiled library for these sources, compiling it first if it is not cached."""
    source_dir = source_dir or SOURCE_DIR
    root = cache_root or default_cache_root()
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError:  # e.g. a read-only home: build per machine boot instead of once
        root = Path(tempfile.gettempdir()) / f"fastdeploy-ops-{os.getuid()}"
        root.mkdir(parents=True, exist_ok=True)
    final = root / source_digest(source_dir)
    lib = final / f"{LIB_NAME}.so"
    if lib.is_file():
        return lib
    with open(root / f"{final.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be building the same digest
        if lib.is_file():
            return lib
        logger.info("compiling the CPU custom ops once (about 20 s) into %s", final)
        work = Path(tempfile.mkdtemp(prefix="build-", dir=root))
        try:
            built = _compile(source_dir, work)
            final.mkdir(exist_ok=True)
            tmp = final / f".{LIB_NAME}.so.{os.getpid()}"
            shutil.copy2(built, tmp)
            os.replace(tmp, lib)  # atomic: readers never see a half-written library
        finally:
            shutil.rmtree(work, ignore_errors=True)
    return lib


_registered: dict[Path, OpsLibrary] = {}


def load_library(source_dir: Path | None = None, cache_root: Path | None = None) -> OpsLibrary:
    """Build if needed and register the ops with Paddle (once per process). Raises on failure."""
    path = build_library(source_dir, cache_root)
    if path not in _registered:
        from paddle.utils.cpp_extension import load_op_meta_info_and_register_op

        names = load_op_meta_info_and_register_op(str(path))
        _registered[path] = OpsLibrary(path=path, ops=frozenset(names))
    return _registered[path]


_library: OpsLibrary | None = None
_tried = False


def library() -> OpsLibrary | None:
    """The process's compiled ops, or None (warned once) when they cannot be built or run here."""
    global _library, _tried
    if _tried:
        return _library
    _tried = True
    try:
        lib = load_library()
        detected = int(lib.call("fd_runtime", paddle.zeros([1]), -2, -1)[0][0])
        if detected == 0:
            raise BuildError("this CPU has neither AVX2+FMA nor AVX-512")
        _library = lib
    except Exception as exc:  # any failure means: run the references
        logger.warning("compiled CPU ops unavailable, using the pure-Paddle reference implementations: %s", exc)
        _library = None
    return _library


def runtime_info() -> dict[str, object]:
    """{'compiled': bool, 'detected_isa', 'active_isa', 'num_threads'} of the compiled ops."""
    lib = library()
    if lib is None:
        return {"compiled": False, "detected_isa": "none", "active_isa": "none", "num_threads": 0}
    detected, active, threads = lib.call("fd_runtime", paddle.zeros([1]), -2, -1)[0].tolist()
    return {"compiled": True, "detected_isa": ISA_NAMES[detected], "active_isa": ISA_NAMES[active],
            "num_threads": threads}


def set_num_threads(n: int) -> None:
    """OpenMP threads used by every compiled op (0: one per core). Tensor-parallel ranks sharing a
    machine should each take their share."""
    if not isinstance(n, int) or n < 0:
        raise ValueError(f"num_threads must be an int >= 0, got {n!r}")
    lib = library()
    if lib is not None:
        lib.call("fd_runtime", paddle.zeros([1]), -2, n)


def set_isa(name: str) -> str:
    """Choose the kernels' instruction set: 'best', 'avx512_bf16', 'avx512' or 'avx2' (lowered to what the
    CPU has; 'avx512' is AVX-512 without its bf16 dot product).
    Returns the one now active. Meant for tests and benchmarks of the fallback paths."""
    levels = {"best": -1, "avx2": 1, "avx512": 2, "avx512_bf16": 3}
    if name not in levels:
        raise ValueError(f"isa must be one of {sorted(levels)}, got {name!r}")
    lib = library()
    if lib is None:
        return "none"
    return ISA_NAMES[int(lib.call("fd_runtime", paddle.zeros([1]), levels[name], -1)[0][1])]


def compiled(use_compiled: bool) -> OpsLibrary | None:
    """The library when the caller wants it and it is available, else None (use the reference)."""
    return library() if use_compiled else None


def call_op(lib: OpsLibrary, name: str, *args: object) -> list[paddle.Tensor]:
    try:
        return lib.call(name, *args)
    except OSError as exc:  # PD_CHECK failures: bad arguments, with the kernel's message
        raise ValueError(str(exc).strip().splitlines()[0]) from None


def share_cores(ranks: int) -> None:
    """Give the compiled ops of this process its share of the cores when `ranks` processes run
    side by side (tensor parallel); oversubscribed OpenMP threads stall each other."""
    set_num_threads(0 if ranks == 1 else max(1, (os.cpu_count() or 1) // ranks))
