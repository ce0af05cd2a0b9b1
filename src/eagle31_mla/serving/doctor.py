"""``eagle31-mla doctor``: every silent misconfiguration of a draft + target + engine (SPEC §4).

Each check compares what the engine will actually do, worked out from the two ``config.json`` files
and the engine's facts (:mod:`eagle31_mla.serving.engine_facts`, applied by :mod:`eagle31_mla.serving.engines`), with
what the drafter needs: its aux layers as this library reads them (:mod:`eagle31_mla.model.aux_layers`), its
EAGLE-3.1 switches, its sizes. The rules the plugins also enforce at serve time are
:mod:`eagle31_mla.serving.compatibility`'s, in the same words. Nothing here needs weights or an installed engine.

A :class:`Finding` has a short id (the catalogue is :data:`CHECKS`), the problem in one line and the
exact fix. By default the engine is checked as it ships; ``with_plugin=True`` assumes this project's
plugin for that engine is installed where it runs, and moves what the plugin corrects at serve time
out of the problems (into ``handled``). Engine versions: one, or every release the tables know.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from ..model.aux_layers import (
    IDS_KEY,
    AuxLayerIdError,
    AuxLayerIds,
    aux_layer_ids_config_entries,
    aux_layer_ids_from_config,
)
from ..model.configuration_eagle31_mla import ENGINE_ARCHITECTURE, ConfigError, Eagle31MLAConfig
from ..prompts import eos_token_ids
from . import compatibility
from .engine_facts import (
    ENGINE_NAMES,
    ENGINES,
    ONE_BASED,
    PLUGIN_INSTALL,
    captures_layer_input,
    release_label,
    sglang as sglang_facts,
    tokenspeed as tokenspeed_facts,
    vllm as vllm_facts,
)
from .engine_facts.vllm import KIMI_K3_STREAM_ENV
from .engines import (
    DEFAULT,
    FLAG,
    NESTED,
    TARGET_LAYER_IDS,
    Target,
    _int,
    sglang_capture,
    sglang_nested_form,
    tokenspeed_capture,
    tokenspeed_flag_form,
    vllm_capture,
)

__all__ = ["CHECKS", "Finding", "Report", "diagnose", "engine_releases", "KIMI_K3_STREAM_ENV"]

PROBLEM, NOTE = "problem", "note"
VLLM_PLUGIN = f"{PLUGIN_INSTALL['vllm']} where vLLM runs (its plugin"
SGLANG_PLUGIN = f"{PLUGIN_INSTALL['sglang']} where SGLang runs (its plugin"
TOKENSPEED_PLUGIN = f"{PLUGIN_INSTALL['tokenspeed']} where TokenSpeed runs (its plugin"

#: Every check: id -> what it catches. Ids are stable: scripts may match on them.
CHECKS: dict[str, str] = {
    "aux-ids-missing": "the draft names no aux layers: every engine silently captures its own default",
    "aux-ids-contradictory": "top-level and nested aux ids name different layers",
    "aux-ids-invalid": "aux ids that no engine can capture right (0, duplicates, not ascending, not ints)",
    "target-layer-ids": "a top-level `target_layer_ids`: vLLM's V2 runner adds 1 to it, the others ignore it",
    "aux-ids-beyond-target": (
        "aux ids beyond the target's depth (or its last layer, which before-layer capture cannot reach)"
    ),
    "draft-config-invalid": "a draft config.json this library refuses (the message names the key)",
    "target-depth-unknown": (
        "the target's config.json has no readable num_hidden_layers: which layers any engine captures cannot be checked"
    ),
    "target-config-unreadable": (
        "a target config.json field the checks read holds the wrong type (architectures as a string or empty, ...)"
    ),
    "target-sizes-unknown": (
        "the target's config.json has no readable hidden_size or vocab_size: the draft cannot be checked against them"
    ),
    "mla-architecture-name": (
        "a draft architecture name the engine does not serve as the MLA drafter (MHA cache or wrong class)"
    ),
    "vocab-size-mismatch": "draft and target vocabularies differ",
    "hidden-size-mismatch": "the draft's target_hidden_size is not the target's hidden size",
    "target-depth-mismatch": "the draft's recorded target_num_hidden_layers is not the target's depth",
    "bos-eos-mismatch": "draft and target disagree on bos/eos token ids",
    "vllm-ids-convention": "vLLM reads the draft's ids in the other convention: one layer off",
    "vllm-nested-ids-ignored": "vLLM 0.20/0.21 ignore nested eagle_config ids: the target's default is captured",
    "vllm-v2-runner-nested-ids": (
        "vLLM's V2 model runner ignores nested eagle_config ids: the target's default is captured"
    ),
    "vllm-draft-model-type": (
        "a draft model_type vLLM turns into an MTP draft (deepseek_v3) or does not detect as MLA (kimi_k2)"
    ),
    "vllm-fc-norm-ignored": "vLLM before 0.23 does not apply EAGLE-3.1's fc_norm (0.22.x builds it, never applies it)",
    "vllm-norm-output-ignored": "vLLM before 0.22 does not apply EAGLE-3.1's norm_output",
    "vllm-fc-width": "vLLM before 0.22 sizes fc for exactly 3 aux states",
    "vllm-kimi-k3-version": "Kimi-K3 targets need vLLM 0.27+",
    "vllm-version-unsupported": "a vLLM release outside 0.20-0.33 (the range the facts cover)",
    "k3-aux-stream": (
        "VLLM_KIMI_K3_AUX_ATTN_RES_STREAM selects the AttnRes mixture, not the prefix stream the drafter was trained on"
    ),
    "sglang-nested-ids-missing": (
        "SGLang reads only nested eagle_config ids: top-level ids are ignored, the target's default is captured"
    ),
    "sglang-first-id-heuristic": (
        "SGLang's DeepSeek/Kimi-K2.x targets add 1 only when the first id is 1: these ids go the wrong way"
    ),
    "sglang-ids-convention": "the SGLang target class reads the nested ids in the other convention",
    "sglang-k3-no-capture": "SGLang 0.5.23 has no EAGLE-3 capture for Kimi-K3 targets",
    "sglang-k3-capture-unconfirmed": "this SGLang release's Kimi-K3 EAGLE-3 capture is not confirmed",
    "sglang-unknown-target": "a target class whose SGLang id rule is not in the table",
    "sglang-version-unsupported": "an SGLang release before 0.5.23",
    "tokenspeed-ids-ignored": "TokenSpeed finds no ids where it looks: the target's default is captured",
    "tokenspeed-ids-convention": "TokenSpeed passes the ids raw and the target reads them in the other convention",
    "tokenspeed-unknown-target": "a target class whose TokenSpeed id rule is not in the table",
    # a PD-disaggregated pair (doctor --prefill-command ... --decode-command ...; eagle31_mla.serving.pd)
    "pd-not-disaggregated": "a side of a PD pair without a KV connector (vLLM) or disaggregation mode: it moves no KV",
    "pd-roles": "a prefill side that does not save KV, or a decode side that does not load it",
    "pd-connector-unknown": "a connector or transfer backend the engine does not have (or refuses on a prefill side)",
    "pd-connector-mismatch": "the two sides transfer through different connectors or settings",
    "pd-target-differs": "the two sides serve different targets",
    "pd-prefill-without-draft": (
        "the decode side speculates, the prefill side has no drafter: vLLM fails at the first request, SGLang's "
        "drafter reads KV nobody wrote"
    ),
    "pd-decode-without-draft": "the prefill side has a drafter, the decode side none: no speculative decoding",
    "pd-draft-differs": "the sides run different drafters (checkpoint, revision, method, dtype, aux ids)",
    "pd-kv-dtype-differs": "the sides' KV cache dtypes differ: the decode side reads the transferred KV otherwise",
    "pd-draft-steps-differ": "the sides' num_speculative_tokens differ (harmless: a note)",
    "pd-nixl-side-channel": "both sides on one NixlConnector side-channel port (a note)",
    "pd-hybrid-target-connector": (
        "a Kimi-K3 (hybrid) target on vLLM with a connector that cannot move a hybrid cache: no start"
    ),
    "pd-example-connector": "vLLM's ExampleConnector is a test connector (a note)",
    "pd-mha-draft-cache": "an MHA drafter beside an MLA target: another cache spec, and what it costs (a note)",
}


@dataclass(frozen=True)
class Finding:
    id: str
    problem: str
    fix: str
    severity: str = PROBLEM
    #: this project's plugin for the engine corrects it at serve time
    plugin_fixes: bool = False
    #: engine releases it applies to (empty: all that were checked)
    versions: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "severity": self.severity,
            "problem": self.problem,
            "fix": self.fix,
            "plugin_fixes": self.plugin_fixes,
            "versions": list(self.versions),
        }


@dataclass
class Report:
    engine: str
    versions: tuple[str, ...]
    with_plugin: bool
    draft: str
    target: str
    aux_layer_ids: AuxLayerIds | None
    aux_layer_ids_how: str
    findings: list[Finding] = field(default_factory=list)
    #: what else was checked, a line each (a PD pair's two sides)
    details: list[str] = field(default_factory=list)

    @property
    def problems(self) -> list[Finding]:
        return [f for f in self.findings if f.severity == PROBLEM and not (self.with_plugin and f.plugin_fixes)]

    @property
    def handled(self) -> list[Finding]:
        return [f for f in self.findings if f.severity == PROBLEM and self.with_plugin and f.plugin_fixes]

    @property
    def notes(self) -> list[Finding]:
        return [f for f in self.findings if f.severity == NOTE and not (self.with_plugin and f.plugin_fixes)]

    @property
    def ok(self) -> bool:
        return not self.problems

    def to_dict(self) -> dict[str, Any]:
        ids = self.aux_layer_ids
        return {
            "ok": self.ok,
            "engine": self.engine,
            "versions": list(self.versions),
            "with_plugin": self.with_plugin,
            "draft": self.draft,
            "target": self.target,
            "aux_layer_ids": None
            if ids is None
            else {"one_based": list(ids.one_based), "zero_based": list(ids.zero_based), "how": self.aux_layer_ids_how},
            "problems": [f.to_dict() for f in self.problems],
            "handled_by_plugin": [f.to_dict() for f in self.handled],
            "notes": [f.to_dict() for f in self.notes],
            "details": list(self.details),
        }

    def format(self) -> str:
        name = ENGINE_NAMES[self.engine]
        lines = [
            f"doctor: {self.draft} on {self.target}, {name} {_runs(self.versions, self.versions)}"
            + (" with the eagle31-mla plugin" if self.with_plugin else "")
        ]
        lines += [f"  {line}" for line in self.details]
        if self.aux_layer_ids is not None:
            lines.append(f"  aux layers wanted: {self.aux_layer_ids.describe()} ({self.aux_layer_ids_how})")
        for title, items in (("problem", self.problems), ("handled by the plugin", self.handled), ("note", self.notes)):
            for f in items:
                where = f" ({name} {_runs(f.versions, self.versions)})" if f.versions else ""
                lines.append(f"  {title} [{f.id}]{where}: {f.problem}")
                lines.append(f"    fix: {f.fix}")
        if self.ok:
            lines.append("  ok: nothing is wrong" + (f" ({len(self.notes)} note(s))" if self.notes else ""))
        else:
            lines.append(f"  {len(self.problems)} problem(s)")
        return "\n".join(lines)


def _runs(versions: Sequence[str], checked: Sequence[str]) -> str:
    """ "0.20-0.22, 0.25": the runs of ``versions`` within the ``checked`` releases, in order."""
    runs, current = [], []
    for v in checked:
        if v in versions:
            current.append(v)
        elif current:
            runs.append(current)
            current = []
    if current:
        runs.append(current)
    return ", ".join(r[0] if len(r) == 1 else f"{r[0]}-{r[-1]}" for r in runs)


# ---- engine releases ---------------------------------------------------------------------------------


def engine_releases(engine: str, version: str | None = None) -> list[tuple[str, Any]]:
    """(label, feature table) for the named release, or for every release the engine's table knows."""
    if engine == "vllm":
        versions = [vllm_facts.parse_version(version)] if version else list(vllm_facts.RELEASES)
        return [(_label(v, version), vllm_facts.features(v)) for v in versions]
    if engine == "sglang":
        versions = [sglang_facts.parse_version(version)] if version else list(sglang_facts.RELEASES)
        return [(_label(v, version, minor_only=False), sglang_facts.features(v)) for v in versions]
    if engine == "tokenspeed":
        return [(version or release_label(tokenspeed_facts.RELEASES[-1]), None)]
    raise ValueError(f"unknown engine {engine!r}; expected one of {ENGINES}")


def _label(v: tuple[int, int, int], given: str | None, minor_only: bool = True) -> str:
    if given:
        return given
    return release_label(v[:2] if minor_only else v)


# ---- the checks ----------------------------------------------------------------------------------------


def _canonical_fix(draft: str, ids: AuxLayerIds) -> str:
    entries = json.dumps(aux_layer_ids_config_entries(ids))[1:-1]
    return (
        f"in {draft}'s config.json set {entries} (what `eagle31-mla convert` writes: right for vLLM, "
        "SGLang's DeepSeek/Kimi targets and TokenSpeed's Kimi-K3 target at once)"
    )


def _read_ids(draft: Mapping[str, Any], add, draft_name: str) -> tuple[AuxLayerIds | None, str, str | None]:
    try:
        ids, how = aux_layer_ids_from_config(draft)
        return ids, how, None
    except AuxLayerIdError as err:
        message = str(err)
    has_top = draft.get(IDS_KEY) is not None
    nested = draft.get("eagle_config")
    has_nested = isinstance(nested, Mapping) and nested.get(IDS_KEY) is not None
    if not has_top and not has_nested and "target_layer_ids" in draft:
        add(
            Finding(
                "target-layer-ids",
                message,
                f"in {draft_name}'s config.json replace `target_layer_ids` by "
                f'"{IDS_KEY}" with "aux_layer_ids_convention" ("one_based" or "zero_based", whichever it is)',
            )
        )
    elif not has_top and not has_nested:
        add(
            Finding(
                "aux-ids-missing",
                message,
                f'in {draft_name}\'s config.json set "{IDS_KEY}" (one-based, e.g. '
                'Kimi-K3: [2, 46, 90]) with "aux_layer_ids_convention": "one_based", at the top level and in '
                '"eagle_config": the layers the drafter was trained on, from its training config',
            )
        )
    elif "contradictory" in message:
        add(
            Finding(
                "aux-ids-contradictory",
                message,
                f"in {draft_name}'s config.json keep the ids the drafter was "
                "trained on (its training config says which), in one convention, labelled",
            )
        )
    else:
        add(
            Finding(
                "aux-ids-invalid",
                message,
                f"in {draft_name}'s config.json list the trained layers once each, "
                "ascending, one-based >= 1 (zero-based >= 0), labelled with aux_layer_ids_convention",
            )
        )
    return None, "", message


@dataclass(frozen=True)
class _Draft:
    """The draft facts the checks use: from Eagle31MLAConfig when it reads the file, else the raw dict
    with the meaning of a missing key in files."""

    architectures: tuple[str, ...]
    model_type: str | None
    vocab_size: int | None
    target_hidden_size: int | None
    target_num_hidden_layers: int | None
    fc_norm: bool
    norm_output: bool
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]


def _read_draft(draft: Mapping[str, Any], add, draft_name: str, ids_error: str | None) -> _Draft:
    raw = dict(draft)
    try:
        config = Eagle31MLAConfig.from_dict(raw)
    except (ConfigError, ValueError, TypeError, KeyError) as err:
        config = None
        if ids_error is None or ids_error not in str(err):
            add(
                Finding(
                    "draft-config-invalid",
                    f"{draft_name}'s config.json is refused: {err}",
                    f"correct that key in {draft_name}'s config.json",
                )
            )
    source = config.to_dict() if config is not None else raw
    eos = source.get("eos_token_id")
    hidden = source.get("hidden_size")
    return _Draft(
        architectures=tuple(a for a in (raw.get("architectures") or []) if isinstance(a, str)),
        model_type=raw.get("model_type"),
        vocab_size=source.get("vocab_size"),
        target_hidden_size=source.get("target_hidden_size") or hidden,
        target_num_hidden_layers=_int(source.get("target_num_hidden_layers")),
        fc_norm=bool(source.get("fc_norm", False)),
        norm_output=bool(source.get("norm_output", False)),
        bos_token_id=source.get("bos_token_id"),
        eos_token_ids=eos_token_ids(eos),
    )


def diagnose(
    draft: Mapping[str, Any],
    target: Target,
    engine: str,
    version: str | None = None,
    *,
    environ: Mapping[str, str] | None = None,
    with_plugin: bool = False,
    layers_to_capture: Sequence[int] | None = None,
    draft_name: str = "the draft",
) -> Report:
    """Check a draft ``config.json`` dict against a target and an engine (one release, or all known).

    ``environ``: the serving environment (default: this process's); ``layers_to_capture``: the
    TokenSpeed ``--eagle3-layers-to-capture`` value that will be passed, if any."""
    if engine not in ENGINES:
        raise ValueError(f"unknown engine {engine!r}; expected one of {ENGINES}")
    environ = os.environ if environ is None else environ
    releases = engine_releases(engine, version)
    # a size that is not a positive integer is as unreadable as a missing one (reported by _check_target)
    target = replace(
        target,
        **{
            key: None
            for key in ("num_layers", "hidden_size", "vocab_size")
            if getattr(target, key) is not None and getattr(target, key) < 1
        },
    )
    findings: list[Finding] = []
    add = findings.append
    ids, how, ids_error = _read_ids(draft, add, draft_name)
    facts = _read_draft(draft, add, draft_name, ids_error)
    _check_target(target, add)
    _check_common(facts, ids, target, engine, add, draft_name)

    per_version: dict[str, Finding] = {}
    labels = [label for label, _ in releases]
    for label, table in releases:
        found: list[Finding] = []
        if engine == "vllm":
            _check_vllm(draft, facts, ids, target, table, environ, found.append, draft_name)
        elif engine == "sglang":
            _check_sglang(draft, ids, target, table, found.append, draft_name)
        else:
            _check_tokenspeed(draft, ids, target, layers_to_capture, found.append, draft_name)
        for f in found:
            if f.id in per_version:
                merged = per_version[f.id]
                per_version[f.id] = Finding(
                    merged.id,
                    merged.problem,
                    merged.fix,
                    merged.severity,
                    merged.plugin_fixes,
                    merged.versions + (label,),
                )
            else:
                per_version[f.id] = Finding(f.id, f.problem, f.fix, f.severity, f.plugin_fixes, (label,))
    for f in per_version.values():  # releases are named only when not all checked ones are affected
        findings.append(
            Finding(
                f.id, f.problem, f.fix, f.severity, f.plugin_fixes, () if set(f.versions) == set(labels) else f.versions
            )
        )
    return Report(engine, tuple(labels), with_plugin, draft_name, target.describe(), ids, how, findings)


def _check_target(target: Target, add) -> None:
    """What the other checks need from the target's config.json: missing, they would pass by default."""
    where = "the target's config.json (or its text_config)"
    for key, expected in target.unreadable:
        add(
            Finding(
                "target-config-unreadable",
                f"{where} for {target.name} has an unreadable {key!r}: expected {expected}; "
                "the checks that depend on it (which model class the engine builds, how it reads aux ids) cannot "
                "run",
                f"point --target at the target model itself; if that is what it is, correct {key!r} in {where}"
                + (' (e.g. "architectures": ["DeepseekV3ForCausalLM"])' if key == "architectures" else ""),
            )
        )
    if target.num_layers is None:
        add(
            Finding(
                "target-depth-unknown",
                f"{where} for {target.name} has no num_hidden_layers that is a positive "
                "integer: which layers the engine captures, and whether the draft's aux ids exist in this target, "
                "cannot be checked",
                f"point --target at the target model itself (its folder, config.json or Hub "
                f'id); if that is what it is, set "num_hidden_layers" in {where} to its layer count (Kimi-K3: 93)',
            )
        )
    missing = [
        key for key, value in (("hidden_size", target.hidden_size), ("vocab_size", target.vocab_size)) if value is None
    ]
    if missing:
        add(
            Finding(
                "target-sizes-unknown",
                f"{where} for {target.name} has no {' or '.join(missing)} that is a positive "
                "integer: the draft's target_hidden_size and vocabulary cannot be checked against it",
                f"point --target at the target model itself; if that is what it is, set {', '.join(missing)} in "
                f"{where}",
            )
        )


def _check_common(d: _Draft, ids: AuxLayerIds | None, target: Target, engine: str, add, draft_name: str) -> None:
    arch = d.architectures[0] if d.architectures else None
    if arch != ENGINE_ARCHITECTURE:
        consequence = {
            "vllm": "vLLM serves this drafter family only under that name (its MLA EAGLE-3 class, which the "
            "eagle31-mla plugin takes over); another name is a different model class or none",
            "sglang": "SGLang picks the KV-cache layout from a fixed list of names: any other name silently gets an "
            "MHA-shaped cache, or the wrong model class",
            "tokenspeed": f"TokenSpeed's MLA list holds {ENGINE_ARCHITECTURE}: any other name silently resolves to MHA",
        }[engine]
        add(
            Finding(
                "mla-architecture-name",
                f"the draft's architectures[0] is {arch!r}, not {ENGINE_ARCHITECTURE!r}: {consequence}",
                f'in {draft_name}\'s config.json set "architectures": ["{ENGINE_ARCHITECTURE}"]',
            )
        )
    if ids is not None and target.num_layers is not None and max(ids.one_based) > target.num_layers:
        add(
            Finding(
                "aux-ids-beyond-target",
                f"aux layers {ids.describe()} go beyond {target.name}'s {target.num_layers} "
                f"layers (one-based ids must be <= {target.num_layers}): the drafter was trained on a deeper target",
                f"serve it with the target it was trained for, or correct the ids in {draft_name}'s config.json",
            )
        )
    built_for = compatibility.Sizes(d.target_hidden_size, d.vocab_size, d.target_num_hidden_layers)
    sizes = compatibility.Sizes(target.hidden_size, target.vocab_size, target.num_layers)
    for mismatch in compatibility.size_mismatches(built_for, sizes, target.name):
        add(_finding(mismatch))
    wrong = []
    if d.bos_token_id is not None and target.bos_token_id is not None and d.bos_token_id != target.bos_token_id:
        wrong.append(f"bos {d.bos_token_id} vs {target.bos_token_id}")
    if d.eos_token_ids and target.eos_token_ids and not set(d.eos_token_ids) <= set(target.eos_token_ids):
        wrong.append(f"eos {list(d.eos_token_ids)} vs {list(target.eos_token_ids)}")
    if wrong:
        fix = {
            "bos_token_id": target.bos_token_id,
            "eos_token_id": list(target.eos_token_ids)
            if len(target.eos_token_ids) > 1
            else (target.eos_token_ids[0] if target.eos_token_ids else None),
        }
        fix = {k: v for k, v in fix.items() if v is not None}
        add(
            Finding(
                "bos-eos-mismatch",
                f"draft and target disagree on special tokens ({'; '.join(wrong)}): a drafter "
                "for another tokenizer, or a config.json with the wrong ids",
                f"check the drafter was trained for {target.name}; then in {draft_name}'s config.json set "
                f"{json.dumps(fix)[1:-1]}",
            )
        )


def _finding(rule: compatibility.Incompatibility) -> Finding:
    return Finding(rule.id, rule.problem, rule.fix)


def _ids_fix_vllm(draft_name: str, ids: AuxLayerIds) -> str:
    return _canonical_fix(draft_name, ids) + f"; or {VLLM_PLUGIN} writes them explicitly for vLLM)"


def _check_vllm(draft, d: _Draft, ids, target: Target, engine, environ, add, draft_name: str) -> None:
    if not engine.supported:
        add(
            Finding(
                "vllm-version-unsupported",
                f"{engine.describe()} is outside 0.20-0.33, the releases whose facts "
                "these checks (and the eagle31-mla plugin) cover",
                "use vLLM 0.20-0.33 (Kimi-K3 targets: 0.27+)",
                severity=NOTE,
            )
        )
    if rule := compatibility.vllm_kimi_k3_version(engine, target.is_kimi_k3):
        add(_finding(rule))
    if d.model_type in vllm_facts.MTP_DRAFT_MODEL_TYPES:
        add(
            Finding(
                "vllm-draft-model-type",
                f"the draft's model_type is {d.model_type!r}: vLLM's draft-config hook turns "
                "it into a DeepSeek MTP draft (architectures DeepSeekMTPModel), not this EAGLE-3 drafter",
                f'in {draft_name}\'s config.json set "model_type": "kimi_k2"; or {VLLM_PLUGIN} serves it as '
                "deepseek_v2)",
                plugin_fixes=True,
            )
        )
    elif d.model_type not in vllm_facts.MLA_DRAFT_MODEL_TYPES:
        add(
            Finding(
                "vllm-draft-model-type",
                f"the draft's model_type is {d.model_type!r}: vLLM reports use_mla=False for "
                "it (its EAGLE-3 layer still builds MLA attention; this matters where the draft cache is sized from "
                "that flag: CPU, Ascend)",
                f"{VLLM_PLUGIN} serves it as deepseek_v2)",
                severity=NOTE,
                plugin_fixes=True,
            )
        )
    if d.fc_norm and not engine.applies_fc_norm:
        add(
            Finding(
                "vllm-fc-norm-ignored",
                "the draft is EAGLE-3.1 (fc_norm: true), and vLLM before 0.23 does not apply "
                "fc_norm (0.22.x builds it and never applies it; 0.20/0.21 drop its weights): the captured states "
                "reach fc un-normalised and acceptance drops, with no error",
                f"use vLLM >= 0.23; or {VLLM_PLUGIN} applies fc_norm)",
                plugin_fixes=True,
            )
        )
    if d.norm_output and not engine.applies_norm_output:
        add(
            Finding(
                "vllm-norm-output-ignored",
                "the draft is EAGLE-3.1 (norm_output: true), and vLLM before 0.22 feeds the "
                "next draft step the pre-norm state",
                f"use vLLM >= 0.22; or {VLLM_PLUGIN} applies norm_output)",
                plugin_fixes=True,
            )
        )
    if ids is not None and (rule := compatibility.vllm_fc_width(engine, len(ids))):
        add(_finding(rule))
    if rule := compatibility.vllm_kimi_k3_stream(engine, target.is_kimi_k3, environ):
        add(_finding(rule))
    if ids is None or target.num_layers is None:
        return
    has_nested = isinstance(draft.get("eagle_config"), Mapping) and draft["eagle_config"].get(IDS_KEY) is not None
    for runner in ("v1", "v2") if engine.v2_model_runner else ("v1",):
        capture = vllm_capture(draft, target, engine, runner)
        runner_name = "V1" if runner == "v1" else "V2"
        got = f"captures one-based {list(capture.layers or ())}"
        if capture.layers == ids.one_based:
            if capture.source == DEFAULT and has_nested and runner == "v2":
                add(
                    Finding(
                        "vllm-v2-runner-nested-ids",
                        "vLLM's V2 model runner ignores nested eagle_config ids; it "
                        f"captures the target's default, which happens to be {list(ids.one_based)}",
                        _ids_fix_vllm(draft_name, ids),
                        severity=NOTE,
                        plugin_fixes=True,
                    )
                )
            continue
        wanted = f"the drafter needs {ids.describe()}"
        if capture.source == TARGET_LAYER_IDS:
            add(
                Finding(
                    "target-layer-ids",
                    f"vLLM's V2 model runner reads the top-level target_layer_ids plus 1 and {got}; {wanted}",
                    _ids_fix_vllm(draft_name, ids) + "; and delete target_layer_ids",
                    plugin_fixes=True,
                )
            )
        elif capture.source == DEFAULT:
            if runner == "v1":
                add(
                    Finding(
                        "vllm-nested-ids-ignored",
                        f"vLLM 0.20/0.21 read only top-level ids, so the target {got} (its default); {wanted}",
                        _ids_fix_vllm(draft_name, ids),
                        plugin_fixes=True,
                    )
                )
            else:
                add(
                    Finding(
                        "vllm-v2-runner-nested-ids",
                        "vLLM's V2 model runner (opt-in with VLLM_USE_V2_MODEL_RUNNER=1, "
                        "the default for Kimi-K3 targets from 0.27 and for every model with Triton from 0.29) ignores "
                        f"nested eagle_config ids, so the target {got} (its default); {wanted}",
                        _ids_fix_vllm(draft_name, ids),
                        plugin_fixes=True,
                    )
                )
        else:
            where = "the top-level ids" if capture.source != NESTED else "the nested eagle_config ids"
            add(
                Finding(
                    "vllm-ids-convention",
                    f"vLLM's {runner_name} runner reads {where} one-based and {got}; {wanted} "
                    + (
                        "(id 0 names no layer: a DeepSeek or Kimi target fails at its first request)"
                        if capture.layers and 0 in capture.layers
                        else "(off by one: nothing fails, acceptance drops)"
                    ),
                    _ids_fix_vllm(draft_name, ids),
                    plugin_fixes=True,
                )
            )


def _check_sglang(draft, ids, target: Target, engine, add, draft_name: str) -> None:
    if not engine.supported:
        add(
            Finding(
                "sglang-version-unsupported",
                f"{engine.describe()} is older than 0.5.23, the release these facts and "
                "the eagle31-mla SGLang plugin are written for",
                "use SGLang >= 0.5.23",
                severity=NOTE,
            )
        )
    reading = sglang_facts.target_reading(target.architectures)
    if reading == ONE_BASED and engine.kimi_k3_eagle3_capture is False:
        add(
            Finding(
                "sglang-k3-no-capture",
                f"{engine.describe()}'s Kimi-K3 target classes have no EAGLE-3 capture "
                "(set_eagle3_layers_to_capture): EAGLE-3 cannot start",
                f"{SGLANG_PLUGIN} adds the prefix-stream "
                "capture to SGLang's Kimi-K3 classes); or use an SGLang release with Kimi-K3 EAGLE-3 capture",
                plugin_fixes=True,
            )
        )
        return
    if reading == ONE_BASED and engine.kimi_k3_eagle3_capture is None:
        add(
            Finding(
                "sglang-k3-capture-unconfirmed",
                f"whether {engine.describe()} ships Kimi-K3 EAGLE-3 capture is not "
                "confirmed (upstream main has it, one-based ids, prefix stream)",
                f"{SGLANG_PLUGIN} adds it when missing and leaves SGLang's own alone)",
                severity=NOTE,
            )
        )
    if reading is None:
        add(
            Finding(
                "sglang-unknown-target",
                f"how SGLang's {target.architectures[:1] or target.model_type} reads aux ids "
                "is not in the table, so the capture cannot be checked",
                f"{SGLANG_PLUGIN} checks what the target stores and refuses a wrong form)",
                severity=NOTE,
            )
        )
        return
    if ids is None or target.num_layers is None or max(ids.one_based) > target.num_layers:
        return  # ids beyond the target: reported once, by the common checks
    if captures_layer_input(reading) and (
        rule := compatibility.last_layer_out_of_reach("SGLang", target.architectures[0], ids, target.num_layers)
    ):
        add(_finding(rule))
        return
    capture = sglang_capture(draft, target, engine)
    if capture.layers == ids.one_based:
        return
    form = sglang_nested_form(target, ids)
    got = f"the target captures one-based {list(capture.layers or ())}; the drafter needs {ids.describe()}"
    if form is None:
        fix = (
            f"no id list makes SGLang's {target.architectures[0]} capture these layers (it adds 1 exactly when "
            "the first id is 1); serve this drafter with vLLM or TokenSpeed"
        )
    elif form == list(ids.one_based):
        fix = _canonical_fix(draft_name, ids) + f"; or {SGLANG_PLUGIN} hands the target the form it reads)"
    else:
        fix = (
            f'in {draft_name}\'s config.json set "eagle_config": {{"{IDS_KEY}": {form}}} with '
            f'"aux_layer_ids_convention": "zero_based" and no top-level ids (SGLang\'s {target.architectures[0]} '
            f"adds 1 to every id); or {SGLANG_PLUGIN} hands the target the form it reads)"
        )
    plugin_fixes = form is not None
    if capture.source == DEFAULT:
        add(
            Finding(
                "sglang-nested-ids-missing",
                f"SGLang reads the aux ids only from the nested eagle_config dict and finds none there, so {got}",
                fix,
                plugin_fixes=plugin_fixes,
            )
        )
    elif reading == "first_id_heuristic":
        first = draft["eagle_config"][IDS_KEY][0]
        rule = (
            "adds 1 to every id because the first is 1"
            if first == 1
            else f"keeps them as they are (first id {first}, not 1)"
        )
        add(
            Finding(
                "sglang-first-id-heuristic",
                f"SGLang's {target.architectures[0]} {rule}, so {got}",
                fix,
                plugin_fixes=plugin_fixes,
            )
        )
    else:
        rule = "adds 1 to every id (zero-based reading)" if reading == "plus_one" else "takes one-based ids unchanged"
        add(
            Finding(
                "sglang-ids-convention",
                f"SGLang's {target.architectures[0]} {rule}, so {got}",
                fix,
                plugin_fixes=plugin_fixes,
            )
        )


def _check_tokenspeed(draft, ids, target: Target, layers_flag, add, draft_name: str) -> None:
    capture = tokenspeed_capture(draft, target, layers_flag)
    if capture.layers is None:
        add(
            Finding(
                "tokenspeed-unknown-target",
                f"how TokenSpeed's {target.architectures[:1] or target.model_type} reads "
                "aux ids is not in the table, so the capture cannot be checked",
                f"pass {tokenspeed_facts.LAYERS_FLAG} in that target's convention (the eagle31-mla plugin refuses to "
                "serve the drafter on a target it does not know)",
                severity=NOTE,
            )
        )
        return
    if ids is None or target.num_layers is None or max(ids.one_based) > target.num_layers:
        return  # ids beyond the target: reported once, by the common checks
    reading = tokenspeed_facts.target_reading(target.architectures, target.model_type)
    if captures_layer_input(reading) and (
        rule := compatibility.last_layer_out_of_reach("TokenSpeed", target.architectures[0], ids, target.num_layers)
    ):
        add(_finding(rule))
        return
    form = tokenspeed_flag_form(target, ids)
    if capture.layers == ids.one_based:
        return
    flag = f"{tokenspeed_facts.LAYERS_FLAG} {','.join(map(str, form))}"
    got = f"the target captures one-based {list(capture.layers)}; the drafter needs {ids.describe()}"
    if capture.source == FLAG:  # the plugin refuses a flag naming other layers: loud, but still the user's to fix
        rule = "adds 1 to every id" if form == list(ids.zero_based) else "takes them as one-based"
        add(
            Finding(
                "tokenspeed-ids-convention",
                f"TokenSpeed passes {tokenspeed_facts.LAYERS_FLAG} raw and the target {rule}, so {got}",
                f"pass {flag} (TokenSpeed hands it to the target as is), or drop the flag: {TOKENSPEED_PLUGIN} gives "
                "the target the right ids, and refuses a flag that names other layers)",
            )
        )
        return
    fix = (
        f"pass {flag} (TokenSpeed hands it to the target as is); or {TOKENSPEED_PLUGIN} writes the ids into the "
        "draft config in the form the target reads, checked on what the target stores)"
    )
    if capture.source == DEFAULT:
        add(
            Finding(
                "tokenspeed-ids-ignored",
                "TokenSpeed looks for ids in eagle_config (which hides the top-level key "
                f"when present) and then the top level, and finds none, so {got}",
                fix,
                plugin_fixes=True,
            )
        )
    else:
        where = "the nested eagle_config ids" if capture.source == NESTED else "the top-level ids"
        rule = "adds 1 to every id" if form == list(ids.zero_based) else "takes them as one-based"
        add(
            Finding(
                "tokenspeed-ids-convention",
                f"TokenSpeed passes {where} raw and the target {rule}, so {got}",
                fix,
                plugin_fixes=True,
            )
        )
