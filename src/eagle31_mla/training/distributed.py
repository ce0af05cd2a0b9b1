"""Data-parallel drafter training with FSDP2 under ``torchrun``, from a capture folder.

    torchrun --nproc-per-node 8 -m eagle31_mla.train --target T --data DIR --out OUT [train options]

:func:`eagle31_mla.training.trainer.train_on`'s objective, the drafter sharded by ``fully_shard``: N ranks train the
drafter one rank trains (docs/training.md). Checkpoints (``torch.distributed.checkpoint``) are one folder per step,
named by a ``latest`` file replaced once every rank has written: a rank killed mid-save leaves the previous one named.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
from dataclasses import asdict
from pathlib import Path

import torch
import torch.distributed as dist

from ..locations import atomic_write
from ..model.modeling_eagle31_mla import Eagle31MLAForCausalLM
from .trainer import (
    CapturedTarget,
    TrainingConfig,
    _apply_step,
    _compute,
    _optimizer,
    clip_gradients,
    combine_depth_losses,
    export_drafter,
    loss_weight_sums,
    step_anchors,
    ttt_loss_terms,
)

logger = logging.getLogger(__name__)

LATEST = "latest"  # names the last complete checkpoint folder in OUT/checkpoint
STEP_FOLDER = "step-{:08d}"
#: Test-only: "RANK:STEP" makes that rank exit at once (as a kill would) when it reaches that step.
KILL_ENV = "EAGLE31_TEST_KILL_RANK_AT_STEP"


def launched_by_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ and "LOCAL_RANK" in os.environ


def _state(drafter, optimizer):
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    return {"model": get_model_state_dict(drafter), "optim": get_optimizer_state_dict(drafter, optimizer)}


def _save(work_dir: Path, step: int, drafter, optimizer, schedule, config: TrainingConfig, rank: int) -> None:
    import torch.distributed.checkpoint as dcp

    folder = work_dir / STEP_FOLDER.format(step)
    if rank == 0 and folder.exists():
        shutil.rmtree(folder)  # a partial save of this very step from a killed run: ours, never named
    dist.barrier()
    dcp.save(_state(drafter, optimizer), checkpoint_id=str(folder))
    if rank == 0:
        trainer = {"step": step, "schedule": schedule.state_dict(), "log": config.log}
        (folder / "trainer.json").write_text(json.dumps(trainer))
    dist.barrier()  # every rank has written its shards
    if rank == 0:
        atomic_write(work_dir / LATEST, lambda tmp: Path(tmp).write_text(folder.name))
        for old in work_dir.glob("step-*"):
            if old.name != folder.name and old.is_dir():
                shutil.rmtree(old)
    dist.barrier()


def train_distributed(
    states: CapturedTarget,
    drafter: Eagle31MLAForCausalLM,
    out_dir: str | Path,
    config: TrainingConfig,
    *,
    micro_batch: int | None = None,
    progress: bool = True,
) -> None:
    """Train ``drafter`` on ``states`` on every rank of the torchrun job; rank 0 exports to ``out_dir``."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from tqdm.auto import tqdm

    cuda = torch.cuda.is_available()
    if not dist.is_initialized():
        dist.init_process_group(backend="nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    if config.batch_size % world:
        raise ValueError(f"--batch-size {config.batch_size} must be a multiple of the number of ranks ({world})")
    micro_batch = micro_batch or config.batch_size // world
    out_dir = Path(out_dir)
    work_dir = out_dir / "checkpoint"
    if rank == 0:
        work_dir.mkdir(parents=True, exist_ok=True)
    states.device = device
    drafter.to(device)
    mesh = init_device_mesh(device.type, (world,))
    policy = MixedPrecisionPolicy()
    if config.compute_dtype == "bfloat16" and device.type == "cuda":
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    # the decoder layer and fc (the bulk); lm_head and the final norm, which the loss also calls outside the
    # drafter's forward (a chunk of logits at a time); then the rest
    for module in (drafter.layers[0], drafter.fc, drafter.lm_head, drafter.norm, drafter):
        fully_shard(module, mesh=mesh, mp_policy=policy)
    params = [p for p in drafter.parameters() if p.requires_grad]
    optimizer, schedule = _optimizer(params, config)
    dist.barrier()
    start = 0
    if (work_dir / LATEST).is_file():
        folder = work_dir / (work_dir / LATEST).read_text().strip()
        state = _state(drafter, optimizer)
        dcp.load(state, checkpoint_id=str(folder))
        set_model_state_dict(drafter, state["model"])
        set_optimizer_state_dict(drafter, optimizer, state["optim"])
        trainer = json.loads((folder / "trainer.json").read_text())
        schedule.load_state_dict(trainer["schedule"])
        start, config.log = trainer["step"], trainer["log"]
        logger.info("resuming from step %d in %s", start, folder)
        states.checkpointed(start, config, remove=rank == 0)  # what a run killed after its checkpoint left
    kill = os.environ.get(KILL_ENV)
    drafter.train()
    bar = tqdm(range(start, config.steps), desc="train drafter", disable=not progress or rank, initial=start)
    for step in bar:
        if kill == f"{rank}:{step}":
            os._exit(1)  # test-only: this rank dies as a killed process does
        stalled = torch.tensor([float(states.stalled(step, config))], device=device)
        dist.all_reduce(stalled, op=dist.ReduceOp.MAX)  # every rank checkpoints if one waits on a full spool
        if stalled.item():
            _save(work_dir, step, drafter, optimizer, schedule, config, rank)
            states.checkpointed(step, config, remove=rank == 0)
        indices = states.step_indices(step, config)
        pad_to = max(states.data.length(int(i)) for i in indices)  # every rank pads to the step's longest sequence
        mine = indices[rank::world]
        # a stream's last step may leave a rank no sequence: it runs one with no loss (FSDP's collectives need it)
        idle = len(mine) == 0
        mine = indices[:1] if idle else mine
        chunks = [mine[i : i + micro_batch] for i in range(0, len(mine), micro_batch)]
        batches = [states.batch(chunk, drafter.config.aux_layer_ids, pad_to=pad_to) for chunk in chunks]
        if idle:
            batches = [(ids, aux, probs, torch.zeros_like(mask)) for ids, aux, probs, mask in batches]
        anchors = [step_anchors(drafter, b[2], b[3], config, step, chunk) for b, chunk in zip(batches, chunks)]
        # the whole step's loss weights per depth (every micro-batch of every rank), known before any forward
        totals = sum(
            loss_weight_sums(drafter, probs, config.depth, mask, a) for (_, _, probs, mask), a in zip(batches, anchors)
        )
        dist.all_reduce(totals)
        loss_total, agree = 0.0, torch.zeros(config.depth, device=device)
        for n, (ids, aux, probs, mask) in enumerate(batches):
            drafter.set_requires_gradient_sync(n == len(batches) - 1)  # reduce the gradients once, at the end
            with _compute(config.compute_dtype, device):
                terms = ttt_loss_terms(drafter, ids, aux, probs, config.depth, mask, anchors[n])
            # this micro-batch's share of the step loss: its KL sums over the step's weight sums
            loss, _ = combine_depth_losses(
                [(kl, total, a) for (kl, _, a), total in zip(terms, totals)], config.depth_decay
            )
            (loss * world).backward()  # FSDP averages gradients over the ranks: the sum is wanted
            loss_total += float(loss.detach())
            agree += torch.stack([a for _, _, a in terms])
        norm = clip_gradients(params, config.grad_clip, reduce=dist.all_reduce)
        reduced = torch.tensor([loss_total], device=device)
        dist.all_reduce(reduced)
        dist.all_reduce(agree)
        accuracy = [float(a / w.clamp_min(1)) for a, w in zip(agree, totals)]
        _apply_step(optimizer, schedule, config, step, float(reduced), accuracy, norm)
        if (step + 1) % config.save_every == 0 or step + 1 == config.steps:
            _save(work_dir, step + 1, drafter, optimizer, schedule, config, rank)
            states.checkpointed(step + 1, config, remove=rank == 0)
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    full = get_model_state_dict(drafter, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0:
        template = Eagle31MLAForCausalLM(drafter.config)  # the unsharded model the gathered weights fill
        template.load_state_dict(full)
        export_drafter(template, out_dir, getattr(torch, config.export_dtype or "float32"), config)
        (out_dir / "training_log.json").write_text(json.dumps({"world_size": world, **asdict(config)}, indent=1))
    # every rank tears its connections down once all are done: a rank that left while another still held the
    # group open aborted at exit, once, in gloo's teardown ("terminate called without an active exception")
    dist.barrier()
    with contextlib.suppress(Exception):
        dist.destroy_process_group()
