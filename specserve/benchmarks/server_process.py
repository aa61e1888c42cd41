"""``specserve serve`` as a subprocess for ``specserve bench-serve``: launched on a port no one uses,
ready once ``GET /health`` answers, always stopped on the way out."""
from __future__ import annotations

import socket
import subprocess
import sys
import time

from specserve.benchmarks.completions_client import ServerError, http_get

HOST = "127.0.0.1"


def _port_in_use(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.settimeout(1.0)
        return s.connect_ex((HOST, port)) == 0


def _log_tail(path: str, n: int = 20) -> str:
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-n:])
    except OSError:
        return ""


class ServerProcess:
    """``specserve serve`` in a subprocess (output to a log file); a context manager that always stops it."""

    def __init__(self, argv: list[str], port: int, timeout_s: float, log_path: str):
        self.argv, self.port, self.timeout_s, self.log_path = argv, port, timeout_s, log_path
        self.base_url = f"http://{HOST}:{port}"
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> "ServerProcess":
        import httpx

        if _port_in_use(self.port):
            raise ValueError(f"port {self.port} is already in use (pick another with --port)")
        log = open(self.log_path, "w")
        try:
            self.proc = subprocess.Popen([sys.executable, "-m", "specserve.entrypoints.cli"] + self.argv,
                                         stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        finally:
            log.close()
        try:
            deadline = time.monotonic() + self.timeout_s
            while True:
                if self.proc.poll() is not None:
                    raise ServerError(f"the server exited with code {self.proc.returncode} before it was ready; "
                                      f"last lines of {self.log_path}:\n{_log_tail(self.log_path)}")
                try:
                    if http_get(self.base_url, "/health", timeout=2.0).status_code == 200:
                        return self
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    raise ServerError(f"no healthy server at {self.base_url} after --server-timeout "
                                      f"{self.timeout_s:g} s; last lines of {self.log_path}:\n"
                                      f"{_log_tail(self.log_path)}")
                time.sleep(0.5)
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after 20 s; waits until the process is gone."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def __exit__(self, *exc) -> None:
        self.stop()
