"""reward.png: reward and eval accuracy against step (and a multi-turn run's tool-use rate)."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def plot_rewards(records: list[dict[str, Any]], out: str | Path, title: str = "GRPO") -> None:
    """Drawn on a matplotlib ``Figure`` of its own (Agg, no pyplot): safe on any thread, and
    the process's pyplot state is left alone."""
    from matplotlib.figure import Figure

    steps = [r["step"] for r in records if "reward/mean" in r]
    rewards = [r["reward/mean"] for r in records if "reward/mean" in r]
    evals = [(r["step"], r["eval/accuracy"]) for r in records if "eval/accuracy" in r]
    fig = Figure(figsize=(7, 4), dpi=110)
    ax = fig.subplots()
    ax.plot(steps, rewards, color="tab:blue", alpha=0.8, label="reward (train, mean)")
    if evals:
        ax.plot(*zip(*evals, strict=True), "o-", color="tab:red", label="eval accuracy (greedy)")
    tools = [
        (r["step"], r["rollout/tool_use_rate"]) for r in records if "rollout/tool_use_rate" in r
    ]
    if tools:
        ax.plot(*zip(*tools, strict=True), color="tab:green", alpha=0.8, label="tool-use rate")
    ax.set_xlabel("step")
    ax.set_ylabel("reward / accuracy")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(out)
