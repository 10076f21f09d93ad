"""A bounded schemathesis run against /openapi.json of the server on the fake engine:
whatever the schema allows (and much that it does not), the server answers without a 5xx."""

from __future__ import annotations

import pytest

schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, settings  # noqa: E402
from schemathesis.checks import not_a_server_error  # noqa: E402
from schemathesis.specs.openapi.checks import response_schema_conformance, status_code_conformance  # noqa: E402
from server_fake import FakeAsyncLLM  # noqa: E402

from kiln.runtime.server.app import build_app  # noqa: E402

app = build_app(lambda: FakeAsyncLLM(), max_queue=1000)
schema = schemathesis.openapi.from_asgi("/openapi.json", app)


@schema.parametrize()
@settings(max_examples=15, deadline=None, derandomize=True,
          suppress_health_check=list(HealthCheck))
def test_no_server_error(case):
    response = case.call()
    case.validate_response(response, checks=[not_a_server_error, status_code_conformance,
                                             response_schema_conformance])
    if response.status_code >= 400:
        assert set(response.json()["error"]) == {"message", "type", "param", "code"}
