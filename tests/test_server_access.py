"""Who may use the server: the API key (401 in OpenAI's format, the ``openai`` client with the
key), TLS, CORS, ``GET /v1/models/{id}``; at start, a port in use found before the model loads and
progress written as log lines when stderr is not a terminal."""
from __future__ import annotations

import shutil
import socket
import ssl
import subprocess
import sys
import time

import httpx
import openai
import pytest

from server_harness import free_port, start_tiny_server
from specserve.entrypoints.openai.access import is_loopback, resolve_api_key

NAME = "tiny-access"
KEY = "sk-test-0123456789"


@pytest.fixture(scope="module")
def keyed(tiny_qwen2_dir):
    s = start_tiny_server(tiny_qwen2_dir, NAME, api_key=KEY, allowed_origins=["https://app.example"])
    yield s
    s.stop()


@pytest.fixture(scope="module")
def open_server(tiny_qwen2_dir):
    s = start_tiny_server(tiny_qwen2_dir, NAME)
    yield s
    s.stop()


def completion_body() -> dict:
    return {"model": NAME, "prompt": "hello", "max_tokens": 3, "temperature": 0}


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY},
                                     {"Authorization": f"Bearer {KEY}x"}])
def test_missing_or_wrong_key_is_401_in_openai_format(keyed, headers):
    for method, path, body in [("POST", "/v1/completions", completion_body()), ("GET", "/v1/models", None),
                               ("GET", f"/v1/models/{NAME}", None)]:
        r = httpx.request(method, keyed.base_url + path, json=body, headers=headers)
        assert r.status_code == 401, (path, r.text)
        err = r.json()["error"]
        assert err["code"] == "invalid_api_key" and err["type"] == "invalid_request_error" and "--api-key" in err["message"]
    assert keyed.all_pages_free()


def test_openai_client_with_the_key_works_and_health_stays_open(keyed):
    client = openai.OpenAI(base_url=keyed.base_url + "/v1", api_key=KEY)
    out = client.completions.create(**completion_body())
    assert out.choices[0].finish_reason == "length" and len(out.choices[0].text) > 0
    assert client.models.retrieve(NAME).id == NAME
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=keyed.base_url + "/v1", api_key="other").models.list()
    assert httpx.get(keyed.base_url + "/health").status_code == 200
    assert httpx.get(keyed.base_url + "/metrics").status_code == 200   # open unless --metrics-need-api-key


def test_models_retrieve(open_server):
    client = openai.OpenAI(base_url=open_server.base_url + "/v1", api_key="unused")
    card = client.models.retrieve(NAME)
    assert card.id == NAME and card.object == "model"
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("no-such-model")
    assert e.value.body["param"] == "model" and e.value.body["code"] == "model_not_found"


def test_cors_closed_unless_origins_are_named(keyed, open_server):
    preflight = {"Origin": "https://app.example", "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization,content-type"}
    r = httpx.options(keyed.base_url + "/v1/completions", headers=preflight)
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "https://app.example"
    other = dict(preflight, Origin="https://evil.example")
    assert "access-control-allow-origin" not in httpx.options(keyed.base_url + "/v1/completions",
                                                              headers=other).headers
    r = httpx.get(open_server.base_url + "/v1/models", headers={"Origin": "https://app.example"})
    assert r.status_code == 200 and "access-control-allow-origin" not in r.headers


def test_metrics_behind_the_key_when_asked(tiny_qwen2_dir):
    s = start_tiny_server(tiny_qwen2_dir, NAME, api_key=KEY, protect_metrics=True)
    try:
        assert httpx.get(s.base_url + "/metrics").status_code == 401
        assert httpx.get(s.base_url + "/metrics", headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
        assert httpx.get(s.base_url + "/health").status_code == 200
    finally:
        s.stop()


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command to make a certificate")
def test_tls_with_a_self_signed_certificate(tiny_qwen2_dir, tmp_path):
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out",
                    str(cert), "-days", "1", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
                   check=True, capture_output=True)
    s = start_tiny_server(tiny_qwen2_dir, NAME, api_key=KEY, ssl=(str(key), str(cert)))
    try:
        assert s.base_url.startswith("https://")
        # closed before the server stops: an idle TLS connection's close waits for the peer's close_notify
        with httpx.Client(verify=ssl.create_default_context(cafile=str(cert))) as http:
            client = openai.OpenAI(base_url=s.base_url + "/v1", api_key=KEY, http_client=http)
            assert client.completions.create(**completion_body()).choices[0].text
        with pytest.raises(httpx.TransportError):   # plain http to the TLS port gets no http answer
            httpx.get(s.base_url.replace("https", "http") + "/health", timeout=5).raise_for_status()
    finally:
        s.stop()


def test_port_in_use_fails_before_the_model_loads(tmp_path):
    """The port is bound first: a busy port is a one-line error in well under 5 s, whatever the model."""
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        t = time.perf_counter()
        r = subprocess.run([sys.executable, "-m", "specserve.entrypoints.cli", "serve", "--model",
                            "qwen2.5-coder-1.5b-instruct", "--port", str(port)],
                           capture_output=True, text=True, timeout=60)
        elapsed = time.perf_counter() - t
    assert r.returncode == 2 and f"cannot listen on 127.0.0.1:{port}" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr
    assert elapsed < 5.0, f"took {elapsed:.1f} s"


def test_key_settings_and_loopback():
    assert resolve_api_key("k") == "k"
    with pytest.raises(ValueError, match="empty"):
        resolve_api_key(" ")
    assert is_loopback("127.0.0.1") and is_loopback("localhost") and is_loopback("::1")
    assert not is_loopback("0.0.0.0") and not is_loopback("192.168.1.5")



def test_progress_is_log_lines_off_a_terminal(caplog, capsys):
    """Off a terminal (a server's log file) long work writes two log lines, never a bar's
    carriage-return frames."""
    import logging

    from specserve.progress import LogProgress, progress

    with caplog.at_level(logging.INFO, logger="specserve.progress"):
        with progress(total=3_000_000, desc="loading model.gguf", unit="param") as bar:
            assert isinstance(bar, LogProgress)   # pytest's captured stderr is not a terminal
            for _ in range(3):
                bar.update(1_000_000)
    assert "\r" not in capsys.readouterr().err
    lines = [r.getMessage() for r in caplog.records if r.name == "specserve.progress"]
    assert lines[0] == "loading model.gguf (3.0 Mparam) ..."
    assert lines[1].startswith("loading model.gguf: done, 3.0 Mparam in ") and len(lines) == 2


# --------------------------------------------------------------------------- slow and silent clients

@pytest.fixture(scope="module")
def strict(tiny_qwen2_dir):
    s = start_tiny_server(tiny_qwen2_dir, NAME, head_timeout_s=1.0, body_timeout_s=1.0)
    yield s
    s.stop()


def _connect(server) -> socket.socket:
    host, port = server.base_url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=10)
    return sock


def _closed_after(sock: socket.socket, send=None, limit_s: float = 6.0) -> tuple[float, bytes]:
    """Seconds until the server closes ``sock`` (trickling ``send``'s bytes meanwhile) and what it sent."""
    t, got = time.perf_counter(), b""
    sock.settimeout(0.3)
    data = list(send or b"")
    while time.perf_counter() - t < limit_s:
        if data:
            try:
                sock.send(bytes([data.pop(0)]))
            except OSError:
                break
        try:
            chunk = sock.recv(4096)
        except socket.timeout:
            continue
        except OSError:
            break
        if not chunk:
            break
        got += chunk
    return time.perf_counter() - t, got


def test_silent_trickling_and_stalled_clients_are_dropped_while_others_are_served(strict):
    silent = _connect(strict)
    trickle = _connect(strict)
    stalled = _connect(strict)
    stalled.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                    b"Content-Length: 1000\r\n\r\n{\"model\":")
    ok = httpx.post(strict.base_url + "/v1/completions", json=completion_body(), timeout=30)   # served meanwhile
    assert ok.status_code == 200
    head = b"GET /health HTTP/1.1\r\nHost: x\r\nUser-Agent: " + b"a" * 100
    elapsed, got = _closed_after(trickle, head)          # one byte every 0.3 s: never a whole head
    assert elapsed < 3.0 and got == b"", (elapsed, got)
    elapsed, got = _closed_after(silent)
    assert elapsed < 3.0 and got == b""
    elapsed, got = _closed_after(stalled)
    assert elapsed < 3.0 and got.startswith(b"HTTP/1.1 408") and b"request_timeout" in got
    for s in (silent, trickle, stalled):
        s.close()
    metrics = httpx.get(strict.base_url + "/metrics").text
    assert 'specserve_connections_dropped_total{reason="head_timeout"} 2.0' in metrics
    assert 'specserve_connections_dropped_total{reason="body_timeout"} 1.0' in metrics
    # a client that keeps its connection and sends whole requests is never cut
    with httpx.Client(base_url=strict.base_url) as client:
        for _ in range(3):
            assert client.get("/health").status_code == 200
            time.sleep(0.5)
    assert strict.all_pages_free()


# --------------------------------------------------------------------------- bounded shutdown

def test_sigint_with_streams_in_flight_exits_within_the_bound():
    """SIGINT while streams run: new requests are refused, the streams still running at
    --shutdown-timeout end with a final error event (then [DONE]), and the process exits 0 within
    the bound (SmolLM2-135M decodes ~17 ms a step: 1,000 tokens outlast a 2 s bound)."""
    import json
    import os
    import signal
    import threading

    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "specserve.entrypoints.cli", "serve", "--model",
                             "smollm2-135m-instruct", "--port", str(port), "--shutdown-timeout", "2",
                             "--max-model-len", "2048", "--no-speculation", "--log-level", "warning"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=dict(os.environ))
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 240
        while time.time() < deadline:
            try:
                if httpx.get(base + "/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.5)
        else:
            pytest.fail("the server did not start")
        events: list[list[str]] = [[], []]

        def stream(k: int) -> None:
            body = {"model": "smollm2-135m-instruct", "prompt": "Once upon a time", "max_tokens": 1000,
                    "temperature": 0, "ignore_eos": True, "stream": True}
            with httpx.stream("POST", base + "/v1/completions", json=body, timeout=60) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        events[k].append(line[6:])

        threads = [threading.Thread(target=stream, args=(k,)) for k in range(2)]
        for t in threads:
            t.start()
        while not all(events):   # both streams are producing tokens
            time.sleep(0.05)
        t0 = time.perf_counter()
        proc.send_signal(signal.SIGINT)
        for t in threads:
            t.join(30)
        rc = proc.wait(30)
        elapsed = time.perf_counter() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
    assert rc == 0, proc.stderr.read()[-2000:]
    assert elapsed < 2 + 5, f"exited {elapsed:.1f} s after SIGINT"
    for ev in events:
        assert ev[-1] == "[DONE]"
        final = json.loads(ev[-2])
        assert final["error"]["code"] == "server_shutdown", ev[-3:]
