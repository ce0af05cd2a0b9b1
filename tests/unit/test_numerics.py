"""The drafter's math equals SPEC §3, written out independently in reference_math.py."""

import pytest
import torch
from safetensors.torch import load_file

import eagle31_mla.model.modeling_eagle31_mla as modeling
from eagle31_mla import Eagle31MLAConfig, Eagle31MLAForCausalLM, LatentKVCache
from eagle31_mla.model.modeling_eagle31_mla import sampling_probs
from tests.support import reference_math as ref, tiny
from tests.support.paths import GOLDEN
from tests.support.tiny import PLAIN_ROPE, TOL, YARN, aux_inputs, bf16_tolerance, draft_step_by_step, tiny_drafter

pytestmark = pytest.mark.transformers

FORMS = {
    "eagle31_yarn": dict(fc_norm=True, norm_output=True, rope_parameters=dict(YARN)),
    "eagle31_plain": dict(fc_norm=True, norm_output=True, rope_parameters=dict(PLAIN_ROPE)),
    "eagle3_yarn": dict(fc_norm=False, norm_output=False, rope_parameters=dict(YARN)),
    "eagle3_plain": dict(fc_norm=False, norm_output=False, rope_parameters=dict(PLAIN_ROPE)),
    "fc_norm_only": dict(fc_norm=True, norm_output=False, rope_parameters=dict(YARN)),
    "norm_output_only": dict(fc_norm=False, norm_output=True, rope_parameters=dict(PLAIN_ROPE)),
}


def drafter_from_file(folder, seed, form):
    """A tiny drafter written as config.json + safetensors and loaded back: the library and the
    reference then each read that raw file their own way (the reference never sees the library's parse)."""
    model = tiny_drafter(seed=seed, **FORMS[form])
    tiny.write_checkpoint(folder, tiny.published_style_config(model), model.state_dict())
    return Eagle31MLAForCausalLM.from_pretrained(folder, dtype=torch.float32)


def reference(model, input_ids, aux=None, h=None, positions=None, variant="exact"):
    """The reference's outputs for ``model``, a drafter loaded from a folder (its raw config.json, its weights)."""
    w = {k: v.detach() for k, v in model.state_dict().items()}
    cfg = ref.config_dict(model.config.name_or_path)
    if h is None:
        h = ref.combine(w, cfg, aux, variant)
    if positions is None:
        positions = torch.arange(input_ids.shape[1]).expand_as(input_ids)
    return ref.forward(w, cfg, input_ids, h, positions, variant)


@pytest.mark.parametrize("form", FORMS)
def test_first_step_equals_reference_and_not_its_deliberate_bugs(form, tmp_path):
    model = drafter_from_file(tmp_path, seed=3, form=form)
    ids, aux = aux_inputs(model.config, batch=2, length=9)
    out = model(ids, aux_hidden_states=aux)
    logits, state = reference(model, ids, aux)
    assert out.logits.shape == (2, 9, model.config.draft_vocab_size)
    assert (out.logits - logits).abs().max() <= TOL
    assert (out.hidden_states - state).abs().max() <= TOL
    # the comparison can fail: every deliberate bug that applies to this form moves the outputs far beyond TOL
    bugs = ["neox_rope", "no_rope", "wrong_state", "hidden_first"]
    if FORMS[form]["fc_norm"]:
        bugs.append("skip_fc_norm")
    if FORMS[form]["rope_parameters"]["rope_type"] == "yarn":
        bugs.append("no_mscale")
    for variant in bugs:
        logits, state = reference(model, ids, aux, variant=variant)
        gap = max((out.logits - logits).abs().max().item(), (out.hidden_states - state).abs().max().item())
        assert gap > 1e-2, f"variant {variant} is indistinguishable from the model (gap {gap})"


@pytest.mark.parametrize("name", ["eagle31_yarn", "eagle3_plain"])
def test_golden_vectors(name):
    """Third opinion: outputs of an independent fp32 implementation shipped with the project."""
    model = Eagle31MLAForCausalLM.from_pretrained(GOLDEN / name)
    e = load_file(GOLDEN / name / "expected.safetensors")
    out = model(e["input_ids"], aux_hidden_states=e["aux_hidden_states"])
    assert (out.logits - e["logits"]).abs().max() <= TOL
    assert (out.hidden_states - e["next_hidden_states"]).abs().max() <= TOL
    for absorb in (True, False):
        first = model(e["input_ids"], aux_hidden_states=e["aux_hidden_states"])
        step = model(
            e["decode_input_ids"],
            hidden_states=first.hidden_states[:, -1:],
            position_ids=e["decode_position_ids"],
            past_key_values=first.past_key_values,
            absorb=absorb,
        )
        assert (step.logits - e["decode_logits"]).abs().max() <= TOL
        assert (step.hidden_states - e["decode_next_hidden_states"]).abs().max() <= TOL
    # and our own reference agrees with the golden file too
    logits, _ = reference(model, e["input_ids"], e["aux_hidden_states"])
    assert (logits - e["logits"]).abs().max() <= TOL


@pytest.mark.parametrize("form", ["eagle31_yarn", "eagle3_plain"])
@pytest.mark.parametrize("absorb", [True, False])
def test_cached_chain_equals_recompute_from_scratch(form, absorb, tmp_path):
    """Three chained draft steps through the latent cache == one uncached pass over all positions."""
    model = drafter_from_file(tmp_path, seed=5, form=form)
    ids, aux = aux_inputs(model.config, batch=2, length=6)
    out = model(ids, aux_hidden_states=aux)
    cache = out.past_key_values
    chain_ids, chain_states, chain_logits = [], [out.hidden_states], [out.logits]
    next_id = out.logits[:, -1:].argmax(-1)
    state = out.hidden_states[:, -1:]
    for _ in range(3):
        step = model(next_id, hidden_states=state, past_key_values=cache, absorb=absorb)
        chain_ids.append(next_id)
        chain_logits.append(step.logits)
        chain_states.append(step.hidden_states)
        state, next_id = step.hidden_states, step.logits.argmax(-1)
    assert cache.get_seq_length() == 9

    # From scratch: the fed-in state at each chain position is the previous position's output state.
    all_ids = torch.cat([ids] + chain_ids, dim=1)
    h_in = torch.cat([model.combine_hidden_states(aux)] + [s[:, -1:] for s in chain_states[:-1]], dim=1)
    scratch = model(all_ids, hidden_states=h_in, use_cache=False, absorb=False)
    assert (torch.cat(chain_logits, 1) - scratch.logits).abs().max() <= TOL
    assert (torch.cat(chain_states, 1) - scratch.hidden_states).abs().max() <= TOL
    # and the independent reference agrees with the whole chain
    logits, state = reference(model, all_ids, h=h_in)
    assert (torch.cat(chain_logits, 1) - logits).abs().max() <= TOL


def test_latent_cache_stores_only_c_kv_and_k_pe():
    model = tiny_drafter()
    ids, aux = aux_inputs(model.config, batch=1, length=5)
    cache = model(ids, aux_hidden_states=aux).past_key_values
    assert isinstance(cache, LatentKVCache) and cache.nbytes_per_token() == (32 + 16) * 4
    assert (cache.c_kv.shape[-1], cache.k_pe.shape[-1]) == (model.config.kv_lora_rank, model.config.qk_rope_head_dim)
    # the stored c_kv is normalised (kv_a_layernorm applied) and k_pe is rotated: recompute both
    layer = model.layers[0]
    embeds, h = layer.input_layernorm(model.embed_tokens(ids)), layer.hidden_norm(model.combine_hidden_states(aux))
    c_kv, k_pe = layer.self_attn.kv_a_proj_with_mqa(torch.cat([embeds, h], -1)).split([32, 16], -1)
    assert torch.allclose(cache.c_kv[:, :5], layer.self_attn.kv_a_layernorm(c_kv), atol=1e-6)
    assert not torch.allclose(cache.k_pe[:, 1:5], k_pe[:, 1:], atol=1e-3)  # rotated for positions > 0
    assert torch.allclose(cache.k_pe[:, 0], k_pe[:, 0], atol=1e-6)  # position 0: identity rotation
    # Kimi-K3's: 1,152 bytes a token in bf16
    cache = LatentKVCache.for_model(Eagle31MLAConfig(), 1, dtype=torch.bfloat16, device="cpu", capacity=4)
    assert cache.nbytes_per_token() == 1152 and cache.nbytes_allocated() == 4 * 1152


def test_cache_grows_and_crops_and_multi_token_steps_absorbed_or_not_agree():
    model = tiny_drafter()
    ids, aux = aux_inputs(model.config, batch=1, length=300)  # beyond the initial capacity
    cache = LatentKVCache.for_model(model.config, 1, dtype=torch.float32, device="cpu", capacity=8)
    full = model(ids, aux_hidden_states=aux, past_key_values=cache)
    assert cache.get_seq_length() == 300
    for absorb in (True, False):  # then a 100-token step over the cropped cache, either way
        cache.crop(200)
        again = model(ids[:, 200:], aux_hidden_states=aux[:, 200:], past_key_values=cache, absorb=absorb)
        assert (again.logits - full.logits[:, 200:]).abs().max() <= TOL, absorb


def test_padding_mask_matches_unpadded_rows():
    model = tiny_drafter(seed=2)
    ids, aux = aux_inputs(model.config, batch=1, length=6)
    alone = model(ids, aux_hidden_states=aux)
    pad = 3  # left padding, positions still start at 0 for the real tokens
    ids_p = torch.cat([torch.zeros(1, pad, dtype=torch.long), ids], 1)
    aux_p = torch.cat([torch.zeros(1, pad, aux.shape[-1]), aux], 1)
    mask = torch.cat([torch.zeros(1, pad), torch.ones(1, 6)], 1).long()
    positions = torch.cat([torch.zeros(1, pad, dtype=torch.long), torch.arange(6)[None]], 1)
    padded = model(ids_p, aux_hidden_states=aux_p, attention_mask=mask, position_ids=positions)
    assert (padded.logits[:, pad:] - alone.logits).abs().max() <= TOL


def test_draft_greedy_equals_manual_chain():
    """draft's greedy chain is the argmax chain of forward, drafted step by step (tiny.draft_step_by_step). That takes
    other shapes than draft's one-row products, so it may round differently: fed draft's own tokens, each must be an
    argmax within TOL of its logits, and the argmax itself wherever the top-2 margin exceeds TOL (no near-tie)."""
    model = tiny_drafter(seed=11)
    ids, aux = aux_inputs(model.config, batch=2, length=7)
    drafted = model.draft(ids, aux, num_tokens=4)
    for b, tokens in enumerate(drafted.tokens):  # target ids = draft ids here (full vocabulary)
        sequence = torch.cat([ids[b, :1], ids[b], tokens])[None]  # it feeds x[t+1] with aux[t]: a placeholder first
        logits = torch.cat(draft_step_by_step(model, sequence, aux[b : b + 1], t=6, depth=4))  # [4, V]
        top2 = logits.topk(2, dim=-1).values
        assert (logits.gather(-1, tokens[:, None])[:, 0] >= top2[:, 0] - TOL).all()
        clear = top2[:, 0] - top2[:, 1] > TOL
        assert torch.equal(tokens[clear], logits.argmax(-1)[clear])  # integer ids: exact
    assert drafted.probs.shape == (2, 4, model.config.draft_vocab_size)
    assert drafted.past_key_values.get_seq_length() == 7 + 3


def test_logits_to_keep_is_the_tail_of_the_full_logits():
    model = tiny_drafter(seed=12)
    ids, aux = aux_inputs(model.config, batch=2, length=6)
    full = model(ids, aux_hidden_states=aux, use_cache=False)
    for keep in (1, 3):
        tail = model(ids, aux_hidden_states=aux, use_cache=False, logits_to_keep=keep)
        assert tail.logits.shape == (2, keep, model.config.draft_vocab_size)
        assert torch.allclose(tail.logits, full.logits[:, -keep:], atol=1e-6)  # a 1-row product may take the mv kernel
        assert torch.equal(tail.hidden_states, full.hidden_states)  # same kernels on the same shapes: exact


def test_draft_sampling_temperature_and_top_p():
    model = tiny_drafter(seed=11)
    ids, aux = aux_inputs(model.config, batch=1, length=7)
    a, b = (
        model.draft(ids, aux, 3, temperature=0.8, top_p=0.9, generator=torch.Generator().manual_seed(0))
        for _ in range(2)
    )
    assert torch.equal(a.tokens, b.tokens)  # seeded, same computation on the same shapes: reproducible
    # q is the library's rule (test_speculative.py's SAMPLING_BY_HAND) on the last position's logits, as draft
    # computes them (the same one-row product, so the same top-p cutoff)
    probs, logits = a.probs[0, 0], model(ids, aux_hidden_states=aux, logits_to_keep=1).logits[0, -1]
    assert torch.allclose(probs, sampling_probs(logits, 0.8, 0.9), atol=1e-6) and 1 < (probs > 0).sum() < len(probs)
    # the chosen tokens always come from the kept set
    for _ in range(20):
        t = model.draft(ids, aux, num_tokens=1, temperature=0.8, top_p=0.9).tokens[0, 0]
        assert probs[t] > 0


def test_cpu_bf16_choice_is_made_in_one_place(monkeypatch):
    monkeypatch.setattr(modeling, "CPU_NATIVE_BF16", False)
    assert modeling.latent_attention_dtype(torch.bfloat16, torch.device("cpu")) == torch.float32
    assert modeling.latent_attention_dtype(torch.float32, torch.device("cpu")) == torch.float32
    assert modeling.latent_attention_dtype(torch.bfloat16, torch.device("meta")) == torch.bfloat16  # not a CPU
    monkeypatch.setattr(modeling, "CPU_NATIVE_BF16", True)
    assert modeling.latent_attention_dtype(torch.bfloat16, torch.device("cpu")) == torch.bfloat16
    for value, native in (("0", False), ("1", True)):
        monkeypatch.setenv("EAGLE31_CPU_NATIVE_BF16", value)
        assert modeling._detect_cpu_native_bf16() is native
    monkeypatch.setenv("EAGLE31_CPU_NATIVE_BF16", "yes")
    with pytest.raises(ValueError, match="EAGLE31_CPU_NATIVE_BF16='yes'; expected 0"):
        modeling._detect_cpu_native_bf16()
    monkeypatch.delenv("EAGLE31_CPU_NATIVE_BF16")
    assert isinstance(modeling._detect_cpu_native_bf16(), bool)  # torch's CPU capabilities, or /proc/cpuinfo


@torch.no_grad()
def masked_decode_step(model, ids, aux):
    """The context, then a 3-token absorbed step over its cache (a causal mask)."""
    out = model(ids, aux_hidden_states=aux.to(model.dtype))
    return model(ids[:, :3], hidden_states=out.hidden_states[:, -3:], past_key_values=out.past_key_values, absorb=True)


def test_bf16_stays_close_to_fp32_and_cpu_bf16_attention_paths_agree(monkeypatch):
    """The fp32 attention taken on CPUs without native bf16 equals the native bf16 one within bf16
    rounding: the attention alone, and a masked multi-token decode step of the whole drafter; both stay
    close to the fp32 drafter."""
    model = tiny_drafter(seed=9).to(torch.bfloat16)
    g = torch.Generator().manual_seed(0)
    q_nope, q_pe = torch.randn(2, 4, 3, 32, generator=g).bfloat16().split([16, 16], -1)
    latent = torch.randn(2, 500, 32 + 16, generator=g).bfloat16()
    mask = torch.rand(2, 1, 3, 500, generator=g) < 0.8
    ids, aux = aux_inputs(model.config, batch=2, length=300)
    cores, steps = [], []
    for native in (True, False):
        monkeypatch.setattr(modeling, "CPU_NATIVE_BF16", native)
        cores.append(model.layers[0].self_attn._absorbed(q_nope, q_pe, latent, mask).float())
        steps.append(masked_decode_step(model, ids, aux))
    assert (cores[0] - cores[1]).abs().max() <= bf16_tolerance(cores[0])
    for name in ("logits", "hidden_states"):
        native, fp32 = getattr(steps[0], name).float(), getattr(steps[1], name).float()
        assert (native - fp32).abs().max() <= bf16_tolerance(native), name
    # and both stay with the fp32 model (bf16 weights and inputs: a looser, relative bound)
    ref = masked_decode_step(tiny_drafter(seed=9), ids, aux)
    for step in steps:
        assert step.logits.dtype == torch.bfloat16 and step.past_key_values.nbytes_per_token() == (32 + 16) * 2
        assert (step.logits.float() - ref.logits).abs().max() <= 0.05 * ref.logits.abs().max()
        assert (step.logits.argmax(-1) == ref.logits.argmax(-1)).float().mean() >= 0.9
