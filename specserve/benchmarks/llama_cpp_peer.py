"""llama.cpp as a peer in ``specserve bench --peers llama.cpp`` (through llama-cpp-python).

The same GGUF files, prompt token ids and token counts as our engine, greedy, EOS ignored:

* **plain**: ``Llama.generate`` on the target GGUF, one prompt at a time; TTFT is the first token's
  time after the prompt is handed over, decode tokens/s ``(n - 1) / (t_last - t_first)``.
* **speculative** (``draft_model``): llama-cpp-python verifies the drafts that a
  ``LlamaDraftModel`` proposes (its speculative hook); :class:`GreedyDraftLlama` proposes k greedy
  tokens from a second ``Llama`` on the draft GGUF, as llama.cpp's own draft-model speculation
  does. We report whether its speculative greedy tokens equal its own plain greedy tokens.
* **perplexity** of the target on given token segments (``logits_all``), beside ours.

llama-cpp-python is in the ``bench`` extra; pip builds it from its sdist (several minutes; it
compiles llama.cpp for this CPU).
"""
from __future__ import annotations

import math
import time
from pathlib import Path

import numpy as np


def _llama_cpp():
    try:
        import llama_cpp
    except ImportError:
        raise ValueError("--peers llama.cpp needs llama-cpp-python: pip install -e '.[bench]' "
                         "(builds llama.cpp from source, several minutes)") from None
    return llama_cpp


def gguf_path(model: str) -> str:
    """The GGUF file behind ``model`` (a built-in name or a .gguf path), for llama.cpp."""
    from specserve.models.loader import resolve_gguf
    from specserve.models.registry import get_entry

    if get_entry(model) is not None:
        return str(resolve_gguf(model))
    if str(model).lower().endswith(".gguf") and Path(model).expanduser().is_file():
        return str(Path(model).expanduser())
    raise ValueError(f"--peers llama.cpp needs a GGUF model (a built-in name or a .gguf file), got {model!r}")


def _open(path: str, n_ctx: int, threads: int, **kw):
    llama_cpp = _llama_cpp()
    return llama_cpp.Llama(model_path=str(path), n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads,
                           n_batch=512, verbose=False, **kw)


def _last_logits(llm) -> np.ndarray:
    return np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(llm.n_vocab(),))


def make_greedy_draft(draft_path: str, k: int, n_ctx: int, threads: int):
    """A ``LlamaDraftModel`` proposing ``k`` greedy tokens from the draft GGUF (its KV cache kept
    across calls: only tokens it has not seen are evaluated)."""
    from llama_cpp.llama_speculative import LlamaDraftModel

    class GreedyDraftLlama(LlamaDraftModel):
        def __init__(self):
            self.llm = _open(draft_path, n_ctx, threads)

        def __call__(self, input_ids, /, **kwargs):
            llm = self.llm
            ids = [int(t) for t in input_ids]
            seen = llm.input_ids[:llm.n_tokens].tolist()
            common = 0
            while common < min(len(seen), len(ids)) and seen[common] == ids[common]:
                common += 1
            common = min(common, len(ids) - 1)  # re-evaluate at least the last token for its logits
            llm.n_tokens = common
            llm.eval(ids[common:])
            out = []
            for i in range(k):
                if llm.n_tokens >= n_ctx - 1:
                    break
                out.append(int(np.argmax(_last_logits(llm))))
                if i + 1 < k:
                    llm.eval([out[-1]])
            return np.array(out, dtype=np.intc)

    return GreedyDraftLlama()


def _generate(llm, prompt: list[int], max_tokens: int) -> dict:
    llm.reset()
    t0 = time.perf_counter()
    times, tokens = [], []
    for tok in llm.generate(prompt, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0, reset=True):
        times.append(time.perf_counter())
        tokens.append(int(tok))
        if len(tokens) >= max_tokens:
            break
    n = len(tokens)
    decode = (n - 1) / (times[-1] - times[0]) if n > 1 and times[-1] > times[0] else None
    return {"ttft_s": times[0] - t0, "decode_tok_s": decode, "e2e_s": times[-1] - t0, "num_tokens": n,
            "token_ids": tokens}


def _summary(per_prompt: list[dict]) -> dict:
    import statistics

    dec = [r["decode_tok_s"] for r in per_prompt if r["decode_tok_s"]]
    toks = sum(r["num_tokens"] for r in per_prompt)
    return {"decode_tok_s_median": statistics.median(dec) if dec else None,
            "ttft_s_median": statistics.median(r["ttft_s"] for r in per_prompt),
            "e2e_tok_s_aggregate": toks / sum(r["e2e_s"] for r in per_prompt)}


def bench_llama_cpp(target_gguf: str, prompt_ids: list[list[int]], max_tokens: int, threads: int,
                    draft_gguf: str | None = None, ks: list[int] = ()) -> dict:
    """Plain and (with ``draft_gguf``) speculative greedy decoding of every prompt; see the module."""
    llama_cpp = _llama_cpp()
    n_ctx = max(len(p) for p in prompt_ids) + max_tokens + 16
    llm = _open(target_gguf, n_ctx, threads)
    plain = [_generate(llm, p, max_tokens) for p in prompt_ids]
    out = {"version": getattr(llama_cpp, "__version__", "?"), "threads": threads, "gguf": str(target_gguf),
           "plain": {"per_prompt": plain, "summary": _summary(plain)}, "speculative": []}
    del llm
    for k in ks if draft_gguf else ():
        llm = _open(target_gguf, n_ctx, threads, draft_model=make_greedy_draft(draft_gguf, k, n_ctx, threads))
        runs = [_generate(llm, p, max_tokens) for p in prompt_ids]
        same = sum(a["token_ids"] == b["token_ids"] for a, b in zip(runs, plain))
        s = _summary(runs)
        out["speculative"].append({
            "k": k, "draft_gguf": str(draft_gguf), "per_prompt": runs, "summary": s,
            "greedy_equal_to_plain": f"{same}/{len(runs)}",
            "speedup_decode_median": (s["decode_tok_s_median"] / out["plain"]["summary"]["decode_tok_s_median"]
                                      if s["decode_tok_s_median"] else None)})
        del llm
    return out


def prefill_llama_cpp(target_gguf: str, prompts: list[list[int]], threads: int) -> dict:
    """llama.cpp's prompt processing rate: each prompt evaluated from an empty cache, its length over
    the time of ``Llama.eval`` (batches of 512 tokens)."""
    import statistics

    llm = _open(target_gguf, max(len(p) for p in prompts) + 8, threads)
    llm.reset()
    llm.eval(prompts[0][:64])   # warm-up
    rates = []
    for ids in prompts:
        llm.reset()
        t = time.perf_counter()
        llm.eval(ids)
        rates.append(len(ids) / (time.perf_counter() - t))
    return {"tokens": len(prompts[0]), "tok_s": rates, "tok_s_median": statistics.median(rates)}


def perplexity_llama_cpp(target_gguf: str, segments: list[list[int]], threads: int) -> dict:
    """Teacher-forced perplexity and argmax ids of llama.cpp over ``segments`` (each from position 0)."""
    n_ctx = max(len(s) for s in segments) + 8
    llm = _open(target_gguf, n_ctx, threads, logits_all=True)
    nll, count, argmax = 0.0, 0, []
    for seg in segments:
        llm.reset()
        llm.eval(seg)
        logits = np.asarray(llm.scores[:len(seg)], dtype=np.float64)     # [L, V]
        logz = np.log(np.exp(logits - logits.max(1, keepdims=True)).sum(1)) + logits.max(1)
        targets = np.asarray(seg[1:])
        nll -= float((logits[np.arange(len(seg) - 1), targets] - logz[:-1]).sum())
        count += len(seg) - 1
        argmax.append(logits.argmax(1)[:-1])
    return {"perplexity": math.exp(nll / count), "num_tokens": count,
            "argmax": np.concatenate(argmax).tolist()}
