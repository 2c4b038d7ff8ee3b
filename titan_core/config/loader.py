"""Load a pydantic config from YAML and ``dotted.key=value`` overrides."""

from __future__ import annotations

from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ConfigDict, ValidationError

T = TypeVar("T", bound=BaseModel)


class ConfigError(ValueError):
    """A config the user wrote is wrong; the message says which key and what to do."""


class Section(BaseModel):
    """Base of every config section: unknown keys and wrong types are errors."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, protected_namespaces=())


def _parse_value(text: str) -> Any:
    """Parse an override value the way YAML would (``3`` -> int, ``true`` -> bool, ``[1,2]``)."""
    try:
        return yaml.safe_load(text) if text != "" else ""
    except yaml.YAMLError:
        return text


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply ``a.b.c=value`` overrides to a nested dict (in place) and return it."""
    for item in overrides:
        if "=" not in item:
            raise ConfigError(
                f"override {item!r} is not of the form key.sub=value (e.g. train.lr=1e-4)"
            )
        key, _, raw = item.partition("=")
        key = key.strip().lstrip("-")
        if not key:
            raise ConfigError(f"override {item!r} has an empty key")
        node = data
        parts = key.split(".")
        for i, part in enumerate(parts[:-1]):
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            elif not isinstance(child, dict):
                raise ConfigError(
                    f"override {item!r}: {'.'.join(parts[: i + 1])} is a value, not a section"
                )
            node = child
        node[parts[-1]] = _parse_value(raw)
    return data


def _format_validation_error(err: ValidationError, source: str) -> str:
    lines = []
    for e in err.errors():
        key = ".".join(str(p) for p in e["loc"]) or "<root>"
        if e["type"] == "extra_forbidden":
            lines.append(f"{key}: unknown key (check the spelling; see the config reference)")
        elif e["type"] == "value_error":  # a validator's own message names its keys
            msg = e["msg"].removeprefix("Value error, ")
            lines.append(msg if key == "<root>" else f"{key}: {msg}")
        else:
            got = e.get("input")
            shown = "" if isinstance(got, dict) else f" (got {got!r})"
            lines.append(f"{key}: {e['msg']}{shown}")
    return f"invalid config {source}:\n  " + "\n  ".join(lines)


def load_config(cls: type[T], path: str | Path | None = None, overrides: list[str] = ()) -> T:
    """Build ``cls`` from a YAML file (optional) and overrides; raise ConfigError on any error."""
    data: dict[str, Any] = {}
    source = "from overrides"
    if path is not None:
        p = Path(path)
        source = str(p)
        if not p.is_file():
            raise ConfigError(f"config file {p} does not exist")
        try:
            loaded = yaml.safe_load(p.read_text())
        except yaml.YAMLError as e:
            raise ConfigError(f"config file {p} is not valid YAML: {e}") from None
        if loaded is None:
            loaded = {}
        if not isinstance(loaded, dict):
            raise ConfigError(f"config file {p} must hold a mapping of sections at the top")
        data = loaded
    apply_overrides(data, list(overrides))
    try:
        return cls.model_validate(data)
    except ValidationError as e:
        raise ConfigError(_format_validation_error(e, source)) from None
    except ValueError as e:  # raised by model validators
        raise ConfigError(f"invalid config {source}: {e}") from None
