"""Run the OpenAI-compatible server in a background thread on a free 127.0.0.1 port (tests only)."""
from __future__ import annotations

import socket
import threading
import time
from dataclasses import dataclass

import uvicorn

from specserve.entrypoints.openai.api_server import uvicorn_config
from specserve.entrypoints.openai.server_state import ServerState, make_server_state


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class RunningServer:
    base_url: str
    state: ServerState
    server: uvicorn.Server
    thread: threading.Thread

    @property
    def engine(self):
        """The LLMEngine (read it only while no request is running)."""
        return self.state.engine.engine

    def wait_idle(self, timeout: float = 60.0) -> None:
        """Wait until the engine holds no request (aborts are applied between steps)."""
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.state.engine.num_unfinished == 0 and not self.engine.has_unfinished_requests() \
                    and not self.engine.requests:
                return
            time.sleep(0.05)
        raise TimeoutError(f"engine still busy: {self.engine.scheduler.running} {self.engine.scheduler.waiting}")

    def all_pages_free(self) -> bool:
        bm = self.engine.block_manager
        return bm.num_free_blocks == bm.num_blocks and not bm.seq_ids()

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)
        self.state.close()


def start_server(engine, served_model_name: str, max_queue_len: int = 256, ssl: tuple[str, str] | None = None,
                 **kw) -> RunningServer:
    """``ssl``: ``(keyfile, certfile)`` to serve https."""
    state = make_server_state(engine, served_model_name, max_queue_len, **kw)
    port = free_port()
    server = uvicorn.Server(uvicorn_config(state, "warning", host="127.0.0.1", port=port,
                                           ssl_keyfile=ssl[0] if ssl else None, ssl_certfile=ssl[1] if ssl else None))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.time() + 30
    while not server.started:
        if time.time() > deadline or not thread.is_alive():
            raise RuntimeError("server did not start")
        time.sleep(0.02)
    return RunningServer(f"{'https' if ssl else 'http'}://127.0.0.1:{port}", state, server, thread)


TINY_CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                      "{% if add_generation_prompt %}assistant:{% endif %}")


def start_tiny_server(target_dir: str, name: str = "tiny", max_model_len: int = 64, **kw) -> RunningServer:
    """The tiny random model (a plain chat template) served with itself as the draft (speculation on)."""
    from specserve.engine.engine import EngineArgs, LLMEngine
    from specserve.models.loader import load_model

    target = load_model(target_dir)
    target.tokenizer.chat_template = TINY_CHAT_TEMPLATE
    spec = {"method": "draft_model", "model": target_dir, "num_speculative_tokens": 3}
    engine = LLMEngine(EngineArgs(model=name, max_model_len=max_model_len, speculative_config=spec), loaded=target,
                       loaded_draft=load_model(target_dir))
    return start_server(engine, name, **kw)
