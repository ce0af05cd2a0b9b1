"""A capture process for the spool tests that needs no engine: the demo target's states from Transformers (as
tests/unit/test_captured.py's ``capture_folder`` makes them), written by the library's ``write_shards``, the
loop ``eagle31-mla capture`` runs around vLLM: the same back-pressure, atomic shards, manifest and resume.

    python -m tests.support.spool_writer OUT [--spool-bytes N --part I/N] [--per-shard S] [--shard-delay SECONDS]

Without --spool-bytes, OUT is a stored capture folder; with it, OUT is a spool and this process its part I.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from eagle31_mla.decoding.target import capture_target_states
from eagle31_mla.demo import DEMO_DIR
from eagle31_mla.model.aux_layers import AuxLayerIds
from eagle31_mla.training.captured import MANIFEST, CaptureManifest, inputs_digest, read_manifest, write_manifest
from eagle31_mla.training.spool import part_folder, part_sequences, plan_part, write_shards

IDS = AuxLayerIds((1, 2, 4))
TOP_K = 64
HIDDEN = 128


def input_sequences() -> list[list[int]]:
    """Twenty-one sequences of 10 to 24 tokens: the capture's input (every part reads all of it)."""
    generator = torch.Generator().manual_seed(3)
    lengths = torch.randint(10, 25, (21,), generator=generator).tolist()
    return [torch.randint(3, 500, (n,), generator=generator).tolist() for n in lengths]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--spool-bytes", type=int)
    parser.add_argument("--part", default="1/1")
    parser.add_argument("--per-shard", type=int, default=2)
    parser.add_argument("--shard-delay", type=float, default=0.0, help="seconds per shard: a slower engine")
    args = parser.parse_args()
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(DEMO_DIR / "target", dtype=torch.float32).eval()
    everything = input_sequences()
    part, parts = map(int, args.part.split("/"))
    out, spool = Path(args.out), None
    sequences = everything
    if args.spool_bytes:
        sequences = [everything[i] for i in part_sequences(len(everything), part, parts)]
        spool = plan_part(
            [len(s) for s in sequences],
            part=part,
            parts=parts,
            inputs=len(everything),
            max_bytes=args.spool_bytes,
            sequences_per_shard=args.per_shard,
            num_aux=len(IDS),
            hidden_size=HIDDEN,
            dtype=torch.float32,
            top_k=TOP_K,
        ).to_json()
        out = part_folder(out, part, parts)
    out.mkdir(parents=True, exist_ok=True)
    if (out / MANIFEST).is_file():
        manifest = read_manifest(out)  # resume
    else:
        manifest = CaptureManifest(
            target={
                "name": "demo",
                "architectures": ["DeepseekV3ForCausalLM"],
                "num_hidden_layers": 4,
                "hidden_size": HIDDEN,
                "vocab_size": 512,
            },
            aux_layer_ids=list(IDS.one_based),
            dtype="float32",
            top_k=TOP_K,
            inputs_sha256=inputs_digest(sequences),
            num_inputs=len(sequences),
            engine="transformers",
            spool=spool,
        )
        write_manifest(out, manifest)

    def run_target(chunk: list[int]) -> list[tuple]:
        time.sleep(args.shard_delay)
        items = []
        for i in chunk:
            seq = torch.tensor(sequences[i])
            aux, probs = capture_target_states(target, seq[None], IDS)
            logprobs, ids = torch.log(probs[0]).topk(TOP_K, dim=-1)
            items.append((i, seq, aux[0].view(len(seq), len(IDS), -1), logprobs, ids))
        return items

    for count, tokens in write_shards(out, manifest, sequences, run_target, sequences_per_shard=args.per_shard):
        print(f"wrote {count} sequences ({tokens} tokens)", flush=True)


if __name__ == "__main__":
    main()
