"""One API request's generation: its prompts queued as engine requests, and the response they make,
a JSON body or server-sent events (text held back while it could still become a stop string, aborted
when the client goes away)."""
from __future__ import annotations

import asyncio
import json
import time
import uuid
from dataclasses import dataclass
from typing import Any, AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from specserve.entrypoints.async_engine import EngineDeadError, ServerShutdownError
from specserve.entrypoints.openai.errors import APIError, error_body
from specserve.entrypoints.openai.logprobs import chat_logprobs, completion_logprobs, echo_logprobs, join_logprobs
from specserve.entrypoints.openai.prompts import PreparedPrompt
from specserve.entrypoints.openai.server_state import ServerState
from specserve.outputs import CompletionOutput, RequestOutput
from specserve.sampling_params import SamplingParams


@dataclass
class _ChoiceState:
    """What a stream has sent of one choice so far."""
    sent_text: int = 0
    sent_tokens: int = 0
    token_text_offset: int = 0   # characters of the token texts already sent (completion text_offset)
    started: bool = False
    finished: bool = False


def _visible_text(c: CompletionOutput, params: SamplingParams) -> str:
    """The text safe to stream: while running, hold back what could still become a stop string
    (it would be cut) and a trailing partial UTF-8 character."""
    if c.finish_reason is not None:
        return c.text
    text = c.text
    hold = max((len(s) for s in params.stop), default=1) - 1
    if hold:
        text = text[:max(0, len(text) - hold)]
    return text.rstrip("\ufffd")


def _usage(prompts: list[PreparedPrompt], finals: list[RequestOutput | None]) -> dict:
    prompt_tokens = sum(len(p.token_ids) for p in prompts)
    completion_tokens = sum(len(c.token_ids) for out in finals if out is not None for c in out.outputs)
    cached = sum(out.num_cached_tokens for out in finals if out is not None)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached}}   # OpenAI's field: prompt tokens served from cache


async def _merge_streams(iterators: list[AsyncIterator]) -> AsyncIterator[tuple[int, Any]]:
    """Yield ``(i, item)`` from several async iterators as items arrive. Closing this generator
    cancels the rest (their requests are aborted)."""
    done_marker = object()
    q: asyncio.Queue = asyncio.Queue()

    async def drain(i: int, it: AsyncIterator) -> None:
        try:
            async for item in it:
                await q.put((i, item))
        except Exception as e:  # noqa: BLE001 - forwarded to the consumer
            await q.put((i, e))
        finally:
            await q.put((i, done_marker))

    tasks = [asyncio.create_task(drain(i, it)) for i, it in enumerate(iterators)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item = await q.get()
            if item is done_marker:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _sse(obj: dict) -> str:
    """One server-sent event."""
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


class Generation:
    """One API request: its prompts, their engine requests and the response they make."""

    def __init__(self, state: ServerState, prompts: list[PreparedPrompt], kind: str, n: int, echo: bool = False):
        self.state, self.prompts, self.kind, self.n, self.echo = state, prompts, kind, n, echo
        prefix = "chatcmpl" if kind == "chat" else "cmpl"
        self.id = f"{prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.object = "chat.completion" if kind == "chat" else "text_completion"
        # queued now, so the next request's queue check counts these
        self.streams = [state.engine.add_request(f"{self.id}-{i}", p.text, p.params, p.token_ids)
                        for i, p in enumerate(prompts)]

    def iterators(self) -> list[AsyncIterator[RequestOutput]]:
        return [s.__aiter__() for s in self.streams]

    def abort(self) -> None:
        """Abort every request not finished yet (the client went away)."""
        for s in self.streams:
            s.abort()

    def _logprobs(self, c: CompletionOutput, start: int, end: int, offset: int = 0) -> dict | None:
        fn = chat_logprobs if self.kind == "chat" else completion_logprobs
        return fn(self.state, c, start, end, offset)

    def _echo(self, i: int, out: RequestOutput) -> tuple[str, dict | None]:
        """Prompt i's text and its tokens' logprobs, when echoed (completions with echo=true)."""
        if not self.echo:
            return "", None
        return self.prompts[i].text or "", echo_logprobs(self.state, out)

    async def full(self) -> dict:
        """The whole response body, once every choice has finished."""
        finals: list[RequestOutput | None] = [None] * len(self.prompts)
        try:
            async for i, out in _merge_streams(self.iterators()):
                finals[i] = out
        finally:
            self.abort()
        failed = _constraint_failure(finals)
        if failed is not None:
            raise APIError(400, failed)
        choices = []
        for i, out in enumerate(finals):
            echo, echo_lps = self._echo(i, out)
            offset = sum(len(t) for t in echo_lps["tokens"]) if echo_lps is not None else 0
            for c in sorted(out.outputs, key=lambda c: c.index):
                choice: dict[str, Any] = {"index": i * self.n + c.index,
                                          "logprobs": join_logprobs(echo_lps, self._logprobs(c, 0, len(c.token_ids),
                                                                                             offset)),
                                          "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
                if self.kind == "chat":
                    choice["message"] = {"role": "assistant", "content": c.text}
                else:
                    choice["text"] = echo + c.text
                choices.append(choice)
        return {"id": self.id, "object": self.object, "created": self.created,
                "model": self.state.served_model_name, "choices": choices,
                "usage": _usage(self.prompts, finals)}

    async def stream(self, include_usage: bool) -> AsyncIterator[str]:
        """Server-sent events: a chunk whenever a choice has new text or tokens, then ``[DONE]``."""
        obj = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        states: dict[int, _ChoiceState] = {}
        finals: list[RequestOutput | None] = [None] * len(self.prompts)
        try:
            async for i, out in _merge_streams(self.iterators()):
                if out.finished:
                    finals[i] = out
                failed = _constraint_failure([out])
                if failed is not None:   # mid-stream: an error event, as for a dead engine
                    yield _sse(error_body(failed))
                    break
                params = self.prompts[i].params
                choices = []
                for c in out.outputs:
                    index = i * self.n + c.index
                    st = states.setdefault(index, _ChoiceState())
                    if st.finished:
                        continue
                    text = _visible_text(c, params)
                    delta_text = text[st.sent_text:] if len(text) > st.sent_text else ""
                    end = len(c.token_ids)
                    finished = c.finish_reason is not None
                    if not delta_text and end == st.sent_tokens and not finished:
                        continue
                    echo_lps = None
                    if not st.started and self.echo:   # the first chunk of a choice carries its prompt
                        echo, echo_lps = self._echo(i, out)
                        delta_text = echo + delta_text
                        if echo_lps is not None:
                            st.token_text_offset += sum(len(t) for t in echo_lps["tokens"])
                    logprobs = self._logprobs(c, st.sent_tokens, end, st.token_text_offset)
                    if logprobs is not None and "tokens" in logprobs:
                        st.token_text_offset += sum(len(t) for t in logprobs["tokens"])
                    logprobs = join_logprobs(echo_lps, logprobs)
                    choice: dict[str, Any] = {"index": index, "logprobs": logprobs,
                                              "finish_reason": c.finish_reason,
                                              "stop_reason": c.stop_reason if finished else None}
                    if self.kind == "chat":
                        delta: dict[str, Any] = {"content": delta_text}
                        if not st.started:
                            delta["role"] = "assistant"
                        choice["delta"] = delta
                    else:
                        choice["text"] = delta_text
                    st.started, st.finished = True, finished
                    st.sent_text, st.sent_tokens = max(st.sent_text, len(text)), end
                    choices.append(choice)
                if choices:
                    yield _sse({"id": self.id, "object": obj, "created": self.created,
                                "model": self.state.served_model_name, "choices": choices})
            if include_usage:
                yield _sse({"id": self.id, "object": obj, "created": self.created,
                            "model": self.state.served_model_name, "choices": [],
                            "usage": _usage(self.prompts, finals)})
        except ServerShutdownError as e:   # the final event of a stream cut at the shutdown bound
            yield _sse(error_body(str(e), "service_unavailable", code="server_shutdown"))
        except EngineDeadError as e:
            yield _sse(error_body(str(e), "internal_error"))
        finally:
            self.abort()
        yield "data: [DONE]\n\n"


def _constraint_failure(outputs: list[RequestOutput | None]) -> str | None:
    """The message of a choice that ended because its output constraint failed in llguidance
    (the engine ends it with finish reason "abort" and the reason), else None."""
    for out in outputs:
        for c in (out.outputs if out is not None else []):
            if c.finish_reason == "abort" and isinstance(c.stop_reason, str):
                return f"{c.stop_reason}; simplify the schema, regex or grammar"
    return None


def include_usage(body) -> bool:
    """OpenAI ends a stream with a usage-only chunk (empty ``choices``) only when asked to."""
    return body.stream_options is not None and body.stream_options.include_usage


async def _until_disconnected(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def respond(request: Request, gen: Generation, stream: bool, include_usage: bool) -> Response:
    """The generation's answer: streamed, or a JSON body (499 when the client goes away first)."""
    if stream:
        # Starlette cancels the body iterator when the client disconnects; that aborts the requests.
        return StreamingResponse(gen.stream(include_usage), media_type="text/event-stream")
    work = asyncio.create_task(gen.full())
    watch = asyncio.create_task(_until_disconnected(request))
    done, _ = await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
    if work not in done:  # the client went away
        work.cancel()
        await asyncio.gather(work, return_exceptions=True)
        gen.abort()
        return Response(status_code=499)
    watch.cancel()
    try:
        return JSONResponse(work.result())
    except EngineDeadError as e:
        raise APIError(503, str(e), type_="service_unavailable") from None
