"""Bad input gets a clear error that names the tensor or field and what was expected."""

import json

import pytest
import torch

from eagle31_mla import CheckpointError, ConfigError, Eagle31MLAForCausalLM, LatentKVCache
from eagle31_mla.model.modeling_eagle31_mla import DraftInputError
from tests.support.tiny import aux_inputs, published_style_config, tiny_drafter, write_checkpoint

# Runs again on the other transformers versions (scripts/test.sh): see tests/unit/test_transformers_selection.py.
pytestmark = pytest.mark.transformers


@pytest.fixture
def good():
    model = tiny_drafter(seed=8)
    return model, published_style_config(model), dict(model.state_dict())


def load(tmp_path, config, tensors):
    return Eagle31MLAForCausalLM.from_pretrained(write_checkpoint(tmp_path, config, tensors))


def test_missing_tensor(tmp_path, good):
    _, config, tensors = good
    del tensors["layers.0.self_attn.kv_a_layernorm.weight"]
    with pytest.raises(
        CheckpointError, match=r"missing tensor 'layers.0.self_attn.kv_a_layernorm.weight', expected shape \[32\]"
    ):
        load(tmp_path, config, tensors)


def test_extra_tensor(tmp_path, good):
    _, config, tensors = good
    tensors["layers.0.self_attn.g_proj.weight"] = torch.zeros(80, 128)  # NeMo's K3 gate: another architecture
    with pytest.raises(CheckpointError, match="unexpected tensor 'layers.0.self_attn.g_proj.weight'"):
        load(tmp_path, config, tensors)


def test_wrong_shape(tmp_path, good):
    _, config, tensors = good
    tensors["layers.0.self_attn.kv_b_proj.weight"] = torch.zeros(4 * 36, 16)
    with pytest.raises(
        CheckpointError, match=r"'layers.0.self_attn.kv_b_proj.weight' has shape \[144, 16\], expected \[144, 32\]"
    ):
        load(tmp_path, config, tensors)


def test_wrong_dtype(tmp_path, good):
    _, config, tensors = good
    tensors["norm.weight"] = torch.ones(64, dtype=torch.int32)
    with pytest.raises(CheckpointError, match="'norm.weight' has dtype I32, expected a floating-point dtype"):
        load(tmp_path, config, tensors)


def test_every_problem_is_listed_at_once(tmp_path, good):
    _, config, tensors = good
    del tensors["fc.weight"]
    tensors["extra.weight"] = torch.zeros(1)
    with pytest.raises(CheckpointError, match=r"2 problem\(s\)") as err:
        load(tmp_path, config, tensors)
    assert "'fc.weight'" in str(err.value) and "'extra.weight'" in str(err.value)


def test_eagle31_config_without_fc_norm_weights(tmp_path, good):
    _, config, tensors = good
    for i in range(3):
        del tensors[f"fc_norm.{i}.weight"]
    with pytest.raises(CheckpointError, match="missing tensor 'fc_norm.0.weight'.*fc_norm: true"):
        load(tmp_path, config, tensors)


def test_eagle3_config_with_fc_norm_weights(tmp_path, good):
    _, config, tensors = good
    del config["fc_norm"]
    with pytest.raises(CheckpointError, match="unexpected tensor 'fc_norm.0.weight'.*set fc_norm: true"):
        load(tmp_path, config, tensors)


def test_fc_width_inconsistent_with_target_hidden_size(tmp_path, good):
    _, config, tensors = good
    config["target_hidden_size"] = 64  # fc was trained on 3 × 48
    with pytest.raises(CheckpointError, match=r"'fc.weight' has shape \[64, 144\], expected \[64, 192\]"):
        load(tmp_path, config, tensors)


def test_number_of_aux_states_inconsistent_with_fc(tmp_path, good):
    _, config, tensors = good
    config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [2, 5, 9, 12]
    with pytest.raises(CheckpointError, match=r"'fc.weight' has shape \[64, 144\], expected \[64, 192\]"):
        load(tmp_path, config, tensors)


def test_truncated_safetensors(tmp_path, good):
    _, config, tensors = good
    folder = write_checkpoint(tmp_path, config, tensors)
    data = (folder / "model.safetensors").read_bytes()
    (folder / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="model.safetensors is not a readable safetensors file"):
        Eagle31MLAForCausalLM.from_pretrained(folder)


def test_corrupt_safetensors_header(tmp_path, good):
    _, config, tensors = good
    folder = write_checkpoint(tmp_path, config, tensors)
    data = bytearray((folder / "model.safetensors").read_bytes())
    data[8:16] = b"not json"
    (folder / "model.safetensors").write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="not a readable safetensors file"):
        Eagle31MLAForCausalLM.from_pretrained(folder)


def test_pickle_weights_are_refused(tmp_path, good):
    _, config, tensors = good
    tmp_path.joinpath("config.json").write_text(json.dumps(config))
    torch.save(tensors, tmp_path / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match="only pickle weights.*pytorch_model.bin.*safetensors"):
        Eagle31MLAForCausalLM.from_pretrained(tmp_path)


def test_no_weights(tmp_path, good):
    _, config, _ = good
    tmp_path.joinpath("config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="neither model.safetensors nor model.safetensors.index.json"):
        Eagle31MLAForCausalLM.from_pretrained(tmp_path)


def test_d2t_out_of_range_and_wrong_length(tmp_path):
    model = tiny_drafter(seed=3, draft_vocab_size=100)
    config, tensors = published_style_config(model), dict(model.state_dict())
    tensors["d2t"] = tensors["d2t"].clone()
    tensors["d2t"][-1] = 10_000
    with pytest.raises(CheckpointError, match=r"'d2t' maps draft ids to target ids in .*\[0, 300\)"):
        load(tmp_path / "a", config, tensors)
    tensors["d2t"] = torch.zeros(99, dtype=torch.long)
    with pytest.raises(CheckpointError, match=r"'d2t' has shape \[99\], expected \[100\]"):
        load(tmp_path / "b", config, tensors)
    tensors["d2t"] = model.d2t.float()
    with pytest.raises(CheckpointError, match="'d2t' has dtype F32, expected an integer dtype"):
        load(tmp_path / "c", config, tensors)


@pytest.mark.parametrize(
    "change, error, message",
    [
        (lambda c: c.update(rope_scaling={"type": "dynamic", "factor": 2.0}), ConfigError, "dynamic"),
        (lambda c: c["eagle_config"].update(eagle_aux_hidden_state_layer_ids=[0, 4, 4]), ConfigError, "duplicates"),
        (lambda c: c["eagle_config"].update(eagle_aux_hidden_state_layer_ids=[9, 2, 5]), ConfigError, "ascending"),
        (lambda c: c.update(eagle_aux_hidden_state_layer_ids=[0, 2, 5]), ConfigError, ">= 1"),
        (lambda c: c.update(target_num_hidden_layers=8), ConfigError, "depth of 8"),
    ],
)
def test_bad_config_through_from_pretrained(tmp_path, good, change, error, message):
    _, config, tensors = good
    change(config)
    with pytest.raises(error, match=message):
        load(tmp_path, config, tensors)


def test_runtime_input_checks():
    model = tiny_drafter()
    ids, aux = aux_inputs(model.config, 1, 4)
    with pytest.raises(ValueError, match=r"`aux_hidden_states` has shape \(1, 4, 128\); expected \(1, 4, 144\)"):
        model(ids, aux_hidden_states=aux[..., :128])
    with pytest.raises(ValueError, match="dtype torch.int64; expected a floating-point"):
        model(ids, aux_hidden_states=aux.long())
    with pytest.raises(ValueError, match="exactly one of"):
        model(ids)
    with pytest.raises(ValueError, match="beyond max_position_embeddings 4096"):
        model(ids, aux_hidden_states=aux, position_ids=torch.arange(4094, 4098)[None])
    with pytest.raises(ValueError, match=r"`hidden_states` has shape \(1, 4, 48\); expected \(1, 4, 64\)"):
        model(ids, hidden_states=aux[..., :48])


def test_non_finite_states_are_refused():
    """NaN/inf in the captured target states (or in a fed-back state) is refused before any compute:
    it would otherwise spread into every logit and draft silently (one isfinite pass over the input)."""
    model = tiny_drafter()
    ids, aux = aux_inputs(model.config, 1, 4)
    for bad in (float("nan"), float("inf"), float("-inf")):
        poisoned = aux.clone()
        poisoned[0, 2, 7] = bad
        with pytest.raises(
            ValueError,
            match=r"`aux_hidden_states` holds 1 non-finite value\(s\) \(NaN or inf\); expected "
            r"finite values \(they come from the target's captured layers",
        ):
            model(ids, aux_hidden_states=poisoned)
        with pytest.raises(ValueError, match="`aux_hidden_states` holds 1 non-finite"):
            model.draft(ids, poisoned, num_tokens=2)
    out = model(ids, aux_hidden_states=aux)
    state = out.hidden_states[:, -1:].clone()
    state[..., :3] = float("nan")
    with pytest.raises(ValueError, match=r"`hidden_states` holds 3 non-finite value\(s\).*the previous draft step"):
        model(ids[:, :1], hidden_states=state, past_key_values=out.past_key_values)
    assert out.past_key_values.get_seq_length() == 4  # the refused step wrote nothing to the cache


def test_runtime_dtype_ids_and_positions():
    model = tiny_drafter()
    ids, aux = aux_inputs(model.config, 2, 4)
    with pytest.raises(
        ValueError,
        match=r"`aux_hidden_states` has dtype torch.bfloat16; expected torch.float32, the "
        r"drafter's dtype \(cast with `.to\(torch.float32\)`\)",
    ):
        model(ids, aux_hidden_states=aux.bfloat16())
    with pytest.raises(ValueError, match=r"`hidden_states` has dtype torch.float64; expected torch.float32"):
        model(ids, hidden_states=torch.zeros(2, 4, 64, dtype=torch.float64))
    too_big = ids.clone()
    too_big[1, 3] = 300
    with pytest.raises(
        ValueError, match=r"`input_ids` hold ids in \[\d+, 300\]; expected ids in \[0, 300\) \(vocab_size"
    ):
        model(too_big, aux_hidden_states=aux)
    with pytest.raises(ValueError, match=r"`input_ids` must be a \[B, T\] tensor of token ids"):
        model(ids[0], aux_hidden_states=aux)
    with pytest.raises(ValueError, match=r"`position_ids` reach -1, below 0 \(expected positions in \[0, 4096\)\)"):
        model(ids, aux_hidden_states=aux, position_ids=torch.arange(-1, 3)[None])
    with pytest.raises(ValueError, match=r"`position_ids` has shape \(1, 3\); expected \(2, 4\)"):
        model(ids, aux_hidden_states=aux, position_ids=torch.arange(3)[None])
    # drafting past the last position: the first token fits, the step that would reach 4096 is refused
    assert model.draft(ids, aux, 1, position_ids=torch.arange(4092, 4096).expand(2, 4)).tokens.shape == (2, 1)
    with pytest.raises(ValueError, match="`position_ids` reach 4096, beyond max_position_embeddings 4096"):
        model.draft(ids, aux, 2, position_ids=torch.arange(4092, 4096).expand(2, 4))


def test_missing_local_folder():
    """A path that does not exist is not sent to the Hub as a repo id."""
    for name in ("/nonexistent/eagle31-draft", "./no-such-draft"):
        with pytest.raises(FileNotFoundError, match=f"{name}: no such folder"):
            Eagle31MLAForCausalLM.from_pretrained(name)


def test_implicit_positions_beyond_the_limit():
    model = tiny_drafter()
    ids, aux = aux_inputs(model.config, 1, 4)
    cache = model(ids, aux_hidden_states=aux).past_key_values
    cache.latent = cache.latent.new_zeros(1, model.config.max_position_embeddings, cache.latent.shape[-1])
    cache.length = model.config.max_position_embeddings - 2  # as if the context had grown that long
    with pytest.raises(
        ValueError, match=r"cache holds 4094 tokens, so these 4 new token\(s\) take positions up to 4097"
    ):
        model(ids, hidden_states=torch.zeros(1, 4, 64), past_key_values=cache)


def test_cache_of_another_batch_is_refused_before_it_is_written():
    """A batch-2 cache given a batch-1 step used to overwrite the other sequence's row silently."""
    model = tiny_drafter()
    ids, aux = aux_inputs(model.config, 2, 4)
    out = model(ids, aux_hidden_states=aux)
    cache = out.past_key_values
    before = cache.latent[:, : cache.length].clone()  # the written part (the rest of the buffer is uninitialised)
    with pytest.raises(
        ValueError, match=r"`past_key_values` does not fit: it has batch size 2 \(these inputs have batch size 1"
    ):
        model(ids[:1, :1], hidden_states=out.hidden_states[:1, -1:], past_key_values=cache)
    with pytest.raises(
        ValueError, match=r"`past_key_values` does not fit: it has batch size 2 \(these inputs have batch size 1"
    ):
        model.draft(ids[:1], aux[:1], 2, past_key_values=cache)
    assert cache.get_seq_length() == 4 and torch.equal(cache.latent[:, :4], before)  # nothing written (exact copy)


def test_cache_of_another_kind_or_drafter_is_refused():
    from transformers import DynamicCache

    model = tiny_drafter()
    ids, aux = aux_inputs(model.config, 1, 4)
    with pytest.raises(
        TypeError, match=r"`past_key_values` is a transformers.DynamicCache; expected this drafter's LatentKVCache"
    ):
        model(ids, aux_hidden_states=aux, past_key_values=DynamicCache())
    other = tiny_drafter(kv_lora_rank=16, qk_rope_head_dim=8)(ids, aux_hidden_states=aux).past_key_values
    with pytest.raises(
        ValueError,
        match=r"kv_lora_rank 16 \+ rope dim 8 per token \(this drafter: kv_lora_rank 32 \+ qk_rope_head_dim 16",
    ):
        model(ids, aux_hidden_states=aux, past_key_values=other)
    cache = model(ids, aux_hidden_states=aux).past_key_values
    with pytest.raises(ValueError, match=r"`past_key_values` was given with use_cache=False"):
        model(ids, aux_hidden_states=aux, past_key_values=cache, use_cache=False)
    bf16 = LatentKVCache.for_model(model.config, 1, dtype=torch.bfloat16, device="cpu")
    with pytest.raises(ValueError, match=r"dtype torch.bfloat16 \(this drafter: torch.float32\)"):
        model(ids, aux_hidden_states=aux, past_key_values=bf16)


def test_crop_outside_the_cache_is_refused_by_name():
    """crop can only drop tokens: a length beyond the cache or below 0 is the library's DraftInputError
    (a ValueError), naming the argument and the range it must be in; the cache is left as it was."""
    model = tiny_drafter()
    ids, aux = aux_inputs(model.config, 1, 4)
    cache = model(ids, aux_hidden_states=aux).past_key_values
    for bad in (7, 5, -1, -5):
        with pytest.raises(
            DraftInputError, match=rf"`length` is {bad}; expected an int in \[0, 4\] \(the cache holds 4 tokens"
        ):
            cache.crop(bad)
        assert cache.get_seq_length() == 4
    for bad in (2.0, "2", None, True):
        with pytest.raises(DraftInputError, match=r"`length` is a \w+; expected an int number of tokens to keep"):
            cache.crop(bad)
    cache.crop(4)
    cache.crop(0)
    assert cache.get_seq_length() == 0


@pytest.mark.parametrize("length", [-2, -1, 257, 10**6])
def test_cache_length_outside_its_capacity_is_refused(length):
    """A cache whose length was set by hand outside [0, capacity] is refused before it is read or written,
    with its length and capacity (never a nonsense count of tokens that would fit)."""
    model = tiny_drafter()
    ids, aux = aux_inputs(model.config, 1, 4)
    out = model(ids, aux_hidden_states=aux)
    cache = out.past_key_values
    cache.length = length
    before = cache.latent.detach().clone().view(torch.uint8)  # bytes: the unused capacity may hold NaN
    message = (
        rf"`past_key_values` has length {length}, outside \[0, 256\] \(its capacity\); expected a cache whose length"
    )
    with pytest.raises(DraftInputError, match=message):
        model(ids[:, :1], hidden_states=out.hidden_states[:, -1:], past_key_values=cache)
    with pytest.raises(DraftInputError, match=message):
        model.draft(ids, aux, 2, past_key_values=cache)
    assert torch.equal(cache.latent.detach().view(torch.uint8), before) and cache.length == length


def test_unknown_forward_arguments_are_refused_by_name():
    """forward(**kwargs) takes only Transformers' output switches at their only supported values; anything
    else (a Transformers-style `inputs_embeds`, `cache_position`, a typo) is refused by name."""
    model = tiny_drafter(seed=8)
    ids, aux = aux_inputs(model.config, 1, 4)
    for name, value in (
        ("inputs_embeds", torch.zeros(1, 4, 64)),
        ("cache_position", torch.arange(4)),
        ("use_cahce", True),
    ):
        with pytest.raises(DraftInputError, match=rf"`{name}` is not an argument of this drafter's forward"):
            model(ids, aux_hidden_states=aux, **{name: value})
    with pytest.raises(DraftInputError, match="`output_attentions` is True"):
        model(ids, aux_hidden_states=aux, output_attentions=True)
    plain = model(ids, aux_hidden_states=aux).logits
    legit = model(ids, aux_hidden_states=aux, return_dict=True, output_attentions=False, output_hidden_states=False)
    assert torch.equal(legit.logits, plain)  # exact: the same kernels on the same inputs in one process


def test_attn_implementation_is_eager_and_nothing_else_is_claimed(tmp_path, good):
    """The drafter's MLA attention is its own code: Transformers reports "eager", `from_pretrained` accepts
    no value, "eager" or "flashinfer" (tests/unit/test_flashinfer.py), and refuses sdpa / flash attention by
    name instead of ignoring them."""
    model, config, tensors = good
    assert model.config._attn_implementation == "eager"
    assert not getattr(type(model), "_supports_sdpa", False)
    folder = write_checkpoint(tmp_path, config, tensors)
    assert (
        Eagle31MLAForCausalLM.from_pretrained(folder, attn_implementation="eager").config._attn_implementation
        == "eager"
    )
    for implementation in ("sdpa", "flash_attention_2"):
        with pytest.raises(
            ConfigError,
            match=rf"`attn_implementation` is '{implementation}'; expected one of \(None, 'eager', 'flashinfer'\)",
        ):
            Eagle31MLAForCausalLM.from_pretrained(folder, attn_implementation=implementation)
