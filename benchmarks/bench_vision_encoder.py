"""LLaVA-1.5-7B's image side at its real shape (CLIP ViT-L/14-336 up to layer 23 + the 1024 -> 4096 -> 4096
projector; random weights at O(1) activations): kiln's encoder graphs in ONNX Runtime under each
`--vision-quantization` (and, for reference, int4 groups of 32, which kiln does not offer), one 336 px image,
rounds interleaved; with --eager the same module in torch eager too.

    .venv/bin/python benchmarks/bench_vision_encoder.py [--rounds 3] [--threads 2] [--eager]
                                                        [--tower clip-vit-l-336 | siglip-so400m-364]

--tower siglip-so400m-364 measures Idefics3-8B's image side instead (SigLIP-so400m on one 364 px tile + its
pixel-shuffle projector).

Builds export/vision/clip_encoder.py's module, exports and optimizes it as `kiln build` does
(optimize/vision_encoder.py; into a temporary folder, deleted after), checks float32 against torch, then prints
each graph's data bytes, its embeddings' error against float32's (relative Frobenius error, the smallest
per-token cosine), each round's seconds and the medians, beside the host's CPU and load average. Needs ~6 GiB of
memory and ~2 GiB of disk.
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

from kiln.export.vision import clip_encoder, siglip_encoder
from kiln.export.vision.idefics3_config import SiglipTowerSpec
from kiln.export.vision.llava_config import ClipTowerSpec
from kiln.optimize.quantize_int4 import quantize_int4
from kiln.optimize.vision_encoder import optimize_encoder
from kiln.vision import EncoderQuantization

LLAVA_15_7B = ClipTowerSpec(hidden_size=1024, intermediate_size=4096, num_heads=16, num_layers=23, image_size=336,
                            patch_size=14, num_channels=3, layer_norm_eps=1e-5, hidden_act="quick_gelu",
                            drop_cls=True, projector_act="gelu", projector_bias=True, text_hidden_size=4096)
# Idefics3-8B-Llama3's image side: SigLIP-so400m (27 layers, hidden 1152, MLP 4304: no multiple of 128) on 364 px
# tiles, pixel shuffle by 2 -> 169 tokens, projection 4608 -> 4096
IDEFICS3_8B = SiglipTowerSpec(hidden_size=1152, intermediate_size=4304, num_heads=16, num_layers=27, image_size=364,
                              patch_size=14, num_channels=3, layer_norm_eps=1e-6, hidden_act="gelu_pytorch_tanh",
                              scale_factor=2, text_hidden_size=4096)
TOWERS = {"clip-vit-l-336": (clip_encoder, LLAVA_15_7B), "siglip-so400m-364": (siglip_encoder, IDEFICS3_8B)}


def random_weights(module, spec: ClipTowerSpec | SiglipTowerSpec) -> dict[str, torch.Tensor]:
    """Norms near 1, biases small, matrices at 1/sqrt(fan-in): activations stay O(1) through every layer."""
    gen = torch.Generator().manual_seed(0)
    with torch.device("meta"):  # the shapes only
        shapes = {f"tower.{k}": v.shape for k, v in module._Tower(spec).state_dict().items()}
        shapes |= {f"projector.{k}": v.shape for k, v in module._Projector(spec).state_dict().items()}
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


def export(model: torch.nn.Module, example: torch.Tensor) -> ir.Model:
    logging.getLogger("torch.onnx").setLevel(logging.ERROR)
    with warnings.catch_warnings(), torch.no_grad(), redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")
        program = torch.onnx.export(model, (example,), input_names=["pixel_values"], output_names=["image_embeds"],
                                    dynamic_shapes={"pixel_values": {0: torch.export.Dim("images", min=1)}},
                                    dynamo=True, optimize=True)
    return program.model


def write_graphs(model: torch.nn.Module, image: torch.Tensor, folder: Path) -> dict[str, Path]:
    """The encoder graph as kiln builds it under each scheme, plus int4 (groups of 32, every linear) for
    comparison: name -> vision.onnx path."""
    graphs = {}
    for name in ("float32", "int8", "int8-weight-only", "int4-g32"):
        graph = export(model, image)
        if name == "int4-g32":
            optimize_encoder(graph, EncoderQuantization.FLOAT32)
            quantize_int4(graph, group_size=32, int4_lm_head=True)
        else:
            optimize_encoder(graph, EncoderQuantization(name))
        path = folder / name / "vision.onnx"
        path.parent.mkdir()
        ir.save(graph, path, external_data=path.name + ".data")
        graphs[name] = path
    return graphs


def host() -> str:
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), "unknown CPU")
    return f"{cpu}; load average {Path('/proc/loadavg').read_text().split()[:3]}"


def error(ours: np.ndarray, reference: np.ndarray) -> str:
    relative = np.linalg.norm(ours - reference) / np.linalg.norm(reference)
    cosine = (ours * reference).sum(-1) / (np.linalg.norm(ours, axis=-1) * np.linalg.norm(reference, axis=-1))
    return f"relative error {relative:.2e}, min token cosine {cosine.min():.5f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--eager", action="store_true", help="time torch eager too")
    parser.add_argument("--tower", choices=sorted(TOWERS), default="clip-vit-l-336")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    module, spec = TOWERS[args.tower]
    encoder = clip_encoder.ClipVisionEncoder if module is clip_encoder else siglip_encoder.SiglipVisionEncoder
    model = encoder(spec, random_weights(module, spec))
    image = torch.randn(1, 3, spec.image_size, spec.image_size)
    pixels = image.numpy()
    print(f"{args.tower}; {host()}")
    with tempfile.TemporaryDirectory() as folder:
        start = time.perf_counter()
        graphs = write_graphs(model, image, Path(folder))
        print(f"export + optimize ({len(graphs)} graphs): {time.perf_counter() - start:.1f} s")
        options = ort.SessionOptions()
        options.intra_op_num_threads = args.threads
        sessions = {name: ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
                    for name, path in graphs.items()}
        outputs = {name: session.run(None, {"pixel_values": pixels})[0] for name, session in sessions.items()}
        with torch.no_grad():
            eager_out = model(image).numpy()
        print(f"float32: max |onnxruntime - torch| {np.abs(outputs['float32'] - eager_out).max():.2e}")
        for name, path in graphs.items():
            data = path.with_name(path.name + ".data").stat().st_size
            print(f"{name}: vision.onnx.data {data / 2**20:.0f} MiB"
                  + ("" if name == "float32" else f"; against float32: {error(outputs[name], outputs['float32'])}"))
        times: dict[str, list[float]] = {name: [] for name in [*sessions, *(["torch eager"] if args.eager else [])]}
        for _ in range(args.rounds):
            for name, session in sessions.items():
                start = time.perf_counter()
                session.run(None, {"pixel_values": pixels})
                times[name].append(time.perf_counter() - start)
            if args.eager:
                start = time.perf_counter()
                with torch.no_grad():
                    model(image)
                times["torch eager"].append(time.perf_counter() - start)
    for name, seconds in times.items():
        print(f"{name} s: {' '.join(f'{t:.2f}' for t in seconds)}  median {statistics.median(seconds):.2f}")
    base = statistics.median(times["float32"])
    print("median time / float32's: " + ", ".join(f"{name} {statistics.median(t) / base:.2f}x"
                                                    for name, t in times.items() if name != "float32"))
    print(host())


if __name__ == "__main__":
    main()
