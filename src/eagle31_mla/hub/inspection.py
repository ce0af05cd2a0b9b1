"""``eagle31-mla inspect``: a drafter folder or Hub repo in plain words: its config as Transformers reads it, its
tensors against the config and the published roster (safetensors headers only), which engine releases serve it."""

from __future__ import annotations

import re
from dataclasses import replace
from itertools import groupby
from pathlib import Path
from typing import Any

from ..prompts import eos_token_ids
from ..serving.engine_facts import ENGINE_NAMES, ENGINES
from ..serving.engines import KIMI_K3_TARGET, InputError, tokenspeed_flag_form

_DIMS = "hidden_size target_hidden_size intermediate_size num_attention_heads q_lora_rank kv_lora_rank".split()
_DIMS += "qk_nope_head_dim qk_rope_head_dim v_head_dim rms_norm_eps max_position_embeddings".split()
_WEIGHTS = ("model.safetensors", "model.safetensors.index.json")


def _config_file(path_or_id: str) -> Path:
    """A folder's config.json, the file itself, or a Hub repo's (only config.json is fetched) by Transformers."""
    from transformers.utils import cached_file

    path = Path(path_or_id).expanduser()
    if path.exists() or path.is_symlink():
        file = path / "config.json" if path.is_dir() else path
        if not file.is_file():  # never opened: a FIFO would block
            raise InputError(f"{file}: not a file; expected a drafter's config.json")
        return file
    try:
        return Path(cached_file(str(path_or_id), "config.json"))
    except (OSError, ValueError, TypeError) as err:  # unknown repo, offline and not cached, no network
        raise InputError(f"{path_or_id}: cannot read its config.json ({str(err).splitlines()[0]})") from None


def layout_of(name: str) -> str:
    """The layout a tensor name is in, from :data:`KEY_MAPPING`: ``published``, ``model. prefix``, ``midlayer.*``."""
    from ..model.modeling_eagle31_mla import KEY_MAPPING

    for pattern, replacement in KEY_MAPPING.items():
        if re.match(pattern, name):
            prefix = pattern.removeprefix("^").replace("\\", "")
            return f"{prefix}*" if replacement else f"{prefix} prefix"
    return "published"


def _check_tensors(folder: Path, expected: dict[str, tuple[int, ...]]) -> dict[str, Any]:
    """The safetensors headers (no tensor is read), by published name, against the config and the roster."""
    from safetensors import SafetensorError, safe_open

    from ..locations import safetensors_files
    from ..model.modeling_eagle31_mla import canonical_tensor_name
    from .roster import roster_differences

    shapes, dtypes, layouts = {}, set(), set()
    try:  # an index names its shards; a lone model.safetensors is opened as is (a dangling link is named)
        files = safetensors_files(folder) if (folder / _WEIGHTS[1]).exists() else [folder / _WEIGHTS[0]]
        for file in files:
            with safe_open(file, "pt") as f:
                for name in f.keys():
                    piece = f.get_slice(name)
                    shapes[canonical_tensor_name(name)] = tuple(piece.get_shape())
                    dtypes.add(piece.get_dtype())
                    layouts.add(layout_of(name))
    except (OSError, ValueError, TypeError, KeyError, SafetensorError) as err:
        return {"checked": False, "why": f"{type(err).__name__}: {err}"}
    problems = [f"missing tensor {n!r}" for n in expected if n not in shapes and not (n == "t2d" and "d2t" in shapes)]
    problems += [f"unexpected tensor {n!r}" for n in shapes if n not in expected]
    misshaped = [n for n, shape in expected.items() if shapes.get(n, shape) != shape]
    problems += [f"tensor {n!r} has shape {list(shapes[n])}, expected {list(expected[n])}" for n in misshaped]
    diff = roster_differences(shapes, dtypes=dtypes)
    found = dict(checked=True, files=[f.name for f in files], count=len(shapes), dtypes=sorted(dtypes))
    found.update(layout=sorted(layouts), matches_config=not problems, problems=problems)
    return {**found, "matches_published_roster": not diff, "roster_differences": diff}


def inspect_drafter(path_or_id: str) -> dict[str, Any]:
    """Everything ``inspect`` reports, JSON-ready (``errors`` lists what the library refuses)."""
    from huggingface_hub.errors import StrictDataclassError

    from ..model.aux_layers import AuxLayerIdError, aux_layer_ids_from_config
    from ..model.configuration_eagle31_mla import Eagle31MLAConfig
    from .roster import PUBLISHED_NUM_PARAMETERS, meta_roster

    file = _config_file(path_or_id)
    try:
        raw, _ = Eagle31MLAConfig.get_config_dict(str(file))  # Transformers' reader, as from_json_file reads it
    except (OSError, ValueError, TypeError, RecursionError) as err:  # not JSON, null, nested past the reader
        raise InputError(f"{file}: not a readable config.json ({type(err).__name__}: {err})") from None
    info: dict[str, Any] = {"name": str(path_or_id), "config_file": str(file), "errors": []}
    try:
        ids, how = aux_layer_ids_from_config(raw)
        info["aux_layer_ids"] = {"one_based": list(ids.one_based), "zero_based": list(ids.zero_based), "how": how}
    except AuxLayerIdError as err:
        ids, info["aux_layer_ids"] = None, None
        info["errors"].append(f"aux layers: {err}")
    try:
        config = Eagle31MLAConfig.from_dict(raw)
    except (ValueError, TypeError, KeyError, AttributeError, StrictDataclassError) as err:
        reason = str(err.__cause__ or err)  # huggingface_hub's strict check wraps the config's own message
        if not any(reason in e for e in info["errors"]):
            info["errors"].append(f"config.json: {reason}")
        return {**info, "tensors": {"checked": False, "why": "the config is refused"}}

    expected, _, num_parameters = meta_roster(config)
    kv = config.kv_cache_values_per_token
    mha = config.num_attention_heads * (config.qk_nope_head_dim + config.v_head_dim)
    vocab, draft_vocab = config.vocab_size, config.draft_vocab_size
    info.update(architectures=raw.get("architectures"), model_type=raw.get("model_type"))
    info.update(eagle="3.1" if config.is_eagle31 else "3", fc_norm=config.fc_norm, norm_output=config.norm_output)
    info.update(dims={key: getattr(config, key) for key in _DIMS}, rope=dict(config.rope_parameters))
    info["vocabulary"] = {"vocab_size": vocab, "draft_vocab_size": draft_vocab, "pruned": draft_vocab != vocab}
    info["special_tokens"] = {"bos": config.bos_token_id, "eos": config.eos_token_id, "pad": config.pad_token_id}
    info.update(dtype=str(config.dtype).removeprefix("torch."), parameters=num_parameters)
    info["kv_cache"] = {"values_per_token": kv, "bytes_per_token": kv * config.dtype.itemsize}
    info["kv_cache"]["mha_bytes_per_token"] = mha * config.dtype.itemsize
    if any((file.parent / name).is_symlink() or (file.parent / name).exists() for name in _WEIGHTS):
        tensors = _check_tensors(file.parent, expected)
        if not tensors["checked"]:
            info["errors"].append(f"tensors: {tensors['why']}")
        elif not tensors["matches_config"]:
            info["errors"].append(f"tensors: {len(tensors['problems'])} problem(s) against config.json")
    else:
        why = "no safetensors next to config.json (a Hub id reads only config.json unless its weights are cached)"
        tensors = {"checked": False, "why": why}
    info["tensors"] = {**tensors, "published_parameters": PUBLISHED_NUM_PARAMETERS}
    if ids is not None:
        info["serving"] = serving_matrix(raw, config, ids)
    return info


def serving_matrix(raw: dict, config, ids) -> list[dict[str, Any]]:
    """Per engine and release: served as is, with the plugin (or TokenSpeed's flag), or not, by a Kimi-K3 target."""
    from ..serving.doctor import diagnose, engine_releases

    sizes = dict(hidden_size=config.target_hidden_size, vocab_size=config.vocab_size, bos_token_id=config.bos_token_id)
    num_layers, eos = max(KIMI_K3_TARGET.num_layers, max(ids.one_based)), eos_token_ids(config.eos_token_id)
    target = replace(KIMI_K3_TARGET, name="a Kimi-K3 target", num_layers=num_layers, eos_token_ids=eos, **sizes)
    rows = []  # (engine, status, blocking, release): consecutive releases of the same verdict share a row
    for engine in ENGINES:
        for label, _ in engine_releases(engine):
            bare = diagnose(raw, target, engine, label, environ={})
            if bare.ok:
                status, blocking = "as is", []
            else:
                plugin = diagnose(raw, target, engine, label, environ={}, with_plugin=True)
                status = "with the eagle31-mla plugin" if plugin.ok else "no"
                blocking = [f.id for f in (bare.problems if plugin.ok else plugin.problems)]
                flag = tokenspeed_flag_form(target, ids) if engine == "tokenspeed" else None
                if plugin.ok and flag and diagnose(raw, target, engine, label, environ={}, layers_to_capture=flag).ok:
                    status += f" (or --eagle3-layers-to-capture {','.join(map(str, flag))})"
            rows.append((engine, status, blocking, label))
    grouped = groupby(rows, key=lambda row: row[:3])
    return [{"engine": e, "versions": [r[3] for r in group], "status": s, "because": b} for (e, s, b), group in grouped]


def format_inspection(info: dict[str, Any]) -> str:
    from ..model.configuration_eagle31_mla import describe_rope

    lines = [f"{info['name']}  ({info['config_file']})"]
    if "dims" not in info:
        return "\n".join(lines + [f"  refused: {e}" for e in info["errors"]])
    d, vocab, kv, ids, t = info["dims"], info["vocabulary"], info["kv_cache"], info["aux_layer_ids"], info["tensors"]
    kind = "EAGLE-3.1 (fc_norm + norm_output)" if info["eagle"] == "3.1" else "EAGLE-3"
    kind += "".join(f" + {k}" for k in ("fc_norm", "norm_output") if info["eagle"] == "3" and info[k])
    lines += [
        f"  drafter: {kind}, one MLA layer; architectures {info['architectures']}, model_type {info['model_type']}",
        f"  dims: hidden {d['hidden_size']} (target {d['target_hidden_size']}), {d['num_attention_heads']} heads, "
        f"q_lora {d['q_lora_rank']}, kv_lora {d['kv_lora_rank']} + rope {d['qk_rope_head_dim']}, "
        f"nope {d['qk_nope_head_dim']}, v {d['v_head_dim']}, MLP {d['intermediate_size']}, eps {d['rms_norm_eps']:g}",
        f"  rope: {describe_rope({'rope_parameters': info['rope']})} (max {d['max_position_embeddings']} positions)",
        f"  aux layers: one-based {ids['one_based']} = zero-based {ids['zero_based']}  ({ids['how']})",
        f"  vocabulary: draft {vocab['draft_vocab_size']} of the target's {vocab['vocab_size']} (pruned: d2t maps "
        "draft ids to target ids)"
        if vocab["pruned"]
        else f"  vocabulary: {vocab['vocab_size']} (full, not pruned)",
        "  special tokens: bos {bos}, eos {eos}, pad {pad}".format(**info["special_tokens"]),
        f"  parameters: {info['parameters']:,} ({info['dtype']})",
        f"  KV cache: {kv['values_per_token']} values = {kv['bytes_per_token']:,} bytes per token ({info['dtype']}); "
        f"an MHA drafter with these heads would need {kv['mha_bytes_per_token']:,}",
    ]
    if not t["checked"]:
        lines.append(f"  tensors: not checked ({t['why']})")
    else:
        n, layout, dtypes = len(t["problems"]), ", ".join(t["layout"]), ", ".join(t["dtypes"])
        match = f"DO NOT match the config ({n} problem(s))" if n else "match the config"
        files = t["files"][0] if len(t["files"]) == 1 else f"{len(t['files'])} shards"
        lines.append(f"  tensors: {t['count']} in {files} ({layout} names; {dtypes}), {match}")
        lines += [f"    - {p}" for p in t["problems"]]
        diff = t["roster_differences"]
        shown = f"differs ({len(diff)}): " + "; ".join(diff[:4]) + (" ..." if len(diff) > 4 else "")
        lines.append(f"  published roster (lightseekorg/kimi-k3-eagle3.1-mla): {shown if diff else 'matches exactly'}")
    if info.get("serving"):
        lines.append("  serving (against a Kimi-K3-architecture target; `eagle31-mla doctor` checks yours):")
        for row in info["serving"]:
            versions = row["versions"][0] + (f"-{row['versions'][-1]}" if len(row["versions"]) > 1 else "")
            why = f"  ({', '.join(row['because'])})" if row["because"] else ""
            lines.append(f"    {ENGINE_NAMES[row['engine']] + ' ' + versions:<18} {row['status']}{why}")
    return "\n".join(lines + [f"  refused: {error}" for error in info["errors"]])
