#!/usr/bin/env python3
"""Train long from the CLI: ``eagle31-mla train --seq-len L`` on the demo pair, live (the target run here) and from
a vLLM capture (``capture --out``, then ``train --data``; ``capture --spool`` and ``train --data --follow`` at
once), one step of batch 1 each; the wall time and peak RSS of each command (of both, for the spool).

    python -m benchmarks.train_long [--seq-len 32768] [--anchors N] [--work DIR] [--no-vllm]

The demo pair declares 512 positions (it was trained on short text), and ``train`` refuses sequences longer than
the target's or the drafter's max_position_embeddings; so the work folder holds copies of the demo target and of
the demo drafter's config with the limit raised to L + 1 (their rope is the plain kind, which does not depend on it:
the weights compute what they compute at 512). The text is the demo corpus, as many documents as fill one
sequence. Compare within one run: the machine is shared.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from eagle31_mla.demo import DEMO_DIR
from eagle31_mla.testing import demo_corpus


def long_pair(work: Path, seq_len: int) -> tuple[Path, Path, Path]:
    """(target copy, drafter config, text of at least one sequence) in ``work``."""
    from transformers import AutoTokenizer

    target = work / "target"
    shutil.rmtree(target, ignore_errors=True)
    shutil.copytree(DEMO_DIR / "target", target)
    draft = work / "draft-config.json"
    for path in (target / "config.json", draft):
        source = DEMO_DIR / ("target" if path.parent == target else "draft") / "config.json"
        limit = {"max_position_embeddings": seq_len + 1}  # vLLM's capture generates one token after a sequence
        path.write_text(json.dumps({**json.loads(source.read_text()), **limit}, indent=2))
    tokenizer = AutoTokenizer.from_pretrained(target)
    lines, tokens, seed = [], 0, 0
    while tokens < 1.05 * seq_len:  # one sequence: the documents and their EOS separators
        texts, _ = demo_corpus(seed, 200)
        for text in texts:
            lines.append(text.replace("\n", " "))
            tokens += len(tokenizer(lines[-1])["input_ids"]) + 1
        seed += 1
    text = work / "long.txt"
    text.write_text("\n".join(lines) + "\n")
    return target, draft, text


def run(commands: list[list[str]], env: dict) -> tuple[float, float, list[str]]:
    """Run the commands at once; (wall seconds, the sum of their peak RSS in GB, failures)."""
    start = time.perf_counter()
    procs = [
        subprocess.Popen(c, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for c in commands
    ]
    peak, failed = 0.0, []
    for proc in procs:
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        peak += usage.ru_maxrss / 1e6  # kB on Linux
        if proc.returncode:
            failed.append((proc.stdout.read().strip().splitlines() or ["killed"])[-1][:100])
    return time.perf_counter() - start, peak, failed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq-len", type=int, default=32768)
    parser.add_argument("--anchors", type=int, help="anchored TTT with N anchors (default: dense TTT)")
    parser.add_argument("--work", type=Path, default=Path("train-long-work"))
    parser.add_argument("--no-vllm", action="store_true", help="the live row only")
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    target, draft, text = long_pair(args.work, args.seq_len)
    cli = [sys.executable, "-m", "eagle31_mla.cli"]
    steps = ["--draft-config", str(draft), "--batch-size", "1", "--quiet"]
    steps += ["--anchors", str(args.anchors)] if args.anchors else []
    capture = [*cli, "capture", "--target", str(target), "--aux-layers", "1,2,3", "--text", str(text), "--quiet"]
    capture += ["--seq-len", str(args.seq_len), "--engine-args", json.dumps({"max_model_len": args.seq_len + 1})]
    out = lambda name: str(args.work / name)  # noqa: E731
    for name in ("live", "captured", "followed", "capture", "spool"):
        shutil.rmtree(out(name), ignore_errors=True)
    rows = [
        ("train, live", [[*cli, "train", "--target", str(target), "--text", str(text), "--seq-len",
                          str(args.seq_len), "--steps", "1", *steps, "--out", out("live")]]),
    ]  # fmt: skip
    if not args.no_vllm:
        rows += [
            ("capture --out (vLLM)", [[*capture, "--out", out("capture")]]),
            ("train --data", [[*cli, "train", "--target", str(target), "--data", out("capture"), "--steps", "1",
                               *steps, "--out", out("captured")]]),
            ("capture --spool + train --follow, at once", [
                [*capture, "--spool", out("spool"), "--max-spool-gb", "1"],
                [*cli, "train", "--target", str(target), "--data", out("spool"), "--follow", *steps,
                 "--out", out("followed")]]),
        ]  # fmt: skip
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_ENABLE_V1_MULTIPROCESSING="0")
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    mode = f"anchored, {args.anchors} anchors" if args.anchors else "dense"
    print(f"# demo pair, {args.seq_len:,} tokens, batch 1, one step, TTT depth 4 ({mode}); {time.strftime('%Y-%m-%d')}")
    print("| command | wall (s) | peak RSS (GB) |\n|---|--:|--:|")
    for name, commands in rows:
        wall, peak, failed = run(commands, env)
        print(f"| {name} | {wall:.0f} | {peak:.1f} |" if not failed else f"| {name} | failed: {failed} | |", flush=True)


if __name__ == "__main__":
    main()
