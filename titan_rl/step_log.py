"""What a GRPO step leaves behind: its record in ``metrics.jsonl`` and its status line."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from titan_core.training.metrics import MetricsWriter, drop_records_after
from titan_rl.rollout.tools import stuck_calls

if TYPE_CHECKING:
    from titan_rl.rollout.generate import RolloutResult
    from titan_rl.sample import Sample


def step_record(step: int, result: RolloutResult, measured: dict[str, Any]) -> dict[str, Any]:
    """A step's metrics from its rollout (and the trainer's, the sync's and the timer's
    ``measured``)."""
    samples = result.samples
    n = len(samples)
    return {
        "step": step,
        "reward/mean": sum(s.reward for s in samples) / n,
        "rollout/accuracy": sum(bool(s.correct) for s in samples) / n,
        "response/length_mean": sum(s.response_length for s in samples) / n,
        "response/truncated_frac": result.truncated / n,
        "rollout/groups_generated": result.groups_generated,
        "rollout/groups_filtered": result.groups_filtered,
        "reward/timeouts": result.reward_timeouts,
        "reward/invalid": result.reward_invalid,
        "rollout/stale_samples": result.stale_samples,
        "rollout/weight_version": ",".join(sorted({s.weight_version for s in samples})),
        "data/prompt_hash": result.prompt_hash,
        **multi_turn_stats(samples),
        **version_stats(samples, str(step - 1)),
        "rollout/carried_groups": len(result.carry),
        **measured,
    }


def version_stats(samples: list[Sample], policy_version: str) -> dict[str, float]:
    """How far off-policy the step's tokens are: the share of model-written tokens generated
    by another weight version than the policy being trained (``policy_version``; all of them
    under rollout.async, some under rollout.partial), the most weight updates between a
    token's version and the policy's (numeric versions, as the GRPO job's), and the samples
    a partial rollout continued across a weight update."""
    versions = [v for s in samples for v in s.token_versions() if v]
    off = sum(v != policy_version for v in versions)
    lags = [int(policy_version) - int(v) for v in set(versions) if v.isdigit()]
    numeric = [int(v) for v in versions if v.isdigit()]
    newest = max(numeric, default=0)
    n = len(versions)
    return {
        "rollout/off_policy_token_share": off / n if n else 0.0,
        # written by an older version than the step's newest tokens: carried across a
        # weight update (0 without rollout.partial, async or not)
        "rollout/carried_token_share": sum(v < newest for v in numeric) / n if n else 0.0,
        "rollout/token_lag_max": max(lags, default=0) if policy_version.isdigit() else 0,
        "rollout/continued_samples": sum(bool(s.metadata.get("continued")) for s in samples),
    }


def multi_turn_stats(samples: list[Sample]) -> dict[str, float]:
    """Turns and tool use of a multi-turn rollout (titan_rl.rollout.multiturn records them in
    each sample's metadata); nothing for single-turn samples."""
    turns = [s.metadata["turns"] for s in samples if "turns" in s.metadata]
    if not turns:
        return {}
    calls = [s.metadata.get("tool_calls") or [] for s in samples if "turns" in s.metadata]
    n, n_calls = len(turns), sum(len(c) for c in calls)
    return {
        "rollout/turns_mean": sum(turns) / n,
        "rollout/tool_calls_mean": n_calls / n,
        # the share of samples that called a tool at least once
        "rollout/tool_use_rate": sum(bool(c) for c in calls) / n,
        # the share of tool calls that failed or timed out (answered with an error)
        "rollout/tool_error_rate": (
            sum("error" in call for c in calls for call in c) / n_calls if n_calls else 0.0
        ),
        # the step's tool calls past their timeout (answered with an error)
        "tools/timeouts": sum(bool(call.get("timed_out")) for c in calls for call in c),
        # sync calls of the driver that timed out (this step or before) and still run:
        # threads cannot be stopped (a tool with isolation="process" is killed instead)
        "tools/stuck": stuck_calls(),
    }


def status_line(rec: dict[str, Any], total: int) -> str:
    """The step's line on stdout."""
    parts = [
        f"step {rec['step']:>4}/{total}",
        f"reward {rec['reward/mean']:.3f}",
        f"rollout acc {rec['rollout/accuracy']:.3f}",
        f"len {rec['response/length_mean']:.1f}",
    ]
    if "eval/accuracy" in rec:
        parts.append(f"eval acc {rec['eval/accuracy']:.3f}")
    if "rollout/tool_use_rate" in rec:
        parts.append(
            f"turns {rec['rollout/turns_mean']:.2f} tool use {rec['rollout/tool_use_rate']:.2f}"
        )
    if rec.get("rollout/carried_groups") or rec.get("rollout/continued_samples"):
        parts.append(
            f"partial: continued {rec['rollout/continued_samples']} / carried "
            f"{rec['rollout/carried_groups']} groups"
        )
    if rec.get("tools/timeouts") or rec.get("tools/stuck"):
        parts.append(f"tool timeouts {rec['tools/timeouts']} / stuck {rec['tools/stuck']}")
    if rec.get("reward/timeouts") or rec.get("reward/invalid"):
        parts.append(f"reward timeouts {rec['reward/timeouts']} / invalid {rec['reward/invalid']}")
    if rec.get("engines/resyncs") or rec.get("rollout/stale_samples"):
        parts.append(
            f"engines restarted {rec['engines/restarts']} / resynced {rec['engines/resyncs']:.0f}"
            f" / stale samples {rec['rollout/stale_samples']}"
        )
    phases = " / ".join(f"{name} {_seconds(rec, name)}" for name in ("rollout", "train", "sync"))
    parts.append(f"time {rec['time/step']:.2f}s ({phases})")
    return " | ".join(parts)


def _seconds(rec: dict[str, Any], phase: str) -> str:
    """A phase's seconds, or ``-`` for one the step never reached (engines lost before it)."""
    value = rec.get(f"time/{phase}")
    return "-" if value is None else f"{value:.2f}"


def open_metrics(path: Path, resumed_step: int) -> MetricsWriter:
    """metrics.jsonl without the records past ``resumed_step`` (-1: a fresh start): a run
    killed after its last checkpoint repeats those steps, which are then recorded once."""
    dropped = drop_records_after(path, resumed_step)
    if dropped:
        print(
            f"{path}: dropped {dropped} records past step {max(resumed_step, 0)}, "
            "where this run starts",
            flush=True,
        )
    return MetricsWriter(path)
