"""Load a user reward function given as ``module:function`` or ``path/to/file.py:function``."""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

CustomRewardFn = Callable[[str, str, str, dict], "float | dict[str, Any]"]

_KEY = "reward.custom_path"


def _import_file(path: Path) -> Any:
    name = f"titan_custom_reward_{abs(hash(str(path.resolve())))}"
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


def split_custom_path(spec: str) -> tuple[str, str]:
    """``spec`` as (module or file, function), importing nothing; ValueError naming the key
    when it has not that form."""
    module_name, sep, attr = spec.rpartition(":")
    if not sep or not module_name or not attr:
        raise ValueError(
            f"{_KEY} {spec!r} must be 'module:function' (e.g. my_pkg.rewards:score) "
            "or 'path/to/file.py:function'"
        )
    return module_name, attr


def load_custom_reward(spec: str) -> CustomRewardFn:
    """Import and return the function named by ``spec``; ValueError naming the key if not.
    A module is imported once per process (a second call finds it in ``sys.modules``)."""
    module_name, attr = split_custom_path(spec)
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
            f"{_KEY} {spec!r}: cannot import {module_name!r}: {type(e).__name__}: {e}"
        ) from None
    fn = getattr(module, attr, None)
    if fn is None:
        raise ValueError(f"{_KEY} {spec!r}: module {module_name!r} has no attribute {attr!r}")
    if not callable(fn):
        raise ValueError(f"{_KEY} {spec!r}: {attr!r} is not callable")
    try:
        inspect.signature(fn).bind("prompt", "response", "label", {})
    except TypeError:
        raise ValueError(
            f"{_KEY} {spec!r}: {attr} must accept (prompt, response, label, metadata)"
        ) from None
    except ValueError:  # builtins without a signature: trust the call
        pass
    return fn
