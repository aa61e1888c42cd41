"""A reduced draft vocabulary: the draft scores only a corpus's most frequent tokens.

The lm_head of a small draft reads its whole ``[V, H]`` matrix for every draft token; for the 0.5B
Qwen2.5 draft (V = 151,936) that is a fifth of its bytes. FR-Spec (Zhao et al. 2025, "FR-Spec:
Accelerating Large-Vocabulary Language Models via Frequency-Ranked Speculative Sampling",
section 3) keeps the rows of the most frequent tokens of a corpus, and EAGLE-3 heads carry such a
vocabulary with its ``d2t`` map (Li et al. 2025, section 3). Speculation stays exact: the target
verifies every draft token, and for sampled requests the draft's distribution over the reduced
vocabulary (zero elsewhere) is the ``q`` of rejection sampling, which accepts exactly the target's
distribution whatever ``q`` is.

The corpus: the Python standard library's sources (code) and Spec-Bench's training questions
(prose; the evaluation ones held out), tokenized once per tokenizer and cached on disk.
"""
from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

CORPUS_TOKENS = 2_000_000   # tokens of standard-library source counted (plus every Spec-Bench training question)


def frequent_token_vocab(counts: torch.Tensor, size: int) -> torch.Tensor:
    """The ``size`` most frequent token ids (``[size]`` int64, ascending id order). Ties go to the
    lower id.

    Raises:
        ValueError: ``size`` outside ``[1, len(counts)]``.
    """
    if not 1 <= size <= counts.numel():
        raise ValueError(f"draft vocabulary size must be in [1, {counts.numel()}], got {size}")
    order = torch.argsort(-counts, stable=True)[:size]
    return order.sort().values


def to_target_logits(logits: torch.Tensor, draft_to_target: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Logits over a reduced vocabulary ``[N, n]`` -> ``[N, vocab_size]``: each at its target id
    (``draft_to_target [n]`` int64), every other token at -inf (never proposed, probability 0)."""
    full = logits.new_full((logits.shape[0], vocab_size), float("-inf"))
    return full.index_copy_(1, draft_to_target.to(logits.device), logits)


def corpus_token_counts(tokenizer, vocab_size: int) -> torch.Tensor:
    """``[vocab_size]`` int64: how often each token occurs in the corpus (see the module doc),
    cached under ``<cache>/draft_vocab/`` by a hash of the tokenizer's vocabulary."""
    from specserve.cache_dir import default_cache_dir
    from specserve.data.corpora import source_documents, spec_bench_train_questions

    vocab = tokenizer.get_vocab()
    key = hashlib.sha256(json.dumps(sorted(vocab.items())).encode()).hexdigest()[:16]
    path = Path(default_cache_dir()) / "draft_vocab" / f"counts-{key}-{vocab_size}-{CORPUS_TOKENS}.pt"
    if path.exists():
        return torch.load(path)
    logger.info("counting token frequencies for a reduced draft vocabulary (once per tokenizer)")
    counts = torch.zeros(vocab_size, dtype=torch.int64)

    def add(ids) -> None:
        ids = torch.as_tensor(list(ids), dtype=torch.int64)
        counts.add_(torch.bincount(ids[(ids >= 0) & (ids < vocab_size)], minlength=vocab_size))

    for _, ids in source_documents(tokenizer, "stdlib", CORPUS_TOKENS, shuffle=False):
        add(ids)
    for _, text in spec_bench_train_questions():
        add(tokenizer.encode(text))
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    torch.save(counts, tmp)
    tmp.replace(path)
    return counts


def draft_vocabulary(tokenizer, vocab_size: int, size: int, always: list[int] = ()) -> torch.Tensor:
    """The reduced draft vocabulary: ``[size]`` int64 target ids in ascending order, the corpus's
    most frequent tokens, with the ids in ``always`` (EOS, ...) included.

    Raises:
        ValueError: ``size`` outside ``[len(always) + 1, vocab_size]``.
    """
    if not len(always) < size <= vocab_size:
        raise ValueError(f"draft_vocab_size must be in [{len(always) + 1}, {vocab_size}], got {size}")
    counts = corpus_token_counts(tokenizer, vocab_size).clone()
    counts[torch.as_tensor(list(always), dtype=torch.int64)] = torch.iinfo(torch.int64).max
    return frequent_token_vocab(counts, size)
