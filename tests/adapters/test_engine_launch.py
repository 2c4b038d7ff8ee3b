"""An engines section becomes a launch in one place (``titan_rl.placement.engine_launch``): a
slime or miles run's engines run what the GRPO job's run from the same Titan YAML, on the
framework's layout, ``engines.dtype`` and ``rollout.return_routed_experts`` among the rest.
No Ray: the launches are compared as objects."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("slime.ray.placement_group", reason="slime's wheel (../shared/peers) is needed")

from adapters.common.arguments import parse  # noqa: E402
from adapters.common.rollout import TitanEngines  # noqa: E402
from titan_rl.placement import plan_placement  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
MATH = REPO / "examples" / "math.yaml"
#: what both frameworks' parsers require
BASE = ["--rollout-batch-size", "4", "--n-samples-per-prompt", "2", "--num-rollout", "1",
        "--custom-rm-path", "adapters.slime.rewards.exact_match"]  # fmt: skip
#: every engines key a launch reads, off its default
SECTIONS = [
    "engines.dtype=bfloat16", "rollout.return_routed_experts=true", "engines.num_threads=3",
    "engines.chunked_prefill_size=512", "engines.api_key=k", "engines.health_timeout_s=30",
    "engines.mem_fraction_static=0.5",
]  # fmt: skip


def _adapter_engines(framework: str, overrides: list[str], layout: list[str]) -> TitanEngines:
    args = parse(framework, [*BASE, "--titan-config", str(MATH), *layout,
                             "--titan-override", *overrides])  # fmt: skip
    return TitanEngines(args)


@pytest.mark.parametrize("framework", ["slime", "miles"])
@pytest.mark.parametrize("colocate", [False, True])
def test_adapter_engines_launch_as_the_grpo_jobs(
    framework: str, colocate: bool, tmp_path: Path
) -> None:
    overrides = [f"run.dir={tmp_path}", *SECTIONS, "train.micro_batch_size=4"]
    overrides += ["trainer.num_processes=2", f"engines.colocate={str(colocate).lower()}"]
    layout = ["--actor-num-nodes", "1", "--actor-num-gpus-per-node", "2",
              "--rollout-num-gpus", "1", "--rollout-num-gpus-per-engine", "1"]  # fmt: skip
    if colocate:
        layout.append("--colocate")
    engines = _adapter_engines(framework, overrides, layout)
    # the GRPO job's plan from the same sections (the adapter's config: its YAML + overrides)
    job = plan_placement(engines.cfg, "cpu", None, None).engine
    assert job is not None
    adapter = engines.engine_launch(str(tmp_path / "hf_start"))
    # the two the adapters' hand-built launch had lost
    assert adapter.dtype == "bfloat16" and adapter.enable_return_routed_experts
    assert adapter.enable_memory_saver is colocate
    # identical, but for where the logs go (the job's run dir; a slime / miles run's engines
    # log to a folder of their own)
    assert job.log_dir == str(tmp_path / "logs") and adapter.log_dir is None
    assert adapter == job.model_copy(update={"log_dir": None})


def test_the_frameworks_flag_turns_routed_experts_on(tmp_path: Path) -> None:
    """slime's ``--use-rollout-routing-replay`` is ``rollout.return_routed_experts`` (the
    launch's SGLang flag); without it the YAML's value holds."""
    layout = ["--rollout-num-gpus", "1", "--rollout-num-gpus-per-engine", "1"]
    base = [f"run.dir={tmp_path}", "train.micro_batch_size=8"]
    off = _adapter_engines("slime", base, layout).engine_launch("/m")
    assert not off.enable_return_routed_experts
    on = _adapter_engines("slime", base, [*layout, "--use-rollout-routing-replay"])
    assert on.engine_launch("/m").enable_return_routed_experts
