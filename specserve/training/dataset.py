"""Segments of precomputed hidden states as training examples, split by document.

One example is one segment (see :mod:`specserve.training.hidden_states`) of L tokens
``x_0 .. x_{L-1}`` with target hidden states ``h_0 .. h_{L-1}`` and, at each position t, the
top-k of the target's distribution of ``x_{t+1}`` (and, for EAGLE-3 heads, the target's
auxiliary-layer features). The kept segments are read into memory (float16 hidden states: 2 x
hidden_size bytes per token, times 1 + the number of auxiliary layers when they are loaded).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from specserve.training.corpus import is_validation, order_key
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
        max_tokens: keep whole segments, documents taken in the corpus's stable order
            (:func:`~specserve.training.corpus.order_key`), until this many tokens (None: every
            segment, in the order written).
        load_aux: also load the auxiliary-layer features (EAGLE-3 heads).
    Raises:
        FileNotFoundError: no manifest. ValueError: a bad split, an empty split, or ``load_aux``
        on a folder precomputed without auxiliary layers.
    """

    def __init__(self, data_dir: str | Path, split: str = "train", val_fraction: float = 0.05,
                 max_tokens: int | None = None, load_aux: bool = False):
        from safetensors import safe_open

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
        # the split's segments (shard, first row, length, document), from the shards' small index tensors
        index: list[tuple[str, int, int, int]] = []
        for shard in self.manifest["shards"]:
            path = str(Path(data_dir) / shard["file"])
            with safe_open(path, "pt") as f:
                lens, seq_doc = f.get_tensor("seq_lens").tolist(), f.get_tensor("seq_doc").tolist()
            start = 0
            for n, d in zip(lens, seq_doc):
                if is_validation(docs[d], val_fraction) == want_val:
                    index.append((path, start, n, d))
                start += n
        if max_tokens is not None:
            # a prefix in the corpus's stable document order (not the order documents were written
            # in: self-distilled ones come first), so every size mixes the corpora alike and a
            # smaller prefix of a folder is part of a larger one
            index.sort(key=lambda e: (order_key(docs[e[3]]), e[1]))   # a document's segments stay in order
            kept, total = [], 0
            for e in index:
                if total >= max_tokens:
                    break
                kept.append(e)
                total += e[2]
            index = kept
        self.segments: list[dict[str, torch.Tensor]] = []
        self.doc_ids: list[str] = []
        self.num_tokens = 0
        by_shard: dict[str, list[int]] = {}
        for i, (path, _, _, _) in enumerate(index):
            by_shard.setdefault(path, []).append(i)
        loaded: list[dict[str, torch.Tensor]] = [{} for _ in index]
        for path, members in by_shard.items():   # each shard is opened once; only the kept rows are read
            with safe_open(path, "pt") as f:
                for k in keys:
                    sl = f.get_slice(k)
                    for i in members:
                        _, start, n, _ = index[i]
                        loaded[i][k] = sl[start:start + n]
        for (_, _, n, d), seg in zip(index, loaded):
            self.segments.append(seg)
            self.doc_ids.append(docs[d])
            self.num_tokens += n
        if not self.segments:
            raise ValueError(f"the {split} split of {str(data_dir)!r} is empty "
                             f"({len(docs)} documents, val_fraction {val_fraction})")

    def __len__(self) -> int:
        return len(self.segments)

    def batch(self, indices: list[int], pad_multiple: int = 1) -> Batch:
        """The segments ``indices`` padded (``mask`` False) to the longest, rounded up to a multiple
        of ``pad_multiple``: few distinct shapes keep oneDNN's per-shape primitive cache small."""
        segs = [self.segments[i] for i in indices]
        b, t = len(segs), max(s["input_ids"].shape[0] for s in segs)
        t = -(-t // pad_multiple) * pad_multiple
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
