#!/usr/bin/env python3
"""Decode-step time of the full-size Kimi-K3 drafter against its memory-bandwidth floor.

A draft step (k >= 1) reads every weight it touches once (attention, MLP, final norm, the 163,840-row
lm_head; not `fc`, `fc_norm` or the embedding table beyond one row) plus the latent KV cache, so its
floor is those bytes / memory bandwidth. Bandwidth is measured by this script in the same run (best
of large copies and of a matrix-vector product streaming 1 GiB, the higher of the two rates; the
stricter floor), beside each row, because the machine is shared and noisy: compare the ratio, not the
seconds. Also times weight-absorbed latent attention against naive decompression of the cache.

    python benchmarks/decode_step.py                       # bf16, contexts 1k 4k 16k 32k
    python benchmarks/decode_step.py --device cuda --compile reduce-overhead   # GPU, CUDA graphs

Random weights (built on the meta device, then filled in bf16: never an fp32 copy of 3 B params).
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import torch

from eagle31_mla import Eagle31MLAConfig, Eagle31MLAForCausalLM, LatentKVCache


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def measure_bandwidth(device, gib: float = 1.0, repeats: int = 5) -> tuple[float, float]:
    """Best of `repeats`: bytes per second moved by a large copy (read + write counted), and read by a
    matrix-vector product (torch.mv, the fastest kernel here) streaming a 1 GiB bf16 matrix (what a
    decode step's weight reads are)."""
    n = int(gib * 2**30) // 2
    src = torch.empty(n, dtype=torch.bfloat16, device=device).fill_(1)
    dst = torch.empty_like(src)
    matrix = src.view(8192, -1)
    vector = torch.ones(matrix.shape[1], dtype=torch.bfloat16, device=device)
    best_copy = best_read = float("inf")
    for _ in range(repeats):
        sync(device)
        t = time.perf_counter()
        dst.copy_(src)
        sync(device)
        best_copy = min(best_copy, time.perf_counter() - t)
        t = time.perf_counter()
        torch.mv(matrix, vector)
        sync(device)
        best_read = min(best_read, time.perf_counter() - t)
    nbytes = src.numel() * src.element_size()
    return 2 * nbytes / best_copy, nbytes / best_read


def random_drafter(device, dtype=torch.bfloat16) -> Eagle31MLAForCausalLM:
    model = Eagle31MLAForCausalLM.on_meta_device(Eagle31MLAConfig(), dtype)
    model = model.to_empty(device=device)
    g = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.fill_(1.0)
            else:
                p.normal_(0, p.shape[1] ** -0.5, generator=g)
    model.rotary_emb.reset_inv_freq(device)
    return model.eval()


def step_bytes(model, context: int) -> int:
    """Bytes a decode step must read: the weights it touches plus the latent cache."""
    skip = ("embed_tokens.", "fc.", "fc_norm.")
    weights = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if not n.startswith(skip))
    weights += model.config.hidden_size * model.embed_tokens.weight.element_size()  # one embedding row
    cache = context * model.config.kv_cache_values_per_token * model.embed_tokens.weight.element_size()
    return weights + cache


def time_step(model, context: int, steps: int, absorb: bool, device) -> float:
    config = model.config
    cache = LatentKVCache.for_model(config, 1, dtype=model.dtype, device=device, capacity=context + 8)
    cache.c_kv[:, :context].normal_()
    cache.k_pe[:, :context].normal_()
    cache.length = context
    token = torch.tensor([[1]], device=device)
    state = torch.randn(1, 1, config.hidden_size, dtype=model.dtype, device=device)
    position = torch.tensor([[context]], device=device)
    times = []
    with torch.inference_mode():
        for i in range(steps + 2):
            sync(device)
            t = time.perf_counter()
            model(token, hidden_states=state, position_ids=position, past_key_values=cache, absorb=absorb)
            sync(device)
            if i >= 2:  # warm-up
                times.append(time.perf_counter() - t)
            cache.crop(context)
    return statistics.median(times)


def time_attention_core(model, context: int, steps: int, absorb: bool, device) -> float:
    """The attention alone, from the step's query to its per-head output over a `context`-token latent
    cache: what absorption changes, without the weight reads both paths share."""
    config, attention = model.config, model.layers[0].self_attn
    g = torch.Generator(device=device).manual_seed(0)
    q_nope = torch.randn(1, config.num_attention_heads, 1, config.qk_nope_head_dim, generator=g, device=device)
    q_pe = torch.randn(1, config.num_attention_heads, 1, config.qk_rope_head_dim, generator=g, device=device)
    latent = torch.randn(1, context, config.kv_cache_values_per_token, generator=g, device=device)
    q_nope, q_pe, latent = (t.to(model.dtype) for t in (q_nope, q_pe, latent))
    core = attention._absorbed if absorb else attention._naive
    times = []
    with torch.inference_mode():
        for i in range(steps + 1):
            sync(device)
            t = time.perf_counter()
            core(q_nope, q_pe, latent, None)
            sync(device)
            if i >= 1:  # warm-up
                times.append(time.perf_counter() - t)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096, 16384, 32768])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--naive-context", type=int, default=32768, help="context for absorbed vs naive")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--compile", default=None, choices=["default", "reduce-overhead", "max-autotune"],
                        help="torch.compile the model first with this mode (reduce-overhead: CUDA graphs)")
    args = parser.parse_args()
    device = torch.device(args.device)

    print(f"# decode step, Kimi-K3 drafter dims, bf16, batch 1 ({time.strftime('%Y-%m-%d')})")
    print(f"# machine: {platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, "
          f"torch {torch.__version__}, device {device}")  # fmt: skip
    model = random_drafter(device)
    if args.compile:
        model.forward = torch.compile(model.forward, mode=args.compile, dynamic=False)
    print("| context | bytes read | bandwidth (GB/s) | floor (ms) | step (ms) | step / floor |")
    print("|--:|--:|--:|--:|--:|--:|")
    for context in args.contexts:
        # measured again beside each row: the floor uses the better of copy and streaming-read rates
        copy_bw, read_bw = measure_bandwidth(device)
        bandwidth = max(copy_bw, read_bw)
        nbytes = step_bytes(model, context)
        floor = nbytes / bandwidth
        step = time_step(model, context, args.steps, absorb=True, device=device)
        print(f"| {context} | {nbytes / 1e9:.3f} GB | {bandwidth / 1e9:.1f} (copy {copy_bw / 1e9:.1f}, "
              f"read {read_bw / 1e9:.1f}) | {floor * 1e3:.1f} | {step * 1e3:.1f} | {step / floor:.2f} |")  # fmt: skip
    context = args.naive_context
    absorbed = time_step(model, context, max(3, args.steps // 3), absorb=True, device=device)
    naive = time_step(model, context, 3, absorb=False, device=device)
    core_absorbed = time_attention_core(model, context, max(3, args.steps // 3), absorb=True, device=device)
    core_naive = time_attention_core(model, context, 3, absorb=False, device=device)
    print(f"\nabsorbed latent attention vs naive decompression at {context} tokens:")
    print("| measured | absorbed (ms) | naive (ms) | naive / absorbed |")
    print("|---|--:|--:|--:|")
    print(f"| attention alone (query -> per-head output) | {core_absorbed * 1e3:.1f} | {core_naive * 1e3:.1f} | "
          f"{core_naive / core_absorbed:.1f}x |")  # fmt: skip
    print(f"| whole decode step (+ the weight reads both share) | {absorbed * 1e3:.1f} | {naive * 1e3:.1f} | "
          f"{naive / absorbed:.1f}x |")  # fmt: skip


if __name__ == "__main__":
    main()
