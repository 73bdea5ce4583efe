"""Metadata lives in pyproject.toml. This file only ships the C++ sources of custom_ops/ inside the
package (as fastdeploy/ops/csrc/) for non-editable installs, which compile them on first use; an
editable install reads them from the checkout."""
import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py


class BuildPyWithOpSources(build_py):
    def run(self) -> None:
        super().run()
        target = Path(self.build_lib) / "fastdeploy" / "ops" / "csrc"
        shutil.copytree(Path(__file__).parent / "custom_ops", target, dirs_exist_ok=True)


setup(cmdclass={"build_py": BuildPyWithOpSources})
