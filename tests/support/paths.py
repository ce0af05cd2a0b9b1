"""Where the test suite's files are: one home for the paths tests used to derive from their own location."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the repository
SUPPORT = ROOT / "tests" / "support"
# Golden vectors from an independent implementation (copied from ../shared/golden; see its README).
GOLDEN = ROOT / "tests" / "golden"


#: A Jinja chat template the demo pair never saw (ChatML's role markers), for the sweep's template perturbation.
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def sweep_inputs(folder: Path) -> list[str]:
    """The sweep's inputs on the demo pair, as `acceptance` arguments: conversations in two domains (rendered with
    the target's template, raw and ChatML), pre-rendered text labelled by its template, and long stories (the demo's
    generated corpus) that reach every --context-lengths cut; 24 new tokens each, EOS ignored."""
    import json

    from eagle31_mla.demo import demo_prompts
    from eagle31_mla.testing import demo_corpus

    stories, _ = demo_corpus(seed=5, n=8)
    rows = [
        {"domain": ("qa", "story")[i % 2], "messages": [{"role": "user", "content": p}]}
        for i, p in enumerate(demo_prompts(4))
    ]
    rows += [{"domain": "story", "template": "plain", "prompt": p} for p in demo_prompts(6)[4:]]
    rows += [
        {"domain": "story", "conversation": [{"role": "user", "content": " ".join(stories[i : i + 4])}]} for i in (0, 4)
    ]
    (folder / "sweep.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    (folder / "chatml.jinja").write_text(CHATML)
    return [
        "--prompts",
        str(folder / "sweep.jsonl"),
        "--template",
        f"chatml={folder / 'chatml.jinja'}",
        "--context-lengths",
        "16,64",
        "--max-new-tokens",
        "24",
        "--ignore-eos",
        "--no-progress",
    ]
