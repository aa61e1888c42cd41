"""Logprobs in the two formats of OpenAI's API: completions' parallel lists (``tokens``,
``token_logprobs``, ``top_logprobs``, ``text_offset``) and chat's ``content`` list of token objects."""
from __future__ import annotations

from specserve.entrypoints.openai.server_state import ServerState
from specserve.outputs import CompletionOutput, Logprob, RequestOutput


def _token_text(state: ServerState, token_id: int) -> str:
    return state.tokenizer.decode([token_id])


def _completion_format(state: ServerState, token_ids: list[int], entries: list[dict[int, Logprob] | None],
                       offset: int) -> dict:
    """Completions' logprobs object of ``token_ids``; a None entry (a prompt's first token) has a null
    logprob and top."""
    tokens, token_lps, tops, offsets = [], [], [], []
    for tid, entry in zip(token_ids, entries):
        s = _token_text(state, tid)
        tokens.append(s)
        token_lps.append(None if entry is None else entry[tid].logprob)
        tops.append(None if entry is None else
                    {_token_text(state, t): lp.logprob for t, lp in entry.items() if lp.rank is not None})
        offsets.append(offset)
        offset += len(s)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


def completion_logprobs(state: ServerState, c: CompletionOutput, start: int, end: int,
                        offset: int = 0) -> dict | None:
    """Logprobs of tokens ``start:end``; ``offset``: characters of the token texts before ``start``."""
    if c.logprobs is None:
        return None
    return _completion_format(state, c.token_ids[start:end], c.logprobs[start:end], offset)


def echo_logprobs(state: ServerState, out: RequestOutput) -> dict | None:
    """Completions' logprobs of the prompt's tokens (echo): the first token's logprob and top are
    null, as OpenAI's; None when the request asked for no logprobs."""
    if out.prompt_logprobs is None:
        return None
    return _completion_format(state, out.prompt_token_ids, out.prompt_logprobs, 0)


def join_logprobs(first: dict | None, second: dict | None) -> dict | None:
    """Two completions logprobs objects as one (``second``'s text offsets already continue ``first``'s)."""
    if first is None or second is None:
        return first if second is None else second
    return {k: first[k] + second[k] for k in first}


def chat_logprobs(state: ServerState, c: CompletionOutput, start: int, end: int, offset: int = 0) -> dict | None:
    """Chat's logprobs of tokens ``start:end`` (``offset`` is unused: chat has no text offsets)."""
    if c.logprobs is None:
        return None
    content = []
    for tid, entry in zip(c.token_ids[start:end], c.logprobs[start:end]):
        s = _token_text(state, tid)
        top = [{"token": _token_text(state, t), "logprob": lp.logprob,
                "bytes": list(_token_text(state, t).encode())}
               for t, lp in sorted(entry.items(), key=lambda kv: kv[1].rank or 0) if lp.rank is not None]
        content.append({"token": s, "logprob": entry[tid].logprob, "bytes": list(s.encode()), "top_logprobs": top})
    return {"content": content}
