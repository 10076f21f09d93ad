"""Pipeline stages without an engine: the layer ranges a stage count gives, the manifest's `stages` (absent:
one graph; inconsistent: one sentence naming why), and the per-stage figures /metrics exports."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kiln.errors import KilnError
from kiln.manifest import MANIFEST_NAME, BuildOptions, EngineLoadError, Manifest, read_manifest, write_manifest
from kiln.pipeline_stages import PipelineStage, stage_layer_ranges
from kiln.spec import ModelSpec

SPEC = ModelSpec(family="llama", vocab_size=320, hidden_size=64, intermediate_size=128, num_layers=5, num_heads=4,
                 num_kv_heads=2, head_dim=16, rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=512,
                 tie_word_embeddings=True, eos_token_ids=(2,))
STAGES = (PipelineStage("stage0.onnx", 0, 3), PipelineStage("stage1.onnx", 3, 5))


def test_layer_ranges_are_contiguous_and_balanced():
    assert stage_layer_ranges(30, 3) == [range(0, 10), range(10, 20), range(20, 30)]
    assert stage_layer_ranges(5, 2) == [range(0, 3), range(3, 5)]
    assert stage_layer_ranges(4, 4) == [range(i, i + 1) for i in range(4)]
    with pytest.raises(KilnError, match="3 pipeline stages are more than the model's 2 layers; each stage needs at "
                                        "least one layer"):
        stage_layer_ranges(2, 3)
    with pytest.raises(KilnError, match="at least 1, got 0"):
        stage_layer_ranges(2, 0)


def _engine(tmp_path, stages=STAGES, count=2):
    graphs = [s.graph for s in stages] or ["model.onnx"]
    for name in [*graphs, *(f"{g}.data" for g in graphs), "tokenizer.json"]:
        (tmp_path / name).write_bytes(b"x")
    manifest = Manifest(spec=SPEC, build=BuildOptions(max_seq_len=512, pipeline_stages=count),
                        backend="onnxruntime-cpu", graph_inputs=("input_ids",), graph_outputs=("logits",),
                        stages=stages)
    write_manifest(tmp_path, manifest)
    return tmp_path


def test_a_staged_manifest_reads_back_and_a_one_graph_manifest_has_no_stages(tmp_path):
    (tmp_path / "staged").mkdir()
    staged = read_manifest(_engine(tmp_path / "staged"))
    assert staged.stages == STAGES and staged.graph_files == ("stage0.onnx", "stage1.onnx")
    one_dir = tmp_path / "one"
    one_dir.mkdir()
    one = read_manifest(_engine(one_dir, stages=(), count=1))
    assert one.stages == () and one.graph_files == ("model.onnx",)
    assert "stages" not in json.loads((one_dir / MANIFEST_NAME).read_text())


@pytest.mark.parametrize("stages, message", [
    ([{"graph": "stage0.onnx", "first_layer": 0, "end_layer": 2}, {"graph": "stage1.onnx", "first_layer": 3,
                                                                   "end_layer": 5}],
     "field stages is inconsistent: pipeline stage stage1.onnx starts at layer 3, not at layer 2"),
    ([{"graph": "stage0.onnx", "first_layer": 0, "end_layer": 3}, {"graph": "stage1.onnx", "first_layer": 3,
                                                                   "end_layer": 4}],
     "the pipeline stages end at layer 4, but the model has 5 layers"),
    ([{"graph": "stage0.onnx", "first_layer": 0, "end_layer": 5}], "lists 1 stages, but build.pipeline_stages is 2"),
    ([{"graph": "stage0.onnx", "first_layer": 0}], "stages\\[0\\].end_layer"),
])
def test_inconsistent_stages_are_one_sentence(tmp_path, stages, message):
    engine = _engine(tmp_path)
    data = json.loads((engine / MANIFEST_NAME).read_text())
    data["stages"] = stages
    (engine / MANIFEST_NAME).write_text(json.dumps(data))
    with pytest.raises(EngineLoadError, match=message):
        read_manifest(engine)


def test_metrics_export_each_stage_time_and_the_bytes_handed_on():
    from prometheus_client import CollectorRegistry, generate_latest

    from kiln.runtime.outputs import EngineStats, StageTotals
    from kiln.runtime.server.metrics import _EngineCollector

    def scrape(stats: EngineStats) -> str:
        registry = CollectorRegistry()
        registry.register(_EngineCollector(lambda: stats))
        return generate_latest(registry).decode()

    text = scrape(EngineStats(pipeline=StageTotals((1.5, 2.25), 4608, 2, (300 << 20, 200 << 20), 1)))
    assert 'kiln_pipeline_stage_resident_bytes{stage="1"} 2.097152e+08' in text
    assert "kiln_pipeline_stage_restarts_total 1.0" in text
    assert 'kiln_pipeline_stage_seconds_total{stage="0"} 1.5' in text
    assert 'kiln_pipeline_stage_seconds_total{stage="1"} 2.25' in text
    assert "kiln_pipeline_bytes_moved_total 4608.0" in text and "kiln_pipeline_tokens_total 2.0" in text
    assert "kiln_pipeline" not in scrape(EngineStats())


def test_replicas_stage_totals_sum_stage_by_stage():
    """A cluster's /metrics sums its replicas' EngineStats field by field, the pipeline totals included."""
    from kiln.runtime.outputs import StageTotals

    total = StageTotals() + StageTotals((1.0, 2.0), 100, 3, (10, 20), 1) + StageTotals((0.5, 0.25), 50, 1, (5, 6))
    assert total == StageTotals((1.5, 2.25), 150, 4, (15, 26), 1)
    assert StageTotals() + StageTotals() == StageTotals()


def test_a_stage_memory_cap_needs_stages_in_their_own_processes():
    from kiln.errors import InvalidParamError
    from kiln.runtime.params import RuntimeConfig

    assert RuntimeConfig(pipeline_parallel=2, stage_memory_bytes=1 << 30).stage_memory_bytes == 1 << 30
    with pytest.raises(InvalidParamError, match="stage_memory_bytes must be > 0, and only with pipeline_parallel > 1"):
        RuntimeConfig(stage_memory_bytes=1 << 30)


def test_memory_growth_cap_refuses_what_passes_it():
    """limit_memory_growth in a child process (the cap cannot be lifted): 32 MiB more fits, 96 MiB more does not."""
    code = ("from kiln.runtime.pipeline.memory import limit_memory_growth\n"
            "limit_memory_growth(64 << 20)\n"
            "a = bytearray(32 << 20)\n"
            "try:\n    b = bytearray(96 << 20)\nexcept MemoryError:\n    print('refused')\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.stdout.strip() == "refused", done.stderr
