"""The unit tier builds no engine: the engine fixtures fail here instead of building one."""

from __future__ import annotations

import pytest

# TRITON_INTERPRET=1 (the Triton kernels in Triton's CPU interpreter) is set by tests/conftest.py;
# test_triton_aot.py compiles in a subprocess without it.


def _no_engine_here():
    pytest.fail("tests/unit/ builds no engine; a test that needs one belongs in tests/engine/")


@pytest.fixture
def tiny_engine():
    _no_engine_here()


@pytest.fixture
def smollm2_engine():
    _no_engine_here()
