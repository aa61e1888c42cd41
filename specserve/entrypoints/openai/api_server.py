"""OpenAI-compatible HTTP server: ``specserve serve --model M [--speculative-model D ...]``.

FastAPI + uvicorn over :class:`~specserve.entrypoints.async_engine.AsyncLLMEngine`. Endpoints:
``/v1/completions`` and ``/v1/chat/completions`` (streamed as server-sent events or not),
``/v1/models``, ``/health`` and ``/metrics`` (Prometheus). Errors use OpenAI's format
``{"error": {"message", "type", "param", "code"}}``: 400 for invalid parameters or a prompt too long
for the context, 404 for an unknown model or route, 503 when the waiting queue is full.

The front end tokenizes with its own copy of the tokenizer (the engine thread detokenizes with the
other) and checks every request with ``LLMEngine.validate`` before it is queued, so a bad request
never reaches the step loop.
"""
from __future__ import annotations

import asyncio
import copy
import json
import logging
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from specserve.entrypoints.async_engine import AsyncLLMEngine, EngineDeadError
from specserve.entrypoints.openai.metrics import ServerMetrics
from specserve.entrypoints.openai.protocol import (ChatCompletionRequest, CompletionRequest, ErrorResponse,
                                                   ModelCard, ModelList)
from specserve.outputs import CompletionOutput, RequestOutput
from specserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    400: {"model": ErrorResponse, "description": "Invalid parameters or prompt too long"},
    404: {"model": ErrorResponse, "description": "Unknown model"},
    503: {"model": ErrorResponse, "description": "Waiting queue full, or the engine stopped"},
}


class APIError(Exception):
    """An error answered in OpenAI's format."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code


def error_response(status: int, message: str, type_: str = "invalid_request_error",
                   param: str | None = None, code: str | None = None) -> JSONResponse:
    body = {"error": {"message": message, "type": type_, "param": param, "code": code}}
    return JSONResponse(body, status_code=status)


@dataclass
class _Prompt:
    text: str | None
    token_ids: list[int]
    params: SamplingParams


@dataclass
class _ChoiceState:
    sent_text: int = 0
    sent_tokens: int = 0
    token_text_offset: int = 0   # characters of the token texts already sent (completion text_offset)
    started: bool = False
    finished: bool = False


DEFAULT_MAX_REQUEST_BYTES = 8 * 2**20


class BodySizeLimit:
    """ASGI middleware: a request body over ``state.max_request_bytes`` is answered 413 in OpenAI's
    error format before anything parses it (by its Content-Length, or as soon as that many bytes
    of a chunked body have arrived)."""

    def __init__(self, app, state: "ServerState"):
        self.app = app
        self.state = state

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        limit = self.state.max_request_bytes
        length = dict(scope.get("headers") or []).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            return await self._too_large(send, limit)
        # read the body here (the app would hold it all anyway), stopping at the limit
        messages, seen = [], 0
        while True:
            message = await receive()
            messages.append(message)
            if message["type"] != "http.request":
                break
            seen += len(message.get("body", b""))
            if seen > limit:
                return await self._too_large(send, limit)
            if not message.get("more_body", False):
                break

        async def replay():
            return messages.pop(0) if messages else await receive()

        await self.app(scope, replay, send)

    @staticmethod
    async def _too_large(send, limit: int) -> None:
        resp = error_response(413, f"the request body is larger than the server's limit of {limit} bytes "
                                   f"(--max-request-bytes)", param=None)
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(resp.body)).encode())]})
        await send({"type": "http.response.body", "body": resp.body})


@dataclass
class ServerState:
    engine: AsyncLLMEngine
    served_model_name: str
    max_queue_len: int
    metrics: ServerMetrics
    tokenizer: Any = None
    created: int = field(default_factory=lambda: int(time.time()))
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES

    def __post_init__(self) -> None:
        if self.tokenizer is None:  # the front end's own copy: HF tokenizers are not thread-safe
            self.tokenizer = copy.deepcopy(self.engine.engine.tokenizer)
        # prompts are tokenized and checked here, one at a time, off the event loop
        self.prep = ThreadPoolExecutor(max_workers=1, thread_name_prefix="specserve-tokenize")

    def close(self) -> None:
        """Stop the engine (and its workers) and the tokenizing thread."""
        self.engine.shutdown()
        self.prep.shutdown(wait=False)

    async def prepare(self, fn, *args):
        """Run ``fn(*args)`` (tokenization and validation) on the front end's worker thread."""
        return await asyncio.get_running_loop().run_in_executor(self.prep, fn, *args)

    @property
    def max_model_len(self) -> int:
        return self.engine.engine.max_model_len


# ---------------------------------------------------------------------- request preparation
def _check_model(state: ServerState, model: str) -> None:
    if model != state.served_model_name:
        raise APIError(404, f"The model {model!r} does not exist; this server serves "
                            f"{state.served_model_name!r}", param="model", code="model_not_found")


def _check_queue(state: ServerState, num_new: int) -> None:
    """503 while the waiting queue cannot take ``num_new`` more sequences (n x prompts); 400 for a
    request that alone exceeds the limit, since retrying it could never succeed."""
    if num_new > state.max_queue_len:
        raise APIError(400, f"this request asks for {num_new} completions (n x prompts), more than the "
                            f"server's queue limit of {state.max_queue_len}; lower n or send fewer prompts",
                       param="n")
    if not state.engine.is_running:
        raise APIError(503, "the engine has stopped", type_="service_unavailable")
    waiting = state.engine.num_waiting + state.engine.num_pending
    if waiting + num_new > state.max_queue_len:
        raise APIError(503, f"the waiting queue is full ({waiting} requests waiting, limit "
                            f"{state.max_queue_len}); retry later", type_="service_unavailable",
                       code="queue_full")


def _prepare(state: ServerState, text: str | None, ids: list[int], body, max_tokens: int | None,
             logprobs: int | None, prompt_logprobs: int | None = None) -> _Prompt:
    """Check one prompt and its parameters; ``max_tokens=None`` means up to the context length."""
    room = state.max_model_len - len(ids)
    if max_tokens is not None and max_tokens > room:
        raise APIError(400, f"This model's maximum context length is {state.max_model_len} tokens. However, "
                            f"you requested {len(ids) + max_tokens} tokens ({len(ids)} in the prompt, "
                            f"{max_tokens} for the completion). Reduce the prompt or max_tokens.",
                       param="max_tokens")
    try:
        constraint = body.structured_outputs()
    except ValueError as e:
        raise APIError(400, e.args[1], param=e.args[0]) from None
    structured = None
    if constraint is not None:   # compiled here so that a bad schema or regex names its field
        param, structured = constraint
        try:
            state.engine.engine.grammar_compiler.compile(structured)
        except ValueError as e:
            raise APIError(400, f"{param}: {e}", param=param) from None
    try:
        params = body.sampling_params(max_tokens if max_tokens is not None else max(room, 1), logprobs,
                                      prompt_logprobs, structured)
        state.engine.engine.validate(ids, params)
    except ValueError as e:
        raise APIError(400, str(e)) from None
    return _Prompt(text, ids, params)


def _refuse_unsupported(body) -> None:
    refused = body.refuse_unsupported()
    if refused is not None:
        raise APIError(400, refused[1], param=refused[0])


def _encode(state: ServerState, text: str, param: str, **kw) -> list[int]:
    """Token ids of ``text``; text the tokenizer cannot take (a lone surrogate) is a 400."""
    try:
        return list(state.tokenizer.encode(text, **kw))
    except Exception as e:  # noqa: BLE001 - the tokenizer's own error types vary by backend
        raise APIError(400, f"the {param} could not be tokenized ({type(e).__name__}: {e}); send valid "
                            f"Unicode text", param=param) from None


def _completion_prompts(state: ServerState, body: CompletionRequest) -> list[_Prompt]:
    _refuse_unsupported(body)
    if body.max_tokens == 0 and not body.echo:
        raise APIError(400, "max_tokens must be >= 1 (0 only with echo=true, to score the prompt)",
                       param="max_tokens")
    if body.suffix:
        raise APIError(400, "suffix is not supported", param="suffix")
    if body.logit_bias:
        raise APIError(400, "logit_bias is not supported", param="logit_bias")
    if body.best_of is not None and body.best_of != body.n:
        raise APIError(400, f"best_of must equal n when given (got best_of={body.best_of}, n={body.n})",
                       param="best_of")
    p = body.prompt
    if isinstance(p, str):
        raw = [p]
    elif not p:
        raise APIError(400, "prompt is empty", param="prompt")
    elif all(isinstance(x, int) for x in p):
        raw = [list(p)]
    else:
        raw = list(p)
    prompts = []
    for item in raw:
        if isinstance(item, str):
            if not item:
                raise APIError(400, "prompt is empty: give at least one character or token id", param="prompt")
            text, ids = item, _encode(state, item, "prompt")
        else:
            text, ids = None, list(item)
        if not ids:
            raise APIError(400, f"prompt {item!r} has no tokens", param="prompt")
        prompt = _prepare(state, text, ids, body, body.max_tokens, body.logprobs,
                          body.logprobs if body.echo else None)
        if body.echo and text is None:   # decoded only once the ids are known to be in the vocabulary
            prompt.text = state.tokenizer.decode(ids)
        prompts.append(prompt)
    return prompts


def _message_text(content) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    parts = []
    for part in content:
        if part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise APIError(400, f"only text content parts are supported, got {str(part)[:80]!r}",
                           param="messages")
        parts.append(part["text"])
    return "".join(parts)


def _chat_prompt(state: ServerState, body: ChatCompletionRequest) -> _Prompt:
    _refuse_unsupported(body)
    if body.logit_bias:
        raise APIError(400, "logit_bias is not supported", param="logit_bias")
    if body.top_logprobs is not None and not body.logprobs:
        raise APIError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
    conversation = [{**m.model_dump(exclude_none=True), "content": _message_text(m.content)}
                    for m in body.messages]
    try:
        text = state.tokenizer.apply_chat_template(conversation, tokenize=False,
                                                   add_generation_prompt=body.add_generation_prompt)
    except Exception as e:  # jinja raises for conversations the template refuses (e.g. bad roles)
        raise APIError(400, f"the chat template rejected the messages: {e}", param="messages") from None
    ids = _encode(state, text, "messages", add_special_tokens=False)
    if not ids:
        raise APIError(400, "the chat template produced an empty prompt", param="messages")
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    return _prepare(state, text, ids, body, max_tokens, logprobs)


# ---------------------------------------------------------------------- output formatting
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


def _token_text(state: ServerState, token_id: int) -> str:
    return state.tokenizer.decode([token_id])


def _completion_logprobs(state: ServerState, c: CompletionOutput, start: int, end: int,
                         offset: int = 0) -> dict | None:
    """Logprobs of tokens ``start:end``; ``offset``: characters of the token texts before ``start``."""
    if c.logprobs is None:
        return None
    tokens, token_lps, tops, offsets = [], [], [], []
    for tid, entry in zip(c.token_ids[start:end], c.logprobs[start:end]):
        s = _token_text(state, tid)
        tokens.append(s)
        token_lps.append(entry[tid].logprob)
        tops.append({_token_text(state, t): lp.logprob for t, lp in entry.items() if lp.rank is not None})
        offsets.append(offset)
        offset += len(s)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


def _echo_logprobs(state: ServerState, out: RequestOutput) -> dict | None:
    """Completions' logprobs of the prompt's tokens (echo): the first token's logprob and top are
    null, as OpenAI's; None when the request asked for no logprobs."""
    if out.prompt_logprobs is None:
        return None
    tokens, token_lps, tops, offsets, offset = [], [], [], [], 0
    for tid, entry in zip(out.prompt_token_ids, out.prompt_logprobs):
        s = _token_text(state, tid)
        tokens.append(s)
        token_lps.append(None if entry is None else entry[tid].logprob)
        tops.append(None if entry is None else
                    {_token_text(state, t): lp.logprob for t, lp in entry.items() if lp.rank is not None})
        offsets.append(offset)
        offset += len(s)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


def _join_logprobs(first: dict | None, second: dict | None) -> dict | None:
    """Two completions logprobs objects as one (``second``'s text offsets already continue ``first``'s)."""
    if first is None or second is None:
        return first if second is None else second
    return {k: first[k] + second[k] for k in first}


def _chat_logprobs(state: ServerState, c: CompletionOutput, start: int, end: int, offset: int = 0) -> dict | None:
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


def _usage(prompts: list[_Prompt], finals: list[RequestOutput | None]) -> dict:
    prompt_tokens = sum(len(p.token_ids) for p in prompts)
    completion_tokens = sum(len(c.token_ids) for out in finals if out is not None for c in out.outputs)
    cached = sum(out.num_cached_tokens for out in finals if out is not None)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached}}   # OpenAI's field: prompt tokens served from cache


async def _merge(iterators: list[AsyncIterator]) -> AsyncIterator[tuple[int, Any]]:
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
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


class _Generation:
    """One API request: its prompts, their engine requests and the response they make."""

    def __init__(self, state: ServerState, prompts: list[_Prompt], kind: str, n: int, echo: bool = False):
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
        fn = _chat_logprobs if self.kind == "chat" else _completion_logprobs
        return fn(self.state, c, start, end, offset)

    def _echo(self, i: int, out: RequestOutput) -> tuple[str, dict | None]:
        """Prompt i's text and its tokens' logprobs, when echoed (completions with echo=true)."""
        if not self.echo:
            return "", None
        return self.prompts[i].text or "", _echo_logprobs(self.state, out)

    async def full(self) -> dict:
        finals: list[RequestOutput | None] = [None] * len(self.prompts)
        try:
            async for i, out in _merge(self.iterators()):
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
                                          "logprobs": _join_logprobs(echo_lps, self._logprobs(c, 0, len(c.token_ids),
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
        obj = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        states: dict[int, _ChoiceState] = {}
        finals: list[RequestOutput | None] = [None] * len(self.prompts)
        try:
            async for i, out in _merge(self.iterators()):
                if out.finished:
                    finals[i] = out
                failed = _constraint_failure([out])
                if failed is not None:   # mid-stream: an error event, as for a dead engine
                    yield _sse({"error": {"message": failed, "type": "invalid_request_error", "param": None,
                                          "code": None}})
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
                    logprobs = _join_logprobs(echo_lps, logprobs)
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
        except EngineDeadError as e:
            yield _sse({"error": {"message": str(e), "type": "internal_error", "param": None, "code": None}})
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


def _include_usage(body) -> bool:
    """OpenAI ends a stream with a usage-only chunk (empty ``choices``) only when asked to."""
    return body.stream_options is not None and body.stream_options.include_usage


async def _until_disconnected(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def _respond(request: Request, gen: _Generation, stream: bool, include_usage: bool) -> Response:
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


# ---------------------------------------------------------------------- the app
# pydantic names the member of a union it tried in an error's location ("stop.str", "stop.list[str]")
_UNION_TAGS = {"str", "int", "float", "bool", "none", "list", "dict"}


def _most_specific_error(errs: list[dict]) -> dict:
    """Of a union field's errors, the one for the member the input's type matches (a list given
    for ``str | list[str]`` is reported against the list's rule, e.g. its length), else the first."""
    first = errs[0] if errs else {}
    field = next((x for x in first.get("loc", ()) if x != "body"), None)
    value = first.get("input")
    if isinstance(value, list):
        for e in errs:
            loc = [x for x in e.get("loc", ()) if x != "body"]
            if loc[:1] == [field] and any(isinstance(x, str) and x.startswith("list[") for x in loc):
                return e
    return first


def build_app(state: ServerState) -> FastAPI:
    """The FastAPI application over a started :class:`AsyncLLMEngine`."""
    app = FastAPI(title="specserve", version="0.1.0",
                  description="OpenAI-compatible server with lossless speculative decoding")
    app.state.server = state
    app.add_middleware(BodySizeLimit, state=state)

    @app.exception_handler(APIError)
    async def _api_error(_: Request, e: APIError):
        return error_response(e.status, e.message, e.type, e.param, e.code)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, e: RequestValidationError):
        errs = e.errors()
        first = errs[0] if errs else {}
        if tuple(first.get("loc", ())) == ("body",) and isinstance(first.get("input"), (bytes, str)):
            return error_response(400, "the request body must be a JSON object sent with "
                                       "'Content-Type: application/json'")
        if first.get("type") == "json_invalid":
            pos = first.get("loc", (None, None))[-1]
            return error_response(400, f"the request body is not valid JSON ({first.get('ctx', {}).get('error', 'invalid')}"
                                       f" at character {pos})")
        first = _most_specific_error(errs)
        loc = ".".join(str(x) for x in first.get("loc", ()) if x != "body" and x not in _UNION_TAGS
                       and not (isinstance(x, str) and "[" in x))
        value = first.get("input")
        shown = repr(value)[:120] if not isinstance(value, dict) else "an object"
        msg = f"{loc or 'body'}: {first.get('msg', 'invalid')} (got {shown})"
        if len(errs) > 1:
            msg += f"; and {len(errs) - 1} more error(s)"
        return error_response(400, msg, param=loc or None)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, e: StarletteHTTPException):
        type_ = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return error_response(e.status_code, str(e.detail), type_)

    @app.exception_handler(Exception)
    async def _internal_error(_: Request, e: Exception):
        logger.exception("internal error")
        return error_response(500, f"internal error: {type(e).__name__}", "internal_error")

    # GET and HEAD as two routes: one route with both methods gives the OpenAPI schema one
    # operation id twice (FastAPI warns; schema-driven clients and fuzzers see a clash).
    @app.head("/health", operation_id="health_head")
    @app.get("/health", operation_id="health")
    async def health() -> Response:
        if not state.engine.is_running:
            problem = state.engine.engine.health() or state.engine.dead
            return error_response(503, f"the engine has stopped{f': {problem}' if problem else ''}",
                                  "service_unavailable")
        return Response(status_code=200)

    @app.get("/v1/models", response_model=ModelList)
    async def models() -> ModelList:
        return ModelList(data=[ModelCard(id=state.served_model_name, created=state.created,
                                         max_model_len=state.max_model_len)])

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.post("/v1/completions", responses=ERROR_RESPONSES)
    async def completions(body: CompletionRequest, request: Request) -> Response:
        _check_model(state, body.model)
        prompts = await state.prepare(_completion_prompts, state, body)   # tokenizing may take long
        _check_queue(state, len(prompts) * body.n)
        return await _respond(request, _Generation(state, prompts, "completion", body.n, echo=body.echo), body.stream,
                              _include_usage(body))

    @app.post("/v1/chat/completions", responses=ERROR_RESPONSES)
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        _check_model(state, body.model)
        prompt = await state.prepare(_chat_prompt, state, body)
        _check_queue(state, body.n)
        return await _respond(request, _Generation(state, [prompt], "chat", body.n), body.stream,
                              _include_usage(body))

    return app


def make_server_state(engine, served_model_name: str, max_queue_len: int = 256,
                      max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES) -> ServerState:
    """Wrap an :class:`LLMEngine` for serving and start its loop thread."""
    metrics = ServerMetrics(engine.num_speculative_tokens)
    async_engine = AsyncLLMEngine(engine, on_step=metrics.on_step, on_finished=metrics.on_finished,
                                  on_gauges=metrics.set_gauges)
    async_engine.start()
    return ServerState(async_engine, served_model_name, max_queue_len, metrics, max_request_bytes=max_request_bytes)


def run_server(args) -> int:
    """``specserve serve``: load the models, then serve until interrupted.

    Raises:
        ValueError: a bad model name or argument (before the port is opened).
    """
    import uvicorn

    from specserve.engine.engine import LLMEngine
    from specserve.entrypoints.args import engine_args

    if args.max_queue_len < 1:
        raise ValueError(f"--max-queue-len must be >= 1, got {args.max_queue_len}")
    if args.max_request_bytes < 1:
        raise ValueError(f"--max-request-bytes must be >= 1, got {args.max_request_bytes}")
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port must be in [0, 65535], got {args.port}")
    logging.basicConfig(level=getattr(logging, args.log_level.upper()),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    engine = LLMEngine(engine_args(args))
    state = make_server_state(engine, args.served_model_name or args.model, args.max_queue_len, args.max_request_bytes)
    logger.info("serving %s (max_model_len %d, speculation %s) on http://%s:%d", state.served_model_name,
                engine.max_model_len, engine.spec_config or "off", args.host, args.port)
    try:
        uvicorn.run(build_app(state), host=args.host, port=args.port, log_level=args.log_level)
    finally:
        state.close()
    return 0
