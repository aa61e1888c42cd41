"""Quality of each ``--quantization`` (``specserve bench --quality``): teacher-forced top-1
agreement with the float32 target and perplexity, on one fixed text.

The text: HumanEval canonical solutions (prompt + solution, in file order) followed by Spec-Bench
first turns, tokenized as one stream and cut into segments of ``segment_len`` tokens, each run
from position 0 through the engine's own model runner (the served code path). For every position
we take the argmax next token and the log-probability of the true next token (float32 softmax).
Agreement is the fraction of positions whose argmax equals the float32 target's.
"""
from __future__ import annotations

import gzip
import json
import math

import torch


def quality_text() -> str:
    """HumanEval canonical solutions, then Spec-Bench first turns (deterministic order)."""
    from specserve.data.corpora import humaneval_file, spec_bench_questions

    parts = []
    with gzip.open(humaneval_file(), "rt", encoding="utf-8") as f:
        problems = [json.loads(line) for line in f if line.strip()]
    parts += [p["prompt"] + p["canonical_solution"] for p in problems]
    parts += [text for _, text in spec_bench_questions()]
    return "\n\n".join(parts)


def quality_segments(tokenizer, num_tokens: int, segment_len: int = 512) -> list[list[int]]:
    ids = list(tokenizer.encode(quality_text()))[:num_tokens]
    if len(ids) < num_tokens:
        raise ValueError(f"the quality text has only {len(ids)} tokens, fewer than {num_tokens}")
    return [ids[i:i + segment_len] for i in range(0, len(ids), segment_len) if len(ids[i:i + segment_len]) > 1]


@torch.inference_mode()
def teacher_forced(engine, segments: list[list[int]], logits_chunk: int = 128) -> dict:
    """Argmax ids and the perplexity of the true next tokens, at every position but each segment's
    last (the segments run through :meth:`~specserve.engine.engine.LLMEngine.score`, as hidden
    states are precomputed for head training)."""
    # rows whose next token is known: all but the last of each segment
    rows, targets, start = [], [], 0
    for seg in segments:
        rows += range(start, start + len(seg) - 1)
        targets += seg[1:]
        start += len(seg)
    targets_t = torch.tensor(targets)
    argmax, nll = [], 0.0
    scores = engine.score(segments)
    for i in range(0, len(rows), logits_chunk):
        logits = scores.logits(rows[i:i + logits_chunk]).double()
        logp = torch.log_softmax(logits, dim=-1)
        nll -= float(logp.gather(1, targets_t[i:i + logits_chunk, None]).sum())
        argmax += logits.argmax(-1).tolist()
    return {"argmax": argmax, "perplexity": math.exp(nll / len(rows)), "num_tokens": len(rows)}


def agreement_rate(a: list[int], b: list[int]) -> float:
    return sum(x == y for x, y in zip(a, b)) / len(a)
