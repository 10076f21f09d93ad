"""Checkpoint tensors read one at a time, on demand, with plain file reads (no memory map kept).

A build must never hold the fp32 model: every tensor is read when asked for, converted, handed over
and forgotten. Reads use os.pread rather than a memory map because the pages a live map has touched
count in the process's resident set (an 8B checkpoint would end up resident, 16 GB of bf16, even
though each tensor is used once); a read lands in the page cache, which the kernel reclaims.

    safetensors: 8-byte header length, a JSON header {name: {dtype, shape, data_offsets}}, the data
    GGUF: the tensor infos gguf-py's reader parses; each tensor's blocks dequantized by gguf-py,
          a slab of rows at a time so the dequantizer's temporaries stay small; or, for
          `--quantization gguf`, its blocks themselves (file_blocks: the raw rows, nothing decoded)
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    from .checkpoint_types import TensorSource

_SAFETENSORS_DTYPES = {
    "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64,
}
_MAX_HEADER = 100 * 2**20  # the format's own limit on the JSON header
_SLAB_BYTES = 16 * 2**20  # float32 output per dequantized slab of GGUF rows (gguf-py's temporaries: ~6x that)


def read_bytes(path: Path, offset: int, size: int) -> bytearray:
    """size bytes at offset; an OSError names the file when it ends early."""
    buffer = bytearray(size)
    view = memoryview(buffer)
    fd = os.open(path, os.O_RDONLY)
    try:
        done = 0
        while done < size:
            got = os.preadv(fd, [view[done:]], offset + done)
            if got == 0:
                raise OSError(f"{path}: ends at byte {offset + done}, a tensor needs bytes up to {offset + size}")
            done += got
    finally:
        os.close(fd)
    return buffer


@dataclass(frozen=True)
class SafetensorsTensor:
    """One tensor of a safetensors file: where its bytes are, and what they hold."""

    path: Path
    offset: int  # absolute, in bytes
    nbytes: int
    dtype: torch.dtype
    shape: tuple[int, ...]

    def read(self) -> torch.Tensor:
        if self.nbytes == 0:
            return torch.zeros(self.shape, dtype=self.dtype)
        data = read_bytes(self.path, self.offset, self.nbytes)
        return torch.frombuffer(data, dtype=self.dtype).reshape(self.shape)


def safetensors_index(path: Path) -> dict[str, SafetensorsTensor]:
    """The tensors of a safetensors file by name, from its header alone (ValueError when the header is
    damaged or a tensor lies past the end of the file)."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ValueError("shorter than the 8-byte header length")
        (header_len,) = struct.unpack("<Q", head)
        if header_len > min(_MAX_HEADER, size - 8):
            raise ValueError(f"header of {header_len} bytes in a file of {size}")
        try:
            header = json.loads(f.read(header_len))
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ValueError(f"header is not JSON ({exc})") from None
    if not isinstance(header, dict):
        raise ValueError("header is not a JSON object")
    base = 8 + header_len
    tensors = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        tensors[name] = _safetensors_entry(path, name, info, base, size)
    return tensors


def _safetensors_entry(path: Path, name: str, info: object, base: int, size: int) -> SafetensorsTensor:
    if not isinstance(info, dict) or not {"dtype", "shape", "data_offsets"} <= set(info):
        raise ValueError(f"header entry {name!r} lacks dtype, shape or data_offsets")
    dtype = _SAFETENSORS_DTYPES.get(info["dtype"])
    if dtype is None:
        raise ValueError(f"{name} is {info['dtype']}; kiln reads float weights "
                         f"({', '.join(_SAFETENSORS_DTYPES)})")
    shape = tuple(int(d) for d in info["shape"])
    start, end = (int(x) for x in info["data_offsets"])
    expected = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if end - start != expected:
        raise ValueError(f"{name} has {end - start} bytes for shape {list(shape)} of {info['dtype']}")
    if base + end > size:
        raise ValueError(f"{name} ends at byte {base + end}, past the end of the file ({size} bytes)")
    return SafetensorsTensor(path, base + start, end - start, dtype, shape)


@dataclass(frozen=True)
class FileBlocks:
    """Rows of a matrix as its file's quantized blocks, read when asked: ggml type id, row count, and read() ->
    uint8 [rows, row bytes] (each row its blocks in order, a GGUF's bytes as they are)."""

    ggml_type: int
    rows: int
    read: Callable[[], np.ndarray]


@dataclass(frozen=True)
class GgufTensor:
    """One tensor of a GGUF file: its blocks' place and type; read() dequantizes to float32 (gguf-py's
    numbers bit for bit) in row-major [rows, cols] order, llama.cpp's q/k row permutation undone when
    rotary_heads is set."""

    path: Path
    offset: int
    nbytes: int
    qtype: int  # gguf.GGMLQuantizationType
    shape: tuple[int, ...]  # PyTorch order (GGUF stores dims innermost first)
    rotary_heads: int = 0

    def read(self) -> torch.Tensor:
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize

        qtype = GGMLQuantizationType(self.qtype)
        data = np.frombuffer(read_bytes(self.path, self.offset, self.nbytes), dtype=np.uint8)
        cols = self.shape[-1] if self.shape else 1
        rows = int(np.prod(self.shape[:-1], dtype=np.int64)) if len(self.shape) > 1 else 1
        data = data.reshape(rows, -1)
        out = np.empty((rows, cols), dtype=np.float32)
        step = max(1, _SLAB_BYTES // (4 * cols))
        for start in range(0, rows, step):  # dequantize works per block: slabs of rows give the same numbers
            out[start:start + step] = dequantize(data[start:start + step], qtype).reshape(-1, cols)
        tensor = torch.from_numpy(out).reshape(self.shape)
        if self.rotary_heads:
            tensor = unpermute_rotary_rows(tensor, self.rotary_heads)
        return tensor

    def file_blocks(self) -> FileBlocks | None:
        """The matrix's rows as the file's blocks (None for vectors and float types); an [E, rows, cols] expert stack's
        are its E * rows rows, expert after expert. llama.cpp's q/k permutation moves whole rows, and a row is whole
        blocks, so undoing it on the rows of bytes is exact."""
        from gguf import GGMLQuantizationType

        if len(self.shape) not in (2, 3) or self.qtype in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
            return None
        return FileBlocks(self.qtype, int(np.prod(self.shape[:-1])), self._read_blocks)

    def _read_blocks(self) -> np.ndarray:
        rows = int(np.prod(self.shape[:-1]))
        data = np.frombuffer(read_bytes(self.path, self.offset, self.nbytes), dtype=np.uint8).reshape(rows, -1)
        if self.rotary_heads:
            data = unpermute_rotary_rows(torch.from_numpy(data), self.rotary_heads).numpy()
        return np.ascontiguousarray(data)


@dataclass(frozen=True)
class RowSlice:
    """Rows [start, start + rows) of another tensor source (a fused projection's part), read on demand."""

    source: TensorSource
    start: int
    rows: int

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.rows, *tuple(self.source.shape)[1:])

    def read(self) -> torch.Tensor:
        return self.source.read()[self.start:self.start + self.rows].clone()

    def file_blocks(self) -> FileBlocks | None:
        """Its rows of the source's blocks (rows are whole blocks: exact), when the source has blocks."""
        blocks = file_blocks(self.source)
        if blocks is None:
            return None
        return FileBlocks(blocks.ggml_type, self.rows,
                          lambda: np.ascontiguousarray(blocks.read()[self.start:self.start + self.rows]))


def file_blocks(source: object) -> FileBlocks | None:
    """A tensor source's blocks (GgufTensor, RowSlice of one), or None for sources without them."""
    method = getattr(source, "file_blocks", None)
    return method() if callable(method) else None


def unpermute_rotary_rows(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's convert permutation of q/k rows (interleaved pairs -> HF rotate_half halves).

    llama.cpp stores ``w.reshape(H, 2, D/2, ...).swapaxes(1, 2)``; this is its inverse.
    """
    rows = w.shape[0]
    half = rows // num_heads // 2
    return w.reshape(num_heads, half, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape).contiguous()
