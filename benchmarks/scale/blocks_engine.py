"""Copy a one-graph engine with kiln.MatMulQ4_1's weights unpacked from records into blocks (the layout engines held
before records, which the kernel packs into anonymous memory at session load), to measure a load both ways on the
same weights with one op library.

    .venv/bin/python benchmarks/scale/blocks_engine.py ENGINE OUT

OUT gets the engine's other files as they are, its graph and data file rewritten tensor by tensor (page-aligned, as
every kiln engine), and a manifest with the new checksums and op-library ABI 8 (the last without records).
"""

from __future__ import annotations

import argparse
import dataclasses
import shutil
from pathlib import Path

import onnx

from kiln.manifest import MANIFEST_NAME, read_manifest, write_manifest
from kiln.optimize._common import write_weights
from kiln.optimize.pack_q4_1_records import unpack_q4_1_records

BLOCKS_ABI = 8
GRAPH, DATA = "model.onnx", "model.onnx.data"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("engine", type=Path)
    parser.add_argument("out", type=Path)
    args = parser.parse_args()
    manifest = read_manifest(args.engine, verify_checksums=False)
    if manifest.stages or manifest.ranks:
        raise SystemExit(f"{args.engine} is split into stages or ranks; this copies one-graph engines")
    args.out.mkdir(parents=True)
    for path in args.engine.iterdir():
        if path.is_file() and path.name not in (GRAPH, DATA, MANIFEST_NAME):
            shutil.copy2(path, args.out / path.name)
    model = onnx.load(str(args.engine / GRAPH), load_external_data=False)
    count = unpack_q4_1_records(model.graph, args.engine)
    write_weights(model.graph, args.engine, args.out / DATA, DATA, inline_limit=1024)
    onnx.save(model, str(args.out / GRAPH))
    write_manifest(args.out, dataclasses.replace(manifest, op_library_abi=BLOCKS_ABI))
    print(f"{args.out}: {count} kiln.MatMulQ4_1 nodes in blocks")


if __name__ == "__main__":
    main()
