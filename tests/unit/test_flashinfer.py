"""The GPU path through FlashInfer (eagle31_mla.model.flashinfer_backend): its dispatch and errors, and exactly what it
hands FlashInfer, on CPU; the kernels themselves on a GPU (tests marked ``gpu``).

CPU (always): asking for FlashInfer without CUDA or without the package is an error naming what is missing and
the install command, from ``from_pretrained``, ``draft``, ``speculative_generate`` and the CLI, never a silent
fallback. The decode glue runs against a stand-in of FlashInfer 0.7.2.post1's planned-MLA API
(``BatchMLAPagedAttentionWrapper.plan(metadata=MLAPlanMetadata.csr(...), ...)`` / ``run(query=, kv_cache=)``,
keyword-only here, so a misspelt keyword fails) that checks the metadata rules FlashInfer's planner states
(int32, rank 1, contiguous; pages per request = ceil(kv_len / page_size)) and computes the attention in plain
torch from exactly the arguments it receives: the drafter's decode through it must equal the torch absorbed path,
and the query, cache views, lengths, index pointers and softmax scale it receives are checked one by one. The
sampling stand-in (``top_p_renorm_probs``, ``sampling_from_probs``, ``chain_speculative_sampling`` with
FlashInfer's output format) only tests shapes and wiring: it samples with torch.

GPU (``gpu``; skipped here with the reason, a failure under EAGLE31_REQUIRE_GPU=1): FlashInfer's decode equals the
torch absorbed path (bf16 within 2e-2 relative; FlashInfer's MLA kernels have no fp32 variant, so fp32 is checked
to be refused) at contexts 1, 4096 and 32768, batch 1 and 8, plain RoPE and YaRN, and reads no cache slot past the
length (a NaN tail); FlashInfer's sampling passes the chi-square losslessness tests of
tests/unit/test_speculative.py (its helper and its p / q; 1e5 draws, broken wirings rejected). Every gpu test also
runs its Python on CPU against the stand-ins when "cuda" is replaced by "cpu" (done once while writing them).
Not yet run on a GPU: no GPU was lent to the sessions that wrote this (README, "GPU path").
"""

from __future__ import annotations

import math
import sys
import types

import pytest
import torch
import transformers

import eagle31_mla.model.flashinfer_backend as fb
import eagle31_mla.model.modeling_eagle31_mla as modeling
from eagle31_mla import Eagle31MLAForCausalLM, LatentKVCache
from eagle31_mla.cli import main
from eagle31_mla.decoding.speculative import accept_chain, speculative_generate
from eagle31_mla.demo import DEMO_DIR
from eagle31_mla.model.modeling_eagle31_mla import DraftInputError, sample_from_logits, sampling_probs
from tests.support.paths import ROOT
from tests.support.tiny import PLAIN_ROPE, YARN, aux_inputs, published_style_config, tiny_drafter, write_checkpoint
from tests.unit.test_speculative import (  # the chi-square helper and the p / q of one small-vocabulary round
    SAMPLES,
    chi_square_p_value,
    drafter as tiny_pair_drafter,
    prompt,
    small_vocab_round,  # noqa: F401 - a fixture, used by the gpu tests
    tiny_target,
)

INSTALL = 'pip install "eagle31-mla[gpu]"'
#: A drafter FlashInfer's MLA kernels take: latent 512, rope 64 (Kimi-K3's); everything else tiny.
MLA_DIMS = dict(kv_lora_rank=512, qk_rope_head_dim=64)


def mla_drafter(seed: int = 3, dtype=torch.bfloat16, **overrides) -> Eagle31MLAForCausalLM:
    return tiny_drafter(seed, **{**MLA_DIMS, **overrides}).to(dtype)


# ---- the extra --------------------------------------------------------------------------------------------


def test_the_gpu_extra_is_bounded_and_nothing_else_pulls_flashinfer():
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    extras = project["project"]["optional-dependencies"]
    assert extras["gpu"] == [fb.REQUIREMENT] == ["flashinfer-python>=0.7.2.post1,<0.8"]
    others = project["project"]["dependencies"] + [r for name, reqs in extras.items() if name != "gpu" for r in reqs]
    assert not [r for r in others if "flashinfer" in r]
    assert any(m.startswith("gpu:") for m in project["tool"]["pytest"]["ini_options"]["markers"])
    assert INSTALL in (ROOT / "README.md").read_text()


# ---- dispatch and errors (no CUDA here; the package simulated missing or present) ---------------------------


def stand_in_flashinfer():
    """A module standing in for ``flashinfer`` (its ``mla`` and ``sampling`` modules, what the glue calls)."""
    flashinfer = types.ModuleType("flashinfer")
    flashinfer.mla = types.SimpleNamespace(
        BatchMLAPagedAttentionWrapper=StandInMLAWrapper, MLAPlanMetadata=StandInPlanMetadata
    )
    flashinfer.sampling = StandInSampling()
    return flashinfer


@pytest.fixture
def no_flashinfer(monkeypatch):
    monkeypatch.setitem(sys.modules, "flashinfer", None)  # `import flashinfer` raises ImportError


@pytest.fixture
def flashinfer_here(monkeypatch):
    """The stand-in installed, and the glue allowed on CPU (it checks for CUDA through DEVICE_TYPES)."""
    flashinfer = stand_in_flashinfer()
    monkeypatch.setitem(sys.modules, "flashinfer", flashinfer)
    monkeypatch.setattr(fb, "DEVICE_TYPES", ("cuda", "cpu"))
    monkeypatch.setattr(fb, "_WRAPPERS", {})
    StandInMLAWrapper.calls = []
    return flashinfer


def test_without_cuda_or_the_package_the_error_names_both(no_flashinfer, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(fb.FlashInferUnavailable) as err:
        fb.require("cpu")
    message = str(err.value)
    assert "FlashInfer runs on CUDA only: no CUDA device here" in message
    assert "flashinfer-python is not installed" in message
    assert INSTALL in message and "flashinfer-python>=0.7.2.post1,<0.8" in message


def test_each_missing_piece_is_named_alone(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setitem(sys.modules, "flashinfer", None)
    with pytest.raises(fb.FlashInferUnavailable) as err:
        fb.require("cuda")  # CUDA "there", the package missing
    assert "flashinfer-python is not installed" in str(err.value) and "CUDA only" not in str(err.value)
    monkeypatch.setitem(sys.modules, "flashinfer", stand_in_flashinfer())
    with pytest.raises(fb.FlashInferUnavailable) as err:
        fb.require("cpu")  # the package there, the drafter on CPU although CUDA is available
    message = str(err.value)
    assert "load the drafter on cuda (it is on cpu)" in message and "not installed" not in message
    assert fb.require("cuda") is sys.modules["flashinfer"]
    with pytest.raises(fb.FlashInferUnavailable, match=r"float16 or bfloat16, the drafter is torch.float32"):
        fb.require("cuda", torch.float32)
    with pytest.raises(
        fb.FlashInferUnavailable, match=r"kv_lora_rank 32 and qk_rope_head_dim 16 \(Kimi-K3's: 512, 64\)"
    ):
        fb.require("cuda", torch.bfloat16, kv_lora_rank=32, rope_dim=16)


def test_from_pretrained_refuses_flashinfer_before_loading(tmp_path, no_flashinfer, monkeypatch):
    model = mla_drafter()
    folder = write_checkpoint(tmp_path / "d", published_style_config(model), model.state_dict())
    loads = []
    monkeypatch.setattr(transformers.PreTrainedModel, "from_pretrained", lambda *a, **k: loads.append(1))
    with pytest.raises(fb.FlashInferUnavailable) as err:
        Eagle31MLAForCausalLM.from_pretrained(folder, attn_implementation="flashinfer", dtype=torch.bfloat16)
    assert "CUDA" in str(err.value) and "flashinfer-python is not installed" in str(err.value)
    assert INSTALL in str(err.value) and not loads  # refused before any weight was read
    monkeypatch.undo()
    with pytest.raises(ValueError, match="FlashInfer"):  # Transformers' own refusal of an unknown implementation
        Eagle31MLAForCausalLM.from_pretrained(folder, attn_implementation="FlashInfer")


def test_from_pretrained_stores_the_choice_in_the_config(tmp_path, flashinfer_here):
    model = mla_drafter()
    folder = write_checkpoint(tmp_path / "d", published_style_config(model), model.state_dict())
    loaded = Eagle31MLAForCausalLM.from_pretrained(folder, attn_implementation="flashinfer", dtype=torch.bfloat16)
    assert loaded.config._attn_implementation == "flashinfer"
    assert "flashinfer" not in loaded.config.to_json_string()  # a run-time choice, never written to config.json
    assert Eagle31MLAForCausalLM.from_pretrained(folder).config._attn_implementation == "eager"
    with pytest.raises(fb.FlashInferUnavailable, match="the drafter is torch.float32"):
        Eagle31MLAForCausalLM.from_pretrained(folder, attn_implementation="flashinfer", dtype=torch.float32)


def test_a_decode_step_never_falls_back_silently(no_flashinfer):
    """Chosen, then run where FlashInfer is missing: the decode step raises; it does not take the torch path."""
    model = mla_drafter()
    ids, aux = aux_inputs(model.config, 1, 5)
    model.config._attn_implementation = "flashinfer"
    with torch.no_grad():
        out = model(ids, aux_hidden_states=aux.bfloat16())  # a prompt: the torch path, by the documented rule
        with pytest.raises(fb.FlashInferUnavailable, match="not installed"):
            model(ids[:, :1], hidden_states=out.hidden_states[:, -1:], past_key_values=out.past_key_values)


def test_the_remote_code_copy_says_flashinfer_needs_the_library(monkeypatch):
    monkeypatch.setitem(sys.modules, "eagle31_mla.model.flashinfer_backend", None)  # as in a Hub repo's modeling copy
    with pytest.raises(RuntimeError, match=r'part of the eagle31-mla library \(pip install "eagle31-mla\[gpu\]"\)'):
        modeling.flashinfer_backend()


def test_sampling_backend_errors(no_flashinfer, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    target, draft = tiny_target(), tiny_pair_drafter()
    with pytest.raises(fb.FlashInferUnavailable, match="CUDA only.*not installed"):
        speculative_generate(target, draft, prompt(5), max_new_tokens=4, sampling_backend="flashinfer")
    with pytest.raises(DraftInputError, match=r"`sampling_backend` is 'cuda'; expected one of"):
        speculative_generate(target, draft, prompt(5), max_new_tokens=4, sampling_backend="cuda")
    ids, aux = aux_inputs(draft.config, 1, 3)
    with pytest.raises(fb.FlashInferUnavailable, match="CUDA only"):
        draft.draft(ids, aux, 2, sampling_backend="flashinfer")
    with pytest.raises(fb.FlashInferUnavailable, match="CUDA only"):
        sampling_probs(torch.randn(2, 9), 0.7, 0.9, "flashinfer")


def test_cli_sampling_backend_flashinfer_is_one_line_before_loading(tmp_path, capsys, no_flashinfer, monkeypatch):
    (tmp_path / "p.txt").write_text("hello\n")
    loads = []
    monkeypatch.setattr(Eagle31MLAForCausalLM, "from_pretrained", lambda *a, **k: loads.append(1))
    pair = ["--target", str(DEMO_DIR / "target"), "--draft", str(DEMO_DIR / "draft")]
    argv = ["acceptance", *pair, "--prompts", str(tmp_path / "p.txt"), "--sampling-backend", "flashinfer"]
    assert main([*argv, "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert "argument --sampling-backend: the FlashInfer path cannot run" in err and INSTALL in err, err
    assert "CUDA only" in err and "flashinfer-python is not installed" in err and not loads, err
    server = ["acceptance", "--prompts", str(tmp_path / "p.txt"), "--server", "http://127.0.0.1:9", "--engine", "vllm"]
    assert main([*server, "--sampling-backend", "torch"]) == 2
    assert "--sampling-backend is for the offline measurement" in capsys.readouterr().err


# ---- decode: the stand-in and what the glue hands it ----------------------------------------------------------


class StandInPlanMetadata:
    @staticmethod
    def csr(*, qo_indptr, kv_indptr, kv_indices, kv_len_arr):
        for name, t in (("qo_indptr", qo_indptr), ("kv_indptr", kv_indptr), ("kv_indices", kv_indices)):
            assert t.dtype == torch.int32 and t.dim() == 1 and t.is_contiguous(), name
        assert kv_len_arr.dtype == torch.int32 and kv_len_arr.dim() == 1 and kv_len_arr.is_contiguous()
        return types.SimpleNamespace(
            qo_indptr=qo_indptr, kv_indptr=kv_indptr, kv_indices=kv_indices, kv_len_arr=kv_len_arr
        )


class StandInMLAWrapper:
    """``BatchMLAPagedAttentionWrapper`` in plain torch. ``run`` reads the planned CSR metadata as FlashInfer
    documents it (query rows of request b: qo_indptr[b]:qo_indptr[b+1]; its pages: kv_indices[kv_indptr[b]:
    kv_indptr[b+1]], page_size tokens each, the first kv_len_arr[b] of them live) and the packed layouts (last
    dim = ckv then kpe), and returns softmax(q . k * sm_scale) . ckv per head, computed in fp32 and rounded once
    to the query's dtype (FlashInfer's output dtype)."""

    calls: list[dict] = []

    def __init__(self, float_workspace_buffer, use_cuda_graph=False, *, backend="auto"):
        assert float_workspace_buffer.dtype == torch.uint8 and backend == "auto"
        self.planned = None

    def plan(
        self,
        *,
        metadata,
        num_heads,
        head_dim_ckv,
        head_dim_kpe,
        page_size,
        causal,
        sm_scale,
        q_data_type,
        kv_data_type,
        query_layout,
        kv_cache_layout,
    ):
        pages = (metadata.kv_len_arr.long() + page_size - 1) // page_size
        assert torch.equal(metadata.kv_indptr[1:].long() - metadata.kv_indptr[:-1].long(), pages)
        assert isinstance(sm_scale, float) and math.isfinite(sm_scale)
        self.planned = dict(locals())
        del self.planned["self"]

    def run(self, *, query, kv_cache):
        plan = self.planned
        meta, C, R = plan["metadata"], plan["head_dim_ckv"], plan["head_dim_kpe"]
        assert query.dim() == 3 and query.shape[1:] == (plan["num_heads"], C + R) and query.dtype == plan["q_data_type"]
        assert kv_cache.dim() == 3 and kv_cache.shape[1:] == (plan["page_size"], C + R)
        assert kv_cache.dtype == plan["kv_data_type"] and not plan["causal"]
        StandInMLAWrapper.calls.append(dict(plan, query=query, kv_cache=kv_cache))
        out = query.new_empty(query.shape[0], query.shape[1], C)
        qo, kv_ptr = meta.qo_indptr.tolist(), meta.kv_indptr.tolist()
        for b, length in enumerate(meta.kv_len_arr.tolist()):
            pages = kv_cache[meta.kv_indices[kv_ptr[b] : kv_ptr[b + 1]].long()]  # [n, page_size, C+R]
            keys = pages.reshape(-1, C + R)[:length].float()  # [S, C+R]
            rows = query[qo[b] : qo[b + 1]].float()  # [t, h, C+R]
            scores = torch.einsum("thd,sd->ths", rows, keys) * plan["sm_scale"]
            out[qo[b] : qo[b + 1]] = torch.einsum("ths,sc->thc", scores.softmax(-1), keys[:, :C]).to(query.dtype)
        return out


def one_decode_step(model, B=2, context=6, capacity=None, seed=1):
    """A prompt of ``context`` tokens (torch naive path), then the inputs of one decode step over its cache."""
    ids, aux = aux_inputs(model.config, B, context, seed=seed)
    cache = LatentKVCache.for_model(model, B, dtype=torch.bfloat16, device="cpu", capacity=capacity or 256)
    with torch.no_grad():
        out = model(ids, aux_hidden_states=aux.bfloat16(), past_key_values=cache)
    step = dict(input_ids=ids[:, -1:], hidden_states=out.hidden_states[:, -1:], past_key_values=cache)
    return step, cache


def attention_outputs(model):
    """The attention sublayer's outputs [B, T, H], appended per call."""
    seen = []
    model.layers[0].self_attn.register_forward_hook(lambda mod, args, out: seen.append(out.float()))
    return seen


# bf16 holds 8 significant bits (an ulp is at most 2^-7 of a value). The torch path is forced onto its fp32
# products (as on a CPU without native bf16) and the stand-in computes in fp32 too, from the same bf16 query and
# cache: the per-head outputs differ by summation order only, then each is rounded once to bf16 (under half an
# ulp) before the same bf16 o_proj / lm_head. 4 ulps at the output's scale bounds that (tests/unit/test_numerics.py
# bf16_tolerance); a lost scale, a wrong page or length, or a missing rope half moves outputs by O(1).
def bf16_close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.float() - b.float()).abs().max().item() <= 4 * 2**-7 * b.float().abs().max().item()


@pytest.mark.parametrize("rope", [PLAIN_ROPE, YARN], ids=["plain_rope", "yarn"])
def test_decode_through_the_stand_in_equals_the_torch_absorbed_path(rope, flashinfer_here, monkeypatch):
    monkeypatch.setattr(modeling, "CPU_NATIVE_BF16", False)
    model = mla_drafter(rope_parameters=dict(rope))
    seen = attention_outputs(model)
    step, cache = one_decode_step(model)
    assert not StandInMLAWrapper.calls  # the prompt (T > 1) took the torch path
    with torch.no_grad():
        eager = model(**step)
        cache.crop(6)
        model.config._attn_implementation = "flashinfer"
        fused = model(**step)
    assert len(StandInMLAWrapper.calls) == 1
    assert bf16_close(seen[-1], seen[-2])
    assert bf16_close(fused.logits, eager.logits) and bf16_close(fused.hidden_states, eager.hidden_states)


def test_the_arguments_flashinfer_receives(flashinfer_here):
    """The query is the torch path's absorbed query (q_nope through kv_b's key factor, then q_pe), the cache is
    LatentKVCache's own buffer (its ckv / kpe halves are views of it: no copy), one page per sequence of
    page_size = capacity, kv_len = the cached length, and sm_scale the drafter's (YaRN mscale included)."""
    model = mla_drafter()  # YaRN: softmax_scale = mscale^2 / sqrt(N + R)
    attention = model.layers[0].self_attn
    original, given = attention._absorbed, {}

    def spy(q_nope, q_pe, latent, mask, cache=None):
        given.update(q_nope=q_nope, q_pe=q_pe, cache=cache)
        return original(q_nope, q_pe, latent, mask, cache)

    attention._absorbed = spy
    step, cache = one_decode_step(model, B=3, context=5, capacity=8)
    model.config._attn_implementation = "flashinfer"
    with torch.no_grad():
        model(**step)
    (call,) = StandInMLAWrapper.calls
    B, h, C, R = 3, model.config.num_attention_heads, 512, 64
    query, kv = call["query"], call["kv_cache"]

    assert query.shape == (B, h, C + R) and query.dtype == torch.bfloat16
    assert torch.equal(query[..., C:], given["q_pe"][:, :, 0])  # the rotated q_pe, as it is
    w = model.layers[0].self_attn.kv_b_proj.weight.float().view(h, -1, C)[:, : model.config.qk_nope_head_dim]
    assert torch.equal(attention._absorbed_weights()[0].float(), w)  # the same w_k as the torch path
    absorbed = torch.einsum("bhn,hnc->bhc", given["q_nope"][:, :, 0].float(), w)  # [B, h, C], fp32
    assert bf16_close(query[..., :C], absorbed)  # rounded once to bf16, like the torch path's query

    assert kv is cache.latent and kv.shape == (B, 8, C + R)  # the buffer itself: [num_pages, page_size, C+R]
    assert kv[..., :C].data_ptr() == cache.c_kv.data_ptr() and kv[..., C:].data_ptr() == cache.k_pe.data_ptr()
    assert kv.untyped_storage().data_ptr() == cache.latent.untyped_storage().data_ptr()
    meta = call["metadata"]
    assert meta.qo_indptr.tolist() == meta.kv_indptr.tolist() == list(range(B + 1))
    assert meta.kv_indices.tolist() == list(range(B)) and meta.kv_len_arr.tolist() == [6] * B == [cache.length] * B
    assert (call["page_size"], call["num_heads"], call["head_dim_ckv"], call["head_dim_kpe"]) == (8, h, C, R)
    assert call["sm_scale"] == model.config.softmax_scale != 1 / math.sqrt(model.config.qk_head_dim)
    assert call["causal"] is False and call["q_data_type"] == call["kv_data_type"] == torch.bfloat16
    assert call["query_layout"] == call["kv_cache_layout"] == "packed"


def test_drafting_runs_each_later_step_through_flashinfer(flashinfer_here, monkeypatch):
    """draft(): the context (T > 1) on the torch path, each later one-token step through FlashInfer, the cache
    growing past its capacity on the way (a new buffer: the next plan takes its page size)."""
    monkeypatch.setattr(modeling, "CPU_NATIVE_BF16", False)
    model = mla_drafter(seed=4)
    ids, aux = aux_inputs(model.config, 2, 6)
    drafted = {}
    for implementation in ("eager", "flashinfer"):
        model.config._attn_implementation = implementation
        cache = LatentKVCache.for_model(model, 2, dtype=torch.bfloat16, device="cpu", capacity=8)
        drafted[implementation] = model.draft(ids, aux.bfloat16(), 5, past_key_values=cache)
    calls = StandInMLAWrapper.calls
    assert [c["metadata"].kv_len_arr.tolist() for c in calls] == [[n, n] for n in (7, 8, 9, 10)]
    assert [c["page_size"] for c in calls] == [8, 8, 16, 16]
    assert torch.equal(drafted["flashinfer"].tokens, drafted["eager"].tokens)
    assert bf16_close(drafted["flashinfer"].hidden_states, drafted["eager"].hidden_states)


def test_masked_and_multi_token_steps_take_the_torch_path(flashinfer_here):
    model = mla_drafter()
    step, cache = one_decode_step(model, B=2, context=5)
    model.config._attn_implementation = "flashinfer"
    with torch.no_grad():
        model(**step, attention_mask=torch.ones(2, 6, dtype=torch.long))  # a padding mask
        cache.crop(5)
        model(
            step["input_ids"].repeat(1, 2), hidden_states=step["hidden_states"].repeat(1, 2, 1), past_key_values=cache
        )
    assert not StandInMLAWrapper.calls


# ---- sampling: wiring only (the stand-in samples with torch) -------------------------------------------------


class StandInSampling:
    """``flashinfer.sampling``'s three calls, with FlashInfer's signatures and output formats; torch inside."""

    def __init__(self):
        self.calls = []

    def top_p_renorm_probs(self, probs, top_p, is_deterministic=False):
        assert probs.dim() == 2 and probs.dtype == torch.float32 and 0 < top_p < 1
        self.calls.append(("top_p_renorm_probs", tuple(probs.shape)))
        return sampling_probs(probs.log(), 1.0, top_p)  # the torch rule, for wiring

    def sampling_from_probs(self, probs, indices=None, deterministic=True, generator=None, check_nan=False):
        assert probs.dim() == 2 and probs.dtype == torch.float32
        self.calls.append(("sampling_from_probs", tuple(probs.shape)))
        return torch.multinomial(probs, 1, generator=generator)[:, 0].int()

    def chain_speculative_sampling(self, draft_probs, draft_token_ids, target_probs, *args, generator=None, **kw):
        B, k, V = draft_probs.shape
        assert draft_token_ids.shape == (B, k) and draft_token_ids.dtype == torch.int32
        assert target_probs.shape == (B, k + 1, V) and draft_probs.dtype == target_probs.dtype == torch.float32
        self.calls.append(("chain_speculative_sampling", (B, k, V)))
        m, nxt = accept_chain(draft_token_ids.long(), draft_probs, target_probs, generator)
        out = torch.full((B, k + 1), -1, dtype=torch.int32)
        for b in range(B):  # accepted drafts, then the correction / bonus, then -1 (FlashInfer's format)
            out[b, : m[b]] = draft_token_ids[b, : m[b]]
            out[b, m[b]] = nxt[b]
        return out, torch.zeros(B, dtype=torch.int32), m.int()


def test_flashinfer_chain_output_is_read_as_accept_chain_returns_it(flashinfer_here):
    sampling = flashinfer_here.sampling
    sampling.chain_speculative_sampling = lambda *a, **k: (
        torch.tensor([[2, 0, -1], [5, 6, 7]], dtype=torch.int32),
        torch.tensor([1, 2], dtype=torch.int32),
        torch.tensor([1, 2], dtype=torch.int32),
    )
    m, nxt = fb.accept_chain(torch.tensor([[2, 1], [5, 6]]), torch.rand(2, 2, 9), torch.rand(2, 3, 9))
    assert m.tolist() == [1, 2] and nxt.tolist() == [0, 7] and m.dtype == nxt.dtype == torch.long


@pytest.mark.parametrize("temperature, top_p", [(0.8, 0.9), (1.0, 1.0), (0.0, 1.0)])
def test_speculative_generate_wires_flashinfer_sampling(temperature, top_p, flashinfer_here):
    target, draft = tiny_target(), tiny_pair_drafter()
    g = torch.Generator().manual_seed(0)
    out = speculative_generate(
        target,
        draft,
        prompt(7),
        max_new_tokens=12,
        temperature=temperature,
        top_p=top_p,
        generator=g,
        sampling_backend="flashinfer",
    )
    calls = flashinfer_here.sampling.calls
    rounds = len(out.accepted_per_round)
    if temperature == 0:  # greedy: the argmax rule, nothing sampled
        assert not calls
        assert out.tokens == speculative_generate(target, draft, prompt(7), max_new_tokens=12).tokens
        return
    chains = [shape for name, shape in calls if name == "chain_speculative_sampling"]
    assert chains == [(1, 3, draft.config.vocab_size)] * rounds  # every verification went through FlashInfer
    draws = [shape for name, shape in calls if name == "sampling_from_probs"]
    assert draws.count((1, draft.config.vocab_size)) == 1 + 3 * rounds  # the target's first token + each draft
    renorms = [shape for name, shape in calls if name == "top_p_renorm_probs"]
    assert (len(renorms) > 0) == (top_p < 1)
    assert len(out.tokens) == 12


def test_trees_keep_the_torch_rule_over_flashinfers_p(flashinfer_here):
    target, draft = tiny_target(), tiny_pair_drafter()
    out = speculative_generate(
        target,
        draft,
        prompt(7),
        max_new_tokens=8,
        topk=2,
        num_draft_tokens=4,
        temperature=0.8,
        top_p=0.9,
        generator=torch.Generator().manual_seed(0),
        sampling_backend="flashinfer",
    )
    names = {name for name, _ in flashinfer_here.sampling.calls}
    assert "chain_speculative_sampling" not in names and "top_p_renorm_probs" in names
    assert len(out.tokens) == 8


# ---- on a GPU -------------------------------------------------------------------------------------------------


def gpu_missing() -> str | None:
    if not torch.cuda.is_available():
        return f"needs a CUDA GPU (torch {torch.__version__}: torch.cuda.is_available() is False)"
    try:
        fb._import_flashinfer()
    except ImportError as err:
        return f"needs flashinfer-python ({INSTALL}): {err}"
    return None


GPU_MISSING = gpu_missing()


def gpu_test(test):
    """Marked ``gpu``, skipped with the reason where there is no GPU or no FlashInfer (a failure under
    EAGLE31_REQUIRE_GPU=1, tests/conftest.py)."""
    return pytest.mark.gpu(pytest.mark.skipif(GPU_MISSING is not None, reason=f"{GPU_MISSING}")(test))


YARN_LONG = {**YARN, "original_max_position_embeddings": 4096}


def gpu_drafter(rope, dtype=torch.bfloat16) -> Eagle31MLAForCausalLM:
    """Kimi-K3's latent widths (512 + 64) and 16 heads; the rest small. Random weights, on CUDA."""
    return mla_drafter(
        seed=5,
        dtype=dtype,
        num_attention_heads=16,
        qk_nope_head_dim=32,
        v_head_dim=32,
        hidden_size=128,
        intermediate_size=128,
        q_lora_rank=64,
        max_position_embeddings=65536,
        rope_parameters=dict(rope),
    ).cuda()


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| / max |want|."""
    return ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()


def decode_three_ways(model, batch: int, context: int, capacity: int, monkeypatch, seed: int = 0):
    """One decode step at position ``context - 1`` over a cache of ``context - 1`` random latents (what decode
    reads is the cache, whatever wrote it; unit variance, as the RMS-normalised c_kv has: another sequence's page
    or a wrong stride gives another average, an O(1) change), run three ways: torch absorbed bf16, FlashInfer bf16,
    torch absorbed fp32 on the same (bf16-rounded) weights and cache. Returns their attention outputs [B, 1, H].
    (Simulated on CPU with this model, the torch bf16 path is within 0.012 of fp32 at these sizes, and within
    0.009 of fp32 products over the bf16 cache, which is what FlashInfer computes before rounding P to bf16.)"""
    calls = []
    decode = fb.latent_decode
    monkeypatch.setattr(fb, "latent_decode", lambda *a: calls.append(1) or decode(*a))
    seen = attention_outputs(model)
    g = torch.Generator(device="cuda").manual_seed(seed)
    cache = LatentKVCache.for_model(model, batch, dtype=torch.bfloat16, device="cuda", capacity=capacity)
    cache.latent.fill_(float("nan"))  # never read past the length: a read shows as NaN
    if context > 1:
        c_kv = torch.randn(batch, context - 1, 512, generator=g, device="cuda").bfloat16()
        cache.update(c_kv, torch.randn(batch, context - 1, 64, generator=g, device="cuda").bfloat16())
    step = dict(
        input_ids=torch.randint(0, model.config.vocab_size, (batch, 1), generator=g, device="cuda"),
        hidden_states=torch.randn(batch, 1, model.config.hidden_size, generator=g, device="cuda").bfloat16(),
        position_ids=torch.full((batch, 1), context - 1, device="cuda"),
        absorb=True,
    )
    with torch.no_grad():
        for implementation in ("eager", "flashinfer"):
            model.config._attn_implementation = implementation
            model(**step, past_key_values=cache)
            cache.crop(context - 1)
        model.float()
        model.config._attn_implementation = "eager"
        cache.latent = cache.latent.float()
        model(**{**step, "hidden_states": step["hidden_states"].float()}, past_key_values=cache)
    assert len(calls) == 1  # the FlashInfer run did go through FlashInfer
    eager, fused, fp32 = seen
    return eager, fused, fp32


@gpu_test
@pytest.mark.parametrize("rope", [PLAIN_ROPE, YARN_LONG], ids=["plain_rope", "yarn"])
@pytest.mark.parametrize("batch", [1, 8])
@pytest.mark.parametrize("context", [1, 4096, 32768])
def test_gpu_decode_equals_the_torch_absorbed_path(context, batch, rope, monkeypatch):
    """FlashInfer's decode within 2e-2 (relative to the output's largest value) of the torch absorbed path in
    bf16 and of the fp32 reference; the cache's pages full (capacity = context). Context 1 attends to the new
    token alone: a wrong length is O(1) there. (No fp32 FlashInfer run: its MLA kernels take fp16/bf16 only,
    test_gpu_fp32_is_refused_by_name.)"""
    eager, fused, fp32 = decode_three_ways(
        gpu_drafter(rope), batch, context, context, monkeypatch, seed=context + batch
    )
    assert torch.isfinite(fused).all()
    assert relative_error(fused, eager) <= 2e-2, relative_error(fused, eager)
    assert relative_error(fused, fp32) <= 2e-2, relative_error(fused, fp32)


@gpu_test
@pytest.mark.parametrize("context, capacity", [(100, 256), (4097, 8192)])
def test_gpu_decode_reads_only_the_cached_length(context, capacity, monkeypatch):
    """A page larger than the length (the cache's usual state: capacity grows by doubling), its tail NaN: FlashInfer
    reads the first kv_len tokens of the page only, and the result is the torch path's."""
    eager, fused, fp32 = decode_three_ways(gpu_drafter(YARN_LONG), 8, context, capacity, monkeypatch)
    assert torch.isfinite(fused).all(), "FlashInfer read the cache past its length"
    assert relative_error(fused, fp32) <= 2e-2, relative_error(fused, fp32)


@gpu_test
def test_gpu_fp32_is_refused_by_name():
    model = gpu_drafter(PLAIN_ROPE, dtype=torch.float32)
    model.config._attn_implementation = "flashinfer"
    ids, aux = aux_inputs(model.config, 1, 3)
    with (
        torch.no_grad(),
        pytest.raises(fb.FlashInferUnavailable, match="float16 or bfloat16, the drafter is torch.float32"),
    ):
        model.draft(ids.cuda(), aux.cuda(), 2)


def flashinfer_chain_first_two(accept, p, q, seed=0):
    """As test_speculative.chain_first_two, on CUDA: the drafts drawn from q by FlashInfer, 1e5 rounds at once."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    k = q.shape[0]
    drafts = torch.stack([fb.sample(q[j].expand(SAMPLES, -1), g) for j in range(k)], 1)
    n, nxt = accept(drafts, q.expand(SAMPLES, -1, -1), p.expand(SAMPLES, -1, -1), g)
    first = torch.where(n >= 1, drafts[:, 0], nxt)
    second = torch.where(n >= 2, drafts[:, 1], nxt)[n >= 1]
    return first.cpu(), second.cpu()


@gpu_test
@pytest.mark.parametrize("sampling", [(1.0, 1.0), (0.7, 0.8)], ids=["T1", "T0.7_top_p0.8"])
def test_gpu_chain_sampling_is_lossless(small_vocab_round, sampling):  # noqa: F811 - the imported fixture
    p, q = (t.cuda() for t in small_vocab_round[sampling])
    first, second = flashinfer_chain_first_two(fb.accept_chain, p, q)
    assert chi_square_p_value(first, p[0].cpu()) > 0.01
    assert second.numel() > 10_000 and chi_square_p_value(second, p[1].cpu()) > 0.01


def draft_probs_as_target(drafts, q, p, g):
    """Broken wiring: the drafter's q passed as the target's (every draft accepted)."""
    return fb.accept_chain(drafts, q, torch.cat([q, p[:, -1:]], 1), g)


def swapped(drafts, q, p, g):
    """Broken wiring: p and q swapped."""
    return fb.accept_chain(drafts, p[:, :-1], torch.cat([q, p[:, -1:]], 1), g)


@gpu_test
@pytest.mark.parametrize("broken", [draft_probs_as_target, swapped])
def test_gpu_broken_wirings_fail_the_same_test(small_vocab_round, broken):  # noqa: F811 - the imported fixture
    p, q = (t.cuda() for t in small_vocab_round[(1.0, 1.0)])
    first, _ = flashinfer_chain_first_two(broken, p, q)
    assert chi_square_p_value(first, p[0].cpu()) < 0.01


@gpu_test
@pytest.mark.parametrize("temperature, top_p", [(1.0, 1.0), (0.7, 0.8), (1.3, 0.5)])
def test_gpu_draws_and_top_p_follow_the_library_rule(temperature, top_p):
    """FlashInfer's top-p keeps the set the torch rule keeps (random logits: no ties), and its draws follow it."""
    g = torch.Generator(device="cuda").manual_seed(1)
    logits = torch.randn(4, 16, generator=g, device="cuda") * 0.5
    want = sampling_probs(logits, temperature, top_p)
    assert ((want > 0).sum(-1) >= 3).all()  # top-p keeps several tokens: the draws have something to test
    got = sampling_probs(logits, temperature, top_p, "flashinfer")
    assert torch.allclose(got, want, atol=1e-4)
    ids, probs = sample_from_logits(logits[:1].expand(SAMPLES, -1), temperature, top_p, g, "flashinfer")
    assert chi_square_p_value(ids.cpu(), want[0].cpu()) > 0.01


@gpu_test
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_gpu_speculative_generate_with_flashinfer_sampling(temperature):
    target, draft = tiny_target().cuda(), tiny_pair_drafter().cuda()
    g = torch.Generator(device="cuda").manual_seed(0)
    kwargs = dict(max_new_tokens=16, temperature=temperature, generator=g)
    out = speculative_generate(target, draft, prompt(7), sampling_backend="flashinfer", **kwargs)
    assert len(out.tokens) == 16
    if temperature == 0:  # greedy: the same argmax rule as the torch backend
        assert out.tokens == speculative_generate(target, draft, prompt(7), **kwargs).tokens


def test_every_gpu_test_is_marked():
    tests = {name: fn for name, fn in globals().items() if name.startswith("test_gpu_")}
    assert len(tests) >= 6
    for name, fn in tests.items():
        assert any(m.name == "gpu" for m in getattr(fn, "pytestmark", [])), name
