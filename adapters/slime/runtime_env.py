"""The Ray runtime environment that puts Titan's backend in every worker of a slime job.

slime selects its accelerator in each process it starts (the rollout manager, the SGLang
engine actors, the train actors), so ``SLIME_ACCELERATOR=titan`` needs ``titan`` registered
in each of them. Ray's ``worker_process_setup_hook`` runs in every worker of the job when it
starts, before the worker loads any task or actor (``ray/_private/workers/default_worker.py``
runs it ahead of ``worker.main_loop()``), so it comes before slime's import-time selection.
:data:`SETUP_HOOK` is that hook, by module path, so that ``ray job submit
--runtime-env-json`` can name it too (the job submission API takes only a string there).

This module imports neither slime nor torch: ``adapters.common.driver.ray_init`` uses it
for miles runs too.
"""

from __future__ import annotations

import importlib.util
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

#: the hook, a dotted path Ray imports in each worker (``adapters.slime.accelerator``)
SETUP_HOOK = "adapters.slime.accelerator.setup_worker"
#: the variables a worker's selection and Titan's start-up read, passed on from the driver
PASSED_ENV = (
    "SLIME_ACCELERATOR",
    "TITAN_ACCELERATOR",
    "TITAN_CONFIG",
    "MUSA_PATCH_PATH",
    "MUSA_TITAN_PATH",
    "TITAN_VENDOR_MUSA_PATCH_PATH",
)
#: Ray's variable holding a submitted job's config (runtime env included) for its driver
JOB_CONFIG_ENV = "RAY_JOB_CONFIG_JSON_ENV_VAR"
#: where Ray keeps a string ``worker_process_setup_hook`` among a runtime env's variables
_HOOK_ENV = "__RAY_WORKER_PROCESS_SETUP_HOOK_ENV_VAR"


def titan_root() -> str:
    """The folder holding the ``adapters`` package (a worker's ``PYTHONPATH`` entry)."""
    return str(Path(__file__).resolve().parents[2])


def slime_installed() -> bool:
    """Whether slime's package is importable (the hook imports its registry)."""
    try:
        return importlib.util.find_spec("slime") is not None
    except (ImportError, ValueError):
        return False


def submitted_job_env() -> dict[str, Any] | None:
    """The runtime env of the job this driver was started by (``ray job submit``), or None
    when it was started otherwise."""
    raw = os.environ.get(JOB_CONFIG_ENV)
    if not raw:
        return None
    return dict(json.loads(raw).get("runtime_env") or {})


def _job_hook(job: Mapping[str, Any]) -> str | None:
    hook = job.get("worker_process_setup_hook")
    return hook if isinstance(hook, str) else (job.get("env_vars") or {}).get(_HOOK_ENV)


def runtime_env(job: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """What a driver passes to ``ray.init(runtime_env=...)``: :data:`SETUP_HOOK`, Titan's
    root on ``PYTHONPATH`` and :data:`PASSED_ENV` from this process's environment. Under a
    submitted job (``job``, default :func:`submitted_job_env`) only what the job's own
    runtime env lacks: Ray refuses a driver's ``ray.init`` that sets a field or variable
    the job sets. A job with another setup hook is an error (Ray runs one per job)."""
    job = submitted_job_env() if job is None else job
    env = {k: os.environ[k] for k in PASSED_ENV if os.environ.get(k)}
    paths = [titan_root(), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    out: dict[str, Any] = {"worker_process_setup_hook": SETUP_HOOK, "env_vars": env}
    if not job:
        return out
    hook = _job_hook(job)
    if hook not in (None, SETUP_HOOK):
        raise RuntimeError(
            f"the submitted job's worker_process_setup_hook is {hook!r}: Ray runs one per job, "
            f"so call {SETUP_HOOK}() from it (or name {SETUP_HOOK!r} in --runtime-env-json)"
        )
    if hook is not None:
        del out["worker_process_setup_hook"]
    job_vars = job.get("env_vars") or {}
    out["env_vars"] = {k: v for k, v in env.items() if k not in job_vars}
    if not out["env_vars"]:
        del out["env_vars"]
    return out
