"""Who may use the server: an API key on ``/v1/*`` (and, if asked, ``/metrics``), CORS origins, the
listening socket bound before the model loads, and a warning when the port is open to the network
without a key.

As vLLM's ``--api-key``: clients send ``Authorization: Bearer <key>`` (the ``openai`` client's
``api_key``); a missing or wrong key is a 401 in OpenAI's error format (code ``invalid_api_key``).
The key is compared in constant time (:func:`hmac.compare_digest`), so the answer's timing does not
tell how much of a guess was right. ``/health`` stays open for load balancers; CORS preflight
requests (``OPTIONS``) carry no key and are answered by the CORS layer.
"""
from __future__ import annotations

import hmac
import ipaddress
import logging
import os
import socket

from specserve.entrypoints.openai.errors import error_response

logger = logging.getLogger(__name__)

API_KEY_ENV = "SPECSERVE_API_KEY"


def resolve_api_key(flag: str | None) -> str | None:
    """``--api-key``, else ``$SPECSERVE_API_KEY``, else None (no key: anyone who reaches the port).

    Raises:
        ValueError: an empty key.
    """
    key = flag if flag is not None else os.environ.get(API_KEY_ENV)
    if key is not None and not key.strip():
        raise ValueError(f"--api-key / {API_KEY_ENV} is empty: give a key, or leave it unset for no key")
    return key


class APIKeyAuth:
    """ASGI middleware: ``/v1/*`` (and ``/metrics`` when ``protect_metrics``) need the bearer key.

    Args:
        app: the wrapped app.
        api_key: the key clients must send.
        protect_metrics: also require it on ``/metrics``.
    """

    def __init__(self, app, api_key: str, protect_metrics: bool = False):
        self.app = app
        self.expected = f"Bearer {api_key}".encode()
        self.protect_metrics = protect_metrics

    def _protected(self, path: str) -> bool:
        return path.startswith("/v1/") or path == "/v1" or (self.protect_metrics and path == "/metrics")

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] == "OPTIONS" or not self._protected(scope["path"]):
            return await self.app(scope, receive, send)
        given = dict(scope.get("headers") or []).get(b"authorization", b"")
        if hmac.compare_digest(given, self.expected):
            return await self.app(scope, receive, send)
        why = "no API key was given" if not given else "the API key given is not this server's"
        resp = error_response(401, f"{why}: send 'Authorization: Bearer <key>' (the server's --api-key)",
                              param=None, code="invalid_api_key")
        await resp(scope, receive, send)


def add_access_control(app, api_key: str | None, protect_metrics: bool, allowed_origins: list[str]) -> None:
    """Wrap ``app`` with the key check and, when ``allowed_origins`` names any, CORS for them
    (closed otherwise: browsers on other origins cannot read the answers)."""
    if api_key is not None:
        app.add_middleware(APIKeyAuth, api_key=api_key, protect_metrics=protect_metrics)
    if allowed_origins:
        from fastapi.middleware.cors import CORSMiddleware

        app.add_middleware(CORSMiddleware, allow_origins=allowed_origins, allow_methods=["GET", "POST"],
                           allow_headers=["Authorization", "Content-Type"])


def parse_origins(value: str | None) -> list[str]:
    """``--allowed-origins``: comma-separated origins (``*`` for any), or none."""
    return [o.strip() for o in (value or "").split(",") if o.strip()]


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def warn_if_exposed(host: str, api_key: str | None) -> None:
    """A warning at start when the server listens beyond this machine without a key."""
    if api_key is None and not is_loopback(host):
        logger.warning("listening on %s without an API key: anyone who can reach this port can use the model "
                       "(set --api-key or %s, or bind to 127.0.0.1)", host, API_KEY_ENV)


def bind_socket(host: str, port: int) -> socket.socket:
    """The listening socket, bound now (before the model loads, so a port in use fails at once).

    Raises:
        ValueError: the address is in use or cannot be bound (names host and port).
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise ValueError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    sock.set_inheritable(True)
    return sock
