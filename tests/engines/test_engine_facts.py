"""The engine facts `doctor` relies on, checked against the real engines where they are installed:
which ids vLLM 0.32's two model runners take from a draft config, and what SGLang 0.5.23's target
classes store for the ids they are given. (The tables cover other releases from their sources.)"""

from __future__ import annotations

import inspect
from types import SimpleNamespace

import pytest

from eagle31_mla.serving.engine_facts import ENGINE_NAMES
from eagle31_mla.serving.engines import InputError, Target, sglang_capture, vllm_capture
from eagle31_mla.serving.pd import parse_launch
from tests.support.engine_configs import LastRank, bare, deepseek_target, draft, llama_target, nested_only

DS = Target.from_config(deepseek_target(layers=61), "ds")

# raw draft configs as files hold them: every place vLLM/SGLang might look, in every convention
RAW = {
    "canonical": draft([3, 30, 57]),
    "nested one-based": nested_only([3, 30, 57], "one_based"),
    "nested zero-based (training)": nested_only([1, 29, 56]),
    "nested starting at 0": nested_only([0, 29, 56], "zero_based"),
    "top level only": draft([3, 30, 57], eagle_config={"use_aux_hidden_state": True}),
    "target_layer_ids": nested_only([3, 30, 57], "one_based", target_layer_ids=[3, 30, 57]),
    "none": draft(eagle_aux_hidden_state_layer_ids=None, eagle_config={"use_aux_hidden_state": True}),
}


@pytest.mark.vllm
def test_vllm_splits_pipeline_stages_where_the_table_says(monkeypatch):
    """doctor's stage boundaries (the PR 50487 check) are vLLM's own ``get_pp_indices``, even and uneven splits and
    VLLM_PP_LAYER_PARTITION; a partition vLLM refuses is refused."""
    pytest.importorskip("vllm", reason="needs the vLLM CPU build (.venv)")
    from vllm.distributed.utils import get_pp_indices

    from eagle31_mla.serving.engine_facts.vllm import PP_PARTITION_ENV, pipeline_stage_starts

    for layers, pp in [(93, 2), (93, 4), (93, 5), (61, 3), (61, 8), (4, 4), (10, 3)]:
        assert pipeline_stage_starts(layers, pp) == [get_pp_indices(layers, r, pp)[0] for r in range(1, pp)]
    monkeypatch.setenv(PP_PARTITION_ENV, "23,24,23,23")
    # vLLM caches its environment once an engine has started: the module attribute wins over its cache
    monkeypatch.setattr(__import__("vllm.envs").envs, PP_PARTITION_ENV, "23,24,23,23", raising=False)
    assert pipeline_stage_starts(93, 4, "23,24,23,23") == [get_pp_indices(93, r, 4)[0] for r in range(1, 4)]
    with pytest.raises(ValueError, match="expected 4 parts summing to 93"):
        pipeline_stage_starts(93, 4, "23,24,23")


@pytest.mark.vllm
@pytest.mark.parametrize("form", sorted(RAW))
def test_vllm_runners_read_what_the_table_says(form):
    pytest.importorskip("vllm", reason="needs the vLLM CPU build (.venv)")
    from vllm.model_executor.models.deepseek_v2 import DeepseekV2ForCausalLM
    from vllm.v1.worker.gpu.spec_decode.eagle.eagle3_utils import get_eagle3_aux_layers_from_config
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from eagle31_mla.serving.engine_facts.vllm import features

    raw = RAW[form]
    spec = SimpleNamespace(draft_model_config=SimpleNamespace(hf_config=SimpleNamespace(**raw)))
    # what vLLM's own DeepSeek target captures when the draft names no ids (asked of vLLM, not restated)
    target = SimpleNamespace(model=SimpleNamespace(layers=[None] * 61))
    default = tuple(DeepseekV2ForCausalLM.get_eagle3_aux_hidden_state_layers(target))
    v1 = GPUModelRunner._get_eagle3_aux_layers_from_config(SimpleNamespace(speculative_config=spec)) or default
    v2 = get_eagle3_aux_layers_from_config(spec) or default
    engine = features((0, 32, 0))
    assert vllm_capture(raw, DS, engine, "v1").layers == tuple(sorted(set(v1)))
    assert vllm_capture(raw, DS, engine, "v2").layers == tuple(sorted(set(v2)))


@pytest.mark.sglang
@pytest.mark.parametrize("form", sorted(RAW))
@pytest.mark.parametrize("target", ["DeepseekV3ForCausalLM", "LlamaForCausalLM"])
def test_sglang_targets_store_what_the_table_says(form, target):
    pytest.importorskip("sglang", reason="runs in .venv-sglang")
    from sglang.srt.models import deepseek_v2, llama

    raw = RAW[form]
    module = deepseek_v2 if target.startswith("Deepseek") else llama
    model = bare(
        getattr(module, target),
        pp_group=LastRank(),
        config=SimpleNamespace(num_hidden_layers=61),
        model=SimpleNamespace(layers_to_capture=[]),
    )
    nested = raw.get("eagle_config") or {}
    model.set_eagle3_layers_to_capture(nested.get("eagle_aux_hidden_state_layer_ids"))  # SGLang passes these, raw
    config = deepseek_target(layers=61) if target.startswith("Deepseek") else llama_target(layers=61)
    capture = sglang_capture(raw, Target.from_config(config, target))
    assert capture.layers == tuple(model.model.layers_to_capture)


@pytest.mark.sglang
def test_sglang_mla_list_and_kimi_k3_capture_facts():
    pytest.importorskip("sglang", reason="runs in .venv-sglang")
    from sglang.srt.configs import model_config
    from sglang.srt.models import kimi_k3

    from eagle31_mla.model.configuration_eagle31_mla import ENGINE_ARCHITECTURE
    from eagle31_mla.serving.engine_facts import KIMI_K3_ARCHITECTURES
    from eagle31_mla.serving.engine_facts.sglang import features

    assert f'"{ENGINE_ARCHITECTURE}" in self.hf_config.architectures' in inspect.getsource(model_config)
    assert features((0, 5, 23)).kimi_k3_eagle3_capture is False
    for name in KIMI_K3_ARCHITECTURES:  # none of its own; the plugin's, if it was added in this process
        method = getattr(getattr(kimi_k3, name), "set_eagle3_layers_to_capture", None)
        assert method is None or method.__module__ == "eagle31_mla_sglang.kimi_k3"


SPEC = "vllm serve T --speculative-config '{}'".format
VLLM, SGLANG = pytest.mark.vllm, pytest.mark.sglang


@pytest.mark.parametrize(
    "engine, line, message",
    [  # vLLM's own parser and its SpeculativeConfig's field types, after the library's typed checks
        pytest.param("vllm", "vllm serve T -tp two", "argument --tensor-parallel-size/-tp: invalid int value: 'two'",
                     marks=VLLM),
        pytest.param("vllm", SPEC('{"model": "D", "bogus": 1}'), "--speculative-config has 'bogus', not a field of "
                     "vLLM's SpeculativeConfig", marks=VLLM),
        pytest.param("vllm", SPEC('{"model": "D", "draft_tensor_parallel_size": "two"}'), "--speculative-config's "
                     "draft_tensor_parallel_size 'two': Input should be a valid integer, unable to parse string as an "
                     "integer", marks=VLLM),
        pytest.param("sglang", "sglang serve --model-path T --tp-size two", "argument --tp-size/--tensor-parallel-size"
                     ": invalid int value: 'two'", marks=SGLANG),
        pytest.param("sglang", "sglang serve --model-path T --mem-fraction-static most", "argument "
                     "--mem-fraction-static: invalid float value: 'most'", marks=SGLANG),
    ],
)  # fmt: skip
def test_launch_lines_are_read_by_the_engines_own_rules(engine, line, message):
    with pytest.raises(InputError) as refused:
        parse_launch(engine, line, "the prefill command")
    assert str(refused.value) == f"the prefill command: {ENGINE_NAMES[engine]}'s own rules refuse it: {message}"
