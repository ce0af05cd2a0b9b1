"""PD-disaggregated serving without an engine: ``serve-command --pd`` prints a pair doctor passes, ``doctor
--prefill-command ... --decode-command ...`` names each trap of a pair by its id (every ``pd-*`` check has a case
here, built by changing one thing in a good pair), and bad uses are one line. The pair on a real engine:
tests/engines/test_vllm_pd.py."""

from __future__ import annotations

import json
import shlex

import pytest

from eagle31_mla.cli import main
from eagle31_mla.serving.doctor import CHECKS
from eagle31_mla.serving.engine_facts import vllm as vllm_facts
from eagle31_mla.serving.engines import InputError
from eagle31_mla.serving.pd import parse_launch
from tests.support.engine_configs import draft, kimi_k3_target, llama_target, write_config


def run(argv, capsys) -> tuple[int, str, str]:
    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """A Kimi-K3 target, the drafter for it, the same drafter one layer off, a Llama-style (MHA) EAGLE-3 draft,
    and a DeepSeek-style (not hybrid) stand-in target, as local folders."""
    root = tmp_path_factory.mktemp("pd-models")
    from tests.support.engine_configs import deepseek_target

    mha = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_size": 7168,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "vocab_size": 163840,
        "eagle_aux_hidden_state_layer_ids": [2, 46, 90],
        "aux_layer_ids_convention": "one_based",
    }
    return {
        "k3": str(write_config(root / "k3", kimi_k3_target())),
        "draft": str(write_config(root / "draft", draft())),
        "draft-off": str(write_config(root / "draft-off", draft(ids=[3, 47, 91]))),
        "mha": str(write_config(root / "mha", mha)),
        "deepseek": str(write_config(root / "deepseek", deepseek_target(layers=93))),
        "llama": str(write_config(root / "llama", llama_target(93))),
    }


VERSIONS = {"vllm": ["--engine-version", "0.32"], "sglang": ["--engine-version", "0.5.23"], "tokenspeed": []}


def pair(engine: str, models: dict, capsys, *extra: str, target: str = "k3") -> dict:
    argv = ["serve-command", "--engine", engine, "--pd", "--json", "--target", models[target]]
    code, out, err = run([*argv, "--draft", models["draft"], *VERSIONS[engine], *extra], capsys)
    assert code == 0, err
    return json.loads(out)


def lines(printed: dict) -> tuple[str, str]:
    sides = printed["pd"]
    return tuple(
        " ".join([*(f"{k}={v}" for k, v in sides[s]["env"].items()), shlex.join(sides[s]["argv"])])
        for s in ("prefill", "decode")
    )


# ---- serve-command --pd -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("engine", ["vllm", "sglang", "tokenspeed"])
def test_the_pair_serve_command_prints_is_one_doctor_passes(engine, models, capsys):
    printed = pair(engine, models, capsys)
    assert printed["doctor"]["ok"] and not printed["doctor"]["problems"]
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


def test_the_cli_offers_the_connectors_the_library_takes():
    """The CLI keeps its own list (importing eagle31_mla.serving.pd would load torch for --help): the same."""
    from eagle31_mla.cli.serve_command import CONNECTORS
    from eagle31_mla.serving.pd import PD_CONNECTORS

    assert {engine: tuple(c) for engine, c in CONNECTORS.items()} == PD_CONNECTORS


def test_the_text_form_lists_the_two_sides_and_the_router(models, capsys):
    code, out, err = run(
        ["serve-command", "--engine", "sglang", "--pd", "--target", models["k3"], "--draft", models["draft"]], capsys
    )
    assert code == 0, err
    assert out.index("# 1. prefill") < out.index("# 2. decode") < out.index("# 3. the router")
    assert out.count("--disaggregation-mode prefill") == 1 and out.count("--disaggregation-mode decode") == 1


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--engine", "vllm", "--connector", "nixl"], "argument --connector: applies to --pd only"),
        (["--engine", "vllm", "--pd", "--connector", "ascend"], "--connector ascend is not one of vLLM's"),
        (["--engine", "sglang", "--pd", "--connector", "example"], "--connector example is not one of SGLang's"),
        (["--engine", "vllm", "--pd", "--connector", "example"], "Kimi-K3 is a hybrid model"),
        (["--engine", "vllm", "--pd", "--connector", "lmcache"], "Kimi-K3 is a hybrid model"),
        (["--engine", "tokenspeed", "--pd", "--topk", "2", "--num-draft-tokens", "4"], "topk"),
    ],
)
def test_what_serve_command_pd_refuses(argv, message, capsys):
    code, out, err = run(["serve-command", *argv], capsys)
    assert code == 2 and not out and len(err.strip().splitlines()) == 1 and message in err, err


def test_a_not_hybrid_target_may_use_any_connector(models, capsys):
    printed = pair("vllm", models, capsys, "--connector", "example", target="deepseek")
    prefill, decode = (parse_launch("vllm", line) for line in lines(printed))
    assert (prefill.role, decode.role) == ("kv_producer", "kv_consumer")
    assert prefill.connector_settings == {vllm_facts.EXAMPLE_CONNECTOR_PATH_KEY: "/mnt/shared/kv-transfer"}
    assert [n["id"] for n in printed["doctor"]["notes"]] == ["pd-example-connector"]


# ---- doctor on a pair: one case per trap --------------------------------------------------------------------------


def edit(command: str, flag: str, value: str | None) -> str:
    """``command`` with ``flag`` set to ``value`` (added when absent; removed, with its value, for None)."""
    words = shlex.split(command)
    if flag in words:
        i = words.index(flag)
        del words[i : i + 2]
    if value is not None:
        words += [flag, value]
    return shlex.join(words)


def transfer(command: str, **changes) -> str:
    words = shlex.split(command)
    config = json.loads(words[words.index("--kv-transfer-config") + 1])
    config.update(changes)
    return edit(command, "--kv-transfer-config", json.dumps(config))


def speculative(command: str, **changes) -> str:
    words = shlex.split(command)
    config = json.loads(words[words.index("--speculative-config") + 1])
    config.update(changes)
    return edit(command, "--speculative-config", json.dumps(config))


def env(command: str, name: str, value: str) -> str:
    words = [w for w in shlex.split(command) if not w.startswith(f"{name}=")]
    return shlex.join([f"{name}={value}", *words])


#: (case, engine, how the (prefill, decode) pair is changed, the check id expected)
CASES = [
    (
        "vllm prefill without the drafter",
        "vllm",
        lambda p, d, m: (edit(p, "--speculative-config", None), d),
        "pd-prefill-without-draft",
    ),
    (
        "vllm decode without the drafter",
        "vllm",
        lambda p, d, m: (p, edit(d, "--speculative-config", None)),
        "pd-decode-without-draft",
    ),
    (
        "vllm another drafter checkpoint",
        "vllm",
        lambda p, d, m: (speculative(p, model=m["draft-off"]), d),
        "pd-draft-differs",
    ),
    ("vllm another revision", "vllm", lambda p, d, m: (speculative(p, revision="v2"), d), "pd-draft-differs"),
    (
        "vllm another kv cache dtype",
        "vllm",
        lambda p, d, m: (edit(p, "--kv-cache-dtype", "fp8"), d),
        "pd-kv-dtype-differs",
    ),
    ("vllm another dtype", "vllm", lambda p, d, m: (p, edit(d, "--dtype", "float16")), "pd-kv-dtype-differs"),
    ("vllm decode does not load", "vllm", lambda p, d, m: (p, transfer(d, kv_role="kv_producer")), "pd-roles"),
    ("vllm prefill does not save", "vllm", lambda p, d, m: (transfer(p, kv_role="kv_consumer"), d), "pd-roles"),
    (
        "vllm a connector vLLM lacks",
        "vllm",
        lambda p, d, m: (transfer(p, kv_connector="P2pNcclConnector"), transfer(d, kv_connector="P2pNcclConnector")),
        "pd-connector-unknown",
    ),
    (
        "vllm two connectors",
        "vllm",
        lambda p, d, m: (transfer(p, kv_connector="MooncakeConnector"), d),
        "pd-connector-mismatch",
    ),
    ("vllm another target", "vllm", lambda p, d, m: (edit(p, "--model", m["deepseek"]), d), "pd-target-differs"),
    (
        "vllm no transfer on prefill",
        "vllm",
        lambda p, d, m: (edit(p, "--kv-transfer-config", None), d),
        "pd-not-disaggregated",
    ),
    (
        "vllm hybrid target, ExampleConnector",
        "vllm",
        lambda p, d, m: tuple(transfer(x, kv_connector="ExampleConnector") for x in (p, d)),
        "pd-hybrid-target-connector",
    ),
    (
        "vllm other step counts",
        "vllm",
        lambda p, d, m: (speculative(p, num_speculative_tokens=1), d),
        "pd-draft-steps-differ",
    ),
    (
        "vllm one side-channel port",
        "vllm",
        lambda p, d, m: (env(p, "VLLM_NIXL_SIDE_CHANNEL_PORT", "5601"), d),
        "pd-nixl-side-channel",
    ),
    (
        "vllm ExampleConnector on a DeepSeek target",
        "vllm",
        lambda p, d, m: tuple(
            edit(transfer(x, kv_connector="ExampleConnector"), "--model", m["deepseek"]) for x in (p, d)
        ),
        "pd-example-connector",
    ),
    (
        "vllm an MHA drafter",
        "vllm",
        lambda p, d, m: tuple(speculative(x, model=m["mha"]) for x in (p, d)),
        "pd-mha-draft-cache",
    ),
    (
        "sglang prefill without the drafter",
        "sglang",
        lambda p, d, m: (edit(edit(p, "--speculative-algorithm", None), "--speculative-draft-model-path", None), d),
        "pd-prefill-without-draft",
    ),
    (
        "sglang the fake backend",
        "sglang",
        lambda p, d, m: tuple(edit(x, "--disaggregation-transfer-backend", "fake") for x in (p, d)),
        "pd-connector-unknown",
    ),
    ("sglang both decode", "sglang", lambda p, d, m: (edit(p, "--disaggregation-mode", "decode"), d), "pd-roles"),
    (
        "sglang other step counts",
        "sglang",
        lambda p, d, m: (edit(p, "--speculative-num-steps", "2"), d),
        "pd-draft-differs",
    ),
    (
        "sglang two backends",
        "sglang",
        lambda p, d, m: (edit(p, "--disaggregation-transfer-backend", "nixl"), d),
        "pd-connector-mismatch",
    ),
]


def test_every_pd_check_has_a_case():
    pd_checks = {check for check in CHECKS if check.startswith("pd-")}
    assert pd_checks == {case[3] for case in CASES}, pd_checks ^ {case[3] for case in CASES}


def doctor(engine: str, prefill: str, decode: str, capsys) -> tuple[int, dict]:
    argv = [
        "doctor",
        "--engine",
        engine,
        "--with-plugin",
        "--json",
        "--prefill-command",
        prefill,
        "--decode-command",
        decode,
    ]
    argv += VERSIONS[engine]
    code, out, err = run(argv, capsys)
    assert code in (0, 1) and not err, err
    return code, json.loads(out)


@pytest.mark.parametrize("case, engine, change, check", CASES, ids=[c[0] for c in CASES])
def test_doctor_names_each_trap_of_a_pair(case, engine, change, check, models, capsys):
    good = lines(pair(engine, models, capsys))
    assert doctor(engine, *good, capsys)[0] == 0
    prefill, decode = change(*good, models)
    code, report = doctor(engine, prefill, decode, capsys)
    found = [f["id"] for f in report["problems"] + report["notes"]]
    assert check in found, (found, report)
    severity = (
        "notes"
        if check in ("pd-draft-steps-differ", "pd-nixl-side-channel", "pd-example-connector", "pd-mha-draft-cache")
        else "problems"
    )
    assert check in [f["id"] for f in report[severity]]
    assert code == (1 if report["problems"] else 0)
    assert all(f["fix"] for f in report["problems"] + report["notes"])


# ---- reading launch commands, and misuse ---------------------------------------------------------------------------


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
    for engine, bad, message in [
        ("vllm", "sglang serve --model-path T", "expected vLLM's launch command"),
        ("vllm", "vllm serve T --speculative-config '{not json'", "--speculative-config is not JSON"),
        ("vllm", "vllm serve T --kv-transfer-config '[1]'", "must be a JSON object"),
        ("sglang", "sglang serve 'unbalanced", "not a shell command line"),
    ]:
        with pytest.raises(InputError, match=message):
            parse_launch(engine, bad)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--engine", "vllm", "--prefill-command", "vllm serve T"], "a PD pair needs --decode-command"),
        (["--prefill-command", "vllm serve T", "--decode-command", "vllm serve T"], "a PD pair needs --engine"),
        (
            [
                "--engine",
                "vllm",
                "--draft",
                "{draft}",
                "--prefill-command",
                "vllm serve T",
                "--decode-command",
                "vllm serve T",
            ],
            "argument --draft: a PD pair takes it from",
        ),
        (
            ["--engine", "sglang", "--prefill-command", "vllm serve T", "--decode-command", "vllm serve T"],
            "argument --prefill-command: expected SGLang's launch command",
        ),
        (
            [
                "--engine",
                "vllm",
                "--prefill-command",
                "vllm serve nowhere/x",
                "--decode-command",
                "vllm serve nowhere/x",
            ],
            "nowhere/x",
        ),
    ],
)
def test_doctor_pd_misuse_is_one_line(argv, message, models, capsys):
    code, out, err = run(["doctor", *(a.format(draft=models["draft"]) for a in argv)], capsys)
    assert code == 2 and not out and len(err.strip().splitlines()) == 1 and message in err, err
