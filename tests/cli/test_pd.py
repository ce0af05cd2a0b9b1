"""PD-disaggregated serving without an engine: ``serve-command --pd`` prints a pair doctor passes, ``doctor
--prefill-command ... --decode-command ...`` names each trap of a pair by its id (every ``pd-*`` check has a case
here, built by changing one thing in a good pair). Bad uses and bad launch commands, one exact line each:
tests/unit/test_bad_inputs.py. The pair on a real engine: tests/engines/test_vllm_pd.py."""

from __future__ import annotations

import json
import shlex
from functools import partial

import pytest

from eagle31_mla.cli import main
from eagle31_mla.serving import pd
from eagle31_mla.serving.doctor import CHECKS
from eagle31_mla.serving.engine_facts import vllm as vllm_facts
from eagle31_mla.serving.pd import parse_launch
from tests.support.engine_configs import K3_IDS, deepseek_target, draft, kimi_k3_target, write_config


def run(argv, capsys) -> tuple[int, str, str]:
    code = main(argv)
    return code, *capsys.readouterr()


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """A Kimi-K3 target, the drafter for it, the same drafter one layer off, a Llama-style (MHA) EAGLE-3 draft,
    and a DeepSeek-style (not hybrid) stand-in target, as local folders."""
    root = tmp_path_factory.mktemp("pd-models")
    mha = dict(architectures=["LlamaForCausalLMEagle3"], model_type="llama", hidden_size=7168, vocab_size=163840)
    mha.update(num_attention_heads=64, num_key_value_heads=8, head_dim=128, eagle_aux_hidden_state_layer_ids=K3_IDS)
    return {
        "k3": str(write_config(root / "k3", kimi_k3_target())),
        "draft": str(write_config(root / "draft", draft())),
        "draft-off": str(write_config(root / "draft-off", draft(ids=[3, 47, 91]))),
        "mha": str(write_config(root / "mha", mha)),
        "deepseek": str(write_config(root / "deepseek", deepseek_target(layers=93))),
    }


VERSIONS = {"vllm": ["--engine-version", "0.32"], "sglang": ["--engine-version", "0.5.23"], "tokenspeed": []}


#: what doctor reports of a printed Kimi-K3 pair: on vLLM, the open upstream bug (issue 52627) and nothing else
UPSTREAM = {"vllm": ["pd-k3-speculation"]}


def pair(engine: str, models: dict, capsys, *extra: str, target: str = "k3") -> dict:
    argv = ["serve-command", "--engine", engine, "--pd", "--json", "--target", models[target]]
    code, out, err = run([*argv, "--draft", models["draft"], *VERSIONS[engine], *extra], capsys)
    printed, upstream = json.loads(out), UPSTREAM.get(engine, []) if target == "k3" else []
    assert [f["id"] for f in printed["doctor"]["problems"]] == upstream and code == (1 if upstream else 0), err
    return printed


def lines(printed: dict) -> tuple[str, ...]:
    return tuple(printed["pd"][side]["shell"].replace("\\\n", "") for side in ("prefill", "decode"))


@pytest.mark.parametrize("engine", ["vllm", "sglang", "tokenspeed"])
def test_the_pair_serve_command_prints_is_one_doctor_passes(engine, models, capsys):
    printed = pair(engine, models, capsys)
    argv = ["serve-command", "--engine", engine, "--pd", "--target", models["k3"], "--draft", models["draft"]]
    text = run([*argv, *VERSIONS[engine]], capsys)[1]  # its text form: the two sides and the router, in order
    assert text.index("# 1. prefill") < text.index("# 2. decode") < text.index("# 3. the router")
    assert printed["doctor"]["ok"] == (engine not in UPSTREAM)  # the problems: pair()
    prefill, decode = (parse_launch(engine, line) for line in lines(printed))
    assert prefill.draft == decode.draft == models["draft"] and prefill.target == decode.target == models["k3"]
    assert prefill.draft_settings == decode.draft_settings and prefill.kv_cache_dtype == decode.kv_cache_dtype
    assert prefill.connector == decode.connector and prefill.connector_settings == decode.connector_settings
    if engine == "vllm":  # Kimi-K3 is hybrid: NixlConnector (it moves a hybrid cache), a side-channel port each
        assert decode.connector == "NixlConnector" and decode.connector in vllm_facts.HMA_CONNECTORS
        assert (prefill.role, decode.role) == ("kv_both", "kv_both")
        ports = {side.env[vllm_facts.NIXL_SIDE_CHANNEL_PORT_ENV] for side in (prefill, decode)}
        assert len(ports) == 2 and prefill.env["VLLM_KIMI_K3_AUX_ATTN_RES_STREAM"] == "0"
        assert "toy_proxy_server.py" in printed["pd"]["router"]
    else:
        assert (prefill.role, decode.role) == ("prefill", "decode") and decode.connector == "mooncake"
        assert "--pd-disaggregation" in printed["pd"]["router"]
        assert "--disaggregation-bootstrap-port 8998" in lines(printed)[0]
        assert text.count("--disaggregation-mode prefill") == 1 and text.count("--disaggregation-mode decode") == 1


def test_a_not_hybrid_target_may_use_any_connector(models, capsys):
    printed = pair("vllm", models, capsys, "--connector", "example", target="deepseek")
    prefill, decode = (parse_launch("vllm", line) for line in lines(printed))
    assert (prefill.role, decode.role) == ("kv_producer", "kv_consumer")
    assert prefill.connector_settings == {vllm_facts.EXAMPLE_CONNECTOR_PATH_KEY: "/mnt/shared/kv-transfer"}
    assert [n["id"] for n in printed["doctor"]["notes"]] == ["pd-example-connector"]


def edit(command: str, flag: str, value: str | None) -> str:
    """``command`` with ``flag`` set to ``value`` (added when absent; removed, with its value, for None)."""
    words = shlex.split(command)
    if flag in words:
        i = words.index(flag)
        del words[i : i + 2]
    if value is not None:
        words += [flag, value]
    return shlex.join(words)


def json_edit(flag: str, command: str, **changes) -> str:
    """``command`` with those keys of its JSON ``flag`` changed."""
    words = shlex.split(command)
    return edit(command, flag, json.dumps({**json.loads(words[words.index(flag) + 1]), **changes}))


transfer, speculative = partial(json_edit, "--kv-transfer-config"), partial(json_edit, "--speculative-config")
example = partial(transfer, kv_connector="ExampleConnector")


def env(command: str, name: str, value: str) -> str:
    words = [w for w in shlex.split(command) if not w.startswith(f"{name}=")]
    return shlex.join([f"{name}={value}", *words])


P, D, BOTH = ("prefill",), ("decode",), ("prefill", "decode")
NOTES = {"pd-draft-steps-differ", "pd-nixl-side-channel", "pd-example-connector", "pd-mha-draft-cache"}
#: (engine, the sides changed, how, the check id expected): one case per check, and one per engine-specific way to
#: fail it
CASES = [
    ("vllm", P, lambda c, m: edit(c, "--speculative-config", None), "pd-prefill-without-draft"),
    ("vllm", D, lambda c, m: edit(c, "--speculative-config", None), "pd-decode-without-draft"),
    ("vllm", P, lambda c, m: speculative(c, model=m["draft-off"]), "pd-draft-differs"),
    ("sglang", P, lambda c, m: edit(c, "--speculative-num-steps", "2"), "pd-draft-differs"),
    ("vllm", P, lambda c, m: edit(c, "--kv-cache-dtype", "fp8"), "pd-kv-dtype-differs"),
    ("vllm", D, lambda c, m: transfer(c, kv_role="kv_producer"), "pd-roles"),
    ("sglang", P, lambda c, m: edit(c, "--disaggregation-mode", "decode"), "pd-roles"),
    ("vllm", BOTH, lambda c, m: transfer(c, kv_connector="P2pNcclConnector"), "pd-connector-unknown"),
    ("sglang", BOTH, lambda c, m: edit(c, "--disaggregation-transfer-backend", "fake"), "pd-connector-unknown"),
    ("vllm", P, lambda c, m: transfer(c, kv_connector="MooncakeConnector"), "pd-connector-mismatch"),
    ("vllm", P, lambda c, m: edit(c, "--model", m["deepseek"]), "pd-target-differs"),
    ("vllm", P, lambda c, m: edit(c, "--kv-transfer-config", None), "pd-not-disaggregated"),
    ("vllm", BOTH, lambda c, m: example(c), "pd-hybrid-target-connector"),
    ("vllm", P, lambda c, m: speculative(c, num_speculative_tokens=1), "pd-draft-steps-differ"),
    ("vllm", P, lambda c, m: env(c, "VLLM_NIXL_SIDE_CHANNEL_PORT", "5601"), "pd-nixl-side-channel"),
    ("vllm", BOTH, lambda c, m: edit(example(c), "--model", m["deepseek"]), "pd-example-connector"),
    ("vllm", BOTH, lambda c, m: speculative(c, model=m["mha"]), "pd-mha-draft-cache"),
    # the printed pair as it is (not on a DeepSeek target: test_a_not_hybrid_target_may_use_any_connector)
    ("vllm", (), lambda c, m: c, "pd-k3-speculation"),
]


def test_every_pd_check_has_a_case():
    pd_checks = {check for check in CHECKS if check.startswith("pd-")}
    assert pd_checks == {case[3] for case in CASES}, pd_checks ^ {case[3] for case in CASES}


def doctor(engine: str, prefill: str, decode: str, capsys) -> tuple[int, dict]:
    argv = ["doctor", "--engine", engine, "--with-plugin", "--json", *VERSIONS[engine]]
    code, out, err = run([*argv, "--prefill-command", prefill, "--decode-command", decode], capsys)
    assert code in (0, 1) and not err, err
    return code, json.loads(out)


@pytest.mark.parametrize("engine, sides, change, check", CASES, ids=[f"{c[0]}-{c[3]}" for c in CASES])
def test_doctor_names_each_trap_of_a_pair(engine, sides, change, check, models, capsys):
    good = lines(pair(engine, models, capsys))  # clean: test_the_pair_serve_command_prints_is_one_doctor_passes
    changed = [change(c, models) if side in sides else c for side, c in zip(("prefill", "decode"), good)]
    code, report = doctor(engine, *changed, capsys)
    assert check in [f["id"] for f in report["notes" if check in NOTES else "problems"]], report
    assert code == (1 if report["problems"] else 0)
    assert all(f["fix"] for f in report["problems"] + report["notes"])


def test_launch_commands_are_read_as_the_engines_read_them():
    line = (
        'FOO=1 python -m vllm.entrypoints.openai.api_server --model T --speculative_config=\'{"model": "D", '
        '"method": "eagle3", "num_speculative_tokens": 2}\' --kv-transfer-config '
        '\'{"kv_connector": "NixlConnector", "kv_role": "kv_both"}\' --kv_cache_dtype fp8 --port 9'
    )
    side = parse_launch("vllm", line)
    assert (side.target, side.draft, side.num_speculative_tokens, side.kv_cache_dtype) == ("T", "D", 2, "fp8")
    assert (side.connector, side.role, side.env) == ("NixlConnector", "kv_both", {"FOO": "1"})
    assert parse_launch("vllm", "vllm serve T").connector is None
    side = parse_launch("sglang", "python -m sglang.launch_server --model-path T --disaggregation-mode decode")
    assert (side.target, side.draft, side.role, side.connector) == ("T", None, "decode", "mooncake")


def test_where_the_engine_does_not_import_its_launch_line_gets_the_typed_checks_alone(monkeypatch):
    """As on a machine without vLLM: a field only vLLM's SpeculativeConfig knows to refuse passes (its own rules:
    tests/engines/test_engine_facts.py), the typed checks still refuse (tests/unit/test_bad_inputs.py's rows)."""
    monkeypatch.setattr(pd, "_own_parser", lambda engine: __import__("no_such_engine"))
    line = 'vllm serve T --speculative-config \'{"model": "D", "num_speculative_tokens": 3, "bogus": 1}\''
    assert parse_launch("vllm", line).num_speculative_tokens == 3


def test_doctor_pd_with_a_target_nowhere_is_one_line(capsys):
    """Its message holds huggingface_hub's words; the other misuses, exact: tests/unit/test_bad_inputs.py."""
    pair = "--prefill-command 'vllm serve nowhere/x' --decode-command 'vllm serve nowhere/x'"
    code, out, err = run(["doctor", "--engine", "vllm", *shlex.split(pair)], capsys)
    assert code == 2 and not out and len(err.strip().splitlines()) == 1 and "nowhere/x" in err, err
