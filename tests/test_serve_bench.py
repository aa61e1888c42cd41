"""`specserve bench-serve` logic: percentiles, level figures, /metrics deltas, text agreement, the
markdown table, flag checking, and the streaming client against a stub server (no model, fast)."""
from __future__ import annotations

import argparse
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from specserve.benchmarks import serve_bench as sb
from specserve.benchmarks import serve_bench_report as report
from specserve.benchmarks import serve_bench_stats as stats
from specserve.entrypoints.cli import build_parser, main


def _args(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["bench-serve", *argv])


# ----------------------------------------------------------------------------------------- stats

def test_percentile_interpolates_like_numpy():
    xs = [4.0, 1.0, 3.0, 2.0]
    assert stats.percentile(xs, 50) == 2.5
    assert stats.percentile(xs, 0) == 1.0 and stats.percentile(xs, 100) == 4.0
    assert stats.percentile(list(range(101)), 99) == 99.0
    assert stats.percentile([1.0, 2.0], 99) == pytest.approx(1.99)
    assert stats.percentile([7.0], 99) == 7.0
    assert stats.percentile([], 50) is None
    with pytest.raises(ValueError, match="101"):
        stats.percentile([1.0], 101)


def _rec(t_sent, t_first, t_last, t_done, n):
    return {"t_sent": t_sent, "t_first": t_first, "t_last": t_last, "t_done": t_done, "completion_tokens": n}


def test_summarize_level():
    records = [_rec(0.0, 1.0, 4.0, 4.5, 4),   # TTFT 1, TPOT 3/3 = 1 s
               _rec(0.0, 2.0, 3.0, 3.0, 3),   # TTFT 2, TPOT 1/2 = 0.5 s
               _rec(1.0, 4.0, 4.0, 5.0, 1)]   # TTFT 3, one token: no TPOT
    s = stats.summarize_level(records, wall_s=4.0)
    assert s["num_requests"] == 3 and s["output_tokens"] == 8
    assert s["output_tok_s"] == 2.0
    assert s["ttft_median_s"] == 2.0 and s["ttft_p99_s"] == pytest.approx(2.98)
    assert s["tpot_median_ms"] == pytest.approx(750.0) and s["tpot_p99_ms"] == pytest.approx(995.0)
    assert s["e2e_median_s"] == 4.0
    assert stats.request_tpot(_rec(0, None, None, 1, 0)) is None
    assert stats.request_tpot(_rec(0, 1, 2, 2, None)) is None


def test_parse_prometheus_sums_label_sets_and_skips_comments():
    text = """# HELP specserve_spec_decode_num_draft_tokens_total drafted
# TYPE specserve_spec_decode_num_draft_tokens_total counter
specserve_spec_decode_num_draft_tokens_total{model_name="a"} 10
specserve_spec_decode_num_draft_tokens_total{model_name="b"} 5.0
specserve_spec_decode_num_accepted_tokens_total 9
specserve_spec_decode_acceptance_length_bucket{le="+Inf",model_name="a, b"} 4
specserve_spec_decode_acceptance_length_sum 11.5 1700000000
"""
    m = stats.parse_prometheus(text)
    assert m[stats.METRIC_DRAFT] == 15.0 and m[stats.METRIC_ACCEPTED] == 9.0
    assert m[stats.METRIC_DRAFT + '{model_name="b"}'] == 5.0
    assert m["specserve_spec_decode_acceptance_length_sum"] == 11.5
    assert m["specserve_spec_decode_acceptance_length_bucket"] == 4.0


def test_spec_metrics_delta():
    before = {stats.METRIC_DRAFT: 10.0, stats.METRIC_ACCEPTED: 5.0,
              stats.METRIC_ACC_LEN + "_sum": 8.0, stats.METRIC_ACC_LEN + "_count": 5.0}
    after = {stats.METRIC_DRAFT: 30.0, stats.METRIC_ACCEPTED: 20.0,
             stats.METRIC_ACC_LEN + "_sum": 33.0, stats.METRIC_ACC_LEN + "_count": 15.0}
    steps = stats.METRIC_STEPS + '{num_speculative_tokens="%d"}'
    before.update({steps % 0: 1.0, steps % 2: 4.0, steps % 10: 1.0})
    after.update({steps % 0: 3.0, steps % 2: 9.0, steps % 10: 1.0, steps % 3: 2.0})
    d = stats.spec_metrics_delta(before, after)
    assert d["draft_tokens"] == 20 and d["accepted_tokens"] == 15 and d["acceptance_rate"] == 0.75
    assert d["verify_steps"] == 10 and d["mean_acceptance_length"] == 2.5
    assert d["decode_steps_by_k"] == {"0": 2.0, "2": 5.0, "3": 2.0}
    assert list(d["decode_steps_by_k"]) == ["0", "2", "3"]
    # no speculation: counters absent or unchanged; no /metrics at all
    assert stats.spec_metrics_delta({}, {})["acceptance_rate"] is None
    assert stats.spec_metrics_delta(before, before)["acceptance_rate"] is None
    assert stats.spec_metrics_delta(None, after)["acceptance_rate"] is None


def test_text_agreement_counts_and_locates_differences():
    a = {"c1/0": "def f():", "c1/1": "return 1", "c2/0": "x"}
    b = {"c1/0": "def f():", "c1/1": "return 2", "c2/0": "x", "c4/0": "only here"}
    r = stats.text_agreement(a, b)
    assert (r["identical"], r["total"]) == (2, 3)
    assert r["differences"] == [{"request": "c1/1", "first_diff_char": 7}]
    assert stats.text_agreement({"k": "ab"}, {"k": "abc"})["differences"][0]["first_diff_char"] == 2


# ----------------------------------------------------------------------------------------- report

def _result():
    def level(c, tok_s, acc=None):
        return {"concurrency": c, "num_requests": 8, "output_tokens": 512, "wall_s": 512 / tok_s,
                "output_tok_s": tok_s, "ttft_median_s": 0.5, "ttft_p99_s": 1.25, "tpot_median_ms": 100.0,
                "tpot_p99_ms": 150.0, "e2e_median_s": 7.0, "e2e_p99_s": 8.0,
                "spec_decode": stats.spec_metrics_delta({}, {} if acc is None else
                                                     {stats.METRIC_DRAFT: 10, stats.METRIC_ACCEPTED: 10 * acc}),
                "requests": [{"index": 0, "text": "t"}]}
    result = {"machine": {"cpu": "cpu", "cpu_count": 2, "torch": "2"},
              "config": {"model": "m", "dtype": "float32", "speculative_model": "d", "num_speculative_tokens": 2,
                         "modes": ["none", "spec"], "concurrency": [1, 4], "num_prompts": 8, "max_tokens": 64},
              "runs": [{"mode": "none", "levels": [level(1, 10.0), level(4, 20.0)]},
                       {"mode": "spec", "levels": [level(1, 15.0, 0.8), level(4, 20.0, 0.5)]}]}
    stats.add_speedups(result)
    return result


def test_speedups_and_markdown_table():
    result = _result()
    assert [lv["speedup_vs_none"] for run in result["runs"] for lv in run["levels"]] == [1.0, 1.0, 1.5, 1.0]
    result["agreement"] = {"identical": 3, "total": 4, "differences": [{"request": "c4/3", "first_diff_char": 9}]}
    md = report.render_markdown(result)
    assert "| mode | concurrency | requests | output tok/s | speedup vs none |" in md
    assert "| none | 1 | 8 | 10.00 | 1.00 | 0.500 | 1.250 | 100.0 | 150.0 | - | - | - |" in md
    assert "| spec | 1 | 8 | 15.00 | 1.50 | 0.500 | 1.250 | 100.0 | 150.0 | 0.80 | - | - |" in md
    assert "draft d k=2" in md
    assert "identical to none on 3/4 requests" in md and "c4/3 at char 9" in md
    rows = [line for line in md.splitlines() if line.startswith("| ") and line[2:6] in ("none", "spec")]
    assert len(rows) == 4


def test_paired_round_speedups_and_table():
    """With rounds, each round's spec tok/s is divided by the none tok/s of the same round and the
    level's speedup is the median of those ratios: none (10, 20, 12) and spec (11, 18, 20) give
    1.1, 0.9, 1.667 -> 1.1, where the ratio of the medians would say 18 / 12 = 1.5."""
    def level(tok_s_rounds, by_k=None):
        return {"concurrency": 4, "num_requests": 8, "output_tokens": 512, "wall_s": 10.0,
                "output_tok_s": sorted(tok_s_rounds)[1], "ttft_median_s": 0.5, "ttft_p99_s": 1.25,
                "tpot_median_ms": 100.0, "tpot_p99_ms": 150.0, "e2e_median_s": 7.0, "e2e_p99_s": 8.0,
                "spec_decode": {"decode_steps_by_k": by_k or {}},
                "rounds": [{"output_tok_s": x, "wall_s": 1.0} for x in tok_s_rounds], "requests": []}
    result = {"machine": {"cpu": "cpu", "cpu_count": 2, "torch": "2"},
              "config": {"model": "m", "dtype": "float32", "speculative_model": "d", "num_speculative_tokens": 2,
                         "modes": ["none", "spec"], "concurrency": [4], "num_prompts": 8, "max_tokens": 64},
              "runs": [{"mode": "none", "levels": [level([10.0, 20.0, 12.0])]},
                       {"mode": "spec", "levels": [level([11.0, 18.0, 20.0], {"0": 4.0, "2": 30.0, "1": 2.0})]}]}
    stats.add_speedups(result)
    spec = result["runs"][1]["levels"][0]
    assert spec["round_speedups"] == pytest.approx([1.1, 0.9, 20 / 12])
    assert spec["speedup_vs_none"] == pytest.approx(1.1)
    assert result["runs"][0]["levels"][0]["speedup_vs_none"] == 1.0
    assert "round_speedups" not in result["runs"][0]["levels"][0]
    md = report.render_markdown(result)
    assert ("| spec | 4 | 8 | 18.00 (11.00, 18.00, 20.00) | 1.10 (1.10, 0.90, 1.67) | 0.500 | 1.250 "
            "| 100.0 | 150.0 | - | - | k=2: 30, k=1: 2, k=0: 4 |") in md
    # a mode without rounds next to one with them falls back to the ratio of the figures
    del result["runs"][1]["levels"][0]["rounds"]
    stats.add_speedups(result)
    assert result["runs"][1]["levels"][0]["speedup_vs_none"] == pytest.approx(18.0 / 12.0)


def test_write_plot(tmp_path):
    path = tmp_path / "sub" / "serve.png"
    assert report.write_plot(_result(), str(path)) is None
    assert path.read_bytes()[:4] == b"\x89PNG"


# ----------------------------------------------------------------------------------------- args

def test_parse_concurrency_and_modes():
    assert sb.parse_concurrency("1, 4,16") == [1, 4, 16]
    for bad, named in (("0", "0"), ("x", "'x'"), ("1,-2", "-2"), ("", "''"), ("1,1", "repeats")):
        with pytest.raises(ValueError, match=named):
            sb.parse_concurrency(bad)
    assert sb.parse_modes("spec") == ["spec"] and sb.parse_modes("none, spec") == ["none", "spec"]
    with pytest.raises(ValueError, match="'fast'"):
        sb.parse_modes("none,fast")
    assert sb.requests_for(1, None) == 8 and sb.requests_for(16, None) == 16 and sb.requests_for(16, 3) == 3


def test_check_args():
    levels, modes = sb.check_args(_args("--model", "m", "--speculative-model", "d", "--concurrency", "1,2"))
    assert levels == [1, 2] and modes == ["none", "spec"]
    assert sb.check_args(_args())[1] == ["none", "spec"]  # the default target has a default draft
    for argv, named in ((["--num-requests", "0"], "--num-requests"), (["--max-tokens", "0"], "--max-tokens"),
                        (["--port", "70000"], "70000"), (["--base-url", "localhost:8000"], "localhost:8000"),
                        (["--model", "m"], "spec"), (["--no-speculation"], "--no-speculation"),
                        (["--repeats", "0"], "--repeats"), (["--repeats", "2", "--sequential"], "interleaved")):
        with pytest.raises(ValueError, match=named):
            sb.check_args(_args(*argv))
    assert sb.check_args(_args("--model", "m", "--modes", "none"))[1] == ["none"]
    assert sb.check_args(_args("--model", "m", "--base-url", "http://127.0.0.1:1"))[1] == ["server"]
    assert sb.check_args(_args("--base-url", "http://h:1", "--modes", "spec"))[1] == ["spec"]


def test_bad_flag_is_one_line_error(capsys):
    assert main(["bench-serve", "--concurrency", "1,x"]) == 2
    err = capsys.readouterr().err
    assert "specserve: error:" in err and "'x'" in err and "Traceback" not in err


def test_command_line_and_server_argv():
    args = _args("--model", "m", "--speculative-model", "d b", "--num-speculative-tokens", "3",
                 "--max-model-len", "512", "--concurrency", "1,2", "--port", "9000")
    cmd = sb.command_line(args)
    assert cmd.startswith("specserve bench-serve --model m --dtype float32 --quantization int4 --max-model-len 512 "
                          "--block-size 16 ")
    assert "--speculative-model 'd b' --num-speculative-tokens 3 " in cmd
    assert "--concurrency 1,2" in cmd and "--port 9000" in cmd and "--json" not in cmd
    none = sb.server_argv(args, "none", 9000)
    assert none[:11] == ["serve", "--model", "m", "--dtype", "float32", "--quantization", "int4", "--max-model-len",
                         "512", "--block-size", "16"]  # both servers run the same target
    assert none[-5:] == ["--no-speculation", "--host", "127.0.0.1", "--port", "9000"]
    assert "--speculative-model" not in none and "--num-speculative-tokens" not in none
    spec = sb.server_argv(args, "spec", 9000)
    assert spec[spec.index("--speculative-model") + 1] == "d b" and "--no-speculation" not in spec
    assert spec[spec.index("--num-speculative-tokens") + 1] == "3"


# ----------------------------------------------------------------------------------------- client

class _StubServer(BaseHTTPRequestHandler):
    """Streams the prompt's first word as max_tokens chunks of one character each (a stand-in for the
    engine), plus /v1/models, /health and /metrics with counters that grow per request."""

    requests = 0

    def log_message(self, *a):
        pass

    def _send(self, body: bytes, ctype: str = "application/json"):
        self.send_response(200)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        if self.path == "/v1/models":
            self._send(json.dumps({"object": "list", "data": [{"id": "stub-model"}]}).encode())
        elif self.path == "/metrics":
            n = type(self).requests
            self._send(f"{stats.METRIC_DRAFT} {4 * n}\n{stats.METRIC_ACCEPTED} {3 * n}\n".encode(), "text/plain")
        else:
            self._send(b"{}")

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        assert body["stream"] and body["ignore_eos"] and body["temperature"] == 0 and body["model"] == "stub-model"
        type(self).requests += 1
        word = body["prompt"].split()[0]
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        for i in range(body["max_tokens"]):
            chunk = {"choices": [{"index": 0, "text": word[i % len(word)]}]}
            self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
        usage = {"choices": [{"index": 0, "text": "", "finish_reason": "length"}],
                 "usage": {"completion_tokens": body["max_tokens"]}}
        self.wfile.write(f"data: {json.dumps(usage)}\n\ndata: [DONE]\n\n".encode())


@pytest.fixture
def stub_url():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _StubServer)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_bench_against_stub_server(stub_url, tmp_path, capsys):
    out = tmp_path / "serve.json"
    rc = main(["bench-serve", "--model", "m", "--base-url", stub_url, "--modes", "spec", "--concurrency", "1,3",
               "--num-requests", "5", "--max-tokens", "4", "--json", str(out)])
    assert rc == 0
    res = json.loads(out.read_text())
    assert res["command"].startswith("specserve bench-serve --model m ")
    (run,) = res["runs"]
    assert run["mode"] == "spec" and run["served_model"] == "stub-model"
    for lv in run["levels"]:
        assert lv["num_requests"] == 5 and lv["output_tokens"] == 20 and lv["output_tok_s"] > 0
        assert lv["ttft_median_s"] > 0 and lv["tpot_median_ms"] >= 0
        assert lv["spec_decode"]["acceptance_rate"] == 0.75
        assert [r["completion_tokens"] for r in lv["requests"]] == [4] * 5
        assert [r["prompt_index"] for r in lv["requests"]] == [0, 1, 2, 3, 4]
        assert all(len(r["text"]) == 4 for r in lv["requests"])
    assert "| spec | 3 | 5 |" in capsys.readouterr().out


def _round(tok_s, ttfts, drafted=None, accepted=None, steps=None, length=None, by_k=None):
    return {"concurrency": 4, "num_requests": len(ttfts), "output_tokens": 8 * len(ttfts), "wall_s": 8 * len(ttfts) / tok_s,
            "output_tok_s": tok_s,
            "spec_decode": {"draft_tokens": drafted, "accepted_tokens": accepted, "verify_steps": steps,
                            "mean_acceptance_length": length, "decode_steps_by_k": by_k or {}},
            "requests": [{"index": i, "ttft_s": t, "tpot_ms": 10.0 * t, "e2e_s": t + 1, "text": f"t{i}"}
                         for i, t in enumerate(ttfts)]}


def test_combine_rounds():
    """Three rounds: tok/s is the median (not the mean), percentiles pool every request, counts add up
    and the acceptance length is re-weighted by verify steps: (2.0 * 10 + 3.0 * 30) / 40 = 2.75."""
    rounds = [_round(10.0, [1.0, 2.0], 20, 10, 10, 2.0, {"0": 3.0, "2": 10.0}),
              _round(30.0, [3.0], 60, 60, 30, 3.0, {"2": 30.0}),
              _round(12.0, [4.0, 5.0], 0, 0, 0, None, {"0": 5.0})]
    lv = stats.combine_rounds(rounds)
    assert lv["output_tok_s"] == 12.0 and lv["num_requests"] == 5 and lv["output_tokens"] == 40
    assert lv["wall_s"] == pytest.approx(1.6 + 8 / 30 + 16 / 12)
    assert lv["ttft_median_s"] == 3.0 and lv["ttft_p99_s"] == pytest.approx(4.96)
    assert lv["tpot_median_ms"] == 30.0 and lv["e2e_median_s"] == 4.0
    sd = lv["spec_decode"]
    assert (sd["draft_tokens"], sd["accepted_tokens"], sd["verify_steps"]) == (80, 70, 40)
    assert sd["acceptance_rate"] == pytest.approx(70 / 80) and sd["mean_acceptance_length"] == pytest.approx(2.75)
    assert sd["decode_steps_by_k"] == {"0": 8.0, "2": 40.0}
    assert [r["round"] for r in lv["requests"]] == [0, 0, 1, 2, 2]
    assert [r["output_tok_s"] for r in lv["rounds"]] == [10.0, 30.0, 12.0]
    assert sorted(stats.mode_texts({"levels": [lv]})) == ["c4/r0/0", "c4/r0/1", "c4/r1/0", "c4/r2/0", "c4/r2/1"]
    assert stats.combine_rounds(rounds[:1]) is rounds[0]


def test_interleaved_rounds_reverse_the_order(monkeypatch):
    """--repeats 3 on none,spec: each level runs none, spec | spec, none | none, spec."""
    calls = []

    class FakeServer:
        def __init__(self, mode):
            self.base_url, self.argv = f"http://{mode}", ["serve"]

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    monkeypatch.setattr(sb, "_start_server", lambda args, mode, port: FakeServer(mode))
    monkeypatch.setattr(sb, "bench_mode", lambda url, model, prompts, levels, n, mt, mode:
                        {"mode": mode, "served_model": "m", "levels": []})

    def measure(url, served, prompts, c, n, max_tokens, mode):
        calls.append((c, mode))
        return _round(2.0 if mode == "spec" else 1.0, [float(len(calls))])

    monkeypatch.setattr(sb, "measure_level", measure)
    runs = sb.bench_interleaved(_args("--repeats", "3"), ["none", "spec"], ["p"], [1, 4])
    order = ["none", "spec", "spec", "none", "none", "spec"]
    assert calls == [(1, m) for m in order] + [(4, m) for m in order]
    assert [[lv["output_tok_s"] for lv in run["levels"]] for run in runs] == [[1.0, 1.0], [2.0, 2.0]]
    assert [r["ttft_s"] for r in runs[0]["levels"][1]["requests"]] == [7.0, 10.0, 11.0]  # calls 7, 10, 11
