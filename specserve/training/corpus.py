"""Corpora available offline for head training, and the train/validation split by document.

* ``stdlib``: the Python standard library's own ``.py`` source files (code).
* ``specbench`` / ``humaneval``: self-distillation. The target answers Spec-Bench's questions (or
  completes HumanEval prompts) through the engine, greedily; each document is prompt + answer, so
  the head learns the distribution it will be asked to draft for. HumanEval prompts used for
  evaluation (the first ``HUMANEVAL_EVAL_PROMPTS``) are never trained on.

A document is ``(doc_id, token_ids)``; the split hashes ``doc_id``, so it does not depend on the
order or number of documents and a document never straddles train and validation.
"""
from __future__ import annotations

import hashlib
import json
import sysconfig
from pathlib import Path
from typing import Iterator

CORPORA = ("stdlib", "specbench", "humaneval")
HUMANEVAL_EVAL_PROMPTS = 40
SPEC_BENCH_FILE = Path(__file__).resolve().parents[1] / "data" / "spec_bench" / "question.jsonl"

Document = tuple[str, list[int]]


def is_validation(doc_id: str, val_fraction: float) -> bool:
    """Whether ``doc_id`` belongs to the validation split (a stable hash, ``val_fraction`` of ids)."""
    h = int.from_bytes(hashlib.sha256(doc_id.encode()).digest()[:8], "big")
    return h / 2**64 < val_fraction


def stdlib_files() -> list[Path]:
    """The standard library's ``.py`` files (tests and site-packages excluded), sorted."""
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = ("site-packages", "test", "tests", "idlelib", "__pycache__")
    return sorted(p for p in root.rglob("*.py") if not any(part in skip for part in p.relative_to(root).parts))


def stdlib_documents(tokenizer, max_tokens: int | None = None) -> Iterator[Document]:
    """Tokenized standard-library sources, until ``max_tokens`` tokens in all."""
    root = Path(sysconfig.get_paths()["stdlib"])
    total = 0
    for path in stdlib_files():
        text = path.read_text(encoding="utf-8", errors="replace")
        ids = list(tokenizer.encode(text))
        if len(ids) < 2:
            continue
        yield f"stdlib/{path.relative_to(root).as_posix()}", ids
        total += len(ids)
        if max_tokens is not None and total >= max_tokens:
            return


def spec_bench_questions(path: str | Path | None = None) -> list[tuple[str, str]]:
    """``(question_id, first turn)`` of Spec-Bench's questions.

    Raises:
        FileNotFoundError: the question file is not where given (or shipped).
    """
    p = Path(path) if path is not None else SPEC_BENCH_FILE
    if not p.is_file():
        raise FileNotFoundError(f"Spec-Bench questions not found at {str(p)!r}")
    out = []
    for line in p.read_text(encoding="utf-8").splitlines():
        if line.strip():
            q = json.loads(line)
            out.append((str(q["question_id"]), q["turns"][0]))
    return out


def self_distill_documents(llm, corpus: str, max_tokens_per_doc: int = 256, max_docs: int | None = None,
                           use_tqdm: bool = True) -> list[Document]:
    """Documents of prompt + the target's own greedy answer, generated through ``llm`` (an ``LLM``).

    Args:
        corpus: ``"specbench"`` (questions through the chat template) or ``"humaneval"`` (raw
            code prompts, all but the first ``HUMANEVAL_EVAL_PROMPTS``).
        max_tokens_per_doc: generated tokens per answer.
        max_docs: how many prompts to use (None: all).
    Raises:
        ValueError: an unknown corpus.
    """
    from specserve.benchmarks.bench import humaneval_prompts
    from specserve.sampling_params import SamplingParams

    if corpus == "specbench":
        tok = llm.get_tokenizer()
        items = [(f"specbench/{qid}", tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                                              add_generation_prompt=True))
                 for qid, q in spec_bench_questions()]
    elif corpus == "humaneval":
        prompts = humaneval_prompts(164)[HUMANEVAL_EVAL_PROMPTS:]
        items = [(f"humaneval/{HUMANEVAL_EVAL_PROMPTS + i}", p) for i, p in enumerate(prompts)]
    else:
        raise ValueError(f"self-distillation corpus must be 'specbench' or 'humaneval', got {corpus!r}")
    items = items[:max_docs] if max_docs is not None else items
    outs = llm.generate([p for _, p in items], SamplingParams(temperature=0, max_tokens=max_tokens_per_doc),
                        use_tqdm=use_tqdm)
    return [(doc_id, list(o.prompt_token_ids) + list(o.outputs[0].token_ids)) for (doc_id, _), o in zip(items, outs)]
