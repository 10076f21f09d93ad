"""The unit tier builds no engine: the engine fixtures fail here instead of building one."""

from __future__ import annotations

import os

import pytest

# The Triton kernels run in Triton's CPU interpreter in this tier, and @triton.jit reads this once, when a kernel
# module is first imported: set before any test module imports kiln.plugins_trt (test_triton_aot.py compiles
# in a subprocess without it).
os.environ["TRITON_INTERPRET"] = "1"


def _no_engine_here():
    pytest.fail("tests/unit/ builds no engine; a test that needs one belongs in tests/engine/")


@pytest.fixture
def tiny_engine():
    _no_engine_here()


@pytest.fixture
def smollm2_engine():
    _no_engine_here()
