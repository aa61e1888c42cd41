"""Segments of precomputed hidden states as training examples, split by document.

One example is one segment (see :mod:`specserve.training.hidden_states`) of L tokens
``x_0 .. x_{L-1}`` with target hidden states ``h_0 .. h_{L-1}`` and, at each position t, the
top-k of the target's distribution of ``x_{t+1}`` (and, for EAGLE-3 heads, the target's
auxiliary-layer features). Shards are read whole into memory (float16 hidden states: 2 x
hidden_size bytes per token, times 1 + the number of auxiliary layers when they are loaded).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from specserve.training.corpus import is_validation
from specserve.training.hidden_states import read_manifest


@dataclass
class Batch:
    """``B`` segments padded to the longest, ``T`` positions.

    hidden_states ``[B, T, H]`` float32, input_ids ``[B, T]`` int64, topk_ids ``[B, T, K]`` int64,
    topk_probs ``[B, T, K]`` float32, mask ``[B, T]`` bool (False on padding), aux_hidden_states
    ``[B, T, n * H]`` float32 or None.
    """

    hidden_states: torch.Tensor
    input_ids: torch.Tensor
    topk_ids: torch.Tensor
    topk_probs: torch.Tensor
    mask: torch.Tensor
    aux_hidden_states: torch.Tensor | None = None

    def to(self, device) -> "Batch":
        return Batch(*(None if getattr(self, f) is None else getattr(self, f).to(device)
                       for f in ("hidden_states", "input_ids", "topk_ids", "topk_probs", "mask", "aux_hidden_states")))


class HiddenStateDataset:
    """The segments of one split of a precomputed folder.

    Args:
        data_dir: a folder written by :func:`~specserve.training.hidden_states.precompute_hidden_states`.
        split: ``"train"`` or ``"validation"``.
        val_fraction: share of documents (by id hash) in validation.
        max_tokens: stop adding segments after this many tokens (None: all).
        load_aux: also load the auxiliary-layer features (EAGLE-3 heads).
    Raises:
        FileNotFoundError: no manifest. ValueError: a bad split, an empty split, or ``load_aux``
        on a folder precomputed without auxiliary layers.
    """

    def __init__(self, data_dir: str | Path, split: str = "train", val_fraction: float = 0.05,
                 max_tokens: int | None = None, load_aux: bool = False):
        from safetensors.torch import load_file

        if split not in ("train", "validation"):
            raise ValueError(f"split must be 'train' or 'validation', got {split!r}")
        self.manifest = read_manifest(data_dir)
        self.settings = self.manifest["settings"]
        docs = self.manifest["documents"]
        if load_aux and not self.settings.get("aux_layers"):
            raise ValueError(f"{str(data_dir)!r} was precomputed without auxiliary layers (an EAGLE-3 head "
                             "needs them): precompute with --aux-layers")
        keys = ("hidden_states", "input_ids", "topk_ids", "topk_probs") + (("aux_hidden_states",) if load_aux else ())
        want_val = split == "validation"
        self.segments: list[dict[str, torch.Tensor]] = []
        self.doc_ids: list[str] = []
        self.num_tokens = 0
        for shard in self.manifest["shards"]:
            t = load_file(str(Path(data_dir) / shard["file"]))
            start = 0
            for n, d in zip(t["seq_lens"].tolist(), t["seq_doc"].tolist()):
                if is_validation(docs[d], val_fraction) == want_val:
                    self.segments.append({k: t[k][start:start + n] for k in keys})
                    self.doc_ids.append(docs[d])
                    self.num_tokens += n
                start += n
                if max_tokens is not None and self.num_tokens >= max_tokens:
                    break
            if max_tokens is not None and self.num_tokens >= max_tokens:
                break
        if not self.segments:
            raise ValueError(f"the {split} split of {str(data_dir)!r} is empty "
                             f"({len(docs)} documents, val_fraction {val_fraction})")

    def __len__(self) -> int:
        return len(self.segments)

    def batch(self, indices: list[int]) -> Batch:
        segs = [self.segments[i] for i in indices]
        b, t = len(segs), max(s["input_ids"].shape[0] for s in segs)
        h, k = segs[0]["hidden_states"].shape[1], segs[0]["topk_ids"].shape[1]
        aux = "aux_hidden_states" in segs[0]
        out = Batch(torch.zeros(b, t, h), torch.zeros(b, t, dtype=torch.int64),
                    torch.zeros(b, t, k, dtype=torch.int64), torch.zeros(b, t, k), torch.zeros(b, t, dtype=torch.bool),
                    torch.zeros(b, t, segs[0]["aux_hidden_states"].shape[1]) if aux else None)
        for i, s in enumerate(segs):
            n = s["input_ids"].shape[0]
            out.hidden_states[i, :n] = s["hidden_states"].float()
            if aux:
                out.aux_hidden_states[i, :n] = s["aux_hidden_states"].float()
            out.input_ids[i, :n] = s["input_ids"].long()
            out.topk_ids[i, :n] = s["topk_ids"].long()
            out.topk_probs[i, :n] = s["topk_probs"].float()
            out.mask[i, :n] = True
        return out

    def token_counts(self, vocab_size: int) -> torch.Tensor:
        """``[vocab_size]`` int64: how often each token is the target's most likely next token."""
        counts = torch.zeros(vocab_size, dtype=torch.int64)
        for s in self.segments:
            counts += torch.bincount(s["topk_ids"][:, 0].long(), minlength=vocab_size)
        return counts


def frequent_token_vocab(counts: torch.Tensor, size: int) -> torch.Tensor:
    """The ``size`` most frequent token ids (``[size]`` int64, ascending id order): a reduced draft
    vocabulary as EAGLE-3 builds it (Li et al. 2025, section 3). Ties go to the lower id."""
    if not 1 <= size <= counts.numel():
        raise ValueError(f"draft vocabulary size must be in [1, {counts.numel()}], got {size}")
    order = torch.argsort(-counts, stable=True)[:size]
    return order.sort().values
