"""StepTimer: each phase's time and the step's, which runs from the previous step's end."""

from __future__ import annotations

import pytest

from titan_rl.step_timer import StepTimer


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def test_phases_and_steps_add_up_to_the_wall_time():
    clock = Clock()
    timer = StepTimer(clock)
    timer.start()
    clock.advance(1.0)  # before any phase: in the step only
    with timer.phase("rollout"):
        clock.advance(2.0)
    with timer.phase("train"):
        clock.advance(3.0)
    with timer.phase("rollout"):  # a phase timed twice adds up
        clock.advance(0.5)
    assert timer.stop() == {"time/rollout": 2.5, "time/train": 3.0, "time/step": 6.5}
    clock.advance(4.0)  # the record, the status line, a save: counted in the next step
    timer.start()
    with timer.phase("sync"):
        clock.advance(1.0)
    assert timer.stop() == {"time/sync": 1.0, "time/step": 5.0}


def test_a_phase_that_raises_is_still_timed():
    clock = Clock()
    timer = StepTimer(clock)
    timer.start()
    with pytest.raises(KeyError), timer.phase("eval"):
        clock.advance(2.0)
        raise KeyError("x")
    assert timer.stop()["time/eval"] == 2.0


def test_phases_outside_a_step_are_refused():
    timer = StepTimer(Clock())
    with pytest.raises(RuntimeError, match="start"), timer.phase("train"):
        pass
    with pytest.raises(RuntimeError, match="start"):
        timer.stop()
