"""Prompts and corpora as users hand them in (every line checked when read, a refusal names file and line), and the
one reading of ``eos_token_id``. No torch import here (the config checks use :func:`eos_token_ids` without it)."""

from __future__ import annotations

import bisect
import json
import numbers
import re
import sys
from pathlib import Path
from typing import Any

PROMPT_SHAPES = (
    'a string, a list of int token ids, or an object with "prompt" or "text" (a string), "messages" '
    '(a list of {"role": ..., "content": ...} objects) or "input_ids" (a list of int token ids)'
)


class PromptError(ValueError):
    """A prompt of none of the accepted shapes, or ids outside the target's vocabulary (one line: file and line)."""


def is_int(value) -> bool:
    """An int of any integral type (numpy's too) but not a bool: what the Python API's token ids may be."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_tensor(value) -> bool:
    torch = sys.modules.get("torch")  # not loaded: nothing is a tensor
    return torch is not None and isinstance(value, torch.Tensor)


def shown(value) -> str:
    """A refused value as the library's messages show it: its repr when short, else its type."""
    return repr(value) if len(repr(value)) <= 40 else f"a {type(value).__name__}"


def eos_token_ids(value, *, vocab_size: int | None = None, strict: bool = False) -> tuple[int, ...]:
    """An ``eos_token_id`` setting as a tuple of ints. ``strict`` (the Python API): a non-id, or one outside
    [0, ``vocab_size``), is a DraftInputError (never iterated or cast); not strict: non-ids are left out."""
    within = f" in [0, {vocab_size})" if vocab_size is not None else ""

    def refuse(what: str):
        from .model.modeling_eagle31_mla import DraftInputError  # loads torch: only on the way to a refusal

        raise DraftInputError(f"`eos_token_id` {what}; expected None, an int token id{within} or a list of them")

    if value is None:
        return ()
    items = value
    if _is_tensor(value):
        import torch

        if value.is_floating_point() or value.is_complex() or value.dtype == torch.bool or value.dim() > 1:
            return refuse(f"is a {value.dtype} tensor of shape {tuple(value.shape)}") if strict else ()
        items = value.tolist()
    if is_int(items):
        items = [items]
    elif not isinstance(items, (list, tuple, set, frozenset, range)):
        return refuse(f"is {shown(value)}") if strict else ()

    fits = lambda i: is_int(i) and (vocab_size is None or 0 <= i < vocab_size)  # noqa: E731
    if strict and (bad := [i for i in items if not fits(i)]):
        refuse(f"holds {shown(bad[0])}")
    return tuple(int(i) for i in items if fits(i))


def read_prompt_lines(path: str | Path) -> list[tuple[str, Any]]:
    """``(file:line, prompt)`` per non-empty line: ``.jsonl`` / ``.json`` (:data:`PROMPT_SHAPES`) or plain text; or a
    prompt set through the ``datasets`` library (:func:`read_hub_prompts`)."""
    if str(path).startswith(HUB_PREFIX):
        return read_hub_prompts(str(path))
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        byte = f"byte {err.object[err.start]:#04x} at offset {err.start}"
        raise PromptError(f"{path}: expected UTF-8 text, {byte} is not") from None
    lines = [(f"{path}:{i}", line) for i, line in enumerate(text.splitlines(), 1) if line.strip()]
    if path.suffix not in (".jsonl", ".json"):
        return lines
    prompts = []
    for where, line in lines:
        try:
            prompt = json.loads(line)
        except json.JSONDecodeError as err:
            raise PromptError(f"{where}: not a JSON line ({err})") from None
        if isinstance(prompt, dict) and "conversation" in prompt and "messages" not in prompt:  # the same, named so
            prompt["messages"] = prompt.pop("conversation")
        check_prompt_shape(prompt, where)
        prompts.append((where, prompt))
    return prompts


HUB_PREFIX = "hf:"
HUB_SPEC = re.compile(r"hf:(?P<name>[^:@\s]+)(?::(?P<config>[^:@\s]+))?(?:@(?P<split>[^:@\s]+))?")
#: A row's columns, by what they hold, first match wins: a conversation (or MT-Bench's list of user turns), a text
#: prompt, a domain label (else the dataset's config name).
HUB_COLUMNS = {
    "messages": ("messages", "conversation", "conversations", "turns"),
    "prompt": ("prompt", "text", "question", "instruction", "problem", "input"),
    "domain": ("domain", "category", "subset", "task"),
}
_SHAREGPT_ROLES = {"human": "user", "gpt": "assistant"}


def read_hub_prompts(spec: str) -> list[tuple[str, Any]]:
    """``hf:NAME[:CONFIG][@SPLIT]`` (a Hub id, or a local dataset folder; split default ``test``, else the first) read
    by ``datasets.load_dataset`` (the Hub's cache when offline), each row mapped by :data:`HUB_COLUMNS` to a
    prompts-file line: a conversation up to its last user turn (the model writes the rest), or a text prompt."""
    if not (match := HUB_SPEC.fullmatch(spec)):
        raise PromptError(f"{spec}: expected hf:NAME[:CONFIG][@SPLIT], e.g. hf:org/prompts:math@test")
    try:
        import datasets
    except ImportError:
        raise PromptError(
            f"{spec}: a Hub prompt set is read with `datasets`: pip install 'eagle31-mla[datasets]'"
        ) from None
    try:
        sets = datasets.load_dataset(match["name"], match["config"])
    except Exception as err:  # noqa: BLE001 - not found, offline without a cache, a broken set: the input's fault
        raise PromptError(f"{spec}: the datasets library cannot load it ({type(err).__name__}: {err})") from None
    split = match["split"] or ("test" if "test" in sets else next(iter(sets)))
    if split not in sets:
        raise PromptError(f"{spec}: no split {split!r}; it has {', '.join(sets)}")
    lines = []
    for i, row in enumerate(sets[split], 1):
        where = f"hf:{match['name']}@{split}:{i}"
        found = {what: next((row[c] for c in columns if row.get(c)), None) for what, columns in HUB_COLUMNS.items()}
        line = {"domain": str(found["domain"] or match["config"] or "-")}
        if isinstance(found["messages"], list):
            turns = [{"role": "user", "content": t} if isinstance(t, str) else t for t in found["messages"]]
            turns = turns[:1] if isinstance(found["messages"][0], str) else turns  # MT-Bench: the first turn
            turns = [
                t
                if "role" in t
                else {"role": _SHAREGPT_ROLES.get(t.get("from"), t.get("from")), "content": t.get("value")}
                for t in turns
                if isinstance(t, dict)
            ]
            while turns and turns[-1].get("role") == "assistant":
                turns.pop()
            line["messages"] = turns
        elif found["prompt"] is not None:
            line["prompt"] = found["prompt"]
        else:
            known = ", ".join(HUB_COLUMNS["messages"] + HUB_COLUMNS["prompt"])
            raise PromptError(f"{where}: no prompt column (one of {known}); the row has {', '.join(row)}")
        check_prompt_shape(line, where)
        lines.append((where, line))
    return lines


def read_corpus(path: str | Path) -> list[str]:
    """A training corpus's documents, one per line: text or (JSONL) ``{"text": str}``; at least one non-empty."""
    texts = []
    for where, line in read_prompt_lines(path):
        text = line.get("text") if isinstance(line, dict) else line
        if not isinstance(text, str):
            raise PromptError(f'{where}: expected a text line or a JSON object with a "text" string')
        if text.strip():
            texts.append(text)
    if not texts:
        raise PromptError(f"expected at least one non-empty document, {path} has none")
    return texts


def _id_list_problem(ids: Any, vocab_size: int | None = None) -> str | None:
    """Why ``ids`` is not a non-empty list of int token ids (within ``vocab_size`` when given), or None."""
    if not isinstance(ids, (list, tuple)):
        return f"a {type(ids).__name__}, not a list of token ids"
    if not ids:
        return "an empty list (a prompt needs at least one token)"
    for i, value in enumerate(ids):
        if not is_int(value):
            return f"{value!r} ({type(value).__name__}) at index {i}, not an int token id"
        if vocab_size is not None and not 0 <= value < vocab_size:
            return f"token id {value} at index {i}, outside the target's vocabulary [0, {vocab_size})"
    return None


def check_prompt_shape(prompt: Any, where: str = "prompt") -> None:
    """Refuse a prompt of none of :data:`PROMPT_SHAPES` (ids must be JSON ints: no bools, floats or strings)."""

    def refuse(what: str):
        raise PromptError(f"{where}: {what}; expected {PROMPT_SHAPES}")

    if isinstance(prompt, str):
        return None if prompt.strip() else refuse("an empty prompt")
    if isinstance(prompt, list):
        if problem := _id_list_problem(prompt):
            refuse(f"a list holding {problem}" if prompt else problem)
        return
    if not isinstance(prompt, dict):
        scalar = prompt is None or isinstance(prompt, (int, float, bool))
        refuse(json.dumps(prompt) if scalar else type(prompt).__name__)
    keys = [key for key in ("input_ids", "messages", "prompt", "text") if key in prompt]
    if not keys:
        refuse(f"an object with keys {sorted(prompt)}")
    if len(keys) > 1:
        refuse(f"an object with both {keys[0]!r} and {keys[1]!r} (which one is the prompt?)")
    key, value = keys[0], prompt[keys[0]]
    if key == "input_ids":
        if problem := _id_list_problem(value):
            refuse(f'"input_ids" is {problem}')
    elif key == "messages":
        if not isinstance(value, list) or not value:
            refuse(f'"messages" is {json.dumps(value)[:60] if not isinstance(value, list) else "an empty list"}')
        for i, m in enumerate(value):
            role, content = (m.get("role"), m.get("content")) if isinstance(m, dict) else (None, None)
            if not (isinstance(role, str) and isinstance(content, (str, list))):
                refuse(f'"messages"[{i}] is {json.dumps(m)[:60]}, not a {{"role": str, "content": str}} object')
    elif not isinstance(value, str) or not value.strip():
        refuse(f'"{key}" is {json.dumps(value)[:60]}, not a non-empty string')


def prompt_token_ids(prompt: Any, tokenizer=None, vocab_size: int | None = None, where: str = "prompt") -> list[int]:
    """Token ids of one prompt, checked; text through the tokenizer, chat messages through its chat template."""
    if _is_tensor(prompt):
        return prompt_tensor(prompt, vocab_size or 2**62)[0].tolist()
    check_prompt_shape(prompt, where)
    if isinstance(prompt, dict):
        key = next(key for key in ("input_ids", "messages", "prompt", "text") if key in prompt)
        if key == "messages":
            if tokenizer is None:
                raise PromptError(f"{where}: chat `messages` prompts need a tokenizer")
            if not getattr(tokenizer, "chat_template", None):
                raise PromptError(f"{where}: the target's tokenizer has no chat template; give `prompt` or `input_ids`")
            ids = tokenizer.apply_chat_template(prompt["messages"], add_generation_prompt=True, tokenize=True)
            ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
        else:
            return prompt_token_ids(prompt[key], tokenizer, vocab_size, where)
    elif isinstance(prompt, str):
        if tokenizer is None:
            raise PromptError(f"{where}: text prompts need a tokenizer")
        ids = list(tokenizer(prompt)["input_ids"])
    else:
        ids = list(prompt)
    if problem := _id_list_problem(ids, vocab_size):
        raise PromptError(f"{where}: the prompt's ids hold {problem}")
    return ids


def prompt_tensor(input_ids, vocab_size: int):
    """The Python API's ``input_ids`` ([n], [1, n] or a sequence of ints) as [1, n] int64; never cast."""
    import torch

    from .model.modeling_eagle31_mla import DraftInputError

    if isinstance(input_ids, torch.Tensor):
        if input_ids.is_floating_point() or input_ids.is_complex() or input_ids.dtype == torch.bool:
            raise DraftInputError(f"`input_ids` has dtype {input_ids.dtype}; expected integer token ids")
        if input_ids.dim() > 2 or (input_ids.dim() == 2 and input_ids.shape[0] != 1):
            raise DraftInputError(f"`input_ids` has shape {tuple(input_ids.shape)}; expected one prompt: [n] or [1, n]")
        ids = input_ids.reshape(-1).tolist()
    else:
        try:
            ids = list(input_ids)
        except TypeError:
            kind = type(input_ids).__name__
            raise DraftInputError(f"`input_ids` is a {kind}; expected a tensor or a sequence of token ids") from None
        if bad := [i for i in ids if not is_int(i)]:
            raise DraftInputError(f"`input_ids` holds {bad[0]!r} ({type(bad[0]).__name__}); expected int token ids")
    if not ids:
        raise DraftInputError("`input_ids` is empty; expected a prompt of at least one token")
    if not all(0 <= i < vocab_size for i in ids):
        within = f"expected ids in [0, {vocab_size}) (the target's vocabulary)"
        raise DraftInputError(f"`input_ids` hold ids in [{min(ids)}, {max(ids)}]; {within}")
    return torch.tensor([ids], dtype=torch.long)


def read_conversations(path: str | Path) -> list[tuple[str, list[dict]]]:
    """``(where, messages)`` for every line of a JSONL conversations file, each with an assistant turn's text."""
    if Path(path).suffix not in (".jsonl", ".json"):
        raise PromptError(f'{path}: expected a .jsonl file, one {{"messages": [...]}} object per line')
    conversations = []
    for where, line in read_prompt_lines(path):
        if not (isinstance(line, dict) and "messages" in line):
            raise PromptError(f'{where}: expected an object with "messages" (a conversation to train on)')
        if not any(m["role"] == "assistant" and _text_of(m["content"]) for m in line["messages"]):
            raise PromptError(f"{where}: no assistant turn with text content: nothing to train on")
        conversations.append((where, line["messages"]))
    if not conversations:
        raise PromptError(f"{path}: expected at least one conversation, found none")
    return conversations


def _text_of(content) -> str:
    """A message's text: the string, or the text parts of a multi-part content list joined."""
    if isinstance(content, str):
        return content
    return "".join(part.get("text", "") for part in content if isinstance(part, dict) and part.get("type") == "text")


def conversation_tokens(messages, tokenizer, *, last_turn_only=False, max_tokens=None, where="conversation"):
    """A conversation's ids rendered by the chat template, and its loss mask (as TorchSpec's): 1 on assistant
    content, 0 elsewhere. A turn's content is found after the render of the turns before it and mapped to tokens by
    decoding prefixes (a token straddling header and content counts as content)."""
    if not getattr(tokenizer, "chat_template", None):
        raise PromptError(f"{where}: the target's tokenizer has no chat template to render conversations with")

    def render(turns, generation_prompt):
        return tokenizer.apply_chat_template(turns, add_generation_prompt=generation_prompt, tokenize=False)

    text = render(messages, False)
    ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
    decode = lambda n: tokenizer.decode(ids[:n], skip_special_tokens=False, clean_up_tokenization_spaces=False)  # noqa: E731
    if decode(len(ids)) != text:
        why = "the tokenizer's decode does not give back the rendered conversation"
        raise PromptError(f"{where}: {why}, so its assistant tokens cannot be located")

    # the first token whose decoded prefix reaches past character `c`
    token_holding = lambda c: bisect.bisect_right(range(len(ids)), c, key=lambda n: len(decode(n + 1)))  # noqa: E731
    turns = [i for i, m in enumerate(messages) if m["role"] == "assistant" and _text_of(m["content"])]
    turns = turns[-1:] if last_turn_only else turns
    mask = [0] * len(ids)
    for i in turns:
        head = render(messages[:i], True)
        content = _text_of(messages[i]["content"])
        start = text.find(content, len(head)) if text.startswith(head) else -1
        if start < 0 and content.strip():
            start = text.find(content.strip(), len(head)) if text.startswith(head) else -1
            content = content.strip()
        if start < 0:
            why = "(the render of the turns before it, with the generation prompt, must begin the whole render"
            why += ", and the turn's content follow it verbatim)"
            raise PromptError(f"{where}: assistant turn {i} is not where the chat template puts it {why}")
        first, last = token_holding(start), token_holding(start + len(content) - 1)
        mask[first : last + 1] = [1] * (last + 1 - first)
    return ids[:max_tokens], mask[:max_tokens]


def conversation_sequences(path: str | Path, tokenizer, max_tokens: int, *, last_turn_only=False, vocab_size=None):
    """(token ids, loss masks, how many conversations had no trained prediction within ``max_tokens``)."""
    kept, conversations = [], read_conversations(path)
    for where, messages in conversations:
        ids, mask = conversation_tokens(messages, tokenizer, last_turn_only=last_turn_only, max_tokens=max_tokens)
        if problem := _id_list_problem(ids, vocab_size):
            raise PromptError(f"{where}: the rendered conversation's ids hold {problem}")
        if sum(mask[:-1]) > 0:  # a trained token must be followed by one to predict
            kept.append((ids, mask))
    if not kept:
        raise PromptError(f"{path}: no conversation has assistant content within its first {max_tokens} tokens")
    return [ids for ids, _ in kept], [mask for _, mask in kept], len(conversations) - len(kept)
