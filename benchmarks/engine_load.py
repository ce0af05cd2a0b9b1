#!/usr/bin/env python3
"""The engine under load: the real vLLM engine (CPU build) with the eagle31-mla plugin serving 64
concurrent requests, checked request by request against the same engine without speculation.

    python -m benchmarks.engine_load                    # 64 requests, k = 3, max_model_len 256
    python -m benchmarks.engine_load --requests 128 --bound 900

Run it from the repository root, as a module: its models and load come from the test suite's vLLM
harness, ``tests.support.vllm_harness``. The load (``mixed_load``): prompts of 3-160 tokens, every 3rd
request sampled (temperature 0.8, top-p 0.95, seeded), every 8th aborted midway, one whose prompt plus
max_tokens runs past max_model_len, one whose prompt alone is too long; all in one engine at once
(max_num_seqs = the number of requests). Models: the tests' tiny DeepSeek-V3 MLA target and an
"early-exit" drafter that agrees with it part of the time. Checks: every greedy output equals the
output without speculation, every aborted one is a prefix of it, sampled ones run to max_tokens with
ids in the vocabulary, the context-limit request stops there ("length"), the too-long prompt is
refused with vLLM's message, and serving finishes within ``--bound`` seconds. Exit status 1 if any
check fails. ``tests/engines/test_vllm_plugin.py::test_every_request_ends_as_expected`` is the 20-request version
that runs in the suite.
"""

from __future__ import annotations

import argparse
import gc
import os
import platform
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

# Before vLLM is imported: in-process engine, a small CPU KV cache, offline, a private compile cache.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
os.environ.setdefault("VLLM_CACHE_ROOT", tempfile.mkdtemp(prefix="eagle31-vllm-cache-"))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--k", type=int, default=3, help="num_speculative_tokens")
    parser.add_argument("--max-model-len", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0, help="of the request mix")
    parser.add_argument("--bound", type=float, default=600.0, help="seconds the speculative serving may take")
    parser.add_argument("--dir", type=Path, default=None, help="where to build the models (default: a temp dir)")
    args = parser.parse_args(argv)

    import vllm

    from tests.support.vllm_harness import (
        VOCAB,
        acceptance_report,
        build_target,
        early_exit_draft,
        make_llm,
        mixed_load,
        run_load,
        spec_metrics,
        write_draft,
    )

    root = args.dir or Path(tempfile.mkdtemp(prefix="eagle31-engine-load-"))
    t0 = time.perf_counter()
    target = build_target(root / "target")  # before any engine runs (see build_target)
    draft = write_draft(root / "draft", early_exit_draft(target), "published")
    requests = mixed_load(args.requests, max_model_len=args.max_model_len, seed=args.seed)
    greedy_ids = [r.id for r in requests if r.temperature == 0]

    engine_kwargs = dict(max_model_len=args.max_model_len, max_num_seqs=args.requests)
    plain = make_llm(target, **engine_kwargs)
    baseline = run_load(plain, [r for r in requests if r.id in greedy_ids], aborts=False)
    del plain
    gc.collect()
    llm = make_llm(target, draft, k=args.k, **engine_kwargs)
    runner = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner
    drafter_class = type(runner.drafter.model).__name__
    spec = run_load(llm, requests)
    report = acceptance_report(spec_metrics(llm))
    total = time.perf_counter() - t0

    failures = []
    by_kind: dict[str, list] = {}
    for r in requests:
        by_kind.setdefault(r.kind, []).append(r)
    greedy_equal = [r for r in by_kind.get("greedy", []) if spec.tokens[r.id] == baseline.tokens[r.id]]
    failures += [
        f"{r.id}: greedy output differs from the output without speculation"
        for r in by_kind.get("greedy", [])
        if r not in greedy_equal
    ]
    failures += [
        f"{r.id}: finished {spec.finish.get(r.id)!r}, expected 'length'"
        for r in by_kind.get("greedy", []) + by_kind.get("sampled", [])
        if spec.finish.get(r.id) != "length"
    ]
    sampled_ok = [
        r
        for r in by_kind.get("sampled", [])
        if len(spec.tokens[r.id]) == r.max_tokens and all(0 <= t < VOCAB for t in spec.tokens[r.id])
    ]
    failures += [
        f"{r.id}: sampled output of length {len(spec.tokens[r.id])}"
        for r in by_kind.get("sampled", [])
        if r not in sampled_ok
    ]
    aborted_ok = []
    for r in by_kind.get("aborted", []):
        got = spec.tokens[r.id]
        prefix = r.temperature != 0 or got == baseline.tokens[r.id][: len(got)]
        if spec.finish.get(r.id) == "aborted" and r.abort_after <= len(got) < r.max_tokens and prefix:
            aborted_ok.append(r)
        else:
            failures.append(
                f"{r.id}: abort after {r.abort_after} tokens gave {spec.finish.get(r.id)!r} with {len(got)} tokens"
            )
    capped = by_kind["context-limit"][0]
    capped_tokens = spec.tokens.get(capped.id, [])
    capped_ok = (
        spec.finish.get(capped.id) == "length"
        and capped_tokens == baseline.tokens.get(capped.id)
        and len(capped.prompt_ids) + len(capped_tokens) == args.max_model_len
    )
    if not capped_ok:
        failures.append(f"context-limit: {spec.finish.get(capped.id)!r} after {len(capped_tokens)} tokens")
    refused = spec.finish.get("over-long", "")
    if not (
        refused.startswith("refused: VLLMValidationError")
        and f"maximum context length is {args.max_model_len}" in refused
    ):
        failures.append(f"over-long prompt: {refused!r}")
    if spec.wall_s > args.bound:
        failures.append(f"serving took {spec.wall_s:.1f} s > bound {args.bound:.0f} s")
    if drafter_class != "Eagle31MLAEagle3ForCausalLM":
        failures.append(f"drafter class {drafter_class}")

    n = len(requests)
    print(
        f"\nengine under load: vLLM {vllm.__version__} ({platform.machine()}, {os.cpu_count()} CPUs), "
        f"drafter {drafter_class}, k = {args.k}, max_model_len {args.max_model_len}, {date.today()}"
    )
    rows = [
        ("requests (all in one engine at once)", f"{n}"),
        ("greedy: equal to no speculation", f"{len(greedy_equal)} / {len(by_kind.get('greedy', []))}"),
        ("sampled (T 0.8, top-p 0.95): ran to max_tokens", f"{len(sampled_ok)} / {len(by_kind.get('sampled', []))}"),
        ("aborted midway: stopped, greedy ones a prefix", f"{len(aborted_ok)} / {len(by_kind.get('aborted', []))}"),
        (
            "prompt + max_tokens past the context limit",
            f"{spec.finish.get(capped.id)} after {len(capped_tokens)} tokens (prompt {len(capped.prompt_ids)})"
            + (", = no speculation" if capped_ok else ""),
        ),
        (
            "prompt alone past the context limit",
            "refused: VLLMValidationError" if refused.startswith("refused: VLLMValidationError") else refused,
        ),
        (
            "serving wall time, speculative",
            f"{spec.wall_s:.1f} s ({spec.steps} engine steps; bound {args.bound:.0f} s)",
        ),
        ("serving wall time, no speculation (greedy only)", f"{baseline.wall_s:.1f} s ({baseline.steps} engine steps)"),
        (
            "accept length (tokens per verification step)",
            f"{report['accept_length']:.2f} over {report['drafts']} drafts, "
            f"per position {[round(x, 3) for x in report['per_position_rate']]}",
        ),
        ("total, with model building and two engine start-ups", f"{total:.0f} s"),
    ]
    width = max(len(name) for name, _ in rows)
    print(f"| {'check':<{width}} | result |\n|{'-' * (width + 2)}|--------|")
    for name, value in rows:
        print(f"| {name:<{width}} | {value} |")
    for failure in failures:
        print(f"FAILED {failure}")
    print("all checks passed" if not failures else f"{len(failures)} check(s) failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
