"""Copy a one-graph engine with kiln.MatMulQ4_1's weights, kiln.MoE's Q4_1 experts and kiln.MatMulGGUF's Q4_K
weights unpacked from records into blocks (the layouts engines held before records: the Q4_1 kernels pack them into
anonymous memory at session load, kiln.MatMulGGUF runs the file's blocks with its blocks kernel), to measure both
ways on the same weights with one op library.

    .venv/bin/python benchmarks/scale/blocks_engine.py ENGINE OUT [--experts-only]

OUT gets the engine's other files as they are, its graph and data file rewritten tensor by tensor (page-aligned, as
every kiln engine), and a manifest with the new checksums and op-library ABI 8 (the last without records); with
--experts-only the kiln.MatMulQ4_1 and kiln.MatMulGGUF records stay and only kiln.MoE's experts become blocks, as
engines of ABI 9 and 10 held them (the manifest says 10, or 12 with kiln.MatMulGGUF records).
"""

from __future__ import annotations

import argparse
import dataclasses
import shutil
from pathlib import Path

import onnx

from kiln.contract import GGUF_RECORDS_ABI, MOE_RECORDS_ABI
from kiln.manifest import MANIFEST_NAME, read_manifest, write_manifest
from kiln.optimize._common import write_weights
from kiln.optimize.pack_gguf_records import unpack_gguf_records
from kiln.optimize.pack_q4_1_records import unpack_q4_1_records

BLOCKS_ABI = 8
GRAPH, DATA = "model.onnx", "model.onnx.data"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("engine", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--experts-only", action="store_true",
                        help="unpack kiln.MoE's experts only, keeping kiln.MatMulQ4_1's records")
    args = parser.parse_args()
    manifest = read_manifest(args.engine, verify_checksums=False)
    if manifest.stages or manifest.ranks:
        raise SystemExit(f"{args.engine} is split into stages or ranks; this copies one-graph engines")
    args.out.mkdir(parents=True)
    for path in args.engine.iterdir():
        if path.is_file() and path.name not in (GRAPH, DATA, MANIFEST_NAME):
            shutil.copy2(path, args.out / path.name)
    model = onnx.load(str(args.engine / GRAPH), load_external_data=False)
    count = unpack_q4_1_records(model.graph, args.engine, dense=not args.experts_only)
    gguf = 0 if args.experts_only else unpack_gguf_records(model.graph, args.engine)
    write_weights(model.graph, args.engine, args.out / DATA, DATA, inline_limit=1024)
    onnx.save(model, str(args.out / GRAPH))
    gguf_records = any(n.op_type == "MatMulGGUF" and any(a.name == "layout" for a in n.attribute)
                       for n in model.graph.node)
    abi = (GGUF_RECORDS_ABI if gguf_records else MOE_RECORDS_ABI - 1) if args.experts_only else BLOCKS_ABI
    write_manifest(args.out, dataclasses.replace(manifest, op_library_abi=abi))
    print(f"{args.out}: {count} kiln.MatMulQ4_1 / kiln.MoE nodes and {gguf} kiln.MatMulGGUF nodes in blocks")


if __name__ == "__main__":
    main()
