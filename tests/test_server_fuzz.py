"""schemathesis against the server's own OpenAPI schema: no input may produce a 5xx.

A tiny random model serves (speculation on, context 64 tokens) so each generated request runs
through the engine quickly. Most cases get the served model's name so they reach generation
instead of stopping at the 404; the rest keep schemathesis's random name.
"""
from __future__ import annotations

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from schemathesis.checks import not_a_server_error

from tests.server_harness import start_tiny_server

NAME = "tiny"
EXAMPLES = 120


@pytest.fixture(scope="module")
def fuzz_server(tiny_qwen2_dir):
    s = start_tiny_server(tiny_qwen2_dir, NAME, max_model_len=64)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def schema(fuzz_server):
    return schemathesis.openapi.from_url(fuzz_server.base_url + "/openapi.json")


def _fuzz(server, operation, mode: schemathesis.GenerationMode) -> None:
    statuses: dict[int, int] = {}

    @given(case=operation.as_strategy(generation_mode=mode), keep_name=st.integers(0, 4))
    @settings(max_examples=EXAMPLES, deadline=None, phases=[Phase.generate], database=None,
              suppress_health_check=list(HealthCheck))
    def run(case, keep_name):
        if keep_name < 4 and isinstance(case.body, dict) and "model" in case.body:
            case.body["model"] = NAME
        response = case.call_and_validate(base_url=server.base_url, checks=[not_a_server_error], timeout=120)
        statuses[response.status_code] = statuses.get(response.status_code, 0) + 1

    run()
    print(operation.label, mode.value, statuses)
    assert not any(code >= 500 for code in statuses), statuses
    return statuses


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("mode", [schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE])
def test_no_server_errors(fuzz_server, schema, path, mode):
    statuses = _fuzz(fuzz_server, schema[path]["POST"], mode)
    if mode == schemathesis.GenerationMode.POSITIVE:
        assert statuses.get(200, 0) > 0, statuses  # valid requests really reached generation
    fuzz_server.wait_idle()
    assert fuzz_server.all_pages_free()
    assert httpx.get(fuzz_server.base_url + "/health").status_code == 200


def test_other_endpoints(fuzz_server, schema):
    for path in ("/v1/models", "/health", "/metrics"):
        _fuzz(fuzz_server, schema[path]["GET"], schemathesis.GenerationMode.POSITIVE)
