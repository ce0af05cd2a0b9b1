"""Fine-tuning a trained drafter the way the published one was trained (TrainingConfig.finetune, train --init):
the pruned-vocabulary rule, non-finite steps, bf16 compute on float32 master weights with a bf16 export, and
`train --init` on an EAGLE-3 drafter. The depth-weighted loss against TorchSpec's: tests/unit/test_anchors.py."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from eagle31_mla import Eagle31MLAForCausalLM
from eagle31_mla.decoding.target import capture_target_states
from eagle31_mla.demo import DEMO_DIR
from eagle31_mla.training.trainer import (
    LiveTarget,
    TrainingConfig,
    drafter_to_finetune,
    target_embeddings,
    train_on,
    ttt_forward,
    ttt_loss,
)
from tests.support.spool_writer import demo_target

pytestmark = pytest.mark.transformers


SEQUENCES = torch.randint(3, 512, (16, 64), generator=torch.Generator().manual_seed(31))  # the demo target's ids


def to_finetune():
    return drafter_to_finetune(DEMO_DIR / "draft", demo_target().get_input_embeddings().weight)


def test_a_pruned_vocabulary_leaves_out_positions_it_cannot_predict():
    """Positions whose target argmax has no draft token carry no loss (TorchSpec's rule)."""
    full = Eagle31MLAForCausalLM.from_pretrained(DEMO_DIR / "draft", dtype=torch.float32)
    ids = SEQUENCES[:2]
    aux, probs = capture_target_states(demo_target(), ids, full.config.aux_layer_ids)
    keep = probs.argmax(-1)[0, :20].unique()  # a draft vocabulary holding some targets' argmax only
    extra = torch.tensor([i for i in range(512) if i not in set(keep.tolist())][: 64 - len(keep)])
    kept = torch.cat([keep, extra]).sort().values
    pruned = Eagle31MLAForCausalLM(
        type(full.config).from_dict({**full.config.to_dict(), "draft_vocab_size": len(kept)})
    )
    state = {**full.state_dict(), "lm_head.weight": full.lm_head.weight[kept], "d2t": kept - torch.arange(len(kept))}
    state["t2d"] = torch.zeros(512, dtype=torch.bool).index_fill_(0, kept, True)
    pruned.load_state_dict(state)
    with torch.no_grad():
        loss, _ = ttt_loss(pruned, ids, aux, probs, 2)
        # by hand: only positions whose target argmax is in the draft vocabulary count
        manual = 0.0
        for k, (rows, head, _) in enumerate(ttt_forward(pruned, ids, aux, 2)):
            logits = pruned.lm_head(head)
            index = rows + 1 + k
            p = probs[:, index.clamp(max=ids.shape[1] - 1)]
            w = (index < ids.shape[1]) * state["t2d"][p.argmax(-1)]
            p = p[..., kept] / p[..., kept].sum(-1, keepdim=True)
            kl = (torch.special.xlogy(p, p) - p * F.log_softmax(logits, -1)).sum(-1)
            manual = manual + (kl * w).sum() / w.sum() / 2
    assert 0 < state["t2d"][probs.argmax(-1)].float().mean() < 1  # some positions are left out
    assert torch.allclose(loss, manual, rtol=1e-5)


def test_a_non_finite_step_is_skipped_and_logged(tmp_path):
    class PoisonedOnce(LiveTarget):
        def batch(self, indices, aux_layer_ids):
            ids, aux, probs, mask = super().batch(indices, aux_layer_ids)
            if self.calls == 1:  # (non-finite aux states are refused by the drafter itself, loudly)
                probs = probs.clone()
                probs[0, 3, 0] = float("nan")
            self.calls += 1
            return ids, aux, probs, mask

    states = PoisonedOnce(demo_target(), SEQUENCES)
    states.calls = 0
    drafter = to_finetune()
    config = TrainingConfig.finetune(steps=3, batch_size=2, seq_len=64, depth=2, lr=1e-3, save_every=100)
    train_on(states, drafter, tmp_path / "out", config, progress=False, stop_at=1)
    before = {n: p.detach().clone() for n, p in drafter.named_parameters()}
    train_on(states, drafter, tmp_path / "out", config, progress=False, stop_at=2)  # the poisoned step
    assert config.log[-1]["skipped"] == "non-finite loss or gradient"
    for name, p in drafter.named_parameters():
        assert torch.equal(p, before[name]), name  # nothing moved, no NaN reached the weights
    train_on(states, drafter, tmp_path / "out", config, progress=False)
    assert all(torch.isfinite(p).all() for p in drafter.parameters())


def test_finetune_recipe_bf16_compute_float32_master_and_bf16_export(tmp_path):
    target, drafter = demo_target(), to_finetune()
    assert drafter.dtype == torch.float32 and not drafter.embed_tokens.weight.requires_grad

    def recipe():
        return TrainingConfig.finetune(steps=4, batch_size=2, seq_len=64, depth=3, lr=1e-4, save_every=2)

    config = recipe()
    assert (config.betas, config.depth_decay, config.grad_clip, config.warmup) == ((0.9, 0.999), 0.8, 1.0, 1)
    trained = train_on(LiveTarget(target, SEQUENCES), drafter, tmp_path / "out", config, progress=False)
    assert all(p.dtype == torch.float32 for p in trained.parameters())
    export = tmp_path / "out"
    exported = Eagle31MLAForCausalLM.from_pretrained(export)
    assert exported.dtype == torch.bfloat16 and json.loads((export / "config.json").read_text())["dtype"] == "bfloat16"
    for (name, a), (_, b) in zip(exported.named_parameters(), trained.named_parameters()):
        assert torch.equal(a, b.to(torch.bfloat16)), name
    assert torch.equal(exported.embed_tokens.weight, target.get_input_embeddings().weight.to(torch.bfloat16))
    master = Eagle31MLAForCausalLM.from_pretrained(export / "checkpoint")
    assert master.dtype == torch.float32 and (export / "checkpoint" / "trainer_state.pt").is_file()
    # resuming from the float32 checkpoint gives the uninterrupted run's weights exactly
    train_on(LiveTarget(target, SEQUENCES), to_finetune(), tmp_path / "b", recipe(), progress=False, stop_at=2)
    resumed = train_on(LiveTarget(target, SEQUENCES), to_finetune(), tmp_path / "b", recipe(), progress=False)
    for (name, a), (_, b) in zip(resumed.named_parameters(), trained.named_parameters()):
        assert torch.equal(a, b), name


def test_train_init_fine_tunes_an_eagle3_drafter_with_the_bf16_recipe(tmp_path, capsys):
    """An EAGLE-3 drafter (fc_norm and norm_output off, as TorchSpec exports): the recipe's bf16 autocast hands
    each TTT step a bf16 state, which the drafter must take (it once refused it by dtype)."""
    from eagle31_mla.cli import main
    from eagle31_mla.testing import demo_corpus

    demo = Eagle31MLAForCausalLM.from_pretrained(DEMO_DIR / "draft", dtype=torch.float32)
    config = demo.config.__class__.from_dict({**demo.config.to_dict(), "fc_norm": False, "norm_output": False})
    eagle3 = Eagle31MLAForCausalLM(config)
    eagle3.load_state_dict({k: v for k, v in demo.state_dict().items() if not k.startswith("fc_norm.")})
    eagle3.save_pretrained(tmp_path / "eagle3")
    text = tmp_path / "corpus.txt"
    text.write_text("\n".join(demo_corpus(seed=5, n=8)[0]) + "\n")
    argv = ["train", "--target", str(DEMO_DIR / "target"), "--init", str(tmp_path / "eagle3"), "--text", str(text)]
    out = tmp_path / "tuned"
    assert main([*argv, "--out", str(out), "--steps", "2", "--batch-size", "2", "--device", "cpu", "--quiet"]) == 0
    recipe = json.loads((out / "training.json").read_text())
    assert (recipe["lr"], recipe["depth"], recipe["depth_decay"], recipe["export_dtype"]) == (2e-5, 7, 0.8, "bfloat16")
    tuned = Eagle31MLAForCausalLM.from_pretrained(out)
    assert torch.equal(tuned.embed_tokens.weight, target_embeddings(DEMO_DIR / "target")[0].to(torch.bfloat16))
    assert tuned.dtype == torch.bfloat16 and not tuned.config.norm_output and not tuned.config.fc_norm
    assert all(torch.isfinite(p).all() for p in tuned.parameters())


@pytest.mark.slow
def test_fine_tuning_the_demo_drafter_keeps_its_accept_length(tmp_path, capsys):
    """`train --init` on demo-style text the drafter was not trained on, then the held-out prompts."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from eagle31_mla.cli import main
    from eagle31_mla.decoding.speculative import measure_acceptance
    from eagle31_mla.demo import demo_prompts
    from eagle31_mla.testing import demo_corpus

    text = tmp_path / "corpus.txt"
    text.write_text("\n".join(demo_corpus(seed=77, n=300)[0]) + "\n")
    out = tmp_path / "tuned"
    argv = ["train", "--target", str(DEMO_DIR / "target"), "--init", str(DEMO_DIR / "draft"), "--text", str(text)]
    assert main([*argv, "--out", str(out), "--steps", "30", "--batch-size", "4", "--device", "cpu", "--quiet"]) == 0
    target = AutoModelForCausalLM.from_pretrained(DEMO_DIR / "target", dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(DEMO_DIR / "target")

    def accept_length(folder):
        drafter = Eagle31MLAForCausalLM.from_pretrained(folder, dtype=torch.float32)
        result = measure_acceptance(
            target, drafter, demo_prompts(8), num_steps=3, max_new_tokens=48, tokenizer=tokenizer, ignore_eos=True
        )
        return result["total"]["mean_accept_length"]

    before, after = accept_length(DEMO_DIR / "draft"), accept_length(out)
    assert after >= before - 0.05, (before, after)  # bf16 export rounding may move a token or two
