"""The sampler's row kernels in the op library (runtime/ops/sampling.cc), called through ctypes.

Not ONNX Runtime ops: the runtime calls them on the logits a step returned, one call per step for
all its sampled rows. The C file's header says how each row is computed.
"""

from __future__ import annotations

import ctypes
from functools import cache

import numpy as np
import numpy.typing as npt

from kiln.errors import KilnError
from kiln.runtime.ops import OpLibraryError, library_path

Floats = npt.NDArray[np.float32]
Doubles = npt.NDArray[np.float64]
Ints = npt.NDArray[np.int64]

_P = ctypes.c_void_p
_I64 = ctypes.c_int64


@cache
def _library() -> ctypes.CDLL:
    path = library_path()
    lib = ctypes.CDLL(path)
    try:
        lib.kiln_sample_rows_on_threads.argtypes = [_P, _I64, _I64, _P, _P, _P, _P, _P, _P, _P, _I64]
        lib.kiln_sample_rows_on_threads.restype = _I64
        lib.kiln_top_tokens.argtypes = [_P, _I64, _I64, _I64, _P, _P]
        lib.kiln_top_tokens.restype = None
    except AttributeError as exc:
        raise OpLibraryError(f"{path} has no sampling kernels (built before them); rebuild it with "
                             "`python runtime/ops/build_ops.py` or reinstall kiln") from exc
    return lib


def _ptr(a: np.ndarray) -> int:
    return int(a.ctypes.data)


def _rows(logits: npt.ArrayLike) -> Floats:
    x: Floats = np.ascontiguousarray(logits, dtype=np.float32)
    if x.ndim != 2 or x.shape[1] == 0:
        raise ValueError(f"logits must be [rows, vocab] with vocab >= 1, got shape {x.shape}")
    return x


def sample_rows(logits: npt.ArrayLike, temperature: Doubles, top_k: Ints, top_p: Doubles, min_p: Doubles,  # noqa: PLR0913
                uniforms: Doubles | None, threads: int = 1) -> tuple[Floats, Ints | None]:
    """Per row, the logit from which on tokens stay in its distribution after min_p, top_k and top_p
    (top_k 0, top_p 1, min_p 0: off; temperature > 0), and, given one uniform in [0, 1) per row, the
    token at that uniform's inverse CDF in vocabulary order (None without uniforms). Up to `threads` threads
    take the rows (from 4 rows a thread); the results are the same for any count."""
    x = _rows(logits)
    rows, vocab = x.shape
    columns = [np.ascontiguousarray(c, dtype=d) for c, d in ((temperature, np.float64), (top_k, np.int64),
                                                              (top_p, np.float64), (min_p, np.float64))]
    if any(c.shape != (rows,) for c in columns):
        raise ValueError(f"each sampling setting needs one value per row ({rows})")
    thresholds = np.empty(rows, dtype=np.float32)
    tokens = None if uniforms is None else np.empty(rows, dtype=np.int64)
    u = None if uniforms is None else np.ascontiguousarray(uniforms, dtype=np.float64)
    bad = _library().kiln_sample_rows_on_threads(_ptr(x), rows, vocab, *(_ptr(c) for c in columns),
                                                 None if u is None else _ptr(u), _ptr(thresholds),
                                                 None if tokens is None else _ptr(tokens), max(1, threads))
    if bad:
        raise unsampleable(bad - 1)
    return thresholds, tokens


def unsampleable(row: int) -> KilnError:
    """The error for a logits row no token can be drawn from (the sampler's and the greedy argmax's)."""
    return KilnError(f"logits row {row} cannot be sampled: it holds a NaN or +inf, or no finite value")


def top_tokens(logits: npt.ArrayLike, k: int) -> tuple[Ints, Floats]:
    """The ids and logits of each row's k largest logits (1 <= k <= vocab), most likely first, ties in
    vocabulary order; NaNs after every number, in vocabulary order."""
    x = _rows(logits)
    rows, vocab = x.shape
    if not 1 <= k <= vocab:
        raise ValueError(f"k must be in [1, {vocab}], got {k}")
    ids = np.empty((rows, k), dtype=np.int64)
    values = np.empty((rows, k), dtype=np.float32)
    _library().kiln_top_tokens(_ptr(x), rows, vocab, k, _ptr(ids), _ptr(values))
    return ids, values


@cache
def _mask_kernel() -> ctypes._NamedFuncPointer:
    path = library_path()
    try:
        kernel = ctypes.CDLL(path).kiln_mask_rows
    except AttributeError as exc:
        raise OpLibraryError(f"{path} has no token-mask kernel (built before it); rebuild it with "
                             "`python runtime/ops/build_ops.py` or reinstall kiln") from exc
    kernel.argtypes = [_P, _I64, _I64, _P, _I64]
    kernel.restype = None
    return kernel


def mask_rows(logits: Floats, bitmask: npt.NDArray[np.int32]) -> None:
    """In place: each row's tokens whose bit is clear in its row of bitmask [rows, ceil(vocab / 32)] (llguidance's
    layout: token i is bit i % 32 of word i // 32) set to -inf. logits must be float32 and C-contiguous."""
    if logits.dtype != np.float32 or not logits.flags["C_CONTIGUOUS"] or logits.ndim != 2:
        raise ValueError("logits must be a C-contiguous float32 [rows, vocab] array")
    mask = np.ascontiguousarray(bitmask, dtype=np.int32)
    if mask.ndim != 2 or mask.shape[0] != logits.shape[0]:
        raise ValueError(f"bitmask must be [rows ({logits.shape[0]}), words], got shape {mask.shape}")
    _mask_kernel()(_ptr(logits), logits.shape[0], logits.shape[1], _ptr(mask), mask.shape[1])
