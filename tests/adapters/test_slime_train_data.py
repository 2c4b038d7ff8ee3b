"""slime's Samples -> train data (reward normalization, loss masks) -> slime's own DP /
micro-batch schedule -> Titan batches, one per optimizer step, with every sample trained
once, on the right tokens, by the right DP rank."""

from __future__ import annotations

import argparse

import pytest
import torch

pytest.importorskip("slime.utils.dp_schedule", reason="slime's wheel (../shared/peers) is needed")

from slime.utils.dp_schedule import build_dp_schedule  # noqa: E402
from slime.utils.types import Sample  # noqa: E402

from adapters.common.rollout_data import RolloutDataError, step_batches, step_indices  # noqa: E402
from adapters.slime.arguments import parse_args  # noqa: E402
from adapters.slime.train_data import post_process_rewards, samples_to_train_data  # noqa: E402


def _args(*extra: str) -> argparse.Namespace:
    args = parse_args(["--num-rollout", "1", "--rollout-batch-size", "4",
                       "--n-samples-per-prompt", "4",
                       "--custom-rm-path", "adapters.slime.rewards.exact_match", *extra])  # fmt: skip
    args.micro_batch_size = 2
    return args


def _samples(n: int = 16, seed: int = 0) -> list[Sample]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        p, r = 3 + i % 3, 2 + i % 4
        s = Sample(group_index=i // 4, index=i, prompt="x", label="y")
        s.tokens = torch.randint(1, 200, (p + r,), generator=g).tolist()
        s.response_length = r
        s.reward = float(torch.rand((), generator=g))
        s.rollout_log_probs = (-torch.rand(r, generator=g)).tolist()
        if i % 5 == 0:  # a multi-turn style mask: a tool output in the middle is not trained
            s.loss_mask = [1] + [0] * (r - 2) + [1]
        out.append(s)
    return out


def test_rewards_normalized_per_group_as_slime_does():
    args = _args()
    samples = _samples()
    raw, norm = post_process_rewards(args, samples)
    r = torch.tensor(raw).view(4, 4)
    want = (r - r.mean(-1, keepdim=True)) / (r.std(-1, keepdim=True) + 1e-6)
    torch.testing.assert_close(torch.tensor(norm), want.flatten(), rtol=0, atol=1e-6)
    _, centred = post_process_rewards(_args("--disable-grpo-std-normalization"), samples)
    torch.testing.assert_close(
        torch.tensor(centred), (r - r.mean(-1, keepdim=True)).flatten(), rtol=0, atol=1e-6
    )
    _, same = post_process_rewards(_args("--disable-rewards-normalization"), samples)
    assert same == raw


@pytest.mark.parametrize("dp_size,global_batch", [(1, 16), (2, 16), (2, 8), (2, 4)])
def test_every_sample_trained_once_on_its_response_tokens(dp_size, global_batch):
    args = _args("--global-batch-size", str(global_batch))
    samples = _samples()
    data = samples_to_train_data(args, samples)
    lengths = [len(t) for t in data["tokens"]]
    config = {"dp_size": dp_size, "cp_size": 1, "vpp_size": 1,
              "microbatch_group_size_per_vp_stage": 1}  # fmt: skip
    parts, mbs, num_mbs, _ = build_dp_schedule(
        args, config, lengths, global_batch_size=global_batch, rollout_indices=data["rollout_ids"]
    )
    seen: list[int] = []
    steps_per_rank = []
    for rank in range(dp_size):
        shard = {k: [data[k][j] for j in parts[rank]] for k in
                 ("tokens", "response_lengths", "rewards", "loss_masks", "rollout_log_probs")}  # fmt: skip
        shard.update(num_microbatches=num_mbs, micro_batch_indices=mbs[rank])
        batches = step_batches(shard, pad_id=0, micro_batch_size=args.micro_batch_size)
        steps_per_rank.append(len(batches))
        for idx, b in zip(step_indices(shard), batches, strict=True):
            assert len(b) % args.micro_batch_size == 0
            for row, i in enumerate(idx):
                s = samples[parts[rank][i]]
                seen.append(s.index)
                p, r = len(s.tokens) - s.response_length, s.response_length
                assert b.tokens[row, : len(s.tokens)].tolist() == s.tokens
                mask = s.loss_mask or [1] * r
                assert b.response_mask[row, p - 1 : p - 1 + r].tolist() == mask
                assert b.response_mask[row].sum() == sum(mask)
                torch.testing.assert_close(
                    b.rollout_logprobs[row, p - 1 : p - 1 + r], torch.tensor(s.rollout_log_probs)
                )
                assert b.advantages[row].item() == pytest.approx(data["rewards"][parts[rank][i]])
            for pad in range(len(idx), len(b)):  # padding rows train nothing
                assert b.response_mask[pad].sum() == 0
    assert sorted(seen) == list(range(16))
    assert steps_per_rank == [16 // global_batch] * dp_size


def test_bad_rollout_data_is_an_error_naming_the_field():
    data = {"tokens": [[1, 2, 3]], "response_lengths": [3], "rewards": [1.0]}
    with pytest.raises(RolloutDataError, match="at least one prompt token"):
        step_batches(data, pad_id=0, micro_batch_size=1)
    data = {"tokens": [[1, 2, 3]], "response_lengths": [2], "rewards": [1.0, 2.0]}
    with pytest.raises(RolloutDataError, match="'rewards' has 2 rows"):
        step_batches(data, pad_id=0, micro_batch_size=1)
    bad = _samples(4)
    bad[1].loss_mask = [1]
    with pytest.raises(ValueError, match="loss_mask has 1 entries"):
        samples_to_train_data(_args("--n-samples-per-prompt", "4"), bad)


def test_command_line_errors_name_the_flag(capsys):
    """What slime's parser would refuse, and what this driver needs, is refused where the
    command line enters (argparse's exit 2, the flag named)."""
    base = ["--num-rollout", "1", "--rollout-batch-size", "4", "--n-samples-per-prompt", "4"]
    for argv, flag in (
        (base, "--custom-rm-path"),
        ([*base, "--custom-rm-path", "m.f", "--global-batch-size", "5"], "--global-batch-size"),
        ([*base, "--custom-rm-path", "m.f", "--rollout-num-gpus", "3",
          "--rollout-num-gpus-per-engine", "2"], "--rollout-num-gpus"),
        ([*base, "--custom-rm-path", "m.f", "--update-weight-transport", "disk"],
         "--update-weight-disk-dir"),
        ([*base, "--custom-rm-path", "m.f", "--not-a-slime-flag", "1"], "--not-a-slime-flag"),
    ):  # fmt: skip
        with pytest.raises(SystemExit) as e:
            parse_args(argv)
        assert e.value.code == 2
        assert flag in capsys.readouterr().err
