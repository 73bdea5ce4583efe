"""`make sanitize`: the compiled ops under AddressSanitizer and UndefinedBehaviorSanitizer.

Run from the repository root (the Makefile passes the op, compiled-step and shape-sweep tests):

    .venv/bin/python tools/sanitize.py tests/test_ops.py [more pytest arguments]

Builds the sanitized variant of the library (fastdeploy/ops/build.py, cached like the release one) in this
process, where no sanitizer runtime is preloaded, then replaces itself with pytest --sanitize in the
environment build.sanitizer_env() gives: the ASan runtime preloaded, the first report aborting the run.
pytest captures only Python's streams (--capture=sys), so a report written to stderr is seen.
"""
from __future__ import annotations

import logging
import os
import sys

from fastdeploy.ops import build


def main(pytest_args: list[str]) -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    build.build_library(sanitize=True)
    argv = [sys.executable, "-m", "pytest", "-q", "--capture=sys", "--sanitize", *pytest_args]
    os.execve(sys.executable, argv, build.sanitizer_env())


if __name__ == "__main__":
    main(sys.argv[1:])
