"""Chat-rendered training data: conversations rendered with the target's chat template, the loss on assistant
content only (every turn, or the last), carried through live training, captures and the CLI."""

from __future__ import annotations

import json

import pytest
import torch

from eagle31_mla.cli import main
from eagle31_mla.demo import DEMO_DIR
from eagle31_mla.prompts import PromptError, conversation_sequences, conversation_tokens, read_conversations

# Runs again on the other transformers versions (scripts/test.sh): see tests/unit/test_transformers_selection.py.
pytestmark = pytest.mark.transformers

ROLES = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)
CHAT = [
    {"role": "system", "content": "be brief"},
    {"role": "user", "content": "hello there"},
    {"role": "assistant", "content": "the cat sat"},
    {"role": "user", "content": "more"},
    {"role": "assistant", "content": "on the mat"},
]


@pytest.fixture()
def tokenizer():
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(DEMO_DIR / "target")
    tok.chat_template = ROLES
    return tok


def masked_spans(tokenizer, ids, mask) -> list[str]:
    """The decoded runs of masked tokens."""
    spans, run = [], []
    for i, m in zip(ids + [None], mask + [0]):
        if m:
            run.append(i)
        elif run:
            spans.append(tokenizer.decode(run))
            run = []
    return spans


def test_the_mask_covers_assistant_content_only(tokenizer):
    ids, mask = conversation_tokens(CHAT, tokenizer)
    assert ids == list(tokenizer.apply_chat_template(CHAT, tokenize=True)["input_ids"])  # the template's own ids
    # the space after "assistant:" is merged into the content's first token, which counts as content
    assert masked_spans(tokenizer, ids, mask) == [" the cat sat", " on the mat"]
    unmasked = tokenizer.decode([i for i, m in zip(ids, mask) if not m])
    assert unmasked == "system: be brief\nuser: hello there\nassistant:\nuser: more\nassistant:\n"
    ids_last, mask_last = conversation_tokens(CHAT, tokenizer, last_turn_only=True)
    assert ids_last == ids and masked_spans(tokenizer, ids, mask_last) == [" on the mat"]
    short_ids, short_mask = conversation_tokens(CHAT, tokenizer, max_tokens=20)
    assert short_ids == ids[:20] and short_mask == mask[:20]


def test_multi_part_content_and_the_demo_template():
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(DEMO_DIR / "target")  # its own template: contents joined by spaces
    parts = [dict(m, content=[{"type": "text", "text": m["content"]}]) if m["role"] == "assistant" else m for m in CHAT]
    plain_ids, plain_mask = conversation_tokens(CHAT[1:], tok)
    assert masked_spans(tok, plain_ids, plain_mask) == [" the cat sat", " on the mat"]
    tok.chat_template = ROLES.replace(
        "m['content']", "m['content'] if m['content'] is string else m['content'][0].text"
    )
    ids, mask = conversation_tokens(parts, tok)
    assert masked_spans(tok, ids, mask) == [" the cat sat", " on the mat"]


@pytest.mark.parametrize(
    "template, message",
    [
        (None, "has no chat template"),
        ("{{ messages|length }} " + ROLES, "not where the chat template puts it"),  # rewrites earlier turns
        (ROLES.replace("m['content'] }}", "m['content']|upper }}"), "not where the chat template puts it"),
    ],
)
def test_a_template_the_mask_cannot_follow_is_refused(tokenizer, template, message):
    tokenizer.chat_template = template
    with pytest.raises(PromptError, match=message):
        conversation_tokens(CHAT, tokenizer, where="c.jsonl:3")


def test_a_tokenizer_that_does_not_decode_back_is_refused(tokenizer, monkeypatch):
    monkeypatch.setattr(type(tokenizer), "decode", lambda self, ids, **kw: "x" * len(ids))
    with pytest.raises(PromptError, match="c.jsonl:3: the tokenizer's decode does not give back"):
        conversation_tokens(CHAT, tokenizer, where="c.jsonl:3")


@pytest.mark.parametrize(
    "name, text, message",
    [
        ("c.txt", "hello\n", "expected a .jsonl file"),
        ("c.jsonl", '{"prompt": "x"}\n', 'c.jsonl:1: expected an object with "messages"'),
        ("c.jsonl", '"x"\n', 'expected an object with "messages"'),
        ("c.jsonl", '{"messages": [{"role": "user", "content": "x"}]}\n', "c.jsonl:1: no assistant turn"),
        ("c.jsonl", '{"messages": [{"role": "assistant", "content": ""}]}\n', "no assistant turn with text"),
        ("c.jsonl", '{"messages": [{"role": "assistant"}]}\n', 'c.jsonl:1: "messages"\\[0\\]'),
        ("c.jsonl", "\n\n", "at least one conversation"),
    ],
)
def test_bad_conversation_files_are_refused_by_line(tmp_path, name, text, message):
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(PromptError, match=message):
        read_conversations(path)


def test_conversations_whose_assistant_content_is_cut_off_are_left_out_and_counted(tmp_path, tokenizer):
    path = tmp_path / "c.jsonl"
    long_user = [{"role": "user", "content": "word " * 100}, {"role": "assistant", "content": "late answer"}]
    path.write_text("\n".join(json.dumps({"messages": m}) for m in (CHAT, long_user)) + "\n")
    sequences, masks, left_out = conversation_sequences(path, tokenizer, 80)
    assert (
        left_out == 1
        and len(sequences) == 1
        and sequences[0] == conversation_tokens(CHAT, tokenizer)[0]
        and masks[0] == conversation_tokens(CHAT, tokenizer, max_tokens=80)[1]
    )
    with pytest.raises(PromptError, match="outside the target's vocabulary"):
        conversation_sequences(path, tokenizer, 80, vocab_size=100)
    with pytest.raises(PromptError, match="no conversation has assistant content within its first 5 tokens"):
        conversation_sequences(path, tokenizer, 5)


def test_live_batches_carry_the_conversation_masks(tokenizer):
    from transformers import AutoModelForCausalLM

    from eagle31_mla.model.aux_layers import AuxLayerIds
    from eagle31_mla.training.trainer import LiveTarget

    target = AutoModelForCausalLM.from_pretrained(DEMO_DIR / "target", dtype=torch.float32).eval()
    first, second = conversation_tokens(CHAT, tokenizer), conversation_tokens(CHAT[:3], tokenizer)
    states = LiveTarget(target, [first[0], second[0]], [first[1], second[1]])
    ids, aux, probs, mask = states.batch(torch.tensor([1, 0]), AuxLayerIds((1, 2, 4)))
    n = len(second[0])
    assert ids.shape == mask.shape == (2, len(first[0]))
    assert mask[0].tolist() == second[1] + [0] * (len(first[0]) - n) and mask[1].tolist() == first[1]
    assert ids[0, :n].tolist() == second[0] and ids[0, n:].eq(0).all()
    # the target is causal: the padding after the shorter conversation leaves its states as they are alone
    alone_aux, _ = LiveTarget(target, [second[0]], [second[1]]).batch(torch.tensor([0]), AuxLayerIds((1, 2, 4)))[1:3]
    assert torch.allclose(aux[0, :n], alone_aux[0], atol=1e-5)


def test_captured_batches_carry_the_conversation_masks(tmp_path):
    from eagle31_mla.model.aux_layers import AuxLayerIds
    from eagle31_mla.training.captured import (
        CapturedStates,
        CaptureManifest,
        inputs_digest,
        write_manifest,
        write_shard,
    )
    from eagle31_mla.training.trainer import CapturedTarget

    masks = [[0, 0, 1, 1, 1], [0, 1, 1]]
    manifest = CaptureManifest(
        target={"name": "t", "architectures": [], "num_hidden_layers": 4, "hidden_size": 8, "vocab_size": 16},
        aux_layer_ids=[1, 2],
        dtype="float32",
        top_k=2,
        inputs_sha256=inputs_digest([[1] * 5, [1] * 3], masks),
        num_inputs=2,
        engine="test",
        loss_mask="assistant",
    )
    items = [
        (i, torch.ones(n, dtype=torch.long), torch.zeros(n, 2, 8), torch.zeros(n, 2), torch.ones(n, 2), m)
        for i, (n, m) in enumerate(zip((5, 3), masks))
    ]
    manifest.shards.append(write_shard(tmp_path, 0, items))
    write_manifest(tmp_path, manifest)
    data = CapturedStates(tmp_path)
    assert data.manifest.loss_mask == "assistant"
    *_, mask = CapturedTarget(data, 16).batch(torch.tensor([0, 1]), AuxLayerIds((1, 2)))
    assert mask.tolist() == [[0, 0, 1, 1, 1], [0, 1, 1, 0, 0]]
    assert inputs_digest([[1] * 5, [1] * 3], masks) != inputs_digest([[1] * 5, [1] * 3])  # resuming checks masks


def test_train_on_conversations_from_the_command_line(tmp_path, capsys):
    path = tmp_path / "chats.jsonl"
    lines = [
        {
            "messages": [
                {"role": "user", "content": f"tell me about the {animal}"},
                {"role": "assistant", "content": f"the {animal} sat on the mat and looked at the {animal} next door"},
            ]
        }
        for animal in ("cat", "dog", "bird", "fish")
    ]
    path.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    out = tmp_path / "drafter"
    argv = ["train", "--target", str(DEMO_DIR / "target"), "--conversations", str(path), "--out", str(out)]
    argv += ["--steps", "2", "--batch-size", "2", "--seq-len", "40", "--anchors", "4", "--anchor-max-gap", "1"]
    argv += ["--draft-config", str(DEMO_DIR / "draft")]  # a small layer: a small checkpoint
    assert main(argv + ["--last-turn-only", "--quiet", "--device", "cpu"]) == 0, capsys.readouterr().err
    recipe = json.loads((out / "training.json").read_text())
    assert recipe["num_anchors"] == 4 and recipe["anchor_max_gap"] == 1
    assert (out / "model.safetensors").is_file()
