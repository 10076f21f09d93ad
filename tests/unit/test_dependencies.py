"""Every third-party package the shipped code imports is declared in pyproject.toml, and every
declared one is imported: the modules come from pyproject's own package list, import names map
to distributions through the installed metadata (onnx_ir -> onnx-ir, yaml -> PyYAML)."""

from __future__ import annotations

import ast
import re
import sys
from importlib.metadata import packages_distributions
from pathlib import Path

import tomllib

REPO = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
# kiln.runtime is the deployed half: it may import only the base install, the server extra, the cluster extra
# (runtime/cluster/, `kiln serve --replicas`) and the tensorrt extra (runtime/trt_runner.py, imported only when a
# TensorRT engine is opened).
RUNTIME_PACKAGE, RUNTIME_EXTRAS = "kiln.runtime", ("server", "cluster", "tensorrt", "vision")
# Import names of the tensorrt extra's distributions, which cannot be installed here (no NVIDIA index, no GPU),
# so the installed metadata cannot map them.
NOT_INSTALLABLE_HERE = {"tensorrt": ["tensorrt"], "cuda": ["cuda-python"]}
# Extras that ship nothing importable by kiln itself (the tests' tools).
TOOL_EXTRAS = ("dev",)


def canonical(distribution: str) -> str:
    return re.sub(r"[-_.]+", "-", distribution).lower()


def requirement_name(requirement: str) -> str:
    return canonical(re.match(r"[A-Za-z0-9._-]+", requirement).group(0))


def declared() -> dict[str, set[str]]:
    """Distribution names per group: "" is the base install, then each extra."""
    project = PYPROJECT["project"]
    groups = {"": project["dependencies"], **project["optional-dependencies"]}
    return {group: {requirement_name(r) for r in reqs} for group, reqs in groups.items()}


def package_dir(package: str) -> Path:
    """Where setuptools finds ``package``: its longest mapped prefix in package-dir, then the rest."""
    mapping = PYPROJECT["tool"]["setuptools"]["package-dir"]
    parts = package.split(".")
    for cut in range(len(parts), 0, -1):
        prefix = ".".join(parts[:cut])
        if prefix in mapping:
            return REPO / mapping[prefix] / Path(*parts[cut:])
    return REPO / Path(*parts)


def shipped_modules() -> dict[str, list[Path]]:
    """The .py files of each package pyproject installs."""
    return {pkg: sorted(package_dir(pkg).glob("*.py")) for pkg in PYPROJECT["tool"]["setuptools"]["packages"]}


def third_party_imports(path: Path) -> set[str]:
    """Top-level names of the absolute imports in ``path`` (function-local ones too) outside
    the standard library and kiln."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            names.add(node.module.split(".")[0])
    return {n for n in names if n not in sys.stdlib_module_names and n != "kiln"}


def distributions_imported(packages: list[str]) -> dict[str, set[str]]:
    """distribution -> the files of ``packages`` importing it (an unmapped import name fails here)."""
    to_distribution = {**NOT_INSTALLABLE_HERE, **packages_distributions()}
    modules = shipped_modules()
    found: dict[str, set[str]] = {}
    for path in (path for package in packages for path in modules[package]):
        for name in third_party_imports(path):
            where = path.relative_to(REPO)
            assert name in to_distribution, f"{where} imports {name!r}, which no installed distribution provides"
            for dist in to_distribution[name]:
                found.setdefault(canonical(dist), set()).add(str(where))
    return found


def all_packages() -> list[str]:
    return list(shipped_modules())


def test_every_shipped_package_has_modules():
    assert all(shipped_modules().values()), "a package in pyproject's list has no .py files"


def test_every_imported_distribution_is_declared():
    groups = declared()
    shipping = set().union(*(reqs for group, reqs in groups.items() if group not in TOOL_EXTRAS))
    missing = {dist: sorted(files) for dist, files in distributions_imported(all_packages()).items()
               if dist not in shipping}
    assert not missing, f"imported but not declared in pyproject.toml: {missing}"


def test_the_runtime_imports_only_the_base_install_and_server_extra():
    groups = declared()
    allowed = groups[""].union(*(groups[extra] for extra in RUNTIME_EXTRAS))
    runtime = [pkg for pkg in all_packages() if pkg == RUNTIME_PACKAGE or pkg.startswith(RUNTIME_PACKAGE + ".")]
    stray = {dist: sorted(files) for dist, files in distributions_imported(runtime).items() if dist not in allowed}
    assert runtime and not stray, f"kiln.runtime imports beyond the base install and {RUNTIME_EXTRAS}: {stray}"


def test_every_declared_distribution_is_imported():
    imported = set(distributions_imported(all_packages()))
    unused = {group: sorted(reqs - imported) for group, reqs in declared().items()
              if group not in TOOL_EXTRAS and reqs - imported}
    assert not unused, f"declared in pyproject.toml but imported by no shipped module: {unused}"
