"""User functions named in a config as ``module:function`` or ``path/to/file.py:function``
(``reward.custom_path``, ``rollout.generate_fn``): the form check and the import, with
errors naming the config key."""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path
from typing import Any


def split_spec(spec: str, key: str, example: str) -> tuple[str, str]:
    """``spec`` as (module or file, function), importing nothing; ValueError naming ``key``
    (``example``: a spec of the right form for the message)."""
    module_name, sep, attr = spec.rpartition(":")
    if not sep or not module_name or not attr:
        raise ValueError(
            f"{key} {spec!r} must be 'module:function' (e.g. {example}) or "
            "'path/to/file.py:function'"
        )
    return module_name, attr


def _import_file(path: Path) -> Any:
    name = f"titan_user_code_{abs(hash(str(path.resolve())))}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


def load_attr(spec: str, key: str, example: str) -> tuple[str, Any]:
    """The function's name and the object ``spec`` names, its module imported once per
    process; ValueError naming ``key`` when it cannot be imported or is missing."""
    module_name, attr = split_spec(spec, key, example)
    try:
        if module_name.endswith(".py"):
            path = Path(module_name)
            if not path.is_file():
                raise ImportError(f"file {path} does not exist")
            module = _import_file(path)
        else:
            module = importlib.import_module(module_name)
    except Exception as e:  # ImportError, or whatever the module raised on import
        raise ValueError(
            f"{key} {spec!r}: cannot import {module_name!r}: {type(e).__name__}: {e}"
        ) from None
    fn = getattr(module, attr, None)
    if fn is None:
        raise ValueError(f"{key} {spec!r}: module {module_name!r} has no attribute {attr!r}")
    return attr, fn
