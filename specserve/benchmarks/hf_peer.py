"""HF transformers as a peer in ``specserve bench`` (``--peers hf``, the default).

``generate`` (``do_sample=False``, ``min_new_tokens = max_new_tokens = n``) on the same weights and
prompt token ids as our engine; token times come from a streamer (its first ``put`` is the prompt).
The figures are summarized as our engine's (:func:`~specserve.benchmarks.engine_runs.summarize`).
"""
from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import torch

from specserve.benchmarks.engine_runs import summarize
from specserve.benchmarks.machine import load_average


def load_hf_model(model: str, dtype: torch.dtype):
    """transformers ``AutoModelForCausalLM`` on the same weights as ``--model``."""
    from transformers import AutoModelForCausalLM

    from specserve.models import registry
    from specserve.models.loader import resolve_gguf

    path = Path(os.path.expanduser(model))
    if path.is_dir() and (path / "config.json").is_file():
        return AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype).eval()
    if path.is_dir():
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) != 1:
            raise ValueError(f"folder {model!r} has no config.json and {len(ggufs)} .gguf files")
        path = ggufs[0]
    elif not path.is_file() and registry.get_entry(model) is not None:
        path = Path(resolve_gguf(model))
    if path.is_file():
        return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=dtype).eval()
    return AutoModelForCausalLM.from_pretrained(model, dtype=dtype).eval()  # hub id


def _make_streamer(times: list[float]):
    from transformers.generation.streamers import BaseStreamer

    class TimingStreamer(BaseStreamer):
        """Records the time of every ``put`` (the first one carries the prompt)."""

        def put(self, value):
            times.append(time.perf_counter())

        def end(self):
            pass

    return TimingStreamer()


def _run_hf_batch(model, batch: list[list[int]], max_tokens: int, pad_id: int) -> tuple[list[dict], dict]:
    width = max(len(x) for x in batch)
    ids = torch.tensor([[pad_id] * (width - len(x)) + x for x in batch], dtype=torch.long)
    mask = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in batch], dtype=torch.long)
    times: list[float] = []
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=max_tokens,
                             min_new_tokens=max_tokens, pad_token_id=pad_id, streamer=_make_streamer(times),
                             num_beams=1, temperature=None, top_p=None, top_k=None)
    token_times = times[1:]  # first put = the prompt
    n = out.shape[1] - width
    records = [{"t0": t0, "t_first": token_times[0], "t_last": token_times[-1], "n_tokens": n,
                "token_ids": out[j, width:].tolist()} for j in range(len(batch))]
    batch_rec = {"t0": t0, "t_first": token_times[0], "t_last": token_times[-1], "n_tokens": n * len(batch),
                 "batch_size": len(batch)}
    return records, batch_rec


def bench_hf(model, prompt_ids: list[list[int]], max_tokens: int, batch_size: int, pad_id: int) -> dict:
    from tqdm import tqdm

    _run_hf_batch(model, [prompt_ids[0]], min(4, max_tokens), pad_id)  # warm-up
    records, batches = [], []
    for start in tqdm(range(0, len(prompt_ids), batch_size), desc="transformers", unit="batch", file=sys.stderr):
        recs, b = _run_hf_batch(model, prompt_ids[start:start + batch_size], max_tokens, pad_id)
        b["load_average"] = load_average()
        records += recs
        batches.append(b)
    return {"summary": summarize(records, batches), "per_prompt": records, "batches": batches}
