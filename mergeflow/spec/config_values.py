"""A model config's values as plain data, stored with the model spec, so that what reads them later (the Megatron
backend's geometry) needs neither config.json nor transformers (imports neither)."""

import json
from typing import Any


def config_values(config: Any) -> dict[str, Any]:
    """Every value of a transformers config (`to_dict()`), with its aliases (`attribute_map`: DeepSeek-V3's
    `num_local_experts` is `n_routed_experts`) resolved, and sub-configs (`text_config`, `vision_config`) likewise;
    as JSON gives them back (the spec cache stores JSON)."""
    return json.loads(json.dumps(_values(config), default=str))


def _values(config: Any) -> dict[str, Any]:
    values = dict(config.to_dict())
    for alias in getattr(config, "attribute_map", {}):
        values[alias] = getattr(config, alias, None)
    for name in list(values):
        value = getattr(config, name, None)
        if hasattr(value, "to_dict") and hasattr(value, "attribute_map"):
            values[name] = _values(value)
    return values


class ConfigValues:
    """Attribute access to `config_values`' data, as to the config it came from (a missing value is an
    AttributeError, so `getattr(config, name, default)` works as on the config)."""

    def __init__(self, values: dict[str, Any]):
        self._values = values

    def __getattr__(self, name: str) -> Any:
        try:
            value = self._values[name]
        except KeyError:
            raise AttributeError(name) from None
        return ConfigValues(value) if isinstance(value, dict) else value

    def get_text_config(self) -> "ConfigValues":
        """The language model's values: `text_config` for a vision-language model, else these."""
        text = self._values.get("text_config")
        return ConfigValues(text) if isinstance(text, dict) else self
