"""kiln.AllReduce (domain "kiln", version 1): the contract and its executable spec.

The ranks of a tensor-parallel engine (kiln/tensor_parallel.py) each compute a partial sum of the same
[..., hidden] tensor (a row-sharded projection's output); kiln.AllReduce makes every rank's output the sum of
all of them, through a shared-memory segment the ranks' processes map (the workspace). The ONNX Runtime CPU
kernel (runtime/ops/all_reduce.cc) is tested against `all_reduce_ref` and this layout.

Inputs
  x          float32 [...]      this rank's partial tensor (any shape; every rank's call has the same shape)
  workspace  uint8   [W]        the group's shared segment (layout below), bound once by the runtime to the
                                graph input `tp_workspace` of every rank's session; the op writes into it
Output
  y          float32 x's shape  sum over ranks 0..world_size-1 of their x, added in rank order in float32:
                                ((x_0 + x_1) + x_2) + ..., so every rank's y is bit for bit the same
Attributes
  rank (int), world_size (int, >= 1, rank < world_size)

Semantics. A rank's calls are numbered 1, 2, ... (its own counter, kept in the workspace). In call g the rank
copies x into its slot of buffer g % 2, publishes g, and waits until every rank has published g; it then sums
the slots of buffer g % 2 in rank order. Two buffers make one barrier per call enough: a rank writes buffer
g % 2 again only in call g + 2, which it reaches after every rank has published g + 1, i.e. has finished
reading call g. Every rank must run the same sequence of calls with the same shapes.

The wait never hangs: it fails (an error naming the ranks it waited for) when the workspace's abort word is set
(the runtime sets it when a rank's process dies), when a rank that published its pid is no longer alive, or
after timeout_ms without every rank arriving. A failed call sets the abort word itself, so every other rank
stops too; the group is then done and the runtime starts it again with a new workspace.

Workspace layout (little-endian uint64 words; each group of words on its own 64-byte line):
  line 0                magic, version, world_size, timeout_ms, abort, slot_bytes
  line 1 + r            rank r's published call number, then the element count of its x in its last call on
                        buffer 0 and on buffer 1 (every rank checks that all counts match its own)
  line 1 + world + r    rank r's pid, wait_ns (time spent waiting for the others), bytes (of x it reduced),
                        calls (its call count, also the last number it published)
  from header_bytes on  2 x world_size slots of slot_bytes: buffer b's slot for rank r at
                        header_bytes + (b * world_size + r) * slot_bytes
"""

from __future__ import annotations

import numpy as np

OP_TYPE = "AllReduce"
OP_VERSION = 1
WORKSPACE_INPUT = "tp_workspace"  # the graph input every rank's AllReduce nodes read the workspace from

MAGIC = 0x6B696C6E_41525331  # "kilnARS1"
LAYOUT_VERSION = 1
LINE = 64  # bytes: one cache line per rank's words, so ranks do not write the same line
WORDS = LINE // 8
# line 0's words
W_MAGIC, W_VERSION, W_WORLD, W_TIMEOUT_MS, W_ABORT, W_SLOT_BYTES = range(6)
# a rank's statistics line
S_PID, S_WAIT_NS, S_BYTES, S_CALLS = range(4)
PAGE = 4096


def header_bytes(world_size: int) -> int:
    """Bytes before the first slot: line 0, the published-call lines and the statistics lines, page-aligned."""
    return -(-(LINE * (1 + 2 * world_size)) // PAGE) * PAGE


def workspace_bytes(world_size: int, max_elements: int) -> int:
    """The workspace for calls of up to max_elements float32 each."""
    slot = -(-(max_elements * 4) // LINE) * LINE
    return header_bytes(world_size) + 2 * world_size * slot


def init_workspace(buffer: np.ndarray, world_size: int, timeout_ms: int) -> None:
    """Write the header of a zeroed uint8 workspace (the runtime does this once, before any rank runs)."""
    if buffer.dtype != np.uint8 or buffer.ndim != 1:
        raise ValueError(f"the workspace must be a flat uint8 array, got {buffer.dtype} {list(buffer.shape)}")
    if world_size < 1 or timeout_ms < 1:
        raise ValueError(f"world_size and timeout_ms must be >= 1, got {world_size} and {timeout_ms}")
    head = header_bytes(world_size)
    slot = (buffer.size - head) // (2 * world_size) // LINE * LINE
    if slot < LINE:
        raise ValueError(f"a workspace of {buffer.size} bytes has no room for {world_size} ranks' slots")
    words = buffer[:head].view(np.uint64)
    words[:] = 0
    words[[W_MAGIC, W_VERSION, W_WORLD, W_TIMEOUT_MS, W_SLOT_BYTES]] = [MAGIC, LAYOUT_VERSION, world_size,
                                                                        timeout_ms, slot]


def header_words(buffer: np.ndarray) -> np.ndarray:
    """The header as uint64 words (a view: line 0's abort word and the ranks' statistics can be read and set)."""
    world = int(buffer[:LINE].view(np.uint64)[W_WORLD])
    return buffer[:header_bytes(world)].view(np.uint64)


def rank_stats(buffer: np.ndarray, rank: int) -> dict[str, int]:
    """Rank `rank`'s pid, wait_ns, bytes and calls, as its op last wrote them."""
    words = header_words(buffer)
    world = int(words[W_WORLD])
    line = (1 + world + rank) * WORDS
    return {"pid": int(words[line + S_PID]), "wait_ns": int(words[line + S_WAIT_NS]),
            "bytes": int(words[line + S_BYTES]), "calls": int(words[line + S_CALLS])}


def set_abort(buffer: np.ndarray) -> None:
    """Make every waiting and future call fail (a rank's process died)."""
    header_words(buffer)[W_ABORT] = 1


def all_reduce_ref(parts: list[np.ndarray]) -> np.ndarray:
    """The sum of every rank's x, float32, added in rank order: what each rank's y must equal bit for bit."""
    if not parts:
        raise ValueError("all_reduce_ref needs at least one rank's tensor")
    shapes = {tuple(p.shape) for p in parts}
    if len(shapes) != 1:
        raise ValueError(f"every rank's x must have the same shape, got {sorted(shapes)}")
    total = np.array(parts[0], dtype=np.float32, copy=True)
    for part in parts[1:]:
        total += np.asarray(part, dtype=np.float32)
    return total
