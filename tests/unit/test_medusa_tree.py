"""The tree-verification estimate (heads/medusa_tree.py) on hand-made ranks and heads."""

from __future__ import annotations

import pytest
import torch

from kiln.heads.medusa_heads import MedusaHeads
from kiln.heads.medusa_tree import (
    IGNORE,
    accepted_beyond_root,
    best_tree,
    chain,
    estimated_speedup,
    expected_tokens,
    label_ranks,
    path_probabilities,
    step_cost,
    top_k_accuracy,
)

# four rows, two heads: the rank of the true token in head 1 and head 2
RANKS = torch.tensor([[0, 0], [0, 1], [1, 0], [3, 0]])


def test_path_probabilities_count_rows_that_follow_each_path():
    p = path_probabilities(RANKS, max_rank=3)  # rank 3 is beyond the tree: its row counts nowhere
    assert p == {(0,): 0.5, (0, 0): 0.25, (0, 1): 0.25, (1,): 0.25, (1, 0): 0.25}


def test_chain_and_tree_expected_tokens():
    p = path_probabilities(RANKS)
    assert expected_tokens(p, chain(1)) == 1.5  # head 1 right in 2 rows of 4
    assert expected_tokens(p, chain(2)) == 1.75  # and head 2 after it in 1
    tree = best_tree(p, 3)
    # the likeliest three nodes: (0,) then, at 0.25 each, the shallower (1,) before the depth-2 nodes
    assert tree == [(0,), (1,), (3,)] and expected_tokens(p, tree) == 2.0
    assert accepted_beyond_root(p, tree) == 1.0
    assert all(len(node) == 1 or node[:-1] in best_tree(p, n) for n in range(1, 7) for node in best_tree(p, n))


def test_top_k_accuracy_per_head():
    assert top_k_accuracy(RANKS, (1, 2)) == {1: [0.5, 0.75], 2: [0.75, 1.0]}


def test_label_ranks_of_fresh_heads_are_the_lm_heads_ranks():
    """Fresh heads are the LM head itself (W, b = 0): ranks are where each label sits in the LM head's order."""
    lm_head = torch.eye(4)  # token v scores x[v]
    x = torch.tensor([[0.1, 0.9, 0.5, 0.2], [0.4, 0.3, 0.2, 0.1], [1.0, 0.0, 0.0, 0.0]])
    labels = torch.tensor([[1, 2], [3, 0], [0, IGNORE]])  # the last row lacks head 2's label: left out
    ranks = label_ranks(MedusaHeads(2, 4), x, labels, lm_head, chunk=1)
    assert ranks.tolist() == [[0, 1], [3, 0]]


@pytest.mark.parametrize("nodes", [1, 2, 5])
def test_best_tree_beats_or_equals_the_chain(nodes):
    ranks = torch.randint(0, 4, (200, 3), generator=torch.Generator().manual_seed(nodes))
    p = path_probabilities(ranks)
    if nodes <= 3:
        assert expected_tokens(p, best_tree(p, nodes)) >= expected_tokens(p, chain(nodes))
    assert len(best_tree(p, nodes)) == nodes


def test_step_cost_interpolates_the_measured_sizes():
    table = {1: 1.0, 2: 1.2, 4: 1.4, 8: 2.2}
    assert step_cost(1, table) == 1.0 and step_cost(4, table) == 1.4
    assert step_cost(3, table) == pytest.approx(1.3) and step_cost(6, table) == pytest.approx(1.8)
    assert step_cost(12, table) == pytest.approx(3.0)  # past the table: the last slope


def test_estimated_speedup_charges_the_heads_and_the_plain_step_after_a_kept_guess():
    table = {1: 1.0, 2: 1.2, 4: 1.4}
    # 1 guess, 1.5 tokens per step: heads at both rows cost 2 x 0.1
    assert estimated_speedup(1.5, 0.5, 1, True, table, 0.1) == pytest.approx(1.5 / 1.4)
    # heads at the first row: half the steps keep a guess and are followed by a plain step
    assert estimated_speedup(1.5, 0.5, 1, False, table, 0.1) == pytest.approx(2.0 / (1.3 + 0.55))
    assert estimated_speedup(1.0, 0.0, 1, False, table, 0.0) < 1.0  # guesses never kept only cost
