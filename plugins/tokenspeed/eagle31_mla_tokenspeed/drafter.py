"""TokenSpeed's own MLA drafter with a profile: MLA's latent cache, and the aux ids in the served target's form,
put right in ``configure_attention``, on the draft config object that ``configure_draft_target`` reads them from."""

from __future__ import annotations

import ast
import inspect
import logging
import pkgutil
import re
import textwrap
from types import SimpleNamespace

from tokenspeed.runtime.configs.model_config import configure_mla_attention
from tokenspeed.runtime.configs.model_profile import ModelProfile
from tokenspeed.runtime.models.deepseek_v3 import Eagle3DeepseekV2ForCausalLM
from torch import nn

from eagle31_mla.model.aux_layers import ONE_BASED, ZERO_BASED, write_aux_layer_ids
from eagle31_mla.model.modeling_eagle31_mla import canonical_tensor_name
from eagle31_mla.serving import compatibility
from eagle31_mla.serving.compatibility import PluginAPIError, ServingConfigError
from eagle31_mla.serving.engine_facts import captures_layer_input, tokenspeed as facts
from eagle31_mla.serving.engines import Target, tokenspeed_flag_form

logger = logging.getLogger(__name__)


class Eagle31MLADrafter(Eagle3DeepseekV2ForCausalLM):
    """TokenSpeed's ``Eagle3DeepseekV2ForCausalLM``, unchanged but for its profile and checkpoint names."""

    @classmethod
    def model_profile(cls, hf_config) -> ModelProfile:
        return ModelProfile(
            configure_attention=configure_draft,
            cache_family="mla",  # MLA's latent cache; Kimi-K3's unified cache takes exactly this draft view
            linear_attention=None,
            default_attention_backend=None,
            default_prefix_granularity=None,
            request_token_history=False,
            tokenizer_kwargs={},
            attention_instances_per_layer=1,
            numerics_envelopes=frozenset({"auto"}),
        )

    def load_weights(self, weights):
        """The published names (``layers.0.*``), whatever layout the checkpoint uses; TokenSpeed maps on from there."""
        return super().load_weights((canonical_tensor_name(name), tensor) for name, tensor in weights)


def configure_draft(model_config, server_args) -> None:
    """The profile's ``configure_attention``: MLA geometry, then the ids for the served target."""
    configure_mla_attention(model_config, server_args)
    if server_args.speculative_algorithm != "EAGLE3":
        return
    from tokenspeed.runtime.models.registry import ModelRegistry
    from tokenspeed.runtime.utils.hf_transformers_utils import get_config

    config = get_config(
        server_args.model, trust_remote_code=server_args.trust_remote_code, revision=server_args.revision
    )
    target = Target.from_config(config.to_dict(), server_args.model)
    target_cls, _ = ModelRegistry.resolve_model_cls(list(target.architectures))
    target_form(model_config.hf_config, target, target_cls, server_args.eagle3_layers_to_capture)


def target_form(hf_config, target: Target, target_cls: type, flag=None) -> list[int]:
    """Write the draft's ids into ``hf_config`` in the form ``target_cls`` captures right, and return it."""
    depth = target.num_layers or getattr(hf_config, "target_num_hidden_layers", None)
    ids, _ = compatibility.served_aux_ids(hf_config, depth)
    name = target_cls.__name__
    keys = ("target_hidden_size", "vocab_size", "target_num_hidden_layers")
    built_for = compatibility.Sizes(*(getattr(hf_config, k, None) for k in keys))
    sizes = compatibility.Sizes(target.hidden_size, target.vocab_size, target.num_layers)
    refusals = compatibility.size_mismatches(built_for, sizes)
    if (reading := facts.target_reading(target.architectures, target.model_type)) is None:
        raise ServingConfigError(
            f"eagle31-mla: how TokenSpeed's {name} reads EAGLE-3 layer ids is not known to the plugin, so it cannot "
            f"make it capture {ids.describe()}; serve a target in the table ({', '.join(facts.ONE_BASED_TARGETS)}, "
            f"{', '.join(facts.PLUS_ONE_TARGETS)})"
        )
    if captures_layer_input(reading) and target.num_layers:
        refusals += filter(None, [compatibility.last_layer_out_of_reach("TokenSpeed", name, ids, target.num_layers)])
    if refusals:
        raise ServingConfigError("eagle31-mla: " + " | ".join(r.message for r in refusals))
    if target.is_kimi_k3 and (problem := k3_stream_problem()):
        raise ServingConfigError(f"eagle31-mla: {problem}")

    wanted = list(ids.one_based)
    form = tokenspeed_flag_form(target, ids)
    stored = stored_layers(target_cls, form, target.num_layers)
    if stored != wanted:
        raise ServingConfigError(
            f"eagle31-mla: TokenSpeed's {name} given {form} captures one-based {stored}, not the drafter's "
            f"{ids.describe()}; this TokenSpeed reads ids unlike {facts.SUPPORTED_RELEASES}, the release(s) the "
            "plugin knows"
        )
    if flag:
        try:
            flagged = stored_layers(target_cls, [int(i) for i in flag], target.num_layers)
        except ValueError as err:
            flagged = f"an error ({err})"
        if flagged != wanted:
            raise ServingConfigError(
                f"eagle31-mla: {facts.LAYERS_FLAG} {','.join(map(str, flag))} makes TokenSpeed's {name} capture "
                f"{flagged if isinstance(flagged, str) else f'one-based {flagged}'}, but the drafter was trained on "
                f"{ids.describe()}; drop the flag (the plugin gives the target the right ids) or pass "
                f"{facts.LAYERS_FLAG} {','.join(map(str, form))}"
            )

    write_aux_layer_ids(hf_config, ids, ONE_BASED if form == wanted else ZERO_BASED)
    from tokenspeed.runtime.execution.factory import _eagle_aux_layer_ids

    read = _eagle_aux_layer_ids(hf_config)
    if read != form:
        raise PluginAPIError(
            f"eagle31-mla: TokenSpeed reads {read} from the draft config where the plugin wrote {form}; its "
            "`_eagle_aux_layer_ids` has changed, so the plugin cannot tell the target which layers to capture"
        )
    logger.info("eagle31-mla: TokenSpeed's %s captures %s (handed %s)", name, ids.describe(), form)
    return form


def stored_layers(target_cls: type, given: list[int], num_layers: int) -> list[int]:
    """What TokenSpeed's own ``target_cls.set_eagle3_layers_to_capture(given)`` stores (ValueError: it refuses)."""
    model = text = object.__new__(target_cls)  # without layers or weights: enough for the setter
    nn.Module.__init__(model)
    if inner := facts.LANGUAGE_MODELS.get(target_cls.__name__):
        text = object.__new__(pkgutil.resolve_name(inner))
        nn.Module.__init__(text)
        model.language_model = text
    text.config = SimpleNamespace(num_hidden_layers=num_layers)
    text.model = SimpleNamespace(layers=[None] * num_layers, **{slot: None for slot in facts.STORED_IDS.values()})
    model.set_eagle3_layers_to_capture(list(given))
    stored = (getattr(text.model, slot) for slot in facts.STORED_IDS.values())
    return sorted(next((value for value in stored if value is not None), []))  # [] never matches: refused


def k3_stream_problem() -> str | None:
    """Why Kimi-K3's forward is not known to capture the prefix-only stream for EAGLE-3 (None: it is)."""
    from tokenspeed.runtime.models.kimi_k3 import KimiLinearModel

    tree = ast.parse(textwrap.dedent(inspect.getsource(KimiLinearModel.forward)))
    captures = [
        ast.unparse(statement)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and "eagle3" in ast.unparse(node.test)
        for statement in node.body
        if "append" in ast.unparse(statement)
    ]
    assigned = (ast.unparse(node) for node in ast.walk(tree) if isinstance(node, ast.Assign))
    layer_returns_prefix = any(re.match(r"prefix_sum, [^=]+ = layer\(", statement) for statement in assigned)
    if captures == [facts.K3_EAGLE3_CAPTURE] and layer_returns_prefix:
        return None
    return (
        f"TokenSpeed's KimiLinearModel.forward captures {captures or 'nothing recognisable'} for EAGLE-3, not "
        f"`{facts.K3_EAGLE3_CAPTURE}` after each layer; the drafter was trained on Kimi-K3's prefix-only stream "
        "and the plugin cannot confirm this TokenSpeed captures it (the AttnRes mixture would drop acceptance silently)"
    )
