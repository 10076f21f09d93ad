"""LLaVA-1.5-7B's image side at its real shape (CLIP ViT-L/14-336 up to layer 23 + the 1024 -> 4096 -> 4096
projector; random weights at O(1) activations): kiln's encoder graph in ONNX Runtime against the same module in
torch eager, one 336 px image, rounds interleaved.

    .venv/bin/python benchmarks/bench_vision_encoder.py [--rounds 3] [--threads 2]

Builds export/vision/clip_encoder.py's module, exports it as `kiln build` does (into a temporary folder), checks
the two agree, then prints each round's seconds and the median ratio. Needs ~3 GiB of memory.
"""

from __future__ import annotations

import argparse
import io
import logging
import math
import statistics
import tempfile
import time
import warnings
from contextlib import redirect_stdout
from pathlib import Path

import numpy as np
import onnx_ir as ir
import onnxruntime as ort
import torch

from kiln.export.vision import clip_encoder
from kiln.export.vision.llava_config import ClipTowerSpec

LLAVA_15_7B = ClipTowerSpec(hidden_size=1024, intermediate_size=4096, num_heads=16, num_layers=23, image_size=336,
                            patch_size=14, num_channels=3, layer_norm_eps=1e-5, hidden_act="quick_gelu",
                            drop_cls=True, projector_act="gelu", projector_bias=True, text_hidden_size=4096)


def random_weights(spec: ClipTowerSpec) -> dict[str, torch.Tensor]:
    """Norms near 1, biases small, matrices at 1/sqrt(fan-in): activations stay O(1) through 23 layers."""
    gen = torch.Generator().manual_seed(0)
    with torch.device("meta"):  # the shapes only
        shapes = {f"tower.{k}": v.shape for k, v in clip_encoder._Tower(spec).state_dict().items()}
        shapes |= {f"projector.{k}": v.shape for k, v in clip_encoder._Projector(spec).state_dict().items()}
    weights = {}
    for name, shape in shapes.items():
        noise = torch.randn(shape, generator=gen)
        if "norm" in name and name.endswith("weight"):
            weights[name] = 1.0 + 0.1 * noise
        elif name.endswith("bias"):
            weights[name] = 0.1 * noise
        elif len(shape) >= 2 and "position" not in name:
            weights[name] = noise / math.sqrt(math.prod(shape[1:]))
        else:
            weights[name] = 0.5 * noise
    return weights


def export(model: torch.nn.Module, example: torch.Tensor, path: Path) -> None:
    logging.getLogger("torch.onnx").setLevel(logging.ERROR)
    with warnings.catch_warnings(), torch.no_grad(), redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")
        program = torch.onnx.export(model, (example,), input_names=["pixel_values"], output_names=["image_embeds"],
                                    dynamic_shapes={"pixel_values": {0: torch.export.Dim("images", min=1)}},
                                    dynamo=True, optimize=True)
    ir.save(program.model, path, external_data=path.name + ".data")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model = clip_encoder.ClipVisionEncoder(LLAVA_15_7B, random_weights(LLAVA_15_7B))
    image = torch.randn(1, 3, 336, 336)
    with tempfile.TemporaryDirectory() as folder:
        graph = Path(folder) / "vision.onnx"
        start = time.perf_counter()
        export(model, image, graph)
        print(f"export: {time.perf_counter() - start:.1f} s")
        options = ort.SessionOptions()
        options.intra_op_num_threads = args.threads
        session = ort.InferenceSession(str(graph), options, providers=["CPUExecutionProvider"])
        pixels = image.numpy()
        with torch.no_grad():
            difference = np.abs(session.run(None, {"pixel_values": pixels})[0] - model(image).numpy()).max()
        print(f"max |onnxruntime - torch|: {difference:.2e}")
        ours, eager = [], []
        for _ in range(args.rounds):
            start = time.perf_counter()
            session.run(None, {"pixel_values": pixels})
            ours.append(time.perf_counter() - start)
            start = time.perf_counter()
            with torch.no_grad():
                model(image)
            eager.append(time.perf_counter() - start)
    print("onnxruntime s:", " ".join(f"{t:.2f}" for t in ours), "| torch eager s:", " ".join(f"{t:.2f}" for t in eager))
    print(f"median: onnxruntime {statistics.median(ours):.2f} s, torch {statistics.median(eager):.2f} s, "
          f"torch / onnxruntime {statistics.median(eager) / statistics.median(ours):.2f}x")


if __name__ == "__main__":
    main()
