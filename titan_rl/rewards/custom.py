"""Load a user reward function given as ``module:function`` or ``path/to/file.py:function``."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from titan_rl.user_code import load_attr, split_spec

CustomRewardFn = Callable[[str, str, str, dict], "float | dict[str, Any]"]

_KEY = "reward.custom_path"
_EXAMPLE = "my_pkg.rewards:score"


def split_custom_path(spec: str) -> tuple[str, str]:
    """``spec`` as (module or file, function), importing nothing; ValueError naming the key
    when it has not that form."""
    return split_spec(spec, _KEY, _EXAMPLE)


def load_custom_reward(spec: str) -> CustomRewardFn:
    """Import and return the function named by ``spec``; ValueError naming the key if not.
    A module is imported once per process (a second call finds it in ``sys.modules``)."""
    attr, fn = load_attr(spec, _KEY, _EXAMPLE)
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
