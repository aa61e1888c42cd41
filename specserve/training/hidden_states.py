"""Precompute the target's hidden states and next-token distributions for head training.

The target runs through the engine's own path (:meth:`~specserve.engine.engine.LLMEngine.score`: the code
the server runs, paged KV cache included), so a head is trained on exactly the features it will
see at inference. Each document is cut into segments of at most ``seq_len`` tokens, each run
from position 0. Per token we store:

* ``hidden_states`` ``[N, H]`` (float16): the final-norm output that feeds the lm_head;
* ``aux_hidden_states`` ``[N, n * H]`` (float16), when ``aux_layers`` names n layers: the residual
  stream entering each, which an EAGLE-3 head fuses (Li et al. 2025, section 3.2);
* ``input_ids`` ``[N]`` int32;
* ``topk_ids`` ``[N, K]`` int32 and ``topk_probs`` ``[N, K]`` float16: the target's K most likely
  next tokens and their probabilities (softmax at temperature 1). Full logits would be
  151,936 floats per token for the Qwen models; the top 20 carry nearly all the mass.

Per segment: ``seq_lens [S]`` and ``seq_doc [S]`` (the document's index in the manifest).
Shards are ``shard_00000.safetensors`` ...; ``manifest.json`` lists them and the documents they
hold. A shard and its manifest entry are written only when whole (temporary file, then rename), so
an interrupted run resumes after the last complete shard and recomputes only the documents that
were not yet in one.
"""
from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

import torch
from tqdm import tqdm


MANIFEST = "manifest.json"
FORMAT_VERSION = 1


def bytes_per_token(hidden_size: int, top_k: int, num_aux_layers: int = 0) -> int:
    """Storage per token: float16 hidden states (final and auxiliary), int32 id, top-k int32 ids
    and float16 probs."""
    return 2 * hidden_size * (1 + num_aux_layers) + 4 + top_k * (4 + 2)


@dataclass
class PrecomputeSettings:
    target: str
    hidden_size: int
    vocab_size: int
    seq_len: int = 1024
    top_k: int = 20
    shard_tokens: int = 65536
    quantization: str = "none"   # the target's, as served: hidden states of another differ
    aux_layers: tuple[int, ...] = ()   # layers whose input residual stream is stored too (EAGLE-3)

    def __post_init__(self) -> None:
        self.aux_layers = tuple(sorted(set(int(i) for i in self.aux_layers)))
        for name in ("seq_len", "top_k", "shard_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.seq_len < 2:
            raise ValueError(f"seq_len must be >= 2, got {self.seq_len}")

    def as_dict(self) -> dict:
        d = {"target": self.target, "hidden_size": self.hidden_size, "vocab_size": self.vocab_size,
             "seq_len": self.seq_len, "top_k": self.top_k}
        if self.quantization != "none":   # folders made before the field existed stay valid
            d["quantization"] = self.quantization
        if self.aux_layers:
            d["aux_layers"] = list(self.aux_layers)
        return d


def read_manifest(data_dir: str | Path) -> dict:
    """The manifest of a precomputed folder. Raises FileNotFoundError when there is none."""
    path = Path(data_dir) / MANIFEST
    if not path.is_file():
        raise FileNotFoundError(f"no {MANIFEST} in {str(data_dir)!r}: precompute hidden states first")
    return json.loads(path.read_text())


def _write_json_atomic(path: Path, obj: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(obj, indent=1) + "\n")
    os.replace(tmp, path)


class _ShardBuffer:
    def __init__(self):
        self.parts: dict[str, list[torch.Tensor]] = {k: [] for k in
                                                     ("hidden_states", "aux_hidden_states", "input_ids",
                                                      "topk_ids", "topk_probs")}
        self.seq_lens: list[int] = []
        self.seq_doc: list[int] = []
        self.docs: list[str] = []
        self.num_tokens = 0

    def add(self, doc_index: int, hidden: torch.Tensor, ids: list[int], topk_ids: torch.Tensor,
            topk_probs: torch.Tensor, hidden_size: int) -> None:
        self.parts["hidden_states"].append(hidden[:, :hidden_size].to(torch.float16))
        if hidden.shape[1] > hidden_size:
            self.parts["aux_hidden_states"].append(hidden[:, hidden_size:].to(torch.float16))
        self.parts["input_ids"].append(torch.tensor(ids, dtype=torch.int32))
        self.parts["topk_ids"].append(topk_ids.to(torch.int32))
        self.parts["topk_probs"].append(topk_probs.to(torch.float16))
        self.seq_lens.append(len(ids))
        self.seq_doc.append(doc_index)
        self.num_tokens += len(ids)

    def tensors(self) -> dict[str, torch.Tensor]:
        out = {k: torch.cat(v).contiguous() for k, v in self.parts.items() if v}
        out["seq_lens"] = torch.tensor(self.seq_lens, dtype=torch.int64)
        out["seq_doc"] = torch.tensor(self.seq_doc, dtype=torch.int64)
        return out


@torch.inference_mode()
def _run_segments(engine, segments: list[list[int]], top_k: int, logits_chunk: int = 256):
    """Hidden states ``[sum L, H (1 + aux)]`` and top-k of the next-token distribution of every token."""
    scores = engine.score(segments)
    hidden = scores.hidden_states
    ids, probs = [], []
    for start in range(0, hidden.shape[0], logits_chunk):
        rows = list(range(start, min(start + logits_chunk, hidden.shape[0])))
        logits = scores.logits(rows)  # [c, V] float32 (any tensor-parallel size)
        p, i = torch.softmax(logits, dim=-1).topk(top_k, dim=-1)
        ids.append(i)
        probs.append(p)
    return hidden.float(), torch.cat(ids), torch.cat(probs)


class HiddenStateWriter:
    """Appends documents' hidden states to a folder as whole shards (see the module docstring).

    Args:
        out_dir: the folder; an existing manifest must have the same ``settings`` (and is
            marked incomplete until :meth:`close`).
        corpus: what the documents are (recorded in the manifest when closed complete).
    Raises:
        ValueError: the folder holds data made with other settings.
    """

    def __init__(self, out_dir: str | Path, settings: PrecomputeSettings, corpus: dict | None = None):
        self.out = Path(out_dir)
        self.out.mkdir(parents=True, exist_ok=True)
        self.path = self.out / MANIFEST
        self.settings, self.corpus = settings, corpus
        if self.path.is_file():
            manifest = json.loads(self.path.read_text())
            if manifest["settings"] != settings.as_dict():
                raise ValueError(f"{self.out} holds hidden states made with {manifest['settings']}, "
                                 f"not {settings.as_dict()}; use another folder")
            manifest["complete"] = False   # until every document of this run is in
        else:
            manifest = {"version": FORMAT_VERSION, "settings": settings.as_dict(), "documents": [], "shards": [],
                        "complete": False}
        self.manifest = manifest
        _write_json_atomic(self.path, manifest)
        self.done = set(manifest["documents"])
        self.buf = _ShardBuffer()

    @property
    def num_tokens_done(self) -> int:
        return sum(s["num_tokens"] for s in self.manifest["shards"])

    def start_document(self, doc_id: str) -> int:
        """Register ``doc_id`` for the shard being filled; returns its index in the manifest."""
        index = len(self.manifest["documents"]) + len(self.buf.docs)
        self.buf.docs.append(doc_id)
        return index

    def add_segment(self, doc_index: int, ids: list[int], hidden: torch.Tensor, topk_ids: torch.Tensor,
                    topk_probs: torch.Tensor) -> None:
        """One segment: ``ids [L]``, the model's ``hidden [L, H (1 + aux)]`` and the top-k."""
        self.buf.add(doc_index, hidden, ids, topk_ids, topk_probs, self.settings.hidden_size)

    def flush_shard(self) -> None:
        """Write the buffered documents as one shard and list them in the manifest."""
        from specserve.models.loader import save_safetensors

        if not self.buf.num_tokens:
            return
        name = f"shard_{len(self.manifest['shards']):05d}.safetensors"
        tmp = self.out / (name + ".tmp")
        save_safetensors(self.buf.tensors(), tmp)
        os.replace(tmp, self.out / name)
        self.manifest["documents"].extend(self.buf.docs)
        self.done.update(self.buf.docs)
        self.manifest["shards"].append({"file": name, "num_tokens": self.buf.num_tokens,
                                        "num_seqs": len(self.buf.seq_lens)})
        _write_json_atomic(self.path, self.manifest)
        self.buf = _ShardBuffer()

    def close(self, complete: bool) -> dict:
        self.flush_shard()
        self.manifest["complete"] = complete
        if complete and self.corpus is not None:
            self.manifest["corpus"] = self.corpus
        _write_json_atomic(self.path, self.manifest)
        return self.manifest


def precompute_hidden_states(engine, documents: Iterable[tuple[str, list[int]]], out_dir: str | Path,
                             settings: PrecomputeSettings, batch_tokens: int = 2048,
                             total_tokens: int | None = None, progress: bool = True,
                             corpus: dict | None = None) -> dict:
    """Run the target over ``documents`` and write sharded safetensors into ``out_dir``.

    Args:
        engine: an :class:`~specserve.engine.engine.LLMEngine` holding the target (no requests
            may run on it meanwhile: its page pool is borrowed).
        documents: ``(doc_id, token_ids)`` pairs; ids must be unique. Documents already in the
            folder (an interrupted run, or captured while generating) are skipped.
        settings: segment length, top-k and shard size; must match an existing manifest.
        batch_tokens: tokens per target forward (segments are batched up to this).
        total_tokens: for the progress bar and size estimate (None: unknown).
        corpus: what the documents are (recorded in the manifest: a folder is complete for a corpus).
    Returns:
        The manifest (also written to ``out_dir/manifest.json``).
    Raises:
        ValueError: the folder holds data made with other settings, or a duplicate doc_id.
    """
    writer = HiddenStateWriter(out_dir, settings, corpus)
    done = writer.done
    per_token = bytes_per_token(settings.hidden_size, settings.top_k, len(settings.aux_layers))
    previous_aux, engine.aux_hidden_state_layers = engine.aux_hidden_state_layers, settings.aux_layers
    if total_tokens is not None:
        print(f"hidden states: about {total_tokens:,} tokens x {per_token:,} bytes = "
              f"{total_tokens * per_token / 2**30:.2f} GiB in {writer.out}"
              + (f" ({len(done)} documents, {writer.num_tokens_done:,} tokens already done)" if done else ""),
              flush=True)
    bar = tqdm(total=total_tokens, unit="tok", desc="hidden states", disable=not progress)
    pending, pending_tokens = [], 0
    seen, timed = set(), []

    def flush_batch():
        nonlocal pending, pending_tokens
        if not pending:
            return
        t0 = time.perf_counter()
        hidden, topk_ids, topk_probs = _run_segments(engine, [seg for _, seg in pending], settings.top_k)
        if not timed and total_tokens is not None:   # the estimate, from the first batch's speed
            timed.append(pending_tokens / (time.perf_counter() - t0))
            left = max(total_tokens - writer.num_tokens_done, 0)   # documents done before are skipped
            print(f"hidden states: {timed[0]:.0f} tokens/s, about {left / timed[0] / 60:.0f} min for the "
                  f"~{left:,} tokens left", flush=True)
        start = 0
        for doc_index, seg in pending:
            n = len(seg)
            writer.add_segment(doc_index, seg, hidden[start:start + n], topk_ids[start:start + n],
                               topk_probs[start:start + n])
            start += n
        bar.update(pending_tokens)
        pending, pending_tokens = [], 0

    try:
        for doc_id, ids in documents:
            if doc_id in seen:
                raise ValueError(f"duplicate document id {doc_id!r}")
            seen.add(doc_id)
            if doc_id in done:
                bar.update(len(ids))
                continue
            doc_index = writer.start_document(doc_id)
            for s in range(0, len(ids), settings.seq_len):
                seg = list(ids[s:s + settings.seq_len])
                if len(seg) < 2:
                    continue
                if pending_tokens + len(seg) > batch_tokens:
                    flush_batch()
                pending.append((doc_index, seg))
                pending_tokens += len(seg)
            if writer.buf.num_tokens + pending_tokens >= settings.shard_tokens:
                flush_batch()
                writer.flush_shard()
        flush_batch()
    finally:
        bar.close()
        engine.aux_hidden_state_layers = previous_aux
    return writer.close(complete=True)


def _step_logits(engine, result, rows: list[int]) -> torch.Tensor:
    """The target's raw logits ``[len(rows), V]`` float32 at hidden-state ``rows`` of a step: the
    rows the step scored already (every decode row: its sampled one) are reused, and the rest
    (prefill rows) get one lm_head call, so the vocabulary's weights are read once either way."""
    have = {r: i for i, r in enumerate(result.logit_rows or [])} if result.logits is not None else {}
    missing = [n for n, r in enumerate(rows) if r not in have]
    if len(missing) == len(rows):
        return engine.compute_logits(result.hidden_states, rows)
    out = result.logits.index_select(0, torch.tensor([have.get(r, 0) for r in rows], device=result.logits.device))
    if missing:
        out[torch.tensor(missing)] = engine.compute_logits(result.hidden_states, [rows[n] for n in missing])
    return out


class _CapturedSequence:
    def __init__(self):
        self.hidden: list[torch.Tensor] = []
        self.topk_ids: list[torch.Tensor] = []
        self.topk_probs: list[torch.Tensor] = []


def generate_with_hidden_states(llm, items: list[tuple[str, str]], params, out_dir: str | Path,
                                settings: PrecomputeSettings, chunk: int = 32, progress: bool = True) -> dict[str, list[int]]:
    """Self-distillation that keeps what it computes: generate answers to ``items`` (``(doc_id,
    prompt text)``) and store, as the target computes them (prefill chunks, then each decode
    step), the hidden states and next-token top-k of every position, so the documents need no
    second pass through :func:`precompute_hidden_states` (half the target's work for them).

    A document is the prompt and the answer, less the last answer token (the target never ran on
    it). Its positions keep their whole context; it is stored as ``seq_len`` segments. ``chunk``
    prompts run at a time, each chunk a shard: an interrupted run keeps the chunks written and
    skips their documents when rerun.

    Args:
        llm: an ``LLM`` without speculation (no other requests may run on it meanwhile).
        params: the ``SamplingParams`` of the answers (greedy for self-distillation).
    Returns:
        ``{doc_id: token ids}`` of the documents now in the folder (the answers included).
    """
    engine = llm.llm_engine
    if engine.spec_config is not None:
        raise ValueError("generate_with_hidden_states needs an engine without speculation")
    writer = HiddenStateWriter(out_dir, settings)
    todo = [it for it in items if it[0] not in writer.done]
    top_k = settings.top_k
    captured: dict[int, _CapturedSequence] = {}   # by seq_id

    def observe(reqs, result):   # called before the step's tokens are committed
        caps, sizes, flat = [], [], []
        for b, req in enumerate(reqs):
            cap, rows = captured.get(req.seq_id), result.hidden_rows[b]
            if cap is not None and len(rows):
                caps.append(cap)
                sizes.append(len(rows))
                flat.extend(rows)
        if not caps:
            return
        hidden = result.hidden_states[torch.tensor(flat)]
        with torch.inference_mode():
            p, i = torch.softmax(_step_logits(engine, result, flat), dim=-1).topk(top_k, dim=-1)
        for cap, h, pp, ii in zip(caps, hidden.split(sizes), p.split(sizes), i.split(sizes)):
            cap.hidden.append(h.to(torch.float16))
            cap.topk_ids.append(ii.to(torch.int32))
            cap.topk_probs.append(pp.to(torch.float16))

    tokens_of: dict[str, list[int]] = {}
    previous_aux, engine.aux_hidden_state_layers = engine.aux_hidden_state_layers, settings.aux_layers
    engine.step_observers.append(observe)
    try:
        bar = tqdm(total=len(todo) * params.max_tokens, unit="tok", desc="self-distillation + hidden states",
                   disable=not progress)
        for s in range(0, len(todo), chunk):
            part, seq_of = todo[s:s + chunk], {}
            for doc_id, prompt in part:
                rid = engine.add_request(f"capture/{doc_id}", prompt, params)
                seq_of[doc_id] = engine.requests[rid][0].seq_id
                captured[seq_of[doc_id]] = _CapturedSequence()
            outs = {}
            while engine.has_unfinished_requests():
                for out in engine.step():
                    bar.update(1)   # a plain step gives each advancing request one token
                    if out.finished:
                        outs[out.request_id] = out
            for doc_id, _ in part:
                out, cap = outs[f"capture/{doc_id}"], captured.pop(seq_of[doc_id])
                tokens = list(out.prompt_token_ids) + list(out.outputs[0].token_ids)
                tokens_of[doc_id] = tokens
                hidden, ids_k, probs_k = (torch.cat(x) for x in (cap.hidden, cap.topk_ids, cap.topk_probs))
                n = min(hidden.shape[0], len(tokens) - 1)   # the last token was never fed to the target
                index = writer.start_document(doc_id)
                for a in range(0, n, settings.seq_len):
                    b = min(n, a + settings.seq_len)
                    if b - a >= 2:
                        writer.add_segment(index, tokens[a:b], hidden[a:b], ids_k[a:b], probs_k[a:b])
            writer.flush_shard()
        bar.close()
    finally:
        engine.step_observers.remove(observe)
        engine.aux_hidden_state_layers = previous_aux
        captured.clear()
    writer.close(complete=False)   # complete once the rest of the corpus is precomputed
    return tokens_of
