"""KvHandoff: a prompt's computed KV blocks and its sequence's state after the first token, handed from
one engine to another (disaggregated prefill and decode, runtime/cluster/).

The prefill engine runs the prompt, samples the first token and reads the prompt's blocks out of its
pools (Engine.add(..., export_kv=True)); the decode engine writes them into blocks of its own pool,
takes the first token as if it had sampled it, and goes on decoding (Engine.add(..., kv=handoff)).
Nothing else crosses: the request's params and id travel with the request itself.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kiln.errors import InvalidParamError


@dataclass(frozen=True)
class KvLayout:
    """What one block of a runner's pools looks like: a block is [num_layers, *block_shape] of dtype."""

    num_layers: int
    block_shape: tuple[int, ...]  # one layer's block: [2, Hkv, block_size, D] in the ORT runner
    dtype: np.dtype


@dataclass(frozen=True)
class KvHandoff:
    prompt_token_ids: tuple[int, ...]
    first_token: int
    first_logprob: float | None  # the sampled token's logprob, when the request asked for logprobs
    first_top_logprobs: dict[int, tuple[float, int]] | None  # token -> (logprob, rank), likewise
    num_cached_tokens: int  # prompt tokens the prefill engine found in its prefix cache
    # [num_layers, blocks of the prompt, *KvLayout.block_shape] in the pools' dtype
    blocks: np.ndarray

    def check(self, prompt_token_ids: list[int], block_size: int, layout: KvLayout) -> None:
        """InvalidParamError naming the mismatch when this handoff cannot continue that prompt in pools of
        that layout (a different engine, or another request's handoff)."""
        if list(self.prompt_token_ids) != list(prompt_token_ids):
            raise InvalidParamError("the KV handoff is for another prompt than the request's", "kv")
        want = (layout.num_layers, -(-len(prompt_token_ids) // block_size), *layout.block_shape)
        if self.blocks.shape != want or self.blocks.dtype != layout.dtype:
            raise InvalidParamError(f"the KV handoff holds {self.blocks.dtype} blocks {list(self.blocks.shape)}, "
                                    f"this engine's pools need {layout.dtype} {list(want)}: the two replicas "
                                    "do not serve the same engine", "kv")
