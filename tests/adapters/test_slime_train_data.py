"""slime's Samples -> train data (reward normalization, loss masks, every field slime emits)
-> slime's own DP / micro-batch schedule -> Titan batches, one per optimizer step, with every
sample trained once, on the right tokens, by the right DP rank.

The oracle is slime's own code: ``RolloutManager._post_process_rewards``,
``_convert_samples_to_train_data`` and ``_split_train_data_by_dp`` (and the hook loading of
its ``__init__``) are read from the installed ``slime/ray/rollout.py`` with ``ast`` (the
module imports ``sglang`` at the top, so it cannot be imported here), compiled into a
namespace holding only the names they reference (slime's real functions where those import),
and run on deep copies of the same ``Sample``s as ``adapters.slime.train_data``."""

from __future__ import annotations

import argparse
import ast
import builtins
import copy
import importlib.util
import math
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

pytest.importorskip("slime.utils.dp_schedule", reason="slime's wheel (../shared/peers) is needed")

from slime.observability.rollout_data_utils import (  # noqa: E402
    tensorize_rollout_data_for_training,
    validate_rollout_routed_experts_for_replay,
)
from slime.utils.data import get_source, process_rollout_data  # noqa: E402
from slime.utils.dp_schedule import build_dp_schedule  # noqa: E402
from slime.utils.misc import Box, load_function  # noqa: E402
from slime.utils.types import Sample  # noqa: E402

from adapters.common.rollout_data import RolloutDataError, step_batches, step_indices  # noqa: E402
from adapters.slime.arguments import parse_args  # noqa: E402
from adapters.slime.train_data import samples_to_train_data, split_by_dp  # noqa: E402

# --------------------------------------------------------------------------- slime's oracle

_METHODS = ("_post_process_rewards", "_convert_samples_to_train_data", "_split_train_data_by_dp")
_HOOKS = ("custom_reward_post_process", "custom_convert_samples_to_train_data")


def _fake_put(value: Any, **kwargs: Any) -> tuple[Any, dict[str, Any]]:
    """``ray.put`` without a cluster: the ref is the value (and how it was sent)."""
    return value, kwargs


def _fake_get(ref: tuple[Any, dict[str, Any]]) -> Any:
    return ref[0]


#: every global name slime's methods read, from where slime's module takes it
_NAMESPACE: dict[str, Any] = {
    "torch": torch,
    "Sample": Sample,
    "load_function": load_function,
    "get_source": get_source,
    "validate_rollout_routed_experts_for_replay": validate_rollout_routed_experts_for_replay,
    "build_dp_schedule": build_dp_schedule,
    "tensorize_rollout_data_for_training": tensorize_rollout_data_for_training,
    "Box": Box,
    "ray": SimpleNamespace(put=_fake_put),
}


def _free_names(nodes: list[ast.AST]) -> set[str]:
    """Names the code reads that it neither binds nor gets from builtins."""
    loaded, bound = set(), set()
    for node in nodes:
        for n in ast.walk(node):
            if isinstance(n, ast.Name):
                (loaded if isinstance(n.ctx, ast.Load) else bound).add(n.id)
            elif isinstance(n, ast.arg):
                bound.add(n.arg)
    return loaded - bound - set(dir(builtins))


def _slime_manager() -> type:
    """slime's ``RolloutManager`` with its three conversion methods and an ``__init__`` made
    of ``self.args = args`` plus slime's own ``__init__`` statements that load the hooks."""
    spec = importlib.util.find_spec("slime")
    assert spec is not None and spec.submodule_search_locations
    path = Path(spec.submodule_search_locations[0]) / "ray" / "rollout.py"
    tree = ast.parse(path.read_text(), filename=str(path))
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "RolloutManager")
    methods = {n.name: n for n in cls.body if isinstance(n, ast.FunctionDef)}
    hook_lines = [
        st for st in methods["__init__"].body if any(h in ast.unparse(st) for h in _HOOKS)
    ]
    assert len(hook_lines) == 4, [ast.unparse(s) for s in hook_lines]  # two `= None`, two `if`
    init = ast.parse("def __init__(self, args):\n    self.args = args\n").body[0]
    assert isinstance(init, ast.FunctionDef)
    init.body += hook_lines
    body = [init, *(methods[m] for m in _METHODS)]
    free = _free_names(body)
    assert free == _NAMESPACE.keys(), f"slime's methods read {sorted(free)}: fix the namespace"
    cls.body, cls.decorator_list = body, []  # no @ray.remote
    module = ast.fix_missing_locations(ast.Module(body=[cls], type_ignores=[]))
    ns = dict(_NAMESPACE)
    exec(compile(module, str(path), "exec"), ns)
    return ns["RolloutManager"]


SlimeManager = _slime_manager()

# --------------------------------------------------------------------------- set-up


def _args(*extra: str, **attrs: Any) -> argparse.Namespace:
    """The driver's args for ``extra`` flags; ``attrs`` set what the command line does not
    (Megatron's model shape, estimators the Titan driver refuses at start-up)."""
    args = parse_args(["--num-rollout", "1", "--rollout-batch-size", "4",
                       "--n-samples-per-prompt", "4",
                       "--custom-rm-path", "adapters.slime.rewards.exact_match", *extra])  # fmt: skip
    args.micro_batch_size = 2
    for key, value in attrs.items():
        setattr(args, key, value)
    return args


def _samples(n: int = 16, seed: int = 0, **features: bool) -> list[Sample]:
    """``n`` samples, 4 per group, of random lengths and rewards; ``features`` add what
    richer rollouts carry (routed experts, train / rollout metadata, top-p tokens, ...)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        p, r = 3 + i % 3, 2 + i % 4
        s = Sample(group_index=i // 4, index=i, prompt="x", label="y")
        s.tokens = torch.randint(1, 200, (p + r,), generator=g).tolist()
        s.response_length = r
        s.reward = float(torch.rand((), generator=g))
        s.rollout_log_probs = (-torch.rand(r, generator=g)).tolist()
        s.status = Sample.Status.TRUNCATED if i % 7 == 3 else Sample.Status.COMPLETED
        if i % 5 == 0:  # a multi-turn style mask: a tool output in the middle is not trained
            s.loss_mask = [1] + [0] * (r - 2) + [1]
        if features.get("rich"):
            s.rollout_routed_experts = torch.randint(1, 8, (p + r - 1, 2, 2), generator=g)
            s.train_metadata = {"loss": "pg", "turn": i % 2}
            s.metadata = {"source_name": f"src{i % 2}", "round_number": i // 8}
            if i % 3 == 0:
                s.metadata["raw_reward"] = 10.0 + i
            s.teacher_log_probs = (-torch.rand(r, generator=g)).tolist()
            if i % 4 == 1:  # only some samples have images
                s.multimodal_train_inputs = {"pixel_values": torch.rand(2, 3, generator=g)}
            s.rollout_id = 100 + i // 2  # compact: two training samples per rollout
            s.remove_sample = i == 6
        if features.get("top_p"):
            counts = torch.randint(1, 4, (r,), generator=g)
            s.rollout_top_p_token_offsets = [0, *torch.cumsum(counts, 0).tolist()]
            s.rollout_top_p_token_ids = torch.randint(
                0, 200, (int(counts.sum()),), generator=g, dtype=torch.int32
            )
        if features.get("plain"):
            s.rollout_log_probs = None
            s.metadata = None
        out.append(s)
    return out


def _drop(samples: list[Sample], i: int) -> list[Sample]:
    return samples[:i] + samples[i + 1 :]


def _same(a: Any, b: Any, where: str = "data") -> None:
    """``a == b`` recursively: the same types, dict keys in the same order, tensors of the
    same dtype and values, floats bit for bit (NaN equal to NaN)."""
    assert type(a) is type(b), f"{where}: {type(a).__name__} vs {type(b).__name__}"
    if isinstance(a, dict):
        assert list(a) == list(b), f"{where}: keys {list(a)} vs {list(b)}"
        for k in a:
            _same(a[k], b[k], f"{where}[{k!r}]")
    elif isinstance(a, list | tuple):
        assert len(a) == len(b), f"{where}: length {len(a)} vs {len(b)}"
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _same(x, y, f"{where}[{i}]")
    elif isinstance(a, torch.Tensor):
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True, msg=where)
    elif isinstance(a, float):
        assert a == b or (math.isnan(a) and math.isnan(b)), f"{where}: {a!r} vs {b!r}"
    else:
        assert a == b, f"{where}: {a!r} vs {b!r}"


def _both(args: argparse.Namespace, samples: list[Sample]) -> tuple[dict, dict]:
    """(Titan's train data, slime's) of copies of ``samples``; the samples as each left them
    (slime sets their loss masks) compared too."""
    ours, theirs = copy.deepcopy(samples), copy.deepcopy(samples)
    titan = samples_to_train_data(args, ours)
    slime = SlimeManager(args)._convert_samples_to_train_data(theirs)
    _same([s.loss_mask for s in ours], [s.loss_mask for s in theirs], "sample.loss_mask")
    return titan, slime


# --------------------------------------------------------------------------- hooks (by path)

CALLS: list[tuple[str, Any, int]] = []


def clipped_rewards(args: Any, samples: list[Sample]) -> tuple[list[float], list[float]]:
    """A ``--custom-reward-post-process-path`` hook."""
    CALLS.append(("post", args, len(samples)))
    raw = [s.get_reward_value(args) for s in samples]
    return raw, [max(-0.25, min(0.25, r - 0.5)) for r in raw]


def tokens_and_lengths(args: Any, samples: list[Sample]) -> dict[str, Any]:
    """A ``--custom-convert-samples-to-train-data-path`` hook."""
    CALLS.append(("convert", args, len(samples)))
    return {
        "tokens": [s.tokens for s in samples],
        "response_lengths": [s.response_length for s in samples],
        "rewards": [float(s.response_length) for s in samples],
        "rollout_ids": [s.index for s in samples],
    }


def _dict_rewards(samples: list[Sample]) -> list[Sample]:
    for s in samples:
        s.reward = {"acc": s.reward, "fmt": 1.0 - s.reward}
    return samples


def _equal_rewards(samples: list[Sample], groups: int | None = None) -> list[Sample]:
    for s in samples:
        if groups is None or s.group_index < groups:
            s.reward = 1.0
    return samples


def _int_rewards(samples: list[Sample]) -> list[Sample]:
    for s in samples:
        s.reward = int(s.reward > 0.5)
    return samples


HOOK = __name__
#: case -> (CLI flags, args attributes, samples)
CASES: dict[str, tuple[tuple[str, ...], dict[str, Any], Callable[[], list[Sample]]]] = {
    "full_batch": ((), {}, _samples),
    "dropped_group": ((), {}, lambda: _samples(12)),
    "dropped_sample": (("--rollout-batch-size", "3"), {}, lambda: _drop(_samples(12), 5)),
    "dropped_sample_no_std": (
        ("--rollout-batch-size", "3", "--disable-grpo-std-normalization"),
        {},
        lambda: _drop(_samples(12), 5),
    ),
    "dropped_sample_gspo": (
        ("--rollout-batch-size", "3", "--advantage-estimator", "gspo"),
        {},
        lambda: _drop(_samples(12), 0),
    ),
    "more_samples_than_batch": (("--rollout-batch-size", "3"), {}, _samples),
    "group_of_one": (("--n-samples-per-prompt", "1"), {}, lambda: _samples(4)),
    "single_sample": ((), {}, lambda: _samples(1)),
    "all_equal_rewards": ((), {}, lambda: _equal_rewards(_samples())),
    "one_group_all_equal": ((), {}, lambda: _equal_rewards(_samples(), groups=1)),
    "int_rewards": ((), {}, lambda: _int_rewards(_samples())),
    "int_rewards_unnormalized": (
        ("--disable-rewards-normalization",),
        {},
        lambda: _int_rewards(_samples()),
    ),
    "disable_rewards_normalization": (("--disable-rewards-normalization",), {}, _samples),
    "disable_grpo_std_normalization": (("--disable-grpo-std-normalization",), {}, _samples),
    # estimators the Titan driver refuses at start-up, converted as slime converts them
    "cispo": ((), {"advantage_estimator": "cispo"}, _samples),
    "reinforce_plus_plus_baseline": (
        (),
        {"advantage_estimator": "reinforce_plus_plus_baseline"},
        _samples,
    ),
    "reinforce_plus_plus": ((), {"advantage_estimator": "reinforce_plus_plus"}, _samples),
    "reward_key": (("--reward-key", "acc"), {}, lambda: _dict_rewards(_samples())),
    "reward_key_dropped": (
        ("--rollout-batch-size", "3", "--reward-key", "fmt"),
        {},
        lambda: _dict_rewards(_drop(_samples(12), 11)),
    ),
    "custom_reward_post_process": (
        ("--custom-reward-post-process-path", f"{HOOK}.clipped_rewards"),
        {},
        _samples,
    ),
    "custom_convert": (
        ("--custom-convert-samples-to-train-data-path", f"{HOOK}.tokens_and_lengths"),
        {},
        _samples,
    ),
    "both_hooks": (
        (
            "--custom-reward-post-process-path",
            f"{HOOK}.clipped_rewards",
            "--custom-convert-samples-to-train-data-path",
            f"{HOOK}.tokens_and_lengths",
        ),
        {},
        _samples,
    ),
    "routed_experts_metadata": ((), {}, lambda: _samples(rich=True)),
    "routed_experts_replay": (
        ("--use-rollout-routing-replay",),
        {"num_layers": 2, "moe_router_topk": 2},
        lambda: _samples(rich=True),
    ),
    "rich_dropped_reward_key": (
        ("--rollout-batch-size", "3", "--reward-key", "acc"),
        {},
        lambda: _dict_rewards(_drop(_samples(12, rich=True), 2)),
    ),
    "top_p": (("--rollout-top-p", "0.9"), {}, lambda: _samples(top_p=True)),
    "no_log_probs_no_metadata": ((), {}, lambda: _samples(plain=True)),
}


#: the hooks a case calls (a custom convert replaces the reward post-processing too)
HOOK_CALLS = {
    "custom_reward_post_process": ["post"],
    "custom_convert": ["convert"],
    "both_hooks": ["convert"],
}


@pytest.mark.parametrize("case", list(CASES))
def test_train_data_is_slimes(case):
    """Titan's train data is slime's, key for key, value for value, on the same samples."""
    flags, attrs, make = CASES[case]
    args = _args(*flags, **attrs)
    CALLS.clear()
    titan, slime = _both(args, make())
    _same(titan, slime)
    # each hook is called once per conversion, Titan's then slime's, with the args given
    assert [c[0] for c in CALLS] == HOOK_CALLS.get(case, []) * 2
    assert all(a is args for _, a, _ in CALLS)


def test_short_batch_normalizes_over_the_whole_batch():
    """12 samples where 4 x 4 are expected (a group filtered out): slime normalizes the 12 as
    one group (6 rewarded of 12: +-0.957), not per group of 4 (1 of 4: 1.5, -0.5)."""
    samples = _samples(12)
    for s, r in zip(samples, [1, 0, 0, 0] + [1, 1, 1, 0] + [1, 1, 0, 0], strict=True):
        s.reward = float(r)
    titan, slime = _both(_args(), samples)
    _same(titan, slime)
    assert titan["rewards"][:2] == [pytest.approx(0.957, abs=1e-3), pytest.approx(-0.957, abs=1e-3)]


def test_rich_samples_carry_every_field():
    """What slime emits for samples with routed experts, metadata, top-p tokens, images."""
    titan, _ = _both(_args("--rollout-top-p", "0.5"), _samples(rich=True, top_p=True))
    for key in (
        "rollout_routed_experts",
        "metadata",
        "round_number",
        "multimodal_train_inputs",
        "teacher_log_probs",
        "source_names",
        "rollout_top_p_token_ids",
        "rollout_top_p_token_offsets",
        "rollout_log_probs",
    ):
        assert key in titan, key
    assert titan["raw_reward"][0] == 10.0  # metadata's raw_reward wins
    assert titan["loss_masks"][6] == [0] * 4  # remove_sample trains nothing
    assert titan["rollout_ids"][:4] == [100, 100, 101, 101]


@pytest.mark.parametrize("case", ["loss_mask", "top_p_missing", "top_p_offsets", "replay_shape"])
def test_bad_samples_are_refused_as_slime_refuses_them(case):
    args = _args()
    samples = _samples(rich=case == "replay_shape", top_p=case.startswith("top_p"))
    if case == "loss_mask":
        samples[1].loss_mask = [1]
    elif case == "top_p_missing":
        args.rollout_top_p = 0.9
        samples[3].rollout_top_p_token_ids = None
    elif case == "top_p_offsets":
        args.rollout_top_p = 0.9
        samples[2].rollout_top_p_token_offsets = samples[2].rollout_top_p_token_offsets[:-1]
    else:
        args.use_rollout_routing_replay, args.num_layers, args.moe_router_topk = True, 3, 2
    with pytest.raises(ValueError):
        samples_to_train_data(args, copy.deepcopy(samples))
    with pytest.raises((AssertionError, ValueError)):
        SlimeManager(args)._convert_samples_to_train_data(copy.deepcopy(samples))


@pytest.mark.parametrize(
    "case,dp_size,global_batch,transport",
    [
        ("full_batch", 1, 16, "object-store"),
        ("full_batch", 2, 8, "object-store"),
        ("routed_experts_metadata", 2, 4, "object-store"),
        ("top_p", 2, 16, "nixl"),
        ("dropped_sample", 1, 4, "object-store"),
    ],
)
def test_dp_split_is_slimes_and_trains(monkeypatch, case, dp_size, global_batch, transport):
    """Titan's per-rank Boxes are slime's; slime's ``process_rollout_data`` reads them and
    Titan's ``step_batches`` trains each sample once."""
    import ray

    monkeypatch.setattr(ray, "put", _fake_put)
    monkeypatch.setattr(ray, "get", _fake_get)
    flags, attrs, make = CASES[case]
    args = _args(*flags, "--global-batch-size", str(global_batch),
                 "--rollout-data-transport", transport, **attrs)  # fmt: skip
    config = {
        "dp_size": dp_size,
        "cp_size": 1,
        "vpp_size": 1,
        "microbatch_group_size_per_vp_stage": 1,
    }
    titan_data, slime_data = _both(args, make())
    refs = split_by_dp(args, titan_data, config)
    manager = SlimeManager(args)
    manager.train_parallel_config = config
    want = manager._split_train_data_by_dp(slime_data)
    _same([r.inner for r in refs], [w.inner for w in want], "boxes")
    _same(titan_data, slime_data)  # both gained total_lengths
    seen = []
    for rank in range(dp_size):
        shard = process_rollout_data(args, refs, rank, dp_size)
        for idx, b in zip(
            step_indices(shard), step_batches(shard, pad_id=0, micro_batch_size=2), strict=True
        ):
            assert len(b) % 2 == 0
            seen += [int(shard["sample_indices"][i]) for i in idx]
    # slime's schedule keeps whole global batches of rollouts (11 samples, 4 a step: 8)
    kept = [titan_data["sample_indices"][j] for r in refs for j in r.inner[0]["partition"]]
    assert len(kept) == len(titan_data["tokens"]) // global_batch * global_batch
    assert sorted(seen) == sorted(kept)


# --------------------------------------------------------------------------- Titan batches


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
