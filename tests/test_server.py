"""The OpenAI-compatible server, driven with the official ``openai`` client on a live 127.0.0.1 port.

Target: SmolLM2-135M-Instruct (real weights, float32). Draft: the same model with int8 weights, so
drafts are accepted often but not always (about 90%). Speculation is on (adaptive k, k <= 3) in every
server below; every greedy answer must equal offline ``LLM.generate`` *without* speculation.
"""
from __future__ import annotations

import asyncio
import random
import re

import httpx
import pytest
from openai import AsyncOpenAI, BadRequestError, NotFoundError, OpenAI

from specserve.engine.engine import EngineArgs, LLMEngine
from specserve.entrypoints.llm import LLM
from specserve.sampling_params import SamplingParams
from tests.conftest import requires_smollm2
from tests.server_harness import start_server

pytestmark = requires_smollm2

NAME = "smollm2-135m-instruct"
MAX_LEN = 512
K = 3
DRAFT_QUANTIZATION = "int8"
KV_GB = 0.5      # per model and rank: ~700 pages, room for every test's requests, and several engines fit in memory

PROMPTS = [
    "def fibonacci(n):",
    "The capital of France is",
    "Write a haiku about the sea.\n",
    "import numpy as np\n\n# compute the mean of a list\n",
    "Q: What is 12 * 7?\nA:",
    "Once upon a time, in a small village,",
    "class Stack:\n    def __init__(self):\n",
    "List three colors:\n1.",
]


@pytest.fixture(scope="module")
def smollm2():
    from specserve.models.loader import load_model
    return load_model(NAME), load_model(NAME, quantization=DRAFT_QUANTIZATION)


@pytest.fixture(scope="module", params=[1, 2], ids=["tp1", "tp2"])
def tp(request) -> int:
    """Every server test runs with the target whole and sharded over two ranks (tensor parallelism;
    SmolLM2's 3 KV heads split 1 and 2)."""
    return request.param


# tp2 runs on the same two cores as its ranks (about twice tp1's time): the tests below whose
# tensor-parallel case adds nothing to what other tp2 tests here and tests/test_tensor_parallel.py
# check (seeded sampling at tp2, concurrent streams at tp2 with preemption), and those of what the
# server alone does (stream framing, stop strings, admission), run unsharded only.
TP1_ONLY = pytest.mark.parametrize("tp", [1], ids=["tp1"], indirect=True)


def _spec_engine(smollm2, tp, adaptive=True, **kw) -> LLMEngine:
    target, draft = smollm2
    spec = {"method": "draft_model", "model": NAME, "num_speculative_tokens": K, "adaptive": adaptive,
            "draft_quantization": DRAFT_QUANTIZATION}
    kw.setdefault("kv_cache_memory_gb", KV_GB)
    return LLMEngine(EngineArgs(model=NAME, max_model_len=MAX_LEN, speculative_config=spec, tensor_parallel_size=tp,
                                **kw), loaded=target, loaded_draft=draft)


@pytest.fixture(scope="module")
def server(smollm2, tp):
    s = start_server(_spec_engine(smollm2, tp), NAME)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def offline(smollm2, tp):
    """Offline generation without speculation, at the server's tensor parallelism: the reference
    every greedy answer must equal."""
    with LLM(NAME, loaded=smollm2[0], max_model_len=MAX_LEN, tensor_parallel_size=tp, kv_cache_memory_gb=KV_GB) as llm:
        yield llm


def client(server) -> OpenAI:
    return OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=300)


def aclient(server) -> AsyncOpenAI:
    return AsyncOpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=600)


def greedy(max_tokens, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **kw)


# ---------------------------------------------------------------------- functional
def test_models_and_health(server):
    models = client(server).models.list()
    assert [m.id for m in models.data] == [NAME]
    assert httpx.get(server.base_url + "/health").status_code == 200


def test_completion_equals_offline(server, offline):
    c = client(server)
    ref = offline.generate(PROMPTS, greedy(24))
    for prompt, want in zip(PROMPTS, ref):
        r = c.completions.create(model=NAME, prompt=prompt, max_tokens=24, temperature=0)
        assert r.choices[0].text == want.outputs[0].text
        assert r.choices[0].finish_reason == want.outputs[0].finish_reason
        assert r.usage.prompt_tokens == len(want.prompt_token_ids)
        assert r.usage.completion_tokens == len(want.outputs[0].token_ids)
        assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert server.engine.spec_stats.num_draft_tokens > 0  # speculation really ran


def test_chat_equals_offline(server, offline):
    messages = [{"role": "system", "content": "You are terse."},
                {"role": "user", "content": "Name a prime number between 10 and 20."}]
    want = offline.chat(messages, greedy(32))[0]
    r = client(server).chat.completions.create(model=NAME, messages=messages, max_tokens=32, temperature=0)
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == want.outputs[0].text
    assert r.usage.prompt_tokens == len(want.prompt_token_ids)
    assert r.usage.completion_tokens == len(want.outputs[0].token_ids)


def _stream_completion(c, **kw) -> tuple[str, list, object]:
    text, finish, usage = [], [], None
    for chunk in c.completions.create(stream=True, stream_options={"include_usage": True}, **kw):
        if chunk.usage is not None:
            usage = chunk.usage
        for ch in chunk.choices:
            text.append(ch.text)
            if ch.finish_reason:
                finish.append(ch.finish_reason)
    return "".join(text), finish, usage


def _check_stream_equals_non_stream(server, stop):
    c = client(server)
    for prompt in PROMPTS[:4]:   # stop strings need the longer outputs to occur
        kw = dict(model=NAME, prompt=prompt, max_tokens=48 if stop else 24, temperature=0, stop=stop)
        full = c.completions.create(**kw)
        text, finish, usage = _stream_completion(c, **kw)
        assert text == full.choices[0].text
        assert finish == [full.choices[0].finish_reason]
        assert usage.completion_tokens == full.usage.completion_tokens
        if stop:
            assert not any(s in text for s in stop)


@TP1_ONLY   # the stream frames the leader's outputs, whatever the ranks
def test_stream_equals_non_stream(server):
    _check_stream_equals_non_stream(server, None)


@TP1_ONLY   # stop strings are the leader's detokenizer's, whatever the ranks
@pytest.mark.parametrize("stop", [["\n\n"], ["return", "):"], [" "]])
def test_stream_with_stop_equals_non_stream(server, stop):
    _check_stream_equals_non_stream(server, stop)


@TP1_ONLY   # framing of the stream, the leader's alone
def test_usage_chunk_only_when_asked(server):
    """The client's documented loop (``chunk.choices[0]``) works: no usage-only chunk (empty
    choices) unless ``stream_options.include_usage`` is true, and then it comes last."""
    c = client(server)
    kw = dict(model=NAME, prompt=PROMPTS[1], max_tokens=8, temperature=0)
    chunks = list(c.completions.create(stream=True, **kw))
    assert chunks and all(len(ch.choices) == 1 and ch.usage is None for ch in chunks)
    assert "".join(ch.choices[0].text for ch in chunks) == c.completions.create(**kw).choices[0].text
    for ch in c.chat.completions.create(stream=True, model=NAME, max_tokens=4,
                                        messages=[{"role": "user", "content": "Hi"}]):
        assert ch.choices[0].delta is not None
    chunks = list(c.completions.create(stream=True, stream_options={"include_usage": False}, **kw))
    assert all(len(ch.choices) == 1 for ch in chunks)
    chunks = list(c.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8
    assert all(len(ch.choices) == 1 for ch in chunks[:-1])


@TP1_ONLY   # the stream frames the leader's outputs, whatever the ranks
def test_chat_stream_equals_non_stream(server):
    c = client(server)
    kw = dict(model=NAME, messages=[{"role": "user", "content": "Write two short sentences about cats."}],
              max_tokens=40, temperature=0)
    full = c.chat.completions.create(**kw)
    parts, roles = [], []
    for chunk in c.chat.completions.create(stream=True, **kw):
        for ch in chunk.choices:
            roles.append(ch.delta.role)
            parts.append(ch.delta.content or "")
    assert "".join(parts) == full.choices[0].message.content
    assert roles[0] == "assistant"


def test_stop_string_and_finish_reason(server, offline):
    prompt = "1, 2, 3, 4, 5,"
    want = offline.generate([prompt], greedy(40, stop=[" 9"]))[0].outputs[0]
    r = client(server).completions.create(model=NAME, prompt=prompt, max_tokens=40, temperature=0, stop=[" 9"])
    assert r.choices[0].text == want.text and " 9" not in r.choices[0].text
    assert r.choices[0].finish_reason == "stop" == want.finish_reason


@TP1_ONLY   # seeded sampling at tp2: test_tensor_parallel.py
def test_seed_reproducible_and_matches_offline(smollm2, tp):
    """Seeded sampling: the same seed gives the same text, as offline with the same (fixed) k.
    (With adaptive k the realization depends on each step's k; the distribution does not.)"""
    s = start_server(_spec_engine(smollm2, tp, adaptive=False), NAME)
    try:
        c = client(s)
        kw = dict(model=NAME, prompt=PROMPTS[5], max_tokens=20, temperature=0.9, top_p=0.95)
        a = c.completions.create(seed=123, **kw).choices[0].text
        b = c.completions.create(seed=123, **kw).choices[0].text
        others = {c.completions.create(seed=s_, **kw).choices[0].text for s_ in (1, 2, 3)}
        assert a == b
        assert len(others | {a}) > 1
        spec = {"method": "draft_model", "model": NAME, "num_speculative_tokens": K, "adaptive": False,
                "draft_quantization": DRAFT_QUANTIZATION}   # the server's draft: sampling depends on its q
        with LLM(NAME, loaded=smollm2[0], loaded_draft=smollm2[1], max_model_len=MAX_LEN, speculative_config=spec,
                 tensor_parallel_size=tp, kv_cache_memory_gb=KV_GB) as llm:
            want = llm.generate([PROMPTS[5]], SamplingParams(temperature=0.9, top_p=0.95, max_tokens=20, seed=123))
        assert a == want[0].outputs[0].text
    finally:
        s.stop()


def test_logprobs(server, offline):
    """Completion logprobs equal offline logprobs (raw target distribution), top-k sorted."""
    prompt = PROMPTS[0]
    want = offline.generate([prompt], greedy(12, logprobs=3))[0].outputs[0]
    r = client(server).completions.create(model=NAME, prompt=prompt, max_tokens=12, temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(want.token_ids) == len(lp.token_logprobs) == len(lp.top_logprobs)
    for tid, entry, got, top in zip(want.token_ids, want.logprobs, lp.token_logprobs, lp.top_logprobs):
        assert got == pytest.approx(entry[tid].logprob, abs=1e-4)
        assert len(top) == 3 and max(top.values()) == pytest.approx(got, abs=1e-4)  # greedy = top-1
    assert "".join(lp.tokens) == r.choices[0].text
    chat = client(server).chat.completions.create(
        model=NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=6, temperature=0, logprobs=True,
        top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    assert all(len(t.top_logprobs) == 2 and t.top_logprobs[0].logprob >= t.top_logprobs[1].logprob for t in content)


def test_n_and_prompt_lists(server, offline):
    c = client(server)
    r = c.completions.create(model=NAME, prompt=PROMPTS[:3], max_tokens=10, temperature=0, n=2)
    assert sorted(ch.index for ch in r.choices) == list(range(6))
    want = offline.generate(PROMPTS[:3], greedy(10))
    for ch in r.choices:
        assert ch.text == want[ch.index // 2].outputs[0].text
    ids = offline.get_tokenizer().encode(PROMPTS[1])
    r = c.completions.create(model=NAME, prompt=ids, max_tokens=10, temperature=0)
    assert r.choices[0].text == want[1].outputs[0].text


# ---------------------------------------------------------------------- errors
def _error(resp: httpx.Response) -> dict:
    body = resp.json()
    assert set(body) == {"error"} and {"message", "type", "param", "code"} <= set(body["error"])
    return body["error"]


@pytest.mark.parametrize("body, fragment", [
    ({"prompt": "x", "temperature": -1}, "temperature"),
    ({"prompt": "x", "top_p": 0}, "top_p"),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "x", "n": 0}, "n"),
    ({"prompt": "x", "logprobs": 99}, "logprobs"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": [10 ** 9]}, "1000000000"),
    ({"prompt": "x", "max_tokens": 10 ** 6}, "maximum context length"),
    ({"prompt": "hello " * 600, "max_tokens": 5}, "maximum context length"),
    ({"prompt": "x", "stop": [""]}, "stop"),
    ({"prompt": "x", "seed": "abc"}, "seed"),
    ({"prompt": "x", "echo": True, "max_tokens": -1}, "max_tokens"),
    ({"prompt": 5}, "prompt"),
    ({}, "prompt"),
])
def test_bad_completion_requests_are_400(server, body, fragment):
    resp = httpx.post(server.base_url + "/v1/completions", json={"model": NAME, **body}, timeout=60)
    assert resp.status_code == 400, resp.text
    err = _error(resp)
    assert fragment in err["message"] and err["type"] == "invalid_request_error"


def test_bad_chat_requests_are_400(server):
    url = server.base_url + "/v1/chat/completions"
    for body in ({"messages": []}, {"messages": [{"content": "no role"}]},
                 {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2},
                 {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}):
        resp = httpx.post(url, json={"model": NAME, **body}, timeout=60)
        assert resp.status_code == 400, (body, resp.text)
        _error(resp)
    resp = httpx.post(url, content=b"{not json", headers={"content-type": "application/json"}, timeout=60)
    assert resp.status_code == 400 and "not valid JSON" in _error(resp)["message"]
    resp = httpx.post(url, content=b'{"model": "x", "messages": []}', timeout=60)  # no Content-Type
    assert resp.status_code == 400 and "Content-Type: application/json" in _error(resp)["message"]


def test_unknown_model_is_404(server):
    with pytest.raises(NotFoundError) as e:
        client(server).completions.create(model="gpt-4", prompt="x", max_tokens=2)
    assert "gpt-4" in str(e.value)
    with pytest.raises(BadRequestError):
        client(server).completions.create(model=NAME, prompt="x", max_tokens=2, top_p=5)


@TP1_ONLY   # admission is the server's, before any rank sees a request
def test_queue_limit_is_503_and_a_request_larger_than_the_queue_is_400(smollm2, tp):
    s = start_server(_spec_engine(smollm2, tp), NAME, max_queue_len=2)
    try:
        async def run():
            c = aclient(s)
            tasks = [asyncio.create_task(c.completions.create(model=NAME, prompt=PROMPTS[i % 8], max_tokens=24,
                                                              temperature=0)) for i in range(80)]
            return await asyncio.gather(*tasks, return_exceptions=True)
        results = asyncio.run(run())
        rejected = [r for r in results if isinstance(r, Exception)]
        assert rejected and all(getattr(r, "status_code", None) == 503 for r in rejected)
        assert any(not isinstance(r, Exception) for r in results)
        # a request bigger than the whole queue can never be admitted: 400 naming the limit, not 503
        with pytest.raises(BadRequestError) as e:
            client(s).completions.create(model=NAME, prompt=PROMPTS[:2], n=2, max_tokens=2)
        assert "4 completions" in str(e.value) and "queue limit of 2" in str(e.value)
        s.wait_idle()
        assert s.all_pages_free()
    finally:
        s.stop()


# ---------------------------------------------------------------------- load
def _load_requests(n: int, seed: int = 0) -> list[dict]:
    """Mixed lengths and parameters; every third request samples, the rest are greedy."""
    rng = random.Random(seed)
    reqs = []
    for i in range(n):
        prompt = PROMPTS[i % len(PROMPTS)] + " " + " ".join(rng.choice(["data", "loop", "sun", "tree", "key"])
                                                             for _ in range(rng.randint(0, 48)))
        kw = dict(prompt=prompt, max_tokens=rng.randint(4, 24))
        if i % 3 == 2:
            kw.update(temperature=0.8, top_p=0.9, seed=i)
        else:
            kw.update(temperature=0)
            if i % 4 == 1:
                kw["stop"] = ["\n"]
            if i % 5 == 3:
                kw["frequency_penalty"] = 0.5
        reqs.append(kw)
    return reqs


def _offline_greedy(offline, reqs: list[dict]) -> dict[int, str]:
    idx = [i for i, r in enumerate(reqs) if r["temperature"] == 0]
    params = [greedy(reqs[i]["max_tokens"], stop=reqs[i].get("stop"),
                     frequency_penalty=reqs[i].get("frequency_penalty", 0.0)) for i in idx]
    outs = offline.generate([reqs[i]["prompt"] for i in idx], params)
    return {i: o.outputs[0].text for i, o in zip(idx, outs)}


async def _stream_all(server, reqs: list[dict]) -> list[tuple[str, str]]:
    c = aclient(server)

    async def one(kw):
        parts, finish = [], None
        stream = await c.completions.create(model=NAME, stream=True, **kw)
        async for chunk in stream:
            for ch in chunk.choices:
                parts.append(ch.text)
                finish = ch.finish_reason or finish
        return "".join(parts), finish

    return await asyncio.gather(*(one(kw) for kw in reqs))


def _check_load(server, offline, reqs):
    results = asyncio.run(_stream_all(server, reqs))
    want = _offline_greedy(offline, reqs)
    assert all(finish in ("stop", "length") for _, finish in results)
    mismatched = [i for i, text in want.items() if results[i][0] != text]
    assert not mismatched, f"greedy outputs differ from offline for requests {mismatched}"
    server.wait_idle()
    assert server.all_pages_free()
    assert httpx.get(server.base_url + "/health").status_code == 200


@TP1_ONLY   # at tp2: the preemption case below
def test_64_concurrent_streams(server, offline):
    reqs = _load_requests(64)
    _check_load(server, offline, reqs)
    metrics = httpx.get(server.base_url + "/metrics").text
    assert float(re.search(r"^specserve_spec_decode_num_accepted_tokens_total (\S+)", metrics, re.M).group(1)) > 0
    assert 'specserve_num_requests_running 0.0' in metrics


def test_32_concurrent_streams_with_preemption(smollm2, tp, offline):
    """A pool of 12 pages of 16 tokens holds ~2 of these requests: the rest wait or are preempted."""
    s = start_server(_spec_engine(smollm2, tp, num_blocks=12), NAME)
    try:
        _check_load(s, offline, _load_requests(32))
        preempted = re.search(r"^specserve_num_preemptions_total (\S+)", httpx.get(s.base_url + "/metrics").text, re.M)
        assert float(preempted.group(1)) > 0
        s.engine.block_manager.check_invariants()
    finally:
        s.stop()


def test_disconnects_abort_and_free_pages(server, offline):
    """20 clients leave mid-stream; 6 others finish with the offline output; no page stays held."""
    keep = _load_requests(6, seed=1)
    for r in keep:
        r.update(temperature=0, max_tokens=30)
        r.pop("seed", None), r.pop("top_p", None)

    async def run():
        c = aclient(server)

        async def leaver(i):
            stream = await c.completions.create(model=NAME, prompt=PROMPTS[i % 8], max_tokens=200,
                                                temperature=0, stream=True)
            got = 0
            async for chunk in stream:
                got += 1
                if got >= 2 + i % 3:
                    break
            await stream.close()

        async def stayer(kw):
            r = await c.completions.create(model=NAME, **kw)
            return r.choices[0].text

        leavers = [asyncio.create_task(leaver(i)) for i in range(20)]
        stayers = [asyncio.create_task(stayer(kw)) for kw in keep]
        await asyncio.gather(*leavers)
        return await asyncio.gather(*stayers)

    texts = asyncio.run(run())
    want = _offline_greedy(offline, keep)
    assert texts == [want[i] for i in range(len(keep))]
    server.wait_idle()
    assert server.all_pages_free()
    metrics = httpx.get(server.base_url + "/metrics").text
    assert float(re.search(r"^specserve_num_requests_running (\S+)", metrics, re.M).group(1)) == 0


def test_non_streamed_client_timeout_aborts(server):
    """A non-streamed request whose client gives up (read timeout closes the connection) is aborted."""
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.base_url + "/v1/completions", timeout=httpx.Timeout(10.0, read=0.5),
                   json={"model": NAME, "prompt": PROMPTS[0], "max_tokens": 400, "temperature": 0,
                         "ignore_eos": True})
    server.wait_idle(timeout=3)   # generating 400 tokens takes far longer than this
    assert server.all_pages_free()
