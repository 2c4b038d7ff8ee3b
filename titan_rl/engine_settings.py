"""The built-in engine's settings, each declared once: its type, its default, its help.

``python -m titan_rl.engine`` makes its flags of the same names from these fields
(:func:`add_arguments`, :func:`from_arguments`: ``num_threads`` is ``--num-threads``), the
:class:`~titan_rl.engine.core.Engine` takes them (:class:`EngineSettings`), and a launch writes
them back as flags (:func:`settings_argv`, called by titan_rl/actors/server.py's
``build_command``). The engine sections that ask for these settings (``engines.*``,
``EngineServerConfig``) take their types, checks and defaults from here.

Beside the engine package, not in it: the job's config imports this, and the rollout and sync
packages, which import the config, never reach the engine (tests/trace/test_module_graph.py);
stdlib only, so a config loads no torch.
"""

from __future__ import annotations

import argparse
import dataclasses
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

#: ``--dtype``: the weights' and the compute's; "auto": the checkpoint's
Dtype = Literal["auto", "float32", "bfloat16", "float16"]

#: ``--model-impl`` (SGLang's flag): "sglang", the engine's own forward of the model
#: (titan_rl/engine/lean.py); "transformers", the HF model's; "auto", the engine's own where it
#: runs the model, else transformers'
ModelImpl = Literal["auto", "sglang", "transformers"]

#: ``--chunked-prefill-size`` left unset: prompt tokens prefilled per scheduler iteration, what
#: a short request or a decode step waits for behind another client's long prompt. Smaller
#: chunks answer sooner but spread a large batch's admission over more iterations, each with a
#: decode step (bench/chunked_prefill.py --chunk 512 2048).
DEFAULT_CHUNKED_PREFILL_SIZE = 2048


def check_chunked_prefill_size(v: int | None) -> int | None:
    """A chunk size: a positive number of tokens, -1 (whole prompts) or None (the default)."""
    if v is not None and v != -1 and v < 1:
        raise ValueError(f"{v}: give a positive number of tokens, or -1 to prefill whole prompts")
    return v


def engine_problem(backend: str, tp_size: int, device: str | None) -> tuple[str, str] | None:
    """What stops ``backend`` from serving ``tp_size``-way on ``device`` (None: not known yet):
    (the setting at fault, why and what to do), or None. The one place these rules live; the
    caller names the key in its own terms (``engines.tp_size``, ``--tp-size``, ...). Here, not
    in titan_rl/actors/config.py, so the engine's command line checks them without importing
    the job's configs (pydantic models, the YAML loader)."""
    if backend == "sglang" and device == "cpu":
        return "backend", (
            "SGLang needs a cuda or musa accelerator and this machine's is cpu (SGLang's CPU "
            "build is not installable here); use the built-in engine, backend builtin (or "
            "auto), on CPU"
        )
    return None


def _help(text: str, *aliases: str) -> dict[str, Any]:
    return {"help": text, "aliases": aliases}


@dataclass(frozen=True)
class EngineSettings:
    """What the built-in engine runs with (the model path and the HTTP server's own flags
    aside). A field ``x_y`` is the flag ``--x-y``."""

    dtype: Dtype = field(
        default="auto",
        metadata=_help(
            "weights and compute (weight updates are cast to it); auto: the checkpoint's"
        ),
    )
    model_impl: ModelImpl = field(
        default="auto",
        metadata=_help(
            "the model's forward: sglang, the engine's own (the same modules and weights, "
            "without transformers' per-call work: faster decode steps); transformers, the HF "
            "model's; auto: the engine's own where it runs the model, else transformers'"
        ),
    )
    context_length: int | None = field(
        default=None,
        metadata=_help(
            "prompt + response tokens a request may reach (default: the model's "
            "max_position_embeddings, else 4096)"
        ),
    )
    max_running_requests: int = field(
        default=256, metadata=_help("sequences in the running batch at once")
    )
    max_prefill_tokens: int = field(
        default=8192, metadata=_help("prompt tokens of one prefill forward (a prompt group)")
    )
    chunked_prefill_size: int | None = field(
        default=None,
        metadata=_help(
            "prompt tokens prefilled per scheduler iteration, between the running requests' "
            "decode steps: a longer prompt is prefilled in chunks, so other requests wait for "
            "a chunk, not for the whole prompt (as SGLang's flag; -1: whole prompts at once; "
            f"default {DEFAULT_CHUNKED_PREFILL_SIZE})"
        ),
    )
    max_queued_requests: int = field(
        default=16384,
        metadata=_help(
            "sequences (a batch's prompts x n) that may wait for a running slot; above it "
            "/generate answers 503 (as SGLang's flag)"
        ),
    )
    num_threads: int | None = field(
        default=None,
        metadata=_help(
            "torch intra-op threads of the engine, shared by its TP ranks (default: torch's)"
        ),
    )
    tp_size: int = field(
        default=1,
        metadata=_help(
            "tensor parallel ranks: this process and N-1 workers, each holding a shard of the "
            "model, over gloo on 127.0.0.1",
            "--tp",
        ),
    )
    weight_version: str = field(
        default="default", metadata=_help("the version the start-up weights are served as")
    )
    random_seed: int = field(
        default=0, metadata=_help("seeds the sampling of requests without a sampling_seed")
    )

    def __post_init__(self) -> None:
        """Refuse what the engine cannot run, naming the flag (ValueError)."""
        if self.tp_size < 1:
            raise ValueError(f"--tp-size {self.tp_size} must be at least 1")
        if self.max_queued_requests < 1:
            raise ValueError("--max-queued-requests must be at least 1")
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError(f"--num-threads {self.num_threads} must be at least 1")
        try:
            check_chunked_prefill_size(self.chunked_prefill_size)
        except ValueError as e:
            raise ValueError(f"--chunked-prefill-size {e}") from None


#: every setting at its default
DEFAULTS = EngineSettings()


def flag(name: str) -> str:
    """The command-line flag of setting ``name``."""
    return "--" + name.replace("_", "-")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add a flag per setting to ``parser`` (its type, choices, default and help from here)."""
    hints = typing.get_type_hints(EngineSettings)
    for f in dataclasses.fields(EngineSettings):
        kind = hints[f.name]
        args = typing.get_args(kind)
        kw: dict[str, Any] = {"default": f.default, "help": f.metadata["help"], "dest": f.name}
        if typing.get_origin(kind) is Literal:
            kw["choices"] = list(args)
        else:  # int, str, or one of them | None
            kw["type"] = next(a for a in (*args, kind) if a is not type(None))
        parser.add_argument(flag(f.name), *f.metadata["aliases"], **kw)


def from_arguments(args: argparse.Namespace) -> EngineSettings:
    """The settings the parsed flags give (ValueError naming a flag the engine refuses)."""
    return EngineSettings(
        **{f.name: getattr(args, f.name) for f in dataclasses.fields(EngineSettings)}
    )


def settings_argv(values: Mapping[str, Any]) -> list[str]:
    """The flags that give the engine the settings in ``values`` (a launch's: names it does not
    have are left at their defaults, as are values equal to them)."""
    argv: list[str] = []
    for f in dataclasses.fields(EngineSettings):
        if f.name in values and values[f.name] != f.default:
            argv += [flag(f.name), str(values[f.name])]
    return argv


__all__ = [
    "DEFAULTS",
    "DEFAULT_CHUNKED_PREFILL_SIZE",
    "Dtype",
    "EngineSettings",
    "add_arguments",
    "check_chunked_prefill_size",
    "engine_problem",
    "flag",
    "from_arguments",
    "settings_argv",
]
