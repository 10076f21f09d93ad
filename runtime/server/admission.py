"""Admission: from a request's prompts to queued engine requests, without blocking the event loop.

1. Cheap refusals first: the queue bound (503), a prompt of more token ids than max_model_len (400,
   before its ids are validated), and a prompt with more characters than max_model_len tokens can
   hold (400; no tokenizer sees it).
2. Tokenizing and checking each prompt on the worker pool (offload.py; a short prompt, on the event
   loop, where it costs less than the trip to a worker).
3. Queueing the prepared requests in one step of the event loop: nothing awaits between the
   queue-bound check and AsyncLLM counting them, so a burst cannot pass the check together.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from typing import Any

from kiln.errors import InvalidParamError
from kiln.runtime.params import SamplingParams
from kiln.runtime.server.errors import APIError
from kiln.runtime.server.offload import INLINE_TOKENIZE_CHARS
from kiln.runtime.server.streams import OutputStream

Prompt = str | list[int]


def check_queue(state: Any, num_prompts: int) -> None:
    """503 (Retry-After) when the prompts would pass the queue bound; 400 for a batch that never can."""
    max_queue = state.max_queue
    if max_queue is None:
        return
    if num_prompts > max_queue:
        raise APIError(400, f"A batch of {num_prompts} prompts is more than the server's queue bound "
                            f"({max_queue}); send at most {max_queue} at a time.", "prompt")
    if state.llm.num_waiting + num_prompts > max_queue:
        raise APIError(503, f"The server is at its queue bound ({max_queue} waiting requests); retry later.",
                       code="queue_full", headers={"Retry-After": "1"})


def check_length(llm: Any, chars: int, param: str) -> None:
    """InvalidParamError when ``chars`` characters cannot fit in max_model_len tokens, whatever they say."""
    if chars > llm.max_prompt_chars:
        raise InvalidParamError(
            f"{param} has {chars} characters, more than max_seq_len ({llm.max_seq_len}) tokens can hold with this "
            f"tokenizer (at most {llm.max_prompt_chars} characters); shorten the prompt", param)


def token_prompts_fit(max_seq_len: int) -> Callable[[Any], None]:
    """A bodies.Precheck for /v1/completions: a prompt of more token ids than max_model_len is refused
    before pydantic checks each id (200,000 ids take it ~0.7 s; counting them takes nothing)."""
    def check(data: Any) -> None:
        prompt = data.get("prompt") if isinstance(data, dict) else None
        if not isinstance(prompt, list) or not prompt:
            return
        for ids in (prompt if isinstance(prompt[0], list) else [prompt]):
            if isinstance(ids, list) and len(ids) > max_seq_len and not isinstance(ids[0], str):
                raise InvalidParamError(f"prompt has {len(ids)} tokens, more than max_seq_len ({max_seq_len})",
                                        "prompt")
    return check


def _prepare(llm: Any, prompts: Sequence[Prompt], params: SamplingParams, ids: Sequence[str],
             images: list[Any]) -> list[Any]:
    """Tokenize and check every prompt, encoding a chat's images (a worker thread); InvalidParamError for the
    first bad one."""
    prepared = []
    for prompt, request_id in zip(prompts, ids, strict=True):
        if isinstance(prompt, str):
            check_length(llm, len(prompt), "prompt")
        if images:  # a chat's (one prompt)
            prepared.append(llm.prepare_request(prompt, params, request_id, images))
        else:
            prepared.append(llm.prepare_request(prompt, params, request_id))
    return prepared


def _queue(state: Any, prepared: list[Any]) -> list[OutputStream]:
    check_queue(state, len(prepared))
    streams: list[OutputStream] = []
    try:
        for request in prepared:
            streams.append(state.llm.add_prepared(request))
    except BaseException:
        for stream in streams:  # a later prompt of the batch was refused: none of it runs
            stream.close()
        raise
    return streams


async def admit(state: Any, prompts: Sequence[Prompt], params: SamplingParams, ids: Sequence[str],
                images: list[Any] | None = None) -> list[OutputStream]:
    """The prompts' engine requests, queued; APIError or InvalidParamError when refused. images: a chat's decoded
    images, encoded on the worker pool with its prompt."""
    check_queue(state, len(prompts))
    for prompt in prompts:
        if isinstance(prompt, str):
            check_length(state.llm, len(prompt), "prompt")
    cost = sys.maxsize if images else _tokenize_cost(prompts, params)  # an encoder run is never short
    prepared = await state.offload.run_sized(cost, INLINE_TOKENIZE_CHARS, _prepare, state.llm, prompts, params, ids,
                                             images or [])
    return _queue(state, prepared)


def _tokenize_cost(prompts: Sequence[Prompt], params: SamplingParams) -> int:
    """The characters _prepare tokenizes (token ids cost ~a character each to check); no bound for a structured
    request, whose grammar may take long to compile."""
    if params.structured is not None:
        return sys.maxsize
    return sum(len(p) for p in prompts)
