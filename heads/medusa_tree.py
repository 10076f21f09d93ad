"""What tree verification would give a set of Medusa heads, estimated from their scored rows.

Not built: a tree needs a tree-shaped attention mask in the verification step, which kiln.PagedAttention
does not take. This module measures what it would be worth before anyone changes that contract.

A tree proposes, at depth i, some of head i's best-ranked tokens under each depth-(i-1) node. All heads read
the same row, so head i ranks tokens the same under every parent, and a node is a path of ranks (p_1..p_d).
Greedy verification keeps the deepest node whose tokens are the continuation: with r_i the rank, in head i,
of the true token i places ahead, node (p_1..p_d) is kept iff r_j = p_j for every j <= d. So a tree T gives
1 + sum over its nodes of P(r_1..r_d = p_1..p_d) tokens per step, counted on real rows (no independence
assumed between heads). A node is never likelier than its parent, so the best tree of n nodes is simply the
n likeliest paths (Medusa's "sparse tree", found without search); a chain of k guesses is (0), (0,0), ...

    python -m kiln.heads.medusa_tree HEADS_DIR ROWS.pt [--split chat] [--nodes 1 2 3 4 6 8]

(HEADS_DIR: `kiln train-medusa -o`; ROWS.pt: its `--rows-cache`.)
"""

from __future__ import annotations

import argparse
from collections import Counter

import torch

from .medusa_heads import MedusaHeads

IGNORE = -100
Path_ = tuple[int, ...]
# CPU time of an fp32 SmolLM2 step of n tokens over a 1-token step (docs/design.md, "Switch-off rule")
FP32_STEP_COST = {1: 1.00, 2: 1.15, 4: 1.26, 8: 1.69, 16: 2.55}
# the heads at one more row, over a 1-token step (bench_medusa_head.py: 3.9 ms on a ~50 ms fp32 step)
HEAD_ROW_COST = 0.08


@torch.no_grad()
def label_ranks(heads: MedusaHeads, x: torch.Tensor, labels: torch.Tensor, lm_head: torch.Tensor,
                chunk: int = 256) -> torch.Tensor:
    """[n, K]: per row and head, how many tokens head i scores above its label (0: the label is its top-1);
    only rows whose K labels all exist (the chain can be scored to its end, as medusa_train.score does)."""
    full = (labels != IGNORE).all(1)
    x, labels = x[full], labels[full]
    ranks = torch.empty(labels.shape, dtype=torch.int64)
    for rows in torch.arange(x.shape[0]).split(chunk):
        logits = heads.logits(x[rows], lm_head)  # [b, K, V]
        target = logits.gather(-1, labels[rows].unsqueeze(-1))
        ranks[rows] = (logits > target).sum(-1)
    return ranks


def path_probabilities(ranks: torch.Tensor, max_rank: int = 8) -> dict[Path_, float]:
    """P(r_1..r_d = path) for every path of ranks below max_rank that some row takes."""
    counts: Counter[Path_] = Counter()
    for row in ranks.tolist():
        for depth, rank in enumerate(row):
            if rank >= max_rank:
                break
            counts[tuple(row[:depth + 1])] += 1
    return {path: n / ranks.shape[0] for path, n in counts.items()}


def best_tree(probabilities: dict[Path_, float], nodes: int) -> list[Path_]:
    """The `nodes` likeliest paths; shallower first among equals, so every node's parent is in the tree."""
    return sorted(probabilities, key=lambda p: (-probabilities[p], len(p), p))[:nodes]


def chain(length: int) -> list[Path_]:
    return [(0,) * d for d in range(1, length + 1)]


def expected_tokens(probabilities: dict[Path_, float], tree: list[Path_]) -> float:
    """Tokens per verification step: the target's own token + the expected depth of the kept node."""
    assert all(p[:-1] in tree or len(p) == 1 for p in tree), "a tree holds every node's parent"
    return 1.0 + sum(probabilities.get(p, 0.0) for p in tree)


def accepted_beyond_root(probabilities: dict[Path_, float], tree: list[Path_]) -> float:
    """P(at least one guess kept): the depth-1 nodes' probabilities (at most one of them is right)."""
    return sum(probabilities.get(p, 0.0) for p in tree if len(p) == 1)


def step_cost(tokens: int, table: dict[int, float] = FP32_STEP_COST) -> float:
    """A step of `tokens` query tokens over a 1-token step, linear between the measured sizes."""
    sizes = sorted(table)
    if tokens >= sizes[-1]:
        low, high = sizes[-2], sizes[-1]
    else:
        low = max(n for n in sizes if n <= tokens)
        high = min(n for n in sizes if n > tokens) if tokens != low else low
    if high == low:
        return table[low]
    return table[low] + (table[high] - table[low]) * (tokens - low) / (high - low)


def estimated_speedup(tokens: float, kept: float, nodes: int, heads_at_every_row: bool,
                      table: dict[int, float] = FP32_STEP_COST, head_row: float = HEAD_ROW_COST) -> float:
    """Decode speed over plain decoding (a 1-token step of cost 1 per token, no heads) for a tree of `nodes`
    guesses giving `tokens` per step, a guess kept with probability `kept`. With the heads read at every
    verified row each step pays them at nodes + 1 rows; read at the first row only, a step that kept a guess
    chose its last token at a row without heads, so the next step is a plain one (1 token, heads at its row)."""
    if heads_at_every_row:
        return tokens / (step_cost(nodes + 1, table) + head_row * (nodes + 1))
    return (tokens + kept) / (step_cost(nodes + 1, table) + head_row + kept * (1 + head_row))


def top_k_accuracy(ranks: torch.Tensor, ks: tuple[int, ...] = (1, 2, 3, 5)) -> dict[int, list[float]]:
    return {k: [round(float((ranks[:, i] < k).float().mean()), 4) for i in range(ranks.shape[1])] for k in ks}


def main(argv: list[str] | None = None) -> None:
    from kiln.export.checkpoint import load_checkpoint
    from kiln.export.reference import ReferenceModel
    from kiln.heads.medusa_data import lm_head_weight
    from kiln.heads.medusa_heads import MedusaArtifact

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("heads")
    parser.add_argument("rows")
    parser.add_argument("--model", default=None, help="checkpoint (default: the one the heads were trained on)")
    parser.add_argument("--split", nargs="+", default=["chat", "heldout"])
    parser.add_argument("--nodes", type=int, nargs="+", default=[1, 2, 3, 4, 5, 6, 8, 10, 12, 16])
    args = parser.parse_args(argv)
    artifact = MedusaArtifact.load(args.heads)
    model = ReferenceModel.from_checkpoint(load_checkpoint(args.model or artifact.info["model_source"]))
    rows = torch.load(args.rows)
    for split in args.split:
        ranks = label_ranks(artifact.heads(), *rows[split], lm_head_weight(model))
        probabilities = path_probabilities(ranks)
        print(f"{split}: {ranks.shape[0]} rows; top-k accuracy per head {top_k_accuracy(ranks)}")
        for n in args.nodes:
            tree = best_tree(probabilities, n)
            line = f"  {n:2d} nodes: best tree {expected_tokens(probabilities, tree):.3f} tokens/step"
            if n <= ranks.shape[1]:
                line += f", chain {expected_tokens(probabilities, chain(n)):.3f}"
            tokens, kept = expected_tokens(probabilities, tree), accepted_beyond_root(probabilities, tree)
            speed = [estimated_speedup(tokens, kept, n, every) for every in (True, False)]
            print(line + f"; P(a guess kept) {kept:.3f}; est. fp32 speed-up {speed[0]:.2f}x (heads at every "
                  f"row) / {speed[1]:.2f}x (first row); tree {tree}")


if __name__ == "__main__":
    main()
