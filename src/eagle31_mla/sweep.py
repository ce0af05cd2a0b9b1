"""Acceptance as users meet it (``eagle31-mla acceptance --sweep``): the prompts expanded by chat template and
context length into token ids (rendered here, so offline and a server see the same tokens), measured once per arm by
the same loops as ``acceptance`` (:func:`~eagle31_mla.decoding.speculative.measure_acceptance` or
:func:`~eagle31_mla.serving.live.measure_server`), and each request's record grouped into cells: by template, domain,
context bucket, and draft depth. One report schema for offline and live; two arms on the same prompts are compared
request by request (paired). Intervals: :func:`~eagle31_mla.serving.live.ratio_half_width`. No torch at import."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from .prompts import PromptError, _text_of, prompt_token_ids, read_prompt_lines
from .serving.live import Acceptance, paired_half_width, ratio_half_width

TARGET, RAW = "target", "raw"  # the target's own chat template; the conversation's texts without one
#: A cell with fewer requests or rounds says so: its interval is too wide to tell drafters or templates apart.
SMALL_CELL, SMALL_ROUNDS = 5, 20
#: The groupings a report holds, in the order the table prints them.
GROUPINGS = (("template",), ("domain",), ("context",), ("template", "context"), ("domain", "context"))
GROUPINGS += (("template", "domain"),)


@dataclass(frozen=True)
class SweepPrompt:
    where: str
    domain: str
    template: str
    context: int  # the bucket: a --context-lengths cut, else the power of two at or above the length
    input_ids: list[int]


def context_bucket(length: int) -> int:
    return 1 << max(0, (length - 1).bit_length())


def read_templates(named: dict[str, str], tokenizer) -> dict[str, str | None]:
    """The templates each conversation is rendered with: the target's own (when it has one), raw text, and each
    named Jinja file (``name -> path``; the CLI keeps the first two names for themselves)."""
    templates: dict[str, str | None] = {TARGET: None} if getattr(tokenizer, "chat_template", None) else {}
    templates[RAW] = None
    return templates | {name: Path(path).expanduser().read_text(encoding="utf-8") for name, path in named.items()}


def _render(messages: list[dict], name: str, template: str | None, tokenizer, vocab: int | None, where: str):
    if name == RAW:  # the texts alone, as a plain completion prompt sees them
        return prompt_token_ids("\n\n".join(_text_of(m["content"]) for m in messages), tokenizer, vocab, where)
    if name == TARGET:
        return prompt_token_ids({"messages": messages}, tokenizer, vocab, where)
    try:  # Transformers renders the user's Jinja as it renders the target's own
        ids = tokenizer.apply_chat_template(messages, chat_template=template, add_generation_prompt=True, tokenize=True)
    except Exception as err:  # noqa: BLE001 - jinja2's TemplateError, a template's raise_exception, ...
        raise PromptError(
            f"{where}: the chat template {name!r} cannot render it ({type(err).__name__}: {err})"
        ) from None
    return prompt_token_ids(list(ids["input_ids"] if hasattr(ids, "keys") else ids), None, vocab, f"{where} ({name})")


def expand(path, tokenizer, vocab, templates: dict, lengths=(), limit=None, chat=False) -> list[SweepPrompt]:
    """Every row of the prompts file (the first ``limit``) under every template (a ``messages`` row, or with ``chat``
    a text one; otherwise a row is measured as given, labelled by its ``template``, default raw), cut to its last N
    tokens for each N of ``lengths`` it reaches (a chat render keeps its generation prompt), or whole in its
    power-of-two bucket."""
    out = []
    for where, row in read_prompt_lines(path)[:limit]:
        meta = row if isinstance(row, dict) else {}
        text = row if isinstance(row, str) else meta.get("prompt", meta.get("text"))
        if chat and isinstance(text, str):  # as `acceptance --chat`: one user message
            meta = {k: v for k, v in meta.items() if k not in ("prompt", "text")}
            meta["messages"] = [{"role": "user", "content": text}]
        domain, label = meta.get("domain", "-"), meta.get("template", RAW)
        for key, value in (("domain", domain), ("template", label)):
            if not isinstance(value, str) or not value.strip():
                raise PromptError(f'{where}: "{key}" is {json.dumps(value)[:40]}; expected a non-empty string')
        if "messages" in meta:
            if "template" in meta:
                raise PromptError(
                    f'{where}: "template" labels pre-rendered text; a conversation is rendered with '
                    'each template of the sweep (drop it, or give the rendered text as "prompt")'
                )
            renders = {
                name: _render(meta["messages"], name, t, tokenizer, vocab, where) for name, t in templates.items()
            }
        else:
            renders = {label: prompt_token_ids(row, tokenizer, vocab, where)}
        for name, ids in renders.items():
            cuts = [(n, ids[-n:]) for n in lengths if len(ids) >= n] if lengths else [(context_bucket(len(ids)), ids)]
            out += [SweepPrompt(where, domain, name, n, cut) for n, cut in cuts]
    if not out:
        reach = f"; none reaches {min(lengths)} tokens (--context-lengths)" if lengths else ""
        raise PromptError(f"{path}: no prompt to measure{reach}")
    return out


def _positions(record: dict, num_steps: int) -> list[int] | None:
    """Rounds whose draft at each depth was accepted: from the histogram, else the reported rates."""
    hist, rounds = record.get("accept_histogram"), record["num_rounds"]
    if num_steps is None:
        return None
    if hist and len(hist) == num_steps + 1:
        return [sum(hist[k + 1 :]) for k in range(num_steps)]
    rates = record.get("acceptance_rate_per_position")
    return [round(r * rounds) for r in rates] if rates and len(rates) == num_steps else None


def _interval(value: float, half: float | None) -> list[float] | None:
    return None if half is None else [value - half, value + half]


def cell(records: list[dict], num_steps: int) -> dict[str, Any]:
    """A cell's numbers: accept length with its 95% interval, per-position and conditional acceptance (accepted at
    depth k given accepted at k - 1) with theirs, the counts, and whether it is too small to mean much."""
    rounds, accepted = [r["num_rounds"] for r in records], [r["num_accepted_tokens"] for r in records]
    total = sum(rounds)
    length = (sum(accepted) + total) / total if total else None
    out = dict(num_requests=len(records), num_rounds=total, num_accepted_tokens=sum(accepted))
    out.update(mean_accept_length=length, small=len(records) < SMALL_CELL or total < SMALL_ROUNDS)
    lengths = [a + r for a, r in zip(accepted, rounds)]
    out["interval_95"] = _interval(length, ratio_half_width(lengths, rounds)) if total else None
    positions = [_positions(r, num_steps) for r in records]
    if total and all(p is not None for p in positions):
        columns = [rounds] + [list(col) for col in zip(*positions)]  # rounds, then accepted at depth 1..k
        rates, conditional = [], []
        for k in range(1, num_steps + 1):
            for into, den in ((rates, columns[0]), (conditional, columns[k - 1])):
                value = sum(columns[k]) / sum(den) if sum(den) else None
                half = ratio_half_width(columns[k], den) if sum(den) else None
                into.append({"rate": value, "interval_95": _interval(value, half) if value is not None else None})
        out.update(acceptance_rate_per_position=rates, conditional_acceptance=conditional)
    else:  # the engine reports no depth: rates unknown
        out.update(acceptance_rate_per_position=None, conditional_acceptance=None)
    return out


def cells(prompts: list[SweepPrompt], records: list[dict], num_steps: int) -> list[dict]:
    """The ``all`` cell, then one per value of each grouping of :data:`GROUPINGS` (keys a cell does not fix: None)."""
    out = [{"by": [], "template": None, "domain": None, "context": None, **cell(records, num_steps)}]
    for by in GROUPINGS:
        groups: dict[tuple, list[dict]] = {}
        for p, r in zip(prompts, records):
            groups.setdefault(tuple(getattr(p, k) for k in by), []).append(r)
        for key in sorted(groups, key=lambda k: [str(v).zfill(12) for v in k]):
            fixed = dict.fromkeys(("template", "domain", "context")) | dict(zip(by, key))
            out.append({"by": list(by), **fixed, **cell(groups[key], num_steps)})
    return out


def _indices(prompts: list[SweepPrompt], c: dict) -> list[int]:
    return [i for i, p in enumerate(prompts) if all(getattr(p, k) == c[k] for k in c["by"])]


def report(prompts: list[SweepPrompt], arms: list[dict], settings: dict[str, Any]) -> dict[str, Any]:
    """The sweep's JSON: ``settings``, ``prompts`` (labels and lengths), ``arms`` (each: ``name``, ``what`` it
    measured, the measurement's ``total``, ``cells``, ``requests``, and ``server`` when live), and with two arms
    ``differences``: per cell, B - A with its paired 95% interval."""
    num_steps = arms[0]["total"]["num_steps"]
    for arm in arms:
        arm["cells"] = cells(prompts, arm["requests"], num_steps)
        for p, r in zip(prompts, arm["requests"]):
            r.update(where=p.where, domain=p.domain, template=p.template, context=p.context)
    rows = [
        {k: v for k, v in asdict(p).items() if k != "input_ids"} | {"num_prompt_tokens": len(p.input_ids)}
        for p in prompts
    ]
    out = dict(kind="eagle31-mla acceptance sweep", settings=settings, prompts=rows, arms=arms)
    if len(arms) == 2:
        out["differences"] = []
        for a, b in zip(*(arm["cells"] for arm in arms)):
            items = [
                [
                    Acceptance(r["num_rounds"], r["num_accepted_tokens"])
                    for r in (arm["requests"][i] for i in _indices(prompts, a))
                ]
                for arm in arms
            ]
            if a["mean_accept_length"] is None or b["mean_accept_length"] is None:
                continue
            diff = b["mean_accept_length"] - a["mean_accept_length"]
            keys = {k: a[k] for k in ("by", "template", "domain", "context")}
            interval = _interval(diff, paired_half_width(*items))
            out["differences"].append(
                keys | dict(difference=diff, interval_95=interval, num_requests=a["num_requests"])
            )
    return out


def cell_name(c: dict) -> str:
    if not c["by"]:
        return "all"
    return ", ".join(f"context <={c['context']}" if k == "context" else f"{k} {c[k]}" for k in c["by"])


def _f(value, spec=".3f") -> str:
    return "-" if value is None else format(value, spec)


def format_sweep(data: dict[str, Any]) -> str:
    """The report as a table: one row per cell (A, and with two arms B and B - A), then acceptance by depth."""
    arms, s = data["arms"], data["settings"]
    lines = [f"arm {a['name']}: {a['what']}" for a in arms]
    cuts = s["context_lengths"]
    lines.append(
        f"{len(data['prompts'])} requests; templates {', '.join(s['templates'])}; context "
        f"{'cut to ' + ', '.join(map(str, cuts)) + ' tokens' if cuts else 'as given'}; {s['num_steps']} draft steps, "
        f"temperature {s['temperature']:g}; '*': under {SMALL_CELL} requests or {SMALL_ROUNDS} rounds"
    )
    head = f"{'cell':<36} {'reqs':>5} {'rounds':>7} {'accept len':>10}  {'95% CI':<16}"
    head += f" {'B accept len':>12}  {'B - A [95% CI]':<26}" if len(arms) == 2 else ""
    lines += ["", head]
    differences = {cell_name(d): d for d in data.get("differences", [])}
    for c, *b in zip(*(a["cells"] for a in arms)):
        ci = c["interval_95"]
        row = f"{cell_name(c)[:34] + (' *' if c['small'] else ''):<36} {c['num_requests']:>5} {c['num_rounds']:>7} "
        row += f"{_f(c['mean_accept_length']):>10}  {'[' + _f(ci[0]) + ', ' + _f(ci[1]) + ']' if ci else '-':<16}"
        if b and (d := differences.get(cell_name(c))):
            dci = d["interval_95"]
            span = f" [{dci[0]:+.3f}, {dci[1]:+.3f}]" if dci else ""
            row += f" {_f(b[0]['mean_accept_length']):>12}  {d['difference']:+.3f}{span}"
        lines.append(row)
    lines += ["", "acceptance by depth (rate at position k; conditional: accepted at k given accepted at k - 1)"]
    for arm in arms:
        for c in (c for c in arm["cells"] if c["by"] in ([], ["template"])):
            if c["acceptance_rate_per_position"] is None:
                continue
            rates = " ".join(_f(x["rate"], ".2f") for x in c["acceptance_rate_per_position"])
            conditional = " ".join(_f(x["rate"], ".2f") for x in c["conditional_acceptance"])
            name = f"{arm['name']} {cell_name(c)}" if len(arms) == 2 else cell_name(c)
            lines.append(f"  {name:<34} rate {rates}   conditional {conditional}")
    return "\n".join(lines)


def plot(data: dict[str, Any], path: str | Path) -> None:
    """A PNG (written atomically): accept length against context per template and per domain, and acceptance by
    depth per template; arm B dashed. Needs matplotlib (the ``plot`` extra): ImportError without it."""
    import matplotlib

    matplotlib.use("Agg")  # no display: a file
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    from .locations import atomic_write

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.8))
    colors: dict[str, str] = {}  # one colour per template / domain in every panel
    color = lambda label: colors.setdefault(label, f"C{len(colors) % 10}")  # noqa: E731
    for arm, style in zip(data["arms"], ("-", "--")):
        for ax, key in zip(axes, ("template", "domain")):
            points: dict[str, list] = {}
            for c in (c for c in arm["cells"] if c["by"] == [key, "context"] and c["mean_accept_length"]):
                points.setdefault(c[key], []).append((c["context"], c["mean_accept_length"]))
            for label, xy in sorted(points.items()):
                x, y = zip(*sorted(xy))
                ax.plot(x, y, style, marker="o", color=color(label), label=f"{label} ({arm['name']})")
            ax.set(xlabel="context: prompt tokens (bucket)", ylabel="accept length", title=f"by {key}")
            ax.set_xscale("log", base=2)
            ax.xaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
        for c in (c for c in arm["cells"] if c["by"] == ["template"] and c["acceptance_rate_per_position"]):
            rates = [x["rate"] for x in c["acceptance_rate_per_position"]]
            label = f"{c['template']} ({arm['name']})"
            axes[2].plot(range(1, len(rates) + 1), rates, style, marker="o", color=color(c["template"]), label=label)
        axes[2].set(xlabel="draft position", ylabel="acceptance rate", title="by depth", ylim=(0, 1.02))
        axes[2].xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    for ax in axes:
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize="small")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    atomic_write(path, lambda tmp: fig.savefig(tmp, format="png", dpi=100))
    plt.close(fig)
