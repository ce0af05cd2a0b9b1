"""The FlashInfer path (eagle31_mla.model.flashinfer_backend): on CPU against stand-ins of FlashInfer 0.7.2.post1's
API, on a GPU (marked ``gpu``, run by scripts/gpu_check.sh) against FlashInfer itself. What each proves: docs/gpu.md."""

from __future__ import annotations

import importlib.util
import math
import sys
import types

import pytest
import tomllib
import torch
import transformers

import eagle31_mla.model.flashinfer_backend as fb
import eagle31_mla.model.modeling_eagle31_mla as modeling
from eagle31_mla import Eagle31MLAForCausalLM, LatentKVCache
from eagle31_mla.decoding.speculative import speculative_generate
from eagle31_mla.model.modeling_eagle31_mla import sample_from_logits, sampling_probs
from tests.support.decoding import SAMPLES, chi_square_p_value, drafter, prompt, small_vocab_round, tiny_target
from tests.support.paths import ROOT
from tests.support.tiny import PLAIN_ROPE, YARN, aux_inputs, bf16_tolerance, tiny_drafter

INSTALL, BF16 = 'pip install "eagle31-mla[gpu]"', torch.bfloat16


def mla_drafter(seed: int = 3, dtype=BF16, **overrides) -> Eagle31MLAForCausalLM:
    """Latent and rope widths FlashInfer's MLA kernels take (Kimi-K3's 512 and 64); everything else tiny."""
    return tiny_drafter(seed, **{"kv_lora_rank": 512, "qk_rope_head_dim": 64, **overrides}).to(dtype)


def test_the_gpu_extra_is_bounded_and_nothing_else_pulls_flashinfer():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    extras = project["project"]["optional-dependencies"]
    assert extras["gpu"] == [fb.REQUIREMENT] == ["flashinfer-python>=0.7.2.post1,<0.8"]
    others = project["project"]["dependencies"] + [r for name, reqs in extras.items() if name != "gpu" for r in reqs]
    assert not [r for r in others if "flashinfer" in r]
    assert any(m.startswith("gpu:") for m in project["tool"]["pytest"]["ini_options"]["markers"])
    assert INSTALL in (ROOT / "README.md").read_text()


# ---- stand-ins for FlashInfer 0.7.2.post1's API ----------------------------------------------------------------

PLAN_ARGS = set(
    "metadata num_heads head_dim_ckv head_dim_kpe page_size causal sm_scale q_data_type kv_data_type query_layout "
    "kv_cache_layout".split()
)


class StandInMLAWrapper:
    """``BatchMLAPagedAttentionWrapper`` in torch: the CSR metadata read as FlashInfer documents it (request b's query
    rows qo_indptr[b]:qo_indptr[b+1], its pages kv_indices[kv_indptr[b]:kv_indptr[b+1]], the first kv_len_arr[b]
    tokens live), the packed layout (ckv then kpe); softmax(q . k * sm_scale) . ckv in fp32, rounded once."""

    calls: list[dict] = []

    def __init__(self, float_workspace_buffer, use_cuda_graph=False, *, backend="auto"):
        assert float_workspace_buffer.dtype == torch.uint8 and backend == "auto"

    def plan(self, **plan):
        assert set(plan) == PLAN_ARGS, set(plan) ^ PLAN_ARGS
        meta, page_size = plan["metadata"], plan["page_size"]
        assert all(t.dtype == torch.int32 and t.dim() == 1 and t.is_contiguous() for t in vars(meta).values())
        pages = (meta.kv_len_arr.long() + page_size - 1) // page_size
        assert torch.equal(meta.kv_indptr[1:].long() - meta.kv_indptr[:-1].long(), pages)
        assert isinstance(plan["sm_scale"], float) and math.isfinite(plan["sm_scale"])
        self.planned = plan

    def run(self, *, query, kv_cache):  # the query and cache it gets: checked by the test
        plan = self.planned
        meta, C, R = plan["metadata"], plan["head_dim_ckv"], plan["head_dim_kpe"]
        StandInMLAWrapper.calls.append(dict(plan, query=query, kv_cache=kv_cache))
        out = query.new_empty(query.shape[0], query.shape[1], C)
        qo, kv_ptr = meta.qo_indptr.tolist(), meta.kv_indptr.tolist()
        for b, length in enumerate(meta.kv_len_arr.tolist()):
            pages = kv_cache[meta.kv_indices[kv_ptr[b] : kv_ptr[b + 1]].long()]  # [n, page_size, C+R]
            keys = pages.reshape(-1, C + R)[:length].float()  # [S, C+R]
            scores = torch.einsum("thd,sd->ths", query[qo[b] : qo[b + 1]].float(), keys) * plan["sm_scale"]
            out[qo[b] : qo[b + 1]] = torch.einsum("ths,sc->thc", scores.softmax(-1), keys[:, :C]).to(query.dtype)
        return out


class StandInSampling:
    """``flashinfer.sampling``'s three calls, with FlashInfer's signatures and output formats; torch inside."""

    def __init__(self):
        self.calls = []

    def top_p_renorm_probs(self, probs, top_p, is_deterministic=False):
        assert probs.dim() == 2 and probs.dtype == torch.float32 and 0 < top_p < 1
        self.calls.append(("top_p_renorm_probs", tuple(probs.shape)))
        return sampling_probs(probs.log(), 1.0, top_p)

    def sampling_from_probs(self, probs, indices=None, deterministic=True, generator=None, check_nan=False):
        assert probs.dim() == 2 and probs.dtype == torch.float32
        self.calls.append(("sampling_from_probs", tuple(probs.shape)))
        return torch.multinomial(probs, 1, generator=generator)[:, 0].int()

    def chain_speculative_sampling(self, draft_probs, draft_token_ids, target_probs, *args, generator=None, **kw):
        B, k, V = draft_probs.shape
        assert draft_token_ids.shape == (B, k) and draft_token_ids.dtype == torch.int32
        assert target_probs.shape == (B, k + 1, V) and draft_probs.dtype == target_probs.dtype == torch.float32
        self.calls.append(("chain_speculative_sampling", (B, k, V)))
        bonus = torch.multinomial(target_probs[:, k], 1, generator=generator).int()  # every draft accepted
        return torch.cat([draft_token_ids, bonus], 1), torch.full((B,), k, dtype=torch.int32), torch.full((B,), k)


def stand_in_flashinfer():
    flashinfer = types.ModuleType("flashinfer")
    csr = types.SimpleNamespace(csr=lambda **metadata: types.SimpleNamespace(**metadata))  # read back by name in run
    flashinfer.mla = types.SimpleNamespace(BatchMLAPagedAttentionWrapper=StandInMLAWrapper, MLAPlanMetadata=csr)
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


# ---- errors: each missing piece named, never a silent fallback -------------------------------------------------

NO_CUDA, ON_CPU = "CUDA only: no CUDA device here", "CUDA only: CUDA is available here, so load the drafter on cuda"
NOT_INSTALLED, FP32 = "flashinfer-python is not installed", "float16 or bfloat16, the drafter is torch.float32"
DIMS = "this drafter has kv_lora_rank 32 and qk_rope_head_dim 16 (Kimi-K3's: 512, 64)"


@pytest.mark.parametrize(
    "cuda, installed, args, kwargs, named, not_named",
    [
        (False, False, ("cpu",), {}, [NO_CUDA, NOT_INSTALLED, INSTALL, fb.REQUIREMENT], []),
        (True, False, ("cuda",), {}, [NOT_INSTALLED], ["CUDA only"]),
        (True, True, ("cpu",), {}, [ON_CPU + " (it is on cpu)"], [NOT_INSTALLED]),
        (True, True, ("cuda", torch.float32), {}, [FP32], ["CUDA only", NOT_INSTALLED]),
        (True, True, ("cuda", BF16), dict(kv_lora_rank=32, rope_dim=16), [DIMS], ["CUDA only", NOT_INSTALLED]),
        (True, True, ("cuda", BF16), dict(kv_lora_rank=512, rope_dim=64), None, None),  # runs: the module
    ],
)
def test_require_names_every_missing_piece(cuda, installed, args, kwargs, named, not_named, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setitem(sys.modules, "flashinfer", stand_in_flashinfer() if installed else None)
    if named is None:
        assert fb.require(*args, **kwargs) is sys.modules["flashinfer"]
        return
    with pytest.raises(fb.FlashInferUnavailable) as err:
        fb.require(*args, **kwargs)
    message = str(err.value)
    assert message.startswith("the FlashInfer path cannot run: ") and INSTALL in message
    assert all(n in message for n in named) and not any(n in message for n in not_named), message


def test_from_pretrained_refuses_before_loading_and_keeps_the_choice_out_of_config_json(tmp_path, monkeypatch):
    model = mla_drafter()
    model.save_pretrained(folder := tmp_path / "d")
    loads = []
    monkeypatch.setattr(transformers.PreTrainedModel, "from_pretrained", lambda *a, **k: loads.append(1))
    monkeypatch.setitem(sys.modules, "flashinfer", None)
    with pytest.raises(fb.FlashInferUnavailable, match=f"{NOT_INSTALLED}.*eagle31-mla\\[gpu\\]"):
        Eagle31MLAForCausalLM.from_pretrained(folder, attn_implementation="flashinfer", dtype=BF16)
    assert not loads  # refused before any weight was read
    monkeypatch.undo()
    with pytest.raises(ValueError, match="FlashInfer"):  # Transformers' own refusal of an unknown implementation
        Eagle31MLAForCausalLM.from_pretrained(folder, attn_implementation="FlashInfer")
    monkeypatch.setitem(sys.modules, "flashinfer", stand_in_flashinfer())
    monkeypatch.setattr(fb, "DEVICE_TYPES", ("cuda", "cpu"))
    loaded = Eagle31MLAForCausalLM.from_pretrained(folder, attn_implementation="flashinfer", dtype=BF16)
    assert loaded.config._attn_implementation == "flashinfer"
    assert "flashinfer" not in loaded.config.to_json_string()  # a run-time choice, never written to config.json
    assert Eagle31MLAForCausalLM.from_pretrained(folder).config._attn_implementation == "eager"
    with pytest.raises(fb.FlashInferUnavailable, match=FP32):
        Eagle31MLAForCausalLM.from_pretrained(folder, attn_implementation="flashinfer", dtype=torch.float32)


@pytest.mark.parametrize(
    "where, dtype, why", [("no_flashinfer", BF16, NOT_INSTALLED), ("flashinfer_here", torch.float32, FP32)]
)
def test_a_decode_step_never_falls_back_silently(where, dtype, why, request):
    """Chosen on the config, then run where FlashInfer cannot: the prompt (several tokens) and a masked step take the
    torch path (the kernel takes no mask: no call, no error), the plain one-token step raises."""
    request.getfixturevalue(where)
    model = mla_drafter(dtype=dtype)
    ids, aux = aux_inputs(model.config, 2, 5)
    model.config._attn_implementation = "flashinfer"
    with torch.no_grad():
        out = model(ids, aux_hidden_states=aux.to(dtype))
        step = dict(input_ids=ids[:, -1:], hidden_states=out.hidden_states[:, -1:], past_key_values=out.past_key_values)
        model(**step, attention_mask=torch.ones(2, 6, dtype=torch.long))  # a padding mask
        out.past_key_values.crop(5)
        with pytest.raises(fb.FlashInferUnavailable, match=why):
            model(**step)


def test_the_remote_code_copy_says_flashinfer_needs_the_library(monkeypatch):
    monkeypatch.setitem(sys.modules, "eagle31_mla.model.flashinfer_backend", None)  # as in a Hub repo's modeling copy
    with pytest.raises(RuntimeError, match=r'part of the eagle31-mla library \(pip install "eagle31-mla\[gpu\]"\)'):
        modeling.flashinfer_backend()


def test_sampling_backend_flashinfer_is_refused_where_it_cannot_run(no_flashinfer, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    target, draft = tiny_target(), drafter()
    ids, aux = aux_inputs(draft.config, 1, 3)
    for call in (
        lambda: speculative_generate(target, draft, prompt(5), max_new_tokens=4, sampling_backend="flashinfer"),
        lambda: draft.draft(ids, aux, 2, sampling_backend="flashinfer"),
        lambda: sampling_probs(torch.randn(2, 9), 0.7, 0.9, "flashinfer"),
    ):
        with pytest.raises(fb.FlashInferUnavailable, match=f"{NO_CUDA}.*{NOT_INSTALLED}"):
            call()


# ---- decode: what the glue hands FlashInfer, and the result equal to the torch path ---------------------------------


@torch.no_grad()
def decode_three_ways(rope, batch: int, context: int, capacity: int, device: str, monkeypatch):
    """One decode step's attention (``Eagle31MLAAttention._absorbed``, where the dispatch is) over ``context`` random
    unit-variance latents (as the RMS-normalised c_kv), the cache's tail NaN (a read past the length shows): torch
    bf16, FlashInfer bf16, torch fp32, per head [B, h, 1, V]. Kimi-K3's latent widths and 16 heads, the rest small."""
    small = dict(qk_nope_head_dim=32, v_head_dim=32, hidden_size=128, intermediate_size=128, q_lora_rank=64)
    model = mla_drafter(5, num_attention_heads=16, max_position_embeddings=65536, rope_parameters=rope, **small)
    attention, calls, decode = model.to(device).layers[0].self_attn, [], fb.latent_decode
    monkeypatch.setattr(fb, "latent_decode", lambda *a: calls.append(1) or decode(*a))
    g = torch.Generator(device=device).manual_seed(context + batch)
    cache = LatentKVCache.for_model(model, batch, dtype=BF16, device=device, capacity=capacity)
    cache.latent.fill_(float("nan"))
    latent = cache.update(*torch.randn(batch, context, 576, generator=g, device=device).bfloat16().split([512, 64], -1))
    q_nope, q_pe = torch.randn(batch, 16, 1, 96, generator=g, device=device).bfloat16().split([32, 64], -1)
    outputs = []
    for implementation in ("eager", "flashinfer"):
        model.config._attn_implementation = implementation
        outputs.append(attention._absorbed(q_nope, q_pe, latent, None, cache))
    model.float().config._attn_implementation = "eager"
    outputs.append(attention._absorbed(q_nope.float(), q_pe.float(), latent.float(), None, None))
    assert len(calls) == 1  # the FlashInfer run did go through FlashInfer
    return outputs


def test_drafting_hands_flashinfer_the_cache_in_place_and_matches_the_torch_path(flashinfer_here, monkeypatch):
    """draft(): the context on the torch path, each later step through FlashInfer on the absorbed query, the cache's
    own buffer (no copy) as one page per sequence of page_size = capacity (a new buffer once it grows), kv_len the
    cached length, sm_scale the drafter's (YaRN mscale included); the same drafts as the torch path."""
    monkeypatch.setattr(modeling, "CPU_NATIVE_BF16", False)
    model = mla_drafter(seed=4)  # YaRN: softmax_scale = mscale^2 / sqrt(N + R)
    ids, aux = aux_inputs(model.config, 2, 6)
    drafted = {}
    for implementation in ("eager", "flashinfer"):
        model.config._attn_implementation = implementation
        cache = LatentKVCache.for_model(model, 2, dtype=BF16, device="cpu", capacity=8)
        drafted[implementation] = model.draft(ids, aux.bfloat16(), 5, past_key_values=cache)
    assert torch.equal(drafted["flashinfer"].tokens, drafted["eager"].tokens)
    # the torch path forced onto fp32 products, the stand-in in fp32: from the same bf16 query and cache, they differ
    # by summation order, then bf16 roundings
    fused, eager = (drafted[name].hidden_states.float() for name in ("flashinfer", "eager"))
    assert (fused - eager).abs().max() <= bf16_tolerance(eager)
    calls, h, C, R = StandInMLAWrapper.calls, model.config.num_attention_heads, 512, 64
    assert [c["metadata"].kv_len_arr.tolist() for c in calls] == [[n, n] for n in (7, 8, 9, 10)]
    assert [c["page_size"] for c in calls] == [8, 8, 16, 16]
    last, meta = calls[-1], calls[-1]["metadata"]
    assert last["kv_cache"] is cache.latent and cache.latent.shape == (2, 16, C + R)  # [num_pages, page_size, C+R]
    assert last["query"].shape == (2, h, C + R) and last["query"].dtype == BF16
    assert meta.qo_indptr.tolist() == meta.kv_indptr.tolist() == [0, 1, 2] and meta.kv_indices.tolist() == [0, 1]
    assert (last["num_heads"], last["head_dim_ckv"], last["head_dim_kpe"]) == (h, C, R)
    assert last["sm_scale"] == model.config.softmax_scale != 1 / math.sqrt(model.config.qk_head_dim)
    assert last["causal"] is False and last["q_data_type"] == last["kv_data_type"] == BF16
    assert last["query_layout"] == last["kv_cache_layout"] == "packed"


# ---- sampling: wiring only ---------------------------------------------------------------------------------------


def test_flashinfer_chain_output_is_read_as_accept_chain_returns_it(flashinfer_here):
    out = torch.tensor([[2, 0, -1], [5, 6, 7]], dtype=torch.int32)  # accepted drafts, correction / bonus, -1
    emitted = torch.tensor([1, 2], dtype=torch.int32)
    flashinfer_here.sampling.chain_speculative_sampling = lambda *a, **k: (out, emitted, emitted)
    m, nxt = fb.accept_chain(torch.tensor([[2, 1], [5, 6]]), torch.rand(2, 2, 9), torch.rand(2, 3, 9))
    assert m.tolist() == [1, 2] and nxt.tolist() == [0, 7] and m.dtype == nxt.dtype == torch.long


@pytest.mark.parametrize(
    "temperature, top_p, tree",
    [(0.8, 0.9, {}), (1.0, 1.0, {}), (0, 1.0, {}), (0.8, 0.9, dict(topk=2, num_draft_tokens=4))],
    ids=["T0.8", "T1", "greedy", "tree"],
)
def test_speculative_generate_wires_flashinfer_sampling(temperature, top_p, tree, flashinfer_here):
    """Chains: every verification and draw through FlashInfer; trees keep the torch acceptance rule over
    FlashInfer's p; greedy is the argmax rule, nothing sampled."""
    target, draft = tiny_target(), drafter()
    V, settings = draft.config.vocab_size, dict(max_new_tokens=12, temperature=temperature, top_p=top_p, **tree)
    g = torch.Generator().manual_seed(0)
    out = speculative_generate(target, draft, prompt(7), generator=g, sampling_backend="flashinfer", **settings)
    assert len(out.tokens) == 12
    calls, rounds = flashinfer_here.sampling.calls, len(out.accepted_per_round)
    if temperature == 0:
        assert not calls and out.tokens == speculative_generate(target, draft, prompt(7), **settings).tokens
        return
    assert [s for n, s in calls if n == "chain_speculative_sampling"] == ([] if tree else [(1, 3, V)] * rounds)
    if not tree:  # the target's first token, then each draft
        assert [s for n, s in calls if n == "sampling_from_probs"].count((1, V)) == 1 + 3 * rounds
    assert any(n == "top_p_renorm_probs" for n, _ in calls) == (top_p < 1)


# ---- on a GPU ----------------------------------------------------------------------------------------------------

GPU_MISSING = [
    need
    for need, there in [("a CUDA GPU", torch.cuda.is_available()), (INSTALL, importlib.util.find_spec("flashinfer"))]
    if not there
]


def gpu_test(test):  # marked gpu; skipped with the reason (a failure under EAGLE31_REQUIRE_GPU=1, tests/conftest.py)
    reason = f"needs {' and '.join(GPU_MISSING)} (torch {torch.__version__})"
    return pytest.mark.gpu(pytest.mark.skipif(bool(GPU_MISSING), reason=reason)(test))


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()


ROPES = [(PLAIN_ROPE, "plain_rope"), ({**YARN, "original_max_position_embeddings": 4096}, "yarn")]
DECODE_CASES = [  # (context, capacity, batch, rope): full pages, then pages longer than the length (a NaN tail)
    *[pytest.param(c, c, b, r, id=f"{c}-b{b}-{n}") for c in (1, 4096, 32768) for b in (1, 8) for r, n in ROPES],
    *[pytest.param(c, cap, 8, ROPES[1][0], id=f"{c}-of-{cap}-b8-yarn") for c, cap in [(100, 256), (4097, 8192)]],
]


@gpu_test
@pytest.mark.parametrize("context, capacity, batch, rope", DECODE_CASES)
def test_gpu_decode_equals_the_torch_absorbed_path(context, capacity, batch, rope, monkeypatch):
    """Finite, and within 2e-2 (relative to the largest output) of the torch path in bf16 and of the fp32 reference.
    Context 1 attends to the new token alone: a wrong length is O(1) there. (fp32 itself has no kernel: refused.)"""
    eager, fused, fp32 = decode_three_ways(dict(rope), batch, context, capacity, "cuda", monkeypatch)
    assert torch.isfinite(fused).all(), "FlashInfer read the cache past its length"
    assert relative_error(fused, eager) <= 2e-2, relative_error(fused, eager)
    assert relative_error(fused, fp32) <= 2e-2, relative_error(fused, fp32)


CHAINS = {  # (temperature, top_p), what accept_chain is handed as q and p: the broken wirings must fail the test
    "T1": ((1.0, 1.0), lambda q, p: (q, p)),
    "T0.7_top_p0.8": ((0.7, 0.8), lambda q, p: (q, p)),
    "broken_q_as_target": ((1.0, 1.0), lambda q, p: (q, torch.cat([q, p[:, -1:]], 1))),
    "broken_p_q_swapped": ((1.0, 1.0), lambda q, p: (p[:, :-1], torch.cat([q, p[:, -1:]], 1))),
}


@gpu_test
@pytest.mark.parametrize("case", CHAINS)
def test_gpu_chain_sampling_is_lossless(case):
    """As test_speculative.chain_first_two, on CUDA: drafts drawn from q by FlashInfer, 1e5 rounds at once."""
    sampling, wiring = CHAINS[case]
    p, q = (t.cuda() for t in small_vocab_round()[sampling])
    g = torch.Generator(device="cuda").manual_seed(0)
    drafts = torch.stack([fb.sample(q[j].expand(SAMPLES, -1), g) for j in range(q.shape[0])], 1)
    n, nxt = fb.accept_chain(drafts, *wiring(q.expand(SAMPLES, -1, -1), p.expand(SAMPLES, -1, -1)), g)
    first, second = torch.where(n >= 1, drafts[:, 0], nxt).cpu(), torch.where(n >= 2, drafts[:, 1], nxt)[n >= 1].cpu()
    if case.startswith("broken"):
        assert chi_square_p_value(first, p[0].cpu()) < 0.01
        return
    assert chi_square_p_value(first, p[0].cpu()) > 0.01
    assert second.numel() > 10_000 and chi_square_p_value(second, p[1].cpu()) > 0.01


@gpu_test
@pytest.mark.parametrize("temperature, top_p", [(1.0, 1.0), (0.7, 0.8), (1.3, 0.5)])
def test_gpu_draws_and_top_p_follow_the_library_rule(temperature, top_p):
    """FlashInfer's top-p keeps the set the torch rule keeps (random logits: no ties), and its draws follow it."""
    g = torch.Generator(device="cuda").manual_seed(1)
    logits = torch.randn(4, 16, generator=g, device="cuda") * 0.5
    want = sampling_probs(logits, temperature, top_p)
    assert ((want > 0).sum(-1) >= 3).all()  # top-p keeps several tokens: the draws have something to test
    assert torch.allclose(sampling_probs(logits, temperature, top_p, "flashinfer"), want, atol=1e-4)
    ids, _ = sample_from_logits(logits[:1].expand(SAMPLES, -1), temperature, top_p, g, "flashinfer")
    assert chi_square_p_value(ids.cpu(), want[0].cpu()) > 0.01


@gpu_test
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_gpu_speculative_generate_with_flashinfer_sampling(temperature):
    target, draft = tiny_target().cuda(), drafter().cuda()
    kwargs = dict(max_new_tokens=16, temperature=temperature, generator=torch.Generator(device="cuda").manual_seed(0))
    out = speculative_generate(target, draft, prompt(7), sampling_backend="flashinfer", **kwargs)
    assert len(out.tokens) == 16
    if temperature == 0:  # greedy: the same argmax rule as the torch backend
        assert out.tokens == speculative_generate(target, draft, prompt(7), **kwargs).tokens
