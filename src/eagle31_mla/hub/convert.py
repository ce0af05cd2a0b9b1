"""``eagle31-mla convert``: any drafter checkpoint the library loads -> a Hub-ready folder.

Load, prune, save, as speculators' converter does: :meth:`Eagle31MLAForCausalLM.from_pretrained` reads every layout
the library accepts (published, training ``midlayer.*``, NeMo ``model.``, EAGLE-3, pruned) and refuses a missing,
unexpected or misshaped tensor; ``--prune-vocab`` keeps the N most frequent target tokens (``d2t`` int64 offsets,
target = draft + d2t[draft]; ``t2d`` bool; the matching ``lm_head`` rows); ``save_pretrained`` writes the published
names (sharded above ``max_shard_size``), ``config.json`` with ``auto_map``, and the remote code. Added: a model card.

Memory, measured (peak RSS, ``/usr/bin/time``, CPU, a 489 MB float32 drafter): 0.93 GB kept float32, in one file or in
100 MB shards; 1.18 GB to bfloat16; 0.42 GB of it is the imports. On the published drafter's size
(``benchmarks/load_checkpoint.py``, 6,031,253,544 bytes bf16, kept bf16): peak RSS 6.03 GiB = 1.07x the file, in
46.8 s (2 CPUs). So the model once, plus its cast copy with --dtype: no streaming writer needed.

Safety: the folder is written beside DST (``.DST.eagle31-convert-<host>-<pid>-*``: removed on an error or Ctrl-C, and
by the next convert into DST once that pid is gone) and then moved in. Onto a new or empty DST, by one rename: a
convert stopped at any moment leaves DST as it was or complete and new. Into a non-empty DST (``--force``) file by
file, after DST's manifest has been widened to every file that may be left: config.json goes first and comes back
last, so a convert killed among those renames leaves a folder nothing loads, which the next ``--force`` completes.
The manifest lists what convert wrote; ``--force`` replaces and removes only those files, never another.
"""

from __future__ import annotations

import json
import math
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
from typing import Any

from ..prompts import eos_token_ids
from ..serving.engine_facts import ENGINE_NAMES, ENGINES
from ..serving.engines import KIMI_K3_TARGET, InputError

__all__ = ["convert", "ConvertError", "ConvertResult", "parse_size", "read_token_counts", "choose_vocabulary"]
__all__ += ["DEFAULT_MAX_SHARD_SIZE", "MANIFEST", "model_card"]

#: Shard above 10 GB: the 6.03 GB Kimi-K3 drafter stays one ``model.safetensors``, as published.
DEFAULT_MAX_SHARD_SIZE = 10 * 10**9
#: In a converted folder: the files convert wrote there (what a later ``--force`` may replace).
MANIFEST = ".eagle31-convert-manifest.json"
_WRITER = "eagle31-mla convert"
_CANONICAL = re.compile(r"0|[1-9][0-9]*", re.ASCII)  # an integer as written: no sign, no leading zero, ASCII


class ConvertError(ValueError):
    """The source is not a drafter checkpoint the library accepts (the message names the problem)."""


@dataclass
class ConvertResult:
    folder: Path
    files: list[str]
    num_tensors: int
    total_bytes: int
    source_layout: str
    vocab_size: int
    draft_vocab_size: int
    notes: list[str] = field(default_factory=list)


# ---- inputs ----------------------------------------------------------------------------------------------


def parse_size(text: str | int) -> int:
    """Bytes from a plain number or a size as huggingface_hub reads ``max_shard_size`` ("10GB", "500MB", "40KB":
    powers of ten), by its own ``parse_size_to_int``; ASCII only (no ``1_0``, no full-width digits)."""
    from huggingface_hub.serialization._base import parse_size_to_int

    try:
        if isinstance(text, str) and (not text.isascii() or "_" in text):
            raise ValueError(text)
        value = text if not isinstance(text, str) else int(text) if text.strip().isdigit() else parse_size_to_int(text)
    except (ValueError, OverflowError):
        raise InputError(f"cannot read a size from {text!r} (e.g. 10GB, 500MB, 1000000)") from None
    if type(value) is not int or value <= 0:
        raise InputError(f"a shard size must be positive, got {text!r}")
    return value


def read_token_counts(path: str | Path) -> dict[int, int]:
    """Token frequencies over the TARGET vocabulary, from a JSON object ``{"token_id": count}`` or list of counts
    (index = token id; each id once), or text lines ``token_id count`` (``#`` comments; repeated ids add up).
    Ids and counts are non-negative integers as written; anything else is one line naming the file."""
    path = Path(path)
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as err:
        raise InputError(f"cannot read token counts from {path} ({err})") from None

    def fail(what: str):
        raise InputError(f"{path}: {what}")

    def number(value: Any, what: str, where: Any) -> int:
        if (isinstance(value, str) and _CANONICAL.fullmatch(value)) or (type(value) is int and value >= 0):
            return int(value)
        fail(f"{where}: expected a {what} written as a non-negative integer (no sign, no leading zero), got {value!r}")

    def no_float(text: str):
        fail(f"{text} {'overflows' if math.isinf(float(text)) else 'is not an integer count'}")

    counts: dict[int, int] = {}
    if path.suffix == ".json":
        unique = lambda pairs: dict(pairs) if len(dict(pairs)) == len(pairs) else fail("a token id appears twice")  # noqa: E731
        try:
            data = json.loads(text, object_pairs_hook=unique, parse_float=no_float, parse_constant=no_float)
        except (json.JSONDecodeError, RecursionError) as err:
            fail(f"not valid JSON ({str(err).splitlines()[0]})")
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


def choose_vocabulary(
    counts: Mapping[int, int], size: int, candidates: Sequence[int], always: Iterable[int] = ()
) -> tuple[list[int], list[str]]:
    """The ``size`` target ids to keep, ascending: ``always`` (special tokens) first, then the most
    frequent candidates (ties: smaller id). Returns the ids and notes about anything unusual."""
    available = set(candidates)
    keep = {token for token in always if token in available}
    notes = [f"special token {t} is not in the source's vocabulary; not kept" for t in always if t not in available]
    if not len(keep) <= size <= len(available):
        raise InputError(f"--prune-vocab {size}: expected {len(keep)} (the special tokens) to {len(available)}")
    unknown = sorted(t for t in counts if t not in available)
    if unknown:
        notes.append(
            f"{len(unknown)} counted token id(s) not in the source's vocabulary ignored (first: {unknown[:5]})"
        )
    chosen = sorted(available - keep, key=lambda t: (-counts.get(t, 0), t))[: size - len(keep)]
    if unseen := sum(1 for t in chosen if counts.get(t, 0) == 0):
        notes.append(f"{unseen} of the kept tokens never occur in the counts (filled in ascending id order)")
    return sorted(keep | set(chosen)), notes


# ---- the destination -------------------------------------------------------------------------------------


def _ours(name: str) -> bool:
    """A name convert writes (``--force`` refuses to overwrite such a file that no manifest of its lists)."""
    from ..model.configuration_eagle31_mla import REMOTE_CODE_FILES

    fixed = {"config.json", "README.md", "model.safetensors", "model.safetensors.index.json", MANIFEST}
    return name in fixed | set(REMOTE_CODE_FILES) or bool(re.fullmatch(r"model-\d{5}-of-\d{5}\.safetensors", name))


def _listed(folder: Path) -> set[str]:
    """The files an earlier convert wrote in ``folder`` (its manifest), and the manifest itself."""
    try:
        data = json.loads((folder / MANIFEST).read_text())
        files = data["files"] if data["written_by"] == _WRITER else []
        return {n for n in files if isinstance(n, str) and n not in ("", ".", "..") and "/" not in n} | {MANIFEST}
    except (OSError, UnicodeDecodeError, ValueError, TypeError, KeyError):
        return set()


def _check_destination(dst: Path, force: bool) -> set[str]:
    """Refuse a DST convert cannot write without losing data; return the files an earlier convert wrote there."""
    if dst.exists() and not dst.is_dir():
        raise InputError(f"the destination {dst} is a file")
    entries = sorted(p.name for p in dst.iterdir()) if dst.exists() else []
    if entries and not force:
        raise InputError(f"the destination {dst} is not empty; pass --force to replace what an earlier convert wrote")
    listed = _listed(dst)
    if clash := [name for name in entries if name not in listed and _ours(name)]:
        raise InputError(
            f"the destination {dst} holds {', '.join(clash)}, which convert would write but did not write there "
            f"(no {MANIFEST} lists them); move them away or convert into a new folder"
        )
    return listed


def _clean_leftovers(dst: Path) -> list[str]:
    """Remove convert's files from the temporary folders of converts into ``dst`` that were killed (named for this
    host and a pid no longer running), then each folder if empty. Any other folder is left alone."""
    notes, prefix = [], f".{dst.name}.eagle31-convert-{socket.gethostname()}-"
    for folder in sorted(p for p in dst.parent.iterdir() if p.name.startswith(prefix) and p.is_dir()):
        pid, _, rest = folder.name.removeprefix(prefix).partition("-")
        try:
            os.kill(int(pid) if pid.isascii() and pid.isdigit() and rest else os.getpid(), 0)
            continue  # that convert is still running (or another process has its pid: left alone)
        except ProcessLookupError:
            pass
        for entry in folder.iterdir():
            if (_ours(entry.name) or entry.name == MANIFEST + ".new") and entry.is_file() and not entry.is_symlink():
                entry.unlink()
        if kept := sorted(p.name for p in folder.iterdir()):
            notes.append(f"kept {folder}, left by an interrupted conversion, for {', '.join(kept)} (not convert's)")
        else:
            folder.rmdir()
            notes.append(f"removed the leftovers of an interrupted conversion ({folder.name})")
    return notes


def _manifest(files: Iterable[str]) -> str:
    return json.dumps({"files": sorted(files), "written_by": _WRITER}, indent=2) + "\n"


def _commit(tmp: Path, dst: Path, listed: set[str], files: list[str]) -> None:
    """Move the finished ``tmp`` into place (see the module docstring); Ctrl-C waits until it is done."""
    main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN) if main else None
    try:
        if not dst.exists() or not any(dst.iterdir()):
            return os.replace(tmp, dst)  # rename(2): atomic, onto nothing or an empty folder
        (tmp / (MANIFEST + ".new")).write_text(_manifest((listed | set(files)) - {MANIFEST}))
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


# ---- the conversion --------------------------------------------------------------------------------------


def _prune(model, counts: Mapping[int, int], size: int):
    """``model`` with its vocabulary cut to the ``size`` most frequent target tokens (special tokens always kept):
    the matching ``lm_head`` rows, a new ``d2t`` / ``t2d``. Returns (model, kept target ids, notes)."""
    import torch

    from ..model.modeling_eagle31_mla import t2d_from_d2t

    config = model.config
    specials = [t for t in (config.bos_token_id, config.pad_token_id) if t is not None]
    specials += list(eos_token_ids(config.eos_token_id))
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
    return pruned.eval(), kept, notes


def _cast(model, dtype, notes: list[str]) -> None:
    """``model`` cast to ``dtype``; to float16, values beyond its range (+-65504: they would become inf) are refused
    and nonzero values below its smallest subnormal (they become 0) noted, each with its count."""
    import torch

    over, under = {}, {}
    for name, tensor in model.state_dict().items() if dtype == torch.float16 else ():
        cast = tensor.to(dtype) if tensor.is_floating_point() else tensor
        over[name], under[name] = (
            int((cast.isinf() & tensor.isfinite()).sum()),
            int(((cast == 0) & (tensor != 0)).sum()),
        )
    over, under = {k: n for k, n in over.items() if n}, {k: n for k, n in under.items() if n}
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
    layout = "published names"
    for prefix, name in (("midlayer.", "training names (`midlayer.*`)"), ("model.", "NeMo layout (`model.` prefix)")):
        layout = name if any(n.startswith(prefix) for n in tensor_names) else layout
    vocab = f", pruned vocabulary {config.draft_vocab_size}/{config.vocab_size}"
    return f"{kind}, {layout}{vocab if config.draft_vocab_size != config.vocab_size else ''}"


def convert(
    src: str | Path,
    dst: str | Path,
    *,
    prune_vocab: int | None = None,
    token_counts: str | Path | None = None,
    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
    dtype: str | None = None,
    repo_id: str | None = None,
    target_name: str = KIMI_K3_TARGET.name,
    force: bool = False,
    progress: bool = True,
) -> ConvertResult:
    """Convert the drafter at ``src`` (folder or Hub id) into a Hub-ready folder ``dst``; ``force``: replace what an
    earlier convert wrote in a non-empty ``dst`` (its manifest lists it; the user's other files there are kept).
    Raises :class:`ConvertError` when the source is refused, :class:`~eagle31_mla.serving.engines.InputError` for
    unusable arguments (``dtype="float16"`` on values it cannot hold too); ``dst`` is then untouched. (The CLI also
    refuses a DST that is, holds or lies inside SRC or --token-counts: :func:`..cli.common.check_paths`.)"""
    from safetensors import safe_open
    from transformers.utils import logging as hf_logging

    from ..locations import model_folder, safetensors_files
    from ..model.configuration_eagle31_mla import ConfigError, resolve_dtype
    from ..model.modeling_eagle31_mla import Eagle31MLAForCausalLM
    from ..serving.engines import probe_output_folder

    max_shard_size = parse_size(max_shard_size)
    if (prune_vocab is None) != (token_counts is None):
        raise InputError("--prune-vocab N and --token-counts FILE go together")
    if prune_vocab is not None and (type(prune_vocab) is not int or prune_vocab < 1):
        raise InputError(f"--prune-vocab: expected a positive integer, got {prune_vocab!r}")
    try:
        out_dtype = None if dtype in (None, "keep") else resolve_dtype(dtype, "--dtype")
    except ConfigError as err:
        raise InputError(str(err)) from None
    for flag, value in (("--repo-id", repo_id), ("--target", target_name)):
        if value is not None and (not isinstance(value, str) or not value.strip() or "\n" in value):
            raise InputError(f"{flag}: expected a non-empty name on one line, got {value!r}")
    try:  # links followed, '..' resolved: DST's name and parent are real ('src/..' is not a folder inside src)
        dst = Path(dst).expanduser().resolve()
    except (OSError, RuntimeError) as err:  # RuntimeError: Python < 3.13's "Symlink loop"
        raise InputError(
            f"DST {dst}: cannot follow its links ({'a symlink loop' if 'loop' in str(err) else err})"
        ) from None
    if dst == dst.parent:
        raise InputError(f"DST {dst}: expected a folder to write, not the file-system root")
    probe_output_folder(dst, "DST")  # a destination that cannot be created fails before any work
    counts = read_token_counts(token_counts) if token_counts is not None else None
    try:
        folder = model_folder(src)
    except Exception as err:
        raise InputError(f"cannot find the source {src} ({type(err).__name__}: {err})".splitlines()[0]) from None
    if not (folder / "config.json").is_file():
        raise InputError(f"{folder} has no config.json")
    listed = _check_destination(dst, force)

    bars, verbosity = hf_logging.is_progress_bar_enabled(), hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # no load report: a refusal's one line names the tensors
    if not progress:
        hf_logging.disable_progress_bar()
    try:
        try:  # ignore_mismatched_sizes: a misshaped tensor comes back in the loading info, refused by name
            names = [n for file in safetensors_files(folder) for n in safe_open(file, "pt").keys()]
            model = Eagle31MLAForCausalLM.from_pretrained(folder, dtype="auto", ignore_mismatched_sizes=True)
        except (ConfigError, RuntimeError, ValueError, OSError) as err:  # CheckpointError is a ValueError
            raise ConvertError((str(err).strip() or repr(err)).splitlines()[0]) from None
        source, kept, notes = _describe(model.config, names), None, []
        if prune_vocab is not None:
            model, kept, notes = _prune(model, counts, prune_vocab)
        if out_dtype is not None:
            _cast(model, out_dtype, notes)
        notes += _clean_leftovers(dst) if dst.parent.is_dir() else []
        try:
            dst.parent.mkdir(parents=True, exist_ok=True)
            prefix = f".{dst.name}.eagle31-convert-{socket.gethostname()}-{os.getpid()}-"
            tmp = Path(tempfile.mkdtemp(prefix=prefix, dir=dst.parent))
        except OSError as err:
            raise InputError(f"cannot write DST {dst}: {err.strerror or err}") from None
        try:  # save_original_format=False: the published names, not the source's layout restored
            model.save_pretrained(tmp, max_shard_size=max_shard_size, save_original_format=False)
            files = sorted([p.name for p in tmp.iterdir()] + ["README.md"])
            config = json.loads((tmp / "config.json").read_text())
            try:
                card = model_card(
                    config,
                    repo_id=repo_id or dst.name,
                    target_name=target_name,
                    source_layout=source,
                    files=files,
                    kept_targets=kept,
                )
            except (ValueError, TypeError, KeyError) as err:
                raise ConvertError(
                    f"cannot write the model card for this config ({type(err).__name__}: {err})"
                ) from None
            (tmp / "README.md").write_text(card)
            (tmp / MANIFEST).write_text(_manifest(files))
            _commit(tmp, dst, listed, files)
        except BaseException:  # Ctrl-C included: remove this run's own (mkdtemp's, private) folder, then stop
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars and not progress:
            hf_logging.enable_progress_bar()
    state, vocab = model.state_dict(), (config["vocab_size"], config["draft_vocab_size"])
    total = sum(t.numel() * t.element_size() for t in state.values())
    return ConvertResult(dst, files, len(state), total, source, *vocab, notes)


# ---- the model card --------------------------------------------------------------------------------------


def model_card(
    config: Mapping[str, Any],
    *,
    repo_id: str,
    target_name: str,
    source_layout: str,
    files: Sequence[str],
    kept_targets: Sequence[int] | None = None,
) -> str:
    """README.md for the converted folder: what it is, how its aux ids are written, how to serve it."""
    from ..model.aux_layers import aux_layer_ids_from_config
    from ..model.configuration_eagle31_mla import describe_rope
    from ..serving.command import serve_command

    ids, _ = aux_layer_ids_from_config(config)
    target = replace(KIMI_K3_TARGET, name=target_name)
    eagle31 = bool(config.get("fc_norm")) and bool(config.get("norm_output"))
    vocab = config["vocab_size"]
    draft_vocab = config.get("draft_vocab_size") or vocab
    lines = [
        "---",
        "library_name: transformers",
        "pipeline_tag: text-generation",
        "tags:",
        "- speculative-decoding",
        "- eagle3",
        "- mla",
        "---",
        "",
        f"# {repo_id}",
        "",
        f"A one-layer {'EAGLE-3.1' if eagle31 else 'EAGLE-3'} draft model with Multi-head Latent Attention (MLA) for "
        f"speculative decoding of `{target_name}`: hidden {config['hidden_size']}, "
        f"{config['num_attention_heads']} heads, "
        f"q_lora {config['q_lora_rank']}, kv_lora {config['kv_lora_rank']} + rope {config['qk_rope_head_dim']}, "
        f"MLP {config['intermediate_size']}, RoPE ({describe_rope(config)}). Its KV cache holds "
        f"{config['kv_lora_rank'] + config['qk_rope_head_dim']} values per token.",
        "",
    ]
    if eagle31:
        lines += [
            "EAGLE-3.1: `fc_norm` (an RMSNorm per captured target state before `fc`) and `norm_output` (the next "
            "draft step is fed the post-norm state).",
            "",
        ]
    if draft_vocab != vocab:
        lines += [
            f"Pruned vocabulary: {draft_vocab} of the target's {vocab} tokens"
            + (
                " (the most frequent in a token-count file, plus the special tokens)"
                if kept_targets is not None
                else ""
            )
            + "; `d2t` maps a draft id to its target id (`target = draft + d2t[draft]`), `t2d` marks the kept "
            "target ids.",
            "",
        ]
    lines += [
        "## Aux layers",
        "",
        f"The drafter reads the target's residual stream after zero-based layers {', '.join(map(str, ids.zero_based))} "
        f"(Transformers' `hidden_states[{', '.join(map(str, ids.one_based))}]`). `config.json` names them one-based, "
        f"`{list(ids.one_based)}`, both at the top level and inside `eagle_config`, and says so "
        "(`aux_layer_ids_convention: one_based`):",
        "",
        "- vLLM reads the top-level key (both model runners, every release);",
        "- TokenSpeed and SGLang read `eagle_config`. SGLang's DeepSeek/Kimi-K2.x targets add 1 only when the first id "
        "is 1 and its Kimi-K3 reader takes one-based ids unchanged, so a one-based list whose first id is not 1 is "
        "captured right by both; TokenSpeed's Kimi-K3 target reads one-based ids too.",
        "",
    ]
    if min(ids.one_based) == 1:
        lines += [
            "**Warning:** these ids start at 1 (the embedding layer's output is not captured, layer 0's output "
            "is). SGLang's DeepSeek rule cannot express that list in any form; serve with vLLM or TokenSpeed. "
            "`eagle31-mla doctor` reports it.",
            "",
        ]
    lines += [
        "Check a deployment before serving (reads only the two `config.json` files):",
        "",
        "```bash",
        f"eagle31-mla doctor --draft {repo_id} --target {target_name} --engine vllm",
        "```",
        "",
        "## Serving",
        "",
        "Install this project's plugin in the engine's environment (`pip install \"eagle31-mla[vllm]\"` or "
        '`"eagle31-mla[sglang]"`): it makes every engine release capture exactly these layers, applies '
        "EAGLE-3.1 where the engine does not, and adds Kimi-K3 capture to SGLang 0.5.23.",
        "",
    ]
    for engine in ENGINES:
        command = serve_command(engine, target_name, repo_id, target, config)
        lines += [f"### {ENGINE_NAMES[engine]}", "", "```bash", command.text(), "```", ""]
    lines += [
        "## Transformers",
        "",
        "```python",
        "from transformers import AutoModelForCausalLM",
        "",
        f'drafter = AutoModelForCausalLM.from_pretrained("{repo_id}", trust_remote_code=True)',
        "step = drafter(input_ids, aux_hidden_states=aux)  # aux: the captured target states, concatenated",
        "```",
        "",
        "## Files",
        "",
        *[f"- `{name}`" for name in files],
        "",
        f"Converted by `eagle31-mla convert` from a checkpoint with {source_layout}.",
        "",
    ]
    return "\n".join(lines)
