"""A corpus of malformed drafts, each built from one good tiny draft: every one is refused with a
clear error that names the field or tensor and what was expected. None loads silently; none escapes
as a bare error from inside torch, safetensors or Transformers.

"Clear" is checked the same way for every case: the exception is the library's own type
(``CheckpointError`` / ``ConfigError``, or the vLLM plugin's ``ServingConfigError`` for serving-time
cases), it is raised from this project's code (the innermost traceback frame), it carries no chained
low-level exception, and its message holds the listed substrings (the name, then the expectation).
"""

from __future__ import annotations

import copy
import json
import struct
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Callable

import pytest
import torch

import eagle31_mla
import eagle31_mla_sglang
import eagle31_mla_vllm
from eagle31_mla import CheckpointError, Eagle31MLAForCausalLM
from tiny import published_style_config, tiny_drafter, write_checkpoint

#: Where this project's code lives, installed editable or not: an error must be raised there.
OWN_CODE = tuple(str(Path(package.__file__).parent) for package in (eagle31_mla, eagle31_mla_vllm, eagle31_mla_sglang))
#: Fragments of low-level messages that must never be what a user sees.
RAW_MESSAGES = ("size mismatch for", "Error(s) in loading state_dict", "mat1 and mat2", "index out of range in self",
                "Expected all tensors", "invalid for input of size", "Traceback (most recent call last)",
                "object is not subscriptable", "unsupported operand", "not supported between instances")  # fmt: skip


@dataclass
class Draft:
    """What a case edits: the config.json dict, the tensors, and the files once written."""

    config: dict
    tensors: dict
    after_write: list[Callable[[Path], None]] = field(default_factory=list)


@dataclass(frozen=True)
class Case:
    name: str
    change: Callable[[Draft], object]
    expect: tuple[str, ...]  # substrings of the message: the field or tensor, then what was expected
    error: str = "CheckpointError"  # or ConfigError / ServingConfigError
    base: str = "full"  # "full" vocabulary, or "pruned" (draft_vocab_size 100 with d2t/t2d)
    check: str = "load"  # "load": from_pretrained; "serving": the vLLM plugin's check_serving against a target
    serving: tuple = ()  # serving cases: (key, value) pairs changing the target, the vLLM version, the environment


# -- edits ------------------------------------------------------------------------------------------


def drop(*names):
    return lambda d: [d.tensors.pop(n) for n in names]


def put(name, make):
    return lambda d: d.tensors.__setitem__(name, make(d.tensors))


def cfg(**changes):
    return lambda d: d.config.update(changes)


def cfg_drop(*keys):
    return lambda d: [d.config.pop(k) for k in keys]


def ids(value, where="nested"):
    def change(d):
        if where == "nested":
            d.config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = value
        else:
            d.config.pop("eagle_config")
            d.config["eagle_aux_hidden_state_layer_ids"] = value

    return change


def rope(**changes):
    return lambda d: d.config["rope_scaling"].update(changes)


def both(*changes):
    return lambda d: [c(d) for c in changes]


def on_files(edit):
    return lambda d: d.after_write.append(edit)


def rewrite_header(edit):
    """Rewrite the safetensors JSON header of model.safetensors (the data stays as it is)."""

    def change(folder):
        data = (folder / "model.safetensors").read_bytes()
        n = struct.unpack("<Q", data[:8])[0]
        header = json.loads(data[8 : 8 + n])
        edit(header)
        raw = json.dumps(header).encode()
        raw += b" " * (-len(raw) % 8)
        (folder / "model.safetensors").write_bytes(struct.pack("<Q", len(raw)) + raw + data[8 + n :])

    return on_files(change)


def bytes_edit(edit):
    return on_files(lambda f: (f / "model.safetensors").write_bytes(edit((f / "model.safetensors").read_bytes())))


def set_bytes(data, at, new):
    return data[:at] + new + data[at + len(new) :]


def pickle_only(filename):
    def change(folder):
        from safetensors.torch import load_file

        tensors = load_file(folder / "model.safetensors")
        (folder / "model.safetensors").unlink()
        torch.save(tensors, folder / filename)

    return on_files(change)


def shard_index(index):
    def change(folder):
        (folder / "model.safetensors").rename(folder / "model-00001-of-00002.safetensors")
        (folder / "model.safetensors.index.json").write_text(index if isinstance(index, str) else json.dumps(index))

    return on_files(change)


def write_config(text):
    return on_files(lambda f: (f / "config.json").write_text(text) if text is not None else (f / "config.json").unlink())


def d2t_edit(edit):
    def change(d):
        d2t = d.tensors["d2t"].clone()
        edit(d2t)
        d.tensors["d2t"] = d2t

    return change


def t2d_flip(d):
    t2d = d.tensors["t2d"].clone()
    first_unmapped = int((~t2d).nonzero()[0])
    t2d[first_unmapped] = True
    d.tensors["t2d"] = t2d


SPLIT = {"weight_map": {"fc.weight": "model-00001-of-00002.safetensors", "norm.weight": "model-00002-of-00002.safetensors"}}

# fmt: off
CASES = [
    # ---- tensors: missing, extra, misshaped, mistyped ----
    Case("missing tensor", drop("layers.0.self_attn.kv_a_layernorm.weight"),
         ("missing tensor 'layers.0.self_attn.kv_a_layernorm.weight'", "expected shape [32]")),
    Case("missing lm_head", drop("lm_head.weight"), ("missing tensor 'lm_head.weight'", "expected shape [300, 64]")),
    Case("extra tensor (K3 gate of another architecture)", put("layers.0.self_attn.g_proj.weight", lambda t: torch.zeros(80, 128)),
         ("unexpected tensor 'layers.0.self_attn.g_proj.weight'",)),
    Case("extra second decoder layer", put("layers.1.mlp.down_proj.weight", lambda t: torch.zeros(64, 96)),
         ("unexpected tensor 'layers.1.mlp.down_proj.weight'",)),
    Case("misshaped kv_b_proj", put("layers.0.self_attn.kv_b_proj.weight", lambda t: torch.zeros(144, 16)),
         ("'layers.0.self_attn.kv_b_proj.weight' has shape [144, 16]", "expected [144, 32]")),
    Case("embedding rows differ from vocab_size", put("embed_tokens.weight", lambda t: t["embed_tokens.weight"][:299]),
         ("'embed_tokens.weight' has shape [299, 64]", "expected [300, 64]")),
    Case("fc stored transposed", put("fc.weight", lambda t: t["fc.weight"].T),
         ("'fc.weight' has shape [144, 64]", "expected [64, 144]")),
    Case("norm weight is a scalar", put("norm.weight", lambda t: torch.tensor(1.0)),
         ("'norm.weight' has shape []", "expected [64]")),
    Case("integer norm weight", put("norm.weight", lambda t: torch.ones(64, dtype=torch.int32)),
         ("'norm.weight' has dtype I32", "expected a floating-point dtype")),
    Case("bool projection", put("layers.0.self_attn.o_proj.weight", lambda t: torch.ones(64, 80, dtype=torch.bool)),
         ("'layers.0.self_attn.o_proj.weight' has dtype BOOL", "expected a floating-point dtype")),
    Case("several problems at once", both(drop("fc.weight"), put("extra.weight", lambda t: torch.zeros(1))),
         ("2 problem(s)", "missing tensor 'fc.weight'", "unexpected tensor 'extra.weight'")),
    Case("published and training names for one tensor", put("midlayer.mlp.up_proj.weight", lambda t: t["layers.0.mlp.up_proj.weight"].clone()),
         ("'layers.0.mlp.up_proj.weight' and 'midlayer.mlp.up_proj.weight' both map to 'layers.0.mlp.up_proj.weight'",)),
    Case("NeMo prefix and plain name for one tensor", put("model.norm.weight", lambda t: t["norm.weight"].clone()),
         ("both map to 'norm.weight'",)),
    # ---- EAGLE-3.1 vs EAGLE-3, fc width ----
    Case("EAGLE-3.1 config without fc_norm weights", drop("fc_norm.0.weight", "fc_norm.1.weight", "fc_norm.2.weight"),
         ("missing tensor 'fc_norm.0.weight'", "expected shape [48]", "fc_norm: true")),
    Case("EAGLE-3 config with fc_norm weights", cfg_drop("fc_norm"),
         ("unexpected tensor 'fc_norm.0.weight'", "set fc_norm: true")),
    Case("one fc_norm weight missing", drop("fc_norm.2.weight"), ("missing tensor 'fc_norm.2.weight'", "expected shape [48]")),
    Case("fc_norm weight of the drafter's width", put("fc_norm.1.weight", lambda t: torch.ones(64)),
         ("'fc_norm.1.weight' has shape [64]", "expected [48]")),
    Case("fc width vs target_hidden_size", cfg(target_hidden_size=64), ("'fc.weight' has shape [64, 144]", "expected [64, 192]")),
    Case("fc width vs four aux ids", ids([2, 5, 9, 12]), ("'fc.weight' has shape [64, 144]", "expected [64, 192]")),
    Case("fc width vs two aux ids", ids([2, 5]), ("'fc.weight' has shape [64, 144]", "expected [64, 96]")),
    # ---- pruned vocabulary: d2t / t2d ----
    Case("d2t maps beyond the vocabulary", d2t_edit(lambda d: d.__setitem__(-1, 10_000)),
         ("'d2t' maps draft ids to target ids in", "outside [0, 300)"), base="pruned"),
    Case("d2t maps below 0", d2t_edit(lambda d: d.__setitem__(0, -5)), ("'d2t' maps draft ids to target ids in [-5,", "[0, 300)"), base="pruned"),
    Case("d2t of the wrong length", put("d2t", lambda t: t["d2t"][:99]), ("'d2t' has shape [99]", "expected [100]"), base="pruned"),
    Case("float d2t", put("d2t", lambda t: t["d2t"].float()), ("'d2t' has dtype F32", "expected an integer dtype"), base="pruned"),
    Case("d2t maps two draft ids to one target id", d2t_edit(lambda d: d.__setitem__(1, d[0] - 1)),
         ("'d2t' maps two draft ids to the same target id",), base="pruned"),
    Case("t2d disagrees with d2t", t2d_flip, ("'t2d' disagrees with 'd2t'", "true exactly for mapped ids"), base="pruned"),
    Case("t2d of the wrong length", put("t2d", lambda t: t["t2d"][:299]), ("'t2d' has shape [299]", "expected [300]"), base="pruned"),
    Case("float t2d", put("t2d", lambda t: t["t2d"].float()), ("'t2d' has dtype F32", "expected bool"), base="pruned"),
    Case("pruned config without d2t", drop("d2t", "t2d"),
         ("missing tensor 'd2t'", "expected shape [100]", "needs the vocab map"), base="pruned"),
    Case("full-vocabulary config with d2t", put("d2t", lambda t: torch.zeros(300, dtype=torch.long)),
         ("unexpected tensor 'd2t'", "draft_vocab_size equals vocab_size")),
    Case("lm_head over the full vocabulary in a pruned config", put("lm_head.weight", lambda t: torch.zeros(300, 64)),
         ("'lm_head.weight' has shape [300, 64]", "expected [100, 64]"), base="pruned"),
    # ---- files ----
    Case("truncated safetensors", bytes_edit(lambda b: b[: len(b) // 2]), ("model.safetensors is not a readable safetensors file",)),
    Case("corrupt safetensors header", bytes_edit(lambda b: set_bytes(b, 8, b"not json")),
         ("model.safetensors is not a readable safetensors file",)),
    Case("header length beyond the file", bytes_edit(lambda b: set_bytes(b, 0, struct.pack("<Q", 10**12))),
         ("model.safetensors is not a readable safetensors file",)),
    Case("empty safetensors file", bytes_edit(lambda b: b""), ("model.safetensors is not a readable safetensors file",)),
    Case("tensor offsets beyond the data", rewrite_header(lambda h: h["norm.weight"].update(data_offsets=[0, 10**9])),
         ("model.safetensors is not a readable safetensors file",)),
    Case("unknown dtype in the header", rewrite_header(lambda h: h["norm.weight"].update(dtype="Q7")),
         ("model.safetensors is not a readable safetensors file",)),
    Case("pickle .bin instead of safetensors", pickle_only("pytorch_model.bin"),
         ("pytorch_model.bin", "safetensors only", "safetensors.torch.save_file", "allow_pickle=True")),
    Case("pickle .pt instead of safetensors", pickle_only("weights.pt"), ("weights.pt", "safetensors.torch.save_file")),
    Case("no weights at all", on_files(lambda f: (f / "model.safetensors").unlink()),
         ("neither model.safetensors nor model.safetensors.index.json",)),
    Case("index that is not JSON", shard_index("{oops"), ("model.safetensors.index.json is not a valid index", "`weight_map`")),
    Case("index without weight_map", shard_index({"metadata": {}}), ("model.safetensors.index.json is not a valid index", "`weight_map`")),
    Case("index with an empty weight_map", shard_index({"weight_map": {}}), ("has an empty `weight_map`", "tensor name -> file")),
    Case("index naming an absent shard", shard_index(SPLIT),
         ("model.safetensors.index.json names shard(s) ['model-00002-of-00002.safetensors']", "not in")),
    Case("no config.json", write_config(None), ("has no config.json",), error="ConfigError"),
    Case("config.json that is not JSON", write_config("{'hidden_size': 64"), ("config.json is not valid JSON",), error="ConfigError"),
    Case("config.json that is a list", write_config("[1, 2]"), ("config.json must hold a JSON object", "got list"), error="ConfigError"),
    # ---- aux-layer ids ----
    Case("aux id 0", ids([0, 2, 5], where="top"), ("[0, 2, 5]", "must be >= 1"), error="ConfigError"),
    Case("aux ids duplicated", ids([2, 5, 5]), ("[2, 5, 5] has duplicates",), error="ConfigError"),
    Case("aux ids unsorted", ids([9, 2, 5]), ("[9, 2, 5] is not ascending", "trained on [2, 5, 9]"), error="ConfigError"),
    Case("aux ids beyond the target depth", cfg(target_num_hidden_layers=8), ("beyond the target's depth of 8", "<= 8"), error="ConfigError"),
    Case("eagle_config that is a list", cfg(eagle_config=[2, 5, 9]), ("`eagle_config` must be a dict",), error="ConfigError"),
    Case("aux ids as a string", ids("2,5,9"), ("eagle_config.eagle_aux_hidden_state_layer_ids", "expected a non-empty list of ints"), error="ConfigError"),
    Case("aux ids only under target_layer_ids", both(cfg_drop("eagle_config"), cfg(target_layer_ids=[2, 5, 9])),
         ("`target_layer_ids`", "write `eagle_aux_hidden_state_layer_ids`"), error="ConfigError"),
    Case("aux ids contradictory (top level vs nested)", cfg(eagle_aux_hidden_state_layer_ids=[2, 5, 8]),
         ("contradictory about aux layers", "[2, 5, 8]", "[2, 5, 9]"), error="ConfigError"),
    Case("no aux ids", cfg_drop("eagle_config"), ("names no aux layers", "`eagle_aux_hidden_state_layer_ids`"), error="ConfigError"),
    Case("non-integer aux id", ids([2, 5.0, 9]), ("every id must be an int", "5.0"), error="ConfigError"),
    Case("unknown aux id convention", cfg(aux_layer_ids_convention="two_based"),
         ("aux_layer_ids_convention", "'one_based', 'zero_based'"), error="ConfigError"),
    Case("use_aux_hidden_state false", lambda d: d.config["eagle_config"].update(use_aux_hidden_state=False),
         ("`eagle_config.use_aux_hidden_state` is false",), error="ConfigError"),
    Case("num_aux_hidden_states disagrees with the ids", cfg(num_aux_hidden_states=4),
         ("`num_aux_hidden_states` is 4", "names 3 aux layers"), error="ConfigError"),
    # ---- rope ----
    Case("unknown rope type", cfg(rope_scaling={"type": "dynamic", "factor": 2.0}), ("'dynamic'", "('default', 'yarn')"), error="ConfigError"),
    Case("longrope", cfg(rope_scaling={"type": "longrope", "factor": 4.0}), ("'longrope'", "('default', 'yarn')"), error="ConfigError"),
    Case("yarn without factor", lambda d: d.config["rope_scaling"].pop("factor"), ("yarn rope needs a positive `factor`",), error="ConfigError"),
    Case("yarn factor below 1", rope(factor=0.5), ("yarn rope `factor` must be >= 1", "0.5"), error="ConfigError"),
    Case("both rope_parameters and rope_scaling", cfg(rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
         ("both `rope_parameters` and `rope_scaling`",), error="ConfigError"),
    Case("rope_scaling that is not a dict", cfg(rope_scaling="yarn"), ("`rope_scaling`/`rope_parameters`: expected a dict",), error="ConfigError"),
    Case("rope type named twice, differently", rope(rope_type="default"), ("`rope_type` 'default' and `type` 'yarn'",), error="ConfigError"),
    Case("rope_theta given twice, differently", rope(rope_theta=10000.0), ("`rope_theta` 50000", "must agree"), error="ConfigError"),
    Case("negative rope_theta", cfg(rope_theta=-5.0), ("`rope_theta` must be a positive number", "-5.0"), error="ConfigError"),
    Case("yarn window beyond max_position_embeddings", rope(original_max_position_embeddings=100000),
         ("`original_max_position_embeddings` (100000) exceeds `max_position_embeddings` (4096)",), error="ConfigError"),
    # ---- other config fields ----
    Case("unrelated model_type", cfg(model_type="llama"), ("`model_type` is 'llama'", "kimi_k2"), error="ConfigError"),
    Case("two decoder layers", cfg(num_hidden_layers=2), ("`num_hidden_layers` is 2", "exactly 1 layer"), error="ConfigError"),
    Case("fewer kv heads than heads", cfg(num_key_value_heads=2), ("`num_key_value_heads` (2) must equal `num_attention_heads` (4)",), error="ConfigError"),
    Case("no q_lora_rank", cfg(q_lora_rank=None), ("`q_lora_rank` is None", "expected a positive int"), error="ConfigError"),
    Case("draft vocabulary larger than the vocabulary", cfg(draft_vocab_size=400), ("`draft_vocab_size` (400) exceeds `vocab_size` (300)",), error="ConfigError"),
    Case("hidden_size as a string", cfg(hidden_size="64"), ("`hidden_size` must be a positive int", "'64'"), error="ConfigError"),
    Case("rms_norm_eps as a string", cfg(rms_norm_eps="1e-5"), ("`rms_norm_eps` must be a positive number", "'1e-5'"), error="ConfigError"),
    Case("fc_norm as a string", cfg(fc_norm="yes"), ("`fc_norm` must be true or false", "'yes'"), error="ConfigError"),
    Case("tied embeddings", cfg(tie_word_embeddings=True), ("`tie_word_embeddings: true` is not supported",), error="ConfigError"),
    Case("unknown activation", cfg(hidden_act="wiggle"), ("`hidden_act` 'wiggle'",), error="ConfigError"),
    Case("odd rope width", cfg(qk_rope_head_dim=15), ("`qk_rope_head_dim` must be even", "15"), error="ConfigError"),
    # ---- at serving time: the vLLM plugin's check against the target vLLM loaded ----
    Case("serving: hidden sizes disagree", cfg(target_hidden_size=64),
         ("`target_hidden_size` is 64", "expected target_hidden_size = 48"), error="ServingConfigError", check="serving"),
    Case("serving: aux ids beyond the target depth", ids([2, 46, 90]),
         ("do not fit this target", "[2, 46, 90] goes beyond the target's depth of 12"), error="ServingConfigError", check="serving"),
    Case("serving: vocabulary disagrees", cfg(vocab_size=400), ("`vocab_size` is 400", "expected vocab_size = 300"),
         error="ServingConfigError", check="serving"),
    Case("serving: hidden sizes disagree with a multimodal target's text_config", cfg(target_hidden_size=64),
         ("`target_hidden_size` is 64", "`hidden_size` is 48"), error="ServingConfigError", check="serving",
         serving=(("text_config", True),)),
    Case("serving: Kimi-K3 target on the AttnRes mixture stream", lambda d: None,
         ("VLLM_KIMI_K3_AUX_ATTN_RES_STREAM=1", "prefix-only"), error="ServingConfigError", check="serving",
         serving=(("kimi_k3", True), ("environ", {"VLLM_KIMI_K3_AUX_ATTN_RES_STREAM": "1"}))),
    Case("serving: four aux states on a vLLM that sizes fc for three", ids([2, 5, 9, 11]),
         ("sizes `fc` for exactly 3 aux states", "names 4"), error="ServingConfigError", check="serving",
         serving=(("vllm", (0, 21, 0)),)),
]
# fmt: on

TARGET = dict(hidden_size=48, vocab_size=300, num_hidden_layers=12)  # the serving cases' target: the good drafts fit it


@pytest.fixture(scope="module")
def good_drafts():
    """The one good draft each case starts from: full vocabulary, and pruned with d2t/t2d."""
    full = tiny_drafter(seed=8)
    pruned = tiny_drafter(seed=3, draft_vocab_size=100)
    return {"full": full, "pruned": pruned}


def build(case: Case, good, folder: Path) -> Path:
    model = good[case.base]
    draft = Draft(copy.deepcopy(published_style_config(model)), dict(model.state_dict()))
    case.change(draft)
    write_checkpoint(folder, draft.config, draft.tensors)
    for edit in draft.after_write:
        edit(folder)
    return folder


def attempt(case: Case, folder: Path) -> None:
    """Load the malformed draft the way its layer would: returns only if it was accepted."""
    if case.check == "load":
        Eagle31MLAForCausalLM.from_pretrained(folder)
    else:
        check_serving(folder, **dict(case.serving))


def check_serving(folder: Path, *, text_config=False, kimi_k3=False, vllm=(0, 32, 0), environ=None) -> None:
    """The plugin's serving-time check (pure Python) with a fake target: what vLLM hands it."""
    from eagle31_mla_vllm.model import check_serving
    from eagle31_mla_vllm.versions import features

    draft_hf_config = SimpleNamespace(**json.loads((folder / "config.json").read_text()))
    arch = ["KimiK3ForConditionalGeneration"] if kimi_k3 else ["DeepseekV3ForCausalLM"]
    if text_config:  # a multimodal wrapper: the language model's sizes live in its text config
        target = SimpleNamespace(hf_config=SimpleNamespace(architectures=arch, model_type="wrapper"), hf_text_config=SimpleNamespace(**TARGET))
    else:
        target = SimpleNamespace(hf_config=SimpleNamespace(architectures=arch, model_type="deepseek_v3", **TARGET))
    target.get_total_num_hidden_layers = lambda: TARGET["num_hidden_layers"]
    check_serving(draft_hf_config, target, features(vllm), environ=environ or {})


def refusal_problems(case: Case, err: BaseException) -> list[str]:
    """Why ``err`` is not a clear refusal of ``case`` (empty when it is)."""
    problems = []
    if type(err).__name__ != case.error:
        problems.append(f"raised {type(err).__module__}.{type(err).__name__}, expected {case.error}")
    message = str(err)
    problems += [f"message lacks {s!r}" for s in case.expect if s not in message]
    problems += [f"message is a raw low-level one ({s!r})" for s in RAW_MESSAGES if s in message]
    if err.__cause__ is not None or (err.__context__ is not None and not err.__suppress_context__):
        problems.append(f"chained to {type(err.__cause__ or err.__context__).__name__}: the user sees two tracebacks")
    innermost = traceback.extract_tb(err.__traceback__)[-1].filename
    if not innermost.startswith(OWN_CODE):
        problems.append(f"raised from {innermost}, not from this project's code")
    return problems


RESULTS: dict[str, str] = {}  # case name -> "refused" | "skipped" | what went wrong


def run_case(case: Case, good, folder: Path) -> str:
    if case.name not in RESULTS:
        if case.check == "serving":
            try:
                import vllm  # noqa: F401
            except ImportError:
                RESULTS[case.name] = "skipped"
                return RESULTS[case.name]
        folder = build(case, good, folder)  # outside the try: a broken case must fail, not count as refused
        try:
            attempt(case, folder)
        except Exception as err:  # noqa: BLE001 - judging exactly which exception escaped is the point
            problems = refusal_problems(case, err)
            RESULTS[case.name] = "refused" if not problems else f"{'; '.join(problems)}\n    message: {err}"
        else:
            RESULTS[case.name] = "LOADED SILENTLY"
    return RESULTS[case.name]


def test_the_good_drafts_load(good_drafts, tmp_path):
    for base, model in good_drafts.items():
        folder = write_checkpoint(tmp_path / base, published_style_config(model), model.state_dict())
        Eagle31MLAForCausalLM.from_pretrained(folder)
        if base == "full":
            try:
                import vllm  # noqa: F401
            except ImportError:
                continue
            check_serving(folder)  # the serving cases' target is a fit


def test_the_judge_rejects_unclear_errors():
    """Control: what the corpus would count as a bare, chained, misplaced or vague error."""
    case = Case("control", lambda d: None, ("missing tensor 'norm.weight'",))
    try:
        torch.zeros(2, 3) @ torch.zeros(2, 3)
    except RuntimeError as err:
        problems = refusal_problems(case, err)
    assert any("raised builtins.RuntimeError" in p for p in problems) and any("mat1 and mat2" in p for p in problems)
    assert any("not from this project's code" in p for p in problems)
    try:
        try:
            {}["norm.weight"]
        except KeyError as inner:
            raise CheckpointError("missing tensor 'norm.weight'") from inner
    except CheckpointError as err:
        problems = refusal_problems(case, err)
    assert any("chained to KeyError" in p for p in problems) and any("not from this project's code" in p for p in problems)
    try:
        Eagle31MLAForCausalLM.from_pretrained(Path("/nonexistent-eagle31-folder"))
    except Exception as err:  # noqa: BLE001
        problems = refusal_problems(case, err)
    assert any("message lacks" in p for p in problems)


def test_the_corpus_is_large_and_distinct():
    assert len(CASES) >= 40
    assert len({c.name for c in CASES}) == len(CASES)


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_malformed_draft_is_refused_clearly(case, good_drafts, tmp_path):
    outcome = run_case(case, good_drafts, tmp_path)
    if outcome == "skipped":
        pytest.skip("serving-time check: needs the vLLM plugin's dependencies (vllm)")
    assert outcome == "refused", outcome


def test_tally(good_drafts, tmp_path_factory, capsys):
    """Runs any case not yet run (so the tally is complete under -k too) and prints the tally."""
    for case in CASES:
        if case.name not in RESULTS:
            run_case(case, good_drafts, tmp_path_factory.mktemp("case"))
    outcomes = [RESULTS[c.name] for c in CASES]
    skipped = outcomes.count("skipped")
    refused = outcomes.count("refused")
    by_kind = {}
    for case, outcome in zip(CASES, outcomes):
        if outcome == "refused":
            by_kind[case.error] = by_kind.get(case.error, 0) + 1
    kinds = ", ".join(f"{n} {kind}" for kind, n in sorted(by_kind.items()))
    with capsys.disabled():
        print(f"\n  malformed-draft corpus: {len(CASES) - skipped} malformed drafts (configs, checkpoints, serving setups), {refused} refused with a clear error "
              f"({kinds})" + (f"; {skipped} serving-time cases skipped (no vLLM)" if skipped else ""))  # fmt: skip
    failed = {c.name: o for c, o in zip(CASES, outcomes) if o not in ("refused", "skipped")}
    assert not failed, failed
