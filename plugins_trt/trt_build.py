"""The TensorRT plan of an engine directory: model.onnx (lowered by `kiln build --backend tensorrt`) -> model.plan.

    python -m kiln.plugins_trt.trt_build ENGINE_DIR     (on the GPU machine that will serve it)

`kiln build --backend tensorrt` calls build_plan itself where tensorrt is importable; elsewhere it writes the
lowered graph and the manifest only, and this command adds the plan later (a plan is specific to one GPU
architecture and TensorRT version anyway, which the manifest then records and the runtime checks).

One optimization profile covers every step the runtime sends: 1..max_num_tokens tokens, 1..max_num_tokens
sequences (each has at least one token), block tables up to max_seq_len / block_size wide, and pools of up to
MAX_POOL_BLOCKS blocks (the runtime sizes the pool at load time; the pool is bound, never reshaped, so a large
bound costs no memory). The network is strongly typed: the ONNX types are the engine's types.

NOT RUN HERE: TensorRT cannot be installed on the machine this was written on (docs/design.md).
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path
from typing import Any

from kiln import contract
from kiln.errors import KilnError
from kiln.manifest import MANIFEST_NAME, Manifest, TensorRTPlan, read_manifest, write_manifest

PLAN_FILE = "model.plan"
MAX_POOL_BLOCKS = 1 << 20


def profile_shapes(manifest: Manifest) -> dict[str, tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]]:
    """(min, opt, max) shape of every graph input, from the manifest's build options and model."""
    build, spec = manifest.build, manifest.spec
    tokens, width = build.max_num_tokens, -(-manifest.max_seq_len // build.block_size)
    pool = (spec.num_kv_heads, build.block_size, spec.head_dim)
    opt_tokens = min(tokens, 256)
    shapes = {
        contract.INPUT_IDS: ((1,), (opt_tokens,), (tokens,)),
        contract.POSITION_IDS: ((1,), (opt_tokens,), (tokens,)),
        contract.QUERY_START_LOC: ((2,), (65,), (tokens + 1,)),
        contract.SEQ_LENS: ((1,), (64,), (tokens,)),
        contract.BLOCK_TABLES: ((1, 1), (64, width), (tokens, width)),
        contract.LOGITS_INDICES: ((1,), (64,), (tokens,)),
    }
    for layer in range(spec.num_layers):
        shapes[contract.kv_cache_input(layer)] = ((1, 2, *pool), (4096, 2, *pool), (MAX_POOL_BLOCKS, 2, *pool))
    return shapes


def build_plan(engine_dir: Path, manifest: Manifest, log: Any = print) -> tuple[bytes, TensorRTPlan]:
    """The serialized plan of engine_dir/model.onnx for this machine's GPU, and what the manifest records."""
    import tensorrt as trt

    import kiln.plugins_trt.trt_plugin  # noqa: F401 - registers kiln::PagedKvWrite and kiln::PagedAttention

    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    network = builder.create_network(1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED))
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(engine_dir / "model.onnx")):
        errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise KilnError(f"TensorRT's ONNX parser refused {engine_dir / 'model.onnx'}: {errors}")
    config = builder.create_builder_config()
    config.set_preview_feature(trt.PreviewFeature.ALIASED_PLUGIN_IO_10_03, True)  # the in-place KV write
    profile = builder.create_optimization_profile()
    for name, (low, opt, high) in profile_shapes(manifest).items():
        profile.set_shape(name, low, opt, high)
    config.add_optimization_profile(profile)
    log(f"building the TensorRT {trt.__version__} plan (minutes) ...")
    plan = builder.build_serialized_network(network, config)
    if plan is None:
        raise KilnError("TensorRT could not build a plan of the engine graph (its log above says why)")
    from cuda.bindings import runtime as cudart

    _, props = cudart.cudaGetDeviceProperties(0)
    return bytes(plan), TensorRTPlan(trt.__version__, f"{props.major}.{props.minor}")


def add_plan(engine_dir: Path, log: Any = print) -> Manifest:
    """Build engine_dir's plan, write it beside the graph and re-checksum the manifest with its TensorRT info."""
    manifest = read_manifest(engine_dir)
    if manifest.backend != "tensorrt":
        raise KilnError(f"{engine_dir} is a {manifest.backend!r} engine; rebuild it with --backend tensorrt")
    plan, info = build_plan(engine_dir, manifest, log)
    (engine_dir / PLAN_FILE).write_bytes(plan)
    log(f"{engine_dir / PLAN_FILE}: {len(plan) / 2**20:.1f} MiB for sm {info.compute_capability}")
    return write_manifest(engine_dir, dataclasses.replace(manifest, tensorrt=info))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("engine_dir", type=Path, help=f"an engine directory with a tensorrt {MANIFEST_NAME}")
    add_plan(parser.parse_args(argv).engine_dir)


if __name__ == "__main__":
    main()
