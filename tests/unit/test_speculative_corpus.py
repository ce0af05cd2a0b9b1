"""Every argument of speculative_generate and measure_acceptance, enumerated from their signatures, refuses
values of the wrong type or domain before any compute: a DraftInputError naming the argument, never a raw
TypeError / OverflowError deep in the loop, never a silent reading (a string eos iterated char by char,
"no" read as True, a dict's keys taken as prompts). A new argument without bad-value cases fails
test_every_argument_has_bad_values."""

from __future__ import annotations

import inspect

import numpy as np
import pytest
import torch

from eagle31_mla.decoding.speculative import measure_acceptance, speculative_generate
from eagle31_mla.model.modeling_eagle31_mla import DraftInputError
from tests.unit.test_speculative import VOCAB, drafter, prompt, tiny_target

# Runs again on the other transformers versions (scripts/test.sh): see tests/unit/test_transformers_selection.py.
pytestmark = pytest.mark.transformers


@pytest.fixture(scope="module")
def pair():
    torch.set_num_threads(1)
    return tiny_target(), drafter()


# value -> the argument; "{drafter}" / "{vocab}" are filled in from the pair
COMMON = {
    "target": ["not a model", 5, "{drafter}"],  # "{drafter}": a drafter passed as the target
    "drafter": ["not a model", None, "{target}"],
    "num_steps": [0, -1, 1.5, True, "3", 10**9],
    "topk": [0, -1, 2.5, "1", 10**9],
    "num_draft_tokens": [1.5, "4", 10**9],
    "temperature": [-1.0, float("nan"), float("inf"), "0"],
    "top_p": [0.0, 1.5, float("nan"), "1"],
    "max_new_tokens": [0, -1, 1.5, "8", 10**12],
    "sampling_backend": ["cuda", "FLASHINFER", None, 1],
    "eos_token_id": [
        "381",
        -1,
        "{vocab}",
        True,
        10**9,
        2.0,
        torch.tensor([2.0, 3.0]),
        torch.tensor([[2, 3]]),
        [1, "2"],
        {"a": 1},
        b"\x02",
    ],
}
BAD = {
    "speculative_generate": {
        **COMMON,
        "input_ids": ["text", [], [1.5, 2], [-1], [VOCAB], torch.tensor([[1.0, 2.0]]), 7],
        "generator": [np.random.default_rng(0), 5, "seed"],
        "tree": ["yes", 1],
    },
    "measure_acceptance": {
        **COMMON,
        "prompts": [{"a": [1, 2]}, "a prompt", 5, torch.tensor([[1, 2]]), []],
        "seed": [2**70, 1.5, -1, "0", True],
        "tokenizer": ["gpt2", 5],
        "ignore_eos": ["no", 0, None],
        "progress": ["no", 1],
    },
}
FUNCTIONS = {"speculative_generate": speculative_generate, "measure_acceptance": measure_acceptance}


def valid_call(name: str, target, draft) -> dict:
    ids = prompt(5)
    base = dict(target=target, drafter=draft, max_new_tokens=4)
    return {**base, "input_ids": ids} if name == "speculative_generate" else {**base, "prompts": [ids]}


def test_every_argument_has_bad_values():
    for name, fn in FUNCTIONS.items():
        params = set(inspect.signature(fn).parameters)
        missing = params - set(BAD[name])
        assert not missing, f"{name}: arguments without bad-value cases: {sorted(missing)}"
        assert not set(BAD[name]) - params, f"{name}: cases for arguments it does not take: {set(BAD[name]) - params}"


CASES = [(name, arg, i) for name, table in BAD.items() for arg, values in table.items() for i in range(len(values))]


@pytest.mark.parametrize("name, arg, i", CASES, ids=[f"{n}-{a}-{i}" for n, a, i in CASES])
def test_bad_value_is_refused_naming_the_argument(name, arg, i, pair):
    target, draft = pair
    value = BAD[name][arg][i]
    if isinstance(value, str) and value.startswith("{") and value.endswith("}"):
        value = {"{drafter}": draft, "{target}": target, "{vocab}": VOCAB}[value]
    kwargs = valid_call(name, target, draft)
    kwargs[arg] = value
    fn = FUNCTIONS[name]
    with pytest.raises(DraftInputError) as err:
        fn(**kwargs)
    message = str(err.value)
    assert f"`{arg}`" in message or (arg == "prompts" and "prompt" in message), message
    assert "expected" in message, message
    assert len(message.splitlines()) == 1, message


@pytest.mark.parametrize("name", list(FUNCTIONS))
def test_valid_calls_still_run(name, pair):
    target, draft = pair
    kwargs = valid_call(name, target, draft)
    kwargs["eos_token_id"] = torch.tensor([2, 3])  # an integer tensor of ids is read as those ids
    FUNCTIONS[name](**kwargs)
