"""The step records (StepBatch, StepResult) on hand-computed cases, the one engine-argument builder
every command uses, and the one-way import rule between engine, speculation and workers."""
from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest

from specserve.config import EngineArgs, SchedulerConfig
from specserve.engine.request import Request
from specserve.engine.scheduler import Scheduler
from specserve.entrypoints.args import engine_args
from specserve.entrypoints.cli import build_parser
from specserve.kv_cache.block_manager import BlockManager
from specserve.sampling_params import SamplingParams

ROOT = Path(__file__).resolve().parents[1]


def make_batch():
    bm = BlockManager(num_blocks=16, block_size=4)
    sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=7, max_model_len=20), bm)
    a = Request("a", 0, [10, 11, 12, 13, 14], SamplingParams(max_tokens=3), None, [2])
    b = Request("b", 1, [20, 21], SamplingParams(max_tokens=100, temperature=0), None, [2])
    for r in (a, b):
        sched.add(r)
    out = sched.schedule(num_lookahead_tokens=2)
    return sched, bm, out, sched.step_batch(out)


def test_step_batch_hand_case():
    sched, bm, out, batch = make_batch()
    assert batch.seq_ids == [0, 1] and batch.query_lens == [5, 2] and batch.context_lens == [0, 0]
    assert batch.cu_query_lens == [0, 5, 7]
    assert batch.input_ids.tolist() == [10, 11, 12, 13, 14, 20, 21]
    assert batch.positions.tolist() == [0, 1, 2, 3, 4, 0, 1]
    assert [batch.samples(b) for b in range(2)] == [True, True] and not batch.is_decode_only
    # a: 3 tokens left (max_tokens), b: 20 - 2 = 18 positions left (max_model_len)
    assert batch.max_new_tokens == [3, 18] and batch.max_draft_tokens == [2, 18]
    assert batch.expected_batch_size == 2
    for b, seq in enumerate(batch.seq_ids):
        n = bm.num_tokens(seq)
        assert batch.slot_mapping(b, 0, n).tolist() == bm.slot_mapping(seq, 0, n)
    sub = batch.select([1])
    assert sub.seq_ids == [1] and sub.input_ids.tolist() == [20, 21] and sub.cu_query_lens == [0, 2]
    md = batch.sampling_metadata([0, 1, 1])
    assert md.is_greedy == [False, True, True]
    # the batch holds the requests' own lists: no copy per step
    assert batch.token_ids[0] is out.scheduled[0].request.token_ids


def test_decode_batch_after_commit():
    sched, bm, out, batch = make_batch()
    for s, t in zip(out.scheduled, (15, 22)):
        s.request.num_computed_tokens += s.num_new_tokens
        s.request.append_output(t)
    batch = sched.step_batch(sched.schedule(num_lookahead_tokens=2))
    assert batch.is_decode_only and batch.query_lens == [1, 1] and batch.context_lens == [5, 2]
    assert batch.input_ids.tolist() == [15, 22] and batch.positions.tolist() == [5, 2]
    assert batch.max_draft_tokens == [1, 17]


# --------------------------------------------------------------------------- one argument builder

@pytest.mark.parametrize("command", [["generate", "hi"], ["serve"], ["bench"], ["bench-serve"]])
def test_every_engine_flag_reaches_the_engine(command):
    flags = ["--model", "m", "--dtype", "bfloat16", "--quantization", "none", "--max-model-len", "99",
             "--block-size", "8", "--num-blocks", "7", "--kv-cache-memory-gb", "0.5", "--max-num-seqs", "3",
             "--max-num-batched-tokens", "55", "--speculative-method", "ngram", "--num-speculative-tokens", "5"]
    args = build_parser().parse_args(command[:1] + flags + command[1:])
    ea = engine_args(args)
    assert (ea.model, ea.dtype, ea.quantization, ea.max_model_len, ea.block_size, ea.num_blocks,
            ea.kv_cache_memory_gb, ea.max_num_seqs, ea.max_num_batched_tokens) == \
        ("m", "bfloat16", "none", 99, 8, 7, 0.5, 3, 55)
    assert ea.speculative_config.method == "ngram" and ea.speculative_config.num_speculative_tokens == 5
    # every EngineArgs field is a flag (seed and device: library-only)
    missing = {f.name for f in dataclasses.fields(EngineArgs)} - set(vars(args)) - {"seed", "device",
                                                                                    "speculative_config"}
    assert not missing, f"EngineArgs fields without a command-line flag: {missing}"


def test_train_head_builds_its_target_from_the_same_builder():
    args = build_parser().parse_args(["train-head", "--target", "t", "--quantization", "int8"])
    ea = engine_args(args, model=args.target, speculative_config=None)
    assert (ea.model, ea.quantization, ea.speculative_config) == ("t", "int8", None)
    assert ea.max_num_seqs == EngineArgs.max_num_seqs   # flags it does not define keep the defaults


# --------------------------------------------------------------------------- layout rules

def imports_of(path: Path) -> set[str]:
    mods = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            mods.add(node.module)
        elif isinstance(node, ast.Import):
            mods.update(a.name for a in node.names)
    return mods


@pytest.mark.parametrize("package,forbidden", [("spec_decode", "specserve.engine"),
                                               ("worker", "specserve.engine"),
                                               ("worker", "specserve.spec_decode"),
                                               ("worker", "specserve.distributed"),
                                               ("kernels", "specserve.models"),
                                               ("training", "specserve.benchmarks"),
                                               ("spec_decode", "specserve.training"),
                                               ("config.py", "specserve.models"),
                                               ("config.py", "specserve.spec_decode"),
                                               ("config.py", "specserve.engine")])
def test_imports_go_one_way(package, forbidden):
    root = ROOT / "specserve" / package
    for path in sorted(root.glob("*.py")) if root.is_dir() else [root]:
        bad = [m for m in imports_of(path) if m == forbidden or m.startswith(forbidden + ".")]
        assert not bad, f"{path.name} imports {bad}"


def package_of(module: str) -> str | None:
    """``specserve.<package>`` (a top-level module counts as its own package); None outside."""
    parts = module.split(".")
    return parts[1] if parts[0] == "specserve" and len(parts) > 1 else None


def test_no_import_circle_between_packages():
    """Between the packages of specserve (lazy imports included) the only circle is the command
    line dispatching to its commands: entrypoints/cli.py is left out of the graph."""
    edges: dict[str, set[str]] = {}
    for path in (ROOT / "specserve").rglob("*.py"):
        rel = path.relative_to(ROOT).with_suffix("")
        if rel.as_posix() == "specserve/entrypoints/cli":
            continue
        src = package_of(".".join(rel.parts))
        for m in imports_of(path):
            dst = package_of(m)
            if src and dst and dst != src:
                edges.setdefault(src, set()).add(dst)

    def reaches(a: str, b: str, seen: set[str]) -> bool:
        return any(n == b or (n not in seen and not seen.add(n) and reaches(n, b, seen)) for n in edges.get(a, ()))

    circles = sorted((a, b) for a in edges for b in edges[a] if a < b and reaches(b, a, set()))
    assert not circles, f"packages importing each other: {circles}"


@pytest.mark.parametrize("package", ["training", "benchmarks"])
def test_tools_use_the_engine_api(package):
    """Head training and the benchmarks reach the target through LLMEngine's API (score,
    scratch_sequence, compute_logits), never its block manager or model runner."""
    for path in sorted((ROOT / "specserve" / package).glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr in ("block_manager", "runner"):
                base = node.value
                owner = base.attr if isinstance(base, ast.Attribute) else getattr(base, "id", "")
                assert owner not in ("engine", "llm_engine"), \
                    f"{path.name}:{node.lineno} reads engine.{node.attr}"


def test_no_references_outside_the_repository():
    """Code, tests and docs cite papers and the project's own docs: a clone has no ../shared."""
    hits = []
    for path in list(ROOT.glob("specserve/**/*.py")) + list(ROOT.glob("tests/*.py")) + list(ROOT.glob("*.md")) \
            + list(ROOT.glob("docs/*.md")):
        if path.name == Path(__file__).name:
            continue
        text = path.read_text()
        if "../shared" in text or "SEED section" in text or "SEED.md" in text:
            hits.append(str(path.relative_to(ROOT)))
    assert not hits, hits


@pytest.mark.parametrize("field,value", [("max_num_seqs", 0), ("block_size", 0), ("max_num_batched_tokens", 0),
                                         ("num_blocks", 0)])
def test_engine_limits_are_checked_before_any_weights_load(field, value):
    with pytest.raises(ValueError, match=f"{field} must be >= 1, got {value}"):
        EngineArgs(model="not-loaded", **{field: value})


def test_num_speculative_tokens_checked_even_without_a_draft():
    args = build_parser().parse_args(["generate", "--model", "m", "--num-speculative-tokens", "0", "hi"])
    with pytest.raises(ValueError, match="--num-speculative-tokens must be >= 1, got 0"):
        engine_args(args)
