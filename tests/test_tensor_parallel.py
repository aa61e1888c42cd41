"""Tensor parallelism at TP = 2 on this CPU (gloo; the engine spawns its worker rank).

Oracles: the same model at TP = 1 (itself checked against HF transformers in test_model_oracle)
for logits; the unsharded layer for each quantized shard; at TP = 2, greedy without speculation for
every speculation method, each prompt alone for a batch, the same seed for sampling.
"""
from __future__ import annotations

import os
import signal
import time

import pytest
import torch

from specserve import LLM, SamplingParams
from specserve.config import ModelConfig
from specserve.distributed.group import TensorParallelError
from specserve.distributed.launcher import TensorParallelLauncher
from specserve.distributed.runner import pack_step_message, unpack_step_message
from specserve.distributed.sharding import plan_shard, shard_weights
from specserve.models.linear import make_linear
from specserve.models.loader import load_model
from tests.conftest import requires_smollm2
from tests.tiny_models import make_layer_skip_draft, make_tiny_model

GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
LENGTHS = [1, 4, 9, 17, 30, 45, 3, 60]


def prompts(lengths=LENGTHS, seed=0, vocab=290):
    g = torch.Generator().manual_seed(seed)
    return [{"prompt_token_ids": torch.randint(3, vocab, (n,), generator=g).tolist()} for n in lengths]


def token_ids(outs):
    return [o.outputs[0].token_ids for o in outs]


def assert_logits_close(got: torch.Tensor, ref: torch.Tensor) -> None:
    """Within 1e-5 of the logits' largest magnitude: float32 additions in another order (the
    partial sums of two ranks) move a logit by a few ulps of the values it was summed from."""
    err, scale = (got - ref).abs().max().item(), ref.abs().max().item()
    assert err <= 1e-5 * scale, f"max |TP2 - TP1| = {err:.3g} for logits up to {scale:.3g}"


def forward_logits(llm, seqs: list[list[int]]) -> torch.Tensor:
    """Logits ``[T, V]`` of every token of ``seqs`` prefilled in one forward (pages 4i.. for sequence i)."""
    runner = llm.llm_engine.target.runner
    ids = torch.tensor([t for s in seqs for t in s])
    positions = [p for s in seqs for p in range(len(s))]
    tables = [list(range(4 * i, 4 * i + 4)) for i in range(len(seqs))]
    _, logits = runner.forward_with_logits(ids, positions, tables, [0] * len(seqs), [len(s) for s in seqs],
                                           list(range(len(ids))))
    return logits


@pytest.fixture(scope="module")
def wide_dir(tmp_path_factory):
    """8 heads of 64 and 2 KV heads, MLP 1024: each rank's o_proj and down_proj columns are whole
    256-value superblocks, so the int8 / int4 paths shard too."""
    d = tmp_path_factory.mktemp("tp_wide")
    make_tiny_model("qwen2", d, hidden_size=512, num_heads=8, num_kv_heads=2, num_layers=2)
    return str(d)


# ---------------------------------------------------------------------- the split
@pytest.mark.parametrize("heads,kv,tp,expect", [
    (8, 2, 2, [((0, 4), (0, 1)), ((4, 8), (1, 2))]),
    (9, 3, 2, [((0, 3), (0, 1)), ((3, 9), (1, 3))]),                     # SmolLM2: uneven KV groups
    (8, 2, 4, [((0, 2), (0, 1)), ((2, 4), (0, 1)), ((4, 6), (1, 2)), ((6, 8), (1, 2))]),   # replicated KV
])
def test_plan_shard_heads(heads, kv, tp, expect):
    cfg = ModelConfig("qwen2", 300, heads * 16, 2 * heads * 16, 1, heads, kv, 16)
    got = [(s.q_heads, s.kv_heads) for s in (plan_shard(cfg, r, tp) for r in range(tp))]
    assert got == expect


def test_plan_shard_refuses_splits_it_cannot_make():
    cfg = ModelConfig("qwen2", 300, 96, 192, 1, 6, 3, 16)
    with pytest.raises(ValueError, match="cannot split 6 attention heads with 3 KV heads"):
        plan_shard(cfg, 0, 4)
    smol = ModelConfig("llama", 300, 576, 1536, 1, 9, 3, 64)
    with pytest.raises(ValueError, match="superblocks"):
        plan_shard(smol, 0, 2, quantized=True)


@pytest.mark.parametrize("quantization", ["none", "int8", "int4"])
def test_shards_add_up_to_the_unsharded_layers(wide_dir, quantization):
    """Column-parallel shards concatenate, row-parallel shards sum, to the unsharded linear
    (quantized: the same superblocks, so only the float additions' order differs)."""
    loaded = load_model(wide_dir)
    cfg, w = loaded.config, loaded.weights
    shards = [shard_weights(cfg, w, plan_shard(cfg, r, 2, quantization != "none")) for r in range(2)]
    lin = lambda ws, name: make_linear([ws[name]], None, quantization, name)
    p = "model.layers.1."
    for name, parallel in [(p + "self_attn.q_proj.weight", "column"), (p + "mlp.up_proj.weight", "column"),
                           ("lm_head.weight", "column"), (p + "self_attn.o_proj.weight", "row"),
                           (p + "mlp.down_proj.weight", "row")]:
        full_w = w[name]
        xin = torch.randn(5, full_w.shape[1], generator=torch.Generator().manual_seed(1))
        full = lin(w, name)(xin)
        if parallel == "column":
            got = torch.cat([lin(s, name)(xin) for s in shards], dim=1)
            assert torch.equal(got, full), name          # the same rows, the same kernel: the same bits
        else:
            cols = [s[name].shape[1] for s in shards]
            parts = torch.split(xin, cols, dim=1)
            got = sum(lin(s, name)(part.contiguous()) for s, part in zip(shards, parts))
            torch.testing.assert_close(got, full, atol=1e-4, rtol=1e-5, msg=name)


def test_step_message_round_trip():
    masks = [torch.tensor([[1, 0], [1, 1]], dtype=torch.bool), None]
    moves = [(torch.tensor([7, 9]), torch.tensor([5, 6]))]
    msg = pack_step_message(torch.tensor([11, 12, 13]), [4, 5, 0], [[3, 1], [8]], [4, 0], [2, 1], [0, 2],
                            masks, (2, 5), moves)
    got = unpack_step_message(msg)
    assert got["input_ids"].tolist() == [11, 12, 13] and got["positions"] == [4, 5, 0]
    assert got["block_tables"] == [[3, 1], [8]] and got["context_lens"] == [4, 0] and got["query_lens"] == [2, 1]
    assert got["logits_rows"] == [0, 2] and got["aux_layers"] == (2, 5)
    assert torch.equal(got["tree_masks"][0], masks[0]) and got["tree_masks"][1] is None
    assert got["moves"][0].tolist() == [7, 9] and got["moves"][1].tolist() == [5, 6]


# ---------------------------------------------------------------------- logits
# TP = 1 and 2 add the partial sums of o_proj and down_proj in different orders; float32 KV entries
# keep those float32-rounding differences as they are, where a 16-bit cache rounds them to its own
# resolution (2^-11 relative), so the comparisons with TP = 1 run on float32 entries.
KV32 = "float32"


@requires_smollm2
def test_tp2_logits_match_tp1_on_smollm2():
    """Real weights with uneven KV groups (3 KV heads: 1 and 2 per rank)."""
    seqs = [p["prompt_token_ids"] for p in prompts([1, 5, 17, 40], vocab=49000)]
    ref = forward_logits(LLM("smollm2-135m-instruct", kv_cache_dtype=KV32), seqs)
    with LLM("smollm2-135m-instruct", tensor_parallel_size=2, kv_cache_dtype=KV32) as llm:
        got = forward_logits(llm, seqs)
    assert_logits_close(got, ref)
    assert torch.equal(got.argmax(1), ref.argmax(1))


def test_tp2_logits_match_tp1_and_rows_do_not_depend_on_the_batch(wide_dir):
    seqs = [p["prompt_token_ids"] for p in prompts([1, 5, 17, 40])]
    ref = forward_logits(LLM(wide_dir, kv_cache_dtype=KV32), seqs)
    with LLM(wide_dir, tensor_parallel_size=2, kv_cache_dtype=KV32) as llm:
        got = forward_logits(llm, seqs)
        assert_logits_close(got, ref)
        start = 0
        for s in seqs:   # each sequence alone: the same bits as inside the batch of four
            assert torch.equal(forward_logits(llm, [s]), got[start:start + len(s)])
            start += len(s)


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_quantized_tp2_rows_do_not_depend_on_the_batch(wide_dir, quantization):
    """The all-reduce keeps the integer kernels' batch invariance (TP = 1 vs 2 differ by the order
    of the partial sums, which quantizing the next layer's activations can amplify: see
    BENCHMARKS.md; the shard test above checks each layer)."""
    seqs = [p["prompt_token_ids"] for p in prompts([3, 17, 40])]
    with LLM(wide_dir, quantization=quantization, tensor_parallel_size=2) as llm:
        got = forward_logits(llm, seqs)
        assert torch.equal(forward_logits(llm, [seqs[1]]), got[3:20])
        out = token_ids(llm.generate(prompts([5, 30]), GREEDY))
        assert out == [token_ids(llm.generate([p], GREEDY))[0] for p in prompts([5, 30])]


# ---------------------------------------------------------------------- generation
@pytest.fixture(scope="module")
def tp2_reference(tiny_qwen2_dir):
    """Greedy at TP = 2 without speculation, batch of 8 and each prompt alone."""
    with LLM(tiny_qwen2_dir, tensor_parallel_size=2) as llm:
        batch = token_ids(llm.generate(prompts(), GREEDY))
        alone = [token_ids(llm.generate([p], GREEDY))[0] for p in prompts()]
    return batch, alone


def test_tp2_batch_equals_each_alone(tp2_reference):
    batch, alone = tp2_reference
    assert batch == alone


@pytest.fixture(scope="module")
def tp_draft_dir(tiny_qwen2_dir, tmp_path_factory):
    d = tmp_path_factory.mktemp("tp_draft") / "perturbed"
    make_layer_skip_draft(tiny_qwen2_dir, d, keep_layers=3, noise=0.07)
    return str(d)


@pytest.mark.parametrize("method", ["draft_model", "mtp", "eagle", "ngram"])
def test_tp2_speculation_greedy_equals_no_speculation(tiny_qwen2_dir, tp2_reference, tp_draft_dir,
                                                      trained_tiny_head, trained_tiny_eagle3_head, method):
    spec = {"method": method, "num_speculative_tokens": 3, "adaptive": False}
    spec["model"] = {"draft_model": tp_draft_dir, "mtp": trained_tiny_eagle3_head, "eagle": trained_tiny_head,
                     "ngram": None}[method]
    batch, _ = tp2_reference
    cores = torch.get_num_threads()
    with LLM(tiny_qwen2_dir, tensor_parallel_size=2, speculative_config=spec) as llm:
        drafting = _watch_drafts(llm) if method == "draft_model" else None
        assert token_ids(llm.generate([prompts()[3]], GREEDY)) == [batch[3]]        # batch 1
        assert token_ids(llm.generate(prompts(), GREEDY)) == batch                  # batch 8
        eng = llm.llm_engine
        assert eng.spec_stats.num_accepted_tokens > 0
        assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks
        if drafting is not None and cores > max(1, (os.cpu_count() or 1) // 2):
            # the leader drafts with every core the engine had while the worker sleeps
            assert drafting["threads"] == {cores} and drafting["wall_s"] > 0
            assert torch.get_num_threads() == max(1, (os.cpu_count() or 1) // 2)
            assert drafting["worker_cpu_s"] <= 0.25 * drafting["wall_s"] + 0.05, drafting


def _cpu_seconds(pid: int) -> float:
    """User + system CPU time of process ``pid`` (all its threads), from /proc."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _watch_drafts(llm) -> dict:
    """Record, over every proposal of the leader's draft, the leader's torch thread count, the
    wall time and the CPU time the worker rank spent meanwhile (a worker spinning in its wait
    would spend about the wall time)."""
    worker = llm.llm_engine.target.launcher.processes[0].pid
    proposer = llm.llm_engine.worker.proposer
    propose, seen = proposer.propose, {"threads": set(), "wall_s": 0.0, "worker_cpu_s": 0.0}

    def watched(batch, ks):
        cpu, t = _cpu_seconds(worker), time.perf_counter()
        seen["threads"].add(torch.get_num_threads())
        try:
            return propose(batch, ks)
        finally:
            seen["wall_s"] += time.perf_counter() - t
            seen["worker_cpu_s"] += _cpu_seconds(worker) - cpu

    proposer.propose = watched
    return seen


def test_tp2_seeded_sampling_is_reproducible_and_batch_invariant(tiny_qwen2_dir, tp_draft_dir):
    """Seeded sampling repeats at TP = 2, with speculation and without; without it, a batch of 8
    equals each prompt alone. (With speculation a sequence's samples depend on which steps it
    drafted in, which the batch can change: the distribution is the target's either way, the
    draws are not the same ones; test_spec_distribution checks the distribution.)"""
    params = [SamplingParams(temperature=0.9, top_p=0.95, seed=100 + i, max_tokens=16, ignore_eos=True)
              for i in range(8)]
    spec = {"method": "draft_model", "model": tp_draft_dir, "num_speculative_tokens": 3, "adaptive": False}
    with LLM(tiny_qwen2_dir, tensor_parallel_size=2, speculative_config=spec) as llm:
        first = token_ids(llm.generate(prompts(), params))
        assert token_ids(llm.generate(prompts(), params)) == first
    with LLM(tiny_qwen2_dir, tensor_parallel_size=2) as llm:
        batch = token_ids(llm.generate(prompts(), params))
        assert token_ids(llm.generate(prompts(), params)) == batch
        assert [token_ids(llm.generate([p], sp))[0] for p, sp in zip(prompts(), params)] == batch


# ---------------------------------------------------------------------- faults
def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_a_killed_worker_fails_the_engine_at_once_and_shutdown_leaves_no_process(wide_dir):
    llm = LLM(wide_dir, tensor_parallel_size=2)
    llm.generate([[5, 6, 7]], GREEDY)
    worker = llm.llm_engine.target.launcher.processes[0]
    os.kill(worker.pid, signal.SIGKILL)
    worker.join(5)
    assert "exited with code -9" in llm.llm_engine.health()
    t0 = time.monotonic()
    with pytest.raises(TensorParallelError, match="rank 1 .* exited with code -9"):
        llm.generate([[5, 6, 7]], GREEDY)
    assert time.monotonic() - t0 < 5
    llm.shutdown()
    assert _gone(worker.pid)


def test_a_hung_worker_fails_the_step_within_the_timeout(wide_dir):
    llm = LLM(wide_dir, tensor_parallel_size=2, distributed_timeout_s=2)
    llm.generate([[5, 6, 7]], GREEDY)
    worker = llm.llm_engine.target.launcher.processes[0]
    os.kill(worker.pid, signal.SIGSTOP)
    t0 = time.monotonic()
    with pytest.raises(TensorParallelError, match="did not answer within 2 s"):
        llm.generate([[5, 6, 7]], GREEDY)
    assert time.monotonic() - t0 < 10
    llm.shutdown()                   # kills the stopped worker
    worker.join(5)
    assert _gone(worker.pid)


def test_a_worker_that_cannot_start_is_reported():
    launcher = TensorParallelLauncher(2, "cpu", 5.0)
    group = launcher.start({1: {"device": "cpu"}})     # no weights: the worker's build fails
    with pytest.raises(TensorParallelError, match=r"worker rank 1 .* exited with code 1: TypeError"):
        group.ready(60)
    launcher.shutdown()
    assert all(not p.is_alive() for p in launcher.processes)


def test_bad_tensor_parallel_size_is_refused(wide_dir):
    with pytest.raises(ValueError, match="tensor_parallel_size must be an integer >= 1, got 0"):
        LLM(wide_dir, tensor_parallel_size=0)
    with pytest.raises(ValueError, match="cannot split 8 attention heads with 2 KV heads"):
        LLM(wide_dir, tensor_parallel_size=3)


def test_under_torchrun_every_rank_runs_the_same_program(wide_dir, tmp_path):
    import json
    import subprocess
    import sys

    from tests.server_harness import free_port

    out = tmp_path / "out.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port()),
           "tests/tp_torchrun_script.py", wide_dir, str(out)]
    proc = subprocess.run(cmd, cwd=os.path.dirname(os.path.dirname(__file__)), capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    with LLM(wide_dir, tensor_parallel_size=2) as llm:    # the engine's own workers: the same arithmetic
        want = token_ids(llm.generate([{"prompt_token_ids": [5, 6, 7, 8]}, {"prompt_token_ids": [40, 41]}], params))
    assert json.loads(out.read_text()) == want


def test_the_server_answers_503_when_a_worker_dies(wide_dir):
    import httpx

    from specserve.engine.engine import EngineArgs, LLMEngine
    from tests.server_harness import start_server

    s = start_server(LLMEngine(EngineArgs(model=wide_dir, tensor_parallel_size=2)), "tiny")
    try:
        body = {"model": "tiny", "prompt": "def hello", "max_tokens": 4, "temperature": 0}
        assert httpx.post(s.base_url + "/v1/completions", json=body, timeout=60).status_code == 200
        assert httpx.get(s.base_url + "/health").status_code == 200
        worker = s.engine.target.launcher.processes[0]
        os.kill(worker.pid, signal.SIGKILL)
        worker.join(5)
        health = httpx.get(s.base_url + "/health")
        assert health.status_code == 503 and "exited with code -9" in health.json()["error"]["message"]
        r = httpx.post(s.base_url + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 503 and r.json()["error"]["type"] == "service_unavailable"
    finally:
        s.stop()
    assert _gone(worker.pid)


def test_an_interrupted_step_fails_the_engine_at_once(wide_dir):
    """An error on rank 0 inside a forward leaves the worker mid-step: the engine must stop, not
    pair the wrong collectives or wait out the timeout."""
    llm = LLM(wide_dir, tensor_parallel_size=2, distributed_timeout_s=30)
    layer = llm.llm_engine.target.model.layers[1]
    name = "forward_fused" if llm.llm_engine.target.model.fused else "forward"   # the one the model calls
    original = getattr(layer, name)

    def boom(*a, **kw):
        setattr(layer, name, original)
        raise KeyboardInterrupt
    setattr(layer, name, boom)
    with pytest.raises(KeyboardInterrupt):
        llm.generate([[5, 6, 7]], GREEDY)
    assert "interrupted" in llm.llm_engine.health()
    t0 = time.monotonic()
    with pytest.raises(TensorParallelError, match="out of step"):
        llm.generate([[5, 6, 7]], GREEDY)
    worker = llm.llm_engine.target.launcher.processes[0]
    llm.shutdown()
    assert time.monotonic() - t0 < 10 and _gone(worker.pid)


def test_no_worker_outlives_a_failed_or_dropped_engine(wide_dir):
    import gc
    import multiprocessing

    with pytest.raises(Exception, match="no-such-draft"):
        LLM(wide_dir, tensor_parallel_size=2, speculative_config={"method": "draft_model", "model": "no-such-draft"})
    assert not [p for p in multiprocessing.active_children() if p.name.startswith("specserve-tp")]
    llm = LLM(wide_dir, tensor_parallel_size=2)
    worker = llm.llm_engine.target.launcher.processes[0]
    del llm
    gc.collect()
    worker.join(10)
    assert _gone(worker.pid)


def test_teacher_forcing_at_tp2(wide_dir):
    """Teacher forcing (bench --quality; the head-data precompute takes logits the same way, through
    the runner) works sharded and agrees with TP = 1."""
    from specserve.benchmarks.quality import teacher_forced

    segs = [p["prompt_token_ids"] for p in prompts([12, 30])]
    ref = teacher_forced(LLM(wide_dir, kv_cache_dtype=KV32).llm_engine, segs)
    with LLM(wide_dir, tensor_parallel_size=2, kv_cache_dtype=KV32) as llm:
        got = teacher_forced(llm.llm_engine, segs)
    # this random model's perplexity is ~exp(68): rel 1e-4 is the mean NLL within 1e-4 (1.5e-6 relative)
    assert got["argmax"] == ref["argmax"] and got["perplexity"] == pytest.approx(ref["perplexity"], rel=1e-4)


def test_keepalive_messages_keep_the_ranks_in_step(wide_dir):
    with LLM(wide_dir, tensor_parallel_size=2) as llm:
        before = token_ids(llm.generate(prompts([5, 9]), GREEDY))
        channel = llm.llm_engine.target.launcher.runner.channel
        sent = channel.num_messages
        llm.llm_engine.keepalive(idle_s=0)          # what the server's idle loop sends
        llm.llm_engine.keepalive(idle_s=3600)       # not idle long enough: nothing sent
        assert channel.num_messages == sent + 1
        assert token_ids(llm.generate(prompts([5, 9]), GREEDY)) == before


def test_a_spawned_worker_exits_when_its_leader_is_killed(wide_dir):
    import subprocess
    import sys

    code = ("import sys; from specserve import LLM\n"
            "if __name__ == '__main__':\n"
            f"    llm = LLM({wide_dir!r}, tensor_parallel_size=2)\n"
            "    print(llm.llm_engine.target.launcher.processes[0].pid, flush=True)\n"
            "    sys.stdin.read()\n")
    leader = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        worker = int(leader.stdout.readline())
        assert not _gone(worker)
        leader.kill()
        leader.wait(10)
        deadline = time.monotonic() + 10
        while not _gone(worker) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _gone(worker), "the worker outlived its leader"
    finally:
        leader.kill()
