"""Gemma 3's image side without an engine: kiln's numpy/Pillow preprocessing against transformers'
Gemma3ImageProcessor (PIL backend) on images of odd sizes and modes, each step shown to matter; the processor
config's refusals; and the scheduler keeping a bidirectional image run in one step (a chunk never ends inside it;
chunks around it, prefix-cache hits inside it and preemption keep the rule) while other images' runs are cut freely."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from gemma3_vision_fixtures import IMAGE_SIZE, PROCESSOR
from vision_fixtures import sample_images

from kiln.runtime.block_manager import BlockManager
from kiln.runtime.model_runner import build_batch
from kiln.runtime.params import SamplingParams
from kiln.runtime.scheduler import Scheduler
from kiln.runtime.sequence import Sequence
from kiln.runtime.vision.gemma3 import Gemma3ImageConfig, pixel_values
from kiln.runtime.vision.prompt import ImageSpan

STEPS = ("do_convert_rgb", "do_resize", "do_rescale", "do_normalize")


@pytest.fixture(scope="module")
def hf_pixels():
    pytest.importorskip("transformers")
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    processor = Gemma3ImageProcessorPil(**{k: v for k, v in PROCESSOR.items() if k != "image_processor_type"})
    return {name: processor(image, return_tensors="np")["pixel_values"][0] for name, image in sample_images().items()}


@pytest.mark.parametrize("name", list(sample_images()))
def test_pixel_values_equal_transformers(name, hf_pixels):
    ours = pixel_values(sample_images()[name], Gemma3ImageConfig.from_hf(PROCESSOR))
    assert ours.dtype == np.float32 and ours.shape == (3, IMAGE_SIZE, IMAGE_SIZE)
    np.testing.assert_allclose(ours, hf_pixels[name], rtol=0, atol=1e-5)


@pytest.mark.parametrize("change", [*({step: False} for step in STEPS), {"resample": 3}])
def test_each_step_matters(change, hf_pixels):
    config = dataclasses.replace(Gemma3ImageConfig.from_hf(PROCESSOR), **change)
    differs = []
    for name, image in sample_images().items():
        try:
            ours = pixel_values(image, config)
        except ValueError:  # e.g. 4 channels against 3 means without do_convert_rgb
            differs.append(True)
            continue
        differs.append(ours.shape != hf_pixels[name].shape or not np.allclose(ours, hf_pixels[name], atol=1e-5))
    assert any(differs), f"{change} changed no image's pixel values"


def test_bad_configs_are_named():
    with pytest.raises(ValueError, match="must be a square"):
        Gemma3ImageConfig.from_hf({**PROCESSOR, "size": {"height": 64, "width": 32}})
    with pytest.raises(ValueError, match="pan-and-scan"):
        Gemma3ImageConfig.from_hf({**PROCESSOR, "do_pan_and_scan": True})


P = SamplingParams(temperature=0)


def image_seq(length: int, run: tuple[int, int], bidirectional: bool = True, first: int = 1) -> Sequence:
    span = ImageSpan(run[0], np.zeros((run[1] - run[0], 2), np.float32), key=5, bidirectional=bidirectional)
    return Sequence(list(range(first, first + length)), P, images=(span,))


def chunks(s: Scheduler, seq: Sequence) -> list[int]:
    """Chunk sizes of seq's prefill, packing every step (which refuses a chunk cutting a bidirectional run)."""
    sizes = []
    while seq.num_computed_tokens < seq.num_prompt_tokens:
        out = s.schedule()
        assert out, "nothing scheduled"
        build_batch(out)
        sizes += [n for q, n in out.scheduled if q is seq]
        s.update(out)
        for q in out.to_sample:
            q.append(7)
        s.bm.check()
    return sizes


def test_a_chunk_stops_before_the_run_and_takes_it_whole():
    s = Scheduler(BlockManager(32, 4), 4, 8)
    seq = image_seq(20, (5, 11))
    s.add(seq)
    assert chunks(s, seq) == [5, 8, 7]  # 8 would end at 8, inside [5, 11)
    s.finish(seq, "stop")
    cut = image_seq(20, (5, 11), bidirectional=False, first=100)  # causal runs are cut anywhere
    s.add(cut)
    assert chunks(s, cut) == [8, 8, 4]


def test_a_run_waits_while_decodes_leave_too_little_budget():
    s = Scheduler(BlockManager(32, 4), 4, 8)
    short = Sequence([1, 2, 3], P)
    s.add(short)
    out = s.schedule()
    s.update(out)
    short.append(7)
    seq = image_seq(12, (0, 8), first=50)
    s.add(seq)
    out = s.schedule()  # one decode takes 1 of 8: the 8-token run does not fit and waits
    assert [(q is seq, n) for q, n in out.scheduled] == [(False, 1)]
    s.update(out)
    s.finish(short, "abort")
    assert chunks(s, seq) == [8, 4]


def test_a_cached_prefix_inside_the_run_is_resumed_from():
    """The cached blocks inside a run were computed with the whole run in view (the same image, the same tokens),
    so a chunk may start inside it; it must still reach the run's end."""
    s = Scheduler(BlockManager(32, 4), 4, 16)
    first = image_seq(14, (2, 13))
    s.add(first)
    assert chunks(s, first) == [14]
    s.finish(first, "stop")
    again = image_seq(14, (2, 13))  # same tokens, same image: blocks 0-2 (positions 0-11) hit
    s.max_num_tokens = 1
    s.add(again)
    sizes = chunks(s, again)
    assert again.num_cached_tokens == 12 and sizes == [1, 1]


def test_preemption_recomputes_with_whole_runs():
    """Two image prompts in a pool too small for both as they decode: preempted and resumed (from their cached
    blocks), no step's chunk ever cuts a run."""
    s = Scheduler(BlockManager(5, 4), 4, 8)
    a, b = image_seq(10, (2, 8), first=1), image_seq(10, (1, 7), first=40)
    s.add(a)
    s.add(b)
    for _ in range(40):
        out = s.schedule()
        if out:
            build_batch(out)  # raises if a chunk cuts a run
        s.update(out)
        for q in out.to_sample:
            q.append(7)
            if q.num_output_tokens == 4:
                s.finish(q, "length")
        s.bm.check()
        if a.is_finished and b.is_finished:
            break
    assert a.is_finished and b.is_finished and s.num_preemptions >= 1


@pytest.mark.parametrize("tower", ["vision_tower.vision_model.", "vision_tower.", "model.vision_tower.vision_model."])
def test_weights_load_under_every_saved_name(tower):
    """The hub's checkpoints (vision_tower.vision_model.*), transformers 5's (vision_tower.*) and in-memory names."""
    pytest.importorskip("torch")
    from kiln.export.checkpoint_types import LazyWeights
    from kiln.export.vision.gemma3_config import vision_part

    projector = "model.multi_modal_projector." if tower.startswith("model.") else "multi_modal_projector."
    names = [tower + "post_layernorm.weight", projector + "mm_input_projection_weight",
             "language_model.model.norm.weight", "lm_head.weight"]
    kept = vision_part(LazyWeights(dict.fromkeys(names)))
    assert sorted(kept) == ["projector.mm_input_projection_weight", "tower.post_layernorm.weight"]


def test_bad_tower_shapes_are_named():
    pytest.importorskip("torch")
    from kiln.export.vision.gemma3_config import gemma3_tower_spec

    config = {"vision_config": {"image_size": 64, "patch_size": 4}, "mm_tokens_per_image": 9,
              "text_config": {"hidden_size": 8}}
    with pytest.raises(ValueError, match="do not average-pool to mm_tokens_per_image 9"):
        gemma3_tower_spec(config, PROCESSOR)
    with pytest.raises(ValueError, match="not the vision tower's image_size 32"):
        gemma3_tower_spec({**config, "vision_config": {"image_size": 32, "patch_size": 4}}, PROCESSOR)
    with pytest.raises(ValueError, match="pan-and-scan"):
        gemma3_tower_spec({**config, "mm_tokens_per_image": 16}, {**PROCESSOR, "do_pan_and_scan": True})


def test_a_checkpoint_without_its_image_processor_is_text_only(tmp_path):
    """Gemma3ForConditionalGeneration without preprocessor_config.json builds its text part, as before images."""
    pytest.importorskip("torch")
    import json

    from safetensors.numpy import save_file

    from kiln.export.vision.export_encoder import load_vision_of

    save_file({"vision_tower.post_layernorm.weight": np.ones(4, np.float32)}, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["Gemma3ForConditionalGeneration"],
                                                      "text_config": {"num_hidden_layers": 1}}))
    assert load_vision_of(tmp_path) is None


def test_the_default_step_budget_has_room_for_an_image_run_beside_decodes():
    from kiln.runtime.loader import room_for_image_runs
    from kiln.vision import VisionSpec

    gemma3 = VisionSpec(family="gemma3", image_token_id=1, tokens_per_image=256, embedding_size=8, image_size=896)
    assert room_for_image_runs(256, 2048, gemma3) == 512
    assert room_for_image_runs(256, 300, gemma3) == 300  # at most what the graph was built for
    assert room_for_image_runs(1024, 2048, gemma3) == 1024
    llava = VisionSpec(family="llava", image_token_id=1, tokens_per_image=576, embedding_size=8, image_size=336)
    assert room_for_image_runs(256, 2048, llava) == room_for_image_runs(256, 2048, None) == 256
