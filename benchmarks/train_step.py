#!/usr/bin/env python3
"""One test-time-training step (depth 4, batch 1, forward + backward of ``ttt_loss``): time and peak memory by
sequence length, for the embedded demo drafter's layer (hidden 128, 2 heads, vocabulary 512) and a mid-size one
(hidden 1024, 8 heads, vocabulary 32,000), fp32 and bf16 (autocast, as ``--compute-dtype bfloat16`` trains), dense
and anchored TTT; the attention as the trainer runs it (``linear``: TTTAttention) or as the dense [T, S + k·T] mask
the tests keep as its oracle (``dense``).

    python -m benchmarks.train_step [--lengths 1024 4096 16384 32768] [--layers demo mid] [--dtypes float32]
        [--modes dense anchored] [--attention linear dense] [--repeats 3] [--device cuda]

Each configuration runs in a fresh process (its peak RSS is its own): the table gives the median step time and the
peak RSS above the process's state before the first step (model, inputs and target distributions included). Compare
ratios within one run: the machine is shared.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LAYERS = {
    "demo": dict(hidden_size=128, vocab_size=512, num_attention_heads=2, intermediate_size=384),
    "mid": dict(hidden_size=1024, vocab_size=32000, num_attention_heads=8, intermediate_size=2816),
}


def rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def one(layer: str, length: int, dtype: str, mode: str, attention: str, repeats: int, device: str = "cpu") -> dict:
    """Run in this process: the steps of one configuration."""
    import torch

    from eagle31_mla import Eagle31MLAConfig, Eagle31MLAForCausalLM
    from eagle31_mla.training import trainer

    if attention == "dense":  # the tests' oracle: run as a module from the repository root
        from tests.support.reference_math import DenseTTTAttention

        trainer.TTTAttention = DenseTTTAttention
    torch.manual_seed(0)
    sizes = LAYERS[layer]
    config = Eagle31MLAConfig(
        **sizes, q_lora_rank=64 if layer == "demo" else 512, kv_lora_rank=512, qk_nope_head_dim=32 if layer == "demo"
        else 128, qk_rope_head_dim=64, v_head_dim=32 if layer == "demo" else 128, max_position_embeddings=2 * length,
        eagle_aux_hidden_state_layer_ids=[1, 2, 3], target_num_hidden_layers=4, bos_token_id=0, eos_token_id=1,
        pad_token_id=2, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )  # fmt: skip
    model = Eagle31MLAForCausalLM(config).float().train().to(device)
    depth, V, H = 4, sizes["vocab_size"], sizes["hidden_size"]
    ids = torch.randint(3, V, (1, length), device=device)
    aux = torch.randn(1, length, 3 * H, device=device)
    probs = torch.softmax(torch.randn(1, length, V, device=device), dim=-1)
    anchors = None
    if mode == "anchored":  # TorchSpec's sampler, one anchor per 8 positions
        weights = torch.ones(1, length, device=device)
        anchors = trainer.sample_anchors(weights, max(1, length // 8), depth, seeds=[0])
    autocast = torch.autocast(torch.device(device).type, dtype=torch.bfloat16, enabled=dtype == "bfloat16")
    cuda = torch.device(device).type == "cuda"  # there: the allocator's peak, not the process's RSS
    before, times = torch.cuda.memory_allocated(device) / 2**20 if cuda else rss_mb(), []
    for _ in range(repeats):
        model.zero_grad(set_to_none=True)
        start = time.perf_counter()
        with autocast:
            loss, _ = trainer.ttt_loss(model, ids, aux, probs, depth, anchors=anchors)
        loss.backward()
        if cuda:
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    peak = torch.cuda.max_memory_allocated(device) / 2**20 if cuda else rss_mb()
    return dict(seconds=statistics.median(times), peak_mb=peak - before, loss=float(loss))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096, 16384, 32768])
    parser.add_argument("--layers", nargs="+", default=["demo", "mid"], choices=list(LAYERS))
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16"])
    parser.add_argument("--modes", nargs="+", default=["dense", "anchored"], choices=["dense", "anchored"])
    parser.add_argument("--attention", nargs="+", default=["linear"], choices=["linear", "dense"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1 (on CUDA the peak is the allocator's)")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # a configuration, run in this (fresh) process
    args = parser.parse_args()
    if args.one:
        print(json.dumps(one(**json.loads(args.one), repeats=args.repeats, device=args.device)))
        return
    import torch

    print(f"# TTT step, depth 4, batch 1 ({time.strftime('%Y-%m-%d')}; torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads)")  # fmt: skip
    memory = "peak allocated" if args.device.startswith("cuda") else "peak RSS"
    print(f"| layer | dtype | mode | attention | tokens | step (s) | {memory} above setup (MB) |")
    print("|---|---|---|---|--:|--:|--:|")
    for layer in args.layers:
        for dtype in args.dtypes:
            for mode in args.modes:
                for length in args.lengths:
                    for attention in args.attention:
                        conf = dict(layer=layer, length=length, dtype=dtype, mode=mode, attention=attention)
                        run = subprocess.run(
                            [sys.executable, "-m", "benchmarks.train_step", "--one", json.dumps(conf)]
                            + ["--repeats", str(args.repeats), "--device", args.device],
                            cwd=ROOT,
                            capture_output=True,
                            text=True,
                        )
                        if run.returncode != 0:
                            why = (run.stderr.strip().splitlines() or ["killed"])[-1][:80]
                            print(f"| {layer} | {dtype} | {mode} | {attention} | {length} | failed: {why} | |")
                            continue
                        r = json.loads(run.stdout.strip().splitlines()[-1])
                        print(
                            f"| {layer} | {dtype} | {mode} | {attention} | {length} | {r['seconds']:.2f} | "
                            f"{r['peak_mb']:.0f} |",
                            flush=True,
                        )


if __name__ == "__main__":
    main()
