"""Typed configs: YAML files plus ``key.sub=value`` overrides, validated by pydantic.

Every section is a :class:`Section` (unknown keys are errors), and every user error comes
out as a :class:`ConfigError` whose message names the key and, where known, the file.
"""

from titan_core.config.loader import ConfigError, Section, apply_overrides, load_config

__all__ = ["ConfigError", "Section", "apply_overrides", "load_config"]
