"""`fastdeploy collect-env`: a plain-text report of the machine and the software this engine runs on, to
paste into a bug report. Reads only: it never compiles the custom ops (that takes ~20 s on first use), it
says whether they are built and, if so, which instruction set their kernels run."""
from __future__ import annotations

import argparse
import os
import platform
import sys
import tempfile
from importlib import metadata
from pathlib import Path

# /proc/cpuinfo flag -> the name people know it by. VNNI: AVX512_VNNI or the VEX-coded AVX_VNNI.
ISA_FLAGS = {"avx2": "AVX2", "fma": "FMA", "avx512f": "AVX-512F", "avx512bw": "AVX-512BW",
             "avx512_vnni": "AVX-512 VNNI", "avx_vnni": "AVX-VNNI", "avx512_bf16": "AVX-512 BF16",
             "amx_bf16": "AMX-BF16"}
PACKAGES = ("paddlepaddle", "numpy", "tokenizers", "sentencepiece", "fastapi", "uvicorn", "pydantic", "requests",
            "llguidance", "fastdeploy-cpu")


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    subparsers.add_parser("collect-env", help="print the environment report for bug reports",
                          description="Print Python, platform, CPU (model, ISA flags, cores), memory, the versions "
                                      "of this package and its main dependencies, and the compiled ops' state.")


def _cpuinfo() -> dict[str, str]:
    """The first processor's fields of /proc/cpuinfo ({} where there is none: not Linux)."""
    fields: dict[str, str] = {}
    try:
        text = Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace")
    except OSError:
        return fields
    for line in text.splitlines():
        if not line.strip():
            if fields:
                break  # one processor is enough
            continue
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    return fields


def _memory() -> str:
    try:
        lines = Path("/proc/meminfo").read_text(encoding="utf-8").splitlines()
    except OSError:
        return "unknown"
    kib = {line.split(":")[0]: int(line.split()[1]) for line in lines if line.split()[1:2] and
           line.split()[1].isdigit()}
    gib = {key: kib[key] / (1 << 20) for key in ("MemTotal", "MemAvailable") if key in kib}
    return ", ".join(f"{key.removeprefix('Mem').lower()} {value:.1f} GiB" for key, value in gib.items()) or "unknown"


def _version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "not installed"


def _ops_lines() -> list[str]:
    """The custom ops: built or not (looked up in their cache, never compiled here), and the ISA they run."""
    from fastdeploy.ops import build

    try:
        digest = build.source_digest(build.SOURCE_DIR)
    except build.BuildError as e:
        return [f"Compiled ops: cannot be built ({e})", "Ops ISA: none (the pure-Paddle reference implementations run)"]
    # build_library's cache, or its fallback when the home directory is read-only.
    cached = [root / digest / f"{build.LIB_NAME}.so"
              for root in (build.default_cache_root(), Path(tempfile.gettempdir()) / f"fastdeploy-ops-{os.getuid()}")]
    found = next((path for path in cached if path.is_file()), None)
    if found is None:
        return ["Compiled ops: not built (compiled from custom_ops/ on first use, about 20 s)",
                "Ops ISA: none (not built)"]
    info = build.runtime_info()
    if not info["compiled"]:
        return [f"Compiled ops: built at {found}, but they do not load or run here (see the warning above)",
                "Ops ISA: none (the pure-Paddle reference implementations run)"]
    return [f"Compiled ops: built at {found}",
            f"Ops ISA: {info['active_isa']} (detected: {info['detected_isa']}; OpenMP threads: {info['num_threads']})"]


def report() -> str:
    cpu = _cpuinfo()
    flags = set(cpu.get("flags", "").split())
    has = [name for flag, name in ISA_FLAGS.items() if flag in flags]
    missing = [name for flag, name in ISA_FLAGS.items() if flag not in flags]
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    lines = [
        f"Python: {sys.version.split()[0]} ({sys.executable})",
        f"Platform: {platform.platform()}",
        f"CPU: {cpu.get('model name', platform.processor() or 'unknown')}",
        f"CPU ISA flags: {', '.join(has) or 'none of them'}" + (f" (absent: {', '.join(missing)})" if missing else ""),
        f"CPU cores: {os.cpu_count()} logical, {usable} usable by this process",
        f"Memory: {_memory()}",
    ]
    lines += [f"{package}: {_version(package)}" for package in PACKAGES]
    lines += _ops_lines()
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    print(report())  # the command's output, for the user to paste
    return 0
