"""`eagle31-mla convert` never loses or half-writes data: inputs are checked first, `--force` replaces only what an
earlier convert wrote (its manifest), and a convert stopped at any moment (an error, Ctrl-C, SIGKILL mid-write)
leaves DST as it was or complete and new (or, killed among `--force`'s renames, without config.json until the next
`--force` completes it)."""

from __future__ import annotations

import hashlib
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import eagle31_mla.hub.convert as module
from eagle31_mla import Eagle31MLAForCausalLM
from eagle31_mla.hub.convert import MANIFEST, ConvertError, convert
from eagle31_mla.serving.engines import InputError
from tests.support.tiny import published_style_config, tiny_drafter, write_checkpoint

IDS = [2, 5, 9]
DEAD = 2**22 + 12345  # above pid_max's default: no such process
USER_FILES = {"notes.txt", "adapter.safetensors", "model-extra.safetensors", ".git/objects/ab"}


def snapshot(folder: Path) -> dict[str, str]:
    """relative path -> sha256 of every file under ``folder`` (what "unchanged" means here)."""
    files = [p for p in folder.rglob("*") if p.is_file()]
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest() for p in files}


def leftovers(dst: Path) -> list[str]:
    return sorted(p.name for p in dst.parent.iterdir() if p.name.startswith(f".{dst.name}.eagle31-convert-"))


def source(tmp_path: Path, name: str = "src", seed: int = 1) -> Path:
    model = tiny_drafter(seed=seed, eagle_aux_hidden_state_layer_ids=IDS)
    return write_checkpoint(tmp_path / name, published_style_config(model), model.state_dict())


@pytest.fixture
def old(tmp_path):
    """DST holding an earlier conversion, plus the user's own files beside it (never convert's to delete)."""
    dst = convert(source(tmp_path, "old-src", seed=2), tmp_path / "hub", progress=False).folder
    (dst / ".git" / "objects").mkdir(parents=True)
    for name in USER_FILES:  # model-extra.safetensors: looks like a shard, is not convert's
        (dst / name).write_bytes(f"the user's {name}".encode())
    return dst


def test_force_replaces_only_what_an_earlier_convert_wrote(tmp_path, old):
    before = snapshot(old)
    result = convert(source(tmp_path), old, force=True, max_shard_size="40KB", progress=False)
    after = snapshot(old)
    assert {name: after[name] for name in USER_FILES} == {name: before[name] for name in USER_FILES}
    assert "model.safetensors" not in after and "model-00001-of-" in " ".join(after)  # the old file was ours
    assert set(after) == USER_FILES | set(result.files) | {MANIFEST} and leftovers(old) == []
    assert json.loads((old / MANIFEST).read_text()) == {"files": result.files, "written_by": "eagle31-mla convert"}
    Eagle31MLAForCausalLM.from_pretrained(old)


@pytest.mark.parametrize(
    "bad, error, message",
    [(dict(force=False), InputError, "is not empty; pass --force"), (dict(max_shard_size="0"), InputError, "size"),
     (dict(prune_vocab=10), InputError, "go together"), (dict(dtype="int8"), ValueError, "--dtype"),
     (dict(prune_vocab=2, token_counts="COUNTS"), InputError, "expected 3 \\(the special tokens\\)"),
     (dict(dtype="float16", src="BIG"), InputError, r"--dtype float16: 2 value\(s\) in 1 tensor\(s\).*fc.weight"),
     (dict(src="MISSING"), ConvertError, "missing tensor 'norm.weight'"),
     (dict(src="MISSHAPED"), ConvertError, "fc.weight"), (dict(src="NAN"), ConvertError, "norm.weight"),
     (dict(dst="CLASH"), InputError, "config.json, model.safetensors, which convert would write but did not"),
     (dict(dst="/proc/x/out"), InputError, r"^DST: cannot create /proc/x/out"),
     (dict(dst="LOOP"), InputError, "cannot follow its links \\(a symlink loop\\)")],
)  # fmt: skip
def test_every_input_is_checked_before_anything_is_written(tmp_path, old, bad, error, message):
    """Bad arguments, too few tokens for the special ones, float16 overflow (bfloat16 holds it), a refused source,
    files of convert's names no manifest lists (a user's: never replaced), a DST where no folder can be created
    (/proc passes os.access as root, yet refuses new folders), a DST that is a symlink loop. (DST the source, around
    or inside it: the CLI's path rule, tests/cli/test_cli_corpus.py.)"""
    (tmp_path / "counts.txt").write_text("5 1\n")
    (tmp_path / "clash").mkdir()
    (tmp_path / "clash" / "config.json").write_text('{"mine": true}')
    (tmp_path / "clash" / "model.safetensors").write_bytes(b"user data")
    (tmp_path / "loop").symlink_to(tmp_path / "loop")
    model = tiny_drafter(seed=4, eagle_aux_hidden_state_layer_ids=IDS)
    with torch.no_grad():
        model.fc.weight[0, :3] = torch.tensor([1e5, -7e4, 65000.0])  # two beyond float16's 65504
    state, config = model.state_dict(), published_style_config(model)
    sources = dict(BIG=state, MISSING={k: v for k, v in state.items() if k != "norm.weight"})
    sources["MISSHAPED"] = {**state, "fc.weight": torch.zeros(3, 3)}
    sources["NAN"] = {**state, "norm.weight": state["norm.weight"] * torch.nan}
    paths = {name: write_checkpoint(tmp_path / name, config, tensors) for name, tensors in sources.items()}
    names = {"COUNTS": tmp_path / "counts.txt", "CLASH": tmp_path / "clash", "LOOP": tmp_path / "loop", **paths}
    bad = {k: names.get(v, v) for k, v in bad.items()}
    dst = Path(bad.pop("dst", old))
    before = snapshot(dst) if dst.exists() else None
    with pytest.raises(error, match=message) as err:
        convert(bad.pop("src", source(tmp_path)), dst, **{"force": True, "progress": False, **bad})
    assert (snapshot(dst) if dst.exists() else None) == before and len(str(err.value).splitlines()) == 1
    assert leftovers(old) == leftovers(tmp_path / "clash") == []
    if bad.get("dtype") == "float16":
        bf16 = convert(paths["BIG"], tmp_path / "bf16", dtype="bfloat16", progress=False).folder
        assert Eagle31MLAForCausalLM.from_pretrained(bf16).fc.weight.isfinite().all()
    if bad == {"force": False}:  # an empty folder needs none
        (tmp_path / "empty").mkdir()
        assert (convert(source(tmp_path), tmp_path / "empty", progress=False).folder / "config.json").is_file()


@pytest.mark.parametrize("at", ["save", "commit"])
def test_an_interruption_leaves_the_old_destination_and_no_temporary_folder(tmp_path, old, monkeypatch, at):
    """Ctrl-C (a real SIGINT) once the weights are written, an error before the move."""
    before = snapshot(old)
    if at == "save":  # a real SIGINT, delivered once the weights are written
        saved = Eagle31MLAForCausalLM.save_pretrained
        interrupted = lambda *a, **k: saved(*a, **k) or signal.raise_signal(signal.SIGINT)  # noqa: E731
        monkeypatch.setattr(Eagle31MLAForCausalLM, "save_pretrained", interrupted)
    else:
        monkeypatch.setattr(module, "_commit", lambda *a, **k: (_ for _ in ()).throw(KeyError("no")))
    with pytest.raises((KeyboardInterrupt, ConvertError, KeyError)):
        convert(source(tmp_path), old, force=True, max_shard_size="40KB", progress=False)
    assert snapshot(old) == before and leftovers(old) == []


def test_force_stopped_among_its_renames_is_completed_by_the_next_force(tmp_path, old, monkeypatch):
    """Stopped after a few renames into DST: DST has no config.json (nothing loads it), every file is the old or
    the new one, the user's are intact; the next `--force` finishes the folder."""
    reference = convert(source(tmp_path), tmp_path / "reference" / old.name, max_shard_size="40KB", progress=False)
    before, new = snapshot(old), snapshot(reference.folder)
    calls, replace = [], os.replace
    monkeypatch.setattr(os, "replace", lambda *a: replace(*a) if len(calls.append(a) or calls) < 4 else 1 / 0)
    with pytest.raises(ZeroDivisionError):
        convert(source(tmp_path), old, force=True, max_shard_size="40KB", progress=False)
    monkeypatch.setattr(os, "replace", replace)
    state = snapshot(old)
    assert "config.json" not in state and renamed_in_part(state, before, new)
    assert USER_FILES <= set(state) and leftovers(old) == []
    convert(source(tmp_path), old, force=True, max_shard_size="40KB", progress=False)
    assert snapshot(old) == {**new, **{name: before[name] for name in USER_FILES}}


def renamed_in_part(state: dict[str, str], before: dict[str, str], new: dict[str, str]) -> bool:
    """DST as `--force`'s renames leave it when stopped among them: the old or the new files, or a mix without
    config.json (nothing loads it; the next --force completes it)."""
    files, old_files, new_files = ({k: v for k, v in s.items() if k != MANIFEST} for s in (state, before, new))
    mixed = all(v in (old_files.get(k), new_files.get(k)) for k, v in files.items())
    return files in (old_files, new_files) or (mixed and "config.json" not in files)


def test_leftovers_of_a_killed_convert_are_cleaned_and_only_they(tmp_path, old):
    prefix = f".{old.name}.eagle31-convert-"
    mine = old.parent / f"{prefix}{socket.gethostname()}-{DEAD}-x1"
    running = old.parent / f"{prefix}{socket.gethostname()}-{os.getppid()}-x2"
    others = [old.parent / f"{prefix}{name}" for name in ("old-archive", f"other-host-{DEAD}-x3")]
    for folder in (mine, running, *others):
        folder.mkdir()
        (folder / "model.safetensors").write_bytes(b"half a shard")
    (mine / "stranger.txt").write_text("not convert's: never deleted")
    result = convert(source(tmp_path), old, force=True, progress=False)
    assert sorted(p.name for p in mine.iterdir()) == ["stranger.txt"]  # convert's files gone, the stranger kept
    for folder in (running, *others):  # a live writer's, another host's, a user's folder of a similar name
        assert (folder / "model.safetensors").read_bytes() == b"half a shard"
    assert any("interrupted conversion" in note for note in result.notes)


@pytest.fixture(scope="module")
def big_source(tmp_path_factory):
    """A ~200 MB drafter (vocabulary 400,000): converting it takes about a second, long enough to kill."""
    from tests.support.tiny import tiny_config

    model = Eagle31MLAForCausalLM(tiny_config(vocab_size=400_000))
    with torch.no_grad():
        [p.uniform_(-1, 1) for p in model.parameters()]
    return write_checkpoint(tmp_path_factory.mktemp("big") / "src", published_style_config(model), model.state_dict())


def convert_command(src: Path, dst: Path) -> list[str]:
    return [sys.executable, "-m", "eagle31_mla.cli", "convert", str(src), str(dst), "--quiet", "--force",
            "--dtype", "bfloat16", "--max-shard-size", "20MB"]  # fmt: skip


def wait_for_temporary_folder(process: subprocess.Popen, dst: Path, timeout: float = 120) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end and process.poll() is None:
        if any(f"-{process.pid}-" in name for name in leftovers(dst)):
            return True
        time.sleep(0.002)
    return False


def test_killing_a_real_convert_mid_write_never_loses_the_destination(tmp_path, old, big_source):
    """SIGKILL at several moments after the temporary folder appears, then SIGINT (exit 130, one line, its temporary
    folder removed): DST is always the old or the complete new folder (or renamed in part), the user's files intact;
    the next convert removes what SIGKILL left and nothing else, and completes DST."""
    before = snapshot(old)
    user = {name: before[name] for name in USER_FILES}
    reference = tmp_path / "reference" / old.name  # the same folder name: the model card names it
    convert(big_source, reference, dtype="bfloat16", max_shard_size="20MB", progress=False)
    new = {**snapshot(reference), **user}
    rng = random.Random(0)
    killed_mid_write = 0
    for delay in [0.0, *(rng.uniform(0.05, 0.8) for _ in range(3))]:
        process = subprocess.Popen(convert_command(big_source, old), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        appeared = wait_for_temporary_folder(process, old)
        time.sleep(delay)
        alive = process.poll() is None
        process.kill()
        process.communicate()
        killed_mid_write += appeared and alive
        state = snapshot(old)
        assert state in (before, new) or renamed_in_part(state, before, new), f"killed {delay:.2f} s in: {state}"
        assert {name: state[name] for name in USER_FILES} == user
        if state == new:  # the move happened: start again from the old folder
            break
    assert killed_mid_write >= 1, "no kill landed while the conversion was writing"

    process = subprocess.Popen(convert_command(big_source, old), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=1)
    assert wait_for_temporary_folder(process, old)
    time.sleep(rng.uniform(0.05, 0.3))
    interrupted = process.poll() is None
    process.send_signal(signal.SIGINT)
    _, err = process.communicate(timeout=120)
    # 0: the signal came during the move, which finishes first; -SIGINT: after it, in the interpreter's teardown
    # (Python restores the default handler there), DST complete
    assert process.returncode in (0, 130) or (process.returncode == -signal.SIGINT and snapshot(old) == new), err
    if interrupted and process.returncode == 130:
        assert err.strip().splitlines() == ["eagle31-mla convert: interrupted"], err
        assert leftovers(old) == []  # its own, and (cleaned before it wrote) those the kills left
    assert "Traceback" not in err

    result = subprocess.run(convert_command(big_source, old), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert snapshot(old) == new and leftovers(old) == []  # what SIGKILL left is gone, the user's files stay
