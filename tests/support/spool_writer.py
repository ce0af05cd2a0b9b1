"""Captures for the training tests, without an engine: the demo target's states from Transformers, written by the
library's ``write_shards`` (the loop ``eagle31-mla capture`` runs around vLLM: the same back-pressure, atomic
shards, manifest and resume); the helpers that damage them and compare what they train. As a process, the capture
side of the spool tests:

    python -m tests.support.spool_writer OUT [--spool-bytes N --part I/N] [--per-shard S] [--shard-delay SECONDS]

Without --spool-bytes, OUT is a stored capture folder; with it, OUT is a spool and this process its part I.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import time
from pathlib import Path

import torch

from eagle31_mla.training.captured import MANIFEST, CaptureManifest, inputs_digest, read_manifest, write_manifest
from eagle31_mla.training.spool import part_folder, part_sequences, plan_part, shard_bytes, write_shards

IDS = [1, 2, 4]  # 4 = the demo target's last layer: its output before the final norm
TOP_K = 64
DEMO = dict(name="demo", architectures=["DeepseekV3ForCausalLM"], num_hidden_layers=4, hidden_size=128, vocab_size=512)


@functools.cache
def demo_target():
    """The embedded demo target in Transformers, float32 (loaded once per process)."""
    from transformers import AutoModelForCausalLM

    from eagle31_mla.demo import DEMO_DIR

    return AutoModelForCausalLM.from_pretrained(DEMO_DIR / "target", dtype=torch.float32).eval()


def demo_sequences() -> list[list[int]]:
    """Teacher-forced sequences of the demo's kind of text, 24 tokens each (for the capture tests)."""
    from transformers import AutoTokenizer

    from eagle31_mla.demo import DEMO_DIR
    from eagle31_mla.testing import demo_corpus
    from eagle31_mla.training.trainer import tokenize_corpus

    texts, _ = demo_corpus(seed=11, n=20)
    return tokenize_corpus(AutoTokenizer.from_pretrained(DEMO_DIR / "target"), texts, 24).tolist()


def trained_weights(folder) -> dict[str, torch.Tensor]:
    from eagle31_mla import Eagle31MLAForCausalLM

    return dict(Eagle31MLAForCausalLM.from_pretrained(folder).named_parameters())


def assert_same_training(start, a, b, share: float = 0.01) -> None:
    """Two drafters (modules, or :func:`trained_weights`) trained from ``start`` by runs that differ only in float32
    rounding, which AdamW carries into the weights: the frozen tensors untouched, every trained one moved, and the
    two within ``share`` of that movement."""
    a, b = (dict(x.named_parameters()) if isinstance(x, torch.nn.Module) else x for x in (a, b))
    for name, s in start.named_parameters():
        x, y = a[name], b[name]
        if not s.requires_grad:
            assert torch.equal(x, y) and torch.equal(x, s), name
            continue
        moved = (x - s).abs().max()
        assert moved > 1e-3, name  # training moved it: the comparison is not of two untouched copies
        assert (x - y).abs().max() <= share * moved, (name, float((x - y).abs().max() / moved))


def edit_manifest(folder: Path, change) -> None:
    """``change(raw)`` on the manifest's JSON, written back."""
    raw = json.loads((folder / MANIFEST).read_text())
    change(raw)
    (folder / MANIFEST).write_text(json.dumps(raw))


def edit_tensors(shard: Path, change) -> None:
    """``change(tensors)`` on a shard's tensors, written back."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(shard)
    change(tensors)
    save_file(tensors, shard)


def input_sequences() -> list[list[int]]:
    """Twenty-one sequences of 10 to 24 tokens: the capture's input (every part reads all of it)."""
    generator = torch.Generator().manual_seed(3)
    lengths = torch.randint(10, 25, (21,), generator=generator).tolist()
    return [torch.randint(3, 500, (n,), generator=generator).tolist() for n in lengths]


def demo_states(sequences, *, top_k=TOP_K, dtype=torch.float32, layers=IDS, delay=0.0):
    """``write_shards``' run_target over ``sequences``: the demo target's states at ``layers``, its top-k
    log-probabilities (top_k 512: every one)."""
    from eagle31_mla.decoding.target import capture_target_states
    from eagle31_mla.model.aux_layers import AuxLayerIds

    def run(chunk: list[int]) -> list[tuple]:
        time.sleep(delay)
        items = []
        for i in chunk:
            seq = torch.tensor(sequences[i])
            aux, probs = capture_target_states(demo_target(), seq[None], AuxLayerIds(tuple(layers)))
            logprobs, ids = torch.log(probs[0]).topk(top_k, dim=-1)
            items.append((i, seq, aux[0].view(len(seq), len(layers), -1).to(dtype), logprobs, ids))
        return items

    return run


def capture_folder(folder: Path, sequences, *, top_k=512, per_shard=4, dtype=torch.float32, layers=IDS) -> Path:
    """What `eagle31-mla capture --out` writes, from the demo target; ``layers``: the layers really captured,
    labelled as IDS (a control: a capture one layer off)."""
    manifest = CaptureManifest(DEMO, IDS, str(dtype).removeprefix("torch."), top_k, "", 0, "transformers")
    run = functools.partial(demo_states, top_k=top_k, dtype=dtype, layers=layers)
    sequences = [list(map(int, s)) for s in sequences]
    return write_part(folder, sequences, run, manifest, per_shard=per_shard, say=lambda _: None)


def plan(lengths, manifest: CaptureManifest, max_bytes=10**9, **where):
    """plan_part for ``manifest``'s shapes; ``where``: part, parts, inputs, sequences_per_shard."""
    shape = len(manifest.aux_layer_ids), manifest.target["hidden_size"], getattr(torch, manifest.dtype), manifest.top_k
    where = dict(part=1, parts=1, inputs=len(lengths), sequences_per_shard=2) | where
    return plan_part(lengths, max_bytes, lambda tokens, count: shard_bytes(tokens, count, *shape), **where)


def write_part(out: Path, everything, run_target, manifest: CaptureManifest, spool_bytes=None, part=1, parts=1, **kw):
    """Part ``part`` of ``parts`` of ``everything`` into the spool ``out`` (``spool_bytes`` its cap), or all of it
    into the capture folder ``out``, as `eagle31-mla capture` does (resuming what is there). ``run_target(sequences)``
    gives ``write_shards``' run_target for this part's sequences. ``kw``: per_shard (2), limit (shards; None: all),
    say (print)."""
    per_shard, say = kw.get("per_shard", 2), kw.get("say", print)
    sequences = everything
    if spool_bytes:
        sequences = [everything[i] for i in part_sequences(len(everything), part, parts)]
        out = part_folder(out, part, parts)
    out.mkdir(parents=True, exist_ok=True)
    if (out / MANIFEST).is_file():
        manifest = read_manifest(out)  # resume
    else:  # as the capture does, before its engine starts
        manifest.num_inputs, manifest.inputs_sha256 = len(sequences), inputs_digest(sequences)
        if spool_bytes:
            where = dict(part=part, parts=parts, inputs=len(everything), sequences_per_shard=per_shard)
            manifest.spool = plan([len(s) for s in sequences], manifest, max_bytes=spool_bytes, **where)
        write_manifest(out, manifest)
    shards = write_shards(out, manifest, sequences, run_target(sequences), sequences_per_shard=per_shard, say=say)
    for count, tokens in itertools.islice(shards, kw.get("limit")):
        say(f"wrote {count} sequences ({tokens} tokens)")
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--spool-bytes", type=int)
    parser.add_argument("--part", default="1/1")
    parser.add_argument("--per-shard", type=int, default=2)
    parser.add_argument("--shard-delay", type=float, default=0.0, help="seconds per shard: a slower engine")
    args = parser.parse_args()
    part, parts = map(int, args.part.split("/"))
    write_part(
        Path(args.out),
        input_sequences(),
        functools.partial(demo_states, delay=args.shard_delay),
        CaptureManifest(DEMO, IDS, "float32", TOP_K, "", 0, "transformers"),
        spool_bytes=args.spool_bytes,
        part=part,
        parts=parts,
        per_shard=args.per_shard,
        say=lambda line: print(line, flush=True),
    )


if __name__ == "__main__":
    main()
