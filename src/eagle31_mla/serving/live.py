"""Accept length of a running deployment: ``eagle31-mla acceptance --server URL`` (no model loaded here).

Prompts go to the server's OpenAI endpoints through the ``openai`` client (each answer bounded by ``timeout``, never
retried), ``concurrency`` at a time. Acceptance is read as each engine reports it (facts: :mod:`.engine_facts`):
**vLLM** its ``/metrics`` spec-decode counters diffed around each request at concurrency 1 (the server otherwise
idle) or around the run, or a response's ``metrics.speculative_decoding``; **SGLang** ``sglext.spec_tokens_details``
(AL = 1 + correct drafts / verify_ct); **TokenSpeed** ``usage.completion_tokens_details.accepted_prediction_tokens``
and, with ``log=``, the scheduler log (``Req: {rid} Finish!`` lines matched by the rid sent, ``Decode batch.``).

**95% interval** (n >= 2): R = sum(a_i) / sum(r_i), se = sd(a_i - R r_i) / (sqrt(n) mean(r_i)) (delta method),
R +- t(0.975, n - 1) se. **Verdict** against ``expect`` or an offline ``reference``: consistent when |measured -
expected| <= max(h, :data:`MIN_MARGIN`), h the 95% half-width (paired request by request on the same prompts), or
:data:`NO_INTERVAL_TOLERANCE` without one; a drop names the likely misconfiguration and the ``doctor`` command.
Every failure is a one-line :class:`LiveError` (the CLI exits 2 and writes nothing).
"""

from __future__ import annotations

import json
import math
import re
import secrets
import shlex
import statistics
import sys
import threading
import time
from collections import Counter
from concurrent.futures import Future, ThreadPoolExecutor, as_completed
from contextlib import suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from .engine_facts import (
    ENGINE_NAMES,
    PLUGIN_INSTALL,
    sglang as sglang_facts,
    tokenspeed as ts_facts,
    vllm as vllm_facts,
)

#: The smallest margin a verdict allows: below it two measurements are the same number.
MIN_MARGIN = 0.02
#: The margin without an interval: a third of aux ids off by one's cost on Kimi-K3 (OFF_BY_ONE_COST, the model card).
NO_INTERVAL_TOLERANCE = 0.1
OFF_BY_ONE_COST = 0.35
_FACTS = {"vllm": vllm_facts, "sglang": sglang_facts, "tokenspeed": ts_facts}


class LiveError(ValueError):
    """The server, the input or a response cannot give a measurement: one line (the CLI exits 2)."""


@dataclass
class Acceptance:
    """What an engine reported for a request or a run (vLLM's cumulative counters too): verification ``rounds``,
    ``accepted`` drafts (the bonus token excluded), ``draft_tokens`` proposed; where known, ``histogram`` (m: rounds
    that accepted m drafts), ``per_position`` (rounds whose draft at depth j + 1 was accepted), ``num_steps``."""

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
        return self.histogram + [0] * (num_steps + 1 - len(self.histogram))

    def positions(self, num_steps: int | None) -> list[int] | None:
        if self.per_position is not None:
            return self.per_position + [0] * max(0, (num_steps or 0) - len(self.per_position))
        hist = self.padded_histogram(num_steps)
        return None if hist is None else [sum(hist[j + 1 :]) for j in range(len(hist) - 1)]


def _int(value) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def _text(value) -> str | None:
    return value if isinstance(value, str) else None


def _field(obj, path: tuple[str, ...]):
    for key in path:
        obj = obj.get(key) if isinstance(obj, dict) else None
    return obj


def _histogram(hist, rounds: int, accepted: int) -> list[int] | None:
    """A reported histogram if it is these rounds' (summing to the rounds and the accepted drafts), else None."""
    if not isinstance(hist, list) or not hist or any(_int(h) is None for h in hist):
        return None
    return list(hist) if sum(hist) == rounds and sum(m * n for m, n in enumerate(hist)) == accepted else None


def _per_round(drafted: int | None, rounds: int) -> int | None:
    return drafted // rounds if drafted is not None and rounds and drafted % rounds == 0 else None


def acceptance_dict(acc: Acceptance | None, generated: int, requests: int, steps=None, mean=None) -> dict[str, Any]:
    """:meth:`~eagle31_mla.decoding.speculative.AcceptanceStats.to_dict` of what a server reported: its keys, and its
    numbers where the engine reports a histogram. What the engine does not report is None, and so is the mean of no
    rounds (offline NaN: None keeps the JSON strict); ``mean`` stands in without rounds (log windows)."""
    from ..decoding.speculative import AcceptanceStats

    steps = steps if steps is not None else acc.num_steps if acc else None
    out = {**dict.fromkeys(AcceptanceStats(0, 0).to_dict()), "mean_accept_length": mean}
    out.update(num_requests=requests, num_steps=steps, num_generated_tokens=generated)
    if acc is None:
        return out
    rounds, drafted, hist = acc.rounds, acc.draft_tokens, acc.padded_histogram(steps)
    per_round, positions = _per_round(drafted, rounds), acc.positions(steps)
    if hist is not None and per_round is not None and steps == len(hist) - 1:
        stats = AcceptanceStats(steps, per_round, hist, generated, requests).to_dict()
        return {k: None if isinstance(v, float) and math.isnan(v) else v for k, v in stats.items()}
    out.update(num_rounds=rounds, num_draft_tokens=drafted, num_accepted_tokens=acc.accepted, accept_histogram=hist)
    out.update(draft_tokens_per_round=per_round or (drafted / rounds if rounds and drafted else None))
    out.update(mean_accept_length=acc.accept_length if rounds else None)
    out.update(acceptance_rate_per_position=[p / rounds for p in positions] if positions and rounds else None)
    out.update(draft_tokens_per_generated_token=drafted / generated if drafted and generated else None)
    return out


def _sum(items: list[Acceptance]) -> Acceptance:
    steps = max((a.num_steps for a in items if a.num_steps is not None), default=None)

    def columns(rows: list) -> list[int] | None:
        ok = rows and all(r is not None and len(r) == len(rows[0]) for r in rows)
        return [sum(col) for col in zip(*rows)] if ok else None

    rounds, accepted = sum(a.rounds for a in items), sum(a.accepted for a in items)
    drafted = None if any(a.draft_tokens is None for a in items) else sum(a.draft_tokens for a in items)
    hist, pos = columns([a.padded_histogram(steps) for a in items]), columns([a.positions(steps) for a in items])
    return Acceptance(rounds, accepted, drafted, hist, pos, steps, items[0].source if items else "")


def parse_prometheus(text: str) -> list:
    """The samples of a Prometheus text page (prometheus_client's parser): a page it cannot read is a LiveError."""
    from prometheus_client.parser import text_string_to_metric_families

    try:
        return [s for family in text_string_to_metric_families(text) for s in family.samples]
    except ValueError as err:
        raise LiveError(f"the server's /metrics page is not Prometheus text: {err}") from None


def vllm_counters(samples: list) -> Acceptance | None:
    """vLLM's spec-decode counters (``_total`` or bare) summed over every label but ``position``, as a cumulative
    :class:`Acceptance` (rounds = drafts); None without a drafts counter."""
    names = vllm_facts.SPEC_DECODE_COUNTERS
    keys = {names[k]: k for k in ("drafts", "draft_tokens", "accepted_tokens")}
    totals, per_pos = Counter(), Counter()
    for s in samples:
        base = s.name.removesuffix("_total")
        if base in keys or base == names["accepted_tokens_per_pos"]:
            if not (math.isfinite(s.value) and s.value >= 0 and s.value == int(s.value)):
                raise LiveError(f"/metrics: {s.name} is {s.value!r}; a counter is a non-negative integer")
        position = s.labels.get(vllm_facts.SPEC_DECODE_POSITION_LABEL, "")
        if base == names["accepted_tokens_per_pos"] and position.isdigit():
            per_pos[int(position)] += s.value
        elif base in keys:
            totals[keys[base]] += s.value
    if "drafts" not in totals:
        return None
    k = max(per_pos, default=-1) + 1
    counts = [round(totals[key]) for key in ("drafts", "accepted_tokens", "draft_tokens")]
    return Acceptance(*counts, per_position=[round(per_pos[j]) for j in range(k)], num_steps=k or None)


def _check_counts(rounds: int, accepted: int, drafted: int | None, positions, what: str) -> None:
    """Counts that contradict each other are a server's error, never a report: accepted drafts within the drafts
    proposed, each position's within the rounds."""
    if drafted is not None and accepted > drafted:
        raise LiveError(f"{what} accepted {accepted} draft tokens of {drafted} proposed: impossible counts")
    if any(p > rounds for p in positions or ()):
        raise LiveError(f"{what} accepted more drafts at one position ({max(positions)}) than rounds ({rounds})")


def _counter_delta(after: Acceptance, before: Acceptance) -> Acceptance:
    """What the counters moved by; a chain's histogram rebuilt from the per-position counts where they are one's:
    hist[m] = count(>= m) - count(>= m + 1), count(>= 0) = rounds."""
    k = max(len(after.per_position), len(before.per_position))
    pos = [a - b for a, b in zip(after.per_position + [0] * k, before.per_position + [0] * k)][:k]
    rounds, accepted = after.rounds - before.rounds, after.accepted - before.accepted
    drafted = after.draft_tokens - before.draft_tokens
    if min(rounds, accepted, drafted, *pos) < 0:
        raise LiveError(
            f"/metrics: the spec-decode counters went down between two scrapes (drafts {before.rounds} -> "
            f"{after.rounds}, accepted {before.accepted} -> {after.accepted}): the server restarted? Measure again"
        )
    _check_counts(rounds, accepted, drafted, pos, "/metrics: the spec-decode counters")
    counts = [rounds, *pos, 0]
    chain = k and sum(pos) == accepted and all(b <= a for a, b in zip(counts, counts[1:]))
    hist = [counts[m] - counts[m + 1] for m in range(k + 1)] if chain else None
    return Acceptance(rounds, accepted, drafted, hist, pos if k else None, k or None, "vllm-metrics")


def _reported(details, keys: tuple[str, str, str, str], steps_key: str | None, source: str) -> Acceptance | None:
    """An engine's per-request fields ``keys``: rounds, accepted drafts, drafts proposed, histogram; the steps from
    ``steps_key`` or else the drafts per round, else the histogram's length."""
    rounds, accepted, drafted = (_int(_field(details, (key,))) for key in keys[:3])
    if rounds is None or accepted is None:
        return None
    hist = _histogram(details.get(keys[3]), rounds, accepted)
    steps = _int(details.get(steps_key)) if steps_key else _per_round(drafted, rounds)
    return Acceptance(rounds, accepted, drafted, hist, None, steps or (len(hist) - 1 if hist else None), source)


def vllm_response_acceptance(response: dict) -> Acceptance | None:
    """``metrics.speculative_decoding`` of a vLLM (>= 0.29, --per-request-spec-decode-metrics) response, or None."""
    spec = _field(response, vllm_facts.PER_REQUEST_SPEC_METRICS_FIELD)
    keys = ("num_spec_steps", "num_accepted_draft_tokens", "num_draft_tokens", "acceptance_histogram")
    return _reported(spec, keys, "num_spec_tokens", "vllm-response")


def sglang_response_acceptance(response: dict) -> Acceptance | None:
    """``sglext.spec_tokens_details`` of an SGLang response, or None."""
    details = _field(response, sglang_facts.SPEC_DETAILS_RESPONSE_FIELD)
    if isinstance(details, list):  # one per choice (n > 1); this tool sends n = 1
        details = details[0] if len(details) == 1 else None
    keys = (sglang_facts.SPEC_VERIFY_CT, sglang_facts.SPEC_NUM_CORRECT_DRAFTS, sglang_facts.SPEC_NUM_PROPOSED_DRAFTS)
    return _reported(details, (*keys, sglang_facts.SPEC_CORRECT_DRAFTS_HISTOGRAM), None, "sglang-response")


def tokenspeed_response_acceptance(response: dict) -> Acceptance | None:
    """``usage.completion_tokens_details.accepted_prediction_tokens`` (+ ``rejected_prediction_tokens``) of a
    TokenSpeed response, or None: rounds = completion tokens - 1 - accepted."""
    details = _field(response, ts_facts.USAGE_DETAILS_FIELD)
    completion = _int(_field(response, ("usage", "completion_tokens")))
    accepted = _int(_field(details, (ts_facts.ACCEPTED_PREDICTION_TOKENS,)))
    if completion is None or accepted is None or completion - 1 - accepted < 0:
        return None
    rejected = _int(details.get(ts_facts.REJECTED_PREDICTION_TOKENS))
    drafted = accepted + rejected if rejected is not None else None
    rounds = completion - 1 - accepted
    return Acceptance(rounds, accepted, drafted, None, None, _per_round(drafted, rounds), "tokenspeed-usage")


_READERS = {"vllm": vllm_response_acceptance, "sglang": sglang_response_acceptance}
_READERS["tokenspeed"] = tokenspeed_response_acceptance

_NUMBER = r"[-+]?[0-9]+\.?[0-9]*(?:[eE][-+]?[0-9]+)?"
_TS_FINISH = re.compile(rf"Req: (\S+) Finish! (?:Accept_num_tokens_avg: ({_NUMBER})|RequestStats\((.*)\))\s*$")
_TS_DECODE = re.compile(rf"Decode batch\. .*?avg_accept_len: ({_NUMBER})")


@dataclass
class TokenSpeedLog:
    """``requests``: rid -> (accept length, output tokens or None); ``windows``: the ``Decode batch.`` lines'
    avg_accept_len."""

    requests: dict[str, tuple[float, int | None]] = field(default_factory=dict)
    windows: list[float] = field(default_factory=list)

    def find(self, rid: str) -> tuple[float, int | None] | None:
        """The line of ``rid`` (or of ``rid-<suffix>``: the gateway's per-attempt id in PD mode)."""
        hits = [v for k, v in self.requests.items() if k.startswith(rid + "-")]
        return self.requests.get(rid, hits[0] if len(hits) == 1 else None)


def parse_tokenspeed_log(text: str) -> TokenSpeedLog:
    """The acceptance lines of a TokenSpeed 0.1.1 scheduler log, whatever the line prefix (formats in
    :mod:`eagle31_mla.serving.engine_facts.tokenspeed`): ``Req: {rid} Finish! Accept_num_tokens_avg: X``, its
    ``RequestStats(..., output_tokens=N, ..., acc_len=X, ...)`` variant and ``Decode batch. ... avg_accept_len: X``."""
    log = TokenSpeedLog()
    for line in text.splitlines():
        if match := _TS_FINISH.search(line):
            stats = dict(re.findall(r"(\w+)=([^,]*)", match[3] or ""))
            value, tokens = match[2] or stats.get("acc_len", ""), stats.get("output_tokens", "")
            if re.fullmatch(_NUMBER, value) and math.isfinite(float(value)):  # acc_len=None: speculation off
                log.requests[match[1]] = (float(value), int(tokens) if tokens.isdigit() else None)
        elif (match := _TS_DECODE.search(line)) and math.isfinite(float(match[1])):
            log.windows.append(float(match[1]))
    return log


def _log_acceptance(accept_length: float, completion_tokens: int) -> Acceptance | None:
    """Rounds and accepted drafts of a request from its logged AL = (output tokens - 1) / rounds."""
    rounds = round((completion_tokens - 1) / accept_length) if accept_length > 0 and completion_tokens else -1
    return Acceptance(rounds, completion_tokens - 1 - rounds, source="tokenspeed-log") if rounds >= 0 else None


_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131)
_T975 += (2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042)


def t_quantile_975(df: int) -> float:
    """Student t's 97.5% quantile: a table to 30 degrees of freedom, Cornish-Fisher above (error < 1e-4)."""
    if df <= len(_T975):
        return _T975[df - 1]
    z = 1.959963984540054
    terms = ((z**3 + z) / 4, (5 * z**5 + 16 * z**3 + 3 * z) / 96, (3 * z**7 + 19 * z**5 + 17 * z**3 - 15 * z) / 384)
    return z + sum(term / df ** (k + 1) for k, term in enumerate(terms))


def _influence(nums: list[float], dens: list[float]) -> list[float]:
    """Each request's linearised influence on R = sum(num) / sum(den): (num_i - R den_i) / mean(den)."""
    ratio, mean_den = sum(nums) / sum(dens), sum(dens) / len(dens)
    return [(a - ratio * r) / mean_den for a, r in zip(nums, dens)]


def _lengths(items: list[Acceptance]) -> tuple[list[int], list[int]]:
    """Accept length's numerator (tokens per round: accepted + bonus) and denominator (rounds), per request."""
    return [a.rounds + a.accepted for a in items], [a.rounds for a in items]


def _standard_error(values: list[float]) -> float:
    return statistics.stdev(values) / math.sqrt(len(values))


def ratio_half_width(nums: list[float], dens: list[float]) -> float | None:
    """The 95% half-width of sum(num) / sum(den) over requests (module docstring); None under two or no den."""
    if len(nums) < 2 or not sum(dens):
        return None
    return t_quantile_975(len(nums) - 1) * _standard_error(_influence(nums, dens))


def paired_half_width(a: list[Acceptance], b: list[Acceptance]) -> float | None:
    """The 95% half-width of accept length B - A measured on the same requests (paired: each request's influence
    on B minus its influence on A); None under two requests or without rounds on either side."""
    if len(a) != len(b) or len(a) < 2 or not _sum(a).rounds or not _sum(b).rounds:
        return None
    return t_quantile_975(len(a) - 1) * _standard_error(
        [x - y for x, y in zip(_influence(*_lengths(b)), _influence(*_lengths(a)))]
    )


def ratio_interval(items: list[Acceptance]) -> dict[str, Any] | None:
    """The 95% interval of the mean accept length (module docstring); None under two requests or no rounds."""
    if len(items) < 2 or sum(a.rounds for a in items) == 0:
        return None
    ratio, se = _sum(items).accept_length, _standard_error(_influence(*_lengths(items)))
    half = t_quantile_975(len(items) - 1) * se
    method = "ratio estimator over requests (delta method), Student t with n - 1 degrees of freedom"
    return dict(
        low=ratio - half, high=ratio + half, half_width=half, standard_error=se, num_requests=len(items), method=method
    )


def read_reference(path: str | Path) -> dict[str, Any]:
    """An offline ``eagle31-mla acceptance --json`` report: JSON whose ``total.mean_accept_length`` is a number >= 1."""
    try:
        data = json.loads(Path(path).expanduser().read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise LiveError(f"not JSON ({err})") from None
    mean = _field(data, ("total", "mean_accept_length"))
    if not isinstance(mean, (int, float)) or isinstance(mean, bool) or not math.isfinite(mean) or mean < 1:
        raise LiveError("no total.mean_accept_length >= 1 (expected the JSON of `eagle31-mla acceptance --json`)")
    return data


def _reference_items(reference: dict) -> list[Acceptance] | None:
    requests = reference.get("requests")
    if not isinstance(requests, list) or not requests:
        return None
    items = [Acceptance(_int(_field(r, ("num_rounds",))), _int(_field(r, ("num_accepted_tokens",)))) for r in requests]
    return None if any(a.rounds is None or a.accepted is None for a in items) else items


def likely_causes(measured: float, expected: float, engine: str) -> list[str]:
    """The known silent misconfigurations a drop from ``expected`` to ``measured`` fits, most likely first."""
    plugin = PLUGIN_INSTALL[engine] + ("; VLLM_PLUGINS must not leave it out" if engine == "vllm" else "")
    where = f"or the engine plugin not loaded where the server runs ({plugin})"
    convention = (
        "the aux layer ids read in the wrong convention (e.g. zero-based training-form ids served as one-based), "
        + ("or --eagle3-layers-to-capture in the wrong convention" if engine == "tokenspeed" else where)
        + ", or a drafter other than the one the expected value was measured with: the drafts are almost never accepted"
    )
    env = f" ({vllm_facts.KIMI_K3_STREAM_ENV}=1)" if engine == "vllm" else ""
    stream = "the AttnRes stream instead of the prefix-only one the drafter was trained on" + env
    off_by_one = f"aux ids off by one layer (about -{OFF_BY_ONE_COST} accept length on Kimi-K3, per the model card)"
    pd = (
        "in a PD-disaggregated deployment, a drafter KV that does not arrive as the decode side's drafter computes it "
        "(a prefill side without the drafter, with another drafter or KV dtype, or a connector that garbles it): "
        "check the pair with eagle31-mla doctor --prefill-command ... --decode-command ..."
    )
    near_one = measured - 1 <= 0.25 * (expected - 1)  # the drafts are almost never accepted
    return [convention, off_by_one, stream, pd] if near_one else [off_by_one, stream, convention, pd]


def doctor_command(server: dict[str, Any]) -> str:
    """The ``eagle31-mla doctor`` command for the deployment (DRAFT / TARGET where the server does not say)."""
    target = server.get("target") or server.get("model")
    draft, target = [shlex.quote(x) if x else name for x, name in ((server.get("draft"), "DRAFT"), (target, "TARGET"))]
    command = f"eagle31-mla doctor --draft {draft} --target {target} --engine {server['engine']}"
    version = server.get("version")
    if isinstance(version, str) and re.fullmatch(r"[0-9]+\.[0-9]+(\.[0-9]+)?([.+-][0-9A-Za-z.]+)?", version):
        command += f" --engine-version {version}"
    return command


def _same_prompts(reference: dict, prompts: str | None) -> bool | None:
    """Whether the reference was measured on the same prompts file (by content); None when it does not say."""
    named = _field(reference, ("settings", "prompts"))
    try:
        return Path(named).expanduser().read_bytes() == Path(prompts).expanduser().read_bytes()
    except (OSError, TypeError):  # TypeError: not a path
        return None


def settings_differences(reference: dict, settings: dict) -> list[str]:
    """The drafting / sampling settings in which the reference and this run differ (each a phrase)."""
    ref = reference.get("settings") if isinstance(reference.get("settings"), dict) else {}
    out = []
    for key in ("temperature", "top_p", "max_new_tokens", "num_steps", "num_draft_tokens"):
        a, b = ref.get(key), settings.get(key)
        if all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in (a, b)) and not math.isclose(a, b):
            out.append(f"{key} {a:g} (reference) vs {b:g} (server)")
    if _same_prompts(reference, settings.get("prompts")) is False:
        out.append(f"prompts {ref.get('prompts')} (reference) vs {settings.get('prompts')} (server)")
    return out


def compare(report: dict[str, Any], *, expect: float | None = None, reference: dict | None = None) -> dict[str, Any]:
    """The verdict of a :func:`measure_server` report against ``expect`` or an offline ``reference`` report (the rule
    is the module docstring's)."""
    measured = report["total"]["mean_accept_length"] or float("nan")  # None: no rounds
    per_request = report["server"]["attribution"] == "per-request"
    items = [Acceptance(r["num_rounds"], r["num_accepted_tokens"]) for r in report["requests"]] if per_request else []
    live, warnings, half = report.get("confidence_interval_95"), [], None
    why = "one request" if per_request else "aggregate attribution"
    method = f"no interval ({why}): tolerance {NO_INTERVAL_TOLERANCE}"
    if reference is not None:
        expected = float(reference["total"]["mean_accept_length"])
        if differences := settings_differences(reference, report["settings"]):
            warnings.append("the reference was measured with other settings: " + "; ".join(differences))
        ref_items = _reference_items(reference) or []
        same = _same_prompts(reference, report["settings"].get("prompts")) is not False
        if same and (half := paired_half_width(ref_items, items)) is not None:
            method = f"paired over {len(items)} requests (same prompts, request by request), 95% t interval"
        elif live:
            ref_ci = ratio_interval(ref_items) or {"standard_error": 0.0, "num_requests": live["num_requests"]}
            se = math.hypot(live["standard_error"], ref_ci["standard_error"])
            half = t_quantile_975(min(live["num_requests"], ref_ci["num_requests"]) - 1) * se
            method = "both 95% intervals combined" if ref_ci["standard_error"] else "the measured 95% interval"
    else:
        expected = float(expect)
        if live:
            half, method = live["half_width"], "the measured 95% interval"
    margin = max(half, MIN_MARGIN) if half is not None else NO_INTERVAL_TOLERANCE
    difference = measured - expected
    consistent = math.isfinite(measured) and abs(difference) <= margin
    against = "reference" if reference is not None else "expect"
    verdict = dict(consistent=consistent, measured=measured, expected=expected, against=against, difference=difference)
    verdict.update(margin=margin, method=method, causes=[], doctor=None, warnings=warnings)
    if not consistent and (difference < 0 or not math.isfinite(measured)):
        verdict["causes"] = likely_causes(measured, expected, report["server"]["engine"])
        verdict["doctor"] = doctor_command(report["server"])
    elif not consistent:
        verdict["causes"] = ["higher than expected: other prompts or settings than the expectation's?"]
    return verdict


class _Refused(Exception):
    """An answer the client stops taking: too large, or from another origin."""


def _CappedTransport():
    """httpx's transport, each answer's body refused once past :data:`MAX_ANSWER_BYTES` as it streams in."""
    import httpx

    class Capped(httpx.HTTPTransport):
        def handle_request(self, request):
            request.headers["Accept-Encoding"] = "identity"  # httpx decodes after the transport: cap what is held
            response, body = super().handle_request(request), bytearray()
            try:
                encoding = response.headers.get("Content-Encoding", "identity")
                if encoding != "identity":
                    raise _Refused(f"an answer in Content-Encoding {encoding}, not the identity asked for: refused")
                for chunk in response.stream:
                    body += chunk
                    if len(body) > MAX_ANSWER_BYTES:
                        raise _Refused(f"an answer larger than {MAX_ANSWER_BYTES >> 20} MiB: refused")
            finally:
                response.stream.close()
            response.stream = httpx.ByteStream(bytes(body))
            return response

    return Capped(limits=httpx.Limits(max_connections=None))  # httpx's default 100 would queue --concurrency 1024


#: The most bytes one answer of a server may take (vLLM's /metrics is ~100 KB; a completion less): a larger one is
#: refused as it streams in, never held.
MAX_ANSWER_BYTES = 64 * 2**20


def redacted_url(url: str) -> str:
    """``url`` as printed and written: credentials in it are ``***``."""
    return re.sub(r"^([A-Za-z][A-Za-z0-9+.-]*://)[^/?#]*@", r"\1***@", url)


class _Client:
    """The server at ``url`` through the ``openai`` client: every request bounded as a whole by ``timeout`` seconds
    (connect, headers and body together: httpx bounds each read only, so a server sending a byte at a time would
    never time out) and by :data:`MAX_ANSWER_BYTES`, never retried, redirected only within the server's origin;
    ``/metrics``, ``/version`` and ``/server_info`` through its generic ``get``, so with the same bounds and errors.
    ``shown`` is the URL as printed and written: credentials in it are ``***``."""

    def __init__(self, url: str, timeout: float):
        import httpx
        import openai

        self.base, self.timeout = url.rstrip("/").removesuffix("/v1").rstrip("/"), timeout
        parts = urlsplit(self.base)
        self.secret, self.shown = parts.password or parts.username, redacted_url(self.base)

        def same_origin(request) -> None:  # as httpx normalises it: LOCALHOST is localhost, http://h:80 is http://h
            if (request.url.scheme, request.url.host, request.url.port) != (home.scheme, home.host, home.port):
                at = f"{request.url.scheme}://{request.url.netloc.decode().rsplit('@', 1)[-1]}"
                raise _Refused(f"redirected to {at}, another origin than {parts.scheme}://{parts.hostname}: refused")

        try:  # the key vLLM's docs pass to a server started without --api-key (one with it answers HTTP 401)
            home = httpx.URL(self.base)
            http = httpx.Client(
                transport=_CappedTransport(), follow_redirects=True, event_hooks={"request": [same_origin]}
            )
            self.openai = openai.OpenAI(
                base_url=self.base + "/v1", api_key="EMPTY", timeout=timeout, max_retries=0, http_client=http
            )
        except Exception as err:  # noqa: BLE001 - a URL its HTTP library refuses (InvalidURL: httpx's or httpx2's)
            raise LiveError(self._redacted(f"cannot reach {self.shown}: {err}")) from None

    def _redacted(self, text: str) -> str:
        return text.replace(self.base, self.shown).replace(self.secret, "***") if self.secret else text

    def _within_deadline(self, call):
        """``call()`` in a daemon thread, given up after ``timeout`` s (the thread ends when the client closes)."""
        answer = Future()

        def run() -> None:
            try:
                answer.set_result(call())
            except BaseException as err:  # noqa: BLE001 - re-raised in the caller's thread
                answer.set_exception(err)

        threading.Thread(target=run, daemon=True, name="eagle31-request").start()
        return answer.result(self.timeout)  # a TimeoutError past it

    def request(self, path: str, call) -> tuple[int, Any]:
        """``call()``, the client's request to ``path``, as (HTTP status, answer: a typed one dumped with the engines'
        extra fields; a refusal's JSON body or None). No answer is a :class:`LiveError`."""
        import openai

        try:
            answer = self._within_deadline(call)
            if isinstance(answer, openai.BaseModel):
                answer = answer.model_dump(by_alias=True, exclude_unset=True, warnings=False)
            return 200, answer
        except openai.APIStatusError as err:  # any status but 2xx
            try:
                return err.status_code, err.response.json()
            except ValueError:
                return err.status_code, None
        except (openai.APITimeoutError, TimeoutError):  # before APIConnectionError, its base class
            reason = f"no answer within {self.timeout:g} s (--timeout)"
        except openai.APIConnectionError as err:  # refused, DNS, reset, a scheme the HTTP library cannot send to
            reason = err.__cause__ or err
        except _Refused as err:  # raised while the body streams in, past openai's wrapping
            reason = err
        except ValueError:  # json.JSONDecodeError: a 2xx answer labelled JSON that is not
            return 200, None
        raise LiveError(self._redacted(f"cannot reach {self.shown}{path}: {reason}")) from None

    def get(self, path: str, *, text: bool = False) -> tuple[int, Any]:
        options = {"headers": {"Accept": "text/plain"}} if text else {}
        return self.request(
            path, lambda: self.openai.get(self.base + path, cast_to=str if text else object, options=options)
        )

    def scrape(self) -> tuple[int, list]:
        status, text = self.get("/metrics", text=True)
        return status, parse_prometheus(text) if status == 200 else []


def _message(status: int, payload) -> str:
    """What a refusing server said, on one line."""
    detail = payload
    if isinstance(payload, dict):
        error = payload.get("error", payload.get("detail", payload.get("message")))
        detail = error.get("message", error) if isinstance(error, dict) else error
    text = " ".join(str(detail).split()) if detail is not None else ""
    return f"HTTP {status}" + (f": {text[:200]}" if text else "")


def _wrong_engine(engine: str, actual: str, how: str) -> LiveError:
    return LiveError(
        f"--engine {engine}, but the server at that URL looks like {ENGINE_NAMES[actual]} ({how}); "
        f"expected --engine {actual}"
    )


def _probe_metrics(client: _Client, engine: str) -> Acceptance | None:
    """vLLM's counters at the start (None when ``/metrics`` has no ``vllm:`` series: --disable-log-stats, the
    responses' per-request metrics are then the only source); for the other engines, whose /metrics is optional,
    only a check that it is not vLLM's."""
    status, samples = client.scrape()
    engines = {e for e, facts in _FACTS.items() if any(s.name.startswith(facts.METRIC_PREFIX) for s in samples)}
    if engine != "vllm":
        if "vllm" in engines and engine not in engines:
            raise _wrong_engine(engine, "vllm", "its /metrics has vllm: series")
        return None
    if status != 200:
        raise LiveError(
            f"{client.shown}/metrics answered HTTP {status}; expected vLLM's Prometheus metrics, which it always "
            "serves (SGLang serves /metrics only with --enable-metrics, TokenSpeed's gateway its own: check --engine)"
        )
    if engines and "vllm" not in engines:
        other = sorted(engines)[0]
        raise _wrong_engine("vllm", other, f"its /metrics has {_FACTS[other].METRIC_PREFIX} series and no vllm: ones")
    if (counters := vllm_counters(samples)) is None and "vllm" in engines:
        raise LiveError(
            f"{client.shown} runs vLLM without speculative decoding: its /metrics has vllm: series but no "
            f"{vllm_facts.SPEC_DECODE_COUNTERS['drafts']}_total (start it with --speculative-config)"
        )
    return counters


def _probe_server(client: _Client, engine: str, model: str | None):
    """Before any request: an OpenAI server, the model, the engine it really is (``owned_by``, ``/metrics``
    prefixes), vLLM's counters and, where the server says, its version, target and draft."""
    # the client's get, not its models.list(): an answer that is no list of models must become the error below
    status, payload = client.get("/v1/models")
    served = _field(payload, ("data",))
    if status != 200 or not isinstance(served, list) or not all(isinstance(m, dict) and "id" in m for m in served):
        shown = _message(status, payload) if payload is not None else f"HTTP {status}, not JSON"
        raise LiveError(
            f"{client.shown} is not an OpenAI-compatible server: GET /v1/models answered {shown}; expected "
            '{"data": [{"id": ...}]} (the URL of `vllm serve`, `sglang serve` / launch_server or `tokenspeed serve`)'
        )
    if not served:
        raise LiveError(f"{client.shown} serves no model (GET /v1/models lists none)")
    names, matches = ", ".join(str(m["id"]) for m in served[:5]), [m for m in served if m["id"] == model]
    if model is None and len(served) > 1:
        raise LiveError(f"the server serves {len(served)} models ({names}); name one with --model")
    if model is not None and not matches:
        raise LiveError(f"--model {model!r} is not served there; the server serves: {names}")
    entry = matches[0] if model is not None else served[0]
    owner = {vllm_facts.MODEL_OWNER: "vllm", sglang_facts.MODEL_OWNER: "sglang"}.get(entry.get("owned_by"))
    if owner not in (None, engine):
        raise _wrong_engine(engine, owner, f'GET /v1/models says owned_by "{entry["owned_by"]}"')
    counters = _probe_metrics(client, engine)
    target, draft, info = _text(entry.get("root")), None, {}
    if engine != "tokenspeed":  # the version and SGLang's server arguments, when the server says; never an error
        with suppress(LiveError):
            status, info = client.get(vllm_facts.VERSION_PATH if engine == "vllm" else sglang_facts.SERVER_INFO_PATH)
        info = info if status == 200 and isinstance(info, dict) else {}
    if engine == "sglang":
        target, draft = _text(info.get("model_path")) or target, _text(info.get("speculative_draft_model_path"))
    return entry, counters, _text(info.get("version")), target, draft


def _no_acceptance(engine: str, where: str, response: dict, have_log: bool) -> LiveError:
    """The error for a response with two or more new tokens and none of the engine's acceptance fields."""
    fields = {
        "vllm": "metrics.speculative_decoding",
        "sglang": "sglext.spec_tokens_details",
        "tokenspeed": "usage.completion_tokens_details.accepted_prediction_tokens",
    }
    for other, how in fields.items():
        if other != engine and _READERS[other](response) is not None:
            return _wrong_engine(engine, other, f"its response carries {how}")
    flags = {
        "vllm": f"{vllm_facts.PER_REQUEST_SPEC_METRICS_FLAG}, vLLM >= 0.29, or /metrics without "
        f"{vllm_facts.DISABLE_LOG_STATS_FLAG}",
        "sglang": f"{sglang_facts.SPEC_FLAG}, SGLang >= 0.5.23",
        "tokenspeed": "a gateway with smg PR #2481" + ("" if have_log else ", or pass its scheduler log with --log"),
    }
    return LiveError(
        f"{where}: {ENGINE_NAMES[engine]} reports no acceptance: the response has no {fields[engine]}"
        + (" and /metrics no vllm: series" if engine == "vllm" else "")
        + f"; expected a server with speculative decoding ({flags[engine]}; check --engine)"
    )


def _min_rounds(completion_tokens: int, num_steps: int | None) -> int:
    """The fewest rounds that make ``completion_tokens`` (the first from the prefill; a round at most num_steps + 1)."""
    if completion_tokens < 2:
        return 0
    return -(-(completion_tokens - 1) // (num_steps + 1)) if num_steps else 1


def _settled_counters(client: _Client, before: Acceptance, min_rounds: int) -> Acceptance:
    """The counters once they count at least ``min_rounds`` rounds since ``before`` and two scrapes in a row agree
    (vLLM records a step's stats just after handing its outputs over); at most 2 s."""
    deadline, current = time.monotonic() + 2.0, None
    while True:
        status, samples = client.scrape()
        again = vllm_counters(samples)
        if again is None:
            raise LiveError(
                f"{client.shown}/metrics stopped reporting vLLM's speculative-decoding counters (HTTP {status})"
            )
        settled = again == current and again.rounds - before.rounds >= min_rounds
        if settled or time.monotonic() >= deadline:
            return again
        current = again
        time.sleep(0.02)


@dataclass
class _Result:
    where: str
    completion_tokens: int
    prompt_tokens: int | None
    finish_reason: str | None
    text: str
    latency: float
    rid: str | None
    response_id: str | None
    acceptance: Acceptance | None


def _request(prompt, chat: bool) -> tuple[str, dict]:
    """The endpoint and the prompt part of the body; ``chat`` wraps a text prompt as one user message."""
    if isinstance(prompt, str) and chat:
        return "/v1/chat/completions", {"messages": [{"role": "user", "content": prompt}]}
    if isinstance(prompt, dict) and "messages" in prompt:
        return "/v1/chat/completions", {"messages": prompt["messages"]}
    if isinstance(prompt, dict):
        prompt = next(prompt[key] for key in ("input_ids", "prompt", "text") if key in prompt)
    return "/v1/completions", {"prompt": prompt}


def measure_server(
    url: str,
    engine: str,
    prompts: str | Path | list[tuple[str, Any]],
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
    reference: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Measure the accept length of the server at ``url`` (``engine`` "vllm", "sglang" or "tokenspeed") on a prompts
    file: the offline report's ``settings``, ``total`` and ``requests`` (None where the engine does not report a
    value), plus ``server`` (attribution "per-request" | "aggregate", source), ``confidence_interval_95``,
    ``tokens_per_second``, ``wall_time_s``, ``notes`` and a ``verdict`` against ``expect`` or a :func:`read_reference`
    ``reference``. The server checks the sampling settings (a refusal is an error). Raises :class:`LiveError`."""
    from tqdm.auto import tqdm

    from ..prompts import read_prompt_lines

    if engine not in _READERS:
        raise LiveError(f"engine {engine!r}; expected one of {', '.join(_READERS)}")
    if expect is not None and reference is not None:
        raise LiveError("give expect= or reference=, not both")
    lines = (prompts if isinstance(prompts, list) else read_prompt_lines(prompts))[:limit]  # a list: (where, prompt)
    if not lines:
        raise LiveError(f"{prompts}: expected at least one prompt, the file has none")
    log = Path(log).expanduser() if log is not None else None
    run, notes = secrets.token_hex(4), []
    client = _Client(url, timeout)
    with client.openai:  # leaving it closes the client's connections
        entry, counters, version, target, draft = _probe_server(client, engine, model)
        log_start = log.stat().st_size if log is not None else 0
        extra_body = {"ignore_eos": True} if ignore_eos else {}
        extra_body |= {sglang_facts.SPEC_DETAILS_REQUEST_FIELD: True} if engine == "sglang" else {}

        def send(i: int) -> _Result:
            where, prompt = lines[i]
            endpoint, body = _request(prompt, chat)
            api = client.openai.chat.completions if "chat" in endpoint else client.openai.completions
            rid = f"eagle31-{run}-{i}" if engine == "tokenspeed" else None
            extra = {**extra_body, ts_facts.REQUEST_ID_FIELD: rid} if rid else extra_body
            body.update(model=entry["id"], max_tokens=max_tokens, temperature=temperature, top_p=top_p, n=1)
            start = time.perf_counter()
            try:
                status, out = client.request(
                    endpoint, lambda: api.create(**body, stream=False, extra_body=extra or None)
                )
            except LiveError as err:
                raise LiveError(f"{where}: {err}") from None
            latency = time.perf_counter() - start
            if status != 200:
                raise LiveError(f"{where}: the server refused the request to {endpoint}: {_message(status, out)}")
            completion, choices = _int(_field(out, ("usage", "completion_tokens"))), _field(out, ("choices",))
            if completion is None or not isinstance(choices, list) or not choices:
                raise LiveError(
                    f"{where}: the answer of {endpoint} is not an OpenAI completion (no choices or no "
                    "usage.completion_tokens)"
                )
            choice = choices[0] if isinstance(choices[0], dict) else {}
            text = _text(choice.get("text") or _field(choice, ("message", "content"))) or ""
            acceptance = _READERS[engine](out)
            if acceptance is not None:
                fields = f"{where}: the response's acceptance fields"
                _check_counts(acceptance.rounds, acceptance.accepted, acceptance.draft_tokens, None, fields)
                if acceptance.rounds > completion:
                    raise LiveError(f"{fields} count {acceptance.rounds} rounds for {completion} tokens: impossible")
            elsewhere = counters is not None if engine == "vllm" else engine == "tokenspeed" and log is not None
            if acceptance is None and completion >= 2 and not elsewhere:  # neither counters nor a log to read
                raise _no_acceptance(engine, where, out, log is not None)
            if acceptance is None and completion < 2 and engine != "vllm":  # the prefill token only: no round
                acceptance = Acceptance(0, 0, 0, source=f"{engine}-response")
            prompt_tokens, finish = _int(_field(out, ("usage", "prompt_tokens"))), choice.get("finish_reason")
            return _Result(
                where, completion, prompt_tokens, finish, text, latency, rid, _text(out.get("id")), acceptance
            )

        results: dict[int, _Result] = {}
        deltas: dict[int, Acceptance] = {}
        wall_start = time.perf_counter()
        with tqdm(total=len(lines), desc="acceptance", unit="req", disable=not progress, file=sys.stderr) as bar:
            if concurrency == 1:
                before = counters
                for i in range(len(lines)):
                    results[i] = send(i)
                    if before is not None:
                        least = _min_rounds(results[i].completion_tokens, before.num_steps)
                        after = _settled_counters(client, before, least)
                        deltas[i], before = _counter_delta(after, before), after
                    _progress(bar, results, deltas)
            else:
                pool = ThreadPoolExecutor(min(concurrency, len(lines)), thread_name_prefix="eagle31-acceptance")
                try:  # the first error (or Ctrl-C) cancels the requests not yet sent (those in flight end in time)
                    futures = {pool.submit(send, i): i for i in range(len(lines))}
                    for future in as_completed(futures):
                        results[futures[future]] = future.result()
                        _progress(bar, results, deltas)
                finally:
                    pool.shutdown(wait=False, cancel_futures=True)
        wall = time.perf_counter() - wall_start
        request_time = sum(r.latency for r in results.values()) if concurrency == 1 else wall
        run_delta = None
        if counters is not None:
            least = sum(_min_rounds(r.completion_tokens, counters.num_steps) for r in results.values())
            run_delta = _counter_delta(_settled_counters(client, counters, least), counters)

    ordered = [results[i] for i in range(len(lines))]
    log_summary = None
    if engine == "vllm":
        if all(r.acceptance is not None for r in ordered):
            source = "response metrics.speculative_decoding"
        elif concurrency == 1 and len(deltas) == len(ordered):
            source = "/metrics counters, diffed around each request"
            for i, r in enumerate(ordered):
                r.acceptance = deltas[i]
                if r.acceptance.rounds > r.completion_tokens:  # counters that contradict the response
                    notes.append(
                        f"{r.where}: the counters moved by {r.acceptance.rounds} rounds for {r.completion_tokens} "
                        "tokens: other traffic on the server? (per-request attribution needs an idle server)"
                    )
        else:
            source = "/metrics counters, diffed around the run"
            for r in ordered:
                r.acceptance = None
    elif engine == "sglang":
        source = "response sglext.spec_tokens_details"
    else:
        source = "response usage.completion_tokens_details"
        if log is not None:
            log_summary, source = _apply_tokenspeed_log(log, log_start, ordered, notes, source)
        missing = [r.where for r in ordered if r.acceptance is None]
        if missing and not (log_summary and log_summary["decode_windows"]):
            raise LiveError(
                f"{len(missing)} request(s) have no acceptance, neither in their usage fields nor in the "
                f"scheduler log (first: {missing[0]})"
            )
    attributed = all(r.acceptance is not None for r in ordered)
    generated = sum(r.completion_tokens for r in ordered)
    total_acc = _sum([r.acceptance for r in ordered]) if attributed else run_delta
    steps = total_acc.num_steps if total_acc else None
    window_mean = log_summary["mean_avg_accept_len"] if log_summary and total_acc is None else None
    total = acceptance_dict(total_acc, generated, len(ordered), steps, window_mean)
    interval = ratio_interval([r.acceptance for r in ordered]) if attributed else None
    requests = []
    for i, r in enumerate(ordered):
        request = {"index": i, "num_prompt_tokens": r.prompt_tokens}
        request.update(acceptance_dict(r.acceptance, r.completion_tokens, 1, steps))
        request.update(output_ids=None, finish_reason=r.finish_reason, context_limited=False, where=r.where)
        speed = r.completion_tokens / r.latency if r.latency > 0 else None
        requests.append({**request, "text": r.text, "latency_s": r.latency, "tokens_per_second": speed})
    per_round = total["draft_tokens_per_round"]
    num_draft_tokens = per_round + 1 if isinstance(per_round, int) else None
    settings = dict(num_steps=steps, topk=None, num_draft_tokens=num_draft_tokens, temperature=temperature)
    settings.update(top_p=top_p, max_new_tokens=max_tokens, seed=None, eos_token_id=None, target=target or entry["id"])
    settings.update(
        draft=draft,
        prompts=None if isinstance(prompts, list) else str(prompts),
        concurrency=concurrency,
        chat=chat,
        ignore_eos=ignore_eos,
    )
    server = dict(url=client.shown, engine=engine, model=entry["id"], target=target, draft=draft, version=version)
    server.update(attribution="per-request" if attributed else "aggregate", source=f"{ENGINE_NAMES[engine]} {source}")
    if log_summary is not None:
        server["log"] = log_summary
    if engine == "vllm" and run_delta is not None and attributed and source.startswith("response"):
        server["counters_accept_length"] = run_delta.accept_length
    report = dict(settings=settings, total=total, requests=requests, server=server, confidence_interval_95=interval)
    speed = generated / request_time if request_time > 0 else None
    report.update(tokens_per_second=speed, wall_time_s=wall, notes=notes)
    if expect is not None or reference is not None:
        report["verdict"] = compare(report, expect=expect, reference=reference)
    return report


def _progress(bar, results: dict, deltas: dict) -> None:
    items = [a for i, r in results.items() if (a := r.acceptance or deltas.get(i)) is not None]
    if sum(a.rounds for a in items):
        bar.set_postfix(accept_length=f"{_sum(items).accept_length:.3f}")
    bar.update(1)


def _apply_tokenspeed_log(
    path: Path, start: int, ordered: list[_Result], notes: list[str], source: str
) -> tuple[dict[str, Any], str]:
    """Attribute (or check) each request from TokenSpeed's scheduler log, matched by the rid it sent."""
    try:
        data = path.read_bytes()
    except OSError as err:
        raise LiveError(f"--log {path}: unreadable ({err.strerror or err})") from None
    whole = parse_tokenspeed_log(data.decode("utf-8", errors="replace"))
    windows = parse_tokenspeed_log(data[start:].decode("utf-8", errors="replace")).windows  # written during the run
    matched, disagree = 0, []
    for r in ordered:
        line = whole.find(r.rid) or (whole.find(r.response_id) if r.response_id else None)
        if line is None:
            continue
        matched += 1
        from_log = _log_acceptance(line[0], line[1] or r.completion_tokens)
        if r.acceptance is None or r.acceptance.source != "tokenspeed-usage":
            r.acceptance = from_log
        elif from_log is not None and from_log.rounds != r.acceptance.rounds:
            disagree.append(f"{r.where} ({from_log.rounds} vs {r.acceptance.rounds} rounds)")
    if not matched and not windows:
        raise LiveError(
            f"--log {path}: no TokenSpeed acceptance lines for this run (no 'Req: <rid> Finish! "
            "Accept_num_tokens_avg: ...' line for its requests and no 'Decode batch. ... avg_accept_len: ...' "
            "line written during it): the scheduler's log, at INFO, of a server with speculative decoding?"
        )
    if disagree:
        notes.append("the scheduler log and the usage fields disagree for " + ", ".join(disagree[:5]))
    if matched and any(r.acceptance is not None and r.acceptance.source == "tokenspeed-log" for r in ordered):
        source = "scheduler log (Req ... Finish! lines, matched by rid)"
    if windows and not all(r.acceptance is not None for r in ordered):
        source = "scheduler log (Decode batch windows: the unweighted mean of their avg_accept_len)"
    mean = sum(windows) / len(windows) if windows else None
    summary = dict(path=str(path), requests_matched=matched, decode_windows=len(windows), mean_avg_accept_len=mean)
    return summary, source


def _f(value, spec: str) -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, spec)


def format_report(report: dict[str, Any]) -> str:
    """The report as text: the server, a per-request table, the totals (:meth:`AcceptanceStats.table` where the
    engine reports a histogram), the verdict."""
    from ..decoding.speculative import AcceptanceStats

    server, total, settings = report["server"], report["total"], report["settings"]
    name = ENGINE_NAMES[server["engine"]] + (f" {server['version']}" if server.get("version") else "")
    lines = [
        f"{server['url']} ({name}, model {server['model']}): {total['num_requests']} requests, concurrency "
        f"{settings['concurrency']}, temperature {settings['temperature']:g}, top-p {settings['top_p']:g}, max "
        f"tokens {settings['max_new_tokens']}",
        f"acceptance: {server['source']} ({server['attribution']})",
        "",
        f"{'#':>4}  {'prompt':<24} {'tokens':>6} {'rounds':>6} {'accepted':>8} {'accept len':>10} {'tok/s':>8}",
    ]
    for r in report["requests"]:
        where = r["where"] if len(r["where"]) <= 24 else "..." + r["where"][-21:]
        lines.append(
            f"{r['index']:>4}  {where:<24} {r['num_generated_tokens']:>6} {_f(r['num_rounds'], 'd'):>6} "
            f"{_f(r['num_accepted_tokens'], 'd'):>8} {_f(r['mean_accept_length'], '.3f'):>10} "
            f"{_f(r['tokens_per_second'], '.1f'):>8}"
        )
    if (interval := report["confidence_interval_95"]) is not None:
        ci = f"95% CI [{interval['low']:.3f}, {interval['high']:.3f}] (ratio estimator, t interval)"
    else:
        per_request = server["attribution"] == "per-request"
        ci = f"no confidence interval ({'one request' if per_request else 'aggregate attribution'})"
    hist, per_round = total["accept_histogram"], total["draft_tokens_per_round"]
    if hist and total["num_steps"] == len(hist) - 1 and isinstance(per_round, int):
        lines += ["", AcceptanceStats.from_dict(total).table()]
    else:  # no histogram (TokenSpeed, a tree's counters, log windows): the numbers the engine reports
        lines += [
            "",
            f"requests {total['num_requests']}, generated tokens {total['num_generated_tokens']}, verification "
            f"rounds {_f(total['num_rounds'], 'd')}",
            f"mean accept length          {_f(total['mean_accept_length'], '.3f')}",
        ]
    lines.append(f"{ci}; output tokens/s {_f(report['tokens_per_second'], '.1f')} ({report['wall_time_s']:.2f} s wall)")
    if log := server.get("log"):
        lines.append(
            f"scheduler log               {log['requests_matched']} requests matched, {log['decode_windows']} decode "
            f"windows (mean avg_accept_len {_f(log['mean_avg_accept_len'], '.2f')})"
        )
    lines += [f"note: {note}" for note in report.get("notes", [])]
    if verdict := report.get("verdict"):
        what = "the reference" if verdict["against"] == "reference" else "the expected"
        head, doctor = "consistent" if verdict["consistent"] else "NOT consistent", verdict["doctor"]
        lines += [
            "",
            f"verdict: {head} with {what} {verdict['expected']:.3f}: measured {_f(verdict['measured'], '.3f')}, "
            f"difference {verdict['difference']:+.3f}, allowed +-{verdict['margin']:.3f} ({verdict['method']})",
        ]
        if verdict["causes"] and doctor:
            lines.append("likely cause (a silent misconfiguration; most likely first):")
        lines += [f"  - {cause}" for cause in verdict["causes"]]
        if doctor:
            lines.append(f"check the deployment: {doctor}")
        if doctor and {"DRAFT", "TARGET"} & set(doctor.split()):
            lines.append("  (DRAFT / TARGET: the drafter and target folders or Hub ids the server was started with)")
    return "\n".join(lines)
