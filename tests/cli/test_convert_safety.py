"""`eagle31-mla convert` never loses or half-writes data: everything is checked first, the new folder is
built beside DST and swapped in whole, `--force` replaces only what an earlier convert wrote (its manifest),
and a convert killed at any moment (SIGKILL or SIGINT of a real process, mid-write) leaves DST as it was
or complete and new. Float16 overflow is refused with its count."""

from __future__ import annotations

import hashlib
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import eagle31_mla.hub.convert as module
from eagle31_mla import Eagle31MLAForCausalLM
from eagle31_mla.hub.convert import MANIFEST, MARKER, ConvertError, convert
from eagle31_mla.serving.engines import InputError
from tests.support.tiny import published_style_config, tiny_drafter, write_checkpoint

IDS = [2, 5, 9]


def snapshot(folder: Path) -> dict[str, str]:
    """relative path -> sha256 of every file under ``folder`` (what "unchanged" means here)."""
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
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


USER_FILES = {"notes.txt", "adapter.safetensors", "model-extra.safetensors", ".git/objects/ab"}


def test_the_manifest_lists_exactly_what_convert_wrote(tmp_path):
    dst = convert(source(tmp_path), tmp_path / "hub", max_shard_size="40KB", progress=False).folder
    manifest = json.loads((dst / MANIFEST).read_text())
    assert manifest["written_by"] == "eagle31-mla convert"
    assert set(manifest["files"]) | {MANIFEST} == {p.name for p in dst.iterdir()}
    assert leftovers(dst) == []


def test_force_replaces_only_what_an_earlier_convert_wrote(tmp_path, old):
    before = snapshot(old)
    user = {name: before[name] for name in USER_FILES}
    result = convert(source(tmp_path), old, force=True, max_shard_size="40KB", progress=False)
    after = snapshot(old)
    assert {name: after[name] for name in USER_FILES} == user  # the user's files: all there, unchanged
    assert "model.safetensors" not in after and "model-00001-of-" in " ".join(after)  # the old shard was ours
    assert set(after) == USER_FILES | set(result.files) | {MANIFEST}
    assert leftovers(old) == []
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


def test_a_non_empty_destination_needs_force(tmp_path, old):
    before = snapshot(old)
    with pytest.raises(InputError, match="--force"):
        convert(source(tmp_path), old, progress=False)
    assert snapshot(old) == before


@pytest.mark.parametrize(
    "bad",
    [
        dict(repo_id=""),
        dict(target_name=" "),
        dict(repo_id="a\nb"),
        dict(max_shard_size="0"),
        dict(prune_vocab=10),
        dict(dtype="int8"),
        dict(prune_vocab=2, token_counts="COUNTS"),
    ],
)
def test_every_input_is_checked_before_anything_is_written(tmp_path, old, bad):
    (tmp_path / "counts.txt").write_text("5 1\n")
    bad = {k: str(tmp_path / "counts.txt") if v == "COUNTS" else v for k, v in bad.items()}
    before = snapshot(old)
    with pytest.raises(InputError):
        convert(source(tmp_path), old, force=True, progress=False, **bad)
    assert snapshot(old) == before and leftovers(old) == []


def test_a_refused_source_leaves_the_old_destination(tmp_path, old):
    model = tiny_drafter(seed=3, eagle_aux_hidden_state_layer_ids=IDS)
    state = dict(model.state_dict())
    del state["norm.weight"]
    bad = write_checkpoint(tmp_path / "bad", published_style_config(model), state)
    before = snapshot(old)
    with pytest.raises(ConvertError):
        convert(bad, old, force=True, progress=False)
    assert snapshot(old) == before and leftovers(old) == []


@pytest.mark.parametrize("at", ["weights", "commit"])
def test_an_interruption_leaves_the_old_destination_and_no_temporary_folder(tmp_path, old, monkeypatch, at):
    """Ctrl-C (KeyboardInterrupt) while writing the weights, or an error just before the swap."""
    before = snapshot(old)
    if at == "weights":
        original = module._write_safetensors

        def interrupted(path, *args):
            original(path, *args)
            raise KeyboardInterrupt

        monkeypatch.setattr(module, "_write_safetensors", interrupted)
        with pytest.raises(KeyboardInterrupt):
            convert(source(tmp_path), old, force=True, max_shard_size="40KB", progress=False)
    else:
        monkeypatch.setattr(module, "_commit", lambda tmp, dst: (_ for _ in ()).throw(OSError("disk gone")))
        with pytest.raises(OSError):
            convert(source(tmp_path), old, force=True, progress=False)
    assert snapshot(old) == before and leftovers(old) == []


def test_the_swap_without_renameat2_also_keeps_everything(tmp_path, old, monkeypatch):
    monkeypatch.setattr(module, "_exchange", lambda a, b: False)
    user = {name: snapshot(old)[name] for name in USER_FILES}
    convert(source(tmp_path), old, force=True, progress=False)
    assert {name: snapshot(old)[name] for name in USER_FILES} == user and leftovers(old) == []


def test_leftovers_of_a_killed_convert_are_cleaned_and_only_they(tmp_path, old):
    dead = 2**22 + 12345  # above pid_max's default: no such process
    mine = old.parent / f".{old.name}.eagle31-convert-new-{dead}-0000"
    mine.mkdir()
    (mine / MARKER).write_text(
        json.dumps(
            {
                "written_by": "eagle31-mla convert",
                "pid": dead,
                "host": os.uname().nodename,
                "files": ["model.safetensors", "README.md"],
            }
        )
    )
    (mine / "model.safetensors").write_bytes(b"half a shard")
    (mine / "stranger.txt").write_text("not listed: never deleted")
    running = old.parent / f".{old.name}.eagle31-convert-new-{os.getppid()}-0001"  # a live writer
    running.mkdir()
    (running / MARKER).write_text(
        json.dumps(
            {
                "written_by": "eagle31-mla convert",
                "pid": os.getppid(),
                "host": os.uname().nodename,
                "files": ["model.safetensors"],
            }
        )
    )
    (running / "model.safetensors").write_bytes(b"being written")
    result = convert(source(tmp_path), old, force=True, progress=False)
    assert sorted(p.name for p in mine.iterdir()) == ["stranger.txt"]  # listed files gone, the stranger kept
    assert (running / "model.safetensors").read_bytes() == b"being written"  # another convert's: untouched
    assert any("interrupted conversion" in note for note in result.notes)


def test_a_convert_killed_before_its_marker_was_written_is_cleaned_and_only_it(tmp_path, old):
    """Killed between creating its folder and renaming its marker into place (the marker is written whole,
    by rename): the folder is empty or holds only the marker's temporary file. The next convert removes
    such a folder when the pid in its name is gone; a live pid's, or one holding anything else, stays."""
    dead = 2**22 + 12345  # above pid_max's default: no such process
    name = f".{old.name}.eagle31-convert-new-{{}}-{{}}"
    empty = old.parent / name.format(dead, "0a1b2c3d")
    half_marker = old.parent / name.format(dead, "4e5f6a7b")
    with_a_file = old.parent / name.format(dead, "8c9d0e1f")
    alive = old.parent / name.format(os.getppid(), "2a3b4c5d")  # a live writer about to write its marker
    for folder in (empty, half_marker, with_a_file, alive):
        folder.mkdir()
    (half_marker / f"{MARKER}.tmp").write_text('{"written_by": "eagle31-mla con')
    (with_a_file / "notes.txt").write_text("not convert's: never deleted")
    result = convert(source(tmp_path), old, force=True, progress=False)
    assert not empty.exists() and not half_marker.exists()
    assert (with_a_file / "notes.txt").read_text() == "not convert's: never deleted" and alive.is_dir()
    assert sum("interrupted as it started" in note for note in result.notes) == 2


def test_an_interrupted_non_atomic_swap_is_restored(tmp_path, old):
    """Without renameat2 the swap is two renames; killed between them, the next convert puts DST back."""
    import socket

    before = snapshot(old)
    parked = old.parent / f".{old.name}.eagle31-convert-old-99999999-0000"
    record = old.parent / f".{old.name}.eagle31-convert-swap-99999999-0000.json"
    record.write_text(
        json.dumps(
            {
                "written_by": "eagle31-mla convert",
                "pid": 99999999,
                "host": socket.gethostname(),
                "dst": old.name,
                "old": parked.name,
                "new": f".{old.name}.eagle31-convert-new-99999999-0000",
            }
        )
    )
    os.rename(old, parked)
    with pytest.raises(InputError, match="--force"):  # restored first, then found non-empty
        convert(source(tmp_path), old, progress=False)
    assert snapshot(old) == before and not parked.exists() and not record.exists()


@pytest.mark.parametrize("record", [None, "not json", {"written_by": "someone else"}, "other-host"])
def test_a_folder_named_like_a_leftover_without_proof_is_never_touched(tmp_path, record):
    """A user's folder named `.out4.eagle31-convert-old-archive` (or -new-...) is not renamed to DST nor
    deleted: only a leftover with convert's own record (pid, host, paired folder) is."""
    import socket

    dst = tmp_path / "out4"
    folders = [tmp_path / ".out4.eagle31-convert-old-archive", tmp_path / ".out4.eagle31-convert-new-archive"]
    for folder in folders:
        folder.mkdir()
        (folder / "notes.txt").write_text("mine")
    if record is not None:
        data = record if isinstance(record, (str, dict)) and record != "other-host" else None
        if record == "other-host":
            data = {
                "written_by": "eagle31-mla convert",
                "pid": 1,
                "host": socket.gethostname() + "-x",
                "dst": "out4",
                "old": folders[0].name,
                "new": "x",
            }
        (tmp_path / ".out4.eagle31-convert-swap-archive.json").write_text(
            data if isinstance(data, str) else json.dumps(data)
        )
    convert(source(tmp_path), dst, progress=False)
    for folder in folders:
        assert (folder / "notes.txt").read_text() == "mine"
    assert not (dst / "notes.txt").exists()


@pytest.mark.parametrize("spelling", ["{src}/..", "{src}/../.", "{src}"])
def test_dst_containing_or_being_the_source_is_refused(tmp_path, spelling):
    src = source(tmp_path, "work")
    before = sorted(str(p) for p in tmp_path.rglob("*"))
    with pytest.raises(InputError, match="DST"):
        convert(src, spelling.format(src=src), force=True, progress=False)
    assert sorted(str(p) for p in tmp_path.rglob("*")) == before


def test_dst_inside_the_source_is_refused(tmp_path):
    src = source(tmp_path, "work")
    with pytest.raises(InputError, match="is inside the source"):
        convert(src, src / "sub" / ".." / "out", progress=False)
    assert not (src / "out").exists()


def test_dst_a_symlink_loop_is_one_input_error(tmp_path):
    loop = tmp_path / "loop"
    loop.symlink_to(loop)
    with pytest.raises(InputError, match="symlink loop"):
        convert(source(tmp_path), loop, progress=False)


@pytest.mark.parametrize(
    "text, message",
    [
        ('{"5": 3, "5": 4}', "appears twice"),
        ('{"05": 3, "5": 4}', "no leading zero"),
        ("[1.5, 2, 3]", "integer count"),
        ('{"5": 1e400}', "overflows"),
        ('{"5": NaN}', "not a count"),
        ('{"-1": 3}', "non-negative"),
        ('{"5": true}', "count"),
        ('{"\uff15": 3}', "token id"),
    ],
)
def test_token_counts_are_canonical_ids_and_finite_integer_counts(tmp_path, text, message):
    from eagle31_mla.hub.convert import read_token_counts

    path = tmp_path / "counts.json"
    path.write_text(text)
    with pytest.raises(InputError, match=message) as err:
        read_token_counts(path)
    assert str(path) in str(err.value) and len(str(err.value).splitlines()) == 1


@pytest.mark.parametrize("text, message", [("05 3\n5 4\n", "token id"), ("5 1.5\n", "count"), ("5 1e400\n", "count")])
def test_token_count_lines_are_canonical(tmp_path, text, message):
    from eagle31_mla.hub.convert import read_token_counts

    path = tmp_path / "counts.txt"
    path.write_text(text)
    with pytest.raises(InputError, match=message):
        read_token_counts(path)


def test_float16_overflow_is_refused_with_its_count(tmp_path, old):
    model = tiny_drafter(seed=4, eagle_aux_hidden_state_layer_ids=IDS)
    with torch.no_grad():
        model.fc.weight[0, :3] = torch.tensor([1e5, -7e4, 65000.0])  # two beyond float16's 65504
    src = write_checkpoint(tmp_path / "big", published_style_config(model), model.state_dict())
    before = snapshot(old)
    with pytest.raises(InputError, match=r"--dtype float16: 2 value\(s\) in 1 tensor\(s\) .*fc.weight"):
        convert(src, old, force=True, dtype="float16", progress=False)
    assert snapshot(old) == before and leftovers(old) == []
    dst = convert(src, tmp_path / "bf16", dtype="bfloat16", progress=False).folder  # bfloat16 holds them
    assert Eagle31MLAForCausalLM.from_pretrained(dst).fc.weight.dtype == torch.bfloat16
    fine = convert(source(tmp_path, "small"), tmp_path / "f16", dtype="float16", progress=False).folder
    assert Eagle31MLAForCausalLM.from_pretrained(fine).fc.weight.dtype == torch.float16


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("dtype", ["keep", "float16"])
def test_non_finite_weights_are_refused_by_name_and_nothing_is_written(tmp_path, old, value, dtype):
    """The loader refuses NaN / inf weights; convert refuses them too (in its one streaming pass), naming
    the tensor, and DST keeps what it held."""
    model = tiny_drafter(seed=4, eagle_aux_hidden_state_layer_ids=IDS)
    with torch.no_grad():
        model.fc.weight[1, 1] = value
    src = write_checkpoint(tmp_path / "nan", published_style_config(model), model.state_dict())
    before = snapshot(old)
    with pytest.raises(ConvertError, match=r"1 NaN or inf value\(s\) in 1 tensor\(s\).*fc.weight"):
        convert(src, old, force=True, dtype=dtype, progress=False)
    assert snapshot(old) == before and leftovers(old) == []
    with pytest.raises(ConvertError):
        convert(src, tmp_path / "new", dtype=dtype, progress=False)
    assert not (tmp_path / "new").exists()


def test_float16_underflow_is_a_one_line_note_with_its_count(tmp_path):
    model = tiny_drafter(seed=4, eagle_aux_hidden_state_layer_ids=IDS)
    with torch.no_grad():
        model.fc.weight[0, :3] = torch.tensor([1e-9, -1e-10, 1e-4])  # two below float16's smallest subnormal
    src = write_checkpoint(tmp_path / "tiny", published_style_config(model), model.state_dict())
    result = convert(src, tmp_path / "f16", dtype="float16", progress=False)
    (note,) = [n for n in result.notes if "became 0" in n]
    assert "2 nonzero value(s) in 1 tensor(s)" in note and "fc.weight" in note and "\n" not in note
    assert not [n for n in convert(src, tmp_path / "f32", progress=False).notes if "became 0" in n]


def test_a_destination_where_no_folder_can_be_created_fails_before_any_work(tmp_path, monkeypatch):
    """/proc passes os.access as root, yet refuses new folders: refused up front, naming DST."""
    reads = []
    monkeypatch.setattr(module, "_read_bytes", lambda *a: reads.append(a) or (_ for _ in ()).throw(AssertionError))
    with pytest.raises(InputError, match=r"^DST: cannot create /proc/x/out"):
        convert(source(tmp_path), "/proc/x/out", progress=False)
    assert not reads
    from eagle31_mla.cli import main

    assert main(["convert", str(source(tmp_path, "s2")), "/proc/x/out", "--quiet"]) == 2


# ---- a real process, killed mid-write ---------------------------------------------------------------


@pytest.fixture(scope="module")
def big_source(tmp_path_factory):
    """A ~200 MB drafter (vocabulary 400,000): converting it takes about a second, long enough to kill."""
    from tests.support.tiny import tiny_config

    folder = tmp_path_factory.mktemp("big") / "src"
    model = Eagle31MLAForCausalLM(tiny_config(vocab_size=400_000))
    with torch.no_grad():
        for p in model.parameters():
            p.uniform_(-1, 1)
    return write_checkpoint(folder, published_style_config(model), model.state_dict())


def start_convert(src: Path, dst: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "eagle31_mla.cli",
            "convert",
            str(src),
            str(dst),
            "--quiet",
            "--force",
            "--dtype",
            "bfloat16",
            "--max-shard-size",
            "20MB",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def wait_for_temporary_folder(process: subprocess.Popen, dst: Path, timeout: float = 120) -> bool:
    """Wait until ``process`` has created its temporary folder (checks passed, the write begins)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end and process.poll() is None:
        if any(f"-new-{process.pid}-" in name for name in leftovers(dst)):
            return True
        time.sleep(0.002)
    return False


def test_killing_a_real_convert_mid_write_never_loses_the_destination(tmp_path, old, big_source):
    """SIGKILL at several moments after the temporary folder appears (during the write of 200 MB), then
    SIGINT: DST is always either the old folder or the complete new one; the user's files are always there;
    SIGINT exits 130 with one line and removes its temporary folder; the next convert removes what SIGKILL
    left and nothing else."""
    before = snapshot(old)
    user = {name: before[name] for name in USER_FILES}
    reference = tmp_path / "reference" / old.name  # the same folder name: the model card names it
    convert(big_source, reference, dtype="bfloat16", max_shard_size="20MB", progress=False)
    new = {**snapshot(reference), **user}
    rng = random.Random(0)
    killed_mid_write = 0
    for delay in [0.0, *(rng.uniform(0.05, 0.8) for _ in range(3))]:
        process = start_convert(big_source, old)
        appeared = wait_for_temporary_folder(process, old)
        time.sleep(delay)
        alive = process.poll() is None
        process.kill()
        process.wait()
        killed_mid_write += appeared and alive
        state = snapshot(old)
        assert state in (before, new), (
            f"killed {delay:.2f} s after the temporary folder appeared: DST is neither "
            f"old nor new: {sorted(set(state.items()) ^ set(before.items()))}"
        )
        assert {name: state[name] for name in USER_FILES} == user
        for leftover in leftovers(old):  # hidden, beside DST, never DST itself
            assert leftover.startswith(f".{old.name}.eagle31-convert-new-")
        if state == new:  # the swap happened: start again from the old folder
            break
    assert killed_mid_write >= 1, "no kill landed while the conversion was writing"

    process = start_convert(big_source, old)
    assert wait_for_temporary_folder(process, old)
    time.sleep(rng.uniform(0.05, 0.3))
    interrupted = process.poll() is None
    process.send_signal(signal.SIGINT)
    _, err = process.communicate(timeout=120)
    assert process.returncode in (0, 130), err  # 0: the signal came during the swap, which finishes first
    if interrupted and process.returncode == 130:
        assert err.strip().splitlines() == ["eagle31-mla convert: interrupted"], err
        assert snapshot(old) in (before, new)
        assert leftovers(old) == []  # its own, and (cleaned when it started) those the kills left
    assert "Traceback" not in err

    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "eagle31_mla.cli",
            "convert",
            str(big_source),
            str(old),
            "--quiet",
            "--force",
            "--dtype",
            "bfloat16",
            "--max-shard-size",
            "20MB",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    assert snapshot(old) == new and leftovers(old) == []  # what SIGKILL left is gone, the user's files stay
