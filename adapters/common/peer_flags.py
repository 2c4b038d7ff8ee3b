"""slime's and miles' command-line flags, read from their installed source.

Their parsers cannot run here: ``slime.utils.arguments`` and ``miles.utils.arguments`` import
``sglang`` (no CPU build) and Megatron-LM's ``megatron.training`` (not in the megatron-core
wheel) at the top. So the ``add_argument`` / ``reset_arg`` calls in their argument modules
are read with :mod:`ast` (flag names, ``dest``, ``type``, ``action``, ``nargs``,
``choices`` and literal defaults), and the adapters' drivers build their parsers from that:
a flag slime or miles adds later is on the command line by itself, with its framework's
default, and the flag table (:mod:`adapters.common.flag_table`) must then classify it.

Two families are generated at run time from packages that are not installed here and so
cannot be listed: SGLang's server arguments (``--sglang-<server flag>``, from sglang's
``ServerArgs``) and sglang-router's (``--router-<flag>``). The drivers accept them by prefix
and the flag table classifies them as a family.

Megatron-LM's own flags (model shape, optimizer, schedule, parallelism, precision), which
both frameworks take through Megatron-LM's parser, are declared in
:mod:`adapters.common.megatron_flags` under Megatron-LM's names and defaults.
"""

from __future__ import annotations

import argparse
import ast
import functools
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from adapters.peers import peer_source

#: where each framework's flags are defined (module, inside the installed package)
PEER_ARGUMENT_MODULES: dict[str, tuple[str, ...]] = {
    "slime": ("slime.utils.arguments", "slime.backends.sglang_utils.arguments"),
    "miles": (
        "miles.utils.arguments",
        "miles.backends.sglang_utils.arguments",
        "miles.dashboard.args",
    ),
}

#: flag prefixes of the argument families generated from packages absent here
GENERATED_PREFIXES: tuple[str, ...] = ("--sglang-", "--router-")

#: a default that is not a literal in the source (computed at parse time)
DYNAMIC = object()


@dataclass(frozen=True)
class FlagSpec:
    """One flag as its framework declares it."""

    options: tuple[str, ...]
    dest: str
    #: argparse action name: store, store_true, store_false, boolean_optional, append, count
    action: str = "store"
    #: int, float, str, json (json.loads), or the source text of another callable
    type: str = "str"
    nargs: Any = None
    default: Any = None
    choices: tuple[Any, ...] | None = None
    #: the function that declares it (slime's / miles' argument group), or Megatron's group
    section: str = ""
    source: str = ""
    help: str = ""
    extra: dict[str, Any] = field(default_factory=dict, compare=False)

    @property
    def name(self) -> str:
        """The flag's long name (the first ``--`` option)."""
        return next((o for o in self.options if o.startswith("--")), self.options[0])

    def add_to(self, parser: Any, *, suppress_default: bool = False) -> None:
        """Declare this flag on an argparse parser (or group) as its framework does."""
        kwargs: dict[str, Any] = {"dest": self.dest, "help": self.help or None}
        default = None if self.default is DYNAMIC else self.default
        if self.action in ("store_true", "store_false"):
            kwargs["action"] = self.action
        elif self.action == "boolean_optional":
            kwargs["action"] = argparse.BooleanOptionalAction
        elif self.action == "count":
            kwargs["action"] = "count"
        else:
            if self.action in ("append", "extend"):
                kwargs["action"] = self.action
            kwargs["type"] = _TYPES.get(self.type, str)
            if self.nargs is not None:
                kwargs["nargs"] = self.nargs
            if self.choices is not None:
                kwargs["choices"] = list(self.choices)
        kwargs["default"] = argparse.SUPPRESS if suppress_default else default
        parser.add_argument(*self.options, **kwargs)


def _json(text: str) -> Any:
    return json.loads(text) if isinstance(text, str) else text


def _moe_freq(text: str) -> Any:
    """Megatron-LM's ``--moe-layer-freq``: an int, or a Python list expression of 0/1 per
    layer (``"[1,1,0]"``, ``"([1]*3+[0])"``), as its own ``moe_freq_type`` reads it."""
    if not isinstance(text, str):
        return text
    if text.strip().isdigit():
        return int(text)
    try:
        value = ast.literal_eval(text)
    except (ValueError, SyntaxError):
        node = ast.parse(text, mode="eval").body  # list arithmetic: [1]*3+[0]
        value = _list_arith(node)
    if not isinstance(value, int | list):
        raise argparse.ArgumentTypeError(f"{text!r} is neither an int nor a list of 0/1")
    return value


def _list_arith(node: ast.AST) -> Any:
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add | ast.Mult):
        left, right = _list_arith(node.left), _list_arith(node.right)
        return left + right if isinstance(node.op, ast.Add) else left * right
    return ast.literal_eval(node)


_TYPES: dict[str, Any] = {
    "int": int, "float": float, "str": str, "json": _json, "moe_freq": _moe_freq,
}  # fmt: skip


def _literal(node: ast.AST | None) -> Any:
    if node is None:
        return None
    try:
        return ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return DYNAMIC


def _type_name(node: ast.AST | None) -> str:
    if node is None:
        return "str"
    if isinstance(node, ast.Name) and node.id in ("int", "float", "str"):
        return node.id
    if isinstance(node, ast.Attribute) and ast.unparse(node) == "json.loads":
        return "json"
    return ast.unparse(node)


def _action_name(node: ast.AST | None) -> str:
    if node is None:
        return "store"
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if ast.unparse(node).endswith("BooleanOptionalAction"):
        return "boolean_optional"
    return ast.unparse(node)


def _dest(options: list[str], explicit: Any) -> str:
    if isinstance(explicit, str):
        return explicit
    long = next((o for o in options if o.startswith("--")), options[0])
    return long.lstrip("-").replace("-", "_")


class _Reader(ast.NodeVisitor):
    def __init__(self, source: str) -> None:
        self.source = source
        self.functions: list[str] = []
        self.specs: list[FlagSpec] = []

    def visit_FunctionDef(self, node: ast.FunctionDef) -> None:
        self.functions.append(node.name)
        self.generic_visit(node)
        self.functions.pop()

    def visit_Call(self, node: ast.Call) -> None:
        func = node.func
        name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
        if name in ("add_argument", "reset_arg"):
            positional = node.args[1:] if name == "reset_arg" else node.args
            options = [
                a.value
                for a in positional
                if isinstance(a, ast.Constant) and isinstance(a.value, str) and a.value[:1] == "-"
            ]
            if options:
                self._add(options, {k.arg: k.value for k in node.keywords if k.arg})
        self.generic_visit(node)

    def _add(self, options: list[str], kw: dict[str, ast.AST]) -> None:
        action = _action_name(kw.get("action"))
        if "default" in kw:
            default = _literal(kw["default"])
        else:
            default = {"store_true": False, "store_false": True}.get(action)
        choices = _literal(kw.get("choices")) if "choices" in kw else None
        help_text = _literal(kw.get("help"))
        self.specs.append(
            FlagSpec(
                options=tuple(options),
                dest=_dest(options, _literal(kw.get("dest"))),
                action=action,
                type=_type_name(kw.get("type")),
                nargs=_literal(kw.get("nargs")) if "nargs" in kw else None,
                default=default,
                choices=tuple(choices) if isinstance(choices, list | tuple) else None,
                section=self.functions[-1] if self.functions else "",
                source=self.source,
                help=help_text if isinstance(help_text, str) else "",
            )
        )


def read_flags(path: str | Path, source: str = "") -> list[FlagSpec]:
    """Every ``add_argument`` / ``reset_arg`` flag declared in one source file, in order."""
    reader = _Reader(source or str(path))
    reader.visit(ast.parse(Path(path).read_text(), filename=str(path)))
    return reader.specs


@functools.cache
def peer_flags(framework: str) -> tuple[FlagSpec, ...]:
    """``framework``'s own flags (slime or miles), from its installed argument modules.

    A flag declared more than once (a ``reset_arg`` after Megatron's, a pre-parse flag
    declared again in the main parser) keeps its last declaration, as argparse's
    ``reset_arg`` does; the generated ``--sglang-`` / ``--router-`` families are listed
    only where the source names them explicitly.
    """
    by_name: dict[str, FlagSpec] = {}
    for module in PEER_ARGUMENT_MODULES[framework]:
        for spec in read_flags(peer_source(module), f"{framework}:{module}"):
            by_name[spec.name] = spec
    return tuple(by_name.values())


def is_generated(flag: str) -> bool:
    """A flag of the families generated from sglang's / sglang-router's argument classes."""
    return flag.startswith(GENERATED_PREFIXES)
