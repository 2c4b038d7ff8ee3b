"""``python -m adapters.slime.launch train.py <slime arguments>``: slime's own driver script
with Titan's backend in its process and in every Ray worker it starts.

slime's ``train.py`` selects its accelerator at import (``slime.ray.placement_group`` imports
the rollout manager, whose ``slime.backends.sglang_utils`` calls ``initialize_accelerator()``
at import), so ``SLIME_ACCELERATOR=titan`` needs ``titan`` registered before the script's
first line. This wrapper:

1. sets ``SLIME_ACCELERATOR=titan`` unless the environment names a backend;
2. registers ``titan`` here (``adapters.slime.accelerator.setup_worker``);
3. starts Ray as the script's first Ray call would (``ray.init()``: the cluster of
   ``RAY_ADDRESS`` / a local ``ray start``, else a new local one), with the job's
   ``worker_process_setup_hook`` (``adapters.slime.runtime_env``); under ``ray job submit``
   only what the job's ``--runtime-env-json`` lacks is added;
4. runs the script as ``python train.py <arguments>`` would (``runpy``, ``__main__``).

No site-packages file, ``.pth`` or ``sitecustomize`` is involved.
"""

from __future__ import annotations

import os
import runpy
import sys
from pathlib import Path

USAGE = "usage: python -m adapters.slime.launch SCRIPT.py [script arguments...]"


def prepare_process() -> None:
    """Steps 1-3: ``titan`` selectable here and in every Ray worker of this job."""
    import ray

    from adapters.slime.accelerator import setup_worker
    from adapters.slime.runtime_env import runtime_env

    os.environ.setdefault("SLIME_ACCELERATOR", "titan")
    setup_worker()
    if not ray.is_initialized():
        ray.init(runtime_env=runtime_env())


def main(argv: list[str] | None = None) -> None:
    """Run ``argv[0]`` (a slime driver script) with ``argv[1:]`` as its arguments."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE, file=sys.stderr)
        raise SystemExit(0 if argv else 2)
    script = Path(argv[0])
    if not script.is_file():
        print(f"{USAGE}\nno such script: {script}", file=sys.stderr)
        raise SystemExit(2)
    # as `python train.py` would have them: Ray gives its workers the script's folder too
    sys.argv = [str(script), *argv[1:]]
    sys.path.insert(0, str(script.resolve().parent))
    prepare_process()
    runpy.run_path(str(script), run_name="__main__")


if __name__ == "__main__":
    main()
