"""TitanTrainActor under slime's own RayTrainGroup on a local Ray: slime's Sample -> train
data -> slime's DP schedule and process_rollout_data -> Titan's trainer; weight sync to the
built-in engine at the new weight_version with logprob parity; DP=2 split as slime splits."""

from __future__ import annotations

import os
from pathlib import Path

import httpx
import pytest

pytest.importorskip("slime.ray.train_actor", reason="slime's wheel (../shared/peers) is needed")

from tests.adapters.engine_probe import engine_logprob, weight_version  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


@pytest.fixture
def slime_job(tmp_path, base, monkeypatch):
    """slime's placement groups, a TitanRolloutManager with one built-in engine and the
    trainer group from slime's create_training_models, two trainer ranks (DP=2)."""
    import ray
    from slime.ray.placement_group import create_placement_groups, create_training_models

    from adapters.common.driver import prepare, ray_init
    from adapters.slime import register
    from adapters.slime.actor import TitanTrainActor
    from adapters.slime.arguments import parse_args
    from adapters.slime.rollout import TitanRolloutManager

    monkeypatch.setenv("SLIME_ACCELERATOR", "titan")
    monkeypatch.setenv("TITAN_CONFIG", str(REPO / "examples/math.yaml"))  # as the driver sets
    args = parse_args([
        "--titan-config", str(REPO / "examples/math.yaml"), "--load", str(base),
        "--actor-num-gpus-per-node", "2", "--rollout-num-gpus", "1",
        "--num-rollout", "1", "--rollout-batch-size", "4", "--n-samples-per-prompt", "4",
        "--micro-batch-size", "4", "--lr", "1e-3", "--min-lr", "1e-3",
        "--save", str(tmp_path / "ckpt"), "--hf-checkpoint", str(tmp_path / "hf"),
        "--custom-rm-path", "adapters.slime.rewards.exact_match",
        "--titan-override", "sync.check_every=1", "train.ppo_steps=1",
    ])  # fmt: skip
    prepare(args)
    args.titan_export_hf_checkpoint = True
    register()
    ray_init(args)
    manager = None
    try:
        pgs = create_placement_groups(args)
        manager = ray.remote(TitanRolloutManager).remote(args, pgs["rollout"])
        group, _ = create_training_models(args, pgs, manager, actor_cls=TitanTrainActor)
        urls = ray.get(manager.start_engines.remote(args.hf_checkpoint))
        yield args, manager, group, urls
    finally:
        if manager is not None:
            ray.get(manager.dispose.remote())
        ray.shutdown()


def test_train_and_sync_under_slime_group(slime_job):
    import ray
    from slime.utils.types import Sample

    from adapters.slime.train_data import samples_to_train_data, split_by_dp
    from titan_core.data.tokenizer import build_tokenizer

    args, manager, group, urls = slime_job

    @ray.remote(num_cpus=0)
    def niceness() -> int:
        return os.nice(0)

    # the driver's Ray runs its workers at the driver's niceness, as the main job's does
    # (Ray's own default is 15), and the setting did not stay in the driver's environment
    assert ray.get(niceness.remote()) == os.nice(0)
    assert "RAY_worker_niceness" not in os.environ
    tok = build_tokenizer("byte")
    # four prompts, four responses each; the right answer rewarded, the others not
    problems = [("12+34=", "46"), ("50+25=", "75"), ("7+8=", "15"), ("100+1=", "101")]
    samples = []
    for g, (prompt, answer) in enumerate(problems):
        for j, resp in enumerate([answer, "9", answer[::-1] + "0", "0"]):
            s = Sample(group_index=g, index=4 * g + j, prompt=prompt, label=answer)
            p_ids = tok.encode(prompt)
            r_ids = tok.encode(resp + "\n")
            s.tokens = p_ids + r_ids
            s.response_length = len(r_ids)
            s.response = resp
            s.reward = 1.0 if resp == answer else 0.0
            s.status = Sample.Status.COMPLETED
            samples.append(s)
    config = ray.get(manager.get_train_parallel_config.remote())
    assert config["dp_size"] == 2

    right = (tok.encode(problems[0][0]), tok.encode(problems[0][1] + "\n"))
    wrong = (tok.encode(problems[0][0]), tok.encode("9\n"))
    group.update_weights()  # slime's first step: engines serve the trainer's weights
    before = (engine_logprob(urls[0], *right), engine_logprob(urls[0], *wrong))
    # the exported checkpoint holds the run's tokenizer, which the engine loaded as slime's
    # SGLang loads --hf-checkpoint's: --rollout-stop texts can match
    assert (Path(args.hf_checkpoint) / "tokenizer.json").is_file()
    info = httpx.get(f"{urls[0]}/get_server_info", timeout=30).json()
    assert info["skip_tokenizer_init"] is False

    for rollout_id in range(3):
        refs = split_by_dp(args, samples_to_train_data(args, samples), config)
        assert len(refs) == 2
        metrics = ray.get(group.async_train(rollout_id, refs))
        assert all(m["train/steps"] == 1.0 for m in metrics)
        synced = group.update_weights()
    after = (engine_logprob(urls[0], *right), engine_logprob(urls[0], *wrong))
    assert after[0] > before[0] + 0.05, (before, after)  # the rewarded answer got likelier
    assert after[1] < before[1], (before, after)
    # the engine reports the trainer's 4th weight version (1 + 3 syncs) at parity
    assert weight_version(urls[0]) == "4"
    assert synced[0]["sync/logprob_abs_diff_max"] < 1e-4
