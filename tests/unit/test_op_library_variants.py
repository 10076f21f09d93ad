"""The op library's per-ISA copies (build_ops.VARIANTS): which one library_path() loads for a CPU's flags and
$KILN_OPS_ISA, that each copy this CPU runs says what it was built for, and that the AVX-512 VNNI copy computes
kiln.MatMulQ4_1 and kiln.SwiGLU bit for bit as the AVX2 one (its Q4_1 dot is vpdpbusd, the same integer sums)."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

from kiln.matmul_q4_1 import make_single_op_model as q4_1_model
from kiln.optimize.quant.rtn import quantize_q4_1
from kiln.runtime import ops
from kiln.swiglu import make_single_op_model as swiglu_model

ort = pytest.importorskip("onnxruntime")

VNNI_FLAGS = frozenset({"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni"})
AVX2_FLAGS = frozenset({"avx2", "fma", "f16c", "avx512f"})
AMX_FLAGS = VNNI_FLAGS | {"amx_tile", "amx_int8", "amx_bf16"}


def runnable() -> list[str]:
    return ops.supported_variants(ops.cpu_flags())


def test_the_best_variant_the_flags_allow(monkeypatch):
    monkeypatch.delenv(ops.ISA_ENV, raising=False)
    assert ops.library_variant(VNNI_FLAGS) == "avx512vnni"
    assert ops.library_variant(AVX2_FLAGS) == "avx2"
    assert ops.supported_variants(None) == ["avx2"]  # flags unknown: the baseline
    assert ops.supported_variants(VNNI_FLAGS) == ["avx512vnni", "avx2"]
    assert ops.library_variant(AMX_FLAGS) == "amx"
    assert ops.library_path("amx") == ops.library_path("avx512vnni")  # the same library, its tiles allowed


def test_the_environment_chooses_and_names_what_is_missing(monkeypatch):
    monkeypatch.setenv(ops.ISA_ENV, "avx2")
    assert ops.library_variant(VNNI_FLAGS) == "avx2"
    monkeypatch.setenv(ops.ISA_ENV, "auto")
    assert ops.library_variant(VNNI_FLAGS) == "avx512vnni"
    monkeypatch.setenv(ops.ISA_ENV, "avx512vnni")
    with pytest.raises(ops.OpLibraryError, match="this CPU lacks avx512_vnni, avx512bw, avx512vl"):
        ops.library_variant(AVX2_FLAGS)
    monkeypatch.setenv(ops.ISA_ENV, "sse2")
    with pytest.raises(ops.OpLibraryError, match="'sse2' is not a library variant; choose one of auto, amx, avx512"):
        ops.library_variant(VNNI_FLAGS)


def test_cpu_flags_reads_the_flags_line(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nmodel name\t: X\nflags\t\t: fpu avx2 avx512_vnni\n\nprocessor\t: 1\n")
    assert ops.cpu_flags(str(info)) == frozenset({"fpu", "avx2", "avx512_vnni"})
    assert ops.cpu_flags(str(tmp_path / "absent")) is None
    assert ops.cpuinfo_field("model name", str(info)) == "X"
    assert ops.cpuinfo_field("microcode", str(info)) is None


@pytest.mark.parametrize("variant", list(ops.LIBRARY_VARIANTS))
def test_each_runnable_copy_says_what_it_was_built_for(variant):
    if variant not in runnable():
        pytest.skip(f"this CPU does not run the {variant} library")
    lib = ctypes.CDLL(ops.library_path(variant))
    lib.kiln_ops_isa.restype = ctypes.c_char_p
    assert lib.kiln_ops_isa().decode() == ops.library_build(variant)
    assert lib.kiln_ops_abi_version() == ops.check_abi()


def outputs(library: str, model, feeds: dict[str, np.ndarray]) -> np.ndarray:
    so = ort.SessionOptions()
    so.register_custom_ops_library(library)
    so.intra_op_num_threads = 2
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"]).run(None, feeds)[0]


@pytest.mark.skipif("avx512vnni" not in runnable(), reason="this CPU has no AVX-512 VNNI")
# one row (decode tiles), passes of up to 6 (AVX2) or 12 (VNNI) rows, more than one work item of rows (32)
@pytest.mark.parametrize("t", [1, 3, 8, 16, 24, 32, 37])
def test_vnni_copy_matches_the_avx2_copy(t):
    """Engines run on either copy, bit for bit alike: MatMulQ4_1's int32 dots are the same (vpdpbusd against
    maddubs + madd) and both copies scale and sum a channel's blocks in the same order, 16 or 8 channels a
    vector; SwiGLU is the same code."""
    rng = np.random.default_rng(t)
    k, n = 576, 100  # SmolLM2's hidden size; 100 channels: 6 whole groups of 16 and a ragged last one
    x = rng.standard_normal((t, k)).astype(np.float32)
    x[:, 5] *= 30  # an outlier: int8 activations at full range
    weights = quantize_q4_1((rng.standard_normal((n, k)) * 0.05).astype(np.float32))
    model = q4_1_model(weights, bias=rng.standard_normal(n).astype(np.float32))
    base, vnni = (outputs(ops.library_path(v), model, {"x": x}) for v in ("avx2", "avx512vnni"))
    np.testing.assert_array_equal(vnni, base)
    gate_up = rng.standard_normal((t, 2 * 1536)).astype(np.float32)
    base, vnni = (outputs(ops.library_path(v), swiglu_model(), {"x": gate_up}) for v in ("avx2", "avx512vnni"))
    np.testing.assert_array_equal(vnni, base)


def test_the_library_is_stale_until_every_copy_is_built(tmp_path):
    from kiln.runtime.ops import build_ops

    base = tmp_path / build_ops.LIBRARY_NAME
    assert build_ops.is_stale(base)
    base.touch()
    assert build_ops.is_stale(base)  # the VNNI copy is missing
    build_ops.variant_path(base, "avx512vnni").touch()
    assert not build_ops.is_stale(base)


def test_a_failed_compile_names_the_copies_and_leaves_nothing(tmp_path, monkeypatch):
    from kiln.runtime.ops import build_ops

    monkeypatch.setenv("CXX", "false")  # a "compiler" that exits 1
    with pytest.raises(build_ops.BuildError, match=r"failed: avx2 \(exit 1\), avx512vnni \(exit 1\)"):
        build_ops.build(tmp_path / build_ops.LIBRARY_NAME, include=tmp_path, verbose=False)
    assert list(tmp_path.iterdir()) == []


def test_a_library_without_the_runtime_routines_is_refused_at_load(monkeypatch):
    """The sampler's C routines are outside the engines' op ABI: a library built before one of them (today's
    threaded sampler, say) must be refused by name when an engine loads, not crash the first sampled step."""
    assert ops.check_abi() == ops.OP_LIBRARY_ABI  # this install's library has every routine
    monkeypatch.setattr(ops, "_RUNTIME_SYMBOLS", (*ops._RUNTIME_SYMBOLS, "kiln_a_routine_from_the_future"))
    with pytest.raises(ops.OpLibraryError, match="lacks kiln_a_routine_from_the_future .*rebuild it"):
        ops.check_abi()
