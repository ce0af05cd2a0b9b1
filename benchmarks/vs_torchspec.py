#!/usr/bin/env python3
"""One test-time-training step (forward + backward, depth 4, batch 1, fp32, CPU) of this library against
TorchSpec's own code on the same weights and inputs, so that "how fast is our trainer" has an outside yardstick.

    python -m benchmarks.vs_torchspec --torchspec /work/torchspec [--lengths 512 2048] [--rounds 5] [--no-memory]

``--torchspec``: a checkout of github.com/torchspec-project/TorchSpec. Its pieces used: ``Eagle3DeepseekV2ForCausalLM``
(torchspec/models/draft/deepseek_eagle.py, sdpa backend), ``Eagle3Model`` (torchspec/models/eagle3.py: the TTT
unroll and its torch.compile'd loss, torchspec/models/ops/loss.py) and ``Eagle3Trainer._backward``'s sum of
0.8^k x loss_k, with ``gradient_checkpointing`` off (its TrainConfig default). The target is handed over as
probabilities (``PrecomputedTarget``), as the library takes it. The library runs ``trainer.ttt_loss`` with the same
0.8^k weighting. Both drafters are plain EAGLE-3 (the library's ``fc_norm`` and ``norm_output`` off: TorchSpec's MLA
drafter has neither) with the embeddings frozen, as both trainers freeze them.

Alignment: TorchSpec is fed the sequence shifted left by one (its trainer's ``padding``) and gates depth k at row t
by loss_mask[t+k]; the library gates it by the fed token's mask[t+1+k]. The library runs with every token trained
(no mask), TorchSpec with that mask shifted left by one (ones, the last 0): both then train exactly the rows whose
fed token is inside the sequence. Its per-depth loss is the cross-entropy, the library's the forward KL: they
differ by the target's mean entropy over the same rows, which is checked, with the gradients, before timing.

Timing: one warm-up step per side and length (TorchSpec compiles there), then rounds that run both sides in
alternating order in one process; the machine is shared, so read the per-round ratios. Peak memory: each side in a
fresh process, the peak RSS of one step after its warm-up above the RSS before it (Linux's VmHWM, reset in between).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import subprocess
import sys
import time
import types
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
DEPTH, DECAY = 4, 0.8
LAYER = dict(hidden_size=1024, vocab_size=32000, num_attention_heads=8, intermediate_size=2816, q_lora_rank=512,
             kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128)  # fmt: skip


def import_torchspec(path: str):
    # the checkout's package by its location (its own imports are absolute: `torchspec.` resolves through it)
    package = Path(path) / "torchspec"
    spec = importlib.util.spec_from_file_location(
        "torchspec", package / "__init__.py", submodule_search_locations=[str(package)]
    )
    # Stub: torchspec.utils.logging imports torchspec.utils.wandb, which imports wandb (not installed; only its
    # experiment logging needs it). Nothing the training step runs touches it.
    sys.modules.setdefault("torchspec.utils.wandb", types.ModuleType("torchspec.utils.wandb"))
    sys.modules["torchspec"] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sys.modules["torchspec"])
    from torchspec.models.draft.deepseek_eagle import Eagle3DeepseekV2ForCausalLM
    from torchspec.models.eagle3 import Eagle3Model, PrecomputedTarget

    return Eagle3DeepseekV2ForCausalLM, Eagle3Model, PrecomputedTarget


def shift_left(x: torch.Tensor) -> torch.Tensor:
    """x[:, 1:] and a zero at the end: TorchSpec's ``padding(x, left=False)``, which its trainer applies to the tokens
    and the target."""
    return torch.cat([x[:, 1:], torch.zeros_like(x[:, :1])], dim=1)


def build(length: int, torchspec_path: str, sides=("library", "torchspec")):
    """The library's drafter, TorchSpec's with the same weights, and each side's inputs for the same sequence."""
    from transformers.models.deepseek_v3.configuration_deepseek_v3 import DeepseekV3Config

    from eagle31_mla import Eagle31MLAConfig, Eagle31MLAForCausalLM

    torch.manual_seed(0)
    config = Eagle31MLAConfig(
        **LAYER, max_position_embeddings=2 * length, eagle_aux_hidden_state_layer_ids=[1, 2, 3],
        target_num_hidden_layers=4, bos_token_id=0, eos_token_id=1, pad_token_id=2, fc_norm=False, norm_output=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )  # fmt: skip
    lib = Eagle31MLAForCausalLM(config).float().train()
    lib.embed_tokens.weight.requires_grad_(False)
    V, H = LAYER["vocab_size"], LAYER["hidden_size"]
    ids = torch.randint(3, V, (1, length))
    aux = torch.randn(1, length, 3 * H)
    probs = torch.softmax(torch.randn(1, length, V), dim=-1)
    built = {}
    if "library" in sides:
        built["library"] = (lib, dict(input_ids=ids, aux=aux, target_probs=probs))
    if "torchspec" in sides:
        Draft, Eagle3Model, PrecomputedTarget = import_torchspec(torchspec_path)
        ts_config = DeepseekV3Config(
            **LAYER, rms_norm_eps=config.rms_norm_eps, max_position_embeddings=2 * length, hidden_act="silu",
            pad_token_id=2, bos_token_id=0, eos_token_id=1, rope_theta=10000.0, target_hidden_size=H,
        )  # fmt: skip
        ts_config.pretraining_tp = 1  # read by TorchSpec's LlamaMLP; Transformers 5's DeepseekV3Config has no such key
        draft = Draft(ts_config, attention_backend="sdpa").float()
        ours = {k.replace("layers.0.", "midlayer."): v for k, v in lib.state_dict().items()}
        theirs = dict(draft.named_parameters())
        assert set(ours) == set(theirs), set(ours) ^ set(theirs)
        with torch.no_grad():
            for name, p in theirs.items():
                assert p.shape == ours[name].shape, name
                p.copy_(ours[name])
        draft.freeze_embedding()
        model = Eagle3Model(draft, length=DEPTH, attention_backend="sdpa", gradient_checkpointing=False).train()
        mask = torch.ones(1, length)
        mask[:, -1] = 0  # the library's all-trained mask, shifted left by one as TorchSpec's trainer shifts the rest
        inputs = dict(
            input_ids=shift_left(ids), attention_mask=torch.ones(1, length, dtype=torch.long), loss_mask=mask,
            hidden_states=aux, target=PrecomputedTarget(F.pad(shift_left(probs), (0, 0, 0, DEPTH))),
        )  # fmt: skip
        built["torchspec"] = (model, inputs)
    return built


def library_step(model, inputs):
    from eagle31_mla.training import trainer

    model.zero_grad(set_to_none=True)
    terms = trainer.ttt_loss_terms(model, depth=DEPTH, **inputs)
    loss, _ = trainer.combine_depth_losses(terms, depth_decay=DECAY)  # = trainer.ttt_loss(..., depth_decay=0.8)
    loss.backward()
    return [float(kl.detach() / w) for kl, w, _ in terms]


def torchspec_step(model, inputs):
    model.zero_grad(set_to_none=True)
    plosses, _, _ = model(**inputs)
    loss = sum(DECAY**i * p for i, p in enumerate(plosses))  # Eagle3Trainer._backward
    loss.backward()
    return [float(p.detach()) for p in plosses]


STEPS = {"library": library_step, "torchspec": torchspec_step}


def check(built, lib_losses, ts_losses) -> str:
    """TorchSpec's cross-entropy per depth against the library's KL + the target's mean entropy over the same rows;
    the gradients of every trained parameter (max relative difference, by the tensor's largest value)."""
    probs = built["library"][1]["target_probs"][0]
    entropy = -torch.special.xlogy(probs, probs).sum(-1)  # [S]; depth k trains rows t whose fed t+1+k < S
    lines = []
    for k, (kl, ce) in enumerate(zip(lib_losses, ts_losses)):
        ours = kl + float(entropy[1 + k :].mean())
        lines.append(
            f"  depth {k}: TorchSpec CE {ce:.6f}, library KL + H {ours:.6f} (rel diff {abs(ours - ce) / ce:.1e})"
        )
    lib, ts = built["library"][0], built["torchspec"][0].draft_model
    theirs = dict(ts.named_parameters())
    worst = ("", 0.0)
    for name, p in lib.named_parameters():
        if p.grad is None:
            continue
        q = theirs[name.replace("layers.0.", "midlayer.")].grad
        rel = float((p.grad - q).abs().max() / p.grad.abs().max())
        worst = max(worst, (name, rel), key=lambda x: x[1])
    fc = float((lib.fc.weight.grad - ts.fc.weight.grad).abs().max() / lib.fc.weight.grad.abs().max())
    lines.append(f"  gradients: largest max|diff|/max|grad| {worst[1]:.1e} ({worst[0]}); fc.weight {fc:.1e}")
    return "\n".join(lines)


def timed(fn, *args) -> tuple[float, float]:
    """(wall seconds, this process's CPU seconds): the CPU time is less hurt by other jobs taking the cores."""
    start, cpu = time.perf_counter(), time.process_time()
    fn(*args)
    return time.perf_counter() - start, time.process_time() - cpu


def vm(field: str) -> float:
    """MB of a /proc/self/status field (VmRSS, VmHWM)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise KeyError(field)


def memory_one(side: str, length: int, torchspec_path: str) -> dict:
    """In a fresh process: the peak RSS of one step after the warm-up, above the RSS before it."""
    built = build(length, torchspec_path, sides=(side,))
    model, inputs = built[side]
    STEPS[side](model, inputs)  # warm-up (TorchSpec compiles)
    model.zero_grad(set_to_none=True)
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS
    before = vm("VmRSS")
    STEPS[side](model, inputs)
    return dict(peak_mb=vm("VmHWM") - before)


def torchspec_version(path: str) -> str:
    """The checkout's commit: git's, or a COMMIT file beside an exported tree (git archive keeps no history)."""
    run = subprocess.run(["git", "-C", path, "rev-parse", "--short=7", "HEAD"], capture_output=True, text=True)
    if run.returncode == 0:
        return run.stdout.strip()
    file = Path(path) / "COMMIT"
    return file.read_text().strip()[:7] if file.exists() else "unknown commit"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--torchspec", required=True, help="a TorchSpec checkout (its repository root)")
    parser.add_argument("--lengths", type=int, nargs="+", default=[512, 2048])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--no-memory", action="store_true", help="skip the fresh-process peak-memory runs")
    parser.add_argument("--memory-one", help=argparse.SUPPRESS)  # side:length, run in this (fresh) process
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.memory_one:
        side, length = args.memory_one.split(":")
        print(json.dumps(memory_one(side, int(length), args.torchspec)))
        return

    print(f"# TTT step vs TorchSpec ({torchspec_version(args.torchspec)}), depth {DEPTH}, batch 1, fp32, hidden 1024, "
          f"8 heads, vocab 32,000 ({time.strftime('%Y-%m-%d')}; torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads)")  # fmt: skip
    rows = []
    for length in args.lengths:
        built = build(length, args.torchspec)
        lib_losses = library_step(*built["library"])  # warm-up, and the equality check
        ts_losses = torchspec_step(*built["torchspec"])
        print(f"\n{length} tokens, the warm-up step of each side:\n{check(built, lib_losses, ts_losses)}", flush=True)
        times = {"library": [], "torchspec": []}
        for r in range(args.rounds):
            order = ("library", "torchspec") if r % 2 == 0 else ("torchspec", "library")
            for side in order:
                times[side].append(timed(STEPS[side], *built[side]))
            (a, a_cpu), (b, b_cpu) = times["library"][-1], times["torchspec"][-1]
            print(f"  round {r + 1}: library {a:.2f} s (CPU {a_cpu:.2f} s), TorchSpec {b:.2f} s (CPU {b_cpu:.2f} s), "
                  f"ratio {a / b:.2f} (CPU {a_cpu / b_cpu:.2f})", flush=True)  # fmt: skip
        del built
        memory = {}
        if not args.no_memory:
            for side in ("library", "torchspec"):
                run = subprocess.run(
                    [sys.executable, "-m", "benchmarks.vs_torchspec", "--torchspec", args.torchspec, "--threads",
                     str(args.threads), "--memory-one", f"{side}:{length}"], cwd=ROOT, capture_output=True, text=True,
                )  # fmt: skip
                ok = run.returncode == 0
                memory[side] = json.loads(run.stdout.strip().splitlines()[-1])["peak_mb"] if ok else None
        rows.append((length, times, memory))

    print("\n| tokens | round | library (s) | TorchSpec (s) | library / TorchSpec | library / TorchSpec, CPU time |")
    print("|--:|--:|--:|--:|--:|--:|")
    for length, times, _ in rows:
        wall = [a / b for (a, _), (b, _) in zip(times["library"], times["torchspec"])]
        cpu = [a / b for (_, a), (_, b) in zip(times["library"], times["torchspec"])]
        for r, ((a, _), (b, _)) in enumerate(zip(times["library"], times["torchspec"])):
            print(f"| {length:,} | {r + 1} | {a:.2f} | {b:.2f} | {wall[r]:.2f} | {cpu[r]:.2f} |")
        lib, ts = (statistics.median(t for t, _ in times[side]) for side in ("library", "torchspec"))
        print(f"| {length:,} | median | {lib:.2f} | {ts:.2f} | {lib / ts:.2f} (of the rounds' ratios: "
              f"{statistics.median(wall):.2f}) | {statistics.median(cpu):.2f} |")  # fmt: skip
    if not args.no_memory:
        print("\n| tokens | library peak RSS above setup (MB) | TorchSpec peak RSS above setup (MB) |")
        print("|--:|--:|--:|")
        for length, _, memory in rows:
            cells = ["failed" if memory[side] is None else f"{memory[side]:,.0f}" for side in ("library", "torchspec")]
            print(f"| {length:,} | {cells[0]} | {cells[1]} |")


if __name__ == "__main__":
    main()
