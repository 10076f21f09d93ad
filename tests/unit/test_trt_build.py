"""The TensorRT backend's parts that run without TensorRT: the plugins' launch arithmetic (trt_launch.py, which
trt_plugin.py evaluates on TensorRT's symbolic shapes), the plan's optimization profile, the build's refusals and
the one-sentence errors where tensorrt is missing. The plugins and the plan build themselves have not run here
(no TensorRT can be installed); docs/design.md lists the commands that verify them on a GPU machine."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest

from kiln.manifest import BuildOptions
from kiln.optimize.build import BuildError, build_engine
from kiln.quant_scheme import QuantScheme
from kiln.runtime.model_runner import BatchInput
from tests.unit.test_manifest import SPEC

pytest.importorskip("triton")

from kiln.plugins_trt.aot import KernelShape  # noqa: E402
from kiln.plugins_trt.plan import AttentionPlan  # noqa: E402
from kiln.plugins_trt.trt_launch import attention_launch, kv_write_launch, trt_attention_plan  # noqa: E402


def scalar_names(signature: dict[str, str]) -> list[str]:
    return [name for name, kind in signature.items() if kind == "i32"]


def test_launches_match_the_torch_launcher_and_the_kernel_signatures():
    shape = KernelShape()  # SmolLM2: 9 / 3 heads x 64
    attention = attention_launch(shape, num_tokens=37, num_seqs=5, table_width=8)
    plan = trt_attention_plan(9, 3)
    assert plan == AttentionPlan(block_q=16, group_pad=4, tile=64)
    assert attention.grid == plan.grid(37, 5, 3) == (7, 3, 1)
    # TensorRT passes these between the inputs and the outputs, in this order: the kernel's i32 parameters
    assert scalar_names(attention.spec.signature) == ["num_seqs", "block_table_stride"]
    assert attention.scalars == (5, 8) and attention.spec.constexprs["SCALE"] == 0.125
    write = kv_write_launch(shape, num_tokens=37, num_seqs=5, num_blocks=100, table_width=8)
    assert write.grid == (37, 1, 1) and write.scalars == (5, 100, 8)
    assert scalar_names(write.spec.signature) == ["num_seqs", "num_blocks", "block_table_stride"]
    assert list(write.spec.signature)[-1] == "kv_cache_out_ptr"  # the aliased output comes last


def test_profile_covers_every_graph_input():
    from kiln import contract
    from kiln.manifest import Manifest
    from kiln.plugins_trt.trt_build import profile_shapes

    inputs = (*BatchInput.FEEDS, *(contract.kv_cache_input(i) for i in range(SPEC.num_layers)))
    manifest = Manifest(spec=SPEC, build=BuildOptions(max_seq_len=512), backend="tensorrt", graph_inputs=inputs,
                        graph_outputs=("logits",))
    shapes = profile_shapes(manifest)
    assert set(shapes) == set(manifest.graph_inputs)
    for name, (low, opt, high) in shapes.items():
        assert len(low) == len(opt) == len(high), name
        assert all(a <= b <= c for a, b, c in zip(low, opt, high, strict=True)), name
    tokens = manifest.build.max_num_tokens
    assert shapes["input_ids"][2] == (tokens,) and shapes["query_start_loc"][2] == (tokens + 1,)
    assert shapes["block_tables"][2] == (tokens, 512 // 16) and shapes["kv_cache.1"][0] == (1, 2, 2, 16, 16)


def test_tensorrt_build_refuses_quantized_weights_before_any_work(tmp_path):
    options = BuildOptions(quantization=QuantScheme.parse("int8-weight-only"))
    with pytest.raises(BuildError, match="--backend tensorrt serves float weights"):
        build_engine("no-such-model", tmp_path / "engine", options, backend="tensorrt")


@pytest.mark.skipif(importlib.util.find_spec("tensorrt") is not None, reason="tensorrt is installed")
def test_plugins_without_tensorrt_say_so_in_one_sentence():
    result = subprocess.run([sys.executable, "-c", "import kiln.plugins_trt.trt_plugin"], capture_output=True,
                            text=True, timeout=60)
    assert result.returncode != 0
    assert "kiln's TensorRT plugins need the tensorrt package (TensorRT 10.8 or newer" in result.stderr


def test_the_runtime_refuses_a_tensorrt_engine_it_cannot_serve_in_one_sentence():
    from kiln.manifest import EngineLoadError, Manifest, TensorRTPlan
    from kiln.runtime.loader import check_backend
    from kiln.runtime.trt_runner import check_plan

    if importlib.util.find_spec("tensorrt") is None:
        with pytest.raises(EngineLoadError, match=r"backend 'tensorrt' is not available in this runtime: serving it "
                                                  r"needs a CUDA GPU with TensorRT 10 and cuda-python, and tensorrt"):
            check_backend("tensorrt")
    with pytest.raises(EngineLoadError, match="backend 'onnx-gpu' is not available"):
        check_backend("onnx-gpu")
    manifest = Manifest(spec=SPEC, build=BuildOptions(max_seq_len=512), backend="tensorrt", graph_inputs=(),
                        graph_outputs=())
    with pytest.raises(EngineLoadError, match="no TensorRT plan: build it on this GPU machine with"):
        check_plan(manifest, "10.13.0", "9.0")
    built = Manifest(**{**manifest.__dict__, "tensorrt": TensorRTPlan("10.13.0", "9.0")})
    check_plan(built, "10.13.0", "9.0")
    with pytest.raises(EngineLoadError, match="built with TensorRT 10.13.0, but this machine has TensorRT 10.9.0"):
        check_plan(built, "10.9.0", "9.0")
    with pytest.raises(EngineLoadError, match="built for GPU architecture sm 9.0, but this GPU is sm 8.0"):
        check_plan(built, "10.13.0", "8.0")
