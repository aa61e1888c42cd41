"""The engine's step loop on its own thread, fed by asyncio code (the server).

``LLMEngine`` is single-threaded: only the loop thread touches it. Requests and aborts reach it
through a command queue drained before every step; each step's outputs go back to the event loop
of the coroutine that asked for them with ``loop.call_soon_threadsafe``, so the event loop never
waits on a model forward.
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
from typing import AsyncIterator, Callable

from specserve.engine.engine import LLMEngine
from specserve.metrics import StepStats
from specserve.outputs import RequestOutput
from specserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class RequestStream:
    """The outputs of one queued request, in order; iterate it with ``async for``.

    Iteration ends after the finished output. :meth:`abort` (idempotent) stops the request; a
    stream left before its end should be aborted, or the engine computes it to the end unread.
    """

    def __init__(self, engine: "AsyncLLMEngine", request_id: str, loop: asyncio.AbstractEventLoop):
        self._engine = engine
        self.request_id = request_id
        self._loop = loop
        self._queue: asyncio.Queue = asyncio.Queue()   # RequestOutput, then None (aborted) or an exception
        self.finished = False

    def put(self, item) -> None:
        """Deliver ``item`` from the loop thread."""
        self._loop.call_soon_threadsafe(self._queue.put_nowait, item)

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        while not self.finished:
            item = await self._queue.get()
            if isinstance(item, BaseException):
                self.finished = True
                raise item
            if item is None:
                self.finished = True
                return
            self.finished = item.finished
            yield item

    def abort(self) -> None:
        if not self.finished:
            self.finished = True
            self._engine.abort(self.request_id)


class EngineDeadError(RuntimeError):
    """The step loop stopped; no request can be served."""


class ServerShutdownError(EngineDeadError):
    """The server is shutting down: a request still running at the bound is ended with this."""


class AsyncLLMEngine:
    """Serve :class:`LLMEngine` to many coroutines at once.

    Args:
        engine: the engine; from now on only the loop thread may use it.
        on_step: called on the loop thread after every step with its :class:`StepStats`.
        on_finished: called on the loop thread with each finished (not aborted) request's output.
    """

    def __init__(self, engine: LLMEngine, on_step: Callable[[StepStats], None] | None = None,
                 on_finished: Callable[[RequestOutput], None] | None = None,
                 on_gauges: Callable[[int, int, float], None] | None = None):
        self.engine = engine
        self.on_step = on_step
        self.on_finished = on_finished
        self.on_gauges = on_gauges
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wakeup = threading.Event()
        self._streams: dict[str, RequestStream] = {}
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, name="specserve-engine", daemon=True)
        self.dead: BaseException | None = None
        # published by the loop thread after each step (plain ints: safe to read anywhere)
        self.num_running = 0
        self.num_waiting = 0
        # each counter is written by one thread only; their difference is the not yet queued requests
        self._num_submitted = 0       # event loop
        self._num_received = 0        # loop thread

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        self._thread.start()

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop the loop thread, then the engine (its tensor-parallel workers)."""
        self._stopping = True
        self._wakeup.set()
        self._thread.join(timeout)
        self.engine.shutdown(polite=not self._thread.is_alive())   # a step still running: no message

    @property
    def is_running(self) -> bool:
        return self._thread.is_alive() and self.dead is None and self.engine.health() is None

    @property
    def num_unfinished(self) -> int:
        return self.num_running + self.num_waiting + self.num_pending

    @property
    def num_pending(self) -> int:
        """Requests submitted that the loop thread has not taken yet."""
        return max(0, self._num_submitted - self._num_received)

    # ------------------------------------------------------------------ requests
    def add_request(self, request_id: str, prompt: str | None, params: SamplingParams,
                    prompt_token_ids: list[int]) -> RequestStream:
        """Queue a request (from the event loop's thread); returns the stream of its outputs.

        Raises:
            EngineDeadError: the step loop has stopped.
        The engine's own checks (``LLMEngine.add_request``) raise ``ValueError`` into the stream.
        """
        if not self.is_running:
            raise EngineDeadError(f"the engine loop is not running ({self.dead!r})")
        stream = RequestStream(self, request_id, asyncio.get_running_loop())
        self._num_submitted += 1
        self._commands.put(("add", request_id, prompt, params, prompt_token_ids, stream))
        self._wakeup.set()
        return stream

    def abort(self, request_id: str) -> None:
        """Abort a request from any thread; its pages are freed before the next step."""
        self._commands.put(("abort", request_id))
        self._wakeup.set()

    def abort_all(self, error: BaseException) -> None:
        """Abort every request from any thread (a bounded shutdown); each stream raises ``error``."""
        self._commands.put(("abort_all", error))
        self._wakeup.set()

    # ------------------------------------------------------------------ loop thread
    def _drain_commands(self) -> None:
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return
            if cmd[0] == "add":
                _, rid, prompt, params, ids, stream = cmd
                self._num_received += 1
                try:
                    self.engine.add_request(rid, prompt if prompt is not None else ids, params,
                                            prompt_token_ids=ids)
                except ValueError as e:
                    stream.put(e)
                    continue
                self._streams[rid] = stream
            elif cmd[0] == "abort_all":
                for rid, stream in list(self._streams.items()):
                    self.engine.abort_request(rid)
                    stream.put(cmd[1])
                self._streams.clear()
                self._publish()
            else:
                rid = cmd[1]
                if rid in self._streams:
                    self.engine.abort_request(rid)
                    self._streams.pop(rid).put(None)
                    self._publish()

    def _loop(self) -> None:
        engine = self.engine
        try:
            while not self._stopping:
                self._drain_commands()
                if not engine.has_unfinished_requests():
                    self._publish()
                    engine.keepalive()
                    self._wakeup.wait(timeout=1.0)
                    self._wakeup.clear()
                    continue
                for out in engine.step():
                    stream = self._streams.get(out.request_id)
                    if stream is None:
                        continue
                    stream.put(out)
                    if out.finished:
                        del self._streams[out.request_id]
                        if self.on_finished is not None:
                            self.on_finished(out)
                self._publish()
                if self.on_step is not None and engine.last_step_stats is not None:
                    self.on_step(engine.last_step_stats)
        except BaseException as e:  # a bug in the engine: fail every waiting client, loudly
            logger.exception("engine loop died")
            self.dead = e
            err = EngineDeadError(f"engine loop died: {e!r}")
            for stream in self._streams.values():
                stream.put(err)
            self._streams.clear()

    def _publish(self) -> None:
        sched = self.engine.scheduler
        self.num_running, self.num_waiting = len(sched.running), len(sched.waiting)
        if self.on_gauges is not None:   # also between steps: an abort shows at once
            self.on_gauges(self.num_running, self.num_waiting, self.engine.block_manager.usage)
