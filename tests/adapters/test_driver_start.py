"""When the slime and miles drivers launch their engines: beside the trainer ranks' start-up
(the two overlap) where the engines load a checkpoint that already exists and have devices
of their own, after the trainers otherwise."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("slime.ray.placement_group", reason="slime's wheel (../shared/peers) is needed")

REPO = Path(__file__).resolve().parents[2]


def _args(tmp_path: Path, *extra: str):
    from adapters.common.driver import prepare, start_policy
    from adapters.slime.arguments import parse_args
    from tests.adapters.test_miles import _tiny_llama, _titan_yaml

    model = _tiny_llama(tmp_path / "model")
    titan = _titan_yaml(tmp_path / "titan.yaml", model, tmp_path / "run")
    extra = tuple(str(model) if e == "MODEL" else e for e in extra)
    args = parse_args([
        "--titan-config", str(titan), "--save", str(tmp_path / "ckpt"),
        "--custom-rm-path", "adapters.slime.rewards.exact_match", "--rollout-batch-size", "2",
        "--num-rollout", "1", "--n-samples-per-prompt", "4", *extra,
    ])  # fmt: skip
    start_policy(args, prepare(args))
    return args


@pytest.mark.parametrize(
    ("flags", "device", "beside"),
    [
        ([], "cpu", False),  # no --hf-checkpoint: the engines serve what rank 0 exports
        (["--hf-checkpoint", "MODEL"], "cpu", True),
        (["--hf-checkpoint", "MODEL", "--colocate"], "cpu", True),  # host memory only
        (["--hf-checkpoint", "MODEL"], "cuda", True),  # engines on their own GPUs
        (["--hf-checkpoint", "MODEL", "--colocate"], "cuda", False),  # one GPU's memory
    ],
    ids=["export", "given", "given-colocated-cpu", "given-gpu", "given-colocated-gpu"],
)
def test_engines_start_beside_the_trainers_where_nothing_stops_them(
    flags, device, beside, tmp_path, monkeypatch
):
    import titan_core.accelerator as accelerator
    from adapters.common.driver import engines_start_beside_trainers

    monkeypatch.delenv("TITAN_CONFIG", raising=False)
    args = _args(tmp_path, *flags)
    real = accelerator.get_accelerator()

    class Device(type(real)):
        device_type = device

    monkeypatch.setattr(accelerator, "get_accelerator", lambda: Device())
    assert engines_start_beside_trainers(args) is beside


def test_a_truncated_hf_checkpoint_stops_the_driver_before_ray(tmp_path):
    """slime's driver reads --hf-checkpoint's weight headers before it starts anything: a
    file cut short exits 2 naming the flag and the file (before: a trainer rank's
    safetensors traceback ~25 s later, after Ray and the trainers had started)."""
    import os
    import subprocess
    import sys

    from tests.adapters.test_miles import _tiny_llama, _titan_yaml

    model = _tiny_llama(tmp_path / "model")
    titan = _titan_yaml(tmp_path / "titan.yaml", model, tmp_path / "run")
    weights = model / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    env = {k: v for k, v in os.environ.items() if k != "TITAN_CONFIG"}
    proc = subprocess.run(
        [sys.executable, "-m", "adapters.slime.train", "--titan-config", str(titan),
         "--actor-num-gpus-per-node", "1", "--rollout-num-gpus", "1", "--num-rollout", "1",
         "--rollout-batch-size", "2", "--n-samples-per-prompt", "4",
         "--hf-checkpoint", str(model), "--save", str(tmp_path / "ckpt"),
         "--custom-rm-path", "adapters.slime.rewards.exact_match"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert f"--hf-checkpoint: {weights} cannot be read" in proc.stderr
    assert "Started a local Ray" not in proc.stdout + proc.stderr
