"""`make lint`'s type check: strict mypy over the layers that must stay typed (kiln, kiln.runtime, kiln.cli).

kiln installs folders as subpackages (pyproject's package-dir maps runtime/ to kiln.runtime, ...), a
layout mypy cannot follow from the source tree. This mirrors the installed layout with symlinks under
.cache/typecheck/ and runs mypy there, with the settings in pyproject's [tool.mypy].
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import tomllib

REPO = Path(__file__).resolve().parent.parent
TREE = REPO / ".cache" / "typecheck"
CHECKED_PACKAGES = ("kiln.runtime", "kiln.cli")  # and kiln's own modules; the build stages are typed loosely


def mirror_packages(tree: Path = TREE) -> None:
    """tree/kiln/... (.cache/typecheck by default): one symlink per module or subpackage folder, as the install
    lays them out (tools/gpu_check.py puts such a tree on PYTHONPATH instead of installing kiln)."""
    package_dir = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    shutil.rmtree(tree, ignore_errors=True)
    root = tree / "kiln"
    root.mkdir(parents=True)
    for module in (REPO / package_dir["kiln"]).glob("*.py"):
        (root / module.name).symlink_to(module)
    for package, folder in package_dir.items():
        if package != "kiln" and package.count(".") == 1:
            (root / package.split(".", 1)[1]).symlink_to(REPO / folder, target_is_directory=True)


def main() -> int:
    mirror_packages()
    modules = [f"kiln.{path.stem}" for path in sorted((TREE / "kiln").glob("*.py")) if path.stem != "__init__"]
    targets = [arg for package in CHECKED_PACKAGES for arg in ("-p", package)]
    targets += [arg for module in modules for arg in ("-m", module)]
    command = [sys.executable, "-m", "mypy", "--config-file", str(REPO / "pyproject.toml"), *targets]
    return subprocess.call(command, cwd=TREE)


if __name__ == "__main__":
    sys.exit(main())
