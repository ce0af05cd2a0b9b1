"""Tiny offline models and probes for running the real vLLM engine (CPU build) in tests.

The target is a 6-layer DeepSeek-V3 (MLA + MoE) with kv_lora 512 + rope 64, the only MLA head size
vLLM's CPU kernels accept; the drafters are this library's model at the same MLA dims, saved in the
config forms users meet. Engines run in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0) so a test can
watch the drafter class directly.
"""

from __future__ import annotations

import functools
import os
import random
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from eagle31_mla import Eagle31MLAForCausalLM
from tests.support.tiny import YARN, published_style_config, tiny_drafter, write_checkpoint

VOCAB, HIDDEN, TARGET_LAYERS = 512, 128, 6
AUX_ONE_BASED = [2, 3, 5]  # < TARGET_LAYERS: HF's hidden_states[6] is post-final-norm, vLLM's is not
PROMPTS = ["The quick brown fox jumps over the lazy dog", "Hello world, this is a tiny", "over the lazy"]
CPU_MLA = "CPU_MLA"  # AMX CPUs would pick AMX_MLA, which refuses fp32 weights; the drafter does not inherit it
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def build_tokenizer(folder: Path):
    from eagle31_mla.testing import train_byte_level_bpe

    texts = ["The quick brown fox jumps over the lazy dog."] * 20 + ["Hello world, this is a tiny tokenizer."] * 20
    return train_byte_level_bpe(texts, 400, folder)


def build_target(folder: Path, *, seed: int = 0, zero_lm_head: bool = False) -> Path:
    """A tiny DeepSeek-V3 target, saved with per-expert MoE tensors (what vLLM's loader reads).

    Safe after an engine has run in the process: vLLM, when it reads a ``kimi_k2`` config (the published
    draft's model_type), sets ``DeepseekV3Config.model_type = "kimi_k2"`` on the class itself
    (``vllm/transformers_utils/config.py``, ``_register_config_class``); Transformers then finds no
    checkpoint conversion for the model and saves the experts fused (``experts.down_proj``), which vLLM
    cannot load. The class attribute is restored for the build."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    from eagle31_mla.testing import cpu_servable_target_config

    changed_by_vllm = DeepseekV3Config.model_type
    DeepseekV3Config.model_type = "deepseek_v3"
    try:
        tok = build_tokenizer(folder)
        config = cpu_servable_target_config(
            tok, vocab_size=VOCAB, hidden_size=HIDDEN, num_layers=TARGET_LAYERS, dense_layers=1, intermediate_size=256
        )
        torch.manual_seed(seed)
        model = DeepseekV3ForCausalLM(config).eval()
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("e_score_correction_bias"):
                    p.normal_(0, 0.01)
            if zero_lm_head:
                model.lm_head.weight.zero_()
        model.save_pretrained(folder)
    finally:
        DeepseekV3Config.model_type = changed_by_vllm
    return folder


def draft_model(seed: int = 2, *, rope=None, zero_lm_head: bool = False, **overrides) -> Eagle31MLAForCausalLM:
    kwargs = dict(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        target_hidden_size=HIDDEN,
        intermediate_size=256,
        num_attention_heads=2,
        q_lora_rank=64,
        kv_lora_rank=512,
        qk_nope_head_dim=32,
        qk_rope_head_dim=64,
        v_head_dim=32,
        max_position_embeddings=512,
        eagle_aux_hidden_state_layer_ids=AUX_ONE_BASED,
        rope_parameters=dict(rope or dict(YARN, original_max_position_embeddings=256)),
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=2,
    )
    model = tiny_drafter(seed, **{**kwargs, **overrides})
    if zero_lm_head:
        with torch.no_grad():
            model.lm_head.weight.zero_()
    return model


def early_exit_draft(target: Path, seed: int = 2) -> Eagle31MLAForCausalLM:
    """A drafter that agrees with the target part of the time: the target's early-exit guess from the deepest
    captured state (after layer 5 of 6) through its own final norm and ``lm_head`` (attention and MLP zeroed).
    The tiny target's greedy output often repeats a token, and those drafts are accepted."""
    from safetensors.torch import load_file

    weights = load_file(Path(target) / "model.safetensors")
    model = draft_model(seed)
    with torch.no_grad():
        model.fc.weight.zero_()
        model.fc.weight[:, -HIDDEN:] = torch.eye(HIDDEN)  # the last aux chunk: hidden_states[AUX_ONE_BASED[-1]]
        for norm in model.fc_norm:
            norm.weight.fill_(1.0)
        model.layers[0].self_attn.o_proj.weight.zero_()
        model.layers[0].mlp.down_proj.weight.zero_()
        model.norm.weight.copy_(weights["model.norm.weight"])
        model.lm_head.weight.copy_(weights["lm_head.weight"])
    return model


def write_draft(folder: Path, model: Eagle31MLAForCausalLM, form: str) -> Path:
    """The config forms a draft folder comes in:
    published   kimi_k2, rope_scaling, nested one-based ids (the released checkpoint's layout)
    training    the same with the training framework's nested zero-based ids
    top_level   only a top-level one-based id list (vLLM's own key)
    exported    written by this library's save_pretrained (labelled, both places)
    nemo        published config, NeMo's `model.` prefix on the tensors
    """
    if form == "exported":
        model.save_pretrained(folder)
        return folder
    config = published_style_config(model, ids_form="published" if form == "nemo" else form)
    config["bos_token_id"], config["eos_token_id"], config["pad_token_id"] = 0, 1, 2
    tensors = dict(model.state_dict())
    if form == "nemo":
        tensors = {(k if k.startswith("lm_head") else "model." + k): v for k, v in tensors.items()}
    return write_checkpoint(folder, config, tensors)


def engine_args(target: Path, draft: Path | None = None, k: int = 3, **kwargs) -> dict:
    """The arguments of an ``LLM`` (and of ``EngineArgs``) serving ``target``, with ``draft`` as EAGLE-3 drafter."""
    args = dict(
        model=str(target),
        dtype="float32",
        max_model_len=256,
        max_num_seqs=4,
        enforce_eager=True,
        seed=0,
        disable_log_stats=False,
        attention_backend=CPU_MLA,
    )
    if draft is not None:
        args["speculative_config"] = {
            "method": "eagle3",
            "model": str(draft),
            "num_speculative_tokens": k,
            "attention_backend": CPU_MLA,
        }
    return args | kwargs


def make_llm(target: Path, draft: Path | None = None, k: int = 3, **kwargs):
    from vllm import LLM

    return LLM(**engine_args(target, draft, k, **kwargs))


def greedy(llm, prompts=PROMPTS, max_tokens: int = 12) -> list[list[int]]:
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return [list(out.outputs[0].token_ids) for out in llm.generate(prompts, params, use_tqdm=False)]


def spec_metrics(llm) -> dict:
    return {
        m.name.removeprefix("vllm:spec_decode_"): list(m.values) if hasattr(m, "values") else m.value
        for m in llm.get_metrics()
        if m.name.startswith("vllm:spec_decode")
    }


def acceptance_report(metrics: dict) -> dict:
    """Accept length as engines report it (tokens per verification step, bonus included) and the
    per-position acceptance rate."""
    drafts = metrics["num_drafts"]
    per_pos = metrics["num_accepted_tokens_per_pos"]
    return {
        "drafts": drafts,
        "accept_length": 1 + metrics["num_accepted_tokens"] / drafts if drafts else float("nan"),
        "per_position_rate": [n / drafts for n in per_pos] if drafts else [],
    }


@functools.lru_cache(maxsize=8)
def hf_model(target: Path):
    """The target in Transformers, fp32, loaded once per folder (the tests compare many prompts)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()


def hf_hidden_states(target: Path, token_ids: list[int]):
    model = hf_model(target)
    with torch.no_grad():
        out = model(torch.tensor([token_ids]), output_hidden_states=True)
    return [h[0] for h in out.hidden_states]


def hf_greedy(target: Path, token_ids: list[int], n: int) -> list[int]:
    """Plain argmax loop (HF `generate` would suppress EOS, which vLLM's ignore_eos does not)."""
    model = hf_model(target)
    ids = list(token_ids)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(token_ids) :]


# ---- the engine under load ------------------------------------------------------------------------


@dataclass(frozen=True)
class LoadRequest:
    """One request of a concurrent load: greedy or sampled (seeded, top-p 0.95), maybe aborted once it has
    ``abort_after`` output tokens; each runs to ``max_tokens`` or the context limit (ignore_eos)."""

    id: str
    prompt_ids: tuple[int, ...]
    max_tokens: int
    temperature: float = 0.0
    seed: int | None = None
    abort_after: int | None = None
    kind: str = "greedy"  # greedy | sampled | aborted | context-limit | over-long


def mixed_load(n: int, *, max_model_len: int, seed: int = 0) -> list[LoadRequest]:
    """``n`` requests of mixed prompt lengths (3-160 tokens): mostly greedy, every 3rd sampled at
    temperature 0.8 (seeded), every 8th aborted midway (greedy or sampled), one whose prompt plus
    max_tokens runs past ``max_model_len`` (vLLM caps it there), one whose prompt alone is too long
    (vLLM refuses it when it is added)."""
    rng = random.Random(seed)
    out = []
    for i in range(n - 2):
        length = rng.choice([rng.randint(3, 12), rng.randint(20, 60), rng.randint(80, 160)])
        prompt = tuple(rng.randrange(3, VOCAB) for _ in range(length))  # 0-2 are bos/eos/pad
        sampled = i % 3 == 2
        aborted = i % 8 == 5
        out.append(
            LoadRequest(
                id=f"r{i:02d}",
                prompt_ids=prompt,
                max_tokens=rng.randint(12, 32),
                temperature=0.8 if sampled else 0.0,
                seed=1000 + i if sampled else None,
                abort_after=rng.randint(2, 8) if aborted else None,
                kind="aborted" if aborted else ("sampled" if sampled else "greedy"),
            )
        )
    edge = tuple(rng.randrange(3, VOCAB) for _ in range(max_model_len - 5))
    out.append(LoadRequest(id="context-limit", prompt_ids=edge, max_tokens=32, kind="context-limit"))
    out.append(LoadRequest(id="over-long", prompt_ids=edge + edge[:10], max_tokens=8, kind="over-long"))
    return out


@dataclass
class LoadRun:
    tokens: dict[str, list[int]]  # request id -> output tokens (for an aborted request: those before the abort)
    finish: dict[str, str]  # request id -> finish reason, "aborted", or "refused: <error>"
    wall_s: float
    steps: int


def run_load(llm, requests: list[LoadRequest], *, aborts: bool = True, max_steps: int = 5000) -> LoadRun:
    """Add every request at once to ``llm``'s engine, then step it until all are done, aborting
    requests as they reach ``abort_after`` tokens (the offline ``LLM.generate`` cannot abort)."""
    from vllm import SamplingParams

    engine = llm.llm_engine
    tokens, finish = {}, {}
    start = time.perf_counter()
    for r in requests:
        sampling = dict(temperature=r.temperature, seed=r.seed, top_p=0.95 if r.temperature else 1.0)
        params = SamplingParams(max_tokens=r.max_tokens, ignore_eos=True, **sampling)
        try:
            engine.add_request(r.id, {"prompt_token_ids": list(r.prompt_ids)}, params)
        except Exception as err:  # noqa: BLE001 - vLLM's validation errors are the expected outcome here
            finish[r.id] = f"refused: {type(err).__name__}: {err}"
        else:
            tokens[r.id] = []
    pending_aborts = {r.id: r.abort_after for r in requests if aborts and r.abort_after and r.id in tokens}
    steps = 0
    while engine.has_unfinished_requests():
        steps += 1
        if steps > max_steps:
            raise TimeoutError(f"engine still busy after {max_steps} steps: {sorted(set(tokens) - set(finish))}")
        for out in engine.step():
            tokens[out.request_id] = list(out.outputs[0].token_ids)
            if out.finished:
                finish[out.request_id] = out.outputs[0].finish_reason
        for rid, after in list(pending_aborts.items()):
            if rid not in finish and len(tokens[rid]) >= after:
                engine.abort_request([rid])
                finish[rid] = "aborted"
                del pending_aborts[rid]
    return LoadRun(tokens, finish, time.perf_counter() - start, steps)
