"""miles' launch scripts (../shared/peers/miles-scripts, unchanged) turned into the argument
list their ``train.py`` would get, with only paths, sizes and counts changed.

Each script builds a ``train_args`` string and hands it to miles'
``command_utils.execute_train``, which starts Ray and submits
``python3 train.py <model args> <train_args>``, the model args sourced from miles'
``scripts/models/<type>`` (not shipped here). :func:`script_launch` runs the script's own
``ScriptArgs`` and ``execute()`` unchanged with ``execute_train`` replaced by a function that
records what it was given (the one substitution); :func:`train_argv` puts slime's
``scripts/models/<type>.sh`` MODEL_ARGS (the same Megatron flags) in front, as
``execute_train`` does, and changes the values of the flags named (sizes, counts)."""

from __future__ import annotations

import importlib.util
import shlex
import subprocess
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from tests.adapters.slime_scripts import PEERS, SLIME_SCRIPTS

MILES_SCRIPTS = PEERS / "miles-scripts" / "scripts"


@dataclass
class Launch:
    """What a script's ``execute()`` gave ``execute_train``."""

    train_args: str
    megatron_model_type: str | None
    num_gpus_per_node: int
    env: dict[str, str]


def load_script(name: str) -> Any:
    """The script file as a module (its ``ScriptArgs``, ``prepare``, ``execute``)."""
    path = MILES_SCRIPTS / name
    spec = importlib.util.spec_from_file_location(f"miles_script_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@contextmanager
def _recording_execute_train(got: dict[str, Any]) -> Any:
    import miles.utils.external_utils.command_utils as U

    original = U.execute_train

    def record(**kwargs: Any) -> None:
        config = kwargs.get("config")
        env = dict(kwargs.get("extra_env_vars") or {})
        if config is not None:  # what execute_train adds from the config
            env = U.resolve_extra_env_vars(env, config)
        got.update(kwargs, env=env)

    U.execute_train = record
    try:
        yield
    finally:
        U.execute_train = original


def script_launch(name: str, **fields: Any) -> Launch:
    """Run script ``name``'s ``execute(ScriptArgs(**fields))`` and return what it passed to
    ``execute_train``."""
    module = load_script(name)
    got: dict[str, Any] = {}
    with _recording_execute_train(got):
        module.execute(module.ScriptArgs(**fields))
    if not got:
        raise RuntimeError(f"{name}'s execute() did not call execute_train")
    return Launch(
        train_args=got["train_args"],
        megatron_model_type=got.get("megatron_model_type"),
        num_gpus_per_node=int(got["num_gpus_per_node"]),
        env={k: str(v) for k, v in got["env"].items()},
    )


def model_args(model_type: str) -> list[str]:
    """MODEL_ARGS of slime's ``scripts/models/<model_type>.sh`` (miles' ``scripts/models``
    declares the same Megatron flags for these models, and is not shipped)."""
    path = SLIME_SCRIPTS / "models" / f"{model_type}.sh"
    program = f"source {shlex.quote(str(path))}\nprintf '%s\\n' \"${{MODEL_ARGS[@]}}\""
    out = subprocess.run(["bash", "-c", program], capture_output=True, text=True, check=True)
    return out.stdout.splitlines()


def change(argv: list[str], changes: dict[str, str]) -> list[str]:
    """``argv`` with each ``--flag value...`` of ``changes`` given the new value(s) (the
    first occurrence; every flag named must be there)."""
    argv = list(argv)
    for flag, value in changes.items():
        if flag not in argv:
            raise KeyError(f"the script passes no {flag}")
        i = argv.index(flag)
        n = 0
        while i + 1 + n < len(argv) and not argv[i + 1 + n].startswith("--"):
            n += 1
        argv[i + 1 : i + 1 + n] = value.split()
    return argv


def train_argv(launch: Launch, changes: dict[str, str]) -> list[str]:
    """The arguments ``train.py`` would get (model args, then the script's ``train_args``,
    split as the shell splits them), with ``changes`` applied."""
    assert launch.megatron_model_type is not None, "a Megatron run names its model type"
    argv = model_args(launch.megatron_model_type) + shlex.split(launch.train_args)
    return change(argv, changes)
