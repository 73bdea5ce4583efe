"""FastDeploy's version helpers: `fastdeploy.version()` and the package version string."""
from __future__ import annotations

from importlib import metadata

DISTRIBUTION = "fastdeploy-cpu"  # the name in pyproject.toml


def current_package_version() -> str:
    """This package's version from its installed metadata ("Unknown" when not installed)."""
    try:
        return metadata.version(DISTRIBUTION)
    except metadata.PackageNotFoundError:
        return "Unknown"


def version() -> str:
    """The build description FastDeploy's version() returns (its version.txt): one `name: value` line each
    for this package's version and Paddle's."""
    import paddle  # deferred: the package imports paddle anyway, this module need not

    return f"fastdeploy version: {current_package_version()}\nPaddle version: {paddle.__version__}\n"
