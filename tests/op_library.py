"""The compiled kiln op library for tests that run its kernels, or a module-level skip saying why it is missing."""

from __future__ import annotations

import pytest


def op_library_or_skip() -> str:
    """libkiln_ops.so's path; skips the calling test module when the library is absent."""
    ops = pytest.importorskip("kiln.runtime.ops")
    try:
        return ops.library_path()
    except ops.OpLibraryError as exc:  # pragma: no cover - the install builds it
        pytest.skip(str(exc), allow_module_level=True)
