"""The TokenSpeed plugin with the real TokenSpeed 0.1.1 package (its own virtual environment), as deep as runs on
CPU once :mod:`tests.support.tokenspeed_standin` stands in for the GPU its kernel package probes for: its own plugin
loader, registry, ``ServerArgs``, ``ModelConfig`` (where the plugin's profile runs), ``_eagle_aux_layer_ids``, the
real target classes' id setters, and weight loading up to its own name mapping (the layers need the GPU).
"""

from __future__ import annotations

import json
import pkgutil
import subprocess
import sys
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

from tests.support.engine_configs import K3_IDS, bare, deepseek_target, kimi_k3_target, write_config  # noqa: E402
from tests.support.paths import ROOT  # noqa: E402
from tests.support.tiny import published_style_config, tiny_drafter, write_checkpoint  # noqa: E402

K3_LAYERS = 93
FORMS = ["published", "training", "top_level", "both", "exported"]
DRAFT_ARCHITECTURE = "Eagle3DeepseekV2ForCausalLM"
K3_TEXT = "tokenspeed.runtime.models.kimi_k3:KimiLinearForCausalLM"
SIZES = dict(hidden_size=128, vocab_size=300)


def write_draft(folder: Path, form: str, ids=K3_IDS) -> Path:
    sizes = dict(hidden_size=128, target_hidden_size=128, target_num_hidden_layers=None)
    model = tiny_drafter(eagle_aux_hidden_state_layer_ids=ids, **sizes)
    if form == "exported":
        model.save_pretrained(folder)  # this library's own files: labelled one-based ids, auto_map, remote code
        return folder
    return write_checkpoint(folder, published_style_config(model, ids_form=form), model.state_dict())


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("tokenspeed")
    return SimpleNamespace(
        k3=write_config(root / "kimi-k3", kimi_k3_target(**SIZES)),
        deepseek=write_config(root / "deepseek", deepseek_target(K3_LAYERS, **SIZES)),
        drafts={form: write_draft(root / f"draft-{form}", form) for form in FORMS},
    )


@pytest.fixture(scope="module")
def plugins_loaded():
    from tokenspeed.runtime.plugins import ensure_loaded

    ensure_loaded()


def model_configs(target: Path, draft: Path, **flags):
    """TokenSpeed's own target and draft ModelConfig, built as its event loop builds them."""
    from tokenspeed.runtime.configs.model_config import ModelConfig
    from tokenspeed.runtime.utils.server_args import ServerArgs

    flags |= dict(speculative_algorithm="EAGLE3", speculative_draft_model_path=str(draft))
    args = ServerArgs(model=str(target), **flags)
    target_config = ModelConfig(str(target), server_args=args, model_override_args="{}")
    return target_config, ModelConfig(str(draft), server_args=args, is_draft_worker=True, model_override_args="{}")


def weightless_target(name: str):
    """TokenSpeed's Kimi-K3 or DeepSeek-V3 target class without its layers: enough for its id setter."""
    from tokenspeed.runtime.models import deepseek_v3, kimi_k3

    if name == "k3":
        text = bare(kimi_k3.KimiLinearForCausalLM, model=SimpleNamespace(layers=[None] * K3_LAYERS))
        return bare(kimi_k3.KimiK3ForConditionalGeneration, language_model=text)
    config, model = SimpleNamespace(num_hidden_layers=K3_LAYERS), SimpleNamespace(layers=[None])
    return bare(deepseek_v3.DeepseekV3ForCausalLM, config=config, model=model)


def captured(target) -> list[int]:
    """The one-based completed-layer ids a target class stored, read by the test itself: Kimi-K3 keeps them as
    given; DeepSeek-V3 keeps "capture before layer i", i.e. after i layers."""
    inner = getattr(target, "language_model", None) or target
    stored = getattr(inner.model, "eagle3_layers_to_capture", None)
    return sorted(inner.model.layers_to_capture if stored is None else stored)


def served(target_name: str, draft_config) -> list[int]:
    """What TokenSpeed's ``configure_draft_target`` does: ids from the draft config object, given to the target."""
    from tokenspeed.runtime.execution.factory import _eagle_aux_layer_ids

    target = weightless_target(target_name)
    target.set_eagle3_layers_to_capture(_eagle_aux_layer_ids(draft_config.hf_config))
    return captured(target)


def run_fresh(code: str) -> subprocess.CompletedProcess:
    code = "from tests.support import tokenspeed_standin\ntokenspeed_standin.install()\n" + code
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)


def test_tokenspeeds_own_loader_registers_the_drafter_in_a_fresh_process():
    result = run_fresh(
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
    assert result.returncode == 0, result.stderr[-4000:]
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert out.pop("plugins") == [["eagle31_mla", "eagle31-mla", [["model", [DRAFT_ARCHITECTURE]]]]]  # once
    assert out == dict(cls="eagle31_mla_tokenspeed.drafter.Eagle31MLADrafter", arch=DRAFT_ARCHITECTURE, failed=[])


@pytest.mark.parametrize("target_name", ["k3", "deepseek"])
@pytest.mark.parametrize("form", FORMS)
def test_every_form_gets_an_mla_cache_and_the_trained_layers(folders, plugins_loaded, form, target_name):
    from tokenspeed.runtime.configs.model_config import AttentionArch

    _, draft = model_configs(getattr(folders, target_name), folders.drafts[form])
    assert (draft.model_profile_architecture, draft.model_profile.cache_family) == (DRAFT_ARCHITECTURE, "mla")
    assert draft.attention_arch == AttentionArch.MLA
    hf = draft.hf_config
    geometry = ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
    assert [getattr(draft, k) for k in geometry] == [getattr(hf, k) for k in geometry]
    assert served(target_name, draft) == K3_IDS  # after zero-based layers 1, 45, 89, on either target


def test_the_traps_the_plugin_closes(folders, plugins_loaded):
    """Control: TokenSpeed's own reading, without the plugin's profile, is one layer off in both directions."""
    from tokenspeed.runtime.utils.hf_transformers_utils import get_config

    def raw(form):
        return SimpleNamespace(hf_config=get_config(str(folders.drafts[form]), trust_remote_code=True))

    assert served("k3", raw("training")) == [1, 45, 89]  # nested zero-based, taken one-based: one layer early
    assert served("deepseek", raw("published")) == [3, 47, 91]  # nested one-based, plus one: one layer late
    assert served("k3", raw("both")) == [1, 45, 89]  # the nested key hides the right top-level one


def test_what_can_be_served_is_and_the_config_written_back_reads_the_same(folders, plugins_loaded, tmp_path):
    """An agreeing flag, a last layer on Kimi-K3 (which captures after a layer); and idempotent: a draft config
    the plugin rewrote (zero-based, for DeepSeek) reads as the same layers again."""
    from tokenspeed.runtime.models.deepseek_v3 import DeepseekV3ForCausalLM

    from eagle31_mla.model.aux_layers import aux_layer_ids_from_attributes
    from eagle31_mla.serving.engines import Target
    from eagle31_mla_tokenspeed.drafter import k3_stream_problem, target_form

    assert k3_stream_problem() is None  # the installed Kimi-K3 captures the prefix-only stream
    model_configs(folders.k3, folders.drafts["training"], eagle3_layers_to_capture="2,46,90")
    model_configs(folders.k3, write_draft(tmp_path / "last", "published", ids=[2, 46, K3_LAYERS]))  # after its last
    target, draft = model_configs(folders.deepseek, folders.drafts["published"], eagle3_layers_to_capture="1,45,89")
    assert draft.hf_config.eagle_aux_hidden_state_layer_ids == [1, 45, 89]
    assert draft.hf_config.aux_layer_ids_convention == "zero_based"
    assert list(aux_layer_ids_from_attributes(draft.hf_config)[0].one_based) == K3_IDS
    again = target_form(draft.hf_config, Target.from_config(target.hf_config.to_dict()), DeepseekV3ForCausalLM)
    assert again == [1, 45, 89] and served("deepseek", draft) == K3_IDS


def _k3_capturing_the_mixture(monkeypatch):
    """Kimi-K3's real forward, changed to capture the AttnRes mixture instead of the prefix stream."""
    import inspect
    import textwrap

    from tokenspeed.runtime.models import kimi_k3

    source = textwrap.dedent(inspect.getsource(kimi_k3.KimiLinearModel.forward))
    mixture = source.replace("prefix_sum.clone()", "self._dspark_capture_stream(layer_idx, prefix_sum, block_residual)")
    assert mixture != source
    namespace = {}
    exec(compile(mixture, kimi_k3.__file__, "exec"), vars(kimi_k3), namespace)
    monkeypatch.setattr(inspect, "getsource", lambda obj: mixture)
    monkeypatch.setattr(kimi_k3.KimiLinearModel, "forward", namespace["forward"])


def _k3_setter_reading_otherwise(monkeypatch):  # the setter Kimi-K3's language model inherits reads ids otherwise
    monkeypatch.delattr(pkgutil.resolve_name(K3_TEXT), "set_eagle3_layers_to_capture")


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


@pytest.mark.parametrize("target, change, message", REFUSALS)
def test_what_would_feed_the_drafter_other_layers_is_refused(
    folders, plugins_loaded, tmp_path, monkeypatch, target, change, message
):
    from eagle31_mla_tokenspeed.drafter import ServingConfigError

    target = getattr(folders, target) if isinstance(target, str) else write_config(tmp_path / "target", target)
    draft = folders.drafts["published"]
    if "ids" in change:
        draft = write_draft(tmp_path / "draft", "published", ids=change["ids"])
    if "config" in change:
        draft = write_config(tmp_path / "draft", json.loads((draft / "config.json").read_text()) | change["config"])
    if "stand_in" in change:
        change["stand_in"](monkeypatch)
    flags = {"eagle3_layers_to_capture": change["flag"]} if "flag" in change else {}
    with pytest.raises(ServingConfigError, match=message):
        model_configs(target, draft, **flags)


CHANGED = [("plugins", "PLUGIN_API_VERSION"), ("configs.model_config", "configure_mla_attention")]
CHANGED += [("execution.factory", "_eagle_aux_layer_ids")]


@pytest.mark.parametrize("module, name", CHANGED)
def test_a_tokenspeed_the_plugin_does_not_know_stops_serving_the_drafter(folders, module, name):
    """Another plugin API version, or a symbol the plugin needs gone: serving the drafter stops, naming it."""
    change = f"m.{name} = 3" if name == "PLUGIN_API_VERSION" else f"del m.{name}"
    named = "plugin API version 3" if name == "PLUGIN_API_VERSION" else f"{module.split('.')[-1]}:{name}` is missing"
    result = run_fresh(
        f"import tokenspeed.runtime.{module} as m\n{change}\n"
        "from tests.engines.test_tokenspeed_plugin import model_configs\n"
        f"model_configs({str(folders.k3)!r}, {str(folders.drafts['published'])!r})\n"
    )
    assert result.returncode != 0
    assert "PluginAPIError: eagle31-mla: the TokenSpeed plugin cannot serve this drafter" in result.stderr
    assert named in result.stderr and "supports TokenSpeed 0.1.1 (installed: 0.1.1)" in result.stderr


def test_every_checkpoint_layout_reaches_tokenspeed_under_the_same_names(plugins_loaded, monkeypatch):
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


def test_the_tokenspeed_facts_match_the_installed_release(plugins_loaded):
    import inspect
    import pkgutil
    from importlib.metadata import entry_points, version

    import tokenspeed.runtime.plugins as plugins
    from tokenspeed.runtime.configs import model_config
    from tokenspeed.runtime.engine import batch_log, generation_output_processor, output_processor
    from tokenspeed.runtime.execution.factory import _eagle_aux_layer_ids
    from tokenspeed.runtime.metrics import collector
    from tokenspeed.runtime.utils.server_args import ServerArgs

    from eagle31_mla.serving.engine_facts import release_label, tokenspeed as facts

    assert version("tokenspeed") == release_label(facts.RELEASES[-1])
    assert plugins.PLUGIN_API_VERSION == facts.PLUGIN_API_VERSION
    assert plugins.ENTRY_POINT_GROUP == facts.ENTRY_POINT_GROUP
    ours = [ep.value for ep in entry_points(group=plugins.ENTRY_POINT_GROUP, name="eagle31_mla")]
    assert ours == ["eagle31_mla_tokenspeed:register"]
    assert all(pkgutil.resolve_name(symbol) is not None for symbol in facts.PLUGIN_SYMBOLS)
    assert DRAFT_ARCHITECTURE in model_config._MLA_ARCHITECTURES
    assert "eagle3_layers_to_capture" in ServerArgs.__dataclass_fields__
    # how each target class reads what it is handed, and where it keeps it
    for name, reading, stored in (("k3", facts.ONE_BASED, [5, 9]), ("deepseek", facts.PLUS_ONE, [6, 10])):
        target = weightless_target(name)
        target.set_eagle3_layers_to_capture([5, 9])
        assert captured(target) == stored
        assert hasattr((getattr(target, "language_model", None) or target).model, facts.STORED_IDS[reading])
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
