"""Where things are: a model named by a local folder or a Hub repo id (the one rule every command reads it by), its
weight files; and the one atomic writer of the files this library writes."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path


def looks_like_a_local_path(name_or_path: str | os.PathLike) -> bool:
    """A path object, or a string starting with / . ~ or holding more than one "/" (Hub ids are "org/name")."""
    name = os.fspath(name_or_path)
    return not isinstance(name_or_path, str) or name.startswith(("/", ".", "~")) or name.count("/") > 1


def is_hub_repo_id(text: str) -> bool:
    """``text`` can name a Hub repo: not a local path, and spelt as huggingface_hub's own check allows."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        return not looks_like_a_local_path(text) and validate_repo_id(text) is None
    except HFValidationError:
        return False


def model_folder(name_or_path: str | os.PathLike) -> Path:
    """A local folder as it is, else the Hub snapshot huggingface_hub downloads (its cache, offline mode)."""
    path = Path(name_or_path)
    if path.is_dir() or looks_like_a_local_path(name_or_path):
        if not path.is_dir():
            raise FileNotFoundError(f"{os.fspath(name_or_path)}: no such folder")
        return path
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(str(name_or_path), allow_patterns=["*.json", "*.safetensors", "*.py", "*.md"]))


def safetensors_files(folder) -> list[Path]:
    """A model folder's weight files: the shards its index names (each inside the folder), or model.safetensors."""
    folder = Path(folder)
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        outside = [name for name in names if folder.resolve() not in (folder / name).resolve().parents]
        if outside:
            raise ValueError(f"{index} names shards outside its folder: {outside}; expected file names inside it")
        return [folder / name for name in names]
    if (folder / "model.safetensors").is_file():
        return [folder / "model.safetensors"]
    raise FileNotFoundError(f"{folder} holds neither model.safetensors nor model.safetensors.index.json")


def atomic_write(path, write) -> None:
    """``write(temporary_path)``, then rename over ``path``: readers see the old file or the whole new one."""
    path = Path(path).expanduser()
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.absolute().parent)
    os.close(fd)
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
