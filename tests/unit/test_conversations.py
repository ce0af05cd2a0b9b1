"""Chat-rendered training data: conversations rendered with the target's chat template, the loss on assistant
content only (every turn, or the last), carried through live training. Captured batches carry their masks:
tests/unit/test_captured.py; the CLI: tests/unit/test_training.py and tests/engines/test_vllm_capture.py; the
conversation files refused: rows of tests/unit/test_bad_inputs.py."""

from __future__ import annotations

import itertools
import json

import pytest
import torch

from eagle31_mla.demo import DEMO_DIR
from eagle31_mla.prompts import PromptError, conversation_sequences, conversation_tokens

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
    runs = itertools.groupby(zip(ids, mask), key=lambda pair: pair[1])
    return [tokenizer.decode([i for i, _ in run]) for masked, run in runs if masked]


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
        (ROLES, "c.jsonl:3: the tokenizer's decode does not give back"),  # with a decode that does not
    ],
)
def test_a_template_or_tokenizer_the_mask_cannot_follow_is_refused(tokenizer, monkeypatch, template, message):
    tokenizer.chat_template = template
    if "decode" in message:
        monkeypatch.setattr(type(tokenizer), "decode", lambda self, ids, **kw: "x" * len(ids))
    with pytest.raises(PromptError, match=message):
        conversation_tokens(CHAT, tokenizer, where="c.jsonl:3")


def test_conversations_whose_assistant_content_is_cut_off_are_left_out_and_counted(tmp_path, tokenizer):
    path = tmp_path / "c.jsonl"
    long_user = [{"role": "user", "content": "word " * 100}, {"role": "assistant", "content": "late answer"}]
    path.write_text("\n".join(json.dumps({"messages": m}) for m in (CHAT, long_user)) + "\n")
    sequences, masks, left_out = conversation_sequences(path, tokenizer, 80)
    assert left_out == 1 and sequences == [conversation_tokens(CHAT, tokenizer)[0]]
    assert masks == [conversation_tokens(CHAT, tokenizer, max_tokens=80)[1]]
    with pytest.raises(PromptError, match="outside the target's vocabulary"):
        conversation_sequences(path, tokenizer, 80, vocab_size=100)
    with pytest.raises(PromptError, match="no conversation has assistant content within its first 5 tokens"):
        conversation_sequences(path, tokenizer, 5)


def test_live_batches_carry_the_conversation_masks(tokenizer):
    from eagle31_mla.model.aux_layers import AuxLayerIds
    from eagle31_mla.training.trainer import LiveTarget
    from tests.support.spool_writer import demo_target

    target = demo_target()
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
