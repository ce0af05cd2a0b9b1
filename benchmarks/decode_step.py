#!/usr/bin/env python3
"""Decode-step time of the full-size Kimi-K3 drafter against an estimate of its memory-bandwidth floor.

A draft step (k >= 1) reads every weight it touches once (attention, MLP, final norm, the 163,840-row
lm_head, about 70% of the bytes; not `fc`, `fc_norm` or the embedding table beyond one row) plus the
latent KV cache, so its floor is about those bytes / the memory's read bandwidth. The read bandwidth
is measured by a pure streaming-read kernel (a sum over a 1 GiB fp32 buffer: no writes, no arithmetic
to speak of), timed interleaved with the steps and taken as the best of those reads, because the
machine is shared and noisy. The floor is an estimate (no kernel reads faster than a plain sum, but a
matrix-vector product may not reach it); each row also prints the rate the step achieved (its bytes /
its median time). Compare the ratio, not the seconds. Also times weight-absorbed latent attention
against naive decompression of the cache, and on CPU both absorbed-attention paths (native bf16
products, and the fp32 ones taken where the CPU has no native bf16).

    python benchmarks/decode_step.py                       # bf16, contexts 1k 4k 16k 32k
    python benchmarks/decode_step.py --contexts 1024 4096 --steps 5 --naive-context 4096   # a quick run
    python benchmarks/decode_step.py --device cuda --compile reduce-overhead   # GPU, CUDA graphs
    python benchmarks/decode_step.py --device cuda --attn flashinfer   # GPU, FlashInfer's MLA decode kernel
    python benchmarks/decode_step.py --device cuda --json rows.json    # also the rows as JSON (scripts/gpu_check.sh)

``--attn flashinfer`` (the ``[gpu]`` extra) runs the drafter with ``attn_implementation="flashinfer"``: the step's
attention over the latent cache through FlashInfer, everything else eager torch; it plans on the host every step,
so it does not combine with ``--compile``.

Random weights (built on the meta device, then filled in bf16: never an fp32 copy of 3 B params).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch

import eagle31_mla.model.modeling_eagle31_mla as modeling
from eagle31_mla import Eagle31MLAConfig, Eagle31MLAForCausalLM, LatentKVCache


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


class StreamingRead:
    """A pure streaming-read kernel: the sum of a `gib` GiB fp32 buffer. ``rate()`` is the best bytes
    per second seen so far, over every ``sample()`` (called between the steps being measured)."""

    def __init__(self, device, gib: float = 1.0):
        self.device = device
        self.buffer = torch.ones(int(gib * 2**30) // 4, dtype=torch.float32, device=device)
        self.best = float("inf")

    def sample(self) -> None:
        sync(self.device)
        t = time.perf_counter()
        self.buffer.sum()
        sync(self.device)
        self.best = min(self.best, time.perf_counter() - t)

    def rate(self) -> float:
        return self.buffer.numel() * self.buffer.element_size() / self.best


def cpu_kind() -> str:
    """The CPU and the flags that decide its bf16 speed, as torch reports them."""
    get = getattr(torch.cpu, "get_capabilities", None)
    caps = dict(get()) if get is not None else {}
    flags = [f for f in ("avx2", "avx512_f", "avx512_bf16", "amx_bf16", "bf16") if caps.get(f)]
    name = caps.get("cpu_name") or platform.processor() or platform.machine()
    path = "native bf16" if modeling.cpu_has_native_bf16() else "fp32 (no native bf16)"
    return f"{name}, flags {' '.join(flags) or 'unknown'}; absorbed attention on this CPU: {path}"


def random_drafter(device, dtype=torch.bfloat16) -> Eagle31MLAForCausalLM:
    model = Eagle31MLAForCausalLM.on_meta_device(Eagle31MLAConfig(), dtype)
    model = model.to_empty(device=device)
    g = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
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


def time_step(model, context: int, steps: int, absorb: bool, device, reads: StreamingRead | None = None) -> float:
    """Median time of a one-token decode step over a `context`-token cache; with `reads`, a streaming
    read is timed before every step (interleaved, so both see the same machine state)."""
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
            if reads is not None:
                reads.sample()
            sync(device)
            t = time.perf_counter()
            model(
                token,
                hidden_states=state,
                position_ids=position,
                past_key_values=cache,
                absorb=absorb,
            )
            sync(device)
            if i >= 2:  # warm-up
                times.append(time.perf_counter() - t)
            cache.crop(context)
    return statistics.median(times)


def time_attention_core(model, context: int, steps: int, absorb: bool, device) -> float:
    """The attention alone, from the step's query to its per-head output over a `context`-token latent
    cache: what absorption changes, without the weight reads both paths share (absorbed: through FlashInfer
    when the drafter's attention implementation is "flashinfer")."""
    config, attention = model.config, model.layers[0].self_attn
    g = torch.Generator(device=device).manual_seed(0)
    q_nope = torch.randn(1, config.num_attention_heads, 1, config.qk_nope_head_dim, generator=g, device=device)
    q_pe = torch.randn(1, config.num_attention_heads, 1, config.qk_rope_head_dim, generator=g, device=device)
    cache = LatentKVCache.for_model(config, 1, dtype=model.dtype, device=device, capacity=context)
    cache.update(
        *torch.randn(1, context, config.kv_cache_values_per_token, generator=g, device=device).split(
            [config.kv_lora_rank, config.qk_rope_head_dim], dim=-1
        )
    )
    q_nope, q_pe = (t.to(model.dtype) for t in (q_nope, q_pe))
    latent = cache.latent[:, :context]
    times = []
    with torch.inference_mode():
        for i in range(steps + 1):
            sync(device)
            t = time.perf_counter()
            if absorb:
                attention._absorbed(q_nope, q_pe, latent, None, cache)
            else:
                attention._naive(q_nope, q_pe, latent, None)
            sync(device)
            if i >= 1:  # warm-up
                times.append(time.perf_counter() - t)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096, 16384, 32768])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--naive-context", type=int, default=32768, help="context for absorbed vs naive (0: skip)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument(
        "--compile",
        default=None,
        choices=["default", "reduce-overhead", "max-autotune"],
        help="torch.compile the model first with this mode (reduce-overhead: CUDA graphs)",
    )
    parser.add_argument(
        "--attn",
        default="eager",
        choices=["eager", "flashinfer"],
        help="the drafter's attention implementation (flashinfer: its MLA decode kernel; the [gpu] extra)",
    )
    parser.add_argument("--json", default=None, metavar="PATH", help="also write the step rows as JSON to PATH")
    args = parser.parse_args()
    device = torch.device(args.device)
    if args.attn == "flashinfer" and args.compile:
        parser.error("--attn flashinfer plans FlashInfer's kernel on the host every step: run it without --compile")
    if args.attn == "flashinfer":  # refused now, with what is missing, not after building 6 GB of weights
        from eagle31_mla.model.flashinfer_backend import require

        config = Eagle31MLAConfig()
        require(device, torch.bfloat16, kv_lora_rank=config.kv_lora_rank, rope_dim=config.qk_rope_head_dim)

    label = f"attention {args.attn}" + (f", torch.compile {args.compile}" if args.compile else ", eager torch")
    print(f"# decode step, Kimi-K3 drafter dims, bf16, batch 1, {label} ({time.strftime('%Y-%m-%d')})")
    print(
        f"# machine: {platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}, "
        f"device {device}"
        + (f" ({torch.cuda.get_device_name(device)})" if device.type == "cuda" and torch.cuda.is_available() else "")
    )
    if device.type == "cpu":
        print(f"# cpu: {cpu_kind()}")
    model = random_drafter(device)
    model.config._attn_implementation = args.attn
    if args.compile:
        model.forward = torch.compile(model.forward, mode=args.compile, dynamic=False)
    print(
        "| context | bytes read | streaming read, best (GB/s) | floor, est. (ms) | step, median (ms) "
        "| step achieved (GB/s) | step / floor |"
    )
    print("|--:|--:|--:|--:|--:|--:|--:|")
    rows = []
    for context in args.contexts:
        reads = StreamingRead(device)  # sampled before every step of this row
        nbytes = step_bytes(model, context)
        step = time_step(model, context, args.steps, absorb=True, device=device, reads=reads)
        floor = nbytes / reads.rate()
        print(
            f"| {context} | {nbytes / 1e9:.3f} GB | {reads.rate() / 1e9:.1f} | {floor * 1e3:.1f} | {step * 1e3:.1f} | "
            f"{nbytes / step / 1e9:.1f} | {step / floor:.2f} |"
        )
        rows.append(dict(context=context, bytes=nbytes, read_rate=reads.rate(), floor_s=floor, step_s=step))
        del reads
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"label": label, "device": str(device), "torch": torch.__version__, "rows": rows}, f, indent=2)
    lm_head = model.lm_head.weight
    share = lm_head.numel() * lm_head.element_size() / step_bytes(model, args.contexts[0])
    print(f"\nlm_head: {share:.0%} of the bytes a step reads at {args.contexts[0]} tokens")

    context = args.naive_context or args.contexts[-1]
    if args.naive_context:
        absorbed_vs_naive(model, context, args.steps, device)
    if device.type == "cpu":  # both CPU paths of the absorbed attention, whichever this CPU takes
        chosen = modeling.cpu_has_native_bf16()
        paths = {}
        try:
            for native in (True, False):
                modeling.CPU_NATIVE_BF16 = native
                paths[native] = time_attention_core(model, context, max(3, args.steps // 3), absorb=True, device=device)
        finally:
            modeling.CPU_NATIVE_BF16 = chosen
        taken = "native bf16" if chosen else "fp32"
        print(f"\nabsorbed attention alone at {context} tokens, by CPU path (this CPU takes {taken}):")
        print(
            f"| native bf16 products (ms) | fp32 products over an fp32 copy of the cache (ms) |\n|--:|--:|\n"
            f"| {paths[True] * 1e3:.1f} | {paths[False] * 1e3:.1f} |"
        )


def absorbed_vs_naive(model, context: int, steps: int, device) -> None:
    absorbed = time_step(model, context, max(3, steps // 3), absorb=True, device=device)
    naive = time_step(model, context, 3, absorb=False, device=device)
    core_absorbed = time_attention_core(model, context, max(3, steps // 3), absorb=True, device=device)
    core_naive = time_attention_core(model, context, 3, absorb=False, device=device)
    print(f"\nabsorbed latent attention vs naive decompression at {context} tokens:")
    print("| measured | absorbed (ms) | naive (ms) | naive / absorbed |")
    print("|---|--:|--:|--:|")
    print(
        f"| attention alone (query -> per-head output) | {core_absorbed * 1e3:.1f} | {core_naive * 1e3:.1f} | "
        f"{core_naive / core_absorbed:.1f}x |"
    )
    print(
        f"| whole decode step (+ the weight reads both share) | {absorbed * 1e3:.1f} | {naive * 1e3:.1f} | "
        f"{naive / absorbed:.1f}x |"
    )


if __name__ == "__main__":
    main()
