"""Corpora available offline for head training, and the train/validation split by document.

* ``stdlib``: the Python standard library's own ``.py`` source files (code).
* ``packages``: the ``.py`` sources of the installed packages (site-packages; torch, transformers,
  numpy ... whatever the environment holds), tests excluded.
* ``specbench`` / ``humaneval``: self-distillation. The target answers Spec-Bench's questions (or
  completes HumanEval prompts) through the engine, greedily; each document is prompt + answer, so
  the head learns the distribution it will be asked to draft for. Prompts used for evaluation are
  never trained on: the first ``HUMANEVAL_EVAL_PROMPTS`` HumanEval prompts and every
  ``SPEC_BENCH_EVAL_EVERY``-th Spec-Bench question (:func:`spec_bench_eval_questions`, the ones
  ``specserve bench --specbench-prompts`` draws from).

The texts themselves (sources, Spec-Bench, HumanEval) are :mod:`specserve.data.corpora`'s.

A document is ``(doc_id, token_ids)``; the split hashes ``doc_id``, so it does not depend on the
order or number of documents and a document never straddles train and validation.
"""
from __future__ import annotations

import gzip
import json
from pathlib import Path

from specserve.data.corpora import (HUMANEVAL_SIZE, SOURCE_CORPORA, SPEC_BENCH_EVAL_EVERY, Document,  # noqa: F401
                                    hash01, humaneval_prompts, source_documents, spec_bench_eval_questions,
                                    spec_bench_train_questions, stdlib_documents)

CORPORA = SOURCE_CORPORA + ("specbench", "humaneval")
HUMANEVAL_EVAL_PROMPTS = 40


def is_validation(doc_id: str, val_fraction: float) -> bool:
    """Whether ``doc_id`` belongs to the validation split (a stable hash, ``val_fraction`` of ids)."""
    return hash01(doc_id) < val_fraction


def order_key(doc_id: str) -> float:
    """A document's place in the stable pseudo-random order of :func:`interleave` (in [0, 1))."""
    return hash01("order/" + doc_id)


def interleave(docs: list[Document]) -> list[Document]:
    """Documents in a stable pseudo-random order (by a hash of their id), so that any prefix of a
    precomputation mixes every corpus in proportion."""
    return sorted(docs, key=lambda d: order_key(d[0]))


def self_distill_prompts(llm, corpus: str) -> list[tuple[str, str]]:
    """``(doc_id, prompt text)`` of a self-distillation corpus, evaluation prompts excluded.

    Raises:
        ValueError: an unknown corpus.
    """
    if corpus == "specbench":   # categories are contiguous in the file: a stable shuffle mixes them
        tok = llm.get_tokenizer()
        questions = sorted(spec_bench_train_questions(), key=lambda q: hash01("specbench/" + q[0]))
        return [(f"specbench/{qid}", tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                                             add_generation_prompt=True))
                for qid, q in questions]
    if corpus == "humaneval":
        prompts = humaneval_prompts(HUMANEVAL_SIZE)[HUMANEVAL_EVAL_PROMPTS:]
        return [(f"humaneval/{HUMANEVAL_EVAL_PROMPTS + i}", p) for i, p in enumerate(prompts)]
    raise ValueError(f"self-distillation corpus must be 'specbench' or 'humaneval', got {corpus!r}")


def read_answers(path: str | Path) -> dict[str, list[int]]:
    """``{doc_id: prompt + answer token ids}`` of a self-distillation ``.jsonl`` (or ``.jsonl.gz``)
    file, one ``{"doc_id", "token_ids"}`` object a line; a line cut by an interruption is skipped."""
    path = Path(path)
    text = gzip.decompress(path.read_bytes()).decode() if path.suffix == ".gz" else path.read_text()
    out = {}
    for line in text.splitlines():
        try:
            d = json.loads(line)
        except json.JSONDecodeError:
            continue
        out[d["doc_id"]] = d["token_ids"]
    return out


def self_distill_documents(llm, corpus: str, max_tokens_per_doc: int = 256, max_docs: int | None = None,
                           use_tqdm: bool = True, cache: str | Path | None = None,
                           chunk: int = 32, capture=None, answers: str | Path | None = None) -> list[Document]:
    """Documents of prompt + the target's own greedy answer, generated through ``llm`` (an ``LLM``).

    Args:
        corpus: ``"specbench"`` (training questions through the chat template) or ``"humaneval"``
            (raw code prompts, all but the first ``HUMANEVAL_EVAL_PROMPTS``).
        max_tokens_per_doc: generated tokens per answer.
        max_docs: how many prompts to use (None: all).
        cache: a ``.jsonl`` file: answers already there are read back, new ones are appended
            ``chunk`` prompts at a time, so an interrupted run loses at most one chunk.
        capture: ``(folder, PrecomputeSettings)``: keep the target's hidden states of every
            position while generating, in that folder
            (:func:`~specserve.training.hidden_states.generate_with_hidden_states`): no second pass.
        answers: a ``.jsonl`` or ``.jsonl.gz`` file of answers made before (another machine, the
            ones committed under ``specserve/data/self_distill``), read only: its prompts are not
            generated again (their hidden states then come from a prefill).
    Raises:
        ValueError: an unknown corpus. FileNotFoundError: ``answers`` does not exist.
    """
    from specserve.sampling_params import SamplingParams

    items = self_distill_prompts(llm, corpus)
    items = items[:max_docs] if max_docs is not None else items
    cache = Path(cache) if cache is not None else None
    if answers is not None and not Path(answers).is_file():
        raise FileNotFoundError(f"no self-distilled answers file {str(answers)!r}")
    have = read_answers(answers) if answers is not None else {}
    if cache is not None and cache.is_file():
        have.update(read_answers(cache))
    todo = [it for it in items if it[0] not in have]
    params = SamplingParams(temperature=0, max_tokens=max_tokens_per_doc)
    if todo:
        print(f"self-distillation ({corpus}): {len(todo)} prompts x up to {max_tokens_per_doc} tokens to generate"
              + (f" ({len(items) - len(todo)} already done)" if len(todo) < len(items) else "")
              + (", keeping the target's hidden states" if capture is not None else ""), flush=True)
    step = chunk if cache is not None else max(len(todo), 1)   # without a cache nothing is kept between chunks
    for s in range(0, len(todo), step):
        part = todo[s:s + step]
        if capture is not None:
            from specserve.training.hidden_states import generate_with_hidden_states

            new = generate_with_hidden_states(llm, part, params, capture[0], capture[1], chunk=len(part),
                                              progress=use_tqdm)
        else:
            outs = llm.generate([p for _, p in part], params, use_tqdm=use_tqdm)
            new = {doc_id: list(o.prompt_token_ids) + list(o.outputs[0].token_ids)
                   for (doc_id, _), o in zip(part, outs)}
        have.update(new)
        if cache is not None:
            cache.parent.mkdir(parents=True, exist_ok=True)
            with open(cache, "a") as f:
                f.write("".join(json.dumps({"doc_id": d, "token_ids": ids}) + "\n" for d, ids in new.items()))
    # (a document captured into the folder just before an interruption, but not yet cached, is
    # in the folder though not listed here)
    return [(doc_id, have[doc_id]) for doc_id, _ in items if doc_id in have]
