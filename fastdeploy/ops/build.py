"""Build the C++ ops in custom_ops/ once, cache the library, and load it.

The library is compiled with paddle.utils.cpp_extension (CppExtension + BuildExtension, in a child
process) into ~/.cache/fastdeploy/ops/<digest>/, where the digest covers the sources, the compiler
flags, the Paddle version and the Python version: a fresh clone builds once (~20 s), later processes
only register the cached library (milliseconds). Concurrent processes (tensor-parallel ranks) take a
file lock, so one builds and the others wait and reuse it.

`library()` never raises: when the build or the load fails, or the CPU lacks AVX2, it logs one warning
and returns None, and every wrapper in fastdeploy.ops then runs its pure-Paddle reference.

`use_sanitizers()` makes the process build and load a second variant instead, under AddressSanitizer and
UndefinedBehaviorSanitizer (`make sanitize`; its flags give it its own digest and cache directory).
"""
from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import shlex
import shutil
import subprocess
import sys
import sysconfig
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
# The sanitized variant: any out-of-bounds or use-after-free access and any undefined behaviour aborts with a
# report (no recovery). -O1 -g is ASan's usual pairing: exact source lines at a fraction of -O0's slowness.
# A process that loads it needs the environment `sanitizer_env()` gives (the ASan runtime preloaded).
# No vptr check: it misfires in Paddle's own header (paddle::any_cast of an op's attributes), whose holder
# types' RTTI lives in libpaddle.so.
SANITIZER_FLAGS = ["-fsanitize=address,undefined", "-fno-sanitize=vptr", "-fno-sanitize-recover=all",
                   "-fno-omit-frame-pointer"]
SANITIZED_CXX_FLAGS = [f for f in CXX_FLAGS if f not in ("-O3", "-g0")] + ["-O1", "-g", *SANITIZER_FLAGS]
SANITIZED_LD_FLAGS = [*LD_FLAGS, *SANITIZER_FLAGS]
# Stop at the first report, as an abort. Python's and Paddle's own leaks are not ours, nor Paddle's new[] /
# delete mismatch in CustomOpDialect::RegisterCustomOp, met by loading any custom op library.
SANITIZER_OPTIONS = {"ASAN_OPTIONS": "detect_leaks=0:alloc_dealloc_mismatch=0:abort_on_error=1",
                     "UBSAN_OPTIONS": "print_stacktrace=1:halt_on_error=1:abort_on_error=1"}
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


def build_flags(sanitize: bool) -> tuple[list[str], list[str]]:
    """(compiler flags, linker flags) of the release or the sanitized variant."""
    return (SANITIZED_CXX_FLAGS, SANITIZED_LD_FLAGS) if sanitize else (CXX_FLAGS, LD_FLAGS)


def _compiler_library(name: str) -> str:
    """Path of the library `name` that the compiler the build uses (GCC) links with."""
    compiler = shlex.split(sysconfig.get_config_var("CC") or "gcc")[0]
    out = subprocess.run([compiler, f"-print-file-name={name}"], capture_output=True, text=True, timeout=60)
    path = out.stdout.strip()
    if out.returncode != 0 or not os.path.isabs(path):  # gcc answers the bare name when it has no such file
        raise BuildError(f"{compiler} has no {name}")
    return path


def sanitizer_env() -> dict[str, str]:
    """This process's environment for a child that loads the sanitized variant, with SANITIZER_OPTIONS.

    The ASan runtime is preloaded, as it must come before every other library, and the C++ runtime with it:
    Python does not link libstdc++, and ASan that cannot intercept __cxa_throw aborts at the first exception
    Paddle throws. ASan's dlopen stands in for the caller's, whose RUNPATH is then not searched: Paddle's
    libs/ directory (MKL, which it opens on first use) goes on the library path instead."""
    preload = f"{_compiler_library('libasan.so')} {_compiler_library('libstdc++.so')}"
    paddle_libs = str(Path(paddle.__file__).resolve().parent / "libs")
    library_path = os.pathsep.join(p for p in (paddle_libs, os.environ.get("LD_LIBRARY_PATH")) if p)  # env-ok
    return {**os.environ, "LD_PRELOAD": preload, "LD_LIBRARY_PATH": library_path, **SANITIZER_OPTIONS}  # env-ok


def source_digest(source_dir: Path, sanitize: bool = False) -> str:
    h = hashlib.sha256()
    if not source_dir.is_dir():
        raise BuildError(f"custom op sources not found at {source_dir}")
    files = sorted(p for p in source_dir.iterdir() if p.suffix in (".cc", ".h", ".inc"))
    for p in files:
        h.update(p.name.encode())
        h.update(p.read_bytes())
    h.update(repr((*build_flags(sanitize), paddle.__version__, sys.version_info[:2])).encode())
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


def _compile(source_dir: Path, work: Path, sanitize: bool) -> Path:
    """Compile into `work` (a fresh directory); returns the shared library's path."""
    sources = []
    for name in SOURCES:
        src = source_dir / name
        if not src.is_file():
            raise BuildError(f"missing source {src}")
        sources.append(str(src))
    out = work / "lib"
    setup_py = work / "setup_ops.py"
    cxx, ld = build_flags(sanitize)
    setup_py.write_text(_SETUP_TEMPLATE.format(name=LIB_NAME, sources=sources, cxx=cxx, ld=ld, out=str(out)))
    # Paddle's build step loads the library it built: the sanitized one needs its runtime (the compiler runs
    # under it too, harmlessly).
    proc = subprocess.run([sys.executable, str(setup_py), "build"], cwd=work, capture_output=True, text=True,
                          env=sanitizer_env() if sanitize else None)
    lib = out / f"{LIB_NAME}.so"
    if proc.returncode != 0 or not lib.is_file():
        tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-15:])
        raise BuildError(f"compiling custom_ops failed (exit {proc.returncode}):\n{tail}")
    return lib


def build_library(source_dir: Path | None = None, cache_root: Path | None = None, sanitize: bool = False) -> Path:
    """Path of the compiled library for these sources (the sanitized variant with sanitize=True), compiling
    it first if it is not cached."""
    source_dir = source_dir or SOURCE_DIR
    root = cache_root or default_cache_root()
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError:  # e.g. a read-only home: build per machine boot instead of once
        root = Path(tempfile.gettempdir()) / f"fastdeploy-ops-{os.getuid()}"
        root.mkdir(parents=True, exist_ok=True)
    final = root / source_digest(source_dir, sanitize)
    lib = final / f"{LIB_NAME}.so"
    if lib.is_file():
        return lib
    with open(root / f"{final.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be building the same digest
        if lib.is_file():
            return lib
        logger.info("compiling the CPU custom ops%s once (about %d s) into %s", " with sanitizers" if sanitize else "",
                    90 if sanitize else 20, final)
        work = Path(tempfile.mkdtemp(prefix="build-", dir=root))
        try:
            built = _compile(source_dir, work, sanitize)
            final.mkdir(exist_ok=True)
            tmp = final / f".{LIB_NAME}.so.{os.getpid()}"
            shutil.copy2(built, tmp)
            os.replace(tmp, lib)  # atomic: readers never see a half-written library
        finally:
            shutil.rmtree(work, ignore_errors=True)
    return lib


_registered: dict[Path, OpsLibrary] = {}


def load_library(source_dir: Path | None = None, cache_root: Path | None = None, sanitize: bool = False) -> OpsLibrary:
    """Build if needed and register the ops with Paddle (once per process). Raises on failure."""
    path = build_library(source_dir, cache_root, sanitize)
    if path not in _registered:
        from paddle.utils.cpp_extension import load_op_meta_info_and_register_op

        names = load_op_meta_info_and_register_op(str(path))
        _registered[path] = OpsLibrary(path=path, ops=frozenset(names))
    return _registered[path]


_library: OpsLibrary | None = None
_tried = False
_sanitize = False


def use_sanitizers() -> None:
    """Make `library()` build and load the ASan + UBSan variant (for `make sanitize`, through tests/conftest.py's
    --sanitize). Call it before the library is first loaded, in a process with the ASan runtime preloaded."""
    global _sanitize
    if _tried or _registered:
        raise RuntimeError("use_sanitizers() must come before the compiled ops are first loaded")
    _sanitize = True


def library() -> OpsLibrary | None:
    """The process's compiled ops, or None (warned once) when they cannot be built or run here."""
    global _library, _tried
    if _tried:
        return _library
    _tried = True
    try:
        lib = load_library(sanitize=_sanitize)
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


_core_budget: int | None = None  # limit_cores's; None: the CPUs the affinity mask allows


def limit_cores(n: int | None) -> None:
    """Make `n` cores this process's budget (a Ray actor's num_cpus), shared among the tensor-parallel ranks an
    engine starts afterwards (they get it from rank 0); None: the CPUs its affinity mask allows."""
    global _core_budget
    if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
        raise ValueError(f"cores must be an int >= 1 or None, got {n!r}")
    _core_budget = n


def core_budget() -> int:
    """The cores this process's engine may use (limit_cores, else its affinity mask's CPUs)."""
    return _core_budget if _core_budget is not None else len(os.sched_getaffinity(0))


def share_cores(ranks: int) -> None:
    """Give the compiled ops of this process its share of the core budget when `ranks` processes run
    side by side (tensor parallel); oversubscribed OpenMP threads stall each other."""
    set_num_threads(max(1, core_budget() // ranks))
