"""Automatic prefix caching: the block manager's cache, and exactness with every speculation method.

The oracle is the same engine with prefix caching off and no speculation: greedy outputs must be
equal token for token while requests share prefixes, arrive in waves, are aborted and preempted.
After every step the block manager's invariants hold and no registered page's entries, the
target's or the proposer's, have changed since they were registered (a shared page is never
written); at the end every page is free or cached.
"""
from __future__ import annotations

import random

import pytest
import torch

from specserve import LLM, SamplingParams
from specserve.kv_cache.block_manager import BlockManager, NoFreeBlocksError, TargetOnly
from tests.tiny_models import make_layer_skip_draft

BS = 4


# ----------------------------------------------------------------------------- block manager
def test_a_registered_chain_is_found_shared_and_counted():
    bm = BlockManager(8, BS, enable_prefix_caching=True)
    toks = list(range(100, 111))                       # 11 tokens: 2 full pages and 3 more
    bm.allocate(0, 11)
    assert bm.cache_full_pages(0, toks, 11) == 2
    assert bm.num_cached_pages(0) == 2
    hit = bm.match_prefix(toks + [7, 8], max_tokens=12)
    assert hit.pages == bm.block_table(0)[:2] and hit.num_tokens == 8
    # the hit never covers the tokens the caller must compute
    assert bm.match_prefix(toks, max_tokens=7).num_tokens == 4
    # a different token anywhere in a page ends the chain there
    other = list(toks)
    other[5] = 0
    assert bm.match_prefix(other, 12).num_tokens == 4
    other = list(toks)
    other[0] = 0
    assert bm.match_prefix(other, 12).num_tokens == 0
    bm.allocate(1, 13, hit)
    assert bm.block_table(1)[:2] == bm.block_table(0)[:2]
    assert [bm.ref_count(p) for p in bm.block_table(1)] == [2, 2, 1, 1]
    assert bm.num_free_blocks == 8 - 5   # 3 + 4 pages, 2 of them shared
    bm.check_invariants()


def test_a_chain_is_exact_not_a_hash_of_its_page():
    """Equal pages under different parents are different entries: a page's key includes its chain."""
    bm = BlockManager(8, BS, enable_prefix_caching=True)
    a = [1, 2, 3, 4, 9, 9, 9, 9, 5]
    b = [6, 6, 6, 6, 9, 9, 9, 9, 5]
    bm.allocate(0, 9)
    bm.cache_full_pages(0, a, 9)
    assert bm.match_prefix(b, 8).num_tokens == 0
    bm.allocate(1, 9)
    bm.cache_full_pages(1, b, 9)
    assert bm.match_prefix(b, 8).pages == bm.block_table(1)[:2]
    assert bm.match_prefix(a, 8).pages == bm.block_table(0)[:2]
    bm.check_invariants()


def test_lookahead_keys_include_the_next_pages_first_token():
    """A head's entry at a page's last position embeds the next token: with lookahead 1 a page is
    found only when that token matches too, and is registered only once it is known."""
    bm = BlockManager(8, BS, enable_prefix_caching=True, worker=TargetOnly(kv_lookahead=1))
    toks = [1, 2, 3, 4, 5, 6, 7, 8]
    bm.allocate(0, 8)
    assert bm.cache_full_pages(0, toks, 8) == 1      # page 2's next token is unknown yet
    assert bm.cache_full_pages(0, toks + [9], 8) == 1
    assert bm.match_prefix([1, 2, 3, 4, 5, 6, 7, 8, 9, 10], 9).num_tokens == 8
    assert bm.match_prefix([1, 2, 3, 4, 5, 6, 7, 8, 0, 10], 9).num_tokens == 4
    assert bm.match_prefix([1, 2, 3, 4, 0, 6, 7, 8, 9, 10], 9).num_tokens == 0


def test_released_cached_pages_are_evicted_last_and_least_recently_used_first():
    bm = BlockManager(6, BS, enable_prefix_caching=True)
    a, b = list(range(10, 19)), list(range(30, 39))
    for sid, toks in ((0, a), (1, b)):
        bm.allocate(sid, 9)
        bm.cache_full_pages(sid, toks, 9)
    a_pages, b_pages = bm.block_table(0), bm.block_table(1)
    bm.free(0)
    bm.free(1)
    assert bm.num_free_blocks == 6 and bm.num_cached_blocks == 4 and bm.usage == 0
    # never-cached pages go first: the partial third pages
    bm.allocate(2, 8)
    assert set(bm.block_table(2)) == {a_pages[2], b_pages[2]}
    assert bm.num_cached_blocks == 4
    # then cached pages, least recently released first (sequence 0's, its tail before its head)
    bm.allocate(3, 4)
    assert bm.block_table(3) == [a_pages[1]] and bm.num_cached_blocks == 3
    assert bm.match_prefix(a, 8).num_tokens == 4
    assert bm.match_prefix(b, 8).num_tokens == 8
    bm.check_invariants()


def test_adopting_evictable_pages_counts_against_the_free_pool():
    bm = BlockManager(3, BS, enable_prefix_caching=True)
    toks = list(range(9))
    bm.allocate(0, 9)
    bm.cache_full_pages(0, toks, 9)
    bm.free(0)
    hit = bm.match_prefix(toks, 8)
    assert hit.num_tokens == 8
    assert bm.num_blocks_needed(None, 13, hit) == 4 and not bm.can_allocate(None, 13, hit)
    with pytest.raises(NoFreeBlocksError):
        bm.allocate(1, 13, hit)
    bm.check_invariants()
    bm.allocate(1, 12, hit)
    assert bm.num_free_blocks == 0 and bm.block_table(1)[:2] == hit.pages
    bm.check_invariants()


def test_duplicate_computation_keeps_the_first_page_and_the_chain_goes_on():
    bm = BlockManager(8, BS, enable_prefix_caching=True)
    toks = list(range(13))
    bm.allocate(0, 13)
    bm.allocate(1, 13)
    bm.cache_full_pages(0, toks, 4)
    assert bm.cache_full_pages(1, toks, 13) == 2      # page 0 already there: pages 1 and 2 are new
    hit = bm.match_prefix(toks, 12)
    assert hit.pages == [bm.block_table(0)[0], bm.block_table(1)[1], bm.block_table(1)[2]]
    bm.free(0)
    bm.free(1)
    bm.check_invariants()
    assert bm.num_free_blocks == 8


def test_bad_prefix_use_is_refused_and_reset_forgets_everything():
    bm = BlockManager(8, BS, enable_prefix_caching=True)
    toks = list(range(9))
    bm.allocate(0, 9)
    bm.cache_full_pages(0, toks, 9)
    hit = bm.match_prefix(toks, 8)
    with pytest.raises(ValueError, match="already has a block table"):
        bm.allocate(0, 12, hit)
    with pytest.raises(ValueError, match="longer than"):
        bm.allocate(1, 4, hit)
    bm.check_invariants()
    assert bm.reset_prefix_cache() == 2
    assert bm.match_prefix(toks, 8).num_tokens == 0 and bm.num_cached_pages(0) == 0
    bm.free(0)
    bm.check_invariants()
    assert not BlockManager(4, BS).match_prefix(toks, 8).pages   # caching off: never a hit


def test_random_operations_keep_the_invariants():
    rng = random.Random(0)
    bm = BlockManager(24, BS, enable_prefix_caching=True, worker=TargetOnly(kv_lookahead=rng.choice([0, 1])))
    prefixes = [[rng.randrange(5) for _ in range(rng.randrange(1, 30))] for _ in range(4)]
    live: dict[int, list[int]] = {}
    for step in range(3000):
        op = rng.random()
        if op < 0.3 and len(live) < 6:
            sid = step
            toks = rng.choice(prefixes) + [rng.randrange(5) for _ in range(rng.randrange(1, 12))]
            hit = bm.match_prefix(toks, len(toks) - 1)
            if bm.can_allocate(sid, len(toks), hit):
                bm.allocate(sid, len(toks), hit)
                live[sid] = toks
        elif op < 0.55 and live:
            sid = rng.choice(list(live))
            grow = live[sid] + [rng.randrange(5) for _ in range(rng.randrange(1, 6))]
            if bm.can_allocate(sid, len(grow)):
                bm.allocate(sid, len(grow))
                bm.truncate(sid, rng.randrange(len(live[sid]), len(grow) + 1))
                live[sid] = grow[:bm.num_tokens(sid)]
        elif op < 0.8 and live:
            sid = rng.choice(list(live))
            bm.cache_full_pages(sid, live[sid], rng.randrange(bm.num_tokens(sid) + 1))
        elif live:
            sid = rng.choice(list(live))
            bm.free(sid)
            del live[sid]
        bm.check_invariants()
    for sid in list(live):
        bm.free(sid)
    bm.check_invariants()
    assert bm.num_free_blocks == bm.num_blocks


# ----------------------------------------------------------------------------- the engine
SYSTEM = [(7 * i + 3) % 250 + 3 for i in range(37)]     # a shared "system prompt", 37 tokens


def workload(seed: int = 0):
    """Three waves of prompts sharing prefixes: the system prompt with different questions, the
    system prompt alone, a part of it, duplicates, and (wave 3) a prompt that extends another."""
    g = torch.Generator().manual_seed(seed)

    def rand(n):
        return torch.randint(3, 250, (n,), generator=g).tolist()

    q = [rand(n) for n in (5, 11, 1, 20, 8, 3)]
    wave1 = [SYSTEM + q[0], SYSTEM + q[1], SYSTEM[:21], rand(30)]
    wave2 = [SYSTEM + q[2], SYSTEM, SYSTEM + q[3], SYSTEM + q[0], rand(9) + SYSTEM]
    wave3 = [SYSTEM + q[1] + q[4], SYSTEM + q[5], SYSTEM[:21] + q[4], SYSTEM + q[0]]
    return [wave1, wave2, wave3]


PARAMS = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)


def proposer_caches(engine):
    """The proposer's paged KV tensors ([key, value] lists), if it keeps any."""
    prop = engine.proposer
    if prop is None:
        return []
    if hasattr(prop, "runner"):
        return [prop.runner.kv_cache]
    if hasattr(prop, "kv"):
        return [prop.kv]
    return []


class SharedPageWatch:
    """Snapshots every registered page's target entries, and its proposer entries once they are
    draft-valid, and checks at every step that none of them changed since."""

    def __init__(self, engine):
        self.engine = engine
        self.snapshots: dict[tuple[int, int, str], list[torch.Tensor]] = {}
        self.checked = 0

    def entries(self, page, which):
        caches = [self.engine.target.kv_cache] if which == "target" else proposer_caches(self.engine)
        return [t[:, page].clone() for c in caches for t in (c.key_cache, c.value_cache)]

    def check(self):
        bm = self.engine.block_manager
        bm.check_invariants()
        live = set()
        for key, page in bm._cache.items():
            for which in ("target", "draft") if bm.is_draft_valid(page) else ("target",):
                ident = (page, bm._page_key_id[page], which)
                live.add(ident)
                now = self.entries(page, which)
                if ident not in self.snapshots:
                    self.snapshots[ident] = now
                    continue
                for a, b in zip(self.snapshots[ident], now):
                    assert torch.equal(a, b), f"registered page {page}'s {which} entries were written"
                self.checked += 1
        for ident in set(self.snapshots) - live:
            del self.snapshots[ident]


def run_waves(llm, waves, abort=None, watch=True):
    """Run the waves through the engine step by step (wave i+1 arrives after a few steps of wave i,
    so requests share pages while running); ``abort``: request ids aborted after their 3rd step.
    Returns {request id: token ids} of the requests that finished."""
    eng = llm.llm_engine
    w = SharedPageWatch(eng) if watch else None
    done, steps = {}, 0
    pending = [list(enumerate(wave)) for wave in waves]
    for i, wave in enumerate(pending):
        for j, prompt in wave:
            eng.add_request(f"{i}.{j}", prompt, PARAMS)
        for _ in range(3 if i + 1 < len(pending) else 10**6):
            if not eng.has_unfinished_requests():
                break
            for out in eng.step():
                if out.finished:
                    done[out.request_id] = out.outputs[0].token_ids
            steps += 1
            if abort and steps == 5:
                for rid in abort:
                    eng.abort_request(rid)
            if w is not None:
                w.check()
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
        if w is not None:
            w.check()
    bm = eng.block_manager
    bm.check_invariants()
    assert bm.num_free_blocks == bm.num_blocks, "a page was leaked"
    return done, w


@pytest.fixture(scope="module")
def reference(tiny_qwen2_dir):
    llm = LLM(tiny_qwen2_dir, block_size=BS, enable_prefix_caching=False)
    return {i: llm.generate([{"prompt_token_ids": p} for p in wave], PARAMS) for i, wave in enumerate(workload())}


def expected(reference, done):
    return {rid: reference[int(rid.split(".")[0])][int(rid.split(".")[1])].outputs[0].token_ids for rid in done}


@pytest.fixture(scope="module")
def self_draft(tiny_qwen2_dir, tmp_path_factory):
    folder = tmp_path_factory.mktemp("pc_draft") / "draft"
    make_layer_skip_draft(tiny_qwen2_dir, folder, keep_layers=3, noise=0.07)
    return str(folder)


METHODS = ["none", "draft_model", "mtp", "eagle", "ngram"]


def spec_config(method, self_draft, head):
    if method == "none":
        return None
    cfg = {"method": method, "num_speculative_tokens": 3, "adaptive": False}
    if method == "draft_model":
        cfg["model"] = self_draft
    elif method in ("mtp", "eagle"):
        cfg["model"] = head
    return cfg


@pytest.mark.parametrize("method", METHODS)
def test_greedy_with_prefix_caching_equals_without(tiny_qwen2_dir, self_draft, trained_tiny_eagle3_head,
                                                   reference, method):
    """Waves of requests sharing a system prompt: every output equals the uncached, unspeculated
    reference; registered pages (target and proposer) are never written; hits really happen."""
    llm = LLM(tiny_qwen2_dir, block_size=BS, speculative_config=spec_config(method, self_draft,
                                                                             trained_tiny_eagle3_head))
    done, watch = run_waves(llm, workload(), abort=["1.1"])
    assert "1.1" not in done and len(done) == sum(map(len, workload())) - 1
    assert done == expected(reference, done)
    bm = llm.llm_engine.block_manager
    assert bm.num_hit_tokens >= 8 * 32, (bm.num_hit_tokens, bm.num_queried_tokens)
    assert watch.checked > 50
    if method != "none":
        assert llm.llm_engine.spec_stats.num_accepted_tokens > 0


@pytest.mark.parametrize("method", ["draft_model", "mtp"])
def test_a_cached_prefix_drafts_as_a_computed_one(tiny_qwen2_dir, self_draft, trained_tiny_eagle3_head, method):
    """The proposer's entries in adopted pages are what it would have computed itself: a request
    served from the cache drafts and accepts exactly the tokens it does with caching off. The
    shared prefix ends on a page boundary and the next tokens differ, so a head (whose entry at a
    page's last position embeds the next token) must not adopt that last page: it gets 32 of the
    36 tokens, a draft LLM all 36."""
    cfg = spec_config(method, self_draft, trained_tiny_eagle3_head)
    system = SYSTEM[:36]
    stats = {}
    for caching in (False, True):
        llm = LLM(tiny_qwen2_dir, block_size=BS, speculative_config=cfg, enable_prefix_caching=caching)
        llm.generate([{"prompt_token_ids": system + [5, 6, 7]}], PARAMS)      # leaves the prefix cached
        out = llm.generate([{"prompt_token_ids": system + [9, 10, 11, 12, 13]}], PARAMS)[0]
        s = out.metrics.spec_decode
        stats[caching] = [out.outputs[0].token_ids, s.num_draft_tokens, s.num_accepted_tokens]
        assert out.num_cached_tokens == (0 if not caching else 32 if method == "mtp" else 36)
        # the entries themselves, of a request stopped after a few steps (its pages still held)
        eng = llm.llm_engine
        eng.add_request("probe", system + [9, 10, 11, 12, 13], PARAMS)
        for _ in range(4):
            eng.step()
        seq = eng.requests["probe"][0]
        slots = torch.tensor(eng.block_manager.slot_mapping(seq.seq_id, 0, len(system) + 4))
        stats[caching].append([t.flatten(1, 2)[:, slots] for c in [eng.target.kv_cache] + proposer_caches(eng)
                               for t in (c.key_cache, c.value_cache)])
        eng.abort_request("probe")
    on, off = stats[True], stats[False]
    assert on[:3] == off[:3]
    for a, b in zip(on[3], off[3]):
        assert torch.equal(a, b)


@pytest.mark.parametrize("adaptive", [False, True])
def test_a_draft_behind_a_cached_prefix_catches_up(tiny_qwen2_dir, self_draft, adaptive):
    """A prefix cached by a request the draft never followed (it ended at its prefill) holds the
    target's entries only: the next request reuses them, its draft catches up over the prefix as
    over a new prompt and speculates; the output is exact, and the pages become draft-valid."""
    cfg = {"method": "draft_model", "model": self_draft, "num_speculative_tokens": 3, "adaptive": adaptive}
    ref = LLM(tiny_qwen2_dir, block_size=BS, enable_prefix_caching=False)
    llm = LLM(tiny_qwen2_dir, block_size=BS, speculative_config=cfg)
    prompt = SYSTEM + [9, 10, 11, 12, 13]
    llm.generate([{"prompt_token_ids": SYSTEM[:36] + [5]}], SamplingParams(temperature=0, max_tokens=1))
    bm = llm.llm_engine.block_manager
    hit = bm.match_prefix(prompt, len(prompt) - 1)
    assert hit.num_tokens == 36 and hit.num_draft_tokens == 0
    out = llm.generate([{"prompt_token_ids": prompt}], PARAMS)[0]
    assert out.outputs[0].token_ids == ref.generate([{"prompt_token_ids": prompt}], PARAMS)[0].outputs[0].token_ids
    assert out.num_cached_tokens == 36 and out.metrics.spec_decode.num_accepted_tokens > 0
    hit = bm.match_prefix(prompt, len(prompt) - 1)
    assert hit.num_draft_tokens == hit.num_tokens >= 36


@pytest.mark.parametrize("method", METHODS)
def test_preemption_and_recompute_with_prefix_caching(tiny_qwen2_dir, self_draft, trained_tiny_eagle3_head,
                                                      reference, method):
    """A pool too small for the waves: requests are preempted, recomputed from cached pages where
    they can be, and the outputs stay exact; registered pages are never written."""
    llm = LLM(tiny_qwen2_dir, block_size=BS, num_blocks=40,
              speculative_config=spec_config(method, self_draft, trained_tiny_eagle3_head))
    preempted = []
    eng = llm.llm_engine
    orig = eng.scheduler._preempt

    def spy(req, out):
        preempted.append(req.request_id)
        orig(req, out)

    eng.scheduler._preempt = spy
    done, _ = run_waves(llm, workload())
    assert preempted, "the pool was meant to be too small"
    assert done == expected(reference, done) and len(done) == sum(map(len, workload()))


def test_prefix_caching_off_never_hits(tiny_qwen2_dir):
    llm = LLM(tiny_qwen2_dir, block_size=BS, enable_prefix_caching=False)
    llm.generate([{"prompt_token_ids": SYSTEM + [5]}, {"prompt_token_ids": SYSTEM + [6]}], PARAMS)
    bm = llm.llm_engine.block_manager
    assert bm.num_hit_tokens == 0 and bm.num_cached_blocks == 0


def test_cached_tokens_are_reported(tiny_qwen2_dir):
    llm = LLM(tiny_qwen2_dir, block_size=BS)
    first = llm.generate([{"prompt_token_ids": SYSTEM + [5]}], PARAMS)[0]
    second = llm.generate([{"prompt_token_ids": SYSTEM + [6, 7]}], PARAMS)[0]
    assert first.num_cached_tokens == 0 and second.num_cached_tokens == 36


def test_prefix_caching_under_tensor_parallelism(tiny_qwen2_dir, self_draft):
    """At TP = 2 every rank's KV shard addresses the same shared pages (rank 0's block tables):
    the waves' outputs with caching and the draft on rank 0 equal TP = 2 without either (TP = 2
    rounds differently from TP = 1, so the reference is at TP = 2 too)."""
    with LLM(tiny_qwen2_dir, block_size=BS, tensor_parallel_size=2, enable_prefix_caching=False) as ref:
        want, _ = run_waves(ref, workload(), watch=False)
    with LLM(tiny_qwen2_dir, block_size=BS, tensor_parallel_size=2,
             speculative_config=spec_config("draft_model", self_draft, None)) as llm:
        done, _ = run_waves(llm, workload(), watch=False)
        assert done == want and len(done) == sum(map(len, workload()))
        assert llm.llm_engine.block_manager.num_hit_tokens >= 8 * 32


def test_rollback_never_reaches_into_cached_pages():
    bm = BlockManager(8, BS, enable_prefix_caching=True)
    bm.allocate(0, 12)
    bm.cache_full_pages(0, list(range(12)), 8)
    bm.truncate(0, 8)                                   # down to the cached pages: fine
    with pytest.raises(ValueError, match="inside its 8 cached tokens"):
        bm.truncate(0, 7)
    bm.check_invariants()
