"""The TokenSpeed plugin with the real TokenSpeed 0.1.1 package (its own virtual environment).

TokenSpeed's engine cannot run without an NVIDIA, AMD or Ascend GPU: its kernel package probes for one
when it is imported. These tests install four narrow stand-ins for that GPU first
(:mod:`tests.support.tokenspeed_standin`: the platform description, a driver library with no device,
Triton's active driver, ``nvidia-smi``'s memory answer) and then go as deep as runs on CPU: TokenSpeed's
own plugin loader in a fresh process, its model registry, its real ``ServerArgs`` and ``ModelConfig`` for
the target and the draft (where the plugin's profile runs), its own ``_eagle_aux_layer_ids``, and the real
target classes' ``set_eagle3_layers_to_capture``. Building the drafter's layers needs the GPU (its rotary
cache is allocated on CUDA), so weight loading is checked up to TokenSpeed's own name mapping.
"""

from __future__ import annotations

import json
import os
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

from tests.support.engine_configs import K3_IDS, bare, deepseek_target, kimi_k3_target  # noqa: E402
from tests.support.paths import ROOT  # noqa: E402
from tests.support.tiny import published_style_config, tiny_drafter, write_checkpoint  # noqa: E402

K3_LAYERS = 93
FORMS = ["published", "training", "top_level", "both", "exported"]
DRAFT_ARCHITECTURE = "Eagle3DeepseekV2ForCausalLM"


def write_draft(folder: Path, form: str, ids=K3_IDS) -> Path:
    model = tiny_drafter(
        hidden_size=128, target_hidden_size=128, eagle_aux_hidden_state_layer_ids=ids, target_num_hidden_layers=None
    )
    if form == "exported":
        model.save_pretrained(folder)  # this library's own files: labelled one-based ids, auto_map, remote code
        return folder
    return write_checkpoint(folder, published_style_config(model, ids_form=form), model.state_dict())


def write_target(folder: Path, config: dict) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("tokenspeed")
    sizes = dict(hidden_size=128, vocab_size=300)
    return SimpleNamespace(
        k3=write_target(root / "kimi-k3", kimi_k3_target(**sizes)),
        deepseek=write_target(root / "deepseek-v3", deepseek_target(K3_LAYERS, **sizes)),
        drafts={form: write_draft(root / f"draft-{form}", form) for form in FORMS},
        root=root,
    )


@pytest.fixture(scope="module")
def plugins_loaded():
    from tokenspeed.runtime.plugins import ensure_loaded

    ensure_loaded()


def server_args(target: Path, draft: Path, **flags):
    from tokenspeed.runtime.utils.server_args import ServerArgs

    return ServerArgs(
        model=str(target), speculative_algorithm="EAGLE3", speculative_draft_model_path=str(draft), **flags
    )


def model_configs(target: Path, draft: Path, **flags):
    """TokenSpeed's own target and draft ModelConfig, built as its event loop builds them."""
    from tokenspeed.runtime.configs.model_config import ModelConfig

    args = server_args(target, draft, **flags)
    target_config = ModelConfig(str(target), server_args=args, model_override_args="{}")
    draft_config = ModelConfig(str(draft), server_args=args, is_draft_worker=True, model_override_args="{}")
    return args, target_config, draft_config


# ---- the target classes, built without weights, read back by the test itself ------------------------


def k3_target(layers: int = K3_LAYERS):
    from tokenspeed.runtime.models import kimi_k3

    language_model = bare(kimi_k3.KimiLinearForCausalLM, model=SimpleNamespace(layers=[None] * layers))
    return bare(kimi_k3.KimiK3ForConditionalGeneration, language_model=language_model)


def deepseek_v3_target(layers: int = K3_LAYERS):
    from tokenspeed.runtime.models.deepseek_v3 import DeepseekV3ForCausalLM

    return bare(
        DeepseekV3ForCausalLM, config=SimpleNamespace(num_hidden_layers=layers), model=SimpleNamespace(layers=[None])
    )


def captured(target) -> list[int]:
    """The one-based completed-layer ids a target class stored: Kimi-K3 keeps them as given
    (``eagle3_layers_to_capture``); DeepSeek-V3 keeps "capture before layer i", i.e. after i layers."""
    inner = getattr(target, "language_model", None) or target
    stored = getattr(inner.model, "eagle3_layers_to_capture", None)
    if stored is None:
        stored = inner.model.layers_to_capture
    return sorted(stored)


def served(target_name: str, draft_config) -> list[int]:
    """What TokenSpeed's ``configure_draft_target`` does: ids from the draft config object, given to the target."""
    from tokenspeed.runtime.execution.factory import _eagle_aux_layer_ids

    target = {"k3": k3_target, "deepseek": deepseek_v3_target}[target_name]()
    target.set_eagle3_layers_to_capture(_eagle_aux_layer_ids(draft_config.hf_config))
    return captured(target)


# ---- the plugin loads --------------------------------------------------------------------------------


def run_fresh(code: str, **env) -> subprocess.CompletedProcess:
    prelude = "from tests.support import tokenspeed_standin\ntokenspeed_standin.install()\n"
    return subprocess.run(
        [sys.executable, "-c", prelude + code],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
        env={**os.environ, **env},
    )


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
        "    'class': f'{cls.__module__}.{cls.__qualname__}', 'arch': arch,\n"
        "    'failed': [str(w.message) for w in caught if 'Failed to load plugin' in str(w.message)]}))\n"
    )
    assert result.returncode == 0, result.stderr[-4000:]
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert out["failed"] == []
    assert out["plugins"] == [["eagle31_mla", "eagle31-mla", [["model", [DRAFT_ARCHITECTURE]]]]]
    assert out["class"] == "eagle31_mla_tokenspeed.drafter.Eagle31MLADrafter"
    assert out["arch"] == DRAFT_ARCHITECTURE


def test_the_drafter_is_tokenspeeds_own_mla_drafter(plugins_loaded):
    from tokenspeed.runtime.models.deepseek_v3 import Eagle3DeepseekV2ForCausalLM
    from tokenspeed.runtime.models.registry import ModelRegistry

    cls, _ = ModelRegistry.resolve_model_cls([DRAFT_ARCHITECTURE])
    assert issubclass(cls, Eagle3DeepseekV2ForCausalLM) and cls is not Eagle3DeepseekV2ForCausalLM
    # only the profile and the checkpoint-name reading are the plugin's: the model itself is TokenSpeed's
    own = {name for name in vars(cls) if not name.startswith("__")}
    assert own == {"model_profile", "load_weights"}


@pytest.mark.parametrize("form", FORMS)
def test_tokenspeed_gives_the_drafter_an_mla_cache(folders, plugins_loaded, form):
    from tokenspeed.runtime.configs.model_config import AttentionArch

    _, _, draft = model_configs(folders.k3, folders.drafts[form])
    assert draft.model_profile_architecture == DRAFT_ARCHITECTURE
    assert draft.model_profile.cache_family == "mla"
    assert draft.attention_arch == AttentionArch.MLA
    hf = draft.hf_config
    assert (draft.kv_lora_rank, draft.qk_nope_head_dim, draft.qk_rope_head_dim, draft.v_head_dim) == (
        hf.kv_lora_rank,
        hf.qk_nope_head_dim,
        hf.qk_rope_head_dim,
        hf.v_head_dim,
    )


# ---- the aux ids: every form, both target families ---------------------------------------------------


@pytest.mark.parametrize("target_name", ["k3", "deepseek"])
@pytest.mark.parametrize("form", FORMS)
def test_every_form_makes_the_target_capture_the_trained_layers(folders, plugins_loaded, form, target_name):
    _, _, draft = model_configs(getattr(folders, target_name), folders.drafts[form])
    assert served(target_name, draft) == K3_IDS  # after zero-based layers 1, 45, 89, on either target


def test_the_traps_the_plugin_closes(folders, plugins_loaded):
    """Control: TokenSpeed's own reading, without the plugin's profile, is one layer off in both directions."""
    from tokenspeed.runtime.utils.hf_transformers_utils import get_config

    def raw(form):
        return SimpleNamespace(hf_config=get_config(str(folders.drafts[form]), trust_remote_code=True))

    assert served("k3", raw("training")) == [1, 45, 89]  # nested zero-based, taken one-based: one layer early
    assert served("deepseek", raw("published")) == [3, 47, 91]  # nested one-based, plus one: one layer late
    assert served("k3", raw("both")) == [1, 45, 89]  # the nested key hides the right top-level one


def test_an_agreeing_flag_is_accepted_and_a_disagreeing_one_refused(folders, plugins_loaded):
    from eagle31_mla_tokenspeed.drafter import ServingConfigError

    model_configs(folders.k3, folders.drafts["training"], eagle3_layers_to_capture="2,46,90")
    model_configs(folders.deepseek, folders.drafts["published"], eagle3_layers_to_capture="1,45,89")
    with pytest.raises(ServingConfigError) as err:
        model_configs(folders.k3, folders.drafts["published"], eagle3_layers_to_capture="1,45,89")
    message = str(err.value)
    assert "--eagle3-layers-to-capture 1,45,89" in message and "one-based [1, 45, 89]" in message
    assert "pass --eagle3-layers-to-capture 2,46,90" in message
    with pytest.raises(ServingConfigError, match="--eagle3-layers-to-capture 2,46,90 makes TokenSpeed's Deepseek"):
        model_configs(folders.deepseek, folders.drafts["published"], eagle3_layers_to_capture="2,46,90")
    with pytest.raises(ServingConfigError, match="capture an error"):  # K3's own check refuses unsorted ids
        model_configs(folders.k3, folders.drafts["published"], eagle3_layers_to_capture="90,46,2")


def test_what_a_target_cannot_capture_is_refused(folders, plugins_loaded, tmp_path):
    from eagle31_mla_tokenspeed.drafter import ServingConfigError

    last = write_draft(tmp_path / "last", "published", ids=[2, 46, K3_LAYERS])
    model_configs(folders.k3, last)  # Kimi-K3 captures after a layer: its last one too
    with pytest.raises(ServingConfigError, match="captures the INPUT of layer i"):
        model_configs(folders.deepseek, last)  # DeepSeek-V3 captures before a layer
    shallow = write_target(tmp_path / "shallow", kimi_k3_target(hidden_size=128, vocab_size=300, num_hidden_layers=60))
    with pytest.raises(ServingConfigError, match="beyond the target's depth of 60"):
        model_configs(shallow, folders.drafts["published"])
    wider = write_target(tmp_path / "wider", kimi_k3_target(hidden_size=256, vocab_size=300))
    with pytest.raises(ServingConfigError, match="target_hidden_size` is 128 but"):
        model_configs(wider, folders.drafts["published"])
    qwen = write_target(
        tmp_path / "qwen",
        {
            "model_type": "qwen3",
            "architectures": ["Qwen3ForCausalLM"],
            "num_hidden_layers": K3_LAYERS,
            "hidden_size": 128,
            "vocab_size": 300,
            "num_attention_heads": 2,
            "num_key_value_heads": 2,
            "intermediate_size": 256,
        },
    )
    with pytest.raises(ServingConfigError, match="how TokenSpeed's Qwen3ForCausalLM reads EAGLE-3 layer ids is not"):
        model_configs(qwen, folders.drafts["published"])


def test_contradictory_ids_stop_at_the_profile(folders, plugins_loaded, tmp_path):
    from eagle31_mla_tokenspeed.drafter import ServingConfigError

    config = json.loads((folders.drafts["published"] / "config.json").read_text())
    config["eagle_aux_hidden_state_layer_ids"] = [3, 47, 91]
    folder = tmp_path / "contradictory"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ServingConfigError, match="contradictory"):
        model_configs(folders.k3, folder)


def test_the_config_written_back_reads_the_same_by_the_librarys_rule(folders, plugins_loaded):
    """Idempotent: a draft config object the plugin already rewrote (zero-based, for DeepSeek) is read
    again as the same layers, and TokenSpeed finds exactly the form the target needs."""
    from tokenspeed.runtime.models.deepseek_v3 import DeepseekV3ForCausalLM

    from eagle31_mla.model.aux_layers import aux_layer_ids_from_attributes
    from eagle31_mla.serving.engines import Target
    from eagle31_mla_tokenspeed.drafter import target_form

    _, target, draft = model_configs(folders.deepseek, folders.drafts["published"])
    assert draft.hf_config.eagle_aux_hidden_state_layer_ids == [1, 45, 89]
    assert draft.hf_config.aux_layer_ids_convention == "zero_based"
    assert list(aux_layer_ids_from_attributes(draft.hf_config)[0].one_based) == K3_IDS
    again = target_form(draft.hf_config, Target.from_config(target.hf_config.to_dict()), DeepseekV3ForCausalLM)
    assert again == [1, 45, 89] and served("deepseek", draft) == K3_IDS


# ---- Kimi-K3's stream -----------------------------------------------------------------------------


def test_k3_eagle3_capture_is_the_prefix_stream():
    from eagle31_mla_tokenspeed.drafter import k3_stream_problem

    assert k3_stream_problem() is None


def test_a_k3_capture_of_another_stream_is_refused(folders, plugins_loaded, monkeypatch):
    """Negative control: the same forward capturing the AttnRes mixture instead is recognised and refused."""
    import inspect
    import textwrap

    from tokenspeed.runtime.models import kimi_k3

    from eagle31_mla_tokenspeed.drafter import ServingConfigError, k3_stream_problem

    source = textwrap.dedent(inspect.getsource(kimi_k3.KimiLinearModel.forward))
    mixture = source.replace(
        "aux_hidden_states.append(prefix_sum.clone())",
        "aux_hidden_states.append(self._dspark_capture_stream(layer_idx, prefix_sum, block_residual))",
    )
    assert mixture != source
    namespace = {}
    exec(compile(mixture, kimi_k3.__file__, "exec"), vars(kimi_k3), namespace)
    monkeypatch.setattr(inspect, "getsource", lambda obj: mixture)
    monkeypatch.setattr(kimi_k3.KimiLinearModel, "forward", namespace["forward"])
    assert "_dspark_capture_stream" in k3_stream_problem()
    with pytest.raises(ServingConfigError, match="prefix-only stream"):
        model_configs(folders.k3, folders.drafts["published"])


# ---- loud failure when TokenSpeed differs ------------------------------------------------------------


@pytest.mark.parametrize(
    "change, named",
    [
        ("plugins.PLUGIN_API_VERSION = 3", "plugin API version 3"),
        (
            "from tokenspeed.runtime.configs import model_config\ndel model_config.configure_mla_attention",
            "model_config:configure_mla_attention` is missing",
        ),
        (
            "from tokenspeed.runtime.execution import factory\ndel factory._eagle_aux_layer_ids",
            "factory:_eagle_aux_layer_ids` is missing",
        ),
    ],
)
def test_a_tokenspeed_the_plugin_does_not_know_stops_serving_the_drafter(folders, change, named):
    result = run_fresh(
        "import tokenspeed.runtime.plugins as plugins\n"
        f"{change}\n"
        "from tests.engines.test_tokenspeed_plugin import model_configs\n"
        f"model_configs({str(folders.k3)!r}, {str(folders.drafts['published'])!r})\n"
    )
    assert result.returncode != 0
    assert "PluginAPIError: eagle31-mla: the TokenSpeed plugin cannot serve this drafter" in result.stderr
    assert named in result.stderr and "supports TokenSpeed 0.1.1 (installed: 0.1.1)" in result.stderr


def test_a_target_setter_that_reads_ids_otherwise_is_caught(folders, plugins_loaded, monkeypatch):
    """The plugin checks what the served class's own setter stores: here Kimi-K3's language model loses its
    setter (the one it inherits reads ids another way), and serving stops instead of capturing other layers."""
    from tokenspeed.runtime.models import kimi_k3

    from eagle31_mla_tokenspeed.drafter import ServingConfigError

    monkeypatch.delattr(kimi_k3.KimiLinearForCausalLM, "set_eagle3_layers_to_capture")
    with pytest.raises(ServingConfigError, match=r"given \[2, 46, 90\] captures one-based \[3, 47, 91\]"):
        model_configs(folders.k3, folders.drafts["published"])


# ---- checkpoint layouts --------------------------------------------------------------------------------


def test_every_checkpoint_layout_reaches_tokenspeed_under_the_same_names(monkeypatch):
    """The published names, NeMo's `model.` prefix and training's `midlayer.*` reach TokenSpeed's own loader
    as the same parameters (it maps `layers.0.` to `midlayer.` and adds `model.`; only the final copy into
    the parameters, which needs the GPU-built model, is replaced by a recorder)."""
    from tokenspeed.runtime.models.deepseek_v3 import DeepseekV3ForCausalLM, Eagle3DeepseekV2ForCausalLM

    from eagle31_mla_tokenspeed.drafter import Eagle31MLADrafter

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
        drafter = bare(Eagle31MLADrafter)
        drafter.load_weights(list(weights.items()))
        names[layout] = [name for name, _ in received.pop()]
    assert names["nemo"] == names["training"] == names["published"]
    assert "model.midlayer.self_attn.kv_a_proj_with_mqa.weight" in names["published"]
    assert "lm_head.weight" in names["published"] and "model.fc.weight" in names["published"]
    # control: TokenSpeed's own drafter takes NeMo's names somewhere else
    Eagle3DeepseekV2ForCausalLM.load_weights(bare(Eagle3DeepseekV2ForCausalLM), list(layouts["nemo"].items()))
    assert [name for name, _ in received.pop()] != names["published"]


# ---- the facts table, against the installed release -------------------------------------------------


def test_the_tokenspeed_facts_match_the_installed_release(plugins_loaded):
    import pkgutil
    from importlib.metadata import entry_points, version

    import tokenspeed.runtime.plugins as plugins
    from tokenspeed.runtime.configs import model_config
    from tokenspeed.runtime.execution.factory import _eagle_aux_layer_ids
    from tokenspeed.runtime.utils.server_args import ServerArgs

    from eagle31_mla.model.configuration_eagle31_mla import ENGINE_ARCHITECTURE
    from eagle31_mla.serving.engine_facts import release_label, tokenspeed as facts

    assert version("tokenspeed") == release_label(facts.RELEASES[-1])
    assert plugins.PLUGIN_API_VERSION == facts.PLUGIN_API_VERSION
    assert plugins.ENTRY_POINT_GROUP == facts.ENTRY_POINT_GROUP
    assert [ep.value for ep in entry_points(group=facts.ENTRY_POINT_GROUP, name="eagle31_mla")] == [
        "eagle31_mla_tokenspeed:register"
    ]
    for symbol in facts.PLUGIN_SYMBOLS:
        assert pkgutil.resolve_name(symbol) is not None, symbol
    assert ENGINE_ARCHITECTURE in model_config._MLA_ARCHITECTURES
    assert "eagle3_layers_to_capture" in ServerArgs.__dataclass_fields__
    assert facts.LAYERS_FLAG == "--eagle3-layers-to-capture"
    # how each target class reads what it is handed, and where it keeps it
    for target, reading in ((k3_target(), facts.ONE_BASED), (deepseek_v3_target(), facts.PLUS_ONE)):
        target.set_eagle3_layers_to_capture([5, 9])
        assert captured(target) == ([5, 9] if reading == facts.ONE_BASED else [6, 10])
        inner = getattr(target, "language_model", None) or target
        assert hasattr(inner.model, facts.STORED_IDS[reading])
    # where TokenSpeed looks for the draft's ids: the nested key first, hiding the top level
    assert _eagle_aux_layer_ids({"eagle_aux_hidden_state_layer_ids": [2], "eagle_config": {}}) is None
    assert _eagle_aux_layer_ids({"eagle_aux_hidden_state_layer_ids": [2]}) == [2]


def test_the_live_measurement_facts_are_in_the_installed_sources():
    """What `eagle31-mla acceptance --server --engine tokenspeed` reads (engine_facts.tokenspeed) against the
    engine's own source lines (the gateway's usage fields are Rust, in tokenspeed-smg: not checked here)."""
    import inspect

    from tokenspeed.runtime.engine import batch_log, generation_output_processor, output_processor
    from tokenspeed.runtime.metrics import collector

    from eagle31_mla.serving.engine_facts import tokenspeed as facts

    finish = inspect.getsource(generation_output_processor)
    assert 'f"Req: {rid!s} Finish! Accept_num_tokens_avg: "' in finish
    assert facts.LOG_REQUEST_FINISH.startswith("Req: {rid} Finish! Accept_num_tokens_avg: ")
    decode = inspect.getsource(batch_log)
    assert "avg_accept_len: {avg_accept:.2f}, accept_rate: " in decode
    assert "avg_accept_len: {avg_accept:.2f}, accept_rate: {accept_rate:.2f}" in facts.LOG_DECODE_BATCH
    assert f'name="{facts.METRIC_PREFIX}num_requests_running"' in inspect.getsource(collector)
    assert 'meta_info["spec_accepted_tokens"]' in inspect.getsource(output_processor)
