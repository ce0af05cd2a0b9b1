"""``eagle31-mla inspect``: a drafter folder or Hub repo in plain words.

The config as the library reads it (dims, EAGLE-3 or 3.1, rope, aux layers in both conventions,
vocabulary pruning), the parameter count and KV bytes per token, whether the tensors match the config
and the published roster (headers only: no tensor is read), and which engine releases serve it, as
:mod:`eagle31_mla.serving.doctor` finds against a Kimi-K3-architecture target of the drafter's own sizes.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

from ..prompts import eos_token_ids
from ..serving.engine_facts import ENGINE_NAMES, ENGINES
from ..serving.engines import KIMI_K3_TARGET, read_config_json, tokenspeed_flag_form

__all__ = ["inspect_drafter", "format_inspection", "serving_matrix"]


def _local_config_file(path_or_id: str) -> Path | None:
    path = Path(path_or_id)
    file = path / "config.json" if path.is_dir() else path
    return file if file.exists() or file.is_symlink() else None


def _read_config(path_or_id: str) -> tuple[dict, str]:
    """The config dict and its file. :class:`ConfigError` for a config.json that is JSON but cannot be a
    config (null, not an object, nested too deeply, a dangling link): the drafter is refused. Unreadable
    input (no such folder, not JSON) stays an :class:`InputError`."""
    from ..model.configuration_eagle31_mla import (
        MAX_CONFIG_DEPTH,
        ConfigError,
        DuplicateKeyError,
        check_config_dict,
        loads_json,
        not_a_regular_file,
        read_config_file,
    )
    from ..serving.engines import InputError

    local = _local_config_file(path_or_id)
    if local is not None:  # before any reader opens it: a FIFO would block, /dev/zero never end
        kind = not_a_regular_file(local)
        if kind:
            raise ConfigError(f"{local} is {kind}; expected a regular file (the drafter's config.json)")
        try:
            loads_json(local.read_text(encoding="utf-8"))
        except DuplicateKeyError as err:  # a JSON reader would keep the last value silently
            raise ConfigError(f"{local} {err.describe()}") from None
        except (OSError, ValueError, RecursionError):
            pass  # reported below, as before
    try:
        raw, file = read_config_json(path_or_id)
    except InputError:
        local = _local_config_file(path_or_id)
        if local is not None and (local.is_symlink() and not local.exists() or _is_json(local)):
            read_config_file(local)  # raises the ConfigError that names what is wrong
        raise
    except RecursionError:  # Python's JSON reader, from about 1,000 levels
        raise ConfigError(
            f"{path_or_id}: config.json nests objects/lists too deeply to read; expected at most "
            f"{MAX_CONFIG_DEPTH} levels (a config nests 2)"
        ) from None
    return check_config_dict(raw, file), file


def _is_json(file: Path) -> bool:
    import json

    try:
        json.loads(file.read_text(encoding="utf-8"))
    except RecursionError:
        return True
    except (OSError, ValueError):
        return False
    return True


def _locate(path_or_id: str) -> tuple[dict, Path | None, str]:
    """config dict, the folder that may hold the safetensors (None if there is none), where it came from."""
    config, file = _read_config(path_or_id)
    folder = Path(file).parent
    has_weights = any(
        (folder / name).is_file() or (folder / name).is_symlink()  # a dangling link is reported
        for name in ("model.safetensors", "model.safetensors.index.json")
    )
    return config, folder if has_weights else None, file


def inspect_drafter(path_or_id: str) -> dict[str, Any]:
    """Everything ``inspect`` reports, as a JSON-ready dict (``errors`` lists what the library refuses)."""
    from ..model.aux_layers import AuxLayerIdError, aux_layer_ids_from_config
    from ..model.configuration_eagle31_mla import ConfigError, Eagle31MLAConfig

    try:
        raw, folder, source = _locate(path_or_id)
    except ConfigError as err:  # config.json is JSON but no config: refused, one line
        local = _local_config_file(path_or_id)
        return {
            "name": str(path_or_id),
            "config_file": str(local) if local else str(path_or_id),
            "errors": [f"config.json: {err}"],
            "tensors": {"checked": False, "why": "the config is refused"},
        }
    info: dict[str, Any] = {"name": str(path_or_id), "config_file": source, "errors": []}
    try:
        ids, how = aux_layer_ids_from_config(raw)
        info["aux_layer_ids"] = {"one_based": list(ids.one_based), "zero_based": list(ids.zero_based), "how": how}
    except AuxLayerIdError as err:
        ids = None
        info["aux_layer_ids"] = None
        info["errors"].append(f"aux layers: {err}")
    try:
        config = Eagle31MLAConfig.from_dict(dict(raw))
    except (ConfigError, ValueError, TypeError, KeyError, RecursionError) as err:
        if not any(str(err) in e for e in info["errors"]):
            info["errors"].append(f"config.json: {err}")
        info["tensors"] = {"checked": False, "why": "the config is refused"}
        return info

    import torch

    from ..model.checkpoint_eagle31_mla import (
        CheckpointError,
        checkpoint_files,
        layout_of,
        read_headers,
        validate_checkpoint,
    )
    from ..model.modeling_eagle31_mla import Eagle31MLAForCausalLM
    from .roster import PUBLISHED_NUM_PARAMETERS, roster_differences

    dtype = config.dtype if isinstance(config.dtype, torch.dtype) else torch.bfloat16
    bytes_per_value = torch.finfo(dtype).bits // 8
    model = Eagle31MLAForCausalLM.on_meta_device(config)
    num_parameters = sum(p.numel() for p in model.parameters())
    rope = dict(config.rope_parameters)
    info.update(
        {
            "architectures": raw.get("architectures"),
            "model_type": raw.get("model_type"),
            "eagle": "3.1" if config.is_eagle31 else "3",
            "fc_norm": config.fc_norm,
            "norm_output": config.norm_output,
            "dims": {
                key: getattr(config, key)
                for key in (
                    "hidden_size",
                    "target_hidden_size",
                    "intermediate_size",
                    "num_attention_heads",
                    "q_lora_rank",
                    "kv_lora_rank",
                    "qk_nope_head_dim",
                    "qk_rope_head_dim",
                    "v_head_dim",
                    "rms_norm_eps",
                    "max_position_embeddings",
                )
            },
            "rope": rope,
            "vocabulary": {
                "vocab_size": config.vocab_size,
                "draft_vocab_size": config.draft_vocab_size,
                "pruned": config.draft_vocab_size != config.vocab_size,
            },
            "special_tokens": {"bos": config.bos_token_id, "eos": config.eos_token_id, "pad": config.pad_token_id},
            "dtype": str(dtype).removeprefix("torch."),
            "parameters": num_parameters,
            "kv_cache": {
                "values_per_token": config.kv_cache_values_per_token,
                "bytes_per_token": config.kv_cache_values_per_token * bytes_per_value,
                "mha_bytes_per_token": config.num_attention_heads
                * (config.qk_nope_head_dim + config.v_head_dim)
                * bytes_per_value,
            },
        }
    )

    tensors: dict[str, Any] = {"checked": folder is not None}
    if folder is None:
        tensors["why"] = (
            "no safetensors next to config.json (a Hub id reads only config.json unless its weights are cached)"
        )
    else:
        try:
            files = checkpoint_files(folder)
            entries = read_headers(files)
            shapes = {name: shape for name, (_, _, shape, _) in entries.items()}
            st_dtypes = sorted({st for (_, _, _, st) in entries.values()})
            tensors.update(
                files=[f.name for f in files],
                count=len(entries),
                dtypes=st_dtypes,
                layout=sorted({layout_of(original) for (_, original, _, _) in entries.values()}),
            )
            try:
                validate_checkpoint(folder, model)
                tensors["matches_config"], tensors["problems"] = True, []
            except CheckpointError as err:
                tensors["matches_config"] = False
                tensors["problems"] = [line.strip()[2:] for line in str(err).splitlines()[1:]]
                info["errors"].append(f"tensors: {len(tensors['problems'])} problem(s) against config.json")
            differences = roster_differences(shapes, dtypes=st_dtypes)
            tensors["matches_published_roster"] = not differences
            tensors["roster_differences"] = differences
        except CheckpointError as err:
            tensors.update(checked=False, why=str(err))
            info["errors"].append(f"tensors: {err}")
    tensors["published_parameters"] = PUBLISHED_NUM_PARAMETERS
    info["tensors"] = tensors
    if ids is not None:
        info["serving"] = serving_matrix(raw, config, ids)
    return info


def serving_matrix(raw: dict, config, ids) -> list[dict[str, Any]]:
    """Per engine and release: served as is, with this project's plugin (on TokenSpeed, or its flag), or not,
    against a Kimi-K3-architecture target sized like the drafter (no environment variables set)."""
    from ..serving.doctor import diagnose, engine_releases

    target = replace(
        KIMI_K3_TARGET,
        name="a Kimi-K3 target",
        num_layers=max(KIMI_K3_TARGET.num_layers, max(ids.one_based)),
        hidden_size=config.target_hidden_size,
        vocab_size=config.vocab_size,
        bos_token_id=config.bos_token_id,
        eos_token_ids=eos_token_ids(config.eos_token_id),
    )
    rows: list[dict[str, Any]] = []
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
            if (
                rows
                and rows[-1]["engine"] == engine
                and (rows[-1]["status"], rows[-1]["because"]) == (status, blocking)
            ):
                rows[-1]["versions"].append(label)
            else:
                rows.append({"engine": engine, "versions": [label], "status": status, "because": blocking})
    return rows


def _versions(labels: list[str]) -> str:
    return labels[0] if len(labels) == 1 else f"{labels[0]}-{labels[-1]}"


def format_inspection(info: dict[str, Any]) -> str:
    from ..model.configuration_eagle31_mla import describe_rope

    lines = [f"{info['name']}  ({info['config_file']})"]
    ids = info.get("aux_layer_ids")
    if "dims" not in info:
        lines += [f"  refused: {e}" for e in info["errors"]]
        return "\n".join(lines)
    d, rope, vocab, kv = info["dims"], info["rope"], info["vocabulary"], info["kv_cache"]
    kind = (
        "EAGLE-3.1 (fc_norm + norm_output)"
        if info["eagle"] == "3.1"
        else ("EAGLE-3" + (" + fc_norm" if info["fc_norm"] else "") + (" + norm_output" if info["norm_output"] else ""))
    )
    lines.append(
        f"  drafter: {kind}, one MLA layer; architectures {info['architectures']}, model_type {info['model_type']}"
    )
    lines.append(
        f"  dims: hidden {d['hidden_size']} (target {d['target_hidden_size']}), {d['num_attention_heads']} heads, "
        f"q_lora {d['q_lora_rank']}, kv_lora {d['kv_lora_rank']} + rope {d['qk_rope_head_dim']}, "
        f"nope {d['qk_nope_head_dim']}, v {d['v_head_dim']}, MLP {d['intermediate_size']}, eps {d['rms_norm_eps']:g}"
    )
    lines.append(f"  rope: {describe_rope({'rope_parameters': rope})} (max {d['max_position_embeddings']} positions)")
    lines.append(f"  aux layers: one-based {ids['one_based']} = zero-based {ids['zero_based']}  ({ids['how']})")
    if vocab["pruned"]:
        lines.append(
            f"  vocabulary: draft {vocab['draft_vocab_size']} of the target's {vocab['vocab_size']} "
            "(pruned: d2t maps draft ids to target ids)"
        )
    else:
        lines.append(f"  vocabulary: {vocab['vocab_size']} (full, not pruned)")
    special = info["special_tokens"]
    lines.append(f"  special tokens: bos {special['bos']}, eos {special['eos']}, pad {special['pad']}")
    lines.append(f"  parameters: {info['parameters']:,} ({info['dtype']})")
    lines.append(
        f"  KV cache: {kv['values_per_token']} values = {kv['bytes_per_token']:,} bytes per token ({info['dtype']}); "
        f"an MHA drafter with these heads would need {kv['mha_bytes_per_token']:,}"
    )
    t = info["tensors"]
    if not t["checked"]:
        lines.append(f"  tensors: not checked ({t['why']})")
    else:
        match = (
            "match the config" if t["matches_config"] else f"DO NOT match the config ({len(t['problems'])} problem(s))"
        )
        files = t["files"][0] if len(t["files"]) == 1 else f"{len(t['files'])} shards"
        lines.append(
            f"  tensors: {t['count']} in {files} ({', '.join(t['layout'])} names; {', '.join(t['dtypes'])}), {match}"
        )
        lines += [f"    - {p}" for p in t["problems"]]
        if t["matches_published_roster"]:
            lines.append("  published roster (lightseekorg/kimi-k3-eagle3.1-mla): matches exactly")
        else:
            diff = t["roster_differences"]
            lines.append(
                f"  published roster (lightseekorg/kimi-k3-eagle3.1-mla): differs ({len(diff)}): "
                + "; ".join(diff[:4])
                + (" ..." if len(diff) > 4 else "")
            )
    if info.get("serving"):
        lines.append("  serving (against a Kimi-K3-architecture target; `eagle31-mla doctor` checks yours):")
        for row in info["serving"]:
            why = f"  ({', '.join(row['because'])})" if row["because"] else ""
            lines.append(
                f"    {ENGINE_NAMES[row['engine']] + ' ' + _versions(row['versions']):<18} {row['status']}{why}"
            )
    for error in info["errors"]:
        lines.append(f"  refused: {error}")
    return "\n".join(lines)
