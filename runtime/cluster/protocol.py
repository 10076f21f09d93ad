"""What the ingress sends an engine replica, and what it learns of one (plain picklable data)."""

from __future__ import annotations

from dataclasses import dataclass

from kiln.runtime.params import SamplingParams


@dataclass(frozen=True)
class ReplicaRequest:
    """One engine request, validated and tokenized by the ingress; block_hashes are its prompt's chained
    block hashes (block_manager.prompt_block_hashes), computed once there for the router."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    block_hashes: tuple[int, ...]


@dataclass(frozen=True)
class ReplicaInfo:
    """What the ingress checks requests against (every replica serves the same engine with the same config)."""

    model_name: str
    max_seq_len: int  # the engine's, capped by one replica's pool
    vocab_size: int
    block_size: int
