"""Deadlines on slow and silent clients: a connection must deliver each request's head (request
line and headers) and then its body within a bound, or it is dropped and counted.

uvicorn has no request-read timeout (its issue #157): ``timeout_keep_alive`` starts only after a
response and is reset by every byte, so a client that sends nothing, or one byte every half
second, holds its connection for good. Two layers close that:

* :func:`deadline_protocol`: uvicorn's h11 protocol with a head deadline, armed when a connection
  opens and again when a response ends (the next request's head), cancelled when a head is
  complete; at the deadline the connection is closed.
* the body: :class:`~specserve.entrypoints.openai.api_server.RequestBody` reads it whole within
  its own bound after the head (and within ``--max-request-bytes``); otherwise a 408 in OpenAI's
  error format, and the connection closes.

Both count what they drop (``specserve_connections_dropped_total{reason}`` in ``/metrics``).
"""
from __future__ import annotations

import asyncio
from typing import Callable

from uvicorn.protocols.http.h11_impl import H11Protocol

DEFAULT_HEAD_TIMEOUT_S = 10.0
DEFAULT_BODY_TIMEOUT_S = 30.0


def deadline_protocol(head_timeout_s: float, on_drop: Callable[[str], None]) -> type[H11Protocol]:
    """An h11 protocol class for ``uvicorn.Config(http=...)`` that drops a connection whose request
    head is not complete ``head_timeout_s`` seconds after the connection opened or the last
    response ended; ``on_drop("head_timeout")`` counts it."""

    class DeadlineH11Protocol(H11Protocol):
        _head_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._arm()

        def connection_lost(self, exc) -> None:
            self._disarm()
            super().connection_lost(exc)

        def handle_events(self) -> None:
            super().handle_events()
            if self.cycle is not None and not self.cycle.response_complete:   # a head arrived
                self._disarm()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing():
                self._arm()   # the next request's head

        def _arm(self) -> None:
            self._disarm()
            self._head_timer = self.loop.call_later(head_timeout_s, self._head_expired)

        def _disarm(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _head_expired(self) -> None:
            self._head_timer = None
            if not self.transport.is_closing():
                on_drop("head_timeout")
                self.transport.close()

    return DeadlineH11Protocol
