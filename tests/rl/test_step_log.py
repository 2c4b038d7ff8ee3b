"""A GRPO step's record: the multi-turn rollout's turns, tool use (issue 21) and tool
timeouts (issue 33), recorded and drawn only when the samples carry them."""

from __future__ import annotations

from pathlib import Path

from titan_rl.plot import plot_rewards
from titan_rl.rollout.generate import RolloutResult
from titan_rl.rollout.tools import stuck_calls
from titan_rl.sample import Sample
from titan_rl.step_log import multi_turn_stats, status_line, step_record


def _sample(i: int, **metadata: object) -> Sample:
    return Sample(group_index=0, index=i, prompt="p", prompt_tokens=[1, 2], label="3",
                  response_tokens=[4, 5, 6], reward=float(i % 2), metadata=dict(metadata))  # fmt: skip


def test_turns_and_tool_use_are_counted_per_sample() -> None:
    ok = {"name": "calc", "args": "1+2", "result": "=3"}
    bad = {"name": "calc", "args": "1/0", "error": "ZeroDivisionError: division by zero"}
    late = {"name": "calc", "args": "9*9", "error": "timed out after 2 s", "timed_out": True}
    samples = [
        _sample(0, turns=3, tool_calls=[ok, bad], stop_reason="done"),
        _sample(1, turns=3, tool_calls=[ok, late], stop_reason="done"),
        _sample(2, turns=1, tool_calls=[], stop_reason="done"),
        _sample(3, turns=1, tool_calls=[], stop_reason="max_total_tokens"),
    ]
    stats = multi_turn_stats(samples)
    assert stats == {
        "rollout/turns_mean": 8 / 4,
        "rollout/tool_calls_mean": 4 / 4,
        "rollout/tool_use_rate": 2 / 4,
        "rollout/tool_error_rate": 2 / 4,
        "tools/timeouts": 1,
        "tools/stuck": stuck_calls(),  # the driver's sync calls still running past a timeout
    }
    measured = {"time/step": 1.0, "time/rollout": 0.5, "time/train": 0.4, "time/sync": 0.1}
    result = RolloutResult(samples, groups_generated=1, groups_filtered=0, truncated=1)
    rec = step_record(5, result, measured)
    assert rec["rollout/tool_use_rate"] == 0.5
    assert "turns 2.00 tool use 0.50" in status_line(rec, 10)
    assert "tool timeouts 1 / stuck" in status_line(rec, 10)
    assert "tool timeouts" not in status_line({**rec, "tools/timeouts": 0, "tools/stuck": 0}, 10)


def test_single_turn_samples_add_nothing(tmp_path: Path) -> None:
    samples = [_sample(i) for i in range(4)]
    assert multi_turn_stats(samples) == {}
    measured = {"time/step": 1.0, "time/rollout": 0.5, "time/train": 0.4, "time/sync": 0.1}
    rec = step_record(1, RolloutResult(samples, 1, 0, 0), measured)
    assert not any(k.startswith(("rollout/tool", "tools/")) for k in rec)
    assert "tool use" not in status_line(rec, 10)
    # the picture is drawn with and without the tool-use curve
    records = [rec, {**rec, "step": 2, "rollout/tool_use_rate": 0.25}]
    plot_rewards(records, tmp_path / "reward.png")
    assert (tmp_path / "reward.png").stat().st_size > 0


def test_a_step_stopped_before_its_sync_has_a_status_line() -> None:
    """Engines lost in the engines' wait after training: the step is recorded without a sync
    time, and its line says so rather than failing the record."""
    samples = [_sample(i) for i in range(4)]
    measured = {"time/step": 1.0, "time/rollout": 0.5, "time/train": 0.4}
    line = status_line(step_record(3, RolloutResult(samples, 1, 0, 0), measured), 10)
    assert "(rollout 0.50 / train 0.40 / sync -)" in line
