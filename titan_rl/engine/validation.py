"""Request validation: pydantic's errors turned into the one-line messages a 400 carries.

Each error reads ``<field path>: <what is wrong> (got <value>)``, e.g.
``sampling_params[1].top_k: ... (got 0)``; :func:`invalid` raises an error shown as written.
"""

from __future__ import annotations

import reprlib
from collections.abc import Callable
from typing import Any, TypeVar

from pydantic import (
    BaseModel,
    ConfigDict,
    ValidationError,
    ValidationInfo,
    WrapValidator,
    model_validator,
)
from pydantic_core import ErrorDetails, PydanticCustomError

# a request the caller got wrong (400); the wire formats' error type, so payload errors are too
from titan_rl.wire.errors import RequestError as RequestError

#: error type of :func:`invalid`: its message is shown as written, without the value
INVALID = "invalid_request"
#: discriminator tags of "one value, or a list of one per prompt" fields (left out of paths)
ONE, EACH = "<one>", "<each>"

_SHORT = reprlib.Repr()  # a value in a message is cut short (a prompt can be 100k tokens)
_SHORT.maxstring = _SHORT.maxother = 60

M = TypeVar("M", bound=BaseModel)


def invalid(message: str) -> PydanticCustomError:
    """An error to raise in a validator; the message is shown as written."""
    # passed as context, so braces in user input are not read as a template
    return PydanticCustomError(INVALID, "{message}", {"message": message})


def on_error(message: str) -> WrapValidator:
    """Replace a field's errors with one message (pydantic's per-branch errors of a union
    such as ``list[int] | list[list[int]]`` say less than one sentence)."""

    def validate(value: Any, handler: Callable[[Any], Any]) -> Any:
        try:
            return handler(value)
        except ValidationError:
            raise invalid(f"{message} (got {_SHORT.repr(value)})") from None

    return WrapValidator(validate)


def context_vocab_size(info: ValidationInfo) -> int | None:
    """The serving model's vocabulary size, when the validation context gives it."""
    context = info.context if isinstance(info.context, dict) else {}
    return context.get("vocab_size")


class RequestModel(BaseModel):
    """A request body as SGLang reads it: unknown keys ignored, ``null`` meaning unset (the
    default applies), and no type coercion (``"1"`` is not an int, ``true`` not a number)."""

    model_config = ConfigDict(extra="ignore", strict=True, frozen=True)

    @model_validator(mode="before")
    @classmethod
    def _null_is_unset(cls, data: Any) -> Any:
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if v is not None}
        return data


def location(loc: tuple[int | str, ...], prefix: str = "") -> str:
    """``("sampling_params", 1, "top_k")`` -> ``sampling_params[1].top_k``."""
    path = prefix
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        elif part not in (ONE, EACH):
            path = f"{path}.{part}" if path else part
    return path


def _message(err: ErrorDetails, prefix: str, unknown: str) -> str:
    where = location(err["loc"], prefix)
    kind = err["type"]
    if kind == "missing":
        return f"missing required field {where!r}"
    if kind == "extra_forbidden":
        what = unknown
    elif kind == INVALID:
        what = err["msg"]
    else:
        what = f"{err['msg']} (got {_SHORT.repr(err.get('input'))})"
    if kind.endswith("_type"):
        return f"{where or 'the request'} has the wrong type: {what}"
    return f"{where}: {what}" if where else what


def describe(error: ValidationError, prefix: str = "", unknown: str = "unknown field") -> str:
    """All of a validation error's problems, one message (``unknown``: for a forbidden key)."""
    return "; ".join(_message(err, prefix, unknown) for err in error.errors())


def parse(
    model: type[M],
    data: Any,
    context: dict[str, Any] | None = None,
    prefix: str = "",
    unknown: str = "unknown field",
) -> M:
    """Validate ``data`` as ``model``; raise :class:`RequestError` naming each bad field."""
    try:
        return model.model_validate(data, context=context)
    except ValidationError as e:
        raise RequestError(describe(e, prefix, unknown)) from None
