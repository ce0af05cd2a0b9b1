"""Every key a drafter config.json may give, read from the config's dataclasses (``dataclasses.fields``: the
name, the type, and the metadata ``setting`` gives a field -- its domain, rope type, whether it is derived).

The keys: the fields ``Eagle31MLAConfig`` declares (Transformers' common fields are not its settings), the extra
keys it reads and does not keep (``Eagle31MLAConfig.extra_keys``), and, for a field whose metadata names the
dataclass of its keys (``rope_parameters``, ``eagle_config``), those keys, named ``<field>.<key>``. The malformed
corpus and the config tests generate their cases from :data:`CONFIG_KEYS`, so a field added to any of these
dataclasses is covered by them automatically; one whose type they cannot give bad values for fails them.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any, get_args

import torch

from eagle31_mla import Eagle31MLAConfig
from eagle31_mla.model.configuration_eagle31_mla import check_settings, expected


@dataclasses.dataclass(frozen=True)
class ConfigKey:
    """One key of config.json and the dataclass field that says what it must be."""

    name: str  # "hidden_size"; "rope_parameters.factor" (``rope_scaling.factor`` in the legacy form)
    field: dataclasses.Field
    owner: type  # the dataclass the field belongs to

    @property
    def key(self) -> str:
        return self.name.rpartition(".")[2]

    @property
    def nested(self) -> bool:
        """A key of the rope dict."""
        return self.name.startswith("rope_parameters.")

    @property
    def in_eagle_config(self) -> bool:
        """A key of the nested ``eagle_config`` dict."""
        return self.name.startswith("eagle_config.")

    @property
    def domain(self) -> str:
        return self.field.metadata.get("domain", "")

    @property
    def rope_type(self) -> str:
        return self.field.metadata.get("rope_type", "")

    @property
    def derived(self) -> bool:
        return self.field.metadata.get("derived", False)

    @property
    def optional(self) -> bool:
        """Null is accepted (the default applies)."""
        return type(None) in get_args(self.field.type)

    @property
    def kind(self) -> str | None:
        """int, float (a number), bool, str, dtype, token_id (an int id), token_ids (an id or a list of ids), read
        from the field's type; None for a type the generated cases have no bad values for."""
        types = set(get_args(self.field.type)) or {self.field.type}
        if torch.dtype in types:
            return "dtype"
        if int in types and list[int] in types:
            return "token_ids"
        if float in types:
            return "float"
        if int in types:
            return "token_id" if self.domain == "token_id" else "int"
        return "bool" if bool in types else "str" if str in types else None

    def expected(self) -> str:
        """What a value must be, in the library's words (the clause of every refusal)."""
        return expected(self.field)

    def check(self, value: Any) -> None:
        """``value`` checked as this key by the library (a ConfigError if it does not fit)."""
        check_settings(self.owner, {self.key: value}, self.name.removesuffix(self.key))


def _keys(owner: type, names: list[str], prefix: str = "") -> list[ConfigKey]:
    out = []
    by_name = {field.name: field for field in dataclasses.fields(owner)}
    for field in (by_name[name] for name in names if name in by_name):
        keys = field.metadata.get("keys")
        if keys is not None:  # a dict of settings: its keys, not the dict
            out += _keys(keys, [f.name for f in dataclasses.fields(keys)], f"{prefix}{field.name}.")
        else:
            out.append(ConfigKey(f"{prefix}{field.name}", field, owner))
    return out


def config_keys() -> list[ConfigKey]:
    """Every key a config.json may give, in declaration order: see the module docstring."""
    own = list(inspect.get_annotations(Eagle31MLAConfig))  # the fields it declares (incl. redeclared `dtype`)
    extra = Eagle31MLAConfig.extra_keys
    return _keys(Eagle31MLAConfig, own) + _keys(extra, [f.name for f in dataclasses.fields(extra)])


CONFIG_KEYS = config_keys()
