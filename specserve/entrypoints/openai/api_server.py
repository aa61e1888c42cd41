"""OpenAI-compatible HTTP server: ``specserve serve --model M [--speculative-model D ...]``.

FastAPI + uvicorn over :class:`~specserve.entrypoints.async_engine.AsyncLLMEngine`. Endpoints:
``/v1/completions`` and ``/v1/chat/completions`` (streamed as server-sent events or not),
``/v1/models`` and ``/v1/models/{id}``, ``/health`` and ``/metrics`` (Prometheus). Errors use
OpenAI's format ``{"error": {"message", "type", "param", "code"}}``: 400 for invalid parameters or a
prompt too long for the context, 401 without the server's ``--api-key``, 404 for an unknown model or
route, 503 when the waiting queue is full.

The front end tokenizes with its own copy of the tokenizer (the engine thread detokenizes with the
other) and checks every request with ``LLMEngine.validate`` before it is queued, so a bad request
never reaches the step loop.

This module is the app: the request-body middleware (size and time limits), the routes and ``run_server``. The rest lives beside
it: ``errors`` (OpenAI-format errors and the exception handlers), ``server_state`` (what the routes
share), ``access`` (API key, CORS, the listening socket), ``prompts`` (checks, tokenization and
validation), ``generation`` (engine requests into JSON
bodies or server-sent events), ``logprobs`` (the two logprobs formats) and ``protocol`` (request bodies).
"""
from __future__ import annotations

import asyncio
import logging
import signal
import time

from fastapi import FastAPI, Request
from fastapi.responses import Response

from specserve.entrypoints.openai.access import add_access_control, bind_socket, parse_origins, resolve_api_key, \
    warn_if_exposed
from specserve.entrypoints.openai.errors import ERROR_RESPONSES, add_error_handlers, error_response
from specserve.entrypoints.openai.generation import Generation, include_usage, respond
from specserve.entrypoints.openai.prompts import chat_prompt, check_model, check_queue, completion_prompts
from specserve.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest, ModelCard, ModelList
from specserve.entrypoints.openai.server_state import ServerState, make_server_state

logger = logging.getLogger(__name__)


class RequestBody:
    """ASGI middleware: reads a request's body whole before the app sees it, within two limits.

    * Size: over ``state.max_request_bytes`` is a 413 before anything parses it (by its
      Content-Length, or as soon as that many bytes of a chunked body have arrived).
    * Time: the whole body must arrive within ``state.body_timeout_s`` of the head, or a 408 and
      the connection closes (a client that stops mid-body cannot hold it; counted in ``/metrics``).
    """

    def __init__(self, app, state: ServerState):
        self.app = app
        self.state = state

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        limit = self.state.max_request_bytes
        length = dict(scope.get("headers") or []).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            return await self._refuse(scope, receive, send, 413, f"the request body is larger than the server's "
                                      f"limit of {limit} bytes (--max-request-bytes)", None)
        deadline = time.monotonic() + self.state.body_timeout_s
        messages, seen = [], 0
        while True:
            try:
                message = await asyncio.wait_for(receive(), max(0.0, deadline - time.monotonic()))
            except asyncio.TimeoutError:
                self.state.metrics.connection_dropped("body_timeout")
                return await self._refuse(scope, receive, send, 408, f"the request body did not arrive within "
                                          f"{self.state.body_timeout_s:g} s (--request-timeout)", "request_timeout")
            messages.append(message)
            if message["type"] != "http.request":
                break
            seen += len(message.get("body", b""))
            if seen > limit:
                return await self._refuse(scope, receive, send, 413, f"the request body is larger than the "
                                          f"server's limit of {limit} bytes (--max-request-bytes)", None)
            if not message.get("more_body", False):
                break

        async def replay():
            return messages.pop(0) if messages else await receive()

        await self.app(scope, replay, send)

    @staticmethod
    async def _refuse(scope, receive, send, status: int, message: str, code: str | None) -> None:
        resp = error_response(status, message, param=None, code=code)
        resp.headers["connection"] = "close"   # the rest of the body is never read
        await resp(scope, receive, send)


def build_app(state: ServerState) -> FastAPI:
    """The FastAPI application over a started :class:`AsyncLLMEngine`."""
    app = FastAPI(title="specserve", version="0.1.0",
                  description="OpenAI-compatible server with lossless speculative decoding")
    app.state.server = state
    app.add_middleware(RequestBody, state=state)
    add_access_control(app, state.api_key, state.protect_metrics, state.allowed_origins)   # outside the size check
    add_error_handlers(app)

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

    def card() -> ModelCard:
        return ModelCard(id=state.served_model_name, created=state.created, max_model_len=state.max_model_len)

    @app.get("/v1/models", response_model=ModelList)
    async def models() -> ModelList:
        return ModelList(data=[card()])

    @app.get("/v1/models/{model_id:path}", response_model=ModelCard, responses={404: ERROR_RESPONSES[404]})
    async def model(model_id: str) -> ModelCard:
        check_model(state, model_id)   # ids may hold '/' (hub ids): the path converter keeps them whole
        return card()

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.post("/v1/completions", responses=ERROR_RESPONSES)
    async def completions(body: CompletionRequest, request: Request) -> Response:
        check_model(state, body.model)
        prompts = await state.prepare(completion_prompts, state, body)   # tokenizing may take long
        check_queue(state, len(prompts) * body.n)
        return await respond(request, Generation(state, prompts, "completion", body.n, echo=body.echo), body.stream,
                             include_usage(body))

    @app.post("/v1/chat/completions", responses=ERROR_RESPONSES)
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        check_model(state, body.model)
        prompt = await state.prepare(chat_prompt, state, body)
        check_queue(state, body.n)
        return await respond(request, Generation(state, [prompt], "chat", body.n), body.stream,
                             include_usage(body))

    return app


def bounded_server(config, state: ServerState):
    """A ``uvicorn.Server`` whose shutdown (SIGINT / SIGTERM) is bounded by ``state.shutdown_timeout_s``:
    it stops admitting at once (the listening socket closes; requests on open connections get
    503), lets requests in flight finish until the bound, then ends every one still running (a
    stream gets a final error event, ``code: server_shutdown``) and exits. A second signal exits
    at once (uvicorn's own)."""
    import threading

    import uvicorn

    from specserve.entrypoints.async_engine import ServerShutdownError

    class BoundedShutdownServer(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:
            if not state.draining:
                state.draining = True
                bound = state.shutdown_timeout_s
                logger.warning("shutting down: no new requests; those in flight have %g s to finish "
                               "(--shutdown-timeout)", bound)
                error = ServerShutdownError(f"the server shut down before this request finished "
                                            f"(--shutdown-timeout {bound:g} s)")
                timer = threading.Timer(bound, state.engine.abort_all, args=(error,))
                timer.daemon = True
                timer.start()
            super().handle_exit(sig, frame)

    return BoundedShutdownServer(config)


def uvicorn_config(state: ServerState, log_level: str = "info", **kw):
    """uvicorn's config for the app over ``state``: the head deadline (our h11 protocol), the
    keep-alive bound and the connection limit; ``kw`` adds host / port, TLS files."""
    import uvicorn

    from specserve.entrypoints.openai.connections import deadline_protocol

    return uvicorn.Config(build_app(state), log_level=log_level,
                          http=deadline_protocol(state.head_timeout_s, state.metrics.connection_dropped),
                          timeout_keep_alive=5, limit_concurrency=state.max_connections,
                          timeout_graceful_shutdown=int(state.shutdown_timeout_s) + 5, **kw)


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def run_server(args) -> int:
    """``specserve serve``: load the models, then serve until interrupted.

    Raises:
        ValueError: a bad model name or argument (before the port is opened).
    """
    if args.max_queue_len < 1:
        raise ValueError(f"--max-queue-len must be >= 1, got {args.max_queue_len}")
    if args.max_request_bytes < 1:
        raise ValueError(f"--max-request-bytes must be >= 1, got {args.max_request_bytes}")
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port must be in [0, 65535], got {args.port}")
    for flag in ("header_timeout", "request_timeout", "shutdown_timeout"):
        if not getattr(args, flag) > 0:
            raise ValueError(f"--{flag.replace('_', '-')} must be > 0 seconds, got {getattr(args, flag)}")
    if args.max_connections < 1:
        raise ValueError(f"--max-connections must be >= 1, got {args.max_connections}")
    if (args.ssl_keyfile is None) != (args.ssl_certfile is None):
        raise ValueError("TLS needs both --ssl-keyfile and --ssl-certfile")
    api_key = resolve_api_key(args.api_key)
    logging.basicConfig(level=getattr(logging, args.log_level.upper()),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    sock = bind_socket(args.host, args.port)   # a port in use fails now, not after minutes of loading
    try:
        from specserve.engine.engine import LLMEngine
        from specserve.entrypoints.args import engine_args

        warn_if_exposed(args.host, api_key)
        engine = LLMEngine(engine_args(args))
        state = make_server_state(engine, args.served_model_name or args.model, args.max_queue_len,
                                  args.max_request_bytes, api_key=api_key, protect_metrics=args.metrics_need_api_key,
                                  allowed_origins=parse_origins(args.allowed_origins),
                                  head_timeout_s=args.header_timeout, body_timeout_s=args.request_timeout,
                                  max_connections=args.max_connections, shutdown_timeout_s=args.shutdown_timeout)
        scheme = "https" if args.ssl_certfile else "http"
        logger.info("serving %s (max_model_len %d, speculation %s) on %s://%s:%d%s", state.served_model_name,
                    engine.max_model_len, engine.spec_config or "off", scheme, args.host, args.port,
                    " (API key required)" if api_key else "")
        try:
            config = uvicorn_config(state, args.log_level, ssl_keyfile=args.ssl_keyfile, ssl_certfile=args.ssl_certfile)
            # uvicorn re-raises the signal it handled once it has shut down: SIGTERM too becomes an
            # exception here, so either signal ends a graceful shutdown with exit code 0
            signal.signal(signal.SIGTERM, _interrupt)
            try:
                bounded_server(config, state).run(sockets=[sock])
            except KeyboardInterrupt:   # the shutdown was ours
                if not state.draining:
                    raise
        finally:
            state.close()
    finally:
        sock.close()
    return 0
