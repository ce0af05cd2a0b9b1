"""Accept length of a running deployment: ``eagle31-mla acceptance --server URL`` (no model loaded here).

The prompts of a prompts file (:func:`eagle31_mla.prompts.read_prompt_lines`, checked by FILE:LINE) go to the
server's OpenAI endpoints with the ``openai`` client (``/v1/completions``: text, or token ids for an id-list /
``input_ids`` prompt; ``/v1/chat/completions``: ``messages``, and text prompts under ``chat=True``), greedy by
default, non-streaming, ``concurrency`` at a time (a :class:`~concurrent.futures.ThreadPoolExecutor`). What is not
OpenAI's API travels in the client's ``extra_body`` (``ignore_eos``, SGLang's ``return_spec_tokens_details``,
TokenSpeed's ``rid``) and comes back among the response's extra fields (SGLang's ``sglext``, vLLM's ``metrics``).
Acceptance is read the way each engine reports it (the facts, each with its source,
are in :mod:`eagle31_mla.serving.engine_facts`):

* **vLLM**: the speculative-decoding counters of its Prometheus ``/metrics`` (drafts, draft tokens, accepted
  tokens, accepted tokens per position; summed over the ``engine`` label), diffed around each request when
  requests run one at a time (``concurrency=1``: per-request attribution; the server must be otherwise idle)
  or around the whole run when they overlap (aggregate). A response that carries
  ``metrics.speculative_decoding`` (vLLM >= 0.29 started with ``--per-request-spec-decode-metrics``) is
  attributed per request from it, concurrent or not.
* **SGLang**: each request asks for ``return_spec_tokens_details`` and reads ``sglext.spec_tokens_details``:
  AL = 1 + ``spec_num_correct_drafts`` / ``spec_verify_ct`` (not SGLang's ``spec_accept_length``, which counts
  the prefill token as well and runs high by 1 / verify_ct).
* **TokenSpeed**: ``usage.completion_tokens_details.accepted_prediction_tokens`` per request (rounds =
  completion tokens - 1 - accepted). With ``log=`` (the scheduler's log file) its per-request
  ``Req: {rid} Finish! Accept_num_tokens_avg: X`` lines are matched to the requests by the ``rid`` each request
  sends (and checked against the usage fields), as the model card attributes acceptance; its
  ``Decode batch. ... avg_accept_len: X`` windows written during the run are reported too.

Accept length counts the bonus token (tokens per verification round), as the offline
:class:`~eagle31_mla.decoding.speculative.AcceptanceStats` does, and the run's mean is the ratio of totals: all tokens
the rounds produced over all rounds.

**95% confidence interval** (per-request attribution, at least two requests): the ratio estimator
R = sum(a_i) / sum(r_i) over requests (a_i: tokens request i's rounds produced, r_i: its rounds) with its
linearised (delta-method) standard error ``se = sd(a_i - R r_i) / (sqrt(n) mean(r_i))`` and a Student t
interval with n - 1 degrees of freedom: R +- t(0.975, n - 1) se. It is the uncertainty from which prompts were
drawn (the requests are the sampling unit), not from the engine. An aggregate-only run (vLLM counters with
overlapping requests) has no per-request values, hence no interval: the report says so (``null``).

**Verdict** against ``expect`` (a number) or ``reference`` (an offline ``acceptance --json`` report): the
difference D = measured - expected is *consistent* when |D| <= max(h, :data:`MIN_MARGIN`), h being the 95%
half-width of D: the measured interval's for ``expect``; for a reference with per-request data on the same
prompts, the paired interval (per-request linearised differences of the two ratio estimators, t with n - 1
degrees of freedom: a correct greedy deployment reproduces the offline rounds request by request, so the
interval is tight); otherwise the two intervals combined (sqrt(se1^2 + se2^2)). With no interval (aggregate
runs) the tolerance is :data:`NO_INTERVAL_TOLERANCE`. A drop beyond that names the likely silent
misconfiguration (:func:`likely_causes`) and the ``eagle31-mla doctor`` command to run.

Errors (unreachable, not an OpenAI server, no speculative decoding, metrics disabled, wrong engine, a log
without acceptance lines, a refused request, no answer in time) are :class:`LiveError`: one line; the CLI exits 2
and writes nothing. The client's own errors (no connection, timeout, an HTTP status) become them in
:meth:`_Server.request`.
"""

from __future__ import annotations

import json
import math
import os
import re
import secrets
import shlex
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .engine_facts import (
    ENGINE_NAMES,
    ENGINES,
    sglang as sglang_facts,
    tokenspeed as tokenspeed_facts,
    vllm as vllm_facts,
)

__all__ = [
    "LiveError",
    "MIN_MARGIN",
    "NO_INTERVAL_TOLERANCE",
    "Acceptance",
    "Sample",
    "VllmCounters",
    "TokenSpeedLog",
    "parse_prometheus",
    "vllm_counters",
    "metrics_engines",
    "vllm_response_acceptance",
    "sglang_response_acceptance",
    "tokenspeed_response_acceptance",
    "parse_tokenspeed_log",
    "acceptance_dict",
    "ratio_interval",
    "t_quantile_975",
    "read_reference",
    "compare",
    "likely_causes",
    "doctor_command",
    "measure_server",
    "format_report",
    "write_json_atomic",
]

#: The smallest margin a verdict allows (accept length): below it two measurements are the same number
#: (the issue's "within 0.02" for the greedy demo served and measured offline).
MIN_MARGIN = 0.02
#: The margin when the run has no confidence interval (aggregate attribution): a third of the smallest known
#: silent misconfiguration's cost on Kimi-K3 (aux ids off by one, about -0.35 per the model card).
NO_INTERVAL_TOLERANCE = 0.1
#: Off by one on Kimi-K3 (the model card): the size of drop it names first.
OFF_BY_ONE_COST = 0.35


class LiveError(ValueError):
    """The server, the input or a response cannot give a measurement: one line (the CLI exits 2)."""


# ---- acceptance of one request or a run ----------------------------------------------------------------


@dataclass
class Acceptance:
    """What an engine reported for one request (or a run): verification ``rounds``, ``accepted`` drafts (the
    bonus token excluded), ``draft_tokens`` proposed; where known, ``histogram`` (index m: rounds that
    accepted exactly m drafts), ``per_position`` (rounds whose draft at depth j + 1 was accepted) and
    ``num_steps`` (drafts per round in a chain)."""

    rounds: int
    accepted: int
    draft_tokens: int | None = None
    histogram: list[int] | None = None
    per_position: list[int] | None = None
    num_steps: int | None = None
    source: str = ""

    @property
    def accept_length(self) -> float:
        return (self.accepted + self.rounds) / self.rounds if self.rounds else float("nan")

    def padded_histogram(self, num_steps: int | None) -> list[int] | None:
        if self.histogram is None or num_steps is None or len(self.histogram) > num_steps + 1:
            return self.histogram
        return list(self.histogram) + [0] * (num_steps + 1 - len(self.histogram))

    def positions(self, num_steps: int | None) -> list[int] | None:
        """Rounds with the draft at depth j + 1 accepted, j = 0..num_steps-1 (from the histogram if need be)."""
        if self.per_position is not None:
            if num_steps is None or len(self.per_position) == num_steps:
                return list(self.per_position)
            return list(self.per_position) + [0] * max(0, num_steps - len(self.per_position))
        hist = self.padded_histogram(num_steps)
        if hist is None:
            return None
        return [sum(hist[j + 1 :]) for j in range(len(hist) - 1)]


def _int(value) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def _histogram_from_positions(rounds: int, per_position: list[int], accepted: int) -> list[int] | None:
    """A chain's histogram from "rounds with depth j + 1 accepted" counts (vLLM's per-position counter):
    hist[m] = count(>= m) - count(>= m + 1), count(>= 0) = rounds; None if the counts are not a chain's."""
    counts = [rounds, *per_position, 0]
    if any(b > a for a, b in zip(counts, counts[1:])) or sum(per_position) != accepted:
        return None
    return [counts[m] - counts[m + 1] for m in range(len(per_position) + 1)]


def acceptance_dict(
    acc: Acceptance | None,
    num_generated_tokens: int,
    num_requests: int,
    *,
    num_steps: int | None = None,
    accept_length: float | None = None,
) -> dict[str, Any]:
    """The offline report's statistics (:meth:`eagle31_mla.decoding.speculative.AcceptanceStats.to_dict`, same
    keys, same formulas) from what a server reported; a value the engine does not report is None, and so is the
    mean of no rounds (offline: NaN; None keeps the JSON strict). ``accept_length`` stands in for the mean when there
    are no round counts (an aggregate from log windows)."""
    steps = num_steps if num_steps is not None else acc.num_steps if acc else None
    rounds = acc.rounds if acc else None
    draft_tokens = acc.draft_tokens if acc else None
    per_round = None
    if rounds and draft_tokens is not None:
        per_round = draft_tokens // rounds if draft_tokens % rounds == 0 else draft_tokens / rounds
    positions = acc.positions(steps) if acc else None
    hist = acc.padded_histogram(steps) if acc else None
    mean = acc.accept_length if acc and acc.rounds else None if acc else accept_length
    return {
        "num_requests": num_requests,
        "num_steps": steps,
        "draft_tokens_per_round": per_round,
        "num_rounds": rounds,
        "num_draft_tokens": draft_tokens,
        "num_accepted_tokens": acc.accepted if acc else None,
        "num_generated_tokens": num_generated_tokens,
        "mean_accept_length": mean,
        "acceptance_rate_per_position": [p / rounds for p in positions] if positions is not None and rounds else None,
        "accept_histogram": hist,
        "draft_tokens_per_generated_token": (
            draft_tokens / num_generated_tokens if draft_tokens is not None and num_generated_tokens else None
        ),
    }


def _sum(items: list[Acceptance]) -> Acceptance:
    steps = {a.num_steps for a in items if a.num_steps is not None}
    num_steps = max(steps) if steps else None
    draft = None if any(a.draft_tokens is None for a in items) else sum(a.draft_tokens for a in items)
    hists = [a.padded_histogram(num_steps) for a in items]
    hist = None
    if hists and all(h is not None and len(h) == len(hists[0]) for h in hists):
        hist = [sum(col) for col in zip(*hists)]
    positions = [a.positions(num_steps) for a in items]
    pos = None
    if positions and all(p is not None and len(p) == len(positions[0]) for p in positions):
        pos = [sum(col) for col in zip(*positions)]
    return Acceptance(
        rounds=sum(a.rounds for a in items),
        accepted=sum(a.accepted for a in items),
        draft_tokens=draft,
        histogram=hist,
        per_position=pos,
        num_steps=num_steps,
        source=items[0].source if items else "",
    )


# ---- vLLM: Prometheus text --------------------------------------------------------------------------


@dataclass(frozen=True)
class Sample:
    name: str
    labels: dict[str, str]
    value: float


def parse_prometheus(text: str) -> list[Sample]:
    """The samples of a Prometheus text exposition, read by prometheus_client's own parser (the library vLLM's
    metrics are written with); a page it cannot read is a :class:`LiveError`, one line."""
    from prometheus_client.parser import text_string_to_metric_families

    try:
        families = list(text_string_to_metric_families(text))
    except ValueError as err:
        raise LiveError(f"the server's /metrics page is not Prometheus text: {err}") from None
    return [Sample(s.name, dict(s.labels), float(s.value)) for family in families for s in family.samples]


def metrics_engines(samples: list[Sample]) -> set[str]:
    """Which engines' series a ``/metrics`` page holds, by their prefixes (``vllm:``, ``sglang:``, ``tokenspeed:``)."""
    prefixes = {
        "vllm": vllm_facts.METRIC_PREFIX,
        "sglang": sglang_facts.METRIC_PREFIX,
        "tokenspeed": tokenspeed_facts.METRIC_PREFIX,
    }
    return {engine for engine, prefix in prefixes.items() if any(s.name.startswith(prefix) for s in samples)}


@dataclass(frozen=True)
class VllmCounters:
    """vLLM's speculative-decoding counters, summed over every label but ``position``."""

    drafts: int
    draft_tokens: int
    accepted: int
    per_position: tuple[int, ...]

    def __sub__(self, before: VllmCounters) -> Acceptance:
        k = max(len(self.per_position), len(before.per_position))
        after_pos = list(self.per_position) + [0] * (k - len(self.per_position))
        before_pos = list(before.per_position) + [0] * (k - len(before.per_position))
        pos = [a - b for a, b in zip(after_pos, before_pos)]
        rounds, accepted = self.drafts - before.drafts, self.accepted - before.accepted
        return Acceptance(
            rounds=rounds,
            accepted=accepted,
            draft_tokens=self.draft_tokens - before.draft_tokens,
            histogram=_histogram_from_positions(rounds, pos, accepted) if k else None,
            per_position=pos if k else None,
            num_steps=k or None,
            source="vllm-metrics",
        )


def vllm_counters(samples: list[Sample]) -> VllmCounters | None:
    """The four counters (:data:`eagle31_mla.serving.engine_facts.vllm.SPEC_DECODE_COUNTERS`, scraped with a ``_total``
    suffix; a bare name is read too) summed over the ``engine`` (and ``model_name``) label, or None when the
    page has no drafts counter."""
    names = vllm_facts.SPEC_DECODE_COUNTERS
    totals: dict[str, float] = {}
    per_pos: dict[int, float] = {}
    found = False
    for s in samples:
        base = s.name.removesuffix("_total")
        if base == names["accepted_tokens_per_pos"]:
            position = s.labels.get(vllm_facts.SPEC_DECODE_POSITION_LABEL, "")
            if position.isdigit():
                per_pos[int(position)] = per_pos.get(int(position), 0.0) + s.value
            continue
        for key in ("drafts", "draft_tokens", "accepted_tokens"):
            if base == names[key]:
                totals[key] = totals.get(key, 0.0) + s.value
                found = found or key == "drafts"
    if not found:
        return None
    k = max(per_pos) + 1 if per_pos else 0
    return VllmCounters(
        drafts=round(totals.get("drafts", 0.0)),
        draft_tokens=round(totals.get("draft_tokens", 0.0)),
        accepted=round(totals.get("accepted_tokens", 0.0)),
        per_position=tuple(round(per_pos.get(j, 0.0)) for j in range(k)),
    )


def _field(obj, path: tuple[str, ...]):
    for key in path:
        if not isinstance(obj, dict):
            return None
        obj = obj.get(key)
    return obj


def vllm_response_acceptance(response: dict) -> Acceptance | None:
    """``metrics.speculative_decoding`` of a vLLM (>= 0.29, --per-request-spec-decode-metrics) response, or None."""
    spec = _field(response, vllm_facts.PER_REQUEST_SPEC_METRICS_FIELD)
    if not isinstance(spec, dict):
        return None
    rounds, accepted = _int(spec.get("num_spec_steps")), _int(spec.get("num_accepted_draft_tokens"))
    if rounds is None or accepted is None:
        return None
    hist = spec.get("acceptance_histogram")
    hist = list(hist) if isinstance(hist, list) and all(_int(h) is not None for h in hist) else None
    if hist is not None and (sum(hist) != rounds or sum(m * n for m, n in enumerate(hist)) != accepted):
        hist = None
    steps = _int(spec.get("num_spec_tokens"))
    return Acceptance(
        rounds=rounds,
        accepted=accepted,
        draft_tokens=_int(spec.get("num_draft_tokens")),
        histogram=hist,
        num_steps=steps or (len(hist) - 1 if hist else None),
        source="vllm-response",
    )


def sglang_response_acceptance(response: dict) -> Acceptance | None:
    """``sglext.spec_tokens_details`` of an SGLang response (asked for with ``return_spec_tokens_details``), or
    None. AL = 1 + correct drafts / verify rounds (SGLang's own ``spec_accept_length`` is not used)."""
    details = _field(response, sglang_facts.SPEC_DETAILS_RESPONSE_FIELD)
    if isinstance(details, list):  # one per choice (n > 1); this tool sends n = 1
        details = details[0] if len(details) == 1 else None
    if not isinstance(details, dict):
        return None
    rounds = _int(details.get(sglang_facts.SPEC_VERIFY_CT))
    accepted = _int(details.get(sglang_facts.SPEC_NUM_CORRECT_DRAFTS))
    if rounds is None or accepted is None:
        return None
    proposed = _int(details.get(sglang_facts.SPEC_NUM_PROPOSED_DRAFTS))
    steps = proposed // rounds if proposed is not None and rounds and proposed % rounds == 0 else None
    hist = details.get(sglang_facts.SPEC_CORRECT_DRAFTS_HISTOGRAM)
    hist = list(hist) if isinstance(hist, list) and hist and all(_int(h) is not None for h in hist) else None
    if hist is not None and (sum(hist) != rounds or sum(m * n for m, n in enumerate(hist)) != accepted):
        hist = None
    if steps is None and hist is not None:
        steps = len(hist) - 1
    return Acceptance(rounds, accepted, proposed, hist, None, steps, "sglang-response")


def tokenspeed_response_acceptance(response: dict) -> Acceptance | None:
    """``usage.completion_tokens_details.accepted_prediction_tokens`` (+ ``rejected_prediction_tokens``) of a
    TokenSpeed (smg gateway) response, or None: rounds = completion tokens - 1 - accepted."""
    details = _field(response, tokenspeed_facts.USAGE_DETAILS_FIELD)
    completion = _int(_field(response, ("usage", "completion_tokens")))
    if not isinstance(details, dict) or completion is None:
        return None
    accepted = _int(details.get(tokenspeed_facts.ACCEPTED_PREDICTION_TOKENS))
    if accepted is None:
        return None
    rounds = completion - 1 - accepted
    if rounds < 0:
        return None
    rejected = _int(details.get(tokenspeed_facts.REJECTED_PREDICTION_TOKENS))
    drafted = accepted + rejected if rejected is not None else None
    steps = drafted // rounds if drafted is not None and rounds and drafted % rounds == 0 else None
    return Acceptance(rounds, accepted, drafted, None, None, steps, "tokenspeed-usage")


# ---- TokenSpeed: the scheduler log --------------------------------------------------------------------

_NUMBER = r"[-+]?(?:[0-9]+\.?[0-9]*(?:[eE][-+]?[0-9]+)?|nan|inf)"
_TS_FINISH = re.compile(r"Req: (\S+) Finish! Accept_num_tokens_avg: (" + _NUMBER + r")\s*$")
_TS_STATS = re.compile(r"Req: (\S+) Finish! RequestStats\((.*)\)\s*$")
_TS_DECODE = re.compile(r"Decode batch\. .*?avg_accept_len: (" + _NUMBER + r")")


@dataclass
class TokenSpeedLog:
    """Acceptance lines of a TokenSpeed scheduler log: ``requests`` rid -> (accept length, output tokens or
    None); ``windows``: the avg_accept_len of each ``Decode batch.`` line."""

    requests: dict[str, tuple[float, int | None]] = field(default_factory=dict)
    windows: list[float] = field(default_factory=list)

    def find(self, rid: str) -> tuple[float, int | None] | None:
        """The line of request ``rid`` (or of ``rid-<suffix>``: the gateway's per-attempt id in PD mode)."""
        if rid in self.requests:
            return self.requests[rid]
        hits = [v for k, v in self.requests.items() if k.startswith(rid + "-")]
        return hits[0] if len(hits) == 1 else None


def parse_tokenspeed_log(text: str) -> TokenSpeedLog:
    """The acceptance lines of a TokenSpeed 0.1.1 scheduler log (formats in
    :mod:`eagle31_mla.serving.engine_facts.tokenspeed`, whatever the line prefix): ``Req: {rid} Finish!
    Accept_num_tokens_avg: X``, its ``RequestStats(..., output_tokens=N, ..., acc_len=X, ...)`` variant, and the
    ``Decode batch. ... avg_accept_len: X`` windows."""
    log = TokenSpeedLog()
    for line in text.splitlines():
        if match := _TS_FINISH.search(line):
            value = float(match[2])
            if math.isfinite(value):
                log.requests[match[1]] = (value, None)
        elif match := _TS_STATS.search(line):
            fields = dict(re.findall(r"(\w+)=([^,]*)", match[2]))
            try:
                value = float(fields.get("acc_len", "None"))
            except ValueError:
                continue  # acc_len=None: speculative decoding was off for it
            tokens = fields.get("output_tokens", "")
            if math.isfinite(value):
                log.requests[match[1]] = (value, int(tokens) if tokens.isdigit() else None)
        elif match := _TS_DECODE.search(line):
            value = float(match[1])
            if math.isfinite(value):
                log.windows.append(value)
    return log


def _log_acceptance(accept_length: float, completion_tokens: int) -> Acceptance | None:
    """Rounds and accepted drafts of a request from its logged AL = (output tokens - 1) / rounds."""
    if not accept_length > 0 or completion_tokens < 1:
        return None
    rounds = round((completion_tokens - 1) / accept_length)
    if rounds < 0 or rounds > completion_tokens - 1:
        return None
    return Acceptance(rounds, completion_tokens - 1 - rounds, source="tokenspeed-log")


# ---- statistics -------------------------------------------------------------------------------------

_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131)
_T975 += (2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042)


def t_quantile_975(df: int) -> float:
    """Student t's 97.5% quantile: a table for 1..30 degrees of freedom, the Cornish-Fisher expansion above
    (error < 1e-4 there)."""
    if df < 1:
        raise ValueError("degrees of freedom must be >= 1")
    if df <= len(_T975):
        return _T975[df - 1]
    z = 1.959963984540054
    return (
        z
        + (z**3 + z) / (4 * df)
        + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * df**2)
        + (3 * z**7 + 19 * z**5 + 17 * z**3 - 15 * z) / (384 * df**3)
    )


def _influence(items: list[Acceptance]) -> tuple[float, list[float]]:
    """The ratio estimator R = sum(a) / sum(r) and each request's linearised influence (a_i - R r_i) / mean(r)."""
    rounds = sum(a.rounds for a in items)
    produced = sum(a.rounds + a.accepted for a in items)
    ratio = produced / rounds
    mean_rounds = rounds / len(items)
    return ratio, [((a.rounds + a.accepted) - ratio * a.rounds) / mean_rounds for a in items]


def _standard_error(values: list[float]) -> float:
    n = len(values)
    mean = sum(values) / n
    return math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1) / n)


def ratio_interval(items: list[Acceptance]) -> dict[str, Any] | None:
    """The 95% interval of the run's mean accept length from per-request values (module docstring): None with
    fewer than two requests or no rounds."""
    if len(items) < 2 or sum(a.rounds for a in items) == 0:
        return None
    ratio, influence = _influence(items)
    se = _standard_error(influence)
    half = t_quantile_975(len(items) - 1) * se
    return {
        "low": ratio - half,
        "high": ratio + half,
        "half_width": half,
        "standard_error": se,
        "num_requests": len(items),
        "method": "ratio estimator over requests (delta method), Student t with n - 1 degrees of freedom",
    }


# ---- reference and verdict ----------------------------------------------------------------------------


def read_reference(path: str | Path) -> dict[str, Any]:
    """An offline ``eagle31-mla acceptance --json`` report: a JSON object whose ``total.mean_accept_length`` is a
    number >= 1; ``settings`` and ``requests`` are read when present."""
    try:
        data = json.loads(Path(path).expanduser().read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise LiveError(f"not JSON ({err})") from None
    total = data.get("total") if isinstance(data, dict) else None
    mean = total.get("mean_accept_length") if isinstance(total, dict) else None
    if not isinstance(mean, (int, float)) or isinstance(mean, bool) or not math.isfinite(mean) or mean < 1:
        raise LiveError("no total.mean_accept_length >= 1 (expected the JSON of `eagle31-mla acceptance --json`)")
    return data


def _reference_items(reference: dict) -> list[Acceptance] | None:
    requests = reference.get("requests")
    if not isinstance(requests, list) or not requests:
        return None
    items = []
    for r in requests:
        rounds = _int(r.get("num_rounds")) if isinstance(r, dict) else None
        accepted = _int(r.get("num_accepted_tokens")) if isinstance(r, dict) else None
        if rounds is None or accepted is None:
            return None
        items.append(Acceptance(rounds, accepted))
    return items


def likely_causes(measured: float, expected: float, engine: str) -> list[str]:
    """The known silent misconfigurations a drop from ``expected`` to ``measured`` fits, most likely first."""
    near_one = measured - 1 <= 0.25 * (expected - 1)
    convention = (
        "the aux layer ids read in the wrong convention (e.g. zero-based training-form ids served as one-based), "
        + (
            f"or the engine plugin not loaded where the server runs ({PLUGIN_HINT[engine]})"
            if engine in PLUGIN_HINT
            else "or --eagle3-layers-to-capture in the wrong convention"
        )
        + ", or a drafter other than the one the expected value was measured with: the drafts are almost never accepted"
    )
    stream = "the AttnRes stream instead of the prefix-only one the drafter was trained on" + (
        f" ({vllm_facts.KIMI_K3_STREAM_ENV}=1)" if engine == "vllm" else ""
    )
    off_by_one = f"aux ids off by one layer (about -{OFF_BY_ONE_COST} accept length on Kimi-K3, per the model card)"
    pd = (
        "in a PD-disaggregated deployment, a drafter KV that does not arrive as the decode side's drafter computes it "
        "(a prefill side without the drafter, with another drafter or KV dtype, or a connector that garbles it): "
        "check the pair with eagle31-mla doctor --prefill-command ... --decode-command ..."
    )
    if near_one:
        return [convention, off_by_one, stream, pd]
    return [off_by_one, stream, convention, pd]


PLUGIN_HINT = {
    "vllm": 'pip install "eagle31-mla[vllm]"; VLLM_PLUGINS must not leave it out',
    "sglang": 'pip install "eagle31-mla[sglang]"',
}


def doctor_command(server: dict[str, Any]) -> str:
    """The ``eagle31-mla doctor`` command for the deployment (DRAFT / TARGET where the server does not say)."""
    parts = [
        "eagle31-mla",
        "doctor",
        "--draft",
        server.get("draft") or "DRAFT",
        "--target",
        server.get("target") or server.get("model") or "TARGET",
        "--engine",
        server["engine"],
    ]
    version = server.get("version")
    if isinstance(version, str) and re.fullmatch(r"[0-9]+\.[0-9]+(\.[0-9]+)?([.+-][0-9A-Za-z.]+)?", version):
        parts += ["--engine-version", version]
    quoted = [p if p in ("DRAFT", "TARGET") else shlex.quote(p) for p in parts]
    return " ".join(quoted)


def _same_prompts(reference: dict, prompts: str | None) -> bool | None:
    """Whether the reference was measured on the same prompts file (by content); None when it does not say."""
    named = (reference.get("settings") or {}).get("prompts") if isinstance(reference.get("settings"), dict) else None
    if not isinstance(named, str) or prompts is None:
        return None
    try:
        return Path(named).expanduser().read_bytes() == Path(prompts).expanduser().read_bytes()
    except OSError:
        return None


def settings_differences(reference: dict, settings: dict) -> list[str]:
    """The drafting / sampling settings in which the reference and this run differ (each a phrase)."""
    ref = reference.get("settings") if isinstance(reference.get("settings"), dict) else {}
    out = []
    for key in ("temperature", "top_p", "max_new_tokens", "num_steps", "num_draft_tokens"):
        a, b = ref.get(key), settings.get(key)
        if a is None or b is None or isinstance(a, bool) or isinstance(b, bool):
            continue
        if isinstance(a, (int, float)) and isinstance(b, (int, float)) and not math.isclose(a, b):
            out.append(f"{key} {a:g} (reference) vs {b:g} (server)")
    if _same_prompts(reference, settings.get("prompts")) is False:
        out.append(f"prompts {ref.get('prompts')} (reference) vs {settings.get('prompts')} (server)")
    return out


def compare(
    report: dict[str, Any], *, expect: float | None = None, reference: dict[str, Any] | None = None
) -> dict[str, Any]:
    """The verdict of a :func:`measure_server` report against ``expect`` or an offline ``reference`` report (the
    rule is the module docstring's). Returns a JSON-ready dict: ``consistent``, ``measured``, ``expected``,
    ``difference``, ``margin``, ``method``, ``causes`` and ``doctor`` (for a drop), ``warnings``."""
    if (expect is None) == (reference is None):
        raise ValueError("compare() takes one of expect= or reference=")
    measured = report["total"]["mean_accept_length"]
    measured = float("nan") if measured is None else measured
    per_request = report["server"]["attribution"] == "per-request"
    items = [Acceptance(r["num_rounds"], r["num_accepted_tokens"]) for r in report["requests"]] if per_request else []
    warnings: list[str] = []
    half = None
    if reference is not None:
        expected = float(reference["total"]["mean_accept_length"])
        differences = settings_differences(reference, report["settings"])
        if differences:
            warnings.append("the reference was measured with other settings: " + "; ".join(differences))
        ref_items = _reference_items(reference)
        paired = (
            per_request
            and ref_items is not None
            and len(ref_items) == len(items) >= 2
            and _same_prompts(reference, report["settings"].get("prompts")) is not False
            and sum(a.rounds for a in items) > 0
            and sum(a.rounds for a in ref_items) > 0
        )
        if paired:
            _, u = _influence(items)
            _, v = _influence(ref_items)
            se = _standard_error([a - b for a, b in zip(u, v)])
            half = t_quantile_975(len(items) - 1) * se
            method = f"paired over {len(items)} requests (same prompts, request by request), 95% t interval"
        elif report.get("confidence_interval_95"):
            live = report["confidence_interval_95"]
            ref_ci = ratio_interval(ref_items) if ref_items else None
            se = math.hypot(live["standard_error"], ref_ci["standard_error"] if ref_ci else 0.0)
            df = min(live["num_requests"], ref_ci["num_requests"] if ref_ci else live["num_requests"]) - 1
            half = t_quantile_975(df) * se
            method = "both 95% intervals combined" if ref_ci else "the measured 95% interval"
        else:
            method = f"no interval (aggregate attribution): tolerance {NO_INTERVAL_TOLERANCE}"
    else:
        expected = float(expect)
        live = report.get("confidence_interval_95")
        if live:
            half = live["half_width"]
            method = "the measured 95% interval"
        else:
            method = f"no interval ({'aggregate attribution' if not per_request else 'one request'}): "
            method += f"tolerance {NO_INTERVAL_TOLERANCE}"
    margin = max(half, MIN_MARGIN) if half is not None else NO_INTERVAL_TOLERANCE
    difference = measured - expected
    consistent = math.isfinite(measured) and abs(difference) <= margin
    verdict: dict[str, Any] = {
        "consistent": consistent,
        "measured": measured,
        "expected": expected,
        "against": "reference" if reference is not None else "expect",
        "difference": difference,
        "margin": margin,
        "method": method,
        "causes": [],
        "doctor": None,
        "warnings": warnings,
    }
    if not consistent and (difference < 0 or not math.isfinite(measured)):
        verdict["causes"] = likely_causes(measured, expected, report["server"]["engine"])
        verdict["doctor"] = doctor_command(report["server"])
    elif not consistent:
        verdict["causes"] = ["higher than expected: other prompts or settings than the expectation's?"]
    return verdict


# ---- HTTP: the openai client ---------------------------------------------------------------------------


class _Client:
    """The server at ``url`` through the ``openai`` client, as users talk to it: every request bounded by
    ``timeout`` seconds (to connect, to send, and each wait for the answer: a whole generation, nothing streams),
    never retried. ``/metrics``, ``/version`` and ``/server_info`` are not OpenAI endpoints: they go through the
    client's generic ``get`` at their absolute URL (openai's way to other endpoints), so over its HTTP library with
    its timeout and its errors, which :meth:`request` maps, rather than through that library directly (httpx or
    httpx2 depending on the openai release). A context manager: leaving it closes the client's connections."""

    def __init__(self, url: str, timeout: float):
        import openai

        self.base = url.rstrip("/").removesuffix("/v1").rstrip("/")
        self.timeout = timeout
        try:  # the key vLLM's docs pass to a server started without --api-key (one with it answers HTTP 401)
            self.openai = openai.OpenAI(base_url=self.base + "/v1", api_key="EMPTY", timeout=timeout, max_retries=0)
        except Exception as err:  # noqa: BLE001 - a URL its HTTP library refuses (InvalidURL: httpx's or httpx2's)
            raise LiveError(f"cannot reach {self.base}: {err}") from None

    def __enter__(self) -> _Client:
        return self

    def __exit__(self, *exc) -> None:
        self.openai.close()

    def request(self, path: str, call: Callable[[], Any]) -> tuple[int, Any]:
        """``call()``, the openai client's request to ``path``, as (HTTP status, answer). 200 and the answer as the
        server wrote it: a typed response dumped with the API's names and the engines' own fields, which the client
        keeps as extra fields (``sglext``, ``metrics``); JSON or text otherwise (None for a body labelled JSON that
        is not). For a refusal its status and JSON body (None when not JSON). No answer is a :class:`LiveError`."""
        import openai

        try:
            answer = call()
            if isinstance(answer, openai.BaseModel):
                answer = answer.model_dump(by_alias=True, exclude_unset=True, warnings=False)
            return 200, answer
        except openai.APIStatusError as err:  # any status but 2xx
            try:
                return err.status_code, err.response.json()
            except ValueError:
                return err.status_code, None
        except openai.APITimeoutError:  # before APIConnectionError, its base class
            reason = f"no answer within {self.timeout:g} s (--timeout)"
        except openai.APIConnectionError as err:  # refused, DNS, reset, a scheme the HTTP library cannot send to
            reason = err.__cause__ or err
        except ValueError:  # json.JSONDecodeError: a 2xx answer labelled JSON that is not
            return 200, None
        raise LiveError(f"cannot reach {self.base}{path}: {reason}") from None

    def get(self, path: str, *, text: bool = False) -> tuple[int, Any]:
        """GET ``path`` (from the server's root): its JSON (a str when the answer is not JSON), or its text."""
        options: dict[str, Any] = {"headers": {"Accept": "text/plain"}} if text else {}
        cast_to = str if text else object
        return self.request(path, lambda: self.openai.get(self.base + path, cast_to=cast_to, options=options))


def _message(status: int, payload) -> str:
    """What a refusing server said, on one line."""
    detail = payload
    if isinstance(payload, dict):
        error = payload.get("error", payload.get("detail", payload.get("message")))
        detail = error.get("message", error) if isinstance(error, dict) else error
    text = " ".join(str(detail).split()) if detail is not None else ""
    return f"HTTP {status}" + (f": {text[:200]}" if text else "")


# ---- the measurement ----------------------------------------------------------------------------------


@dataclass
class _Result:
    index: int
    where: str
    prompt_tokens: int | None
    completion_tokens: int
    finish_reason: str | None
    text: str
    latency: float
    rid: str | None
    acceptance: Acceptance | None = None
    response_id: str | None = None


def _request(prompt, chat: bool) -> tuple[str, dict]:
    """The endpoint and the prompt part of the body for one prompt of a prompts file. Like the offline command's
    --chat-template, ``chat`` wraps a bare text prompt as one user message; ``messages`` always go to chat."""
    if isinstance(prompt, str):
        if chat:
            return "/v1/chat/completions", {"messages": [{"role": "user", "content": prompt}]}
        return "/v1/completions", {"prompt": prompt}
    if isinstance(prompt, list):
        return "/v1/completions", {"prompt": list(prompt)}
    key = next(key for key in ("input_ids", "messages", "prompt", "text") if key in prompt)
    if key == "messages":
        return "/v1/chat/completions", {"messages": prompt["messages"]}
    return "/v1/completions", {"prompt": prompt[key]}


def _models(client: _Client) -> list[dict]:
    # the client's get, not its models.list(): an answer that is no list of models must become the error below
    status, payload = client.get("/v1/models")
    data = payload.get("data") if isinstance(payload, dict) else None
    if status != 200 or not isinstance(data, list) or not all(isinstance(m, dict) and "id" in m for m in data):
        shown = _message(status, payload) if payload is not None else f"HTTP {status}, not JSON"
        raise LiveError(
            f"{client.base} is not an OpenAI-compatible server: GET /v1/models answered {shown}; expected "
            '{"data": [{"id": ...}]} (the URL of `vllm serve`, `sglang serve` / launch_server or `tokenspeed serve`)'
        )
    if not data:
        raise LiveError(f"{client.base} serves no model (GET /v1/models lists none)")
    return data


def _wrong_engine(engine: str, actual: str, how: str) -> LiveError:
    return LiveError(
        f"--engine {engine}, but the server at that URL looks like {ENGINE_NAMES[actual]} ({how}); "
        f"expected --engine {actual}"
    )


def _scrape(client: _Client) -> tuple[int, list[Sample]]:
    status, text = client.get("/metrics", text=True)
    return status, parse_prometheus(text) if status == 200 else []


def _min_rounds(completion_tokens: int, num_steps: int | None) -> int:
    """The fewest verification rounds that make ``completion_tokens`` (the first comes from the prefill; a round
    makes at most num_steps + 1)."""
    if completion_tokens < 2:
        return 0
    return -(-(completion_tokens - 1) // (num_steps + 1)) if num_steps else 1


def _settled_counters(client: _Client, before: VllmCounters, min_rounds: int, wait: float = 2.0) -> VllmCounters:
    """The counters once they account for at least ``min_rounds`` rounds since ``before`` and two scrapes in a
    row agree: vLLM records a step's stats right after handing its outputs over, so the last step's increments
    may land just after the response. At most ``wait`` seconds (then what is there)."""
    deadline = time.monotonic() + wait

    def scrape() -> VllmCounters:
        status, samples = _scrape(client)
        counters = vllm_counters(samples)
        if counters is None:
            raise LiveError(
                f"{client.base}/metrics stopped reporting vLLM's speculative-decoding counters (HTTP {status})"
            )
        return counters

    current = scrape()
    while time.monotonic() < deadline:
        time.sleep(0.02)
        again = scrape()
        if again == current and current.drafts - before.drafts >= min_rounds:
            return current
        current = again
    return current


def _probe_vllm(client: _Client) -> VllmCounters | None:
    """vLLM's counters at the start; None when the page has no ``vllm:`` series at all (--disable-log-stats:
    the responses' per-request metrics are then the only source)."""
    status, samples = _scrape(client)
    if status == 404:
        raise LiveError(
            f"{client.base} has no /metrics (HTTP 404), which vLLM always serves: not a vLLM server? "
            "(SGLang serves /metrics only with --enable-metrics; TokenSpeed's gateway has its own; check --engine)"
        )
    if status != 200:
        raise LiveError(f"{client.base}/metrics answered HTTP {status}; expected vLLM's Prometheus metrics")
    engines = metrics_engines(samples)
    others = sorted(engines - {"vllm"})
    if others and "vllm" not in engines:
        prefix = {"sglang": sglang_facts.METRIC_PREFIX, "tokenspeed": tokenspeed_facts.METRIC_PREFIX}[others[0]]
        raise _wrong_engine("vllm", others[0], f"its /metrics has {prefix} series and no vllm: ones")
    if any(s.name.startswith(vllm_facts.DIFFUSION_COUNTER_PREFIX) for s in samples):
        raise LiveError(
            f"{client.base} serves a diffusion model ({vllm_facts.DIFFUSION_COUNTER_PREFIX}* counters): "
            "not speculative decoding"
        )
    counters = vllm_counters(samples)
    if counters is None and "vllm" in engines:
        raise LiveError(
            f"{client.base} runs vLLM without speculative decoding: its /metrics has vllm: series but no "
            f"{vllm_facts.SPEC_DECODE_COUNTERS['drafts']}_total (start it with --speculative-config)"
        )
    return counters


def _version(client: _Client, engine: str) -> tuple[str | None, dict | None]:
    """The engine's version and (SGLang) its server arguments, when the server says; never an error."""
    try:
        if engine == "vllm":
            status, payload = client.get(vllm_facts.VERSION_PATH)
            version = payload.get("version") if status == 200 and isinstance(payload, dict) else None
            return (version if isinstance(version, str) else None), None
        if engine == "sglang":
            status, payload = client.get(sglang_facts.SERVER_INFO_PATH)
            if status == 200 and isinstance(payload, dict):
                version = payload.get("version")
                return (version if isinstance(version, str) else None), payload
    except LiveError:
        pass
    return None, None


def _no_acceptance(engine: str, where: str, response: dict, have_log: bool) -> LiveError:
    """The error for a response with two or more new tokens and none of the engine's acceptance fields."""
    if engine != "vllm" and vllm_response_acceptance(response) is not None:
        return _wrong_engine(engine, "vllm", "its response carries metrics.speculative_decoding")
    if engine != "sglang" and sglang_response_acceptance(response) is not None:
        return _wrong_engine(engine, "sglang", "its response carries sglext.spec_tokens_details")
    if engine != "tokenspeed" and tokenspeed_response_acceptance(response) is not None:
        return _wrong_engine(engine, "tokenspeed", "its usage carries accepted_prediction_tokens")
    if engine == "sglang":
        return LiveError(
            f"{where}: the response has no sglext.spec_tokens_details: the server runs without speculative "
            f"decoding ({sglang_facts.SPEC_FLAG}) or is not SGLang >= 0.5.23 (check --engine)"
        )
    if engine == "tokenspeed":
        return LiveError(
            f"{where}: the response's usage has no completion_tokens_details.accepted_prediction_tokens: the "
            "server runs without speculative decoding, or its gateway predates smg PR #2481"
            + ("" if have_log else "; pass its scheduler log with --log")
        )
    return LiveError(
        f"{where}: vLLM reports no speculative-decoding data: /metrics has no vllm: series (started with "
        f"{vllm_facts.DISABLE_LOG_STATS_FLAG}?) and the response has no metrics.speculative_decoding "
        f"({vllm_facts.PER_REQUEST_SPEC_METRICS_FLAG} summary, vLLM >= 0.29)"
    )


def _probe_server(client: _Client, engine: str, model: str | None):
    """Before any request: an OpenAI server, the model (``/v1/models``), the engine it really is (``owned_by``,
    ``/metrics`` prefixes), what it reports (vLLM's counters) and, where it says, its version, target and draft.
    Returns (model entry, vLLM counters or None, version, target, draft)."""
    served = _models(client)
    if model is None:
        if len(served) > 1:
            names = ", ".join(str(m["id"]) for m in served[:5])
            raise LiveError(f"the server serves {len(served)} models ({names}); name one with --model")
        entry = served[0]
    else:
        matches = [m for m in served if m["id"] == model]
        if not matches:
            names = ", ".join(str(m["id"]) for m in served[:5])
            raise LiveError(f"--model {model!r} is not served there; the server serves: {names}")
        entry = matches[0]
    owner = entry.get("owned_by")
    owners = {vllm_facts.MODEL_OWNER: "vllm", sglang_facts.MODEL_OWNER: "sglang"}
    if owner in owners and owners[owner] != engine:
        raise _wrong_engine(engine, owners[owner], f'GET /v1/models says owned_by "{owner}"')
    counters = None
    if engine == "vllm":
        counters = _probe_vllm(client)
    else:
        status, samples = _scrape(client)  # optional for these engines: only to catch the wrong --engine
        engines = metrics_engines(samples) if status == 200 else set()
        if "vllm" in engines and engine not in engines:
            raise _wrong_engine(engine, "vllm", "its /metrics has vllm: series")
    version, server_info = _version(client, engine)
    target = entry.get("root") if isinstance(entry.get("root"), str) else None
    draft = None
    if server_info:
        target = server_info.get("model_path") if isinstance(server_info.get("model_path"), str) else target
        draft = server_info.get("speculative_draft_model_path")
        draft = draft if isinstance(draft, str) else None
    return entry, counters, version, target, draft


def measure_server(
    url: str,
    engine: str,
    prompts: str | Path,
    *,
    concurrency: int = 1,
    max_tokens: int = 256,
    temperature: float = 0.0,
    top_p: float = 1.0,
    chat: bool = False,
    model: str | None = None,
    timeout: float = 120.0,
    log: str | Path | None = None,
    limit: int | None = None,
    ignore_eos: bool = False,
    progress: bool = False,
    expect: float | None = None,
    reference: dict[str, Any] | str | Path | None = None,
) -> dict[str, Any]:
    """Measure the accept length of the server at ``url`` (``engine``: "vllm", "sglang" or "tokenspeed") on a
    prompts file. Returns the offline report's dict (``settings``, ``total``, ``requests``; the keys of
    :func:`eagle31_mla.decoding.speculative.measure_acceptance`, None where the engine does not report a value) plus
    ``server`` (url, engine, model, version, attribution "per-request" | "aggregate", source),
    ``confidence_interval_95`` (None for aggregate runs), ``tokens_per_second``, ``wall_time_s``, ``notes``
    and, with ``expect`` or ``reference``, ``verdict`` (:func:`compare`). Raises :class:`LiveError`."""
    from ..model.modeling_eagle31_mla import check_sampling_settings
    from ..prompts import read_prompt_lines

    if engine not in ENGINES:
        raise LiveError(f"engine {engine!r}; expected one of {', '.join(ENGINES)}")
    if expect is not None and reference is not None:
        raise LiveError("give expect= or reference=, not both")
    temperature, top_p = check_sampling_settings(temperature, top_p)
    if isinstance(reference, (str, Path)):
        reference = read_reference(reference)
    lines = read_prompt_lines(prompts)[:limit]
    if not lines:
        raise LiveError(f"{prompts}: expected at least one prompt, the file has none")
    notes: list[str] = []
    with _Client(url, timeout) as client:
        entry, counters, version, target, draft = _probe_server(client, engine, model)
        log_path = Path(log).expanduser() if log is not None else None
        log_start = log_path.stat().st_size if log_path is not None else 0
        run = secrets.token_hex(4)

        def send(i: int) -> _Result:
            where, prompt = lines[i]
            endpoint, body = _request(prompt, chat)
            chat_api = endpoint == "/v1/chat/completions"
            api = client.openai.chat.completions if chat_api else client.openai.completions
            # what OpenAI's API does not have goes in extra_body: ignore_eos (a sampling option of vLLM, SGLang
            # and TokenSpeed), SGLang's return_spec_tokens_details, TokenSpeed's rid
            extra: dict[str, Any] = {"ignore_eos": True} if ignore_eos else {}
            if engine == "sglang":
                extra[sglang_facts.SPEC_DETAILS_REQUEST_FIELD] = True
            rid = None
            if engine == "tokenspeed":
                rid = extra[tokenspeed_facts.REQUEST_ID_FIELD] = f"eagle31-{run}-{i}"
            body.update(model=entry["id"], max_tokens=max_tokens, temperature=temperature, top_p=top_p, n=1)
            body["stream"] = False
            start = time.perf_counter()
            try:
                status, payload = client.request(endpoint, lambda: api.create(**body, extra_body=extra or None))
            except LiveError as err:
                raise LiveError(f"{where}: {err}") from None
            latency = time.perf_counter() - start
            if status != 200:
                raise LiveError(f"{where}: the server refused the request to {endpoint}: {_message(status, payload)}")
            usage = payload.get("usage") if isinstance(payload, dict) else None
            choices = payload.get("choices") if isinstance(payload, dict) else None
            completion = _int(usage.get("completion_tokens")) if isinstance(usage, dict) else None
            if completion is None or not isinstance(choices, list) or not choices:
                raise LiveError(
                    f"{where}: the answer of {endpoint} is not an OpenAI completion (no choices or no "
                    "usage.completion_tokens)"
                )
            choice = choices[0] if isinstance(choices[0], dict) else {}
            text = choice.get("text")
            if text is None and isinstance(choice.get("message"), dict):
                text = choice["message"].get("content")
            acceptance = {
                "vllm": vllm_response_acceptance,
                "sglang": sglang_response_acceptance,
                "tokenspeed": tokenspeed_response_acceptance,
            }[engine](payload)
            if acceptance is None and completion >= 2 and not (engine == "vllm" and counters is not None):
                if not (engine == "tokenspeed" and log_path is not None):
                    raise _no_acceptance(engine, where, payload, log_path is not None)
            if acceptance is None and completion < 2 and engine != "vllm":
                acceptance = Acceptance(0, 0, 0, source=f"{engine}-response")  # the prefill token only: no round
            return _Result(
                index=i,
                where=where,
                prompt_tokens=_int(usage.get("prompt_tokens")),
                completion_tokens=completion,
                finish_reason=choice.get("finish_reason"),
                text=text if isinstance(text, str) else "",
                latency=latency,
                rid=rid,
                acceptance=acceptance,
                response_id=payload.get("id") if isinstance(payload.get("id"), str) else None,
            )

        from tqdm.auto import tqdm

        results: dict[int, _Result] = {}
        deltas: dict[int, Acceptance] = {}
        bar = tqdm(total=len(lines), desc="acceptance", unit="req", disable=not progress, file=sys.stderr)
        run_before = counters
        request_time = 0.0
        wall_start = time.perf_counter()
        try:
            if concurrency == 1:
                before = counters
                for i in range(len(lines)):
                    result = send(i)
                    results[i] = result
                    request_time += result.latency
                    if before is not None:
                        steps = len(before.per_position) or None
                        after = _settled_counters(client, before, _min_rounds(result.completion_tokens, steps))
                        deltas[i] = after - before
                        before = after
                    _postfix(bar, results, deltas)
                    bar.update(1)
            else:
                _run_concurrently(send, len(lines), concurrency, results, bar, deltas)
                request_time = time.perf_counter() - wall_start
        finally:
            bar.close()
        wall = time.perf_counter() - wall_start
        run_delta = None
        if run_before is not None:
            steps = len(run_before.per_position) or None
            least = sum(_min_rounds(r.completion_tokens, steps) for r in results.values())
            run_delta = _settled_counters(client, run_before, least) - run_before

    # attribution
    ordered = [results[i] for i in range(len(lines))]
    source = ""
    log_summary = None
    if engine == "vllm":
        if all(r.acceptance is not None for r in ordered):
            source = "response metrics.speculative_decoding"
        elif concurrency == 1 and len(deltas) == len(ordered):
            for r in ordered:
                r.acceptance = deltas[r.index]
            source = "/metrics counters, diffed around each request"
        else:
            for r in ordered:
                r.acceptance = None
            source = "/metrics counters, diffed around the run"
        for r in ordered:
            if r.acceptance is not None and r.acceptance.source == "vllm-metrics":
                if r.acceptance.rounds > r.completion_tokens:
                    notes.append(
                        f"{r.where}: the counters moved by {r.acceptance.rounds} rounds for {r.completion_tokens} "
                        "tokens: other traffic on the server? (per-request attribution needs an idle server)"
                    )
    elif engine == "sglang":
        source = "response sglext.spec_tokens_details"
    else:
        source = "response usage.completion_tokens_details"
        if log_path is not None:
            log_summary, source = _apply_tokenspeed_log(log_path, log_start, ordered, notes, source)
        missing = [r.where for r in ordered if r.acceptance is None]
        if missing and not (log_summary and log_summary["decode_windows"]):
            raise LiveError(
                f"{len(missing)} request(s) have no acceptance, neither in their usage fields nor in the "
                f"scheduler log (first: {missing[0]})"
            )
    attributed = all(r.acceptance is not None for r in ordered)
    attribution = "per-request" if attributed else "aggregate"

    generated = sum(r.completion_tokens for r in ordered)
    if attributed:
        total_acc = _sum([r.acceptance for r in ordered])
    elif run_delta is not None:
        total_acc = run_delta
    else:
        total_acc = None
    num_steps = total_acc.num_steps if total_acc else None
    total = acceptance_dict(
        total_acc,
        generated,
        len(ordered),
        num_steps=num_steps,
        accept_length=log_summary["mean_avg_accept_len"] if log_summary and total_acc is None else None,
    )
    interval = ratio_interval([r.acceptance for r in ordered]) if attributed else None
    if attributed and interval is None:
        notes.append("one request (or no verification rounds): no confidence interval")
    elif not attributed:
        notes.append(
            "aggregate attribution (overlapping requests, and no per-request acceptance in the responses): "
            "no per-request values, no confidence interval"
        )
    requests = []
    for r in ordered:
        stats = acceptance_dict(r.acceptance, r.completion_tokens, 1, num_steps=num_steps)
        requests.append(
            {
                "index": r.index,
                "num_prompt_tokens": r.prompt_tokens,
                **stats,
                "output_ids": None,
                "finish_reason": r.finish_reason,
                "context_limited": False,
                "where": r.where,
                "text": r.text,
                "latency_s": r.latency,
                "tokens_per_second": r.completion_tokens / r.latency if r.latency > 0 else None,
            }
        )
    per_round = total["draft_tokens_per_round"]
    settings = {
        "num_steps": num_steps,
        "topk": None,
        "num_draft_tokens": per_round + 1 if isinstance(per_round, int) else None,
        "temperature": temperature,
        "top_p": top_p,
        "max_new_tokens": max_tokens,
        "seed": None,
        "eos_token_id": None,
        "target": target or entry["id"],
        "draft": draft,
        "prompts": str(prompts),
        "concurrency": concurrency,
        "chat": chat,
        "ignore_eos": ignore_eos,
    }
    report: dict[str, Any] = {
        "settings": settings,
        "total": total,
        "requests": requests,
        "server": {
            "url": client.base,
            "engine": engine,
            "model": entry["id"],
            "target": target,
            "draft": draft,
            "version": version,
            "attribution": attribution,
            "source": f"{ENGINE_NAMES[engine]} {source}",
        },
        "confidence_interval_95": interval,
        "tokens_per_second": generated / request_time if request_time > 0 else None,
        "wall_time_s": wall,
        "notes": notes,
    }
    if log_summary is not None:
        report["server"]["log"] = log_summary
    if engine == "vllm" and run_delta is not None and attributed and source.startswith("response"):
        report["server"]["counters_accept_length"] = run_delta.accept_length
    if expect is not None or reference is not None:
        report["verdict"] = compare(report, expect=expect, reference=reference)
    return report


def _postfix(bar, results: dict, deltas: dict) -> None:
    items = [r.acceptance or deltas.get(i) for i, r in results.items()]
    items = [a for a in items if a is not None]
    rounds = sum(a.rounds for a in items)
    if rounds:
        bar.set_postfix(accept_length=f"{(sum(a.accepted for a in items) + rounds) / rounds:.3f}")


def _run_concurrently(send, n: int, concurrency: int, results: dict, bar, deltas: dict) -> None:
    """``send(i)`` for i < n, ``concurrency`` at a time. The first error (or Ctrl-C) is raised here and cancels the
    requests not yet sent; those in flight are left to end (each within --timeout; the interpreter waits for them
    at exit)."""
    pool = ThreadPoolExecutor(max_workers=min(concurrency, n), thread_name_prefix="eagle31-acceptance")
    try:
        futures = {pool.submit(send, i): i for i in range(n)}
        for future in as_completed(futures):
            results[futures[future]] = future.result()
            _postfix(bar, results, deltas)
            bar.update(1)
    finally:
        pool.shutdown(wait=False, cancel_futures=True)


def _apply_tokenspeed_log(
    path: Path, start: int, ordered: list[_Result], notes: list[str], source: str
) -> tuple[dict[str, Any], str]:
    """Attribute (or check) each request from TokenSpeed's scheduler log, matched by the rid it sent."""
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError as err:
        raise LiveError(f"--log {path}: unreadable ({err.strerror or err})") from None
    whole = parse_tokenspeed_log(text)
    during = parse_tokenspeed_log(text.encode("utf-8")[start:].decode("utf-8", errors="replace"))
    matched, disagree = 0, []
    for r in ordered:
        line = whole.find(r.rid) if r.rid else None
        if line is None and r.response_id:
            line = whole.find(r.response_id)
        if line is None:
            continue
        matched += 1
        accept_length, logged_tokens = line
        from_log = _log_acceptance(accept_length, logged_tokens or r.completion_tokens)
        if r.acceptance is None or r.acceptance.source != "tokenspeed-usage":
            r.acceptance = from_log
        elif from_log is not None and from_log.rounds != r.acceptance.rounds:
            disagree.append(f"{r.where} ({from_log.rounds} vs {r.acceptance.rounds} rounds)")
    if not matched and not during.windows:
        raise LiveError(
            f"--log {path}: no TokenSpeed acceptance lines for this run (no 'Req: <rid> Finish! "
            "Accept_num_tokens_avg: ...' line for its requests and no 'Decode batch. ... avg_accept_len: ...' "
            "line written during it): the scheduler's log, at INFO, of a server with speculative decoding?"
        )
    if disagree:
        notes.append("the scheduler log and the usage fields disagree for " + ", ".join(disagree[:5]))
    if matched and any(r.acceptance is not None and r.acceptance.source == "tokenspeed-log" for r in ordered):
        source = "scheduler log (Req ... Finish! lines, matched by rid)"
    windows = during.windows
    summary = {
        "path": str(path),
        "requests_matched": matched,
        "decode_windows": len(windows),
        "mean_avg_accept_len": sum(windows) / len(windows) if windows else None,
    }
    if not all(r.acceptance is not None for r in ordered) and windows:
        source = "scheduler log (Decode batch windows: the unweighted mean of their avg_accept_len)"
    return summary, source


# ---- output -------------------------------------------------------------------------------------------


def _f(value, spec: str, missing: str = "-") -> str:
    return missing if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, spec)


def format_report(report: dict[str, Any], show_requests: int | None = None) -> str:
    """The report as text: the server, a per-request table, the totals with the interval, per-position
    acceptance and the histogram where the engine reports them, output tokens/s, the verdict."""
    server, total, settings = report["server"], report["total"], report["settings"]
    name = ENGINE_NAMES[server["engine"]] + (f" {server['version']}" if server.get("version") else "")
    lines = [
        f"{server['url']} ({name}, model {server['model']}): {total['num_requests']} requests, "
        f"concurrency {settings['concurrency']}, temperature {settings['temperature']:g}, top-p "
        f"{settings['top_p']:g}, max tokens {settings['max_new_tokens']}",
        f"acceptance: {server['source']} ({server['attribution']})",
        "",
        f"{'#':>4}  {'prompt':<24} {'tokens':>6} {'rounds':>6} {'accepted':>8} {'accept len':>10} {'tok/s':>8}",
    ]
    requests = report["requests"]
    shown = requests if show_requests is None else requests[:show_requests]
    for r in shown:
        where = r["where"] if len(r["where"]) <= 24 else "..." + r["where"][-21:]
        lines.append(
            f"{r['index']:>4}  {where:<24} {r['num_generated_tokens']:>6} {_f(r['num_rounds'], 'd'):>6} "
            f"{_f(r['num_accepted_tokens'], 'd'):>8} {_f(r['mean_accept_length'], '.3f'):>10} "
            f"{_f(r['tokens_per_second'], '.1f'):>8}"
        )
    if len(shown) < len(requests):
        lines.append(f"      ... {len(requests) - len(shown)} more in the JSON report")
    steps = total["num_steps"]
    per_round = total["draft_tokens_per_round"]
    lines += [
        "",
        f"requests {total['num_requests']}, generated tokens {total['num_generated_tokens']}, verification rounds "
        f"{_f(total['num_rounds'], 'd')}, {_f(per_round, 'g', '?')} draft tokens per round "
        f"({_f(steps, 'd', '?')} steps)",
    ]
    interval = report["confidence_interval_95"]
    if interval:
        ci = (
            f"95% CI [{interval['low']:.3f}, {interval['high']:.3f}] (ratio estimator over "
            f"{interval['num_requests']} requests, t interval)"
        )
    elif server["attribution"] == "per-request":
        ci = "no confidence interval (one request)"
    else:
        ci = "no confidence interval (aggregate attribution: no per-request values)"
    lines.append(f"mean accept length          {_f(total['mean_accept_length'], '.3f')}  {ci}")
    if total["draft_tokens_per_generated_token"] is not None:
        lines.append(f"draft tokens per new token  {total['draft_tokens_per_generated_token']:.3f}")
    lines.append(
        f"output tokens/s             {_f(report['tokens_per_second'], '.1f')}  "
        f"({total['num_generated_tokens']} tokens, requests in flight {report['wall_time_s']:.2f} s wall)"
    )
    if server.get("log"):
        log = server["log"]
        lines.append(
            f"scheduler log               {log['requests_matched']} requests matched, {log['decode_windows']} decode "
            f"windows (mean avg_accept_len {_f(log['mean_avg_accept_len'], '.2f')})"
        )
    rates = total["acceptance_rate_per_position"]
    if rates:
        lines += ["", f"{'position':>8}  {'acceptance rate':>15}"]
        lines += [f"{j + 1:>8}  {rate:>15.3f}" for j, rate in enumerate(rates)]
    hist = total["accept_histogram"]
    if hist and total["num_rounds"]:
        lines += ["", f"{'accepted':>8}  {'rounds':>8}  {'share':>6}  histogram"]
        for m, n in enumerate(hist):
            share = n / total["num_rounds"]
            lines.append(f"{m:>8}  {n:>8}  {share:>6.3f}  {'#' * round(40 * share)}")
    for note in report.get("notes", []):
        lines.append(f"note: {note}")
    verdict = report.get("verdict")
    if verdict:
        lines.append("")
        lines += format_verdict(verdict)
    return "\n".join(lines)


def format_verdict(verdict: dict[str, Any]) -> list[str]:
    what = "the reference" if verdict["against"] == "reference" else "the expected"
    head = (
        f"verdict: consistent with {what} {verdict['expected']:.3f}"
        if verdict["consistent"]
        else f"verdict: NOT consistent with {what} {verdict['expected']:.3f}"
    )
    lines = [
        f"{head}: measured {_f(verdict['measured'], '.3f')}, difference {verdict['difference']:+.3f}, allowed "
        f"+-{verdict['margin']:.3f} ({verdict['method']})"
    ]
    if verdict["causes"]:
        if verdict["doctor"]:
            lines.append("likely cause (a silent misconfiguration; most likely first):")
        lines += [f"  - {cause}" for cause in verdict["causes"]]
    if verdict["doctor"]:
        lines.append(f"check the deployment: {verdict['doctor']}")
        if "DRAFT" in verdict["doctor"].split() or "TARGET" in verdict["doctor"].split():
            lines.append("  (DRAFT / TARGET: the drafter and target folders or Hub ids the server was started with)")
    return lines


def write_json_atomic(path: str | Path, data: Any) -> None:
    """``data`` as JSON at ``path``: written to a temporary file beside it, then moved over it (os.replace), so a
    reader never sees half a report and a failure leaves any earlier file as it was."""
    path = Path(path).expanduser()
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.absolute().parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(json.dumps(data, indent=2, allow_nan=True) + "\n")
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
