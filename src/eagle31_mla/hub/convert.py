"""``eagle31-mla convert``: load any drafter layout (strict), optionally prune the vocabulary, ``save_pretrained``, add
a model card. Memory: peak RSS 1.07x the file for the 6.03 GB published drafter (and the cast copy with --dtype).

The folder is written beside DST (``.DST.eagle31-convert-<host>-<pid>-*``, removed on an error or Ctrl-C, and by the
next convert into DST once that pid is gone), then moved in: onto a new or empty DST by one rename; into a non-empty
DST (``--force``) file by file, after DST's manifest lists every file that may be left, config.json out first and in
last (killed among those renames, DST is a folder nothing loads until the next ``--force`` completes it). ``--force``
replaces and removes only the files a manifest lists."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import tempfile
import threading
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from ..prompts import eos_token_ids
from ..serving.engine_facts import ENGINE_NAMES, ENGINES
from ..serving.engines import KIMI_K3_TARGET, InputError

#: In a converted folder: the files convert wrote there (what a later ``--force`` may replace).
MANIFEST = ".eagle31-convert-manifest.json"
_WRITER = "eagle31-mla convert"
_CANONICAL = re.compile(r"0|[1-9][0-9]*", re.ASCII)  # an integer as written: no sign, no leading zero, ASCII


class ConvertError(ValueError):
    """The source is not a drafter checkpoint the library accepts (the message names the problem)."""


@dataclass
class ConvertResult:  # the fields are `convert --json`'s keys
    folder: Path
    files: list[str]
    tensors: int
    tensor_bytes: int
    source: str
    vocab_size: int
    draft_vocab_size: int
    notes: list[str] = field(default_factory=list)


def parse_size(text: str | int) -> int:
    """Bytes from a number or a size as huggingface_hub reads ``max_shard_size`` ("10GB": powers of ten)."""
    from huggingface_hub.serialization._base import parse_size_to_int

    try:
        value = text if not isinstance(text, str) else int(text) if text.strip().isdigit() else parse_size_to_int(text)
        if type(value) is not int or value <= 0:
            raise ValueError(text)
        return value
    except (ValueError, OverflowError):
        raise InputError(f"cannot read a size from {text!r} (e.g. 10GB, 500MB, 1000000)") from None


def read_token_counts(path: str | Path) -> dict[int, int]:
    """Token frequencies over the TARGET vocabulary: a JSON object ``{"token_id": count}`` or list of counts, or text
    lines ``token_id count`` (``#`` comments; repeated ids add up); non-negative integers as written."""
    path, counts = Path(path), {}

    def fail(what: str):
        raise InputError(f"{path}: {what}")

    def number(value, what: str, where: str) -> int:
        if (isinstance(value, str) and _CANONICAL.fullmatch(value)) or (type(value) is int and value >= 0):
            return int(value)
        fail(f"{where}: expected a {what} written as a non-negative integer (no sign, no leading zero), got {value!r}")

    try:
        text = path.read_text()
        if path.suffix == ".json":  # a float (1.5, 1e400 = inf, NaN) is refused by number() with its value
            unique = lambda pairs: dict(pairs) if len(dict(pairs)) == len(pairs) else fail("a token id appears twice")  # noqa: E731
            data = json.loads(text, object_pairs_hook=unique)
    except (OSError, ValueError, RecursionError) as err:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        fail(f"cannot read token counts ({str(err).splitlines()[0]})")
    if path.suffix == ".json":
        if not isinstance(data, (dict, list)):
            fail("expected a JSON object {token_id: count} or a list of counts")
        for key, count in data.items() if isinstance(data, dict) else enumerate(data):
            counts[number(key, "token id", f"id {key!r}")] = number(count, "count", f"id {key!r}")
        return counts
    for line_number, line in enumerate(text.splitlines(), 1):
        fields = line.split("#", 1)[0].split()
        if len(fields) not in (0, 2):
            fail(f"line {line_number}: expected 'token_id count', got {line.strip()!r}")
        if fields:
            token = number(fields[0], "token id", f"line {line_number}")
            counts[token] = counts.get(token, 0) + number(fields[1], "count", f"line {line_number}")
    return counts


def choose_vocabulary(counts: Mapping[int, int], size: int, candidates: Sequence[int], always: Iterable[int] = ()):
    """The ``size`` ids to keep, ascending: ``always`` (special tokens), then the most frequent; and notes."""
    available = set(candidates)
    keep = {token for token in always if token in available}
    notes = [f"special token {t} is not in the source's vocabulary; not kept" for t in always if t not in available]
    if not len(keep) <= size <= len(available):
        raise InputError(f"--prune-vocab {size}: expected {len(keep)} (the special tokens) to {len(available)}")
    unknown = sorted(t for t in counts if t not in available)
    if unknown:
        notes.append(f"{len(unknown)} counted id(s) not in the source's vocabulary ignored (first: {unknown[:5]})")
    chosen = sorted(available - keep, key=lambda t: (-counts.get(t, 0), t))[: size - len(keep)]
    return sorted(keep | set(chosen)), notes


def _ours(name: str) -> bool:
    """A name convert writes (``--force`` refuses to overwrite such a file that no manifest of its lists)."""
    from ..model.configuration_eagle31_mla import REMOTE_CODE_FILES

    fixed = {"config.json", "README.md", "model.safetensors", "model.safetensors.index.json", MANIFEST}
    return name in fixed | set(REMOTE_CODE_FILES) or bool(re.fullmatch(r"model-\d{5}-of-\d{5}\.safetensors", name))


def _check_destination(dst: Path, force: bool) -> set[str]:
    """Refuse a DST convert cannot write without losing data; return the files an earlier convert wrote there."""
    entries = sorted(p.name for p in dst.iterdir()) if dst.exists() else []
    if entries and not force:
        raise InputError(f"the destination {dst} is not empty; pass --force to replace what an earlier convert wrote")
    try:  # the files an earlier convert wrote there (its manifest), and the manifest itself
        data = json.loads((dst / MANIFEST).read_text())
        files = data["files"] if data["written_by"] == _WRITER else []
        listed = {n for n in files if isinstance(n, str) and n not in ("", ".", "..") and "/" not in n} | {MANIFEST}
    except (OSError, UnicodeDecodeError, ValueError, TypeError, KeyError):
        listed = set()
    if clash := [name for name in entries if name not in listed and _ours(name)]:
        why = f"which convert would write but did not write there (no {MANIFEST} lists them)"
        raise InputError(f"the destination {dst} holds {', '.join(clash)}, {why}; move them away or use a new folder")
    return listed


def _clean_leftovers(dst: Path) -> list[str]:
    """Remove convert's files from the temporary folders of killed converts into ``dst``, then each empty folder."""
    notes, prefix = [], f".{dst.name}.eagle31-convert-{socket.gethostname()}-"
    for folder in sorted(p for p in dst.parent.iterdir() if p.name.startswith(prefix) and p.is_dir()):
        pid, _, rest = folder.name.removeprefix(prefix).partition("-")
        with contextlib.suppress(ProcessLookupError):  # that convert is gone: clean its folder
            os.kill(int(pid) if pid.isascii() and pid.isdigit() and rest else os.getpid(), 0)
            continue  # that convert is still running (or another process has its pid: left alone)
        for entry in folder.iterdir():
            if (_ours(entry.name) or entry.name == MANIFEST + ".new") and entry.is_file() and not entry.is_symlink():
                entry.unlink()
        if kept := sorted(p.name for p in folder.iterdir()):
            notes.append(f"kept {folder}, left by an interrupted conversion, for {', '.join(kept)} (not convert's)")
        else:
            folder.rmdir()
            notes.append(f"removed the leftovers of an interrupted conversion ({folder.name})")
    return notes


def _commit(tmp: Path, dst: Path, listed: set[str], files: list[str]) -> None:
    """Move the finished ``tmp`` into place (see the module docstring); Ctrl-C waits until it is done."""
    main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN) if main else None
    try:
        if not dst.exists() or not any(dst.iterdir()):
            return os.replace(tmp, dst)  # rename(2): atomic, onto nothing or an empty folder
        widened = {"files": sorted((listed | set(files)) - {MANIFEST}), "written_by": _WRITER}
        (tmp / (MANIFEST + ".new")).write_text(json.dumps(widened, indent=2) + "\n")
        os.replace(tmp / (MANIFEST + ".new"), dst / MANIFEST)  # lists every file that may be left in DST
        (dst / "config.json").unlink(missing_ok=True)  # listed: _check_destination refuses it otherwise
        for name in [n for n in files if n != "config.json"]:
            os.replace(tmp / name, dst / name)
        for name in listed - set(files) - {MANIFEST}:
            (dst / name).unlink(missing_ok=True)
        os.replace(tmp / "config.json", dst / "config.json")  # DST is complete and new from here
        os.replace(tmp / MANIFEST, dst / MANIFEST)
        tmp.rmdir()
    finally:
        if main:
            signal.signal(signal.SIGINT, previous)


def _prune(model, counts: Mapping[int, int], size: int):
    """(``model`` cut to the ``size`` most frequent target tokens and the special ones, notes)."""
    import torch

    from ..model.modeling_eagle31_mla import t2d_from_d2t

    config = model.config
    specials = (config.bos_token_id, config.pad_token_id, *eos_token_ids(config.eos_token_id))
    specials = [t for t in specials if t is not None]
    candidates = range(config.vocab_size) if model.d2t is None else (torch.arange(len(model.d2t)) + model.d2t).tolist()
    kept, notes = choose_vocabulary(counts, size, candidates, specials)
    row = {t: r for r, t in enumerate(candidates)}
    state = {k: v for k, v in model.state_dict().items() if k not in ("d2t", "t2d")}
    state["lm_head.weight"] = state["lm_head.weight"][[row[t] for t in kept]]
    config.draft_vocab_size = len(kept)
    pruned = type(model).on_meta_device(config)
    if pruned.d2t is not None:
        d2t = torch.tensor(kept) - torch.arange(len(kept))
        state.update(d2t=d2t, t2d=t2d_from_d2t(d2t, config.vocab_size))
    pruned.load_state_dict(state, assign=True)
    return pruned.eval(), notes


def _cast(model, dtype, notes: list[str]) -> None:
    """``model`` cast to ``dtype``; to float16, values that would become inf are refused, those becoming 0 noted."""
    import torch

    lost = {}  # name -> (values that overflow, values that underflow)
    for name, t in model.state_dict().items() if dtype == torch.float16 else ():
        if t.is_floating_point():
            lost[name] = (int((t.to(dtype).isinf() & t.isfinite()).sum()), int(((t.to(dtype) == 0) & (t != 0)).sum()))
    over, under = ({name: n[i] for name, n in lost.items() if n[i]} for i in (0, 1))
    if over:
        raise InputError(
            f"--dtype float16: {sum(over.values()):,} value(s) in {len(over)} tensor(s) exceed float16's range "
            f"(+-65504) and would become inf (first: {next(iter(over))}); keep the source dtype or use bfloat16"
        )
    if under:
        notes.append(
            f"--dtype float16: {sum(under.values()):,} nonzero value(s) in {len(under)} tensor(s) are below its "
            f"smallest subnormal (~6e-8) and became 0 (first: {next(iter(under))})"
        )
    model.to(dtype)


def _describe(config, tensor_names: list[str]) -> str:
    """The source in words: EAGLE-3 or 3.1, how its tensors are named, its vocabulary."""
    kind = "EAGLE-3.1" if config.is_eagle31 else "EAGLE-3" if not (config.fc_norm or config.norm_output) else "EAGLE-3+"
    layouts = (("midlayer.", "training names (`midlayer.*`)"), ("model.", "NeMo layout (`model.` prefix)"))
    layout = next((name for prefix, name in layouts if any(n.startswith(prefix) for n in tensor_names)), None)
    vocab = f", pruned vocabulary {config.draft_vocab_size}/{config.vocab_size}"
    return f"{kind}, {layout or 'published names'}{vocab if config.draft_vocab_size != config.vocab_size else ''}"


def convert(
    src: str | Path,
    dst: str | Path,
    *,
    prune_vocab: int | None = None,
    token_counts: str | Path | None = None,
    max_shard_size: int | str = "10GB",  # the 6.03 GB Kimi-K3 drafter stays one model.safetensors, as published
    dtype: str | None = None,
    repo_id: str | None = None,
    target_name: str = KIMI_K3_TARGET.name,
    force: bool = False,
    progress: bool = True,
) -> ConvertResult:
    """The drafter at ``src`` as a Hub-ready folder ``dst``; :class:`ConvertError` for a refused source,
    ``InputError`` for unusable arguments, ``dst`` untouched."""
    from safetensors import safe_open
    from transformers.utils import logging as hf_logging

    from ..locations import model_folder, safetensors_files
    from ..model.configuration_eagle31_mla import ConfigError, resolve_dtype
    from ..model.modeling_eagle31_mla import Eagle31MLAForCausalLM
    from ..serving.engines import probe_output_folder

    max_shard_size = parse_size(max_shard_size)
    if (prune_vocab is None) != (token_counts is None):
        raise InputError("--prune-vocab N and --token-counts FILE go together")
    out_dtype = None if dtype in (None, "keep") else resolve_dtype(dtype, "--dtype")  # a ConfigError names --dtype
    try:  # links followed, '..' resolved: DST's name and parent are real ('src/..' is not a folder inside src)
        dst = Path(dst).expanduser().resolve()
    except (OSError, RuntimeError) as err:  # RuntimeError: Python < 3.13's "Symlink loop"
        why = "a symlink loop" if "loop" in str(err) else err
        raise InputError(f"DST {dst}: cannot follow its links ({why})") from None
    if dst == dst.parent:
        raise InputError(f"DST {dst}: expected a folder to write, not the file-system root")
    probe_output_folder(dst, "DST")  # a destination that cannot be created fails before any work
    counts = read_token_counts(token_counts) if token_counts is not None else None
    folder = model_folder(src)  # an OSError (the CLI's exit 2) when there is none
    listed = _check_destination(dst, force)

    bars, verbosity = hf_logging.is_progress_bar_enabled(), hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # no load report: a refusal's one line names the tensors
    (hf_logging.enable_progress_bar if progress else hf_logging.disable_progress_bar)()
    try:
        try:  # from_pretrained refuses a missing, unexpected, misshaped or non-finite tensor by name
            names = [n for file in safetensors_files(folder) for n in safe_open(file, "pt").keys()]
            model = Eagle31MLAForCausalLM.from_pretrained(folder, dtype="auto")
        except (ConfigError, RuntimeError, ValueError, OSError) as err:  # CheckpointError is a ValueError
            raise ConvertError((str(err).strip() or repr(err)).splitlines()[0]) from None
        source, notes = _describe(model.config, names), []
        if prune_vocab is not None:
            model, notes = _prune(model, counts, prune_vocab)
        if out_dtype is not None:
            _cast(model, out_dtype, notes)
        notes += _clean_leftovers(dst) if dst.parent.is_dir() else []
        dst.parent.mkdir(parents=True, exist_ok=True)  # probe_output_folder showed it can be
        prefix = f".{dst.name}.eagle31-convert-{socket.gethostname()}-{os.getpid()}-"
        tmp = Path(tempfile.mkdtemp(prefix=prefix, dir=dst.parent))
        try:  # save_original_format=False: the published names, not the source's layout restored
            model.save_pretrained(tmp, max_shard_size=max_shard_size, save_original_format=False)
            files = sorted([p.name for p in tmp.iterdir()] + ["README.md"])
            config = json.loads((tmp / "config.json").read_text())
            (tmp / "README.md").write_text(model_card(config, repo_id or dst.name, target_name, source, files))
            (tmp / MANIFEST).write_text(json.dumps({"files": files, "written_by": _WRITER}, indent=2) + "\n")
            _commit(tmp, dst, listed, files)
        except BaseException:  # Ctrl-C included: remove this run's own (mkdtemp's, private) folder, then stop
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    finally:
        hf_logging.set_verbosity(verbosity)
        (hf_logging.enable_progress_bar if bars else hf_logging.disable_progress_bar)()
    state, vocab = model.state_dict(), (config["vocab_size"], config["draft_vocab_size"])
    return ConvertResult(dst, files, len(state), sum(t.nbytes for t in state.values()), source, *vocab, notes)


_CARD = """---
library_name: transformers
pipeline_tag: text-generation
tags: [speculative-decoding, eagle3, mla]
---

# {repo_id}

A one-layer {kind} draft model with Multi-head Latent Attention (MLA) for speculative decoding of `{target}`
(converted by `eagle31-mla convert` from a checkpoint with {source_layout}): hidden {hidden_size},
{num_attention_heads} heads, q_lora {q_lora_rank}, kv_lora {kv_lora_rank} + rope {qk_rope_head_dim}, MLP
{intermediate_size}, RoPE ({rope}); its KV cache holds {kv} values per token.{notes}

It reads the target's residual stream after zero-based layers {zero} (Transformers' `hidden_states[{one}]`),
written one-based, `{ids}`, at the top level of `config.json` (read by vLLM) and in `eagle_config` (read by SGLang
and TokenSpeed), labelled `aux_layer_ids_convention: one_based`.{warning} Check a deployment before serving (reads
only the two `config.json` files): `eagle31-mla doctor --draft {repo_id} --target {target} --engine vllm`.

## Serving

Install this project's plugin where the engine runs (`pip install "eagle31-mla[vllm]"` or `"eagle31-mla[sglang]"`):
every engine release then captures exactly these layers and applies EAGLE-3.1.
{serving}
With Transformers: `AutoModelForCausalLM.from_pretrained("{repo_id}", trust_remote_code=True)`, then
`drafter(input_ids, aux_hidden_states=aux)` (aux: the captured target states, concatenated).

## Files

{files}
"""


def model_card(config: Mapping, repo_id: str, target_name: str, source_layout: str, files) -> str:
    """README.md for the converted folder: what it is, how its aux ids are written, how to serve it."""
    from ..model.aux_layers import aux_layer_ids_from_config
    from ..model.configuration_eagle31_mla import describe_rope
    from ..serving.command import serve_command

    ids, _ = aux_layer_ids_from_config(config)
    eagle31, vocab = config.get("fc_norm") and config.get("norm_output"), config["vocab_size"]
    draft_vocab = config.get("draft_vocab_size") or vocab
    notes = " EAGLE-3.1: `fc_norm` (an RMSNorm before `fc`) and `norm_output`." if eagle31 else ""
    if draft_vocab != vocab:
        notes += f" Pruned vocabulary: {draft_vocab} of {vocab}; draft id `i` is target `i + d2t[i]`."
    warning = " **Warning:** ids from 1 cannot be expressed by SGLang's DeepSeek rule: serve with vLLM or TokenSpeed."
    target = replace(KIMI_K3_TARGET, name=target_name)
    commands = {e: serve_command(e, target_name, repo_id, target, config).text() for e in ENGINES}
    fields = dict(repo_id=repo_id, target=target_name, kind="EAGLE-3.1" if eagle31 else "EAGLE-3", notes=notes)
    fields.update(rope=describe_rope(config), kv=config["kv_lora_rank"] + config["qk_rope_head_dim"])
    fields.update(zero=", ".join(map(str, ids.zero_based)), one=", ".join(map(str, ids.one_based)))
    fields.update(ids=list(ids.one_based), warning=warning if min(ids.one_based) == 1 else "")
    fields.update(serving="".join(f"\n### {ENGINE_NAMES[e]}\n\n```bash\n{c}\n```\n" for e, c in commands.items()))
    fields.update(files="\n".join(f"- `{name}`" for name in files), source_layout=source_layout)
    return _CARD.format_map({**config, **fields})
