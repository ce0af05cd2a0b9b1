"""The SGLang plugin with the real SGLang 0.5.23 package (its own virtual environment).

SGLang's engine cannot run on CPU, so these tests go as deep as runs: the real plugin loader in a
fresh process, the real registry and ModelConfig, SGLang's real id-resolution code under the plugin's
hooks, the real target classes' `set_eagle3_layers_to_capture`, and the real Kimi-K3 model forward
and residual stream for the capture.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import nn

pytestmark = pytest.mark.sglang
pytest.importorskip("sglang", reason="runs in .venv-sglang, which scripts/test.sh creates")
os.environ["SGLANG_PLUGINS"] = "eagle31_mla"  # ours only: the wheel ships two unrelated plugins

from tests.support.engine_configs import K3_IDS, LastRank, bare  # noqa: E402
from tests.support.tiny import published_style_config, tiny_drafter, write_checkpoint  # noqa: E402

K3_LAYERS = 93


def write_draft(folder: Path, form: str) -> Path:
    model = tiny_drafter(hidden_size=128, target_hidden_size=128, eagle_aux_hidden_state_layer_ids=K3_IDS)
    if form == "exported":
        model.save_pretrained(folder)
        return folder
    config = published_style_config(model, ids_form=form if form in ("training", "top_level", "both") else "published")
    if form == "mha_name":
        config["architectures"] = ["KimiK3MLADrafter"]
    return write_checkpoint(folder, config, model.state_dict())


def write_target(folder: Path, layers: int = K3_LAYERS) -> Path:
    from transformers import DeepseekV3Config

    config = DeepseekV3Config(
        vocab_size=300,
        hidden_size=128,
        intermediate_size=256,
        moe_intermediate_size=64,
        num_hidden_layers=layers,
        first_k_dense_replace=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        n_routed_experts=8,
        n_shared_experts=1,
        num_experts_per_tok=2,
        n_group=2,
        topk_group=1,
        q_lora_rank=64,
        kv_lora_rank=512,
        qk_rope_head_dim=64,
        qk_nope_head_dim=32,
        v_head_dim=32,
        max_position_embeddings=512,
    )
    config.architectures = ["DeepseekV3ForCausalLM"]
    config.save_pretrained(folder)
    return folder


FORMS = ["published", "training", "top_level", "both", "exported"]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("sglang")
    return SimpleNamespace(
        target=write_target(root / "target"),
        drafts={form: write_draft(root / f"draft-{form}", form) for form in FORMS + ["mha_name"]},
    )


@pytest.fixture(scope="module")
def plugins_loaded():
    from sglang.srt.plugins import load_plugins

    load_plugins()


# ---- the plugin loads, through both of SGLang's mechanisms ------------------------------------


def run_fresh(code: str, **env) -> str:
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=600, env={**os.environ, **env}
    )
    assert result.returncode == 0, result.stderr[-4000:]
    return result.stdout


def test_entry_point_plugin_installs_the_hooks_in_a_fresh_process():
    out = run_fresh(
        "from sglang.srt.plugins import load_plugins\n"
        "load_plugins(); load_plugins()\n"
        "from sglang.srt.model_executor.model_runner_components import spec_aux_hidden_state as s, "
        "attention_backend_setup as a\n"
        "from sglang.srt.model_executor import model_runner as r\n"
        "import eagle31_mla_sglang as p\n"
        "for fn in (s._resolve_eagle_aux_hidden_state, a.configure_aux_hidden_state_capture, "
        "r.configure_aux_hidden_state_capture):\n"
        "    assert 'around' in repr(fn).lower() or fn.__wrapped__ is not None, fn\n"
        "from sglang.srt.plugins.hook_registry import HookRegistry\n"
        "print(sum(1 for t in (p.RESOLVE_TARGET, p.CONFIGURE_TARGET) for _ in HookRegistry._hooks[t]))\n"
    )
    assert out.strip().splitlines()[-1] == "2"  # registered once each although loaded twice


def test_external_model_package_mechanism():
    out = run_fresh(
        "from sglang.srt.models.registry import ModelRegistry\n"
        "cls, arch = ModelRegistry.resolve_model_cls(['Eagle3DeepseekV2ForCausalLM'])\n"
        "from sglang.srt.models import kimi_k25_eagle3\n"
        "assert cls is kimi_k25_eagle3.Eagle3DeepseekV2ForCausalLM, cls\n"
        "from sglang.srt.model_executor.model_runner_components import spec_aux_hidden_state as s\n"
        "import eagle31_mla_sglang\n"
        "assert hasattr(s._resolve_eagle_aux_hidden_state, '__wrapped__'), 'hooks not applied'\n"
        "print('ok')\n",
        SGLANG_EXTERNAL_MODEL_PACKAGE="eagle31_mla_sglang",
        SGLANG_PLUGINS="none-of-them",
    )
    assert out.strip().endswith("ok")


# ---- MLA cache and aux ids through SGLang's own config code ------------------------------------


@pytest.mark.parametrize("form", FORMS)
def test_sglang_gives_the_drafter_an_mla_cache(folders, form):
    from sglang.srt.configs.model_config import AttentionArch, ModelConfig

    config = ModelConfig(str(folders.drafts[form]), is_draft_model=True, trust_remote_code=False)
    assert AttentionArch(config.attention_arch) == AttentionArch.MLA
    assert config.kv_lora_rank == 32 and config.qk_rope_head_dim == 16


def resolve(folders, draft: Path):
    """SGLang's real id resolution for a target run (the plugin's hook included)."""
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.model_executor.model_runner_components.spec_aux_hidden_state import (
        resolve_spec_aux_hidden_state_config,
    )
    from sglang.srt.runtime_context import SpawnRanks, publish
    from sglang.srt.server_args import ServerArgs
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    args = ServerArgs(
        model_path=str(folders.target),
        speculative_algorithm="EAGLE3",
        device="cpu",
        speculative_draft_model_path=str(draft),
        speculative_num_steps=3,
        speculative_eagle_topk=1,
        speculative_num_draft_tokens=4,
    )
    publish(args, role="scheduler", ranks=SpawnRanks(world_rank=0, dp_rank=0, gpu_id=0))
    return resolve_spec_aux_hidden_state_config(
        server_args=args,
        model_config=ModelConfig.from_server_args(args),
        spec_algorithm=SpeculativeAlgorithm.from_string("EAGLE3"),
        is_draft_worker=False,
    ).eagle_aux_hidden_state_layer_ids


@pytest.mark.parametrize("form", FORMS)
def test_every_form_resolves_to_the_same_layers(folders, plugins_loaded, form):
    from eagle31_mla_sglang import CanonicalAuxLayerIds

    ids = resolve(folders, folders.drafts[form])
    assert isinstance(ids, CanonicalAuxLayerIds)
    assert ids.aux_layer_ids.one_based == (2, 46, 90) and ids.aux_layer_ids.zero_based == (1, 45, 89)


def test_without_the_plugin_sglang_reads_only_the_raw_nested_ids(folders):
    """The traps the plugin removes: top-level ids ignored, nested ids passed on raw."""
    from sglang.srt.model_executor.model_runner_components import spec_aux_hidden_state as module
    from sglang.srt.plugins.hook_registry import HookRegistry  # noqa: F401  (hooks may be applied: call the original)

    original = getattr(module._resolve_eagle_aux_hidden_state, "__wrapped__", module._resolve_eagle_aux_hidden_state)
    saved = module._resolve_eagle_aux_hidden_state
    module._resolve_eagle_aux_hidden_state = original
    try:
        assert resolve(folders, folders.drafts["top_level"]) is None  # -> the target's default, silently
        assert list(resolve(folders, folders.drafts["training"])) == [1, 45, 89]
    finally:
        module._resolve_eagle_aux_hidden_state = saved


# ---- SGLang only logs a hook it could not apply: the plugin checks its hooks itself ---------------


def drafter_class():
    from sglang.srt.models.kimi_k25_eagle3 import Eagle3DeepseekV2ForCausalLM

    return Eagle3DeepseekV2ForCausalLM


@pytest.mark.parametrize("how", ["renamed", "not hooked"])
@pytest.mark.parametrize("which", ["resolve", "configure"])
def test_a_hook_that_is_not_in_place_stops_serving(folders, plugins_loaded, monkeypatch, which, how):
    """As if this SGLang had renamed the function (SGLang would log the failure and go on) or had not
    applied the hook: building the drafter raises, naming the symbol and the supported releases, and so
    does resolving the draft's ids where that still runs."""
    from sglang.srt.model_executor.model_runner_components import attention_backend_setup, spec_aux_hidden_state

    import eagle31_mla_sglang as plugin

    module, name = {
        "resolve": (spec_aux_hidden_state, "_resolve_eagle_aux_hidden_state"),
        "configure": (attention_backend_setup, "configure_aux_hidden_state_capture"),
    }[which]
    assert plugin.hook_problems() == []
    if how == "renamed":
        monkeypatch.delattr(module, name)
    else:
        monkeypatch.setattr(module, name, getattr(module, name).__wrapped__)
    message = rf"`sglang\.srt\.model_executor\.model_runner_components\.\w+\.{name}` " + (
        "does not exist" if how == "renamed" else "exists but the plugin's hook was not applied"
    )
    cls = drafter_class()
    with pytest.raises(plugin.PluginHookError, match=message + r".*supports SGLang 0\.5\.23"):
        cls.__init__(cls.__new__(cls), config=None)  # the guard runs before SGLang's own __init__
    if which == "configure":  # the id resolution still runs, and refuses too
        with pytest.raises(plugin.PluginHookError, match=message):
            resolve(folders, folders.drafts["published"])


def test_a_resolve_function_without_model_config(folders, plugins_loaded):
    """Other SGLang releases' `_resolve_eagle_aux_hidden_state` takes no `model_config`: the ids are
    still made canonical (the target's depth is then checked when the capture is configured)."""
    import inspect

    from sglang.srt.model_executor.model_runner_components import spec_aux_hidden_state as module
    from sglang.srt.plugins.hook_registry import HookType, _wrap_fn

    from eagle31_mla_sglang import CanonicalAuxLayerIds, resolve_eagle_aux_hidden_state

    current = inspect.unwrap(module._resolve_eagle_aux_hidden_state)

    def without_model_config(*, config, server_args, spec_algorithm, is_draft_worker):
        return current(
            config=config,
            server_args=server_args,
            model_config=None,
            spec_algorithm=spec_algorithm,
            is_draft_worker=is_draft_worker,
        )

    hooked = _wrap_fn(without_model_config, resolve_eagle_aux_hidden_state, HookType.AROUND)  # as SGLang hooks it

    def caller_adapter(*, model_config, **kwargs):  # 0.5.23's caller passes model_config; that release's would not
        return hooked(**kwargs)

    caller_adapter.__wrapped__ = hooked
    real = module._resolve_eagle_aux_hidden_state
    module._resolve_eagle_aux_hidden_state = caller_adapter
    try:
        ids = resolve(folders, folders.drafts["training"])
    finally:
        module._resolve_eagle_aux_hidden_state = real
    assert isinstance(ids, CanonicalAuxLayerIds) and ids.aux_layer_ids.one_based == (2, 46, 90)
    shallow = deepseek()
    shallow.config.num_hidden_layers = 61
    with pytest.raises(ValueError, match="beyond the target's depth of 61"):
        configure(shallow, ids)


def test_contradictory_and_out_of_range_ids_are_refused(folders, plugins_loaded, tmp_path):
    import json

    config = json.loads((folders.drafts["published"] / "config.json").read_text())
    config["eagle_aux_hidden_state_layer_ids"] = [3, 47, 91]
    bad = write_checkpoint(tmp_path / "contradictory", config, {})
    with pytest.raises(ValueError, match="contradictory about aux layers"):
        resolve(folders, bad)
    config = json.loads((folders.drafts["published"] / "config.json").read_text())
    config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [2, 46, 95]
    with pytest.raises(ValueError, match="depth of 93"):
        resolve(folders, write_checkpoint(tmp_path / "deep", config, {}))


def test_a_draft_sglang_would_give_an_mha_cache_is_refused(folders):
    from sglang.srt.configs.model_config import ModelConfig

    from eagle31_mla_sglang import canonical_ids_for_draft

    config = ModelConfig(str(folders.drafts["mha_name"]), is_draft_model=True, trust_remote_code=False)
    with pytest.raises(ValueError, match="KV cache, not MLA"):
        canonical_ids_for_draft(config.hf_config, K3_LAYERS, attention_arch=config.attention_arch)


# ---- the ids each real target class ends up capturing ------------------------------------------


def deepseek(cls_name="DeepseekV3ForCausalLM"):
    from sglang.srt.models import deepseek_v2

    return bare(
        getattr(deepseek_v2, cls_name),
        pp_group=LastRank(),
        config=SimpleNamespace(num_hidden_layers=K3_LAYERS),
        model=SimpleNamespace(layers_to_capture=[]),
    )


def kimi_k25():
    from sglang.srt.models.kimi_k25 import KimiK25ForConditionalGeneration

    return bare(KimiK25ForConditionalGeneration, language_model=deepseek())


def llama():
    from sglang.srt.models.llama import LlamaForCausalLM

    return bare(
        LlamaForCausalLM,
        pp_group=LastRank(),
        config=SimpleNamespace(num_hidden_layers=K3_LAYERS),
        model=SimpleNamespace(layers_to_capture=[]),
    )


class StubLayer(nn.Module):
    """A layer that leaves its output pending on the real ResidualStream, like a real FFN exit."""

    def __init__(self, hidden):
        super().__init__()
        self.w = nn.Linear(hidden, hidden, bias=False)

    def forward(self, positions, hidden_states, forward_batch, zero_allocator, capture_gathered=None):
        from sglang.srt.layers.layer_boundary.residual import batch as residual_batch
        from sglang.srt.layers.layer_boundary.residual.add_norm import PLAIN_ADD

        stream = residual_batch.stream_of(forward_batch)
        full = stream.snapshot(hidden_states)
        stream.write(full)
        return stream.record(torch.tanh(self.w(full)), PLAIN_ADD)


def kimi_k3_language_model(layers=K3_LAYERS, hidden=16, vocab=32):
    from sglang.srt.models import kimi_k3

    inner = bare(
        kimi_k3.KimiK3LinearModel,
        pp_group=LastRank(),
        dspark_layers_to_capture=None,
        carries_bank_slices=False,
        embed_tokens=nn.Embedding(vocab, hidden),
        layers=nn.ModuleList(StubLayer(hidden) for _ in range(layers)),
        start_layer=0,
        end_layer=layers,
        attn_bank=None,
        norm=nn.Identity(),
        config=SimpleNamespace(attn_res_block_size=None, num_hidden_layers=layers, hidden_size=hidden),
    )
    inner._final_read = lambda h, r=None: h if r is None else (h + r, h + r)
    return bare(
        kimi_k3.KimiK3LinearForCausalLM,
        model=inner,
        config=inner.config,
        pp_group=LastRank(),
        capture_aux_hidden_states=False,
    )


def kimi_k3_multimodal():
    from sglang.srt.models import kimi_k3

    return bare(kimi_k3.KimiK3ForConditionalGeneration, language_model=kimi_k3_language_model())


TARGETS = {
    "DeepseekV2ForCausalLM": lambda: deepseek("DeepseekV2ForCausalLM"),
    "DeepseekV3ForCausalLM": deepseek,
    "KimiK25ForConditionalGeneration": kimi_k25,
    "LlamaForCausalLM": llama,
    "KimiK3LinearForCausalLM": kimi_k3_language_model,
    "KimiK3ForConditionalGeneration": kimi_k3_multimodal,
}


def configure(model, ids):
    from sglang.srt.model_executor.model_runner_components.attention_backend_setup import (
        configure_aux_hidden_state_capture,
    )

    configure_aux_hidden_state_capture(
        model=model,
        eagle_use_aux_hidden_state=True,
        eagle_aux_hidden_state_layer_ids=ids,
        dflash_use_aux_hidden_state=False,
        dflash_target_layer_ids=None,
        is_dspark=False,
    )


def canonical(one_based):
    from eagle31_mla.model.aux_layers import AuxLayerIds
    from eagle31_mla_sglang import CanonicalAuxLayerIds

    return CanonicalAuxLayerIds(AuxLayerIds.from_one_based(one_based, K3_LAYERS))


@pytest.mark.parametrize("target", TARGETS)
def test_each_target_class_captures_the_canonical_layers(plugins_loaded, target):
    from eagle31_mla_sglang import captured_layers

    model = TARGETS[target]()
    configure(model, canonical(K3_IDS))
    assert list(captured_layers(model)) == K3_IDS  # the inputs of layers 2, 46, 90 = outputs of 1, 45, 89


def test_the_traps_without_the_plugin(plugins_loaded):
    """Raw ids straight into SGLang's targets: the DeepSeek rule and Llama's +1 move them."""
    from eagle31_mla_sglang import captured_layers

    model = deepseek()
    model.set_eagle3_layers_to_capture([0, 45, 89])  # zero-based, first id not 1: taken as one-based
    assert captured_layers(model) == [0, 45, 89]  # the embeddings and one layer early
    model = llama()
    model.set_eagle3_layers_to_capture(K3_IDS)  # one-based given to Llama: +1 always
    assert captured_layers(model) == [3, 47, 91]


def test_a_form_the_target_cannot_capture_is_refused(plugins_loaded):
    """One-based [1, ...] (after layer 0) on a DeepSeek target: given [1, ...] it adds 1, given [0, ...]
    it keeps 0. Neither is right, so the plugin refuses instead of serving a wrong layer."""
    with pytest.raises(ValueError, match=r"cannot capture layers one-based \[1, 46, 90\].*first id is 1"):
        configure(deepseek(), canonical([1, 46, 90]))
    configure(llama(), canonical([1, 46, 90]))  # Llama can: it takes zero-based [0, 45, 89]


def test_newer_sglang_k3_capture_is_left_alone_and_checked(plugins_loaded, monkeypatch):
    from sglang.srt.models import kimi_k3

    from eagle31_mla_sglang import kimi_k3 as ours

    def upstream(self, layer_ids=None):  # stands in for a newer SGLang's own method
        self.model.eagle3_layers_to_capture = [i + 1 for i in layer_ids]  # a convention that disagrees

    monkeypatch.setattr(kimi_k3.KimiK3LinearForCausalLM, "set_eagle3_layers_to_capture", upstream, raising=False)
    model = kimi_k3_language_model(layers=K3_LAYERS)
    configure(model, canonical(K3_IDS))  # one-based fails the check, zero-based passes: that form is used
    assert model.model.eagle3_layers_to_capture == K3_IDS
    assert kimi_k3.KimiK3LinearForCausalLM.set_eagle3_layers_to_capture is upstream  # not replaced
    assert ours.set_eagle3_layers_to_capture_language_model is not upstream


# ---- the Kimi-K3 capture itself -----------------------------------------------------------------


def run_k3(model, token_ids):
    from unittest.mock import patch

    from sglang.srt.models import kimi_k3

    batch = SimpleNamespace(residual_stream=None)
    with patch.object(kimi_k3, "get_parallel", lambda: SimpleNamespace(pp_group=LastRank())), torch.no_grad():
        return model.model(token_ids, torch.arange(len(token_ids)), batch)


def test_k3_capture_runs_in_the_real_model_forward(plugins_loaded):
    """The real KimiK3LinearModel.forward with stub layers: the captured states are the stream after
    zero-based layers 1, 2, 4 (one-based 2, 3, 5), where the plain stream == the prefix stream."""
    model = kimi_k3_language_model(layers=6)
    configure(model, canonical([2, 3, 5]))
    assert model.capture_aux_hidden_states
    ids = torch.randint(0, 32, (5,))
    output, aux = run_k3(model, ids)
    with torch.no_grad():
        stream = model.model.embed_tokens(ids)
        after = [stream]
        for layer in model.model.layers:
            stream = stream + torch.tanh(layer.w(stream))
            after.append(stream)
    assert len(aux) == 3
    for captured, k in zip(aux, [2, 3, 5]):  # the same fp32 ops, summed in SGLang's order: fp32 default tolerances
        torch.testing.assert_close(captured, after[k])
    assert not torch.allclose(aux[0], after[1])  # and not one layer early


def test_k3_capture_is_the_prefix_stream_not_the_attnres_mixture():
    """A synthetic AttnRes state: bank rows of completed blocks, a within-block prefix (written
    residual) and a pending MLP output. The capture is prefix + pending; the mixture DSpark reads
    (SGLang's own aggregate_stream_torch over bank + prefix) is different."""
    from sglang.srt.layers.attn_residual import aggregate_stream_torch
    from sglang.srt.layers.layer_boundary.residual.add_norm import PLAIN_ADD
    from sglang.srt.layers.layer_boundary.residual.stream import ResidualStream

    from eagle31_mla_sglang.kimi_k3 import prefix_stream

    torch.manual_seed(0)
    T, H, blocks = 4, 16, 2
    bank = torch.randn(T, 3, H)  # committed block sums (bank row 0 = the embeddings)
    prefix, pending_mlp = torch.randn(T, H), torch.randn(T, H)
    stream = ResidualStream(prefix)
    handle = stream.record(pending_mlp, PLAIN_ADD)
    batch = SimpleNamespace(residual_stream=stream, attn_bank=bank)
    captured = prefix_stream(handle, batch)
    torch.testing.assert_close(captured, prefix + pending_mlp)

    weight = torch.randn(H)  # the next layer's AttnRes score projection

    def score_norm(rows):
        return rows * torch.rsqrt(rows.pow(2).mean(-1, keepdim=True) + 1e-6)

    def score_proj(rows):
        return (rows @ weight[:, None],)

    mixture = aggregate_stream_torch(prefix + pending_mlp, bank, blocks, score_proj, score_norm)
    assert (mixture - captured).abs().max() > 0.1
