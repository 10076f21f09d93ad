"""The runner's KV pools (runtime/kv_memory.py): from HUGE_POOL_MIN a layer each is a mapping of its own on a 2 MiB
boundary, the graph writes its K/V there, and a step's logits are the same as on small (numpy) pools."""

from __future__ import annotations

import numpy as np

from kiln.runtime.kv_memory import HUGE_PAGE, HUGE_POOL_MIN
from kiln.runtime.model_runner import Chunk, pack_chunks
from kiln.runtime.ort_runner import OrtModelRunner, graph_kv_pools, open_session


def test_large_pools_are_aligned_mappings_the_graph_writes_into(tiny_engine):
    session = open_session(tiny_engine / "model.onnx", num_threads=1)
    spec = graph_kv_pools(session)
    blocks = -(-HUGE_POOL_MIN * spec.num_layers // spec.bytes_per_block)  # a layer's pool just reaching the size
    large = OrtModelRunner(session, spec, num_blocks=blocks)
    small = OrtModelRunner(session, spec, num_blocks=8)
    assert all(pool.nbytes >= HUGE_POOL_MIN and pool.ctypes.data % HUGE_PAGE == 0 for pool in large.pools)
    assert all(pool.nbytes < HUGE_POOL_MIN for pool in small.pools)
    steps = [pack_chunks([Chunk(0, [1, 2, 3, 4, 5], [3])], all_rows=True),
             pack_chunks([Chunk(5, [6], [3])], all_rows=False)]
    for step in steps:  # the second step reads the first one's K/V back from block 3
        np.testing.assert_array_equal(large.execute(step), small.execute(step))
    for big, little in zip(large.pools, small.pools, strict=True):
        assert big[3].any() and not big[:3].any() and not big[4:16].any()  # written in place, in block 3 only
        np.testing.assert_array_equal(big[3], little[3])
