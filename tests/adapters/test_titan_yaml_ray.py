"""A Titan YAML's ``ray`` section under slime / miles: the framework starts Ray and places the
actors itself, so the section has no effect there, and the start-up says so in one line."""

from __future__ import annotations

from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("ray_keys", [[], ["ray.num_cpus=2"]])
def test_the_ray_section_is_named_as_having_no_effect(ray_keys, tmp_path, capsys, monkeypatch):
    from adapters.common.driver import prepare
    from adapters.slime.arguments import parse_args

    monkeypatch.delenv("TITAN_CONFIG", raising=False)
    args = parse_args([
        "--titan-config", str(REPO / "examples/math.yaml"), "--save", str(tmp_path / "ckpt"),
        "--custom-rm-path", "adapters.slime.rewards.exact_match", "--rollout-batch-size", "4", "--num-rollout", "1", "--micro-batch-size", "4",
        "--n-samples-per-prompt", "4", "--titan-override", f"run.dir={tmp_path / 'run'}", *ray_keys,
    ])  # fmt: skip
    prepare(args)
    said = [s for s in capsys.readouterr().out.splitlines() if "ray section" in s]
    if ray_keys:
        assert said == [
            "no effect here: the Titan YAML's ray section (ray.address, ray.*_resources): the "
            "framework starts Ray and places its actors itself (--actor-num-nodes, "
            "--rollout-num-gpus, ...)"
        ]
    else:
        assert said == []
