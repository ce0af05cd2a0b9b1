"""`eagle31-mla convert` never loses or half-writes data: everything is checked first, the new folder is built
beside DST and moved into place at the end, `--force` replaces only what an earlier convert wrote (its manifest),
and a convert stopped at any moment (an error, Ctrl-C, SIGKILL of a real process mid-write) leaves DST as it was or
complete and new (or, killed among `--force`'s renames, without config.json until the next `--force` completes it).
Float16 overflow is refused with its count."""

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
from eagle31_mla.hub.convert import MANIFEST, ConvertError, convert, read_token_counts
from eagle31_mla.serving.engines import InputError
from tests.support.tiny import published_style_config, tiny_drafter, write_checkpoint

IDS = [2, 5, 9]
DEAD = 2**22 + 12345  # above pid_max's default: no such process
USER_FILES = {"notes.txt", "adapter.safetensors", "model-extra.safetensors", ".git/objects/ab"}


def snapshot(folder: Path) -> dict[str, str]:
    """relative path -> sha256 of every file under ``folder`` (what "unchanged" means here)."""
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest() for p in folder.rglob("*") if p.is_file()
    }


def leftovers(dst: Path) -> list[str]:
    return sorted(p.name for p in dst.parent.iterdir() if p.name.startswith(f".{dst.name}.eagle31-convert-"))


def source(tmp_path: Path, name: str = "src", seed: int = 1, **overrides) -> Path:
    model = tiny_drafter(seed=seed, eagle_aux_hidden_state_layer_ids=IDS, **overrides)
    return write_checkpoint(tmp_path / name, published_style_config(model), model.state_dict())


@pytest.fixture
def old(tmp_path):
    """DST holding an earlier conversion, plus the user's own files beside it (never convert's to delete)."""
    dst = convert(source(tmp_path, "old-src", seed=2), tmp_path / "hub", progress=False).folder
    (dst / "notes.txt").write_text("mine")
    (dst / "adapter.safetensors").write_bytes(b"user weights")
    (dst / "model-extra.safetensors").write_bytes(b"looks like a shard, is not ours")
    (dst / ".git" / "objects").mkdir(parents=True)
    (dst / ".git" / "objects" / "ab").write_bytes(b"blob")
    return dst


def test_the_manifest_lists_exactly_what_convert_wrote(tmp_path):
    dst = convert(source(tmp_path), tmp_path / "hub", max_shard_size="40KB", progress=False).folder
    manifest = json.loads((dst / MANIFEST).read_text())
    assert manifest["written_by"] == "eagle31-mla convert"
    assert set(manifest["files"]) | {MANIFEST} == {p.name for p in dst.iterdir()} and leftovers(dst) == []


def test_force_replaces_only_what_an_earlier_convert_wrote(tmp_path, old):
    before = snapshot(old)
    result = convert(source(tmp_path), old, force=True, max_shard_size="40KB", progress=False)
    after = snapshot(old)
    assert {name: after[name] for name in USER_FILES} == {name: before[name] for name in USER_FILES}
    assert "model.safetensors" not in after and "model-00001-of-" in " ".join(after)  # the old file was ours
    assert set(after) == USER_FILES | set(result.files) | {MANIFEST} and leftovers(old) == []
    assert json.loads((old / MANIFEST).read_text())["files"] == result.files
    Eagle31MLAForCausalLM.from_pretrained(old)


def test_force_refuses_to_replace_files_it_did_not_write(tmp_path):
    dst = tmp_path / "hub"
    dst.mkdir()
    (dst / "config.json").write_text('{"mine": true}')  # no manifest: a user's file of convert's name
    (dst / "model.safetensors").write_bytes(b"user data")
    before = snapshot(dst)
    with pytest.raises(InputError, match="config.json, model.safetensors, which convert would write but did not"):
        convert(source(tmp_path), dst, force=True, progress=False)
    assert snapshot(dst) == before and leftovers(dst) == []


def test_a_non_empty_destination_needs_force_and_an_empty_one_is_replaced(tmp_path, old):
    before = snapshot(old)
    with pytest.raises(InputError, match="--force"):
        convert(source(tmp_path), old, progress=False)
    assert snapshot(old) == before
    (tmp_path / "empty").mkdir()
    assert (convert(source(tmp_path), tmp_path / "empty", progress=False).folder / "config.json").is_file()


@pytest.mark.parametrize(
    "bad",
    [dict(repo_id=""), dict(target_name=" "), dict(repo_id="a\nb"), dict(max_shard_size="0"), dict(prune_vocab=10),
     dict(dtype="int8"), dict(prune_vocab=2, token_counts="COUNTS"), dict(dtype="float16", src="BIG")],
)  # fmt: skip
def test_every_input_is_checked_before_anything_is_written(tmp_path, old, bad):
    """Bad arguments, too few tokens for the special ones, float16 overflow (refused with its count)."""
    (tmp_path / "counts.txt").write_text("5 1\n")
    model = tiny_drafter(seed=4, eagle_aux_hidden_state_layer_ids=IDS)
    with torch.no_grad():
        model.fc.weight[0, :3] = torch.tensor([1e5, -7e4, 65000.0])  # two beyond float16's 65504
    big = write_checkpoint(tmp_path / "big", published_style_config(model), model.state_dict())
    bad = {k: {"COUNTS": str(tmp_path / "counts.txt"), "BIG": big}.get(v, v) for k, v in bad.items()}
    before = snapshot(old)
    with pytest.raises(InputError) as err:
        convert(bad.pop("src", source(tmp_path)), old, force=True, progress=False, **bad)
    assert snapshot(old) == before and leftovers(old) == [] and len(str(err.value).splitlines()) == 1
    if bad.get("dtype") == "float16":  # bfloat16 holds them
        assert "--dtype float16: 2 value(s) in 1 tensor(s)" in str(err.value) and "fc.weight" in str(err.value)
        bf16 = convert(big, tmp_path / "bf16", dtype="bfloat16", progress=False).folder
        assert Eagle31MLAForCausalLM.from_pretrained(bf16).fc.weight.isfinite().all()


def test_float16_underflow_is_a_one_line_note_with_its_count(tmp_path):
    model = tiny_drafter(seed=4, eagle_aux_hidden_state_layer_ids=IDS)
    with torch.no_grad():
        model.fc.weight[0, :3] = torch.tensor([1e-9, -1e-10, 1e-4])  # two below float16's smallest subnormal
    src = write_checkpoint(tmp_path / "tiny", published_style_config(model), model.state_dict())
    result = convert(src, tmp_path / "f16", dtype="float16", progress=False)
    (note,) = [n for n in result.notes if "became 0" in n]
    assert "2 nonzero value(s) in 1 tensor(s)" in note and "fc.weight" in note and "\n" not in note
    assert Eagle31MLAForCausalLM.from_pretrained(result.folder).fc.weight.dtype == torch.float16
    assert not [n for n in convert(src, tmp_path / "f32", progress=False).notes if "became 0" in n]


def test_a_refused_source_leaves_the_old_destination(tmp_path, old):
    model = tiny_drafter(seed=3, eagle_aux_hidden_state_layer_ids=IDS)
    state = dict(model.state_dict())
    del state["norm.weight"]
    bad = write_checkpoint(tmp_path / "bad", published_style_config(model), state)
    before = snapshot(old)
    with pytest.raises(ConvertError):
        convert(bad, old, force=True, progress=False)
    assert snapshot(old) == before and leftovers(old) == []


@pytest.mark.parametrize("at", ["save", "card", "commit"])
def test_an_interruption_leaves_the_old_destination_and_no_temporary_folder(tmp_path, old, monkeypatch, at):
    """Ctrl-C (KeyboardInterrupt) once the weights are written, a model card refused, an error before the move."""
    before = snapshot(old)
    if at == "save":
        saved = Eagle31MLAForCausalLM.save_pretrained
        ctrl_c = (_ for _ in ()).throw
        monkeypatch.setattr(
            Eagle31MLAForCausalLM, "save_pretrained", lambda *a, **k: (saved(*a, **k), ctrl_c(KeyboardInterrupt))
        )
    else:
        name = "model_card" if at == "card" else "_commit"
        monkeypatch.setattr(module, name, lambda *a, **k: (_ for _ in ()).throw(KeyError("no")))
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
    """DST as `--force`'s renames leave it when stopped among them: the old or the new files under a manifest that
    lists both, or a mix of old and new files without config.json (nothing loads it; the next --force completes it)."""
    files, old_files, new_files = ({k: v for k, v in s.items() if k != MANIFEST} for s in (state, before, new))
    mixed = all(v in (old_files.get(k), new_files.get(k)) for k, v in files.items())
    return files in (old_files, new_files) or (mixed and "config.json" not in files)


def test_leftovers_of_a_killed_convert_are_cleaned_and_only_they(tmp_path, old):
    prefix = f".{old.name}.eagle31-convert-"
    mine, running = (
        old.parent / f"{prefix}{socket.gethostname()}-{DEAD}-x1",
        old.parent / f"{prefix}{socket.gethostname()}-{os.getppid()}-x2",
    )
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


@pytest.mark.parametrize("spelling", ["{src}/..", "{src}/../.", "{src}", "{src}/sub/../out", "{src}/../loop"])
def test_dst_the_source_around_or_inside_it_or_a_symlink_loop_is_refused(tmp_path, spelling, capsys):
    """The CLI's path rule (cli.common.check_paths, params.OUTPUT_FOLDER): exit 2, one line, nothing written."""
    from eagle31_mla.cli import main

    src = source(tmp_path, "work")
    (tmp_path / "loop").symlink_to(tmp_path / "loop")
    before = sorted(str(p) for p in tmp_path.rglob("*"))
    assert main(["convert", str(src), spelling.format(src=src), "--force", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert sorted(str(p) for p in tmp_path.rglob("*")) == before and len(err.strip().splitlines()) == 1
    assert ("symlink loop" in err) == ("loop" in spelling)
    with pytest.raises(InputError, match="symlink loop"):  # the library's own reading of DST
        convert(src, tmp_path / "loop", progress=False)


@pytest.mark.parametrize(
    "name, text, message",
    [("counts.json", '{"5": 3, "5": 4}', "appears twice"), ("counts.json", '{"05": 3, "5": 4}', "no leading zero"),
     ("counts.json", "[1.5, 2, 3]", "integer count"), ("counts.json", '{"5": 1e400}', "overflows"),
     ("counts.json", '{"5": NaN}', "NaN is not an integer count"), ("counts.json", '{"-1": 3}', "non-negative"),
     ("counts.json", '{"5": true}', "count"), ("counts.json", '{"\uff15": 3}', "token id"),
     ("counts.txt", "05 3\n5 4\n", "token id"), ("counts.txt", "5 1.5\n", "count"),
     ("counts.txt", "5 1e400\n", "count")],
)  # fmt: skip
def test_token_counts_are_canonical_ids_and_finite_integer_counts(tmp_path, name, text, message):
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(InputError, match=message) as err:
        read_token_counts(path)
    assert str(path) in str(err.value) and len(str(err.value).splitlines()) == 1


def test_a_destination_where_no_folder_can_be_created_fails_before_any_work(tmp_path, monkeypatch):
    """/proc passes os.access as root, yet refuses new folders: refused up front, naming DST."""
    monkeypatch.setattr(Eagle31MLAForCausalLM, "from_pretrained", lambda *a, **k: 1 / 0)  # never reached
    with pytest.raises(InputError, match=r"^DST: cannot create /proc/x/out"):
        convert(source(tmp_path), "/proc/x/out", progress=False)
    from eagle31_mla.cli import main

    assert main(["convert", str(source(tmp_path, "s2")), "/proc/x/out", "--quiet"]) == 2


# ---- a real process, killed mid-write ---------------------------------------------------------------


@pytest.fixture(scope="module")
def big_source(tmp_path_factory):
    """A ~200 MB drafter (vocabulary 400,000): converting it takes about a second, long enough to kill."""
    from tests.support.tiny import tiny_config

    model = Eagle31MLAForCausalLM(tiny_config(vocab_size=400_000))
    with torch.no_grad():
        for p in model.parameters():
            p.uniform_(-1, 1)
    return write_checkpoint(tmp_path_factory.mktemp("big") / "src", published_style_config(model), model.state_dict())


def convert_command(src: Path, dst: Path) -> list[str]:
    return [sys.executable, "-m", "eagle31_mla.cli", "convert", str(src), str(dst), "--quiet", "--force",
            "--dtype", "bfloat16", "--max-shard-size", "20MB"]  # fmt: skip


def wait_for_temporary_folder(process: subprocess.Popen, dst: Path, timeout: float = 120) -> bool:
    """Wait until ``process`` has created its temporary folder (source loaded, the write begins)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end and process.poll() is None:
        if any(f"-{process.pid}-" in name for name in leftovers(dst)):
            return True
        time.sleep(0.002)
    return False


def test_killing_a_real_convert_mid_write_never_loses_the_destination(tmp_path, old, big_source):
    """SIGKILL at several moments after the temporary folder appears, then SIGINT: DST is the old folder or the
    complete new one (or, killed among --force's renames, old and new files without config.json); the user's files
    are always there; SIGINT exits 130 with one line and removes its temporary folder; the next convert removes what
    SIGKILL left and nothing else, and completes DST."""
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

    process = subprocess.Popen(
        convert_command(big_source, old), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    assert wait_for_temporary_folder(process, old)
    time.sleep(rng.uniform(0.05, 0.3))
    interrupted = process.poll() is None
    process.send_signal(signal.SIGINT)
    _, err = process.communicate(timeout=120)
    assert process.returncode in (0, 130), err  # 0: the signal came during the move, which finishes first
    if interrupted and process.returncode == 130:
        assert err.strip().splitlines() == ["eagle31-mla convert: interrupted"], err
        assert leftovers(old) == []  # its own, and (cleaned before it wrote) those the kills left
    assert "Traceback" not in err

    result = subprocess.run(convert_command(big_source, old), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert snapshot(old) == new and leftovers(old) == []  # what SIGKILL left is gone, the user's files stay
