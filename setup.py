"""Build hook: compile the kiln custom-op library (libkiln_ops.so) during `pip install`.

All metadata lives in pyproject.toml. build_py compiles runtime/ops/*.cc with g++ (see
runtime/ops/build_ops.py for where ONNX Runtime's headers come from): into the source tree
for an editable install (only when a source is newer), into the build lib for a wheel.
"""

import importlib.util
from pathlib import Path

from setuptools import Distribution, setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent


def _build_ops():
    spec = importlib.util.spec_from_file_location("kiln_build_ops", ROOT / "runtime" / "ops" / "build_ops.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class BuildPyWithOps(build_py):
    def run(self):
        super().run()
        ops = _build_ops()
        if getattr(self, "editable_mode", False):
            target = ROOT / "runtime" / "ops" / ops.LIBRARY_NAME
            if not ops.is_stale(target):
                return
        else:
            target = Path(self.build_lib) / "kiln" / "runtime" / "ops" / ops.LIBRARY_NAME
        try:
            ops.build(target)
        except ops.BuildError as exc:
            raise SystemExit(f"kiln: cannot build {ops.LIBRARY_NAME}: {exc}") from exc


class BinaryDistribution(Distribution):
    """The wheel carries a compiled library: tag it for this platform."""

    def has_ext_modules(self):
        return True


setup(cmdclass={"build_py": BuildPyWithOps}, distclass=BinaryDistribution)
