"""The TokenSpeed plugin with the real TokenSpeed 0.1.1 package (its own virtual environment), as deep as runs on
CPU once :mod:`tests.support.tokenspeed_standin` stands in for the GPU (what is reached: docs/engines.md)."""

from __future__ import annotations

import importlib
import json
import pkgutil
from functools import partial
from pathlib import Path
from types import SimpleNamespace

import pytest

pytestmark = [
    pytest.mark.tokenspeed,
    # TokenSpeed's kernel packages import deprecated names of their own dependencies by the dozen
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
]
pytest.importorskip("tokenspeed", reason="runs in .venv-tokenspeed, which scripts/test.sh creates")

from tests.support import tokenspeed_standin  # noqa: E402

tokenspeed_standin.install()

from tokenspeed.runtime.plugins import ensure_loaded  # noqa: E402

from tests.support.engine_configs import K3_IDS, bare, deepseek_target, kimi_k3_target, write_config  # noqa: E402
from tests.support.plugin_tests import FORMS, K3_LAYERS, write_draft, write_drafts  # noqa: E402
from tests.support.subprocesses import run_python  # noqa: E402
from tests.support.tiny import tiny_drafter  # noqa: E402


@pytest.fixture(scope="module", autouse=True)
def plugins_loaded():
    """In this process too, as in TokenSpeed's; not at import, where it would register TokenSpeed's configs with
    Transformers for every test collected beside these (the remote-code tests then load a KimiK2Config)."""
    ensure_loaded()


DRAFT_ARCHITECTURE = "Eagle3DeepseekV2ForCausalLM"
K3_TEXT = "tokenspeed.runtime.models.kimi_k3:KimiLinearForCausalLM"
SIZES = dict(hidden_size=128, vocab_size=300)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("tokenspeed")
    return SimpleNamespace(
        k3=write_config(root / "kimi-k3", kimi_k3_target(**SIZES)),
        deepseek=write_config(root / "deepseek", deepseek_target(K3_LAYERS, **SIZES)),
        drafts=write_drafts(root),
    )


def model_configs(target: Path, draft: Path, **flags):
    """TokenSpeed's own target and draft ModelConfig, built as its event loop builds them."""
    from tokenspeed.runtime.configs.model_config import ModelConfig
    from tokenspeed.runtime.utils.server_args import ServerArgs

    flags |= dict(speculative_algorithm="EAGLE3", speculative_draft_model_path=str(draft))
    args = ServerArgs(model=str(target), **flags)
    target_config = ModelConfig(str(target), server_args=args, model_override_args="{}")
    return target_config, ModelConfig(str(draft), server_args=args, is_draft_worker=True, model_override_args="{}")


def served(target_name: str, draft_config) -> list[int]:
    """TokenSpeed's ``configure_draft_target`` (the draft config's ids, to the real target class), and the one-based
    ids the target keeps: Kimi-K3 as given; DeepSeek-V3 "capture before layer i", i.e. after i layers."""
    from tokenspeed.runtime.execution.factory import _eagle_aux_layer_ids
    from tokenspeed.runtime.models import deepseek_v3, kimi_k3

    ids = _eagle_aux_layer_ids(draft_config.hf_config)
    if target_name == "k3":
        text = bare(kimi_k3.KimiLinearForCausalLM, model=SimpleNamespace(layers=[None] * K3_LAYERS))
        bare(kimi_k3.KimiK3ForConditionalGeneration, language_model=text).set_eagle3_layers_to_capture(ids)
        return sorted(text.model.eagle3_layers_to_capture)
    config, model = SimpleNamespace(num_hidden_layers=K3_LAYERS), SimpleNamespace(layers=[None])
    bare(deepseek_v3.DeepseekV3ForCausalLM, config=config, model=model).set_eagle3_layers_to_capture(ids)
    return sorted(model.layers_to_capture)


def test_tokenspeeds_own_loader_registers_the_drafter_in_a_fresh_process():
    code = (
        "from tests.support import tokenspeed_standin\n"
        "tokenspeed_standin.install()\n"
        "import json, warnings\n"
        "from tokenspeed.runtime.plugins import ensure_loaded\n"
        "with warnings.catch_warnings(record=True) as caught:\n"
        "    warnings.simplefilter('always')\n"
        "    plugins = ensure_loaded(); ensure_loaded()\n"
        "from tokenspeed.runtime.models.registry import ModelRegistry\n"
        f"cls, arch = ModelRegistry.resolve_model_cls([{DRAFT_ARCHITECTURE!r}])\n"
        "print(json.dumps({'plugins': [[p.name, p.package, [list(r) for r in p.registrations]] for p in plugins],\n"
        "    'cls': f'{cls.__module__}.{cls.__qualname__}', 'arch': arch,\n"
        "    'failed': [str(w.message) for w in caught if 'Failed to load plugin' in str(w.message)]}))\n"
    )
    result = run_python(["-c", code])
    assert result.returncode == 0, result.stderr[-4000:]
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert out.pop("plugins") == [["eagle31_mla", "eagle31-mla", [["model", [DRAFT_ARCHITECTURE]]]]]  # once
    assert out == dict(cls="eagle31_mla_tokenspeed.drafter.Eagle31MLADrafter", arch=DRAFT_ARCHITECTURE, failed=[])


@pytest.mark.parametrize("target_name", ["k3", "deepseek"])
@pytest.mark.parametrize("form", FORMS)
def test_every_form_gets_an_mla_cache_and_the_trained_layers(folders, form, target_name):
    from tokenspeed.runtime.configs.model_config import AttentionArch

    _, draft = model_configs(getattr(folders, target_name), folders.drafts[form])
    assert (draft.model_profile_architecture, draft.model_profile.cache_family) == (DRAFT_ARCHITECTURE, "mla")
    assert draft.attention_arch == AttentionArch.MLA
    hf = draft.hf_config
    geometry = ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
    assert [getattr(draft, k) for k in geometry] == [getattr(hf, k) for k in geometry]
    assert served(target_name, draft) == K3_IDS  # after zero-based layers 1, 45, 89, on either target


def test_the_traps_the_plugin_closes(folders):
    """Control: TokenSpeed's own reading, without the plugin's profile, is one layer off in both directions."""
    from tokenspeed.runtime.utils.hf_transformers_utils import get_config

    def raw(form):
        return SimpleNamespace(hf_config=get_config(str(folders.drafts[form]), trust_remote_code=True))

    assert served("k3", raw("training")) == [1, 45, 89]  # nested zero-based, taken one-based: one layer early
    assert served("deepseek", raw("published")) == [3, 47, 91]  # nested one-based, plus one: one layer late
    assert served("k3", raw("both")) == [1, 45, 89]  # the nested key hides the right top-level one


def test_what_can_be_served_is_and_the_config_written_back_reads_the_same(folders, tmp_path):
    """An agreeing flag, a last layer on Kimi-K3 (which captures after a layer); and idempotent: a draft config
    the plugin rewrote (zero-based, for DeepSeek) reads as the same layers again."""
    from tokenspeed.runtime.models.deepseek_v3 import DeepseekV3ForCausalLM

    from eagle31_mla.model.aux_layers import aux_layer_ids_from_attributes
    from eagle31_mla.serving.engines import Target
    from eagle31_mla_tokenspeed.drafter import target_form

    model_configs(folders.k3, folders.drafts["training"], eagle3_layers_to_capture="2,46,90")
    model_configs(folders.k3, write_draft(tmp_path / "last", "published", ids=[2, 46, K3_LAYERS]))  # after its last
    target, draft = model_configs(folders.deepseek, folders.drafts["published"], eagle3_layers_to_capture="1,45,89")
    assert draft.hf_config.eagle_aux_hidden_state_layer_ids == [1, 45, 89]
    assert draft.hf_config.aux_layer_ids_convention == "zero_based"
    assert list(aux_layer_ids_from_attributes(draft.hf_config)[0].one_based) == K3_IDS
    again = target_form(draft.hf_config, Target.from_config(target.hf_config.to_dict()), DeepseekV3ForCausalLM)
    assert again == [1, 45, 89] and served("deepseek", draft) == K3_IDS


def _k3_capturing_the_mixture(monkeypatch):
    """Kimi-K3's forward as if it captured the AttnRes mixture instead of the prefix stream (the plugin reads it)."""
    import inspect

    from tokenspeed.runtime.models import kimi_k3

    source = inspect.getsource(kimi_k3.KimiLinearModel.forward)
    mixture = source.replace("prefix_sum.clone()", "self._dspark_capture_stream(layer_idx, prefix_sum, block_residual)")
    assert mixture != source
    monkeypatch.setattr(inspect, "getsource", lambda obj: mixture)


def _k3_setter_reading_otherwise(monkeypatch):  # the setter Kimi-K3's language model inherits reads ids otherwise
    monkeypatch.delattr(pkgutil.resolve_name(K3_TEXT), "set_eagle3_layers_to_capture")


def _unknown_release(module: str, name: str, monkeypatch):
    """Another plugin API version, or a symbol the plugin needs gone, when TokenSpeed's loader calls ``register``."""
    from tokenspeed.runtime.plugins import registry

    import eagle31_mla_tokenspeed

    monkeypatch.setitem(registry._MODELS, DRAFT_ARCHITECTURE, registry._MODELS[DRAFT_ARCHITECTURE])  # restored after
    changed = importlib.import_module(f"tokenspeed.runtime.{module}")
    if name == "PLUGIN_API_VERSION":
        monkeypatch.setattr(changed, name, 3)
    else:
        monkeypatch.delattr(changed, name)
    eagle31_mla_tokenspeed.register()  # what the loader calls (its loading: the fresh-process test above)


QWEN = {"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "num_hidden_layers": K3_LAYERS, **SIZES}
QWEN |= {"num_attention_heads": 2, "num_key_value_heads": 2, "intermediate_size": 256}
FLAG_MESSAGE = r"1,45,89 makes TokenSpeed's KimiK3For\w+ capture one-based \[1, 45, 89\].*pass {} 2,46,90"
REFUSALS = [  # (target, what differs, the message)
    ("k3", dict(flag="1,45,89"), FLAG_MESSAGE.format("--eagle3-layers-to-capture")),
    ("deepseek", dict(flag="2,46,90"), "--eagle3-layers-to-capture 2,46,90 makes TokenSpeed's Deep"),
    ("k3", dict(flag="90,46,2"), "capture an error"),  # Kimi-K3's own check refuses unsorted ids
    ("deepseek", dict(ids=[2, 46, K3_LAYERS]), "captures the INPUT of layer i"),  # it captures before a layer
    (kimi_k3_target(**SIZES, num_hidden_layers=60), {}, "beyond the target's depth of 60"),
    (kimi_k3_target(hidden_size=256, vocab_size=300), {}, "target_hidden_size` is 128 but"),
    (QWEN, {}, "how TokenSpeed's Qwen3ForCausalLM reads EAGLE-3 layer ids is not"),
    ("k3", dict(config={"eagle_aux_hidden_state_layer_ids": [3, 47, 91]}), "contradictory"),
    ("k3", dict(stand_in=_k3_capturing_the_mixture), "_dspark_capture_stream.*prefix-only"),
    ("k3", dict(stand_in=_k3_setter_reading_otherwise), r"given \[2, 46, 90\] captures one-based \[3, 47, 91\]"),
]
UNKNOWN = r"the TokenSpeed plugin cannot serve this drafter: .*{}.*supports TokenSpeed 0\.1\.1 \(installed: 0\.1\.1\)"
for module, name, named in [
    ("plugins", "PLUGIN_API_VERSION", "plugin API version 3"),
    ("configs.model_config", "configure_mla_attention", "model_config:configure_mla_attention` is missing"),
    ("execution.factory", "_eagle_aux_layer_ids", "factory:_eagle_aux_layer_ids` is missing"),
]:  # an unknown TokenSpeed release: the plugin's stand-in drafter stops serving it
    REFUSALS.append(("k3", dict(stand_in=partial(_unknown_release, module, name)), UNKNOWN.format(named)))


@pytest.mark.parametrize("target, change, message", REFUSALS)
def test_what_would_feed_the_drafter_other_layers_is_refused(folders, tmp_path, monkeypatch, target, change, message):
    from eagle31_mla.serving.compatibility import PluginAPIError, ServingConfigError

    target = getattr(folders, target) if isinstance(target, str) else write_config(tmp_path / "target", target)
    draft = folders.drafts["published"]
    if "ids" in change:
        draft = write_draft(tmp_path / "draft", "published", ids=change["ids"])
    if "config" in change:
        draft = write_config(tmp_path / "draft", json.loads((draft / "config.json").read_text()) | change["config"])
    if "stand_in" in change:
        change["stand_in"](monkeypatch)
    flags = {"eagle3_layers_to_capture": change["flag"]} if "flag" in change else {}
    unknown_release = isinstance(change.get("stand_in"), partial)
    with pytest.raises(PluginAPIError if unknown_release else ServingConfigError, match=message):
        model_configs(target, draft, **flags)


def test_every_checkpoint_layout_reaches_tokenspeed_under_the_same_names(monkeypatch):
    """Published names, NeMo's `model.` prefix and training's `midlayer.*` reach TokenSpeed's own name mapping as the
    same parameters (only the final copy, which needs the GPU-built model, is replaced by a recorder)."""
    from tokenspeed.runtime.models.deepseek_v3 import DeepseekV3ForCausalLM, Eagle3DeepseekV2ForCausalLM
    from tokenspeed.runtime.models.registry import ModelRegistry

    Eagle31MLADrafter, _ = ModelRegistry.resolve_model_cls([DRAFT_ARCHITECTURE])  # the plugin's, registered
    assert issubclass(Eagle31MLADrafter, Eagle3DeepseekV2ForCausalLM)  # TokenSpeed's own, but for its profile:
    assert {name for name in vars(Eagle31MLADrafter) if not name.startswith("__")} == {"model_profile", "load_weights"}
    received = []
    monkeypatch.setattr(DeepseekV3ForCausalLM, "load_weights", lambda self, weights: received.append(list(weights)))
    tensors = tiny_drafter().state_dict()
    layouts = {
        "published": dict(tensors),
        "nemo": {f"model.{name}": tensor for name, tensor in tensors.items()},
        "training": {name.replace("layers.0.", "midlayer."): tensor for name, tensor in tensors.items()},
    }
    names = {}
    for layout, weights in layouts.items():
        bare(Eagle31MLADrafter).load_weights(list(weights.items()))
        names[layout] = [name for name, _ in received.pop()]
    assert names["nemo"] == names["training"] == names["published"]
    assert "model.midlayer.self_attn.kv_a_proj_with_mqa.weight" in names["published"]
    assert "lm_head.weight" in names["published"] and "model.fc.weight" in names["published"]
    # control: TokenSpeed's own drafter takes NeMo's names somewhere else
    Eagle3DeepseekV2ForCausalLM.load_weights(bare(Eagle3DeepseekV2ForCausalLM), list(layouts["nemo"].items()))
    assert [name for name, _ in received.pop()] != names["published"]


def test_the_tokenspeed_facts_match_the_installed_release():
    import inspect
    from importlib.metadata import version

    from tokenspeed.runtime.configs import model_config
    from tokenspeed.runtime.engine import batch_log, generation_output_processor, output_processor
    from tokenspeed.runtime.execution.factory import _eagle_aux_layer_ids
    from tokenspeed.runtime.metrics import collector

    from eagle31_mla.serving.engine_facts import release_label, tokenspeed as facts

    # the plugin checks PLUGIN_API_VERSION, PLUGIN_SYMBOLS and STORED_IDS itself, and its entry point and the
    # flag are used above: the tests above see it serve
    assert version("tokenspeed") == release_label(facts.RELEASES[-1])
    assert DRAFT_ARCHITECTURE in model_config._MLA_ARCHITECTURES
    # where TokenSpeed looks for the draft's ids: the nested key first, hiding the top level
    assert _eagle_aux_layer_ids({"eagle_aux_hidden_state_layer_ids": [2], "eagle_config": {}}) is None
    assert _eagle_aux_layer_ids({"eagle_aux_hidden_state_layer_ids": [2]}) == [2]
    # what `eagle31-mla acceptance --server --engine tokenspeed` reads, against the engine's own source lines
    assert 'f"Req: {rid!s} Finish! Accept_num_tokens_avg: "' in inspect.getsource(generation_output_processor)
    assert facts.LOG_REQUEST_FINISH.startswith("Req: {rid} Finish! Accept_num_tokens_avg: ")
    assert "avg_accept_len: {avg_accept:.2f}, accept_rate: " in inspect.getsource(batch_log)
    assert "avg_accept_len: {avg_accept:.2f}, accept_rate: {accept_rate:.2f}" in facts.LOG_DECODE_BATCH
    assert f'name="{facts.METRIC_PREFIX}num_requests_running"' in inspect.getsource(collector)
    assert 'meta_info["spec_accepted_tokens"]' in inspect.getsource(output_processor)
