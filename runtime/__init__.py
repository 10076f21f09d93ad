"""kiln.runtime: serve an engine directory (never imports torch or the compile-time stages)."""

from typing import TYPE_CHECKING

from kiln.runtime.outputs import CompletionOutput, EngineStats, Logprob, RequestOutput, merge_outputs
from kiln.runtime.params import RuntimeConfig, SamplingParams

__all__ = [
    "AsyncLLM", "CompletionOutput", "EngineStats", "LLM", "Logprob", "RequestOutput", "RuntimeConfig",
    "SamplingParams", "merge_outputs",
]

if TYPE_CHECKING:  # the type checker sees the lazily loaded classes as plain imports
    from kiln.runtime.async_llm import AsyncLLM
    from kiln.runtime.llm import LLM


def __getattr__(name: str) -> type:
    # LLM / AsyncLLM pull in onnxruntime and tokenizers; load them on first use.
    if name == "LLM":
        from kiln.runtime.llm import LLM
        return LLM
    if name == "AsyncLLM":
        from kiln.runtime.async_llm import AsyncLLM
        return AsyncLLM
    raise AttributeError(f"module 'kiln.runtime' has no attribute {name!r}")
