#!/usr/bin/env python3
"""Loading the full-size checkpoint: peak memory and time of `from_pretrained` against a plain
safetensors load of the same file; and the peak memory of `eagle31-mla convert` on it.

    python benchmarks/load_checkpoint.py [--dir /tmp/k3-draft] [--keep]

Writes a synthetic checkpoint in the published layout (20 BF16 tensors, 6,031,253,592 bytes: the
published file's exact size) plus its config.json, then loads it in fresh processes: a plain
`safetensors.torch.load_file`, and `Eagle31MLAForCausalLM.from_pretrained`. Each load is followed by
reading every byte of every tensor, so lazily mapped loads pay for their reads too. Peak RSS is the
process's VmHWM (it counts file pages mapped into the process as well as anonymous memory).
Ratios matter, not seconds: the page cache is warm for all runs after the first (the order is
plain, library, plain, library). Then `convert` (to a Hub-ready folder, in a fresh process): it loads the
model once through Transformers and writes it with `save_pretrained`, so its peak RSS should stay near one copy of
the file (about 1.07x), never two.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from eagle31_mla.hub.roster import PUBLISHED_FILE_BYTES

PROBE = r"""
import json, sys, time, torch
path, how = sys.argv[1], sys.argv[2]
from safetensors.torch import load_file  # imports are not part of the load
from eagle31_mla import Eagle31MLAForCausalLM
from eagle31_mla import Eagle31MLAConfig
t = time.perf_counter()
import hashlib
if how == "plain":
    tensors = load_file(path + "/model.safetensors")
else:
    model = Eagle31MLAForCausalLM.from_pretrained(path)
    tensors = model.state_dict()
loaded = time.perf_counter() - t
for tensor in tensors.values():  # read every byte (timed: lazily mapped loads pay for their reads here)
    int(tensor.view(torch.uint8).max()) if tensor.numel() else 0
total = time.perf_counter() - t
hwm = next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmHWM"))
# Untimed: a SHA-256 over every tensor's name, dtype, shape and bytes, in name order, so "same bytes"
# below is a real comparison of what the two loads hold, not of a summary that could collide.
digest = hashlib.sha256()
for name in sorted(tensors):
    tensor = tensors[name].contiguous()
    digest.update(f"{name}|{tensor.dtype}|{list(tensor.shape)}|".encode())
    digest.update(tensor.view(torch.uint8).reshape(-1).numpy().data if tensor.numel() else b"")
print(json.dumps({"load_s": loaded, "load_and_read_s": total, "peak_rss": hwm,
                  "bytes": sum(x.numel() * x.element_size() for x in tensors.values()), "sha256": digest.hexdigest()}))
"""

CONVERT = r"""
import json, sys, time
from eagle31_mla.hub.convert import convert
t = time.perf_counter()
result = convert(sys.argv[1], sys.argv[2], progress=False)
seconds = time.perf_counter() - t
hwm = next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmHWM"))
print(json.dumps({"seconds": seconds, "peak_rss": hwm, "bytes": result.tensor_bytes, "files": result.files}))
"""


def write_checkpoint(folder: Path) -> int:
    import torch
    from safetensors.torch import save_file

    from eagle31_mla import Eagle31MLAConfig, Eagle31MLAForCausalLM

    config = Eagle31MLAConfig()
    meta = Eagle31MLAForCausalLM.on_meta_device(config)
    folder.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(0)
    tensors = {}
    for name, t in meta.state_dict().items():  # ~6 GB in bf16 held once, as the file will be
        tensors[name] = torch.empty(t.shape, dtype=torch.bfloat16).normal_(0, 0.02, generator=g)
    save_file(tensors, str(folder / "model.safetensors"))
    del tensors
    (folder / "config.json").write_text(json.dumps(config.to_dict(), indent=2))
    return (folder / "model.safetensors").stat().st_size


def probe(folder: Path, how: str) -> dict:
    out = subprocess.run([sys.executable, "-c", PROBE, str(folder), how], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", type=Path, default=None, help="where to write the checkpoint (default: a temp dir)")
    parser.add_argument("--keep", action="store_true", help="keep the checkpoint afterwards")
    args = parser.parse_args()
    folder = args.dir or Path(tempfile.mkdtemp(prefix="k3-draft-"))
    try:
        if not (folder / "model.safetensors").is_file():
            t = time.perf_counter()
            size = write_checkpoint(folder)
            print(f"# wrote {size:,} bytes in {time.perf_counter() - t:.0f} s to {folder}")
        size = (folder / "model.safetensors").stat().st_size
        print(f"# checkpoint: {size:,} bytes (published: {PUBLISHED_FILE_BYTES:,}; the difference is header metadata)")
        runs = {"plain": [], "library": []}
        for how in ("plain", "library", "plain", "library"):
            runs[how].append(probe(folder, how))
        print(f"# {time.strftime('%Y-%m-%d')}, {os.cpu_count()} CPUs; best of 2 warm runs each\n")
        print("| load | load (s) | load + read all (s) | peak RSS | peak RSS / file |")
        print("|---|--:|--:|--:|--:|")
        best = {}
        for how, label in (
            ("plain", "safetensors.torch.load_file"),
            ("library", "Eagle31MLAForCausalLM.from_pretrained"),
        ):
            r = min(runs[how], key=lambda x: x["load_and_read_s"])
            best[how] = r
            print(
                f"| {label} | {r['load_s']:.2f} | {r['load_and_read_s']:.2f} | {r['peak_rss'] / 2**30:.2f} GiB | "
                f"{r['peak_rss'] / size:.2f} |"
            )
        ratio = best["library"]["load_and_read_s"] / best["plain"]["load_and_read_s"]
        rss = best["library"]["peak_rss"] / best["plain"]["peak_rss"]
        print(
            f"\nlibrary / plain: time {ratio:.2f}x, peak RSS {rss:.2f}x;"
            f" same bytes (SHA-256 of every tensor): {best['library']['sha256'] == best['plain']['sha256']}"
        )
        if len({r["sha256"] for rs in runs.values() for r in rs}) != 1:
            raise SystemExit(
                "the library's load holds other bytes than the file: "
                + str({h: [r["sha256"] for r in rs] for h, rs in runs.items()})
            )
        converted = folder.parent / (folder.name + "-converted")
        try:
            out = subprocess.run(
                [sys.executable, "-c", CONVERT, str(folder), str(converted)], capture_output=True, text=True, check=True
            )
            c = json.loads(out.stdout.strip().splitlines()[-1])
        finally:
            shutil.rmtree(converted, ignore_errors=True)
        print(
            f"\neagle31-mla convert of the same checkpoint: {c['bytes']:,} bytes of tensors in {c['seconds']:.1f} s, "
            f"peak RSS {c['peak_rss'] / 2**30:.2f} GiB = {c['peak_rss'] / size:.3f} x the file "
            f"(wrote {', '.join(n for n in c['files'] if n.endswith('.safetensors'))})"
        )
    finally:
        if not args.keep and args.dir is None:
            shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
