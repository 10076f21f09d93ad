"""Tensor-parallel ranks of an engine: one graph per rank (kiln build --tensor-parallel N), each holding a share of
every layer's attention heads and MLP columns, joined by kiln.AllReduce (kiln/all_reduce.py).

Rank r's graph computes, per layer, its query heads' part of the packed QKV projection (column-sharded), its heads'
kiln.PagedAttention on its own KV pool (its KV heads only), its rows of the output projection (row-sharded), an
all-reduce of that partial sum, then its columns of the gate/up projection, kiln.SwiGLU on them, its rows of the
down projection and a second all-reduce. The embedding and the norms are replicated (every rank holds the whole
residual stream, bit for bit the same on every rank since the all-reduce sums in rank order); the final norm and
the LM head are on rank 0 alone, which returns the logits. Ranks > 0 end with the last all-reduce, output as
`tp_hidden`, so that they take part in it.

Heads: query heads go to ranks in contiguous runs that respect the GQA groups (query head h reads KV head
h // (H / Hkv)):
  - Hkv divisible by N: each rank gets Hkv / N KV heads and their groups' query heads (divided, not replicated);
  - N a multiple of Hkv (and H of N): each rank gets H / N query heads inside one group and that group's KV head,
    replicated on the N / Hkv ranks sharing the group;
  - otherwise, with Hkv >= N: whole groups, as evenly as they go (SmolLM2 at N = 2: 3 KV heads as 1 and 2, rank 0
    taking the fewer since it also runs the LM head);
  - anything else is refused, as is attention that normalises q and k inside kiln.PagedAttention (Qwen3, Gemma 3,
    OLMoE: OLMoE's norm spans every head).
MLP columns are split so that each rank reads the same number of weights per decode step: a rank with more
attention weights, or rank 0 with the LM head (its weights counted per layer), gets fewer (multiples of 32).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kiln.errors import KilnError

TP_HIDDEN = "tp_hidden"  # a rank > 0's output: the residual-stream delta of its last all-reduce
_COLUMN_STEP = 32  # MLP columns per rank are multiples of this: whole Q4_1 blocks of the down projection's input


class TensorParallelError(KilnError, ValueError):
    """The model cannot be split into the asked ranks; the message names why."""


def rank_graph_name(rank: int) -> str:
    return f"rank{rank}.onnx"


@dataclass(frozen=True)
class TensorRank:
    """One rank: its graph file, its query heads [first_head, end_head), KV heads [first_kv_head, end_kv_head)
    and MLP columns [first_column, end_column) of every layer."""

    graph: str
    first_head: int
    end_head: int
    first_kv_head: int
    end_kv_head: int
    first_column: int
    end_column: int

    def __post_init__(self) -> None:
        for name, start, end in (("heads", self.first_head, self.end_head),
                                 ("KV heads", self.first_kv_head, self.end_kv_head),
                                 ("MLP columns", self.first_column, self.end_column)):
            if not 0 <= start < end:
                raise ValueError(f"tensor-parallel rank {self.graph} has the empty or negative {name} range "
                                 f"[{start}, {end})")

    @property
    def heads(self) -> range:
        return range(self.first_head, self.end_head)

    @property
    def kv_heads(self) -> range:
        return range(self.first_kv_head, self.end_kv_head)

    @property
    def columns(self) -> range:
        return range(self.first_column, self.end_column)

    def to_dict(self) -> dict[str, Any]:
        return {"graph": self.graph, "first_head": self.first_head, "end_head": self.end_head,
                "first_kv_head": self.first_kv_head, "end_kv_head": self.end_kv_head,
                "first_column": self.first_column, "end_column": self.end_column}


@dataclass(frozen=True)
class ShardShape:
    """What the split reads off the model: its head counts, widths and the LM head's size."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    intermediate_size: int
    vocab_size: int
    num_layers: int


def head_ranges(num_heads: int, num_kv_heads: int, ranks: int) -> list[tuple[range, range]]:
    """(query heads, KV heads) of each rank, per the module's rules."""
    if ranks < 1:
        raise TensorParallelError(f"the tensor-parallel rank count must be at least 1, got {ranks}")
    group = num_heads // num_kv_heads
    if num_kv_heads % ranks == 0:
        per = num_kv_heads // ranks
        return [(range(r * per * group, (r + 1) * per * group), range(r * per, (r + 1) * per)) for r in range(ranks)]
    if ranks % num_kv_heads == 0 and num_heads % ranks == 0:
        per = num_heads // ranks
        return [(range(r * per, (r + 1) * per), range(r * per // group, r * per // group + 1)) for r in range(ranks)]
    if num_kv_heads > ranks:
        base, extra = divmod(num_kv_heads, ranks)
        result, start = [], 0
        for r in range(ranks):  # the larger shares last: rank 0 also runs the LM head
            end = start + base + (1 if r >= ranks - extra else 0)
            result.append((range(start * group, end * group), range(start, end)))
            start = end
        return result
    raise TensorParallelError(f"{num_heads} query heads in {num_kv_heads} KV groups do not split over {ranks} "
                              f"tensor-parallel ranks (the KV heads must divide by the ranks, the ranks by the KV "
                              f"heads with the query heads dividing by the ranks, or the KV heads outnumber them)")


def column_ranges(shape: ShardShape, heads: list[tuple[range, range]]) -> list[range]:
    """Each rank's MLP columns: sized so every rank's per-layer weights (attention, MLP, rank 0's share of the LM
    head) are as equal as multiples of _COLUMN_STEP columns allow, each rank keeping at least one step."""
    ranks, hidden, d = len(heads), shape.hidden_size, shape.head_dim
    if shape.intermediate_size < ranks * _COLUMN_STEP:
        raise TensorParallelError(f"the MLP's {shape.intermediate_size} columns are too few for {ranks} "
                                  f"tensor-parallel ranks of at least {_COLUMN_STEP} each")
    fixed = [hidden * d * (2 * len(q) + 2 * len(kv)) for q, kv in heads]  # QKV columns and output rows
    fixed[0] += shape.hidden_size * shape.vocab_size // shape.num_layers
    per_column = 3 * hidden  # gate, up and down
    target = (sum(fixed) + per_column * shape.intermediate_size) / ranks
    counts = [max(_COLUMN_STEP, round((target - f) / per_column / _COLUMN_STEP) * _COLUMN_STEP) for f in fixed]
    while sum(counts[:-1]) > shape.intermediate_size - _COLUMN_STEP:  # the last rank keeps at least one step
        widest = max(range(ranks - 1), key=lambda r: counts[r])
        counts[widest] -= _COLUMN_STEP
    counts[-1] = shape.intermediate_size - sum(counts[:-1])
    result, start = [], 0
    for count in counts:
        result.append(range(start, start + count))
        start += count
    return result


def plan_ranks(shape: ShardShape, ranks: int) -> tuple[TensorRank, ...]:
    """The ranks of an N-way split of a model of this shape."""
    if shape.num_heads % shape.num_kv_heads:
        raise TensorParallelError(f"{shape.num_heads} query heads are not a multiple of {shape.num_kv_heads} KV heads")
    heads = head_ranges(shape.num_heads, shape.num_kv_heads, ranks)
    columns = column_ranges(shape, heads)
    return tuple(TensorRank(rank_graph_name(r), q.start, q.stop, kv.start, kv.stop, c.start, c.stop)
                 for r, ((q, kv), c) in enumerate(zip(heads, columns, strict=True)))


def check_ranks(ranks: tuple[TensorRank, ...], num_heads: int, num_kv_heads: int) -> None:
    """Ranks must cover every query head in order, each reading KV heads its heads' groups need (ValueError
    naming the first that does not)."""
    expected = 0
    group = num_heads // num_kv_heads
    for rank in ranks:
        if rank.first_head != expected:
            raise ValueError(f"tensor-parallel rank {rank.graph} starts at head {rank.first_head}, not at head "
                             f"{expected} where the previous rank ends")
        if range(rank.first_head // group, (rank.end_head - 1) // group + 1) != rank.kv_heads:
            raise ValueError(f"tensor-parallel rank {rank.graph}'s KV heads {list(rank.kv_heads)} are not those of "
                             f"its query heads {list(rank.heads)}")
        expected = rank.end_head
    if ranks and expected != num_heads:
        raise ValueError(f"the tensor-parallel ranks end at head {expected}, but the model has {num_heads} heads")
