"""The GRPO loop's seams without Ray or engines: the order of a step's phases (colocated,
async, profiled), the checkpoints and their sampler state, a stop signal mid-rollout, and
the metrics each step records. Trainers, engines and rollouts are fakes that log calls."""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path
from typing import Any

import pytest

from titan_core.config import load_config
from titan_core.signals import StopSignals
from titan_core.training.metrics import read_metrics
from titan_rl.colocation import SeparateDevices, SharedDevices
from titan_rl.config import GRPOConfig
from titan_rl.data import Prompt, PromptSampler
from titan_rl.driver import Driver
from titan_rl.grpo import _train, resolve_config
from titan_rl.job import Job
from titan_rl.rollout.generate import RolloutResult
from titan_rl.rollout.partial import PartialBuffer
from titan_rl.sample import Sample, Status
from titan_rl.step_log import open_metrics

REPO = Path(__file__).resolve().parents[2]
PROMPTS_PER_STEP = 2


class FakeTrainers:
    def __init__(self, log: list[tuple]) -> None:
        self.log = log

    def begin_step(self, step: int) -> None:
        self.log.append(("begin_step", step))

    def end_step(self, step: int) -> None:
        self.log.append(("end_step", step))

    def mark(self, phase: str, begin: bool) -> None:
        self.log.append(("mark", phase, begin))

    def train(self, batch: Any, step: int) -> dict[str, float]:
        self.log.append(("train", step, tuple(batch.tokens.shape)))
        return {"train/loss": float(step)}

    def train_async(self, batch: Any, step: int) -> Any:
        self.log.append(("train_async", step))
        log = self.log

        class Call:
            def result(self) -> dict[str, float]:
                log.append(("train_result", step))
                return {"train/loss": float(step)}

        return Call()

    def sync_weights(self, step: int) -> dict[str, float]:
        self.log.append(("sync", step))
        return {"sync/seconds": 0.5}

    def save(self, step: int, extra: dict[str, Any]) -> None:
        self.log.append(("save", step, extra["sampler"]))


class FakeRecovery:
    def __init__(self, log: list[tuple]) -> None:
        self.log = log

    def on_train_queued(self, version: str) -> None:
        self.log.append(("on_train_queued", version))

    def on_sync(self, version: str) -> None:
        self.log.append(("on_sync", version))

    async def wait_all_up(self) -> None:
        self.log.append(("wait_all_up",))

    async def report(self) -> dict[str, float]:
        return {"engines/resyncs": 0.0, "engines/serving": 1.0}


class FakeRollouts:
    """Draws from a real PromptSampler; ``stop_at``: the step whose rollout a SIGTERM
    interrupts."""

    def __init__(self, cfg: GRPOConfig, log: list[tuple], stop: StopSignals) -> None:
        self.log = log
        self.stop = stop
        self.stop_at: int | None = None
        self.run_dir = Path(cfg.run.dir)
        self.tok = type("Tok", (), {"eod": 0})()
        prompts = [Prompt(f"{i}+1=", str(i + 1), {}) for i in range(50)]
        self.sampler = PromptSampler(prompts, seed=cfg.run.seed)
        self.carried = PartialBuffer()
        self.data_stats = {"data/skipped_rows": 3}

    async def rollout(self, client: Any, step: int, recovery: Any) -> RolloutResult:
        self.log.append(("rollout", step))
        if step == self.stop_at:
            self.stop.request(signal.SIGTERM)
            await asyncio.sleep(10)  # cancelled by the signal
        samples = [
            Sample(g, i, p.text, [1, 2], p.label, response_tokens=[3], reward=1.0 * (i == 0),
                   correct=i == 0, status=Status.COMPLETED, weight_version=str(step - 1))
            for g, p in enumerate(self.sampler.take(PROMPTS_PER_STEP))
            for i in range(2)
        ]  # fmt: skip
        return RolloutResult(samples, PROMPTS_PER_STEP, 0, 0, prompt_hash=f"h{step}")

    async def evaluate(self, client: Any, recovery: Any) -> float:
        self.log.append(("evaluate",))
        return 0.25


class FakeMemory:
    def __init__(self, log: list[tuple]) -> None:
        self.log = log

    async def release(self) -> None:
        self.log.append(("release",))

    async def resume(self, tags: list[str] | None) -> None:
        self.log.append(("resume", tags))

    async def aclose(self) -> None:
        self.log.append(("memory_closed",))


def _driver(tmp_path: Path, *overrides: str, colocate: bool = False):
    cfg = resolve_config(load_config(GRPOConfig, REPO / "examples/math.yaml", [
        f"run.dir={tmp_path}", f"rollout.prompts_per_step={PROMPTS_PER_STEP}",
        "rollout.n_samples_per_prompt=2", "train.micro_batch_size=4",
        f"engines.colocate={str(colocate).lower()}", *overrides,
    ]))  # fmt: skip
    log: list[tuple] = []
    stop = StopSignals()  # not installed: the fake rollout requests the stop itself
    rollouts = FakeRollouts(cfg, log, stop)
    recovery = FakeRecovery(log)
    aio = asyncio.new_event_loop()
    if colocate:
        colocation: Any = SharedDevices(
            aio.run_until_complete, recovery.wait_all_up, FakeMemory(log),
            resume_kv_cache=cfg.sync.resume_kv_cache,
        )  # fmt: skip
    else:
        colocation = SeparateDevices(aio.run_until_complete, recovery.wait_all_up)
    engines = type("Engines", (), {"restarts": lambda self: 0})()
    job: Any = Job(
        stop, rollouts, aio, trainers=FakeTrainers(log), engines=engines,
        writer=open_metrics(tmp_path / "metrics.jsonl", -1), recovery=recovery,
        colocation=colocation,
    )  # fmt: skip
    return Driver(cfg, job), log, rollouts


def _run(driver: Driver) -> int:
    try:
        driver.evaluate_base()
        _train(driver)
        code = driver.finish()
    finally:
        driver.writer.close()
        driver.aio.close()
    if code == 0:  # as titan_rl.grpo: reward.png is drawn while the job closes
        driver.report_written()
    return code


def _phases(log: list[tuple], step: int) -> list[str]:
    """The calls of ``step``: from its rollout (or the step's trained batch) to its save."""
    names = [e[0] for e in log]
    begin = next(i for i, e in enumerate(log) if e[:2] in (("rollout", step), ("begin_step", step)))
    return names[begin : next(i for i, e in enumerate(log) if e[:2] == ("on_sync", str(step))) + 1]


def test_a_colocated_step_releases_the_engines_around_the_update(tmp_path):
    driver, log, _ = _driver(tmp_path, "run.num_steps=2", "run.save_interval=1", colocate=True)
    assert _run(driver) == 0
    assert _phases(log, 2) == [
        "rollout", "release", "train", "wait_all_up", "resume", "sync", "on_sync",
    ]  # fmt: skip
    assert ("resume", ["weights"]) in log  # the sync resumes the KV cache once loaded
    assert [e for e in log if e[0] == "save"] == [
        ("save", 1, {"epoch": 0, "offset": 2}),
        ("save", 2, {"epoch": 0, "offset": 4}),
    ]
    recs = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in recs] == [0, 1, 2]
    assert recs[0] == {"step": 0, "eval/accuracy": 0.25, "data/skipped_rows": 3}
    times = {"time/rollout", "time/release", "time/train", "time/resume", "time/sync",
             "time/eval", "time/step"}  # fmt: skip
    for r in recs[1:]:
        assert times <= r.keys() and "data/skipped_rows" not in r
        assert r["engines/restarts"] == 0 and r["engines/serving"] == 1.0
        assert r["train/loss"] == r["step"] and r["sync/seconds"] == 0.5
        assert r["reward/mean"] == 0.5 and r["rollout/weight_version"] == str(r["step"] - 1)
        assert r["time/step"] >= sum(r[k] for k in times - {"time/step"})
    assert recs[2]["eval/accuracy"] == 0.25 and "eval/accuracy" not in recs[1]
    assert (tmp_path / "reward.png").is_file()


def test_engines_on_their_own_devices_keep_their_memory(tmp_path):
    driver, log, _ = _driver(tmp_path, "run.num_steps=1", "profile.steps=[1,1]")
    assert _run(driver) == 0
    assert _phases(log, 1) == [
        "begin_step", "mark", "rollout", "mark", "train", "wait_all_up", "sync", "on_sync",
    ]  # fmt: skip
    assert log.index(("end_step", 1)) < log.index(("save", 1, {"epoch": 0, "offset": 2}))
    rec = read_metrics(tmp_path / "metrics.jsonl")[-1]
    assert "time/release" not in rec and "time/resume" not in rec
    assert "data/skipped_rows" not in rec  # it went with step 0's record


def test_async_draws_the_next_rollout_while_training(tmp_path):
    driver, log, _ = _driver(
        tmp_path, "run.num_steps=3", "run.save_interval=1", "rollout.async=true"
    )
    assert driver.cfg.algo.use_tis is True
    assert _run(driver) == 0
    names = [e[:2] for e in log if e[0] != "evaluate"]
    assert names == [
        ("rollout", 1), ("train_async", 1), ("on_train_queued", "1"), ("rollout", 2),
        ("train_result", 1), ("wait_all_up",), ("sync", 1), ("on_sync", "1"), ("save", 1),
        ("train_async", 2), ("on_train_queued", "2"), ("rollout", 3), ("train_result", 2),
        ("wait_all_up",), ("sync", 2), ("on_sync", "2"), ("save", 2),
        ("train", 3), ("wait_all_up",), ("sync", 3), ("on_sync", "3"), ("save", 3),
    ]  # fmt: skip
    # a resume redraws the prefetched rollout: each save holds the sampler before it drew
    saves = [e[2]["offset"] for e in log if e[0] == "save"]
    assert saves == [2, 4, 6]


@pytest.mark.parametrize("save_on_signal", [True, False])
def test_a_signal_mid_rollout_abandons_the_step_and_saves_the_last_completed(
    tmp_path, capsys, save_on_signal
):
    driver, log, rollouts = _driver(
        tmp_path, "run.num_steps=5", "run.save_interval=0",
        f"run.save_on_signal={str(save_on_signal).lower()}",
    )  # fmt: skip
    rollouts.stop_at = 3
    assert _run(driver) == 128 + signal.SIGTERM
    assert ("train", 3) not in [e[:2] for e in log] and ("sync", 2) in log
    saves = [e for e in log if e[0] == "save"]
    assert saves == ([("save", 2, {"epoch": 0, "offset": 4})] if save_on_signal else [])
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [0, 1, 2]
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith("stopped by SIGTERM at step 2; ")
    assert ("saved iter_0000002" in last) is save_on_signal


def test_a_stop_cancels_a_coroutine_that_started_no_task():
    """The rollout's requests can all be done when the cancel lands: nothing to wait for."""
    from titan_rl.stopping import until_stopped

    stop = StopSignals()

    async def work() -> int:
        stop.request(signal.SIGINT)
        await asyncio.sleep(10)
        return 1

    aio = asyncio.new_event_loop()
    try:
        assert until_stopped(aio, work(), stop) is None
        assert until_stopped(aio, asyncio.sleep(0, result=7), StopSignals()) == 7
    finally:
        aio.close()


def test_null_intervals_evaluate_and_save_nothing(tmp_path):
    """``run.eval_interval=null`` / ``run.save_interval=null``: no step-0 or last-step
    evaluation, no checkpoint at the last step (slime's unset ``--eval-interval`` /
    ``--save-interval``); the steps still run and record."""
    driver, log, _ = _driver(
        tmp_path, "run.num_steps=3", "run.eval_interval=null", "run.save_interval=null"
    )
    assert _run(driver) == 0
    assert [e for e in log if e[0] in ("evaluate", "save")] == []
    recs = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in recs] == [1, 2, 3]
    assert not any("eval/accuracy" in r for r in recs)
    assert recs[0]["data/skipped_rows"] == 3  # the first record carries the data stats
    assert (tmp_path / "reward.png").is_file()


def test_null_save_interval_still_saves_on_a_signal(tmp_path):
    driver, log, rollouts = _driver(tmp_path, "run.num_steps=5", "run.save_interval=null")
    rollouts.stop_at = 3
    assert _run(driver) == 128 + signal.SIGTERM
    assert [e for e in log if e[0] == "save"] == [("save", 2, {"epoch": 0, "offset": 4})]


def test_a_job_tears_down_its_parts_newest_first_and_all_of_them(monkeypatch):
    """Job.close: the client, the colocation, the recovery, the metrics file, the engines, the
    tool workers, the reward, the trainers, then the event loop; a step that raises stops
    none of the others, and its error comes out after them."""
    log: list[str] = []

    def part(name: str, *methods: str, fails: bool = False) -> Any:
        def call(method: str) -> Any:
            def f(*_: Any) -> None:
                log.append(f"{name}.{method}")
                if fails:
                    raise RuntimeError(f"{name} failed")

            async def af(*_: Any) -> None:
                f()

            return af if method == "aclose" else f

        return type(name, (), {m: staticmethod(call(m)) for m in methods})()

    monkeypatch.setattr("titan_rl.job.close_tool_workers", lambda: log.append("tool_workers"))
    aio = asyncio.new_event_loop()
    close_loop = aio.close
    monkeypatch.setattr(aio, "close", lambda: (log.append("aio.close"), close_loop()))
    rollouts: Any = type("Rollouts", (), {"reward": part("reward", "close")})()
    job = Job(
        StopSignals(), rollouts, aio, trainers=part("trainers", "shutdown"),
        engines=part("engines", "stop", fails=True), writer=part("writer", "close"),
        recovery=part("recovery", "aclose"), client=part("client", "aclose"),
        colocation=part("colocation", "close"),
    )  # fmt: skip
    with pytest.raises(RuntimeError, match="engines failed"):
        job.close()
    assert log == [
        "client.aclose", "colocation.close", "recovery.aclose", "writer.close", "engines.stop",
        "tool_workers", "reward.close", "trainers.shutdown", "aio.close",
    ]  # fmt: skip
    assert aio.is_closed()
