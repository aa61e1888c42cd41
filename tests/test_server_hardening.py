"""The server against hostile or careless clients: every bad input a 400 (413 for a body over the
limit) naming what is wrong, never a 500; the event loop free while big prompts are tokenized;
gauges right after aborts; fields we would not honour refused by name, harmless ones accepted."""
from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from tests.server_harness import start_tiny_server

NAME = "tiny"
LIMIT = 6 * 2**20


@pytest.fixture(scope="module")
def server(tiny_qwen2_dir):
    s = start_tiny_server(tiny_qwen2_dir, NAME, max_model_len=256, max_request_bytes=LIMIT)
    yield s
    s.stop()


def post(server, path, body, **kw):
    """JSON with \\u escapes (as most clients send it), so a lone surrogate reaches the server."""
    return httpx.post(server.base_url + path, content=json.dumps({"model": NAME, **body}),
                      headers={"content-type": "application/json"}, timeout=120, **kw)


def error(resp) -> dict:
    body = resp.json()
    assert set(body) == {"error"} and {"message", "type", "param", "code"} <= set(body["error"])
    return body["error"]


@pytest.mark.parametrize("body, param, fragment", [
    ({"prompt": "x", "stream": "yes"}, "stream", "valid boolean"),
    ({"prompt": "x", "max_tokens": True}, "max_tokens", "valid integer"),
    ({"prompt": [True, False]}, "prompt", "valid"),
    ({"prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, "stop", "at most 4"),
    ({"prompt": "ab\ud800cd"}, "prompt", "could not be tokenized"),
    ({"prompt": "x", "guided_json": {"type": "object"}}, "guided_json", "not supported"),
    ({"prompt": "x", "response_format": {"type": "json_object"}}, "response_format", "not supported"),
])
def test_bad_completion_bodies_are_400_naming_the_field(server, body, param, fragment):
    resp = post(server, "/v1/completions", {"max_tokens": 2, **body})
    assert resp.status_code == 400, resp.text
    err = error(resp)
    assert err["param"].split(".")[0] == param and fragment in err["message"], err


@pytest.mark.parametrize("extra, param", [
    ({"messages": [{"role": "user", "content": "ab\ud800cd"}]}, "messages"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {}}}}, "response_format"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "required"}, "tool_choice"),
    ({"tool_choice": {"type": "function", "function": {"name": "f"}}}, "tool_choice"),
])
def test_bad_chat_bodies_are_400_naming_the_field(server, extra, param):
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **extra}
    resp = post(server, "/v1/chat/completions", body)
    assert resp.status_code == 400, resp.text
    assert error(resp)["param"] == param


def test_harmless_fields_are_accepted(server):
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "user": "u1",
            "metadata": {"run": "7"}, "response_format": {"type": "text"},
            "tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "none"}
    assert post(server, "/v1/chat/completions", body).status_code == 200
    assert post(server, "/v1/completions", {"prompt": "x", "max_tokens": 2, "temperature": 1}).status_code == 200


def test_head_health(server):
    assert httpx.head(server.base_url + "/health").status_code == 200


def test_bodies_over_the_limit_are_413_and_the_server_goes_on(server):
    big = "x" * (LIMIT + 1)
    resp = post(server, "/v1/completions", {"prompt": big})
    assert resp.status_code == 413 and "limit of" in error(resp)["message"]

    def chunks():          # no Content-Length: counted as it arrives
        for _ in range(7):
            yield b" " * 2**20
    resp = httpx.post(server.base_url + "/v1/completions", content=chunks(),
                      headers={"content-type": "application/json"}, timeout=120)
    assert resp.status_code == 413
    assert post(server, "/v1/completions", {"prompt": "x", "max_tokens": 2}).status_code == 200


def test_tokenizing_a_huge_prompt_leaves_the_event_loop_free(server):
    """A 4 MB prompt takes seconds to tokenize (then is refused as too long): meanwhile /health
    and a small request are answered."""
    result = {}

    def big():
        result["resp"] = post(server, "/v1/completions", {"prompt": "the quick brown fox " * 200_000})
    t = threading.Thread(target=big)
    t.start()
    time.sleep(1.0)
    t0 = time.monotonic()
    assert httpx.get(server.base_url + "/health", timeout=30).status_code == 200
    health_s = time.monotonic() - t0
    t.join()
    assert result["resp"].status_code == 400 and "maximum context length" in error(result["resp"])["message"]
    assert health_s < 1.0, f"/health took {health_s:.2f} s behind the big prompt"


def test_gauges_reflect_an_abort_at_once(server):
    """A stream left mid-way: running requests and KV usage go back to 0 without another step."""
    with httpx.stream("POST", server.base_url + "/v1/completions", timeout=120,
                      json={"model": NAME, "prompt": "hello", "max_tokens": 200, "stream": True,
                            "ignore_eos": True}) as r:
        next(r.iter_lines())
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        metrics = httpx.get(server.base_url + "/metrics").text
        if "specserve_num_requests_running 0.0" in metrics and "specserve_kv_cache_usage_perc 0.0" in metrics:
            break
        time.sleep(0.05)
    assert "specserve_num_requests_running 0.0" in metrics and "specserve_kv_cache_usage_perc 0.0" in metrics
