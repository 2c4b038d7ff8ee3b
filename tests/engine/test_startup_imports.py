"""The engine process's start-up imports what it serves with, not the job's configs.

On the GRPO job's 2-core start the engine's start competes with the trainer's, so a module
the engine never uses is CPU time taken from both (issue 34).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

#: the job's configs (pydantic models, the YAML loader) and the HF <-> megatron converter:
#: the trainer's and the driver's, never the engine's
NOT_IMPORTED = (
    "titan_rl.actors.config",
    "titan_core.config",
    "titan_core.models.hf.convert",
    "titan_core.parallel.nodes",
    "yaml",
)


def test_the_engine_s_start_up_leaves_the_job_s_configs_unimported():
    """What ``python -m titan_rl.engine`` runs before loading the model: its command line
    and checks (titan_rl/engine/cli.py's ``validate``, ``bind_weight_groups``) and the
    engine's and the server's modules, on a single node (no ``TITAN_NODE_IP``)."""
    code = (
        "import sys\n"
        "from titan_rl.engine import cli\n"
        f"args = cli.build_parser().parse_args(['--model-path', {str(REPO)!r}])\n"
        "cli.validate(args)\n"
        "cli.bind_weight_groups()\n"
        "import titan_rl.engine.core, titan_rl.engine.server\n"
        f"print(' '.join(m for m in {NOT_IMPORTED!r} if m in sys.modules) or 'none')\n"
    )
    drop = {
        "TITAN_CONFIG",
        "TITAN_NODE_IP",
        "MASTER_ADDR",
        "GROUP_WORLD_SIZE",
        "TORCHELASTIC_RUN_ID",
    }
    env = {k: v for k, v in os.environ.items() if k not in drop}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO, env=env
    )
    assert out.stdout.split() == ["none"]
