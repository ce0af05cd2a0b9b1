"""``eagle31-mla acceptance --server URL``: an in-process HTTP server (``http.server`` on 127.0.0.1, class
:class:`Stub`) stands in for each engine and the real command runs against it, in process.

Each stand-in answers as the engine's own source has it (facts with file:line in
src/eagle31_mla/serving/engine_facts/): vLLM 0.32's ``/metrics`` as prometheus_client writes its spec-decode
counters (``v1/spec_decode/metrics.py:229-264``), ``/v1/models`` ``ModelCard``s, ``/version`` and, with
``--per-request-spec-decode-metrics``, ``metrics.speculative_decoding`` (``v1/metrics/stats.py:396-422``); SGLang
0.5.23's ``sglext.spec_tokens_details`` (``tokenizer_manager.py:3138-3206``; its biased ``spec_accept_length``
included) and ``/server_info``; TokenSpeed 0.1.1's usage fields (smg ``common.rs:726-753``) and scheduler log lines
rendered from :mod:`eagle31_mla.serving.engine_facts.tokenspeed`'s format strings. The same command against a real
``vllm serve`` is tests/engines/test_vllm_serve.py's.
"""

from __future__ import annotations

import gzip
import json
import math
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, Counter, generate_latest

from eagle31_mla.cli import main
from eagle31_mla.demo import DEMO_DIR
from eagle31_mla.serving import live
from eagle31_mla.serving.engine_facts import tokenspeed as ts_facts, vllm as vllm_facts

K = 3  # draft tokens per round (num_speculative_tokens)
MAX_TOKENS = 48
#: per prompt: the drafts each round accepts, cycled (each round makes accepted + 1 tokens)
PATTERNS = {"p0": [3, 3, 2, 3], "p1": [1, 0, 2], "p2": [3, 1], "p3": [0, 3, 3, 1, 2], "p4": [2], "p5": [3, 3, 3, 0]}
FOUR = ["p0", "p1", "p2", "p3"]


def script(prompt: str, max_tokens: int = MAX_TOKENS, pattern: list[int] | None = None) -> dict:
    """What the engine does for a prompt: one prefill token, then rounds of accepted + 1 tokens until max_tokens
    (the counters count a round's drafts before the output is cut at max_tokens, as vLLM does)."""
    pattern = pattern or PATTERNS.get(str(prompt), [2, 1])
    tokens, per_round = 1, []
    while tokens < max_tokens:
        per_round.append(pattern[len(per_round) % len(pattern)])
        tokens += per_round[-1] + 1
    return {
        "completion_tokens": min(tokens, max_tokens),
        "rounds": len(per_round),
        "accepted": sum(per_round),
        "histogram": [per_round.count(m) for m in range(K + 1)],
        "per_position": [sum(1 for a in per_round if a > j) for j in range(K)],
    }


def accepted(prompt: str, kind: str = "vllm") -> int:
    """The drafts a prompt's rounds accepted, as the engine counts them (TokenSpeed: completion - 1 - rounds, so
    without the drafts of a last round cut at max_tokens)."""
    s = script(prompt)
    return s["completion_tokens"] - 1 - s["rounds"] if kind == "tokenspeed" else s["accepted"]


def expected_al(prompts: list[str], kind: str = "vllm") -> float:
    return 1 + sum(accepted(p, kind) for p in prompts) / sum(script(p)["rounds"] for p in prompts)


LOG_PREFIX = ts_facts.LOG_LINE_PREFIX.format(asctime="2026-10-06 12:00:00", prefix=" TP0")


def decode_batch(avg_accept: float) -> str:
    """TokenSpeed's ``Decode batch.`` line (batch_log.py:189-200)."""
    return ts_facts.LOG_DECODE_BATCH.format(
        dp_rank=0, bs=1, avg_seq_len=30.0, active=3, cached=0, total=100, page_ratio=0.03, gen_throughput=1500.0,
        avg_accept=avg_accept, accept_rate=(avg_accept - 1) / K, queued=0,
    )  # fmt: skip


class Stub(ThreadingHTTPServer):
    """An engine's HTTP surface on 127.0.0.1 (its :class:`Handler`): ``kind`` vllm / sglang / tokenspeed, with
    switches for its configurations; it counts as vLLM counts and keeps the bodies it was sent."""

    daemon_threads = True

    def __init__(self, kind: str, **options):
        super().__init__(("127.0.0.1", 0), Handler)
        self.kind, self.options, self.lock = kind, options, threading.Lock()
        self.drafts = self.draft_tokens = self.accepted = 0
        self.per_pos = [0] * K
        self.bodies: list[tuple[str, dict]] = []
        self.in_flight = self.max_in_flight = 0

    def handle_error(self, request, client_address):
        """A client that hangs up early (the CLI stops at its first refusal) is no server error: socketserver would
        print a BrokenPipeError traceback to the stderr the test reads."""
        if not isinstance(sys.exc_info()[1], ConnectionError):
            super().handle_error(request, client_address)

    def metrics(self) -> str:
        """vLLM's /metrics: prometheus_client's text exposition of the counters vLLM registers."""
        o, labels = self.options, 'engine="0",model_name="demo"'
        lines = ["# TYPE python_gc_objects_collected_total counter", "python_gc_objects_collected_total 1234.0"]
        if p := o.get("metrics_prefix"):  # another engine's page
            lines += [f"# TYPE {p}spec_verify_calls_total counter", f'{p}spec_verify_calls_total{{model_name="d"}} 1.0']
        if p or o.get("disable_log_stats"):
            return "\n".join(lines) + "\n"
        lines += ["# TYPE vllm:num_requests_running gauge", f"vllm:num_requests_running{{{labels}}} {self.in_flight}.0"]
        names = vllm_facts.SPEC_DECODE_COUNTERS
        counters = {"drafts": self.drafts, "draft_tokens": self.draft_tokens, "accepted_tokens": self.accepted}
        counters["drafts"] = o.get("drafts_value", counters["drafts"])  # what a broken exporter writes
        for key, value in () if o.get("no_spec") else counters.items():
            n, doc = names[key], {"drafts": "Number of spec decoding drafts."}.get(key, "Number of tokens.")
            lines += [f"# HELP {n}_total {doc}", f"# TYPE {n}_total counter", f"{n}_total{{{labels}}} {float(value)!r}"]
            lines += [f"# HELP {n}_created {doc}", f"# TYPE {n}_created gauge", f"{n}_created{{{labels}}} 1.76e+09"]
            if o.get("two_engines"):  # data parallel: one series per engine index, summed by the reader
                lines.append(f'{n}_total{{engine="1",model_name="demo"}} 0.0')
        if not o.get("no_spec"):
            n = names["accepted_tokens_per_pos"]
            lines += [f"# HELP {n}_total Accepted tokens per draft position.", f"# TYPE {n}_total counter"]
            lines += [f'{n}_total{{{labels},position="{j}"}} {float(self.per_pos[j])!r}' for j in range(K)]
        return "\n".join(lines) + "\n"

    def record(self, s: dict) -> None:
        with self.lock:
            if self.options.get("restarts"):  # the counters start again from 0 after each request
                self.drafts = self.draft_tokens = self.accepted = 0
                self.per_pos = [0] * K
            self.drafts += s["rounds"]
            self.draft_tokens += s["rounds"] * K
            self.accepted += s["accepted"] + self.options.get("extra_accepted", 0)
            self.per_pos = [a + b for a, b in zip(self.per_pos, s["per_position"])]

    def models_body(self) -> dict:
        owner = self.options.get("owned_by", {"vllm": "vllm", "sglang": "sglang"}.get(self.kind, "self_hosted"))
        entry = {"object": "model", "created": 0, "owned_by": owner}
        if self.kind != "tokenspeed":
            entry.update(root="/models/demo-target", parent=None, max_model_len=512, permission=[])
        return {"object": "list", "data": [{"id": m, **entry} for m in self.options.get("models", ["demo"])]}

    def completion(self, path: str, body: dict) -> tuple[int, dict]:
        o = self.options
        if o.get("refuse"):
            message = "This model's maximum context length is 512 tokens."
            return 400, {"object": "error", "message": message, "code": 400}
        prompt = body["messages"][-1]["content"] if "messages" in body else body.get("prompt")
        s = script(str(prompt), body["max_tokens"], o.get("pattern"))
        completion, rounds, accepted = s["completion_tokens"], s["rounds"], s["accepted"]
        text = {"message": {"role": "assistant", "content": "x" * completion}} if "chat" in path else {"text": "x"}
        usage = {"prompt_tokens": 4, "completion_tokens": completion, "total_tokens": 4 + completion}
        choices = [{"index": 0, "finish_reason": "length", **text}]
        response = {"id": "cmpl-0123456789abcdef", "object": "text_completion", "model": body["model"]}
        response.update(created=1760000000, choices=choices, usage=usage)
        if self.kind == "vllm":
            if o.get("per_request_metrics"):  # RequestSpecDecodeMetrics.to_dict (v1/metrics/stats.py:396-422)
                spec = {"mean_acceptance_length": 1.0 + accepted / rounds, "num_spec_tokens": K}
                spec.update(draft_acceptance_rate=accepted / (rounds * K), acceptance_histogram=s["histogram"])
                spec.update(num_spec_steps=rounds, num_accepted_draft_tokens=accepted, num_draft_tokens=rounds * K)
                spec.update(o.get("spec_fields", {}))
                response["metrics"] = {"speculative_decoding": spec}
            if o.get("late_counters"):  # the step's stats recorded just after the response went out
                threading.Timer(0.05, self.record, (s,)).start()
            elif not o.get("no_spec"):
                self.record(s)
        elif self.kind == "sglang" and body.get("return_spec_tokens_details") and not o.get("no_spec"):
            hist = s["histogram"][: max(m for m in range(K + 1) if s["histogram"][m]) + 1]  # as long as the largest j
            details = {"spec_accept_rate": accepted / (rounds * K), "spec_accept_length": completion / rounds}  # biased
            details.update(spec_num_correct_drafts=accepted, spec_num_proposed_drafts=rounds * K, spec_verify_ct=rounds)
            response["sglext"] = {"spec_tokens_details": {**details, "spec_correct_drafts_histogram": hist}}
        elif self.kind == "tokenspeed":  # the engine's spec_accepted_tokens = completion_tokens - 1 - verify_ct
            response["id"] = rid = body.get(ts_facts.REQUEST_ID_FIELD) or response["id"]
            engine_accepted = completion - 1 - rounds
            if not o.get("no_usage_fields"):
                details = {ts_facts.ACCEPTED_PREDICTION_TOKENS: engine_accepted}
                details[ts_facts.REJECTED_PREDICTION_TOKENS] = rounds * K - engine_accepted
                usage["completion_tokens_details"] = details
            if o.get("log") is not None:
                self.write_log(rid, completion, (completion - 1) / rounds)
        return 200, response

    def write_log(self, rid: str, completion: int, al: float) -> None:
        """A finished request's lines (generation_output_processor.py:538-545)."""
        if self.options.get("request_stats"):
            stats = (
                f"RequestStats(status='finished', reason='length', prompt_tokens=4, cache_tokens=0, output_tokens="
                f"{completion}, cache_hit_rate=0.0, queue_ms=0.1, decode_tps=1500.0, acc_len={round(al, 2)}, "
                f"acc_rate={round((al - 1) / K, 4)}, recv_ts=1760000000.0, finish_ts=1760000000.03)"
            )
            line = ts_facts.LOG_REQUEST_STATS.format(rid=rid, stats=stats)
        else:
            line = ts_facts.LOG_REQUEST_FINISH.format(rid=rid, accept_draft_tokens=al)
        with self.lock, open(self.options["log"], "a") as f:
            f.write(LOG_PREFIX + decode_batch(al) + "\n")
            f.write("" if self.options.get("windows_only") else LOG_PREFIX + line + "\n")


class Handler(BaseHTTPRequestHandler):  # self.server: the Stub
    protocol_version = "HTTP/1.1"
    # TCP_NODELAY, as the engines' servers have it: without it a kept-alive answer waits ~40 ms for an ACK
    disable_nagle_algorithm = True

    def log_message(self, *args):
        pass

    def send(self, status: int, body, content_type="application/json", encoding=None):
        data = (
            body if isinstance(body, bytes) else body.encode() if isinstance(body, str) else json.dumps(body).encode()
        )
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        if encoding:  # whatever the client asked for
            self.send_header("Content-Encoding", encoding)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        if hostile := self.server.options.get("hostile_models_page"):  # drips, streams forever, or redirects away
            if hostile == "gzip":  # 200 KB on the wire, 200 MB once httpx would decode it
                return self.send(200, gzip.compress(b" " * 200 * 2**20), "application/json", "gzip")
            self.send_response(307 if hostile == "redirect" else 200)
            self.send_header("Location", "http://localhost:9/v1/models")
            self.send_header("Content-Length", "0" if hostile == "redirect" else str(2**40))
            self.end_headers()
            while hostile != "redirect":
                self.wfile.write(b" " if hostile == "drip" else b" " * 2**20)
                time.sleep(0.2 if hostile == "drip" else 0)
            return
        stub, info = self.server, {"model_path": "/models/demo-target", "version": "0.5.23"}
        info.update(speculative_draft_model_path="/models/demo-draft", speculative_algorithm="EAGLE3")
        pages = {  # models_page: what another web server answers there
            ("any", "/v1/models"): stub.options.get("models_page", (200, stub.models_body(), "application/json")),
            ("vllm", "/metrics"): (200, stub.metrics(), "text/plain; version=0.0.4; charset=utf-8"),
            ("vllm", "/version"): (200, {"version": "0.32.0"}, "application/json"),
            ("sglang", "/server_info"): (200, info, "application/json"),
        }
        kind = "vllm" if self.path == "/metrics" and stub.options.get("metrics_prefix") else stub.kind
        page = pages.get(("any", self.path)) or pages.get((kind, self.path))
        self.send(*(page or (404, {"detail": "Not Found"}, "application/json")))

    def do_POST(self):
        stub, body = self.server, json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        with stub.lock:
            stub.bodies.append((self.path, body))
            stub.in_flight += 1
            stub.max_in_flight = max(stub.max_in_flight, stub.in_flight)
        time.sleep(stub.options.get("delay", 0.0))
        status, response = stub.completion(self.path, body)
        with stub.lock:
            stub.in_flight -= 1
        self.send(status, response)


@pytest.fixture
def serve():
    servers = []

    def start(kind: str, **options) -> tuple[str, Stub]:
        servers.append(stub := Stub(kind, **options))
        threading.Thread(target=stub.serve_forever, args=(0.02,), daemon=True).start()  # quick to shut down
        return f"http://127.0.0.1:{stub.server_address[1]}", stub

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


def prompts_file(path: Path, names=FOUR) -> Path:
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in names))
    return path


@pytest.fixture
def prompts(tmp_path):
    return prompts_file(tmp_path / "prompts.jsonl")


def run(argv, capsys) -> tuple[int, str, str]:
    code = main(["acceptance", "--no-progress", *argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def measure(url, engine, prompts_path, *extra, capsys, json_path=None) -> tuple[int, dict | None, str, str]:
    argv = ["--server", url, "--engine", engine, "--prompts", str(prompts_path), "--max-tokens", str(MAX_TOKENS)]
    code, out, err = run([*argv, *(["--json", str(json_path)] if json_path else []), *extra], capsys)
    report = json.loads(Path(json_path).read_text()) if json_path and Path(json_path).exists() else None
    return code, report, out, err


@pytest.fixture(scope="module")
def offline_report(tmp_path_factory):
    """A real offline `acceptance --json` report (the embedded demo pair, one prompt, 8 tokens)."""
    root = tmp_path_factory.mktemp("offline")
    (root / "p.txt").write_text("Ann has a red\n")
    argv = ["acceptance", "--target", str(DEMO_DIR / "target"), "--draft", str(DEMO_DIR / "draft")]
    argv += ["--prompts", str(root / "p.txt"), "--max-new-tokens", "8", "--device", "cpu", "--no-progress"]
    assert main([*argv, "--json", str(root / "offline.json")]) == 0
    return json.loads((root / "offline.json").read_text())


# ---- what each engine reports, attributed per request or in aggregate --------------------------------------


@pytest.mark.parametrize(
    "kind, options, extra, attribution",
    [
        ("vllm", {}, [], "per-request"),  # /metrics counters diffed around each request
        # increments that land after the response; data-parallel engines' series summed
        ("vllm", {"late_counters": True, "two_engines": True}, [], "per-request"),
        ("vllm", {"delay": 0.2}, ["--concurrency", "3"], "aggregate"),  # overlapping: diffed around the run
        ("vllm", {"per_request_metrics": True, "delay": 0.2}, ["--concurrency", "4"], "per-request"),
        ("vllm", {"per_request_metrics": True, "disable_log_stats": True}, [], "per-request"),
        ("sglang", {"delay": 0.1}, ["--concurrency", "3"], "per-request"),
        ("tokenspeed", {}, [], "per-request"),
    ],
)
def test_each_engines_acceptance_is_exact(serve, tmp_path, capsys, offline_report, kind, options, extra, attribution):
    names = list(PATTERNS) if "--concurrency" in extra else FOUR
    url, stub = serve(kind, **options)
    path = prompts_file(tmp_path / "p.jsonl", names)
    code, report, out, err = measure(url, kind, path, *extra, capsys=capsys, json_path=tmp_path / "r.json")
    assert code == 0, err
    if "--concurrency" in extra:
        assert stub.max_in_flight >= 2  # the requests really overlapped
    assert set(offline_report) <= set(report) and set(report["total"]) == set(offline_report["total"])  # one schema
    assert set(report["settings"]) >= set(offline_report["settings"])
    assert set(report["requests"][0]) >= set(offline_report["requests"][0])
    total, server = report["total"], report["server"]
    assert server["attribution"] == attribution and server["model"] == "demo"
    assert total["num_rounds"] == sum(script(p)["rounds"] for p in names)
    assert total["mean_accept_length"] == pytest.approx(expected_al(names, kind))  # all tokens over all rounds
    assert total["num_steps"] == K and total["draft_tokens_per_round"] == K
    assert report["settings"]["num_draft_tokens"] == K + 1 and report["tokens_per_second"] > 0
    assert f"report written to {tmp_path / 'r.json'}" in out
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".r.json")]  # no temporary file left
    if attribution == "aggregate":
        assert report["confidence_interval_95"] is None and "no confidence interval (aggregate attribution" in out
        assert all(r["num_rounds"] is None and r["mean_accept_length"] is None for r in report["requests"])
        assert total["acceptance_rate_per_position"] == [n / total["num_rounds"] for n in stub.per_pos]
        return
    ci = report["confidence_interval_95"]
    assert ci["low"] < total["mean_accept_length"] < ci["high"] and "95% CI [" in out
    for r, p in zip(report["requests"], names):
        s = script(p)
        assert (r["num_rounds"], r["num_accepted_tokens"]) == (s["rounds"], accepted(p, kind)), p
        assert r["mean_accept_length"] == pytest.approx(expected_al([p], kind)), p  # SGLang's: not its biased field
        assert r["num_generated_tokens"] == s["completion_tokens"]
        if kind == "tokenspeed":  # no histogram, no per-position rates; drafts from accepted + rejected
            assert r["num_draft_tokens"] == s["rounds"] * K and r["accept_histogram"] is None
            assert r["acceptance_rate_per_position"] is None
        else:  # vLLM's per-position counter rebuilt into a chain's histogram; SGLang's padded to num_steps + 1
            assert r["accept_histogram"] == s["histogram"]
            assert r["acceptance_rate_per_position"] == [n / s["rounds"] for n in s["per_position"]]
    if kind == "vllm" and not options.get("per_request_metrics"):
        assert total["num_rounds"] == stub.drafts and server["version"] == "0.32.0"
    if options.get("per_request_metrics") and not options.get("disable_log_stats"):  # the counters agree
        assert server["counters_accept_length"] == pytest.approx(total["mean_accept_length"])
    sent = {key for _, body in stub.bodies for key in body}
    assert ("return_spec_tokens_details" in sent) == (kind == "sglang") and ("rid" in sent) == (kind == "tokenspeed")
    assert len({b.get("rid") for _, b in stub.bodies}) == (4 if kind == "tokenspeed" else 1)  # one rid each


def test_statistics_without_a_histogram_follow_the_offline_formulas():
    """Per-position counts without a histogram (a tree's counters): AcceptanceStats.to_dict's numbers for every key
    the engine reports."""
    from eagle31_mla.decoding.speculative import AcceptanceStats

    stats = AcceptanceStats(3, 3, [4, 2, 5, 9], 120, 2).to_dict()
    acc = live.Acceptance(20, 39, 60, None, [16, 14, 9], 3)
    assert live.acceptance_dict(acc, 120, 2) == {**stats, "accept_histogram": None}


@pytest.mark.parametrize(
    "options, matched, source",
    [
        ({"no_usage_fields": True}, 4, "scheduler log (Req"),  # Finish! lines attribute each request by its rid
        ({"no_usage_fields": True, "request_stats": True}, 4, "scheduler log (Req"),  # the RequestStats variant
        ({}, 4, "usage"),  # usage fields and log lines cross-checked: no disagreement
        ({"no_usage_fields": True, "windows_only": True}, 0, "Decode batch windows"),  # an aggregate of windows
    ],
)
def test_tokenspeed_scheduler_log(serve, prompts, capsys, tmp_path, options, matched, source):
    log = tmp_path / "scheduler.log"
    log.write_text("[2026-10-06 11:59:59 TP0] Load weight end.\n")
    url, _ = serve("tokenspeed", log=log, **options)
    code, report, out, err = measure(
        url, "tokenspeed", prompts, "--log", str(log), capsys=capsys, json_path=tmp_path / "r.json"
    )
    assert code == 0, err
    assert source in report["server"]["source"] and not [n for n in report["notes"] if "disagree" in n]
    assert report["server"]["log"]["requests_matched"] == matched and report["server"]["log"]["decode_windows"] == 4
    assert f"scheduler log               {matched} requests matched" in out
    if matched:
        assert [r["num_rounds"] for r in report["requests"]] == [script(p)["rounds"] for p in FOUR]
    else:  # the unweighted mean of the windows' avg_accept_len, as logged (2 decimals)
        assert report["server"]["attribution"] == "aggregate" and report["confidence_interval_95"] is None
        windows = [float(f"{(script(p)['completion_tokens'] - 1) / script(p)['rounds']:.2f}") for p in FOUR]
        assert report["total"]["mean_accept_length"] == pytest.approx(sum(windows) / 4)


def test_prompt_shapes_endpoints_defaults_and_credentials_never_printed(serve, prompts, tmp_path, capsys):
    path = tmp_path / "p.jsonl"
    lines = ['"p0"', "[5, 6, 7]", '{"input_ids": [1, 2]}', '{"messages": [{"role": "user", "content": "p1"}]}']
    path.write_text("\n".join(lines) + "\n")
    url, stub = serve("vllm")
    code, _, _, err = measure(url, "vllm", path, "--chat", "--temperature", "0.5", "--top-p", "0.9", capsys=capsys)
    assert code == 0, err
    assert [(p, b.get("prompt", b.get("messages"))) for p, b in stub.bodies] == [
        ("/v1/chat/completions", [{"role": "user", "content": "p0"}]),  # --chat wraps a text prompt
        ("/v1/completions", [5, 6, 7]),  # ids go as a token list
        ("/v1/completions", [1, 2]),
        ("/v1/chat/completions", [{"role": "user", "content": "p1"}]),
    ]
    body = stub.bodies[0][1]
    assert (body["model"], body["temperature"], body["top_p"], body["max_tokens"]) == ("demo", 0.5, 0.9, MAX_TOKENS)
    stub.bodies.clear()  # the defaults, with --json - and the progress bar
    assert main(["acceptance", "--server", url, "--engine", "vllm", "--prompts", str(path), "--json", "-"]) == 0
    assert {(b["temperature"], b["top_p"]) for _, b in stub.bodies} == {(0.0, 1.0)}
    captured = capsys.readouterr()
    assert json.loads(captured.out)["total"]["num_requests"] == 4  # stdout is the report alone
    assert "acceptance: 100%" in captured.err and "accept_length=" in captured.err  # tqdm, on stderr
    # credentials in the URL: never printed nor written
    secret_url = url.replace("http://", "http://ada:hunter2@")
    code, report, out, err = measure(secret_url, "vllm", prompts, capsys=capsys, json_path=tmp_path / "r.json")
    assert code == 0 and report["server"]["url"] == url.replace("http://", "http://***@"), err
    assert "hunter2" not in out + err + (tmp_path / "r.json").read_text()
    code, _, out, err = measure(secret_url.replace(url.rsplit(":", 1)[1], "9"), "vllm", prompts, capsys=capsys)
    assert code == 2 and "cannot reach http://***@127.0.0.1:9/v1/models" in err and "hunter2" not in out + err
    code, _, out, err = measure(secret_url + "0000", "vllm", prompts, capsys=capsys)  # a port out of range
    assert code == 2 and f"got '{url.replace('http://', 'http://***@')}0000'" in err and "hunter2" not in out + err
    # the origin as httpx normalises it: the same server named in capitals is no redirect
    code, _, _, err = measure(secret_url.replace("127.0.0.1", "LOCALHOST"), "vllm", prompts, capsys=capsys)
    assert code == 0, err


# ---- the confidence interval and the verdict ----------------------------------------------------------


def test_t_quantiles_and_the_ratio_estimators_interval():
    assert live.t_quantile_975(1) == 12.706 and live.t_quantile_975(30) == 2.042
    for df, value in ((40, 2.0211), (60, 2.0003), (120, 1.9799), (1000, 1.9623)):
        assert live.t_quantile_975(df) == pytest.approx(value, abs=2e-4)
    items = [live.Acceptance(10, 20), live.Acceptance(5, 4), live.Acceptance(8, 16), live.Acceptance(12, 15)]
    a, r = [i.rounds + i.accepted for i in items], [i.rounds for i in items]
    ratio = sum(a) / sum(r)
    se = math.sqrt(sum((ai - ratio * ri) ** 2 for ai, ri in zip(a, r)) / 3 / 4) / (sum(r) / 4)
    ci = live.ratio_interval(items)
    assert ci["low"] == pytest.approx(ratio - 3.182 * se) and ci["high"] == pytest.approx(ratio + 3.182 * se)
    assert live.ratio_interval(items[:1]) is None  # one request: no interval


def reference_for(names: list[str], path: Path, *, scale: float = 1.0, **settings) -> Path:
    """An offline report (the keys `acceptance --json` writes) with the per-request rounds of the prompts ``names``."""
    requests = [
        {"index": i, "num_rounds": script(p)["rounds"], "num_accepted_tokens": round(script(p)["accepted"] * scale)}
        for i, p in enumerate(names)
    ]
    rounds, accepted = (sum(r[key] for r in requests) for key in ("num_rounds", "num_accepted_tokens"))
    base = {"num_steps": K, "topk": 1, "num_draft_tokens": K + 1, "temperature": 0.0, "top_p": 1.0}
    base.update({"max_new_tokens": MAX_TOKENS, "seed": 0, "eos_token_id": [1], **settings})
    total = {"mean_accept_length": 1 + accepted / rounds, "num_rounds": rounds}
    path.write_text(json.dumps({"settings": base, "total": total, "requests": requests}))
    return path


@pytest.mark.parametrize(
    "pattern, verdict_args, code, method",
    [
        (None, ["--expect", "{mean+0.01}"], 0, "the measured 95% interval"),
        (None, ["--concurrency", "3", "--expect", "{mean+0.05}"], 0, "(aggregate attribution): tolerance 0.1"),
        (None, ["--reference", "{same}"], 0, "paired"),  # same prompts: request by request, margin MIN_MARGIN
        # a small drop the unpaired interval would miss; the reference's other settings, a warning
        (None, ["--reference", "{ten_percent_more}"], 1, "paired"),
        ([0, 0, 0, 0, 0, 0, 0, 1], ["--expect", "3.4"], 1, "wrong convention"),  # near 1: almost never accepted
        ([3, 2, 2, 1], ["--expect", "3.4"], 1, "off by one"),  # a moderate drop
    ],
)
def test_verdicts(serve, prompts, capsys, tmp_path, pattern, verdict_args, code, method):
    url, _ = serve("vllm", pattern=pattern)
    values = {
        "mean+0.01": f"{expected_al(FOUR) + 0.01:.4f}",
        "mean+0.05": f"{expected_al(FOUR) + 0.05:.4f}",
        "same": reference_for(FOUR, tmp_path / "same.json", prompts=str(prompts)),
        "ten_percent_more": reference_for(FOUR, tmp_path / "more.json", scale=1.1, max_new_tokens=256, temperature=0.7),
    }
    argv = [str(values[a[1:-1]]) if a.startswith("{") else a for a in verdict_args]
    got, report, out, err = measure(url, "vllm", prompts, *argv, capsys=capsys, json_path=tmp_path / "r.json")
    verdict = report["verdict"]
    assert got == code and verdict["consistent"] == (code == 0), err
    if code == 0:
        assert method in verdict["method"] and "verdict: consistent with" in out and not err
        if "same" in argv[-1]:
            assert verdict["difference"] == pytest.approx(0) and verdict["margin"] == live.MIN_MARGIN
        if "tolerance" in method:
            assert verdict["margin"] == live.NO_INTERVAL_TOLERANCE
        return
    assert "paired" in verdict["method"] if method == "paired" else method in verdict["causes"][0]
    if "more" in argv[-1]:
        (warning,) = [line for line in err.splitlines() if line.startswith("warning:")]
        assert "max_new_tokens 256 (reference) vs 48 (server)" in warning and "temperature 0.7" in warning
    assert verdict["difference"] < 0 and "AttnRes" in " ".join(verdict["causes"])
    assert "VLLM_KIMI_K3_AUX_ATTN_RES_STREAM=1" in " ".join(verdict["causes"])
    command = "eagle31-mla doctor --draft DRAFT --target /models/demo-target --engine vllm --engine-version 0.32.0"
    assert verdict["doctor"] == command and "verdict: NOT consistent" in out
    assert f"check the deployment: {command}" in out


def test_the_python_api_and_sglangs_doctor_command(serve, prompts):
    """The doctor command names the pair SGLang's /server_info names (DRAFT / TARGET where a server does not)."""
    url, _ = serve("sglang", models=["a", "b"])
    report = live.measure_server(url, "sglang", prompts, max_tokens=MAX_TOKENS, model="b", expect=9.9)
    assert report["server"]["engine"] == "sglang" and report["server"]["model"] == "b"
    assert report["server"]["version"] == "0.5.23" and not report["verdict"]["consistent"]
    assert report["verdict"]["doctor"] == (
        "eagle31-mla doctor --draft /models/demo-draft --target /models/demo-target --engine sglang "
        "--engine-version 0.5.23"
    )
    with pytest.raises(live.LiveError, match="expect= or reference="):
        live.measure_server(url, "sglang", prompts, expect=2.0, reference={"total": {"mean_accept_length": 2}})


# ---- bad input: one line, exit 2, nothing written ---------------------------------------------------------


@pytest.mark.parametrize(
    "kind, options, engine, extra, message",
    [
        (None, {}, "vllm", [], "cannot reach {url}/v1/models"),
        ("vllm", {"delay": 2.0}, "vllm", ["--timeout", "0.5"], "no answer within 0.5 s (--timeout)"),
        ("vllm", {"models_page": (200, "<html>hello</html>", "text/html")}, "vllm", [], "is not an OpenAI-compatible"),
        ("vllm", {"models_page": (404, "missing", "text/html")}, "vllm", [], "/v1/models answered HTTP 404, not JSON"),
        ("vllm", {"owned_by": "vllm", "models": []}, "vllm", [], "serves no model"),
        ("vllm", {"models": ["a", "b"]}, "vllm", [], "serves 2 models (a, b); name one with --model"),
        ("vllm", {"models": ["a", "b"]}, "vllm", ["--model", "c"], "--model 'c' is not served"),
        ("vllm", {"no_spec": True}, "vllm", [], "runs vLLM without speculative decoding"),
        ("vllm", {"disable_log_stats": True}, "vllm", [], "--disable-log-stats"),
        ("sglang", {"no_spec": True}, "sglang", [], "no sglext.spec_tokens_details"),
        ("tokenspeed", {"no_usage_fields": True}, "tokenspeed", [], "pass its scheduler log with --log"),
        ("tokenspeed", {}, "tokenspeed", ["--log", "{log}"], "no TokenSpeed acceptance lines"),
        ("vllm", {}, "vllm", ["--prompts", "{bad}"], "{bad}:2: "),  # a bad prompt line: refused before any request
        ("vllm", {"refuse": True}, "vllm", [], "prompts.jsonl:1: the server refused the request to /v1/completions: "
         "HTTP 400: This model's maximum context length is 512 tokens."),
        ("sglang", {}, "vllm", [], 'looks like SGLang (GET /v1/models says owned_by "sglang")'),
        ("vllm", {}, "sglang", [], 'looks like vLLM (GET /v1/models says owned_by "vllm")'),
        ("vllm", {}, "tokenspeed", [], "looks like vLLM"),
        ("vllm", {"owned_by": "proxy"}, "sglang", [], "looks like vLLM (its /metrics has vllm: series)"),
        ("sglang", {"owned_by": "x", "metrics_prefix": "sglang:"}, "vllm", [], "like SGLang (its /metrics has sglang:"),
        ("tokenspeed", {}, "sglang", [], "looks like TokenSpeed (its response carries usage.completion_tokens_details"),
        ("sglang", {"owned_by": "self_hosted"}, "tokenspeed", [], "no usage.completion_tokens_details.accepted_"),
        # a server is untrusted: a request's whole answer within --timeout and 64 MiB, counters checked as counters
        ("vllm", {"hostile_models_page": "drip"}, "vllm", ["--timeout", "1"], "/v1/models: no answer within 1 s"),
        ("vllm", {"hostile_models_page": "endless"}, "vllm", [], "an answer larger than 64 MiB: refused"),
        ("vllm", {"hostile_models_page": "gzip"}, "vllm", [], "an answer in Content-Encoding gzip, not the identity "
         "asked for: refused"),
        ("vllm", {"hostile_models_page": "redirect"}, "vllm", [], "redirected to http://localhost:9, another origin "
         "than http://127.0.0.1:"),
        ("vllm", {"restarts": True}, "vllm", [], "went down between two scrapes (drafts 13 -> 24, accepted 36 -> 24)"),
        ("vllm", {"extra_accepted": 100}, "vllm", [], "/metrics: the spec-decode counters accepted 136 draft tokens "
         "of 39 proposed: impossible counts"),
        ("vllm", {"drafts_value": -3}, "vllm", [], "/metrics: vllm:spec_decode_num_drafts_total is -3.0; a counter"),
        ("vllm", {"drafts_value": "NaN"}, "vllm", [], "vllm:spec_decode_num_drafts_total is nan; a counter is a "),
        ("vllm", {"per_request_metrics": True, "disable_log_stats": True, "spec_fields": {"num_spec_steps": 10**30}},
         "vllm", [], "prompts.jsonl:1: the response's acceptance fields count 1000000000000000000000000000000 rounds "
         "for 48 tokens: impossible"),
        ("vllm", {"per_request_metrics": True, "disable_log_stats": True, "spec_fields": {"num_draft_tokens": 3}},
         "vllm", [], "prompts.jsonl:1: the response's acceptance fields accepted 36 draft tokens of 3 proposed"),
    ],
)  # fmt: skip
def test_a_server_that_cannot_be_measured(serve, prompts, capsys, tmp_path, kind, options, engine, extra, message):
    """One line naming the cause, exit 2, no traceback, nothing on stdout, no report (nor its temporary file), an
    earlier report left as it was; found out before any request where the server's pages tell."""
    url, stub = serve(kind or "vllm", **options)
    if kind is None:  # a server gone: nothing listens at its port
        stub.shutdown()
        stub.server_close()
    log = tmp_path / "scheduler.log"
    log.write_text("[2026-10-06 12:00:00 TP0] Prefill batch. #new-seq: 1\n")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "ok"}\n{"input_ids": [1.5]}\n')
    out = tmp_path / "r.json"
    out.write_text('{"earlier": true}\n')
    start = time.monotonic()
    argv = [a.format(log=log, bad=bad) for a in extra]
    code, _, stdout, err = measure(url, engine, prompts, *argv, capsys=capsys, json_path=out)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("eagle31-mla: error: "), err
    assert message.format(url=url, bad=bad) in lines[0], lines[0]
    assert "Traceback" not in err and not stdout and time.monotonic() - start < 10
    assert out.read_text() == '{"earlier": true}\n' and not list(tmp_path.glob(".r.json*"))
    if options.get("no_spec") and kind == "vllm" or "{bad}" in extra:
        assert not stub.bodies  # vLLM's counters, the prompts file: found out before any request


@pytest.mark.parametrize(
    "argv, message",
    [  # --target with --server, --expect without it, --expect with --reference: tests/cli/test_cli_corpus.py's
        (["--server", "{url}"], "--server needs --engine"),
        (["--server", "{url}", "--engine", "vllm", "--log", "{prompts}"], "--log reads TokenSpeed's scheduler log"),
        (["--engine", "vllm", "--target", "{model}", "--draft", "{model}"], "--engine measures a running server"),
        (["--target", "{model}"], "acceptance needs --draft"),
        ([], "acceptance needs --target and --draft"),
    ],
)
def test_argument_rules(prompts, capsys, argv, message):
    values = {"url": "http://127.0.0.1:9", "model": str(DEMO_DIR / "target"), "prompts": str(prompts)}
    code, out, err = run(["--prompts", str(prompts), *[a.format(**values) for a in argv]], capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1 and message in err and not out, err


# ---- the parsers on their engines' own text ---------------------------------------------------------------


def test_prometheus_text_is_read_as_prometheus_client_writes_it(serve):
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
    assert (counters.rounds, counters.accepted, counters.per_position) == (16, 5, [0, 3])
    assert live.vllm_counters(live.parse_prometheus("vllm:num_requests_running 0\n")) is None
    with pytest.raises(live.LiveError, match="/metrics page is not Prometheus text"):  # one line, never a traceback
        live.parse_prometheus(text + "garbage line here\n")
    # two counters registered as vLLM registers them (v1/spec_decode/metrics.py:229-264), written by prometheus_client
    registry, names, labels = CollectorRegistry(), vllm_facts.SPEC_DECODE_COUNTERS, ["model_name", "engine"]
    Counter(names["drafts"], "Number of spec decoding drafts.", labels, registry=registry).labels("demo", "0").inc(14)
    doc = "Accepted tokens per draft position."
    per_pos = Counter(names["accepted_tokens_per_pos"], doc, [*labels, "position"], registry=registry)
    per_pos.labels("demo", "0", "0").inc(12)
    written = generate_latest(registry).decode()
    counters = live.vllm_counters(live.parse_prometheus(written))
    assert (counters.rounds, counters.per_position) == (14, [12])  # the _created series are not counted
    _, stub = serve("vllm")
    stub.drafts, stub.per_pos = 14, [12, 0, 0]
    page = stub.metrics().splitlines()  # the stand-in writes the same lines
    assert [line for line in written.splitlines() if "_created" not in line and line not in page] == []


def test_tokenspeed_log_parser_on_lines_from_its_format_strings():
    stats = "RequestStats(status='finished', reason='stop', output_tokens=30, acc_len=2.9, acc_rate=0.6333)"
    lines = [
        ts_facts.LOG_REQUEST_FINISH.format(rid="chatcmpl-abc", accept_draft_tokens=47 / 14),
        ts_facts.LOG_REQUEST_STATS.format(rid="cmpl-x-0192", stats=stats),
        ts_facts.LOG_REQUEST_STATS.format(rid="r-off", stats="RequestStats(status='finished', acc_len=None)"),
        decode_batch(2.3456),
        # the older format quoted in smg-project/smg#1965 (no #dp-rank)
        "Decode batch. #running-req: 2, #pages(active/cached/total): 1/0/9, avg_accept_len: 1.90, accept_rate: 0.30",
    ]
    log = live.parse_tokenspeed_log("\n".join([LOG_PREFIX + line for line in lines] + ["noise"]))
    assert log.requests == {"chatcmpl-abc": (47 / 14, None), "cmpl-x-0192": (2.9, 30)}  # full precision from str()
    assert log.windows == [2.35, 1.9]
    assert log.find("cmpl-x") == (2.9, 30)  # the gateway's per-attempt suffix (PD mode)
    assert live._log_acceptance(47 / 14, 48).rounds == 14
