"""``eagle31-mla acceptance --sweep`` on the demo pair, offline (fp32, greedy): each cell is what a separate
``acceptance`` run on that cell's prompts measures, the prompts are the renders written out here by other means, and
the A/B difference and intervals are the formulas stated in the tests. The same sweep behind ``vllm serve``:
tests/engines/test_vllm_serve.py."""

from __future__ import annotations

import json
import math
import shutil
import statistics
import sys

import jinja2
import pytest
from transformers import AutoTokenizer

from eagle31_mla.cli import main
from eagle31_mla.demo import DEMO_DIR
from eagle31_mla.prompts import read_prompt_lines
from eagle31_mla.serving.live import t_quantile_975
from eagle31_mla.sweep import expand, read_templates
from tests.cli import test_acceptance_server as stand_in
from tests.cli.test_acceptance_server import MAX_TOKENS, expected_al, serve  # noqa: F401 - serve: a fixture
from tests.support.paths import CHATML, sweep_inputs

PAIR = ["--target", str(DEMO_DIR / "target"), "--draft", str(DEMO_DIR / "draft"), "--dtype", "float32"]
NO_NORM_OUTPUT = ["--b-override", "norm_output=false"]  # the same weights, the last norm not applied to the state


def sweep(tmp_path, *extra) -> dict:
    assert main(["acceptance", "--sweep", *PAIR, *sweep_inputs(tmp_path), *extra]) == 0
    return json.loads((tmp_path / "sweep.json").read_text())


def acceptance(tmp_path, name: str, ids: list[list[int]], draft=None) -> dict:
    """A plain `acceptance` run on these token ids, with the sweep's settings."""
    prompts = tmp_path / f"{name}.jsonl"
    prompts.write_text("".join(json.dumps({"input_ids": i}) + "\n" for i in ids))
    pair = PAIR if draft is None else [*PAIR[:3], str(draft), *PAIR[4:]]
    argv = ["acceptance", *pair, "--prompts", str(prompts), "--max-new-tokens", "24", "--ignore-eos", "--no-progress"]
    assert main([*argv, "--json", str(tmp_path / f"{name}.json")]) == 0
    return json.loads((tmp_path / f"{name}.json").read_text())["total"]


def paired_half_width(a: list[dict], b: list[dict]) -> float:
    """The 95% half-width of B - A over the same requests, written out: each request's influence (tokens - R rounds)
    / mean rounds on each side, the t interval of their differences."""

    def influence(records):
        rounds = [r["num_rounds"] for r in records]
        tokens = [r["num_rounds"] + r["num_accepted_tokens"] for r in records]
        ratio, mean = sum(tokens) / sum(rounds), sum(rounds) / len(rounds)
        return [(t - ratio * n) / mean for t, n in zip(tokens, rounds)]

    d = [y - x for x, y in zip(influence(a), influence(b))]
    return t_quantile_975(len(d) - 1) * statistics.stdev(d) / math.sqrt(len(d))


def test_each_cell_is_an_acceptance_run_on_its_prompts_and_the_difference_is_paired(tmp_path):
    report = sweep(tmp_path, *NO_NORM_OUTPUT, "--json", str(tmp_path / "sweep.json"))
    assert (tmp_path / "sweep.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    # the prompts: each conversation under each template, cut to its last 16 and 64 tokens where it reaches them
    tokenizer = AutoTokenizer.from_pretrained(DEMO_DIR / "target")
    templates = read_templates({"chatml": str(tmp_path / "chatml.jinja")}, tokenizer)
    swept = expand(tmp_path / "sweep.jsonl", tokenizer, 512, templates, (16, 64))
    labels = [{k: v for k, v in p.items() if k != "num_prompt_tokens"} for p in report["prompts"]]
    assert labels == [dict(where=p.where, domain=p.domain, template=p.template, context=p.context) for p in swept]
    rows = [json.loads(line) for line in (tmp_path / "sweep.jsonl").read_text().splitlines()]
    long = rows[-1]["conversation"]
    renders = {
        "target": tokenizer.apply_chat_template(long, add_generation_prompt=True),
        "raw": tokenizer(long[0]["content"])["input_ids"],
        "chatml": tokenizer(jinja2.Template(CHATML).render(messages=long, add_generation_prompt=True))["input_ids"],
    }
    renders = {k: list(v["input_ids"] if hasattr(v, "keys") else v) for k, v in renders.items()}
    last = [p for p in swept if p.where.endswith(f":{len(rows)}")]
    assert [(p.template, p.context, p.input_ids) for p in last] == [
        (name, n, ids[-n:]) for name, ids in renders.items() for n in (16, 64)
    ]
    assert {p.template for p in swept if p.where.endswith(":5")} == {"plain"}  # pre-rendered text: its label

    # each cell: a separate `acceptance` run on exactly its prompts gives its numbers
    a, b = report["arms"]
    chosen = [c for c in a["cells"] if c["by"] in ([], ["domain"], ["template", "context"])]
    assert len(chosen) == 1 + 2 + 7  # all; qa, story; (chatml, plain, raw, target) x (16, 64) less plain's 64
    for c in chosen:
        ids = [p.input_ids for p in swept if all(getattr(p, k) == c[k] for k in c["by"])]
        total = acceptance(tmp_path, "cell", ids)
        assert (c["num_requests"], c["num_rounds"]) == (total["num_requests"], total["num_rounds"]), c
        assert c["num_accepted_tokens"] == total["num_accepted_tokens"]
        assert c["mean_accept_length"] == pytest.approx(total["mean_accept_length"], abs=1e-12)
        rates = [x["rate"] for x in c["acceptance_rate_per_position"]]
        assert rates == pytest.approx(total["acceptance_rate_per_position"], abs=1e-12)
        conditional = [x["rate"] for x in c["conditional_acceptance"]]  # accepted at k given accepted at k - 1
        assert conditional == pytest.approx([r / q for r, q in zip(rates, [1.0, *rates])], abs=1e-12)

    # arm B is the drafter with norm_output off: a folder saved so measures the same
    edited = tmp_path / "no-norm-output"
    shutil.copytree(DEMO_DIR / "draft", edited)
    config = json.loads((edited / "config.json").read_text()) | {"norm_output": False}
    (edited / "config.json").write_text(json.dumps(config))
    total = acceptance(tmp_path, "edited", [p.input_ids for p in swept], draft=edited)
    assert b["cells"][0]["mean_accept_length"] == pytest.approx(total["mean_accept_length"], abs=1e-12)
    assert b["what"].endswith(" norm_output=false")

    # B - A: the difference of the two measurements, with the paired interval written out above
    for d, ca, cb in zip(report["differences"], a["cells"], b["cells"]):
        assert d["difference"] == pytest.approx(cb["mean_accept_length"] - ca["mean_accept_length"], abs=1e-12)
        records = [
            [r for r, p in zip(arm["requests"], swept) if all(getattr(p, k) == d[k] for k in d["by"])] for arm in (a, b)
        ]
        if len(records[0]) < 2:  # no interval of one request
            assert d["interval_95"] is None
            continue
        half = paired_half_width(*records)
        assert d["interval_95"] == pytest.approx([d["difference"] - half, d["difference"] + half], abs=1e-9)
    whole = report["differences"][0]
    assert whole["interval_95"][1] < 0  # a drop the interval resolves
    assert all(c["small"] == (c["num_requests"] < 5 or c["num_rounds"] < 20) for c in a["cells"])


def test_a_drafter_against_itself_differs_by_nothing_and_the_plot_needs_matplotlib(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # not installed
    report = sweep(tmp_path, "--b-draft", str(DEMO_DIR / "draft"), "--json", str(tmp_path / "sweep.json"))
    assert len(report["differences"]) == len(report["arms"][0]["cells"])
    assert all(
        d["difference"] == 0 and d["interval_95"][0] <= 0 <= d["interval_95"][1]
        for d in report["differences"]
        if d["interval_95"]
    )
    assert not (tmp_path / "sweep.png").exists()
    out, err = capsys.readouterr()
    assert "no plot: matplotlib is not installed (pip install 'eagle31-mla[plot]')" in err
    assert "B - A [95% CI]" in out and "template chatml, context <=64" in out and "conditional" in out


def test_a_prompt_set_is_read_through_datasets_by_its_columns(tmp_path, monkeypatch, capsys):
    """``--prompts hf:NAME[:CONFIG][@SPLIT]``: datasets.load_dataset (here a local dataset folder, offline), each row
    mapped to a prompts line: MT-Bench's turns (the first), ShareGPT's conversations (up to the last user turn),
    a question; its category as the domain."""
    rows = [
        {"category": "writing", "turns": ["Write a poem.", "Now shorter."]},
        {"category": "chat", "conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello"}]},
        {"question": "What is 2 + 3?"},
    ]
    (tmp_path / "set" / "data").mkdir(parents=True)
    (tmp_path / "set" / "data" / "test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    spec = f"hf:{tmp_path / 'set'}"
    assert [line for _, line in read_prompt_lines(spec)] == [
        {"domain": "writing", "messages": [{"role": "user", "content": "Write a poem."}]},
        {"domain": "chat", "messages": [{"role": "user", "content": "Hi"}]},
        {"domain": "-", "prompt": "What is 2 + 3?"},
    ]
    argv = ["acceptance", "--sweep", *PAIR, "--prompts", spec, "--max-new-tokens", "8", "--no-progress", "--json", "-"]
    assert main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    assert [(p["domain"], p["template"]) for p in report["prompts"]] == [
        ("writing", "target"),
        ("writing", "raw"),
        ("chat", "target"),
        ("chat", "raw"),
        ("-", "raw"),
    ]
    assert main([*argv, "--prompts", f"{spec}@train"]) == 2  # the last --prompts is the one
    assert "no split 'train'; it has test" in capsys.readouterr().err
    monkeypatch.setitem(sys.modules, "datasets", None)  # not installed
    assert main(argv) == 2
    assert "pip install 'eagle31-mla[datasets]'" in capsys.readouterr().err


@pytest.mark.parametrize("engine", ["sglang", "tokenspeed"])
def test_the_sweep_on_sglang_and_tokenspeed_reads_each_response(engine, serve, tmp_path, capsys, monkeypatch):  # noqa: F811
    """Against each engine's stand-in server (tests/cli/test_acceptance_server.py: its per-response acceptance as
    the engine's source writes it), the prompts sent as the token ids rendered here: every request's rounds and
    accepted drafts, as that engine counts them, land in the cells."""
    url, stub = serve(engine)
    inputs = sweep_inputs(tmp_path)
    tokenizer = AutoTokenizer.from_pretrained(DEMO_DIR / "target")
    templates = read_templates({"chatml": str(tmp_path / "chatml.jinja")}, tokenizer)
    patterns = [[3, 3, 2, 3], [1, 0, 2], [3, 1], [0, 3, 3, 1, 2], [2]]  # drafts accepted per round, by request
    swept = expand(tmp_path / "sweep.jsonl", tokenizer, 512, templates, (16, 64))
    by_ids = {str(p.input_ids): patterns[i % len(patterns)] for i, p in enumerate(swept)}
    monkeypatch.setattr(stand_in, "PATTERNS", by_ids)  # what the stand-in answers for each prompt
    argv = ["acceptance", "--sweep", "--server", url, "--engine", engine, "--tokenizer", str(DEMO_DIR / "target")]
    assert main([*argv, *inputs, "--max-tokens", str(MAX_TOKENS), "--json", "-"]) == 0  # the last --max-tokens
    report = json.loads(capsys.readouterr().out)
    sent = [body["prompt"] for path, body in stub.bodies if path == "/v1/completions"]
    assert len(sent) == len(report["prompts"]) and all(isinstance(ids, list) for ids in sent)
    for c in report["arms"][0]["cells"]:
        members = [str(ids) for ids, p in zip(sent, report["prompts"]) if all(p[k] == c[k] for k in c["by"])]
        assert c["mean_accept_length"] == pytest.approx(expected_al(members, engine), abs=1e-12)
