"""The SGLang plugin with the real SGLang 0.5.23 package (its own virtual environment), as deep as runs on CPU (what
is reached: docs/engines.md)."""

from __future__ import annotations

import importlib
import json
import os
import pkgutil
from functools import wraps
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import nn

pytestmark = pytest.mark.sglang
pytest.importorskip("sglang", reason="runs in .venv-sglang, which scripts/test.sh creates")
os.environ["SGLANG_PLUGINS"] = "eagle31_mla"  # ours only: the wheel ships two unrelated plugins

from sglang.srt.plugins import load_plugins  # noqa: E402

import eagle31_mla_sglang as plugin  # noqa: E402
from eagle31_mla.model.aux_layers import AuxLayerIds  # noqa: E402
from tests.support.engine_configs import K3_IDS, LastRank, bare, deepseek_target, write_config  # noqa: E402
from tests.support.plugin_tests import FORMS, K3_LAYERS, write_drafts  # noqa: E402
from tests.support.subprocesses import run_python  # noqa: E402
from tests.support.tiny import write_checkpoint  # noqa: E402

load_plugins()  # in this process too, as in SGLang's


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("sglang")
    target = deepseek_target(K3_LAYERS, hidden_size=128, vocab_size=300, intermediate_size=256, n_routed_experts=8)
    return SimpleNamespace(target=write_config(root / "target", target), drafts=write_drafts(root))


LOADERS = {  # SGLang's two ways of loading the plugin: (environment, code); the entry point is loaded twice
    "entry point": ({}, "from sglang.srt.plugins import load_plugins\nload_plugins(); load_plugins()\n"),
    "external model package": (dict(SGLANG_EXTERNAL_MODEL_PACKAGE="eagle31_mla_sglang", SGLANG_PLUGINS="none"), ""),
}


@pytest.mark.parametrize("loader", LOADERS)
def test_the_plugin_loads_in_a_fresh_process_with_its_hooks_in_place(loader):
    env, code = LOADERS[loader]
    code += (
        "from sglang.srt.models.registry import ModelRegistry\n"
        "from sglang.srt.models import kimi_k25_eagle3\n"
        "cls, arch = ModelRegistry.resolve_model_cls(['Eagle3DeepseekV2ForCausalLM'])\n"
        "import eagle31_mla_sglang as p, sglang.srt.model_executor.model_runner\n"
        "from sglang.srt.plugins.hook_registry import HookRegistry\n"
        "hooks = sum(len(HookRegistry._hooks[t]) for t in (p.RESOLVE_TARGET, p.CONFIGURE_TARGET))\n"
        "print(cls is kimi_k25_eagle3.Eagle3DeepseekV2ForCausalLM, p.check_hooks(), hooks)\n"
    )
    result = run_python(["-c", code], env=env)
    assert result.returncode == 0, result.stderr[-4000:]
    assert result.stdout.strip().splitlines()[-1] == "True None 2"  # SGLang's drafter; each hook registered once


def resolve(folders, draft: Path):
    """SGLang's real id resolution for a target run (the plugin's hook included)."""
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.model_executor.model_runner_components import spec_aux_hidden_state
    from sglang.srt.runtime_context import SpawnRanks, publish
    from sglang.srt.server_args import ServerArgs
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    spec = dict(speculative_num_steps=3, speculative_eagle_topk=1, speculative_num_draft_tokens=4, device="cpu")
    args = ServerArgs(
        model_path=str(folders.target), speculative_algorithm="EAGLE3", speculative_draft_model_path=str(draft), **spec
    )
    publish(args, role="scheduler", ranks=SpawnRanks(world_rank=0, dp_rank=0, gpu_id=0))
    algorithm, model_config = SpeculativeAlgorithm.from_string("EAGLE3"), ModelConfig.from_server_args(args)
    return spec_aux_hidden_state.resolve_spec_aux_hidden_state_config(
        server_args=args, model_config=model_config, spec_algorithm=algorithm, is_draft_worker=False
    ).eagle_aux_hidden_state_layer_ids


@pytest.mark.parametrize("form", FORMS)
def test_every_form_gets_an_mla_cache_and_resolves_to_the_same_layers(folders, form):
    from sglang.srt.configs.model_config import AttentionArch, ModelConfig

    config = ModelConfig(str(folders.drafts[form]), is_draft_model=True, trust_remote_code=False)
    assert AttentionArch(config.attention_arch) == AttentionArch.MLA
    assert config.kv_lora_rank == 32 and config.qk_rope_head_dim == 16
    ids = resolve(folders, folders.drafts[form])
    assert isinstance(ids, plugin.CanonicalAuxLayerIds) and ids == K3_IDS  # one-based, = zero-based [1, 45, 89]


def test_without_the_plugin_sglang_reads_only_the_raw_nested_ids(folders, monkeypatch):
    """The traps the plugin removes: top-level ids ignored, nested ids passed on raw."""
    from sglang.srt.model_executor.model_runner_components import spec_aux_hidden_state as module

    original = getattr(module._resolve_eagle_aux_hidden_state, "__wrapped__", module._resolve_eagle_aux_hidden_state)
    monkeypatch.setattr(module, "_resolve_eagle_aux_hidden_state", original)
    assert resolve(folders, folders.drafts["top_level"]) is None  # -> the target's default, silently
    assert list(resolve(folders, folders.drafts["training"])) == [1, 45, 89]


@pytest.mark.parametrize("how", ["renamed", "not hooked"])
@pytest.mark.parametrize("which", ["resolve", "configure"])
def test_a_hook_that_is_not_in_place_stops_serving(folders, monkeypatch, which, how):
    """As if this SGLang had renamed the function (SGLang would log the failure and go on) or had not applied the
    hook: building the drafter raises, naming the symbol and the supported releases; so does resolving the ids."""
    from sglang.srt.models.kimi_k25_eagle3 import Eagle3DeepseekV2ForCausalLM as cls

    module, name = {"resolve": plugin.RESOLVE_TARGET, "configure": plugin.CONFIGURE_TARGET}[which].rsplit(".", 1)
    module = importlib.import_module(module)
    plugin.check_hooks()  # in place, until changed here
    if how == "renamed":
        monkeypatch.delattr(module, name)
    else:
        monkeypatch.setattr(module, name, getattr(module, name).__wrapped__)
    message = rf"`sglang\.srt\.model_executor\.model_runner_components\.\w+\.{name}` " + (
        "does not exist" if how == "renamed" else "exists but the plugin's hook was not applied"
    )
    with pytest.raises(plugin.PluginAPIError, match=message + r".*supports SGLang 0\.5\.23"):
        cls.__init__(cls.__new__(cls), config=None)  # the guard runs before SGLang's own __init__
    if which == "configure":  # the id resolution still runs, and refuses too
        with pytest.raises(plugin.PluginAPIError, match=message):
            resolve(folders, folders.drafts["published"])


def test_what_cannot_be_served_is_refused(folders, tmp_path, monkeypatch):
    """Ids the draft config contradicts or the target lacks; a draft given an MHA cache; a form the target
    cannot capture; a newer SGLang passing the resolver something other than the target's ModelConfig."""
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.model_executor.model_runner_components import spec_aux_hidden_state as module

    published = json.loads((folders.drafts["published"] / "config.json").read_text())
    nested = published["eagle_config"] | {"eagle_aux_hidden_state_layer_ids": [2, 46, 95]}
    for change, message in [
        ({"eagle_aux_hidden_state_layer_ids": [3, 47, 91]}, "contradictory about aux layers"),
        ({"eagle_config": nested}, "beyond the target's depth of 93"),
    ]:
        with pytest.raises(ValueError, match=message):
            resolve(folders, write_checkpoint(tmp_path / message, published | change, {}))
    renamed = write_config(tmp_path / "renamed", published | {"architectures": ["KimiK3MLA"]})
    config = ModelConfig(str(renamed), is_draft_model=True, trust_remote_code=False)
    with pytest.raises(ValueError, match="KV cache, not MLA"):
        plugin.canonical_ids_for_draft(config.hf_config, K3_LAYERS, config.attention_arch)
    # one-based [1, ...]: given [1, ...] a DeepSeek target adds 1, given [0, ...] it keeps 0; neither is right
    with pytest.raises(ValueError, match=r"cannot capture layers one-based \[1, 46, 90\].*first id is 1"):
        configure(target_model("DeepseekV3ForCausalLM"), canonical([1, 46, 90]))
    hooked = module._resolve_eagle_aux_hidden_state  # its hook in place: SGLang's wrapper is what we wrap
    without = wraps(hooked)(lambda **kwargs: hooked(**kwargs | {"model_config": None}))
    monkeypatch.setattr(module, "_resolve_eagle_aux_hidden_state", without)
    with pytest.raises(plugin.PluginAPIError, match=r"passed `\S+` a NoneType as `model_config`, not the target's"):
        resolve(folders, folders.drafts["published"])


# ---- the ids each real target class ends up capturing ------------------------------------------

TARGETS = {  # class -> (its module, the text target a multimodal wrapper delegates to)
    "DeepseekV2ForCausalLM": ("deepseek_v2", None),
    "DeepseekV3ForCausalLM": ("deepseek_v2", None),
    "LlamaForCausalLM": ("llama", None),
    "KimiK3LinearForCausalLM": ("kimi_k3", None),
    "KimiK25ForConditionalGeneration": ("kimi_k25", "DeepseekV3ForCausalLM"),
    "KimiK3ForConditionalGeneration": ("kimi_k3", "KimiK3LinearForCausalLM"),
}


def target_model(name: str):
    """A real SGLang target class without its weights (DeepSeek-family and Llama store in ``layers_to_capture``)."""
    module, text = TARGETS[name]
    cls = pkgutil.resolve_name(f"sglang.srt.models.{module}:{name}")
    if text:
        return bare(cls, language_model=target_model(text))
    if name == "KimiK3LinearForCausalLM":
        return kimi_k3_language_model()
    state = dict(config=SimpleNamespace(num_hidden_layers=K3_LAYERS), model=SimpleNamespace(layers_to_capture=[]))
    return bare(cls, pp_group=LastRank(), **state)


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

    state = dict(pp_group=LastRank(), dspark_layers_to_capture=None, carries_bank_slices=False, attn_bank=None)
    state |= dict(embed_tokens=nn.Embedding(vocab, hidden), norm=nn.Identity(), start_layer=0, end_layer=layers)
    state["layers"] = nn.ModuleList(StubLayer(hidden) for _ in range(layers))
    state["config"] = SimpleNamespace(attn_res_block_size=None, num_hidden_layers=layers, hidden_size=hidden)
    inner = bare(kimi_k3.KimiK3LinearModel, **state)
    inner._final_read = lambda h, r=None: h if r is None else (h + r, h + r)
    text = dict(model=inner, config=inner.config, pp_group=LastRank(), capture_aux_hidden_states=False)
    return bare(kimi_k3.KimiK3LinearForCausalLM, **text)


def configure(model, ids):
    no_dflash = dict(dflash_use_aux_hidden_state=False, dflash_target_layer_ids=None, is_dspark=False)
    configure = pkgutil.resolve_name(plugin.CONFIGURE_TARGET)  # SGLang's function, the plugin's hook around it
    configure(model=model, eagle_use_aux_hidden_state=True, eagle_aux_hidden_state_layer_ids=ids, **no_dflash)


def canonical(one_based):
    return plugin.CanonicalAuxLayerIds(AuxLayerIds(tuple(one_based), K3_LAYERS))


def newer_sglangs_own_k3_capture(self, layer_ids=None):  # a convention that disagrees with the plugin's
    self.model.eagle3_layers_to_capture = [i + 1 for i in layer_ids]


@pytest.mark.parametrize("target", [*TARGETS, "KimiK3LinearForCausalLM of a newer SGLang"])
def test_each_target_class_captures_the_canonical_layers(target, monkeypatch):
    """A newer SGLang's own Kimi-K3 method is left alone: given one-based it stores other layers, so it gets
    zero-based."""
    from sglang.srt.models.kimi_k3 import KimiK3LinearForCausalLM as k3

    if newer := target.endswith("newer SGLang"):
        monkeypatch.setattr(k3, "set_eagle3_layers_to_capture", newer_sglangs_own_k3_capture, raising=False)
    model = target_model(target.split()[0])
    configure(model, canonical(K3_IDS))
    assert list(plugin.captured_layers(model)) == K3_IDS  # the inputs of layers 2, 46, 90 = outputs of 1, 45, 89
    if newer:
        assert k3.set_eagle3_layers_to_capture is newer_sglangs_own_k3_capture  # not replaced


# ---- the Kimi-K3 capture itself -----------------------------------------------------------------


def test_k3_capture_runs_in_the_real_model_forward():
    """The real KimiK3LinearModel.forward with stub layers: the captured states are the stream after
    zero-based layers 1, 2, 4 (one-based 2, 3, 5), where the plain stream == the prefix stream."""
    from unittest.mock import patch

    from sglang.srt.models import kimi_k3

    model = kimi_k3_language_model(layers=6)
    configure(model, canonical([2, 3, 5]))
    assert model.capture_aux_hidden_states
    ids = torch.randint(0, 32, (5,))
    with patch.object(kimi_k3, "get_parallel", lambda: SimpleNamespace(pp_group=LastRank())), torch.no_grad():
        _, aux = model.model(ids, torch.arange(len(ids)), SimpleNamespace(residual_stream=None))
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
    """A synthetic AttnRes state (completed blocks' bank rows, the within-block prefix, a pending MLP output): the
    capture is prefix + pending, not the mixture DSpark reads (SGLang's own aggregate_stream_torch)."""
    from sglang.srt.layers.attn_residual import aggregate_stream_torch
    from sglang.srt.layers.layer_boundary.residual.add_norm import PLAIN_ADD
    from sglang.srt.layers.layer_boundary.residual.stream import ResidualStream

    from eagle31_mla_sglang.kimi_k3 import prefix_stream

    torch.manual_seed(0)
    T, H = 4, 16
    bank = torch.randn(T, 3, H)  # committed block sums (bank row 0 = the embeddings)
    prefix, pending_mlp = torch.randn(T, H), torch.randn(T, H)
    stream = ResidualStream(prefix)
    handle = stream.record(pending_mlp, PLAIN_ADD)
    captured = prefix_stream(handle, SimpleNamespace(residual_stream=stream, attn_bank=bank))
    torch.testing.assert_close(captured, prefix + pending_mlp)
    weight = torch.randn(H)  # the next layer's AttnRes score projection

    def score_norm(rows):
        return rows * torch.rsqrt(rows.pow(2).mean(-1, keepdim=True) + 1e-6)

    mixture = aggregate_stream_torch(prefix + pending_mlp, bank, 2, lambda rows: (rows @ weight[:, None],), score_norm)
    assert (mixture - captured).abs().max() > 0.1
