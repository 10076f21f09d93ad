"""SmolLM2-135M's int4-q4_1 engine stores kiln.MatMulQ4_1's weights as the kernel's records, on page boundaries of
its data file, and computes bit for bit what the same graph with its weights in blocks computes."""

from __future__ import annotations

import pytest
from q4_1_records_helpers import assert_records_compute_the_blocks_logits


@pytest.mark.slow
def test_smollm2_q4_1_engine_holds_records_and_computes_the_blocks_logits(smollm2_q4_1_engine, tmp_path):
    assert_records_compute_the_blocks_logits(smollm2_q4_1_engine, tmp_path)
