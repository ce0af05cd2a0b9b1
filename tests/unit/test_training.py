"""Test-time training: the unrolled recurrence is exactly what drafting does, and training works."""

import json

import pytest
import torch

from eagle31_mla.training import trainer
from eagle31_mla.training.trainer import (
    TrainingConfig,
    TTTAttention,
    drafter_for_target,
    train_drafter,
    ttt_forward,
    ttt_loss,
)
from tests.support.decoding import tiny_target
from tests.support.reference_math import DenseTTTAttention, SoftCrossEntropyByAutograd, diagonal_mask
from tests.support.tiny import TOL, aux_inputs, draft_step_by_step, tiny_drafter

pytestmark = pytest.mark.transformers


def test_diagonal_mask_literal():
    expected = torch.tensor(
        [
            [1, 0, 0, 1, 0, 0, 1, 0, 0],
            [1, 1, 0, 0, 1, 0, 0, 1, 0],
            [1, 1, 1, 0, 0, 1, 0, 0, 1],
        ],
        dtype=torch.bool,
    )
    assert torch.equal(diagonal_mask(3, 2, None, "cpu"), expected)
    anchored = torch.tensor([[1, 1, 0, 0, 1, 0], [1, 1, 1, 1, 0, 1]], dtype=torch.bool)  # anchors 1 and 3, S = 4
    assert torch.equal(diagonal_mask(4, 1, torch.tensor([1, 3]), "cpu")[:, :6], anchored)


@pytest.mark.parametrize("form", [dict(fc_norm=True, norm_output=True), dict(fc_norm=False, norm_output=False)])
def test_ttt_equals_teacher_forced_drafting(form):
    """Depth k at position t (dense, or at an anchor slot holding t) == drafting k steps after a context ending at t,
    fed the true tokens. Anchors shared by the batch, or each sequence its own with an empty slot (-1) among them;
    depth 0 included (TorchSpec's anchored loss)."""
    model = tiny_drafter(seed=4, **form)
    S, depth = 9, 4
    ids, aux = aux_inputs(model.config, 2, S)
    drafted = {
        (b, t): draft_step_by_step(model, ids[b : b + 1], aux[b : b + 1], t, depth)
        for b in (0, 1)
        for t in range(S - 1)
    }
    for anchors in (None, torch.tensor([1, 4, 6]), torch.tensor([[6, 1, -1], [2, 7, 5]])):
        with torch.no_grad():
            unrolled = [model.lm_head(head) for _, head, _ in ttt_forward(model, ids, aux, depth, anchors)]
        slots = (torch.arange(S - 1) if anchors is None else anchors).expand(2, -1)  # S - 1 predicts nothing
        for b, slot in (slots >= 0).nonzero().tolist():
            for k, logits in enumerate(drafted[b, int(slots[b, slot])]):
                assert (logits[0] - unrolled[k][b, slot]).abs().max() <= TOL, (anchors, b, slot, k)


#: on CUDA (scripts/gpu_check.sh runs the tests marked gpu): its SDPA kernels (memory-efficient in fp32) and cuBLAS
#: reduce in other orders than the CPU's, TF32 off: fp32 sums agree to about 1e-6 relative, gradients after a
#: backward through four depths to about 1e-5
ON_CUDA = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.parametrize("device, rtol", [("cpu", 1e-5), pytest.param("cuda", 1e-4, marks=ON_CUDA)])
@pytest.mark.parametrize("anchors", [None, torch.tensor([[6, 1, -1], [2, 7, 5]])], ids=["dense", "anchored"])
@pytest.mark.parametrize("blocks", ["checkpointed", "kept"])
def test_linear_memory_attention_equals_the_dense_mask(anchors, blocks, device, rtol, monkeypatch):
    """The TTT loss and every gradient through TTTAttention (causal SDPA at depth 0; deeper, blocks of rows with
    their own keys, by hand) and the loss a chunk of logits at a time (its gradient by hand) equal the dense
    [T, S + k·T] mask's with every logit at once and autograd's loss, fp32: within 1e-5 relative on CPU (the same
    sums, in another order; CUDA: see :data:`ON_CUDA`). Blocks of 2 query rows, recomputed in the backward pass or
    kept, and chunks of 3 loss rows (some across two sequences) force several of each."""
    model = tiny_drafter(seed=4).to(device)
    ids, aux = (t.to(device) for t in aux_inputs(model.config, 2, 9))
    probs = torch.softmax(torch.randn(2, 9, model.config.vocab_size, generator=torch.Generator().manual_seed(5)), -1)
    probs, anchors = probs.to(device), None if anchors is None else anchors.to(device)

    def loss_and_grads():
        model.zero_grad()
        loss, _ = ttt_loss(model, ids, aux, probs, 4, anchors=anchors)
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    monkeypatch.setattr(TTTAttention, "BLOCK_ROWS", 2)
    if blocks == "checkpointed":
        monkeypatch.setattr(TTTAttention, "CHUNK_SCORES", 2 * 2 * 2 * 13)  # batch 2 x 2 heads x 2 rows x 13 keys
    monkeypatch.setattr(trainer, "LOSS_CHUNK", 3 * model.config.vocab_size)  # logits of 3 rows at a time
    linear = loss_and_grads()
    monkeypatch.setattr(trainer, "TTTAttention", DenseTTTAttention)
    monkeypatch.setattr(trainer, "SoftCrossEntropy", SoftCrossEntropyByAutograd)
    monkeypatch.setattr(trainer, "LOSS_CHUNK", 2**30)  # every row's logits at once
    dense = loss_and_grads()
    assert torch.allclose(linear[0], dense[0], rtol=rtol, atol=0)
    assert linear[1].keys() == dense[1].keys() and len(dense[1]) > 10
    for name, grad in dense[1].items():
        assert torch.allclose(linear[1][name], grad, rtol=rtol, atol=rtol / 100), name


def test_under_bf16_autocast_the_blocks_give_the_dense_masks_gradients(monkeypatch):
    """bf16 compute (the fine-tuning recipe's autocast): the blocks' hand-made backward, in bf16, against the dense
    mask's and autograd's, within 3e-2 of each gradient's norm (bf16 keeps 8 bits: one rounding is 4e-3 relative,
    and a step adds up many; measured 0.3-1.7e-2). A part of the gradient left out would be off by its whole size."""
    model = tiny_drafter(seed=4)
    ids, aux = aux_inputs(model.config, 2, 9)
    probs = torch.softmax(torch.randn(2, 9, model.config.vocab_size, generator=torch.Generator().manual_seed(5)), -1)

    def grads():
        model.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss, _ = ttt_loss(model, ids, aux, probs, 4)
        loss.backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    monkeypatch.setattr(TTTAttention, "BLOCK_ROWS", 2)
    ours = grads()
    monkeypatch.setattr(trainer, "TTTAttention", DenseTTTAttention)
    monkeypatch.setattr(trainer, "SoftCrossEntropy", SoftCrossEntropyByAutograd)
    dense = grads()
    for name, grad in dense.items():
        assert (ours[name] - grad).norm() <= 3e-2 * grad.norm(), name


def test_the_loss_gradient_made_by_hand_is_autograds():
    """SoftCrossEntropy's value, agreement and gradient (made in the logits' buffer) against autograd of the same
    formula, with zero weights and a target that is a view of a larger tensor, fp32 within 1e-6 of each result's
    largest value (the same sums of 40 terms, in another order and thread split: measured 1.4e-7; an element near
    zero has no relative bound); under bf16 autocast its dot products stay fp32. Its backward runs once: a
    second (a retained graph) would read the overwritten buffer, so it is refused."""
    gen = torch.Generator().manual_seed(0)
    x, weight = torch.randn(6, 16, generator=gen), torch.randn(40, 16, generator=gen)
    probs = torch.softmax(3 * torch.randn(8, 40, generator=gen), -1)
    p, w = probs[1:7], torch.tensor([1.0, 0.0, 2.0, 1.0, 0.5, 1.0])
    top = (x @ weight.T).argmax(-1)
    top[3:] = (top[3:] + 1) % 40  # rows 0-2 agree (weights 1, 0, 2), 3-5 do not

    def run(loss_function):
        x_ = x.clone().requires_grad_()
        cross, agree = loss_function.apply(x_ @ weight.T, p, w, top)
        cross.backward()
        return cross.detach(), agree, x_.grad

    ours, oracle = run(trainer.SoftCrossEntropy), run(SoftCrossEntropyByAutograd)
    for a, b in zip(ours, oracle):
        assert (a - b).abs().max() <= 1e-6 * b.abs().max()
    assert ours[1] == 3 and ours[2][1].abs().max() == 0  # the weight-0 row has no gradient
    logits = x @ weight.T
    with torch.autocast("cpu", dtype=torch.bfloat16):
        cross, _ = trainer.SoftCrossEntropy.apply(logits, p, w, top)
    assert (cross - oracle[0]).abs() <= 1e-6 * oracle[0].abs()
    logits = (x @ weight.T).requires_grad_()
    cross, _ = trainer.SoftCrossEntropy.apply(logits * 1, p, w, top)
    cross.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="backward runs once"):
        cross.backward()


def new_drafter(target):
    torch.manual_seed(1)
    layer = dict(intermediate_size=64, num_attention_heads=2, q_lora_rank=16, kv_lora_rank=16, v_head_dim=8)
    layer |= dict(qk_nope_head_dim=8, qk_rope_head_dim=8, max_position_embeddings=128)
    rope = {"rope_type": "default"}
    return drafter_for_target(target, eagle_aux_hidden_state_layer_ids=[1, 2, 3], rope_parameters=rope, **layer)


def test_training_lowers_the_loss_and_resumes_exactly(tmp_path):
    target = tiny_target()
    sequences = torch.randint(3, 64, (32, 24), generator=torch.Generator().manual_seed(0))
    config = dict(steps=8, batch_size=8, seq_len=24, depth=3, lr=1e-2, warmup=2, save_every=100)

    def run(out, training, **kw):
        return train_drafter(target, new_drafter(target), sequences, tmp_path / out, training, progress=False, **kw)

    straight = run("a", TrainingConfig(**config))
    run("b", TrainingConfig(**config), stop_at=3)
    log = TrainingConfig(**config)  # a new process would pick up here: new objects, the same folder
    resumed = run("b", log)
    for (name, a), b in zip(straight.state_dict().items(), resumed.state_dict().values()):
        assert torch.equal(a, b), name  # bit for bit
    assert [e["step"] for e in log.log] == list(range(1, 9))

    long = TrainingConfig(**{**config, "steps": 40, "save_every": 40})
    run("c", long)
    first, last = long.log[0], long.log[-1]
    assert last["loss"] < 0.8 * first["loss"], (first, last)
    assert last["acc"][0] > first["acc"][0]


def test_train_command_end_to_end_and_resumes(tmp_path, capsys, caplog):
    """`eagle31-mla train` on the embedded demo target, on conversations (the loss on the last assistant turn)
    with anchors: the published layout, aux ids by default from the 4-layer target's depth (not Kimi-K3's
    [2, 46, 90]), EAGLE-3 when asked, the recipe recorded, and a second run with more steps (the ids now given)
    resumes. (`train --text`: tests/unit/test_finetune.py.)"""
    from safetensors import safe_open

    from eagle31_mla import Eagle31MLAForCausalLM
    from eagle31_mla.cli import main
    from eagle31_mla.demo import DEMO_DIR

    chats = tmp_path / "chats.jsonl"
    for animal in ("cat", "dog", "bird", "fish"):
        turns = [{"role": "user", "content": f"tell me about the {animal}"}]
        turns += [{"role": "assistant", "content": f"the {animal} sat on the mat and looked at the {animal} next door"}]
        with chats.open("a") as f:
            f.write(json.dumps({"messages": turns}) + "\n")
    common = ["train", "--target", str(DEMO_DIR / "target"), "--conversations", str(chats), "--last-turn-only"]
    common += ["--out", str(tmp_path / "d"), "--batch-size", "2", "--seq-len", "40", "--depth", "2", "--anchors", "4"]
    common += ["--anchor-max-gap", "1", "--quiet", "--device", "cpu", "--eagle3"]
    common += ["--draft-config", str(DEMO_DIR / "draft")]  # the demo drafter's layer (2 heads ...): a small checkpoint
    assert main([*common, "--steps", "2"]) == 0
    assert "EAGLE-3, aux layers" in capsys.readouterr().out
    first = json.loads((tmp_path / "d" / "training.json").read_text())
    assert (first["steps"], first["num_anchors"], first["anchor_max_gap"]) == (2, 4, 1)
    caplog.set_level("INFO", logger="eagle31_mla.training.trainer")
    assert main([*common, "--steps", "3", "--aux-layers", "1,2,3"]) == 0
    assert "resuming from step 2" in caplog.text
    drafter = Eagle31MLAForCausalLM.from_pretrained(tmp_path / "d")
    assert drafter.config.aux_layer_ids.one_based == (1, 2, 3)
    assert not drafter.config.fc_norm and not drafter.config.norm_output
    layer = json.loads((DEMO_DIR / "draft" / "config.json").read_text())
    for key in ("num_attention_heads", "q_lora_rank", "qk_nope_head_dim", "v_head_dim", "intermediate_size"):
        assert getattr(drafter.config, key) == layer[key], key  # --draft-config's layer
    assert drafter.config.hidden_size == 128 and drafter.config.rope_parameters == layer["rope_parameters"]
    state = torch.load(tmp_path / "d" / "trainer_state.pt", weights_only=True)
    assert state["step"] == 3 and [e["step"] for e in json.loads(state["log"])] == [1, 2, 3]
    with safe_open(tmp_path / "d" / "model.safetensors", "pt") as f:  # the published tensor names
        names = set(f.keys())
    assert "layers.0.self_attn.kv_a_proj_with_mqa.weight" in names
    assert not any(n.startswith(("midlayer.", "model.", "fc_norm.")) for n in names)  # EAGLE-3: no fc_norm


@pytest.fixture(scope="module")
def capture(tmp_path_factory):
    from tests.support.spool_writer import capture_folder

    sequences = torch.randint(3, 500, (2, 24), generator=torch.Generator().manual_seed(0))
    return capture_folder(tmp_path_factory.mktemp("capture") / "c", sequences, top_k=16)


TRAIN = ["train", "--target", "{target}", "--out", "{tmp}/o"]
CAPTURE = ["capture", "--target", "{target}", "--text", "{text}"]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["train", "--target", "{draft}", "--text", "{text}", "--out", "{tmp}/o"], "argument --target: "),
        (["train", "--target", "{tmp}/missing-target", "--text", "{text}", "--out", "{tmp}/o"], "missing-target"),
        ([*TRAIN, "--text", "{tmp}/corpus.jsonl"], "corpus.jsonl:2"),
        ([*TRAIN, "--text", "{text}", "--last-turn-only"], "argument --last-turn-only: applies to --conversations"),
        ([*TRAIN, "--text", "{text}", "--anchor-max-gap", "2"], "argument --anchor-max-gap: applies to --anchors"),
        ([*TRAIN, "--conversations", "{tmp}/bad.jsonl"], "argument --conversations: {tmp}/bad.jsonl:1: no assistant"),
        ([*TRAIN, "--text", "{text}", "--follow"], "argument --follow: applies to --data only"),
        ([*TRAIN, "--data", "{tmp}/spool"], "holds no manifest.json; a spool is read with --follow"),
        ([*TRAIN, "--data", "{tmp}/spool", "--epochs", "2"], "argument --epochs: applies to --follow"),
        ([*TRAIN, "--data", "{tmp}/spool", "--follow", "--steps", "3"], "argument --steps: with --follow"),
        (
            [*TRAIN, "--data", "{capture}", "--aux-layers", "2,3,4"],
            "argument --aux-layers: the capture holds aux layers [1, 2, 4] (one-based), not [2, 3, 4]",
        ),
        (
            ["train", "--target", "{tmp}/other", "--data", "{capture}", "--out", "{tmp}/o"],
            "argument --data: captured from a target with (layers, hidden size, vocabulary) (4, 128, 512)",
        ),
        ([*CAPTURE, "--spool", "{tmp}/o"], "argument --max-spool-gb: expected the spool's cap"),
        ([*CAPTURE, "--out", "{tmp}/o", "--part", "1/2"], "argument --part: applies to --spool"),
        ([*CAPTURE, "--out", "{tmp}/o", "--max-spool-gb", "1"], "argument --max-spool-gb: applies to --spool only"),
        ([*CAPTURE, "--spool", "{tmp}/o", "--part", "3/2", "--max-spool-gb", "1"], "argument --part: expected I/N"),
    ],
)
def test_train_and_capture_refuse_bad_input_in_one_line_before_loading(tmp_path, capsys, capture, argv, message):
    from eagle31_mla.cli import main
    from eagle31_mla.demo import DEMO_DIR

    (tmp_path / "corpus.txt").write_text("Ann has red apples.\n" * 50)
    (tmp_path / "corpus.jsonl").write_text('{"text": "fine"}\n{"text": 5}\n')
    (tmp_path / "bad.jsonl").write_text('{"messages": [{"role": "user", "content": "x"}]}\n')
    (tmp_path / "spool").mkdir()  # an empty spool: the capture has not started
    (tmp_path / "other").mkdir()  # a target of another hidden size than the capture's
    config = json.loads((DEMO_DIR / "target" / "config.json").read_text())
    (tmp_path / "other" / "config.json").write_text(json.dumps({**config, "hidden_size": 256}))
    names = dict(target=DEMO_DIR / "target", draft=DEMO_DIR / "draft", text=tmp_path / "corpus.txt", tmp=tmp_path)
    names["capture"] = capture
    assert main([a.format(**names) for a in argv]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message.format(**names) in err and "Loading" not in err, err
    assert not (tmp_path / "o").exists()  # nothing written


def test_default_aux_ids_follow_the_target_depth():
    from eagle31_mla.training.trainer import default_aux_layer_ids

    assert default_aux_layer_ids(93) == [2, 46, 90] and default_aux_layer_ids(61) == [2, 30, 58]
    assert default_aux_layer_ids(4) == [1, 2, 3] and default_aux_layer_ids(2) == [1, 2]
    for depth in range(1, 100):
        ids = default_aux_layer_ids(depth)
        assert ids == sorted(set(ids)) and 1 <= ids[0] and ids[-1] <= depth
