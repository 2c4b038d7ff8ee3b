"""The config surface of ``python -m titan_core.pretrain`` and ``python -m titan_rl.grpo``:
every dotted key with its type and default, pinned in tests/config_surface.txt (as torchtitan
freezes its CLI), so a key that appears, disappears or changes its default is a reviewed
change. Every key is documented: a ``#:`` comment above its field, or, in the sections named
after another framework's arguments (Megatron's, slime's), that framework's flag of the same
name. Keys the README, docs/ and bench/README.md name must exist.

After changing a config on purpose: ``.venv/bin/python -m tests.test_config_surface``
rewrites the file.
"""

from __future__ import annotations

import ast
import functools
import inspect
import re
import sys
import textwrap
import types
import typing
from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import BaseModel
from pydantic.fields import FieldInfo

from tests.test_docs import DOCS  # the README, docs/, bench/README.md, the packages' READMEs
from titan_core.config import load_config
from titan_core.config.pretrain import (
    ModelConfig,
    ParallelConfig,
    PretrainConfig,
    TrainConfig,
    TrainFields,
)
from titan_rl.algo.config import AlgoConfig
from titan_rl.config import GRPOConfig

REPO = Path(__file__).resolve().parents[1]
SURFACE = Path(__file__).with_name("config_surface.txt")
REGENERATE = ".venv/bin/python -m tests.test_config_surface"
ROOTS: dict[str, type[BaseModel]] = {"pretrain": PretrainConfig, "grpo": GRPOConfig}
#: sections whose keys are another framework's argument names, documented there
NAMED_AFTER: dict[type[BaseModel], str] = {
    ModelConfig: "Megatron",
    ParallelConfig: "Megatron",
    TrainFields: "Megatron",
    TrainConfig: "Megatron",
    AlgoConfig: "slime",
}
#: README words that look like keys but are files
_FILE_SUFFIXES = {"png", "py", "yaml", "jsonl", "json", "txt", "md"}


def _type_name(annotation: Any) -> str:
    """``annotation`` as one reads it: ``int [Gt(gt=0)] | None``, ``Literal['a', 'b']``."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if annotation is type(None):
        return "None"
    if origin is typing.Literal:
        return f"Literal[{', '.join(map(repr, args))}]"
    if origin is typing.Annotated:
        return _type_name(args[0]) + f" [{', '.join(map(repr, args[1:]))}]"
    if origin in (typing.Union, types.UnionType):
        return " | ".join(_type_name(a) for a in args)
    if origin is not None:
        return f"{origin.__name__}[{', '.join(_type_name(a) for a in args)}]"
    return getattr(annotation, "__name__", repr(annotation))


def _constraints(field: FieldInfo) -> str:
    parts = [repr(m) for m in field.metadata]
    return f" [{', '.join(parts)}]" if parts else ""


def _leaves(model: BaseModel, prefix: str = "") -> list[tuple[str, type[BaseModel], str, str]]:
    """(dotted key, its class, type, default) of every key under ``model``'s default values."""
    out = []
    for name, field in type(model).model_fields.items():
        key = prefix + (field.alias or name)
        value = getattr(model, name)
        if isinstance(value, BaseModel):
            out += _leaves(value, key + ".")
            continue
        kind = _type_name(field.annotation) + _constraints(field)
        out.append((key, _owner(type(model), name), kind, repr(value)))
    return out


def _owner(cls: type[BaseModel], name: str) -> type[BaseModel]:
    """The class in ``cls``'s MRO that declares field ``name``."""
    for klass in cls.__mro__:
        if name in getattr(klass, "__annotations__", {}):
            return klass
    return cls


@functools.cache
def _commented_fields(cls: type) -> frozenset[str]:
    """Fields of ``cls`` with a ``#:`` comment right above them (Sphinx's attribute docs)."""
    src = textwrap.dedent(inspect.getsource(cls))
    lines = src.splitlines()
    body = ast.parse(src).body[0]
    assert isinstance(body, ast.ClassDef)
    return frozenset(
        node.target.id
        for node in body.body
        if isinstance(node, ast.AnnAssign)
        and isinstance(node.target, ast.Name)
        and node.lineno >= 2
        and lines[node.lineno - 2].strip().startswith("#:")
    )


def surface() -> list[str]:
    """One line per key of each command's config: ``<command> <key>: <type> = <default>``."""
    lines = [
        f"{command} {key}: {kind} = {default}"
        for command, root in ROOTS.items()
        for key, _, kind, default in _leaves(root())
    ]
    return sorted(lines)


def undocumented() -> list[str]:
    out = []
    for root in ROOTS.values():
        for key, owner, _, _ in _leaves(root()):
            name = key.rsplit(".", 1)[-1]
            field = next(n for n, f in owner.model_fields.items() if (f.alias or n) == name)
            if owner not in NAMED_AFTER and field not in _commented_fields(owner):
                out.append(f"{key} ({owner.__module__}.{owner.__qualname__}.{field})")
    return sorted(set(out))


def test_config_surface_is_pinned():
    want = SURFACE.read_text().splitlines() if SURFACE.is_file() else []
    have = surface()
    added = sorted(set(have) - set(want))
    removed = sorted(set(want) - set(have))
    assert not added and not removed, (
        "the config surface changed (a key added, removed, retyped or given a new default):\n"
        + "".join(f"  + {line}\n" for line in added)
        + "".join(f"  - {line}\n" for line in removed)
        + "If that is intended, document each new key (a `#:` comment above its field saying "
        "what it does; README or docs/ where it changes user-facing behaviour), remove the docs' "
        f"mentions of a removed one, then run `{REGENERATE}` and commit {SURFACE.name}."
    )


def test_every_key_is_documented():
    missing = undocumented()
    assert not missing, (
        "config keys without docs: write a `#:` comment above each field saying what it "
        "does and what its values mean:\n  " + "\n  ".join(missing)
    )


def _readme_keys() -> dict[str, str]:
    """Backticked words of the docs that look like config keys, each with the first doc naming it."""
    sections = {k.split(".")[0] for line in surface() for k in [line.split()[1]]}
    found: dict[str, str] = {}
    for doc in DOCS:
        for key in re.findall(r"`([a-z_]+(?:\.[a-z_][a-z0-9_]*)+)(?![\w(])", doc.read_text()):
            if key.split(".")[0] in sections and key.rsplit(".", 1)[-1] not in _FILE_SUFFIXES:
                found.setdefault(key, str(doc.relative_to(REPO)))
    return found


def test_keys_the_readme_names_exist():
    known = {line.split()[1].rstrip(":") for line in surface()}
    prefixes = {k.rsplit(".", i)[0] for k in known for i in range(1, k.count(".") + 1)}
    named = _readme_keys()
    stale = sorted(f"{k} ({doc})" for k, doc in named.items() if k not in known | prefixes)
    assert not stale, f"the README or docs name config keys that do not exist: {stale}"


@pytest.mark.parametrize("path", sorted((REPO / "examples").glob("*.yaml")), ids=lambda p: p.name)
def test_examples_load(path: Path):
    root = GRPOConfig if "policy" in (yaml.safe_load(path.read_text()) or {}) else PretrainConfig
    assert isinstance(load_config(root, path), root)


if __name__ == "__main__":
    SURFACE.write_text("\n".join(surface()) + "\n")
    print(f"wrote {SURFACE} ({len(surface())} keys)", file=sys.stderr)
