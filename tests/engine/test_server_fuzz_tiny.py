"""A bounded schemathesis run against the server on the real tiny engine (in-process, ASGI):
whatever the schema allows reaches the real tokenizer, validator, sampler and detokenizer,
and nothing answers 5xx. Generation lengths are capped so the run stays short."""

from __future__ import annotations

import pytest

schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from schemathesis import GenerationMode  # noqa: E402
from schemathesis.checks import not_a_server_error  # noqa: E402

from kiln.runtime.server.app import build_app  # noqa: E402


def _cap_generation(body) -> None:
    if isinstance(body, dict):
        for key in ("max_tokens", "max_completion_tokens"):
            if type(body.get(key)) is int:
                body[key] = min(body[key], 4)
        if "messages" in body and type(body.get("max_completion_tokens")) is not int:
            body["max_completion_tokens"] = 4


def test_no_server_error_on_tiny_engine(tiny_engine):
    from kiln.runtime import AsyncLLM

    llm = AsyncLLM(tiny_engine)
    schema = schemathesis.openapi.from_asgi("/openapi.json", build_app(lambda: llm, max_queue=1000))
    statuses: dict[int, int] = {}
    for result in schema.get_all_operations():
        operation = result.ok()
        modes = [GenerationMode.POSITIVE] + ([GenerationMode.NEGATIVE] if operation.method.upper() == "POST" else [])
        for mode in modes:

            @given(case=operation.as_strategy(generation_mode=mode))
            @settings(max_examples=16, deadline=None, derandomize=True, database=None,
                      suppress_health_check=list(HealthCheck))
            def run(case):
                _cap_generation(case.body)
                response = case.call()
                statuses[response.status_code] = statuses.get(response.status_code, 0) + 1
                case.validate_response(response, checks=[not_a_server_error])

            run()
    assert statuses.get(200, 0) >= 10, statuses  # the run did reach the engine
