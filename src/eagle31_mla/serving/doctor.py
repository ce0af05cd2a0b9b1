"""``eagle31-mla doctor``: every silent misconfiguration of a draft + target + engine (SPEC §4): what the engine will
do (:mod:`.engines`) against what the drafter needs. A :class:`Finding` has a stable id (:data:`CHECKS`), the problem
and the exact fix; ``with_plugin=True`` moves what the plugin corrects into ``handled``. Needs no weights, no engine.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from itertools import groupby
from types import SimpleNamespace
from typing import Any

from ..model.aux_layers import IDS_KEY, AuxLayerIdError, AuxLayerIds, aux_layer_ids_from_config
from ..model.configuration_eagle31_mla import ENGINE_ARCHITECTURE, ConfigError, Eagle31MLAConfig
from ..prompts import eos_token_ids
from . import compatibility, engine_facts as facts, engines
from .engine_facts.vllm import KIMI_K3_STREAM_ENV
from .engines import DEFAULT, FLAG, NESTED, TARGET_LAYER_IDS, Target, _int, _nested

PROBLEM, NOTE = "problem", "note"

#: Every check: id -> what it catches. Ids are stable: scripts may match on them.
CHECKS: dict[str, str] = {
    "aux-ids-missing": "the draft names no aux layers: every engine silently captures its own default",
    "aux-ids-contradictory": "top-level and nested aux ids name different layers",
    "aux-ids-invalid": "aux ids that no engine can capture right (0, duplicates, not ascending, not ints)",
    "target-layer-ids": "a top-level `target_layer_ids`: vLLM's V2 runner adds 1 to it, the others ignore it",
    "aux-ids-beyond-target": "aux ids beyond the target's depth (or its last layer, which before-layer capture misses)",
    "draft-config-invalid": "a draft config.json this library refuses (the message names the key)",
    "target-depth-unknown": "the target's config.json has no readable num_hidden_layers: capture cannot be checked",
    "target-config-unreadable": "a target config.json field the checks read holds the wrong type (architectures, ...)",
    "target-sizes-unknown": "the target's config.json has no readable hidden_size or vocab_size",
    "mla-architecture-name": "a draft architecture name the engine does not serve as the MLA drafter (MHA cache)",
    "vocab-size-mismatch": "draft and target vocabularies differ",
    "hidden-size-mismatch": "the draft's target_hidden_size is not the target's hidden size",
    "target-depth-mismatch": "the draft's recorded target_num_hidden_layers is not the target's depth",
    "bos-eos-mismatch": "draft and target disagree on bos/eos token ids",
    "vllm-ids-convention": "vLLM reads the draft's ids in the other convention: one layer off",
    "vllm-nested-ids-ignored": "vLLM 0.20/0.21 ignore nested eagle_config ids: the target's default is captured",
    "vllm-v2-runner-nested-ids": "vLLM's V2 model runner ignores nested eagle_config ids: the default is captured",
    "vllm-draft-model-type": "a draft model_type vLLM turns into an MTP draft (deepseek_v3) or not MLA (kimi_k2)",
    "vllm-fc-norm-ignored": "vLLM before 0.23 does not apply EAGLE-3.1's fc_norm (0.22.x builds it, never applies it)",
    "vllm-norm-output-ignored": "vLLM before 0.22 does not apply EAGLE-3.1's norm_output",
    "vllm-fc-width": "vLLM before 0.22 sizes fc for exactly 3 aux states",
    "vllm-kimi-k3-version": "Kimi-K3 targets need vLLM 0.27+",
    "vllm-version-unsupported": "a vLLM release outside 0.20-0.33 (the range the facts cover)",
    "vllm-k3-last-layer-capture": "vLLM captures a Kimi-K3 target's last layer as prefix_sum + hidden (PR 50815)",
    "vllm-k3-pp-boundary-capture": "vLLM captures the running prefix at a Kimi-K3 pipeline-stage boundary (PR 50487)",
    "tp-draft-heads": "the drafter's attention heads do not split evenly over the tensor-parallel ranks",
    "k3-aux-stream": f"{KIMI_K3_STREAM_ENV} selects the AttnRes mixture, not the drafter's prefix stream",
    "sglang-nested-ids-missing": "SGLang reads only nested eagle_config ids: top-level ids are ignored",
    "sglang-first-id-heuristic": "SGLang's DeepSeek/Kimi-K2.x targets add 1 only when the first id is 1",
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
    "pd-prefill-without-draft": "the decode side speculates, the prefill side has no drafter: its KV is missing",
    "pd-decode-without-draft": "the prefill side has a drafter, the decode side none: no speculative decoding",
    "pd-draft-differs": "the sides run different drafters (checkpoint, revision, method, dtype, aux ids)",
    "pd-kv-dtype-differs": "the sides' KV cache dtypes differ: the decode side reads the transferred KV otherwise",
    "pd-draft-steps-differ": "the sides' num_speculative_tokens differ (harmless: a note)",
    "pd-nixl-side-channel": "both sides on one NixlConnector side-channel port (a note)",
    "pd-hybrid-target-connector": "a Kimi-K3 (hybrid) target on vLLM with a connector that cannot move its cache",
    "pd-example-connector": "vLLM's ExampleConnector is a test connector (a note)",
    "pd-mha-draft-cache": "an MHA drafter beside an MLA target: another cache spec, and what it costs (a note)",
    "pd-k3-speculation": "vLLM corrupts Kimi-K3 output with PD disaggregation and speculation together (issue 52627)",
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

    def _select(self, severity: str, handled: bool) -> list[Finding]:
        return [f for f in self.findings if f.severity == severity and (self.with_plugin and f.plugin_fixes) == handled]

    problems = property(lambda self: self._select(PROBLEM, False))
    handled = property(lambda self: self._select(PROBLEM, True))
    notes = property(lambda self: self._select(NOTE, False))
    ok = property(lambda self: not self.problems)

    def to_dict(self) -> dict[str, Any]:
        if (ids := self.aux_layer_ids) is not None:
            ids = {"one_based": list(ids.one_based), "zero_based": list(ids.zero_based), "how": self.aux_layer_ids_how}
        found = {"problems": self.problems, "handled_by_plugin": self.handled, "notes": self.notes}
        out = dict(ok=self.ok, engine=self.engine, versions=list(self.versions), with_plugin=self.with_plugin)
        out.update(draft=self.draft, target=self.target, aux_layer_ids=ids)
        return {**out, **{k: [asdict(f) for f in v] for k, v in found.items()}, "details": list(self.details)}

    def format(self) -> str:
        name = facts.ENGINE_NAMES[self.engine]
        plugin = " with the eagle31-mla plugin" if self.with_plugin else ""
        lines = [f"doctor: {self.draft} on {self.target}, {name} {_runs(self.versions, self.versions)}{plugin}"]
        lines += [f"  {line}" for line in self.details]
        if self.aux_layer_ids is not None:
            lines.append(f"  aux layers wanted: {self.aux_layer_ids.describe()} ({self.aux_layer_ids_how})")
        for title, items in (("problem", self.problems), ("handled by the plugin", self.handled), ("note", self.notes)):
            for f in items:
                where = f" ({name} {_runs(f.versions, self.versions)})" if f.versions else ""
                lines += [f"  {title} [{f.id}]{where}: {f.problem}", f"    fix: {f.fix}"]
        notes = f" ({len(self.notes)} note(s))" if self.notes else ""
        lines.append(f"  ok: nothing is wrong{notes}" if self.ok else f"  {len(self.problems)} problem(s)")
        return "\n".join(lines)


def _runs(versions: Sequence[str], checked: Sequence[str]) -> str:
    """ "0.20-0.22, 0.25": the runs of ``versions`` within the ``checked`` releases, in order."""
    runs = [list(run) for inside, run in groupby(checked, lambda v: v in versions) if inside]
    return ", ".join(r[0] if len(r) == 1 else f"{r[0]}-{r[-1]}" for r in runs)


def engine_releases(engine: str, version: str | None = None) -> list[tuple[str, Any]]:
    """(label, feature table) for the named release, or for every release the engine's table knows."""
    if engine == "tokenspeed":
        return [(version or facts.release_label(facts.tokenspeed.RELEASES[-1]), None)]
    table = {"vllm": facts.vllm, "sglang": facts.sglang}[engine]
    if version:
        return [(version, table.features(facts.parse_release(version, engine)))]
    return [(facts.release_label(v[:2] if engine == "vllm" else v), table.features(v)) for v in table.RELEASES]


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
    tensor_parallel_size: int | None = None,
    pipeline_parallel_size: int | None = None,
) -> Report:
    """Check a draft ``config.json`` dict against a target and an engine (one release, or all known), served at
    the given tensor- and pipeline-parallel sizes."""
    releases, environ = engine_releases(engine, version), os.environ if environ is None else environ
    # a size that is not a positive integer is as unreadable as a missing one (reported by _check_target)
    sizes = ("num_layers", "hidden_size", "vocab_size")
    target = replace(target, **{k: None for k in sizes if getattr(target, k) is not None and getattr(target, k) < 1})
    findings: list[Finding] = []
    add = _adder(findings)
    ids, how, ids_error = _read_ids(draft, add, draft_name)
    d = _read_draft(draft, add, draft_name, ids_error)
    _check_target(target, add)
    _check_common(d, ids, target, engine, add, draft_name)
    heads, tp = d.heads, tensor_parallel_size
    if tp and isinstance(heads, int) and heads % tp:
        problem = f"the drafter's {heads} attention heads do not split evenly over {tp} tensor-parallel ranks"
        add("tp-draft-heads", problem, f"serve at a tensor-parallel size that divides {heads} (Kimi-K3's card: 16)")
    labels, per_id = [label for label, _ in releases], {}
    for label, table in releases:
        found: list[Finding] = []
        if engine == "vllm":
            _check_vllm(draft, d, ids, target, table, environ, _adder(found), draft_name)
            _check_vllm_kimi_k3(ids, target, table, environ, pipeline_parallel_size, _adder(found))
        elif engine == "sglang":
            _check_sglang(draft, ids, target, table, _adder(found), draft_name)
        else:
            _check_tokenspeed(draft, ids, target, layers_to_capture, _adder(found), draft_name)
        for f in found:
            per_id.setdefault(f.id, (f, []))[1].append(label)
    for f, versions in per_id.values():  # releases are named only when not all checked ones are affected
        findings.append(replace(f, versions=() if len(versions) == len(labels) else tuple(versions)))
    return Report(engine, tuple(labels), with_plugin, draft_name, target.describe(), ids, how, findings)


def _adder(findings: list[Finding]):  # add(id, problem, fix, severity, plugin_fixes), or add(rule); None: none
    def add(check, problem="", fix="", severity=PROBLEM, plugin_fixes=False):
        if isinstance(check, compatibility.Incompatibility):
            check, problem, fix = check.id, check.problem, check.fix
        findings.extend([Finding(check, problem, fix, severity, plugin_fixes)] if check else [])

    return add


def _plugin(engine: str, does: str) -> str:
    return f"{facts.PLUGIN_INSTALL[engine]} where {facts.ENGINE_NAMES[engine]} runs (its plugin {does})"


def _canonical_fix(draft: str, ids: AuxLayerIds) -> str:
    from ..model.aux_layers import aux_layer_ids_config_entries

    return (
        f"in {draft}'s config.json set {json.dumps(aux_layer_ids_config_entries(ids))[1:-1]} (what `eagle31-mla "
        "convert` writes: right for vLLM, SGLang's DeepSeek/Kimi targets and TokenSpeed's Kimi-K3 target at once)"
    )


def _read_ids(draft: Mapping[str, Any], add, name: str) -> tuple[AuxLayerIds | None, str, str | None]:
    try:
        return (*aux_layer_ids_from_config(draft), None)
    except AuxLayerIdError as err:
        message = str(err)
    if draft.get(IDS_KEY) is not None or (_nested(draft) or {}).get(IDS_KEY) is not None:
        if "contradictory" in message:
            check, fix = "aux-ids-contradictory", "keep the ids the drafter was trained on, in one convention, labelled"
        else:
            check = "aux-ids-invalid"
            fix = "list the trained layers once each, ascending, one-based >= 1 (zero-based >= 0), labelled"
    elif "target_layer_ids" in draft:
        check, fix = "target-layer-ids", f'replace `target_layer_ids` by "{IDS_KEY}" with "aux_layer_ids_convention"'
    else:
        check = "aux-ids-missing"
        fix = f'set "{IDS_KEY}" (one-based, e.g. Kimi-K3: [2, 46, 90]) with "aux_layer_ids_convention": "one_based", '
        fix += 'at the top level and in "eagle_config": the layers the drafter was trained on'
    add(check, message, f"in {name}'s config.json {fix}")
    return None, "", message


def _read_draft(draft: Mapping[str, Any], add, name: str, ids_error: str | None) -> SimpleNamespace:
    """The draft facts the checks use: as Eagle31MLAConfig reads the file, else the raw dict."""
    try:
        source = Eagle31MLAConfig.from_dict(dict(draft)).to_dict()
    except (ConfigError, ValueError, TypeError, KeyError) as err:
        source = draft
        if ids_error is None or ids_error not in str(err):
            add("draft-config-invalid", f"{name}'s config.json is refused: {err}", f"correct it in {name}")
    architectures = draft.get("architectures") if isinstance(draft.get("architectures"), list) else []
    get = source.get
    return SimpleNamespace(
        architecture=next((a for a in architectures if isinstance(a, str)), None),
        model_type=draft.get("model_type"),
        sizes=compatibility.Sizes(
            get("target_hidden_size") or get("hidden_size"), get("vocab_size"), _int(get("target_num_hidden_layers"))
        ),
        heads=get("num_attention_heads"),
        fc_norm=bool(get("fc_norm")),
        norm_output=bool(get("norm_output")),
        bos=get("bos_token_id"),
        eos=eos_token_ids(get("eos_token_id")),
    )


def _check_target(target: Target, add) -> None:
    """What the other checks need from the target's config.json: missing, they would pass by default."""
    where = f"the target's config.json (or its text_config) for {target.name}"
    point = "point --target at the target model itself; if that is what it is,"
    for key, expected in target.unreadable:
        example = ' (e.g. "architectures": ["DeepseekV3ForCausalLM"])' if key == "architectures" else ""
        problem = f"{where} has an unreadable {key!r}: expected {expected}; the checks that depend on it cannot run"
        add("target-config-unreadable", problem, f"{point} correct {key!r} in it{example}")
    if target.num_layers is None:
        problem = (
            f"{where} has no num_hidden_layers that is a positive integer: which layers the engine captures, and "
            "whether the draft's aux ids exist in this target, cannot be checked"
        )
        add("target-depth-unknown", problem, f'{point} set "num_hidden_layers" in it to its layer count (Kimi-K3: 93)')
    if missing := [k for k in ("hidden_size", "vocab_size") if getattr(target, k) is None]:
        problem = f"{where} has no {' or '.join(missing)} that is a positive integer: the draft cannot be checked"
        add("target-sizes-unknown", problem, f"{point} set {', '.join(missing)} in it")


MLA_NAME_CONSEQUENCE = {
    "vllm": "vLLM serves this drafter family only under that name (its MLA EAGLE-3 class); another is another class",
    "sglang": "SGLang picks the KV-cache layout from a fixed list of names: any other silently gets an MHA cache",
    "tokenspeed": f"TokenSpeed's MLA list holds {ENGINE_ARCHITECTURE}: any other name silently resolves to MHA",
}


def _check_common(d, ids: AuxLayerIds | None, target: Target, engine: str, add, name: str) -> None:
    if d.architecture != ENGINE_ARCHITECTURE:
        problem = f"the draft's architectures[0] is {d.architecture!r}, not {ENGINE_ARCHITECTURE!r}: "
        fix = f'in {name}\'s config.json set "architectures": ["{ENGINE_ARCHITECTURE}"]'
        add("mla-architecture-name", problem + MLA_NAME_CONSEQUENCE[engine], fix)
    if ids is not None and target.num_layers is not None and max(ids.one_based) > target.num_layers:
        problem = (
            f"aux layers {ids.describe()} go beyond {target.name}'s {target.num_layers} layers (one-based ids must be "
            f"<= {target.num_layers}): the drafter was trained on a deeper target"
        )
        fix = f"serve it with the target it was trained for, or correct the ids in {name}'s config.json"
        add("aux-ids-beyond-target", problem, fix)
    sizes = compatibility.Sizes(target.hidden_size, target.vocab_size, target.num_layers)
    for mismatch in compatibility.size_mismatches(d.sizes, sizes, target.name):
        add(mismatch)
    wrong = []
    if d.bos is not None and target.bos_token_id is not None and d.bos != target.bos_token_id:
        wrong.append(f"bos {d.bos} vs {target.bos_token_id}")
    if d.eos and target.eos_token_ids and not set(d.eos) <= set(target.eos_token_ids):
        wrong.append(f"eos {list(d.eos)} vs {list(target.eos_token_ids)}")
    if wrong:
        eos = list(target.eos_token_ids)
        ids = {"bos_token_id": target.bos_token_id, "eos_token_id": eos if len(eos) > 1 else (eos or [None])[0]}
        fix = f"check the drafter was trained for {target.name}; then in {name}'s config.json set "
        problem = f"draft and target disagree on special tokens ({'; '.join(wrong)}): a drafter for another tokenizer"
        add("bos-eos-mismatch", problem, fix + json.dumps({k: v for k, v in ids.items() if v is not None})[1:-1])


def _check_vllm(draft, d, ids, target: Target, engine, environ, add, name: str) -> None:
    if not engine.supported:
        problem = f"{engine.describe()} is outside 0.20-0.33, the releases these checks and the plugin cover"
        add("vllm-version-unsupported", problem, "use vLLM 0.20-0.33 (Kimi-K3 targets: 0.27+)", NOTE)
    add(compatibility.vllm_kimi_k3_version(engine, target.is_kimi_k3))
    as_v2 = _plugin("vllm", "serves it as deepseek_v2")
    if d.model_type in facts.vllm.MTP_DRAFT_MODEL_TYPES:
        problem = f"the draft's model_type is {d.model_type!r}: vLLM turns it into a DeepSeek MTP draft, not EAGLE-3"
        fix = f'in {name}\'s config.json set "model_type": "kimi_k2"; or {as_v2}'
        add("vllm-draft-model-type", problem, fix, plugin_fixes=True)
    elif d.model_type not in facts.vllm.MLA_DRAFT_MODEL_TYPES:
        problem = f"the draft's model_type is {d.model_type!r}: vLLM reports use_mla=False (CPU, Ascend size caches so)"
        if (bug := facts.vllm.KIMI_K2_DRAFT_NOT_MLA).affects(engine.version) and d.model_type == "kimi_k2":
            problem += f" ({bug.cite()})"
        add("vllm-draft-model-type", problem, as_v2, NOTE, plugin_fixes=True)
    if d.fc_norm and not engine.applies_fc_norm:
        problem = "the draft is EAGLE-3.1 (fc_norm: true), and vLLM before 0.23 does not apply fc_norm: the captured "
        problem += "states reach fc un-normalised and acceptance drops, with no error"
        add("vllm-fc-norm-ignored", problem, f"use vLLM >= 0.23; or {_plugin('vllm', 'applies it')}", plugin_fixes=True)
    if d.norm_output and not engine.applies_norm_output:
        problem = "the draft is EAGLE-3.1 (norm_output: true); vLLM before 0.22 feeds the next step the pre-norm state"
        fix = f"use vLLM >= 0.22; or {_plugin('vllm', 'applies norm_output')}"
        add("vllm-norm-output-ignored", problem, fix, plugin_fixes=True)
    if ids is not None:
        add(compatibility.vllm_fc_width(engine, len(ids)))
    add(compatibility.vllm_kimi_k3_stream(engine, target.is_kimi_k3, environ))
    if ids is None or target.num_layers is None:
        return
    fix = f"{_canonical_fix(name, ids)}; or {_plugin('vllm', 'writes them explicitly for vLLM')}"
    for runner in ("v1", "v2") if engine.v2_model_runner else ("v1",):
        capture = engines.vllm_capture(draft, target, engine, runner)
        got = f"captures one-based {list(capture.layers or ())}; the drafter needs {ids.describe()}"
        if capture.layers == ids.one_based:
            if capture.source == DEFAULT and (_nested(draft) or {}).get(IDS_KEY) is not None and runner == "v2":
                problem = "vLLM's V2 model runner ignores nested eagle_config ids; the target's default it captures "
                add("vllm-v2-runner-nested-ids", f"{problem}happens to be {list(ids.one_based)}", fix, NOTE, True)
        elif capture.source == TARGET_LAYER_IDS:
            problem = f"vLLM's V2 model runner reads the top-level target_layer_ids plus 1 and {got}"
            add("target-layer-ids", problem, fix + "; and delete target_layer_ids", plugin_fixes=True)
        elif capture.source == DEFAULT and runner == "v1":
            problem = f"vLLM 0.20/0.21 read only top-level ids, so the target {got} (its default)"
            add("vllm-nested-ids-ignored", problem, fix, plugin_fixes=True)
        elif capture.source == DEFAULT:
            problem = (
                "vLLM's V2 model runner (the default for Kimi-K3 targets from 0.27 and for every model with Triton "
                f"from 0.29) ignores nested eagle_config ids, so the target {got} (its default)"
            )
            add("vllm-v2-runner-nested-ids", problem, fix, plugin_fixes=True)
        else:
            where = "the nested eagle_config ids" if capture.source == NESTED else "the top-level ids"
            effect = "(off by one: nothing fails, acceptance drops)"
            if 0 in (capture.layers or ()):
                effect = "(id 0 names no layer: a DeepSeek or Kimi target fails at its first request)"
            problem = f"vLLM's {runner.upper()} runner reads {where} one-based and {got} {effect}"
            add("vllm-ids-convention", problem, fix, plugin_fixes=True)


def _check_vllm_kimi_k3(ids, target: Target, engine, environ, pp: int | None, add) -> None:
    """vLLM's open Kimi-K3 capture bugs (engine_facts.vllm), where this drafter and the parallel layout meet them."""
    depth = target.num_layers
    if not target.is_kimi_k3 or ids is None or depth is None or max(ids.one_based) > depth:
        return
    if (bug := facts.vllm.K3_LAST_LAYER_CAPTURE).affects(engine.version) and depth in ids.one_based:
        problem = f"aux id {depth} is {target.name}'s last layer, and vLLM captures prefix_sum + hidden there, not the "
        problem += f"layer's post-AttnRes output: another stream than the drafter was trained on ({bug.cite()})"
        add(bug.check, problem, f"serve a drafter whose aux ids stop below {depth}, or a vLLM with the fix")
    bug = facts.vllm.K3_PP_BOUNDARY_CAPTURE
    if not (pp and pp > 1 and bug.affects(engine.version)):
        return
    env = facts.vllm.PP_PARTITION_ENV
    starts = facts.vllm.pipeline_stage_starts(depth, pp, environ.get(env))
    if hit := [k for k in ids.one_based if k in starts]:
        problem = f"with {pp} pipeline stages a stage ends at layer(s) {', '.join(str(k - 1) for k in hit)} "
        problem += f"(zero-based), whose output is aux id {hit}: vLLM captures the running prefix there ({bug.cite()})"
        moved = [b + 1 if b in hit else b for b in starts]  # one layer later: no longer an aux layer's output
        if any(b in ids.one_based for b in moved) or moved[-1] >= depth:
            moved = [b - 1 if b in hit else b for b in starts]
        parts = [b - a for a, b in zip([0, *moved], [*moved, depth])]
        add(bug.check, problem, f"set {env}={','.join(map(str, parts))} (no stage ends at an aux layer)")


def _unknown_target(engine: str, target: Target) -> str:
    return f"how {engine}'s {target.architectures[:1] or target.model_type} reads aux ids is not in the table"


def _out_of_reach(engine: str, reading: str | None, ids, target: Target, add) -> bool:
    """Ids beyond the target (reported once, by the common checks), or a last layer before-layer capture misses."""
    if ids is None or target.num_layers is None or max(ids.one_based) > target.num_layers:
        return True
    arch, depth = target.architectures[0], target.num_layers
    rule = facts.captures_layer_input(reading) and compatibility.last_layer_out_of_reach(engine, arch, ids, depth)
    add(rule or None)
    return bool(rule)


def _check_sglang(draft, ids, target: Target, engine, add, name: str) -> None:
    if not engine.supported:
        problem = f"{engine.describe()} is older than 0.5.23, the release these facts and the SGLang plugin cover"
        add("sglang-version-unsupported", problem, "use SGLang >= 0.5.23", NOTE)
    reading = facts.sglang.target_reading(target.architectures)
    if reading == facts.ONE_BASED and engine.kimi_k3_eagle3_capture is False:
        problem = f"{engine.describe()}'s Kimi-K3 target classes have no EAGLE-3 capture: EAGLE-3 cannot start"
        fix = "use an SGLang release with Kimi-K3 EAGLE-3 capture; or " + _plugin("sglang", "adds one")
        return add("sglang-k3-no-capture", problem, fix, plugin_fixes=True)
    if reading == facts.ONE_BASED and engine.kimi_k3_eagle3_capture is None:
        problem = f"whether {engine.describe()} ships Kimi-K3 EAGLE-3 capture (prefix stream) is not confirmed"
        add("sglang-k3-capture-unconfirmed", problem, _plugin("sglang", "adds it when missing"), NOTE)
    if reading is None:
        fix = _plugin("sglang", "checks what the target stores and refuses a wrong form")
        return add("sglang-unknown-target", _unknown_target("SGLang", target), fix, NOTE)
    if _out_of_reach("SGLang", reading, ids, target, add):
        return
    arch, capture = target.architectures[0], engines.sglang_capture(draft, target)
    if capture.layers == ids.one_based:
        return
    forms = (list(ids.one_based), list(ids.zero_based))  # the nested ids that make the target capture ``ids``
    form = next((f for f in forms if facts.sglang.stored_layers(reading, f, target.num_layers) == forms[0]), None)
    got = f"the target captures one-based {list(capture.layers or ())}; the drafter needs {ids.describe()}"
    plugin = "; or " + _plugin("sglang", "hands the target the form it reads")
    if form is None:
        fix = f"no id list makes SGLang's {arch} capture these layers (it adds 1 exactly when the first id is 1); "
        fix += "serve this drafter with vLLM or TokenSpeed"
    elif form == list(ids.one_based):
        fix = _canonical_fix(name, ids) + plugin
    else:
        fix = (
            f'in {name}\'s config.json set "eagle_config": {{"{IDS_KEY}": {form}}} with "aux_layer_ids_convention": '
            f'"zero_based" and no top-level ids (SGLang\'s {arch} adds 1 to every id){plugin}'
        )
    if capture.source == DEFAULT:
        check = "sglang-nested-ids-missing"
        problem = f"SGLang reads the aux ids only from the nested eagle_config dict and finds none there, so {got}"
    elif reading == facts.FIRST_ID_HEURISTIC:
        first = draft["eagle_config"][IDS_KEY][0]
        rule = "adds 1 to every id because the first is 1" if first == 1 else f"keeps them (first id {first}, not 1)"
        check, problem = "sglang-first-id-heuristic", f"SGLang's {arch} {rule}, so {got}"
    else:
        rule = "adds 1 to every id (zero-based reading)" if reading == facts.PLUS_ONE else "takes one-based ids as is"
        check, problem = "sglang-ids-convention", f"SGLang's {arch} {rule}, so {got}"
    add(check, problem, fix, plugin_fixes=form is not None)


def _check_tokenspeed(draft, ids, target: Target, layers_flag, add, name: str) -> None:
    capture = engines.tokenspeed_capture(draft, target, layers_flag)
    flag = facts.tokenspeed.LAYERS_FLAG
    if capture.layers is None:
        fix = f"pass {flag} in that target's convention (the eagle31-mla plugin refuses a target it does not know)"
        return add("tokenspeed-unknown-target", _unknown_target("TokenSpeed", target), fix, NOTE)
    reading = facts.tokenspeed.target_reading(target.architectures, target.model_type)
    if _out_of_reach("TokenSpeed", reading, ids, target, add) or capture.layers == ids.one_based:
        return
    form = engines.tokenspeed_flag_form(target, ids)
    rule = "adds 1 to every id" if form == list(ids.zero_based) else "takes them as one-based"
    got = f"the target captures one-based {list(capture.layers)}; the drafter needs {ids.describe()}"
    passed = f"pass {flag} {','.join(map(str, form))} (TokenSpeed hands it to the target as is)"
    if capture.source == FLAG:  # the plugin refuses a flag naming other layers: loud, but still the user's to fix
        fix = f"{passed}, or drop the flag: {_plugin('tokenspeed', 'gives the target the right ids')}"
        return add("tokenspeed-ids-convention", f"TokenSpeed passes {flag} raw and the target {rule}, so {got}", fix)
    fix = f"{passed}; or {_plugin('tokenspeed', 'writes the ids into the draft config in the form the target reads')}"
    if capture.source == DEFAULT:
        problem = f"TokenSpeed finds no ids in eagle_config (which hides the top-level key) or the top level, so {got}"
        return add("tokenspeed-ids-ignored", problem, fix, plugin_fixes=True)
    where = "the nested eagle_config ids" if capture.source == NESTED else "the top-level ids"
    problem = f"TokenSpeed passes {where} raw and the target {rule}, so {got}"
    add("tokenspeed-ids-convention", problem, fix, plugin_fixes=True)
