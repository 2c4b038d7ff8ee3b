"""The slime and miles drivers survive what the main job survives, faults injected from
outside into ``python -m adapters.{slime,miles}.train`` as a user runs it:

- a second driver on the same run folder exits 2 at start-up naming the holder;
- ``kill -9`` of the rollout engine's server: its supervisor restarts it, the trainers
  resync it before it serves, and no response on the start-up weights is trained
  (``engines/restarts``, ``engines/resyncs``, ``rollout/stale_resent``);
- SIGSTOP of the restarted one (alive, not answering): killed after
  ``engines.health_timeout_s`` and restarted the same way (``engines/hung_restarts``);
- SIGTERM: the rollout in flight is finished or abandoned, the last completed rollout is
  saved, exit 143 with the line saying how to resume; the same command then resumes after
  it, each rollout's record once;
- a ``--custom-rm-path`` reward that never returns: scored ``reward.timeout_score`` after
  ``reward.timeout_s`` (``reward/timeouts``, a warning line), the run goes on;
- one that returns NaN: the run stops with one line naming the flag, the value and the
  sample, nothing trained on it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.adapters.test_miles import _tiny_llama, _titan_yaml

pytest.importorskip("slime.ray.placement_group", reason="slime's wheel (../shared/peers) is needed")
pytest.importorskip("miles.ray.train_actor", reason="miles' wheel (../shared/peers) is needed")
pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
ROLLOUTS = 10_000  # more than run before the SIGTERM


class Driver:
    """A driver subprocess whose output lines are collected as they come."""

    def __init__(self, cmd: list[str], env: dict[str, str]) -> None:
        self.proc = subprocess.Popen(
            cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)

    def wait_for(self, text: str, timeout: float, after: int = 0) -> int:
        """The index of the first line from ``after`` on that holds ``text``."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for i in range(after, len(self.lines)):
                if text in self.lines[i]:
                    return i
            if self.proc.poll() is not None and not self._reader.is_alive():
                break
            time.sleep(0.2)
        raise AssertionError(f"no line with {text!r}:\n" + "".join(self.lines[-60:]))

    def finish(self, timeout: float) -> int:
        code = self.proc.wait(timeout)
        self._reader.join(10)
        return code

    @property
    def output(self) -> str:
        return "".join(self.lines)


def _engine_servers(pid: int) -> list[int]:
    """The built-in engine servers among ``pid``'s descendants."""
    import psutil

    out = []
    for p in psutil.Process(pid).children(recursive=True):
        try:
            if "titan_rl.engine" in " ".join(p.cmdline()):
                out.append(p.pid)
        except psutil.Error:
            continue
    return out


def _assert_gone(pids: list[int], timeout: float = 20.0) -> None:
    """Nothing the job started outlives it (an orphan is re-parented, not a descendant)."""
    import psutil

    deadline = time.monotonic() + timeout
    alive = pids
    while alive and time.monotonic() < deadline:
        alive = [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != "zombie"]
        time.sleep(0.5)
    assert not alive, f"engine servers {alive} outlived the job"


@pytest.mark.parametrize("framework", ["slime", "miles"])
def test_driver_survives_faults(framework: str, tmp_path: Path) -> None:
    import yaml

    model = _tiny_llama(tmp_path / "model")
    run = tmp_path / "run"
    titan = _titan_yaml(tmp_path / "titan.yaml", model, run)
    cfg = yaml.safe_load(titan.read_text())
    cfg["reward"] = {"timeout_s": 2.0, "timeout_score": 0.0}
    cfg["engines"]["health_timeout_s"] = 5.0
    titan.write_text(yaml.safe_dump(cfg))
    cmd = [
        sys.executable, "-m", f"adapters.{framework}.train", "--titan-config", str(titan),
        "--actor-num-gpus-per-node", "1", "--rollout-num-gpus", "1",
        "--num-rollout", str(ROLLOUTS), "--rollout-batch-size", "2", "--n-samples-per-prompt", "4",
        "--hf-checkpoint", str(model), "--save", str(tmp_path / "ckpt"), "--save-interval", "50",
        "--custom-rm-path", "adapters.slime.rewards.exact_match", "--skip-eval-before-train",
    ]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "TITAN_CONFIG"}
    env.update(PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    first = Driver(cmd, env)
    try:
        at = first.wait_for(f"rollout    1/{ROLLOUTS}", 300)
        # a second job on the same run folder: refused before it starts anything
        second = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
        assert second.returncode == 2, second.stdout[-2000:] + second.stderr[-3000:]
        assert f"run.dir {run} is in use by pid {first.proc.pid}" in second.stderr

        servers = _engine_servers(first.proc.pid)
        assert len(servers) == 1, servers
        at = len(first.lines)
        os.kill(servers[0], signal.SIGKILL)
        at = first.wait_for("rollout ", 300, after=at)  # the next rollouts after the kill
        at = first.wait_for("rollout ", 300, after=at + 1)
        assert first.proc.poll() is None, first.output[-4000:]
        servers += _engine_servers(first.proc.pid)  # the restarted one
        # then that one hangs (alive, not answering): killed after engines.health_timeout_s
        # and restarted as a dead one, resynced before it serves
        at = len(first.lines)
        os.kill(servers[-1], signal.SIGSTOP)
        at = first.wait_for("rollout ", 300, after=at)
        at = first.wait_for("rollout ", 300, after=at + 1)
        servers += _engine_servers(first.proc.pid)
        first.proc.send_signal(signal.SIGTERM)
        code = first.finish(300)
    finally:
        if first.proc.poll() is None:
            first.proc.kill()
    out = first.output
    assert code == 143, out[-4000:]
    line = next(x for x in out.splitlines() if x.startswith("stopped by SIGTERM after rollout"))
    stopped_after = int(line.split("after rollout ")[1].split(";")[0])
    assert f"saved rollout {stopped_after} in {tmp_path / 'ckpt'}" in line, line
    assert "rerun the same command to resume" in line

    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert max(r.get("engines/restarts", 0) for r in rows) >= 2, rows
    assert max(r.get("engines/hung_restarts", 0) for r in rows) >= 1, rows
    assert sum(r.get("engines/resyncs", 0) for r in rows) >= 1, rows
    # the engine after its restart serves the trainers' weights: every later sync at parity
    assert all(
        r["sync/logprob_abs_diff_max"] < 1e-4 for r in rows if "sync/logprob_abs_diff_max" in r
    )
    _assert_gone(servers)

    # the same command again, resumed after the saved rollout, now with a reward that never
    # returns for the first rollout's 8 calls (scored reward.timeout_score after
    # reward.timeout_s, in workers that are replaced), then returns NaN: that rollout is not
    # trained, and the run stops with one line naming the flag, the value and the sample
    total = stopped_after + 4
    cmd[cmd.index("--num-rollout") + 1] = str(total)
    cmd[cmd.index("--custom-rm-path") + 1] = "tests.adapters.fault_rm.hang_then_nan"
    env.update(FAULT_RM_LOG=str(tmp_path / "calls.log"), FAULT_RM_HANG="8")
    again = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    out = again.stdout + again.stderr
    assert again.returncode == 1, out[-5000:]
    assert "8 of 8 reward calls (--custom-rm-path tests.adapters.fault_rm.hang_then_nan) ran " \
        "past reward.timeout_s=2" in out, out[-5000:]  # fmt: skip
    errors = [x for x in again.stderr.splitlines() if x.startswith("error: ")]
    assert len(errors) == 1, again.stderr[-5000:]
    assert errors[0].startswith(
        "error: --custom-rm-path tests.adapters.fault_rm.hang_then_nan returned nan (float) for "
        "the sample with prompt"
    ), errors[0]
    assert "Traceback" not in again.stderr.split(errors[0])[-1]
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    # each rollout's record once: the resumed one (all rewards timed out), not the NaN one
    assert [r["step"] for r in rows] == list(range(1, stopped_after + 3)), rows
    assert rows[-1]["reward/timeouts"] == 8 and rows[-1]["reward/mean"] == 0.0
