"""The checkpoint contract: the published roster and other layouts of the same tensors, loaded exactly (what it
refuses: tests/unit/test_bad_inputs.py)."""

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from eagle31_mla import Eagle31MLAConfig, Eagle31MLAForCausalLM
from eagle31_mla.model.configuration_eagle31_mla import AUTO_MAP
from tests.support.tiny import aux_inputs, published_style_config, same_logits, tiny_drafter, write_checkpoint

pytestmark = pytest.mark.transformers

# SPEC §2, transcribed here on purpose (not imported from the library): the published file's header.
PUBLISHED = {
    "embed_tokens.weight": [163840, 7168],
    "fc.weight": [7168, 21504],
    "fc_norm.0.weight": [7168],
    "fc_norm.1.weight": [7168],
    "fc_norm.2.weight": [7168],
    "layers.0.hidden_norm.weight": [7168],
    "layers.0.input_layernorm.weight": [7168],
    "layers.0.post_attention_layernorm.weight": [7168],
    "layers.0.self_attn.q_a_proj.weight": [1536, 14336],
    "layers.0.self_attn.q_a_layernorm.weight": [1536],
    "layers.0.self_attn.q_b_proj.weight": [12288, 1536],
    "layers.0.self_attn.kv_a_proj_with_mqa.weight": [576, 14336],
    "layers.0.self_attn.kv_a_layernorm.weight": [512],
    "layers.0.self_attn.kv_b_proj.weight": [16384, 512],
    "layers.0.self_attn.o_proj.weight": [7168, 8192],
    "layers.0.mlp.gate_proj.weight": [18432, 7168],
    "layers.0.mlp.up_proj.weight": [18432, 7168],
    "layers.0.mlp.down_proj.weight": [7168, 18432],
    "norm.weight": [7168],
    "lm_head.weight": [163840, 7168],
}


def test_default_config_reproduces_the_published_roster_and_the_library_compares_with_it():
    from eagle31_mla.hub.roster import PUBLISHED_NUM_PARAMETERS as N, PUBLISHED_ROSTER, roster_differences

    model = Eagle31MLAForCausalLM.on_meta_device(Eagle31MLAConfig())
    state = model.state_dict()
    assert {k: list(v.shape) for k, v in state.items()} == PUBLISHED
    assert {v.dtype for v in state.values()} == {torch.bfloat16}
    # bytes on disk: bf16 data + 8-byte length + 2,128-byte header = 6,031,253,592, the pinned file size
    assert sum(v.numel() for v in state.values()) == 3_015_625_728 == N
    assert all(p.is_meta for p in model.parameters())
    assert {k: list(v) for k, v in PUBLISHED_ROSTER.items()} == PUBLISHED  # the library compares with SPEC's
    assert roster_differences({**PUBLISHED, "g_proj.weight": [1]}) == ["extra g_proj.weight [1]"]
    assert (
        roster_differences(PUBLISHED, dtypes=["BF16"]) == roster_differences(PUBLISHED, dtypes=[torch.bfloat16]) == []
    )
    assert roster_differences(PUBLISHED, dtypes=["F32"]) == ["dtypes ['float32'], published bfloat16"]
    assert roster_differences(PUBLISHED, num_parameters=N + 1) == [f"{N + 1:,} parameters, published {N:,}"]


def test_save_pretrained_writes_exactly_the_published_names(tmp_path):
    model = tiny_drafter()
    model.save_pretrained(tmp_path)
    with safe_open(tmp_path / "model.safetensors", "pt") as f:
        assert sorted(f.keys()) == sorted(PUBLISHED)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["architectures"] == ["Eagle3DeepseekV2ForCausalLM"]
    auto_map = {"AutoConfig": "configuration_eagle31_mla.Eagle31MLAConfig"}  # as Transformers names them
    auto_map["AutoModelForCausalLM"] = "modeling_eagle31_mla.Eagle31MLAForCausalLM"
    assert config["auto_map"] == AUTO_MAP == auto_map
    assert same_logits(Eagle31MLAForCausalLM.from_pretrained(tmp_path), model)


@pytest.mark.parametrize(
    "file_of",  # the file model.safetensors.index.json puts the i-th tensor (sorted by name) in
    [lambda i: f"model-0000{1 + (i >= 10)}-of-00002.safetensors", lambda i: "shards/all.safetensors"],
    ids=["sharded", "a subfolder"],
)
def test_indexed_shards_load_with_identical_logits(tmp_path, file_of):
    """(Renamed tensors and EAGLE-3 load in tests/cli/test_convert.py, the Hub cache's links in test_hub.py.)"""
    model, files = tiny_drafter(seed=1), {}
    state = model.state_dict()
    for i, name in enumerate(sorted(state)):
        files.setdefault(file_of(i), {})[name] = state[name].contiguous()
    for file, tensors in files.items():
        (tmp_path / file).parent.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(tmp_path / file))
    index = {"metadata": {}, "weight_map": {name: file for file, tensors in files.items() for name in tensors}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    (tmp_path / "config.json").write_text(json.dumps(published_style_config(model)))
    assert same_logits(Eagle31MLAForCausalLM.from_pretrained(tmp_path), model)


def test_pruned_vocabulary_with_d2t_and_t2d(tmp_path):
    model = tiny_drafter(seed=3, draft_vocab_size=100)
    state = model.state_dict()
    assert state["d2t"].dtype == torch.int64 and state["t2d"].dtype == torch.bool
    folder = write_checkpoint(tmp_path, published_style_config(model), state)
    loaded = Eagle31MLAForCausalLM.from_pretrained(folder)
    assert torch.equal(loaded.d2t, model.d2t) and torch.equal(loaded.t2d, model.t2d)
    # draft id i means target id i + d2t[i]; t2d marks exactly those target ids
    targets = torch.arange(100) + loaded.d2t
    assert loaded.t2d.sum() == 100 and loaded.t2d[targets].all()
    assert torch.equal(loaded.draft_to_target_ids(torch.tensor([0, 99])), targets[[0, 99]])
    ids, aux = aux_inputs(loaded.config, 1, 5)  # draft's first token: the argmax of draft ids, as a target id
    logits = loaded(ids, aux_hidden_states=aux, logits_to_keep=1).logits[0, -1]  # the one-row product draft computes
    assert logits.shape == (100,) and loaded.draft(ids, aux, 2).tokens[0, 0] == targets[logits.argmax()]
    # d2t alone (vLLM ignores t2d, many exports omit it): t2d is derived
    del state["t2d"]
    folder = write_checkpoint(tmp_path / "no_t2d", published_style_config(model), state)
    assert torch.equal(Eagle31MLAForCausalLM.from_pretrained(folder).t2d, model.t2d)


def test_loading_never_initialises_random_weights_and_takes_the_dtype_asked(tmp_path, monkeypatch):
    """Build on the meta device and assign the file's tensors: no init pass runs at all. The dtype: config.json's
    torch_dtype (float32), whatever the file's tensors hold (bf16), unless asked."""
    model = tiny_drafter()
    folder = write_checkpoint(
        tmp_path, published_style_config(model), {k: v.bfloat16() for k, v in model.state_dict().items()}
    )
    touched = []
    for name in ("normal_", "uniform_", "kaiming_uniform_", "trunc_normal_", "ones_", "zeros_"):
        original = getattr(torch.nn.init, name)

        def spy(tensor, *args, _original=original, **kwargs):
            touched.append(tensor.device.type)
            return _original(tensor, *args, **kwargs)

        monkeypatch.setattr(torch.nn.init, name, spy)
    assert Eagle31MLAForCausalLM.from_pretrained(folder).dtype == torch.float32
    assert Eagle31MLAForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).dtype == torch.bfloat16
    assert Eagle31MLAForCausalLM.from_pretrained(folder, torch_dtype="bfloat16").dtype == torch.bfloat16
    assert set(touched) <= {"meta"}  # module constructors may "init" meta tensors: free, no storage
    Eagle31MLAForCausalLM(model.config)  # control: the spy does see a real initialisation
    assert "cpu" in touched
