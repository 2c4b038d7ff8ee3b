"""Titan as miles' training backend, against miles' own code on a local Ray (gloo, CPU).

miles' ``Sample`` -> miles' ``postprocess_rollout_data`` / ``convert_samples_to_train_data``
/ ``split_train_data_by_dp`` (its object store) -> ``TitanTrainRayActor.train`` in miles'
``RayTrainGroup`` (DP=2); ``update_weights`` with the ``EnginesAndLock`` of the rollout
manager brings Titan's built-in engine to the new weight version at logprob parity;
``export_hf`` writes a directory transformers loads; a missing miles module is a
``PeerImportError`` naming miles. ``python -m adapters.miles.train`` (miles' loop, synced at
parity every rollout) runs in tests/adapters/test_driver_faults.py and test_miles_scripts.py.
The policy is a tiny random llama (policy.format=hf), so nothing is pretrained.
"""

from __future__ import annotations

import ast
import asyncio
import importlib.util
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("miles.ray.train_actor", reason="miles' wheel (../shared/peers) is needed")

from tests.adapters.engine_probe import engine_logprob, weight_version  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
VOCAB = 300
PROBLEMS = [("12+34=", "46"), ("50+25=", "75")]


def _tiny_llama(path: Path) -> Path:
    """A random ~100k-parameter llama (vocab 300 holds Titan's byte tokenizer's ids)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    LlamaForCausalLM(
        LlamaConfig(
            vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
            eos_token_id=2, bos_token_id=1, pad_token_id=0, tie_word_embeddings=False,
        )
    ).save_pretrained(path)  # fmt: skip
    return path


def _titan_yaml(path: Path, model_dir: Path, run_dir: Path) -> Path:
    """A titan_rl.grpo YAML starting from the HF directory: model section from its config,
    byte tokenizer, arithmetic prompts, sync by shared-memory tensors with a parity check
    on every sync."""
    import yaml

    from titan_core.models.hf.convert import model_config_from_hf

    model = model_config_from_hf(model_dir, seq_length=32, transformer_impl="local")
    cfg = {
        "policy": {"format": "hf", "load": str(model_dir)},
        "model": model.model_dump(mode="json", exclude_defaults=True),
        "train": {
            "micro_batch_size": 2, "lr": 3.0e-3, "min_lr": 3.0e-3, "lr_warmup_iters": 0,
            "lr_decay_style": "constant", "weight_decay": 0.0, "clip_grad": 1.0,
        },
        "rollout": {"prompts_per_step": 2, "n_samples_per_prompt": 4, "max_response_len": 4},
        "algo": {"advantage_estimator": "grpo"},
        "sync": {"transport": "tensor", "check_every": 1},
        "engines": {"num_threads": 1},
        "data": {"type": "arithmetic", "num_digits": 2, "num_eval": 8},
        "run": {"dir": str(run_dir)},
    }  # fmt: skip
    path.write_text(yaml.safe_dump(cfg))
    return path


class _NoMiles:
    """A meta-path finder hiding the miles package, as on a machine without it."""

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> None:
        if name == "miles" or name.startswith("miles."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None


def test_missing_miles_is_a_peer_import_error(monkeypatch: pytest.MonkeyPatch) -> None:
    from adapters.peers import PeerImportError, import_peer

    # miles installed, one of its modules gone
    monkeypatch.setitem(sys.modules, "miles.ray.train_actor", None)
    with pytest.raises(PeerImportError, match=r"miles is installed but has no module"):
        import_peer("miles.ray.train_actor")
    monkeypatch.delitem(sys.modules, "miles.ray.train_actor")
    # miles not installed at all: the adapter's own import says so, naming miles (the
    # modules dropped here are put back by monkeypatch)
    for name in [
        m for m in sys.modules if m == "miles" or m.startswith(("miles.", "adapters.miles."))
    ]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setattr(sys, "meta_path", [_NoMiles(), *sys.meta_path])
    with pytest.raises(PeerImportError, match=r"the miles package is not installed.*miles-\*\.whl"):
        importlib.import_module("adapters.miles.actor")


def test_sglang_importing_miles_modules_name_sglang() -> None:
    """The modules the adapter replaces do need sglang (on a machine without it)."""
    if importlib.util.find_spec("sglang") is not None:
        pytest.skip("sglang is installed here: miles' own modules import")
    from adapters.peers import PeerImportError, import_peer

    for module in ("miles.utils.data", "miles.ray.rollout.rollout_manager"):
        with pytest.raises(PeerImportError, match=r"needs the package 'sglang'"):
            import_peer(module)


def test_engines_and_lock_has_miles_fields() -> None:
    """Without sglang, ``engines_and_lock`` answers a namespace: its fields are those of
    miles' own ``EnginesAndLock`` dataclass, read from miles' source."""
    from adapters.miles.rollout import ENGINES_AND_LOCK_FIELDS, engines_and_lock

    spec = importlib.util.find_spec("miles.ray.rollout.rollout_manager")
    tree = ast.parse(Path(spec.origin).read_text())
    (cls,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "EnginesAndLock"]
    fields = tuple(n.target.id for n in cls.body if isinstance(n, ast.AnnAssign))
    assert fields == ENGINES_AND_LOCK_FIELDS
    info = engines_and_lock(["e"], "lock", True, [1], [0])
    assert {f: getattr(info, f) for f in fields} == {
        "rollout_engines": ["e"], "rollout_engine_lock": "lock", "has_new_engines": True,
        "engine_gpu_counts": [1], "engine_gpu_offsets": [0],
    }  # fmt: skip


# ---- miles' group of Titan ranks ---------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _tiny_llama(tmp_path_factory.mktemp("miles-tiny-llama"))


@pytest.fixture(scope="module")
def engine(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    from titan_rl.actors.config import EngineServerConfig
    from titan_rl.actors.server import ServerProcess

    server = ServerProcess(
        EngineServerConfig(
            model_path=str(tiny_model), backend="builtin", num_threads=1,
            skip_tokenizer_init=True, weight_version="0", startup_timeout_s=120,
            log_dir=str(tmp_path_factory.mktemp("miles-engine-logs")),
        ),
        name="miles-engine",
    )  # fmt: skip
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def miles_job(
    tiny_model: Path, engine: Any, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Any, Any, Any, list[Any]]]:
    """The driver's set-up with the engine above as miles' external engine: placement
    groups, a TitanRolloutManager, miles' RayTrainGroup of two Titan ranks (DP=2)."""
    import ray
    from miles.utils import object_store

    from adapters.common.driver import prepare, ray_init
    from adapters.miles.arguments import parse_args
    from adapters.miles.rollout import TitanRolloutManager
    from adapters.miles.train import build_trainer_group, create_placement_groups

    tmp = tmp_path_factory.mktemp("miles-job")
    host_port = engine.url.removeprefix("http://")
    args = parse_args([
        "--titan-config", str(_titan_yaml(tmp / "titan.yaml", tiny_model, tmp / "run")),
        "--actor-num-gpus-per-node", "2", "--rollout-num-gpus", "1",
        "--rollout-external", "--rollout-external-engine-addrs", host_port,
        "--num-rollout", "1", "--rollout-batch-size", "2", "--n-samples-per-prompt", "4",
        "--micro-batch-size", "2", "--save", str(tmp / "ckpt"), "--hf-checkpoint", str(tiny_model),
        "--custom-rm-path", "adapters.slime.rewards.exact_match",
    ])  # fmt: skip
    prepare(args)
    env = pytest.MonkeyPatch()  # ray_init exports the run's TITAN_CONFIG: undone at the end
    env.setenv("TITAN_CONFIG", args.titan_config)
    env.setenv("SLIME_ACCELERATOR", "titan")
    ray_init(args)
    try:
        object_store.get_instance()
    except AssertionError:  # miles' driver makes the instance once per process
        object_store.init_instance(args, contribute_segment=False)
    manager = actors = None
    try:
        pgs = create_placement_groups(args)
        manager = ray.remote(TitanRolloutManager).remote(args, pgs["rollout"])
        group, actors = asyncio.run(build_trainer_group(args, pgs, manager))
        ray.get(manager.start_engines.remote(args.hf_checkpoint))
        yield args, manager, group, actors
    finally:
        if actors:
            ray.get([a.shutdown.remote() for a in actors])
        if manager is not None:
            ray.get(manager.dispose.remote())
        ray.shutdown()
        env.undo()


def _samples(tok: Any) -> list[list[Any]]:
    """Two prompt groups of four miles Samples each; the right answer rewarded."""
    from miles.utils.types import Sample

    groups = []
    for g, (prompt, answer) in enumerate(PROBLEMS):
        group = []
        for j, resp in enumerate([answer, "9", answer[::-1] + "0", "0"]):
            s = Sample(group_index=g, index=4 * g + j, prompt=prompt, label=answer)
            p_ids, r_ids = tok.encode(prompt), tok.encode(resp + "\n")
            s.tokens, s.response, s.response_length = p_ids + r_ids, resp, len(r_ids)
            s.reward = 1.0 if resp == answer else 0.0
            s.status = Sample.Status.COMPLETED
            group.append(s)
        groups.append(group)
    return groups


def test_train_sync_and_export_under_miles_group(
    miles_job: tuple[Any, Any, Any, list[Any]], engine: Any, tmp_path: Path
) -> None:
    import ray
    from miles.ray.rollout.rollout_data_conversion import postprocess_rollout_data
    from miles.ray.rollout.train_data_conversion import (
        convert_samples_to_train_data,
        split_train_data_by_dp,
    )
    from miles.utils import object_store
    from miles.utils.hf_config import is_complete_hf_export

    from titan_core.data.tokenizer import build_tokenizer

    args, manager, group, actors = miles_job
    config = ray.get(manager.get_train_parallel_config.remote())
    assert config == {
        "dp_size": 2,
        "cp_size": 1,
        "vpp_size": 1,
        "microbatch_group_size_per_vp_stage": 1,
    }

    # miles' first step: the engines get the trainer's weights (version 1) through the
    # rollout manager's EnginesAndLock; the sync checks engine-vs-trainer parity
    info = ray.get(manager.get_updatable_engines_and_lock.remote())
    assert info.has_new_engines and info.engine_gpu_counts == [1]
    asyncio.run(group.update_weights())
    synced = ray.get(actors[0].get_metrics.remote())
    assert synced["sync/logprob_abs_diff_max"] < 1e-4, synced
    assert weight_version(engine.url) == "1"
    assert ray.get(manager.get_updatable_engines_and_lock.remote()).has_new_engines is False

    tok = build_tokenizer("byte")
    right = (tok.encode(PROBLEMS[0][0]), tok.encode(PROBLEMS[0][1] + "\n"))
    wrong = (tok.encode(PROBLEMS[0][0]), tok.encode("9\n"))
    before = (engine_logprob(engine.url, *right), engine_logprob(engine.url, *wrong))
    for rollout_id in range(3):
        data, metadata = postprocess_rollout_data(args, _samples(tok), train_parallel_config=config)
        train_data = convert_samples_to_train_data(args, data, metadata, None, None)
        refs = split_train_data_by_dp(args, train_data, config)
        assert len(refs) == 2
        if rollout_id == 0:  # miles scheduled the micro-batches on the rollout side
            shard = object_store.get_instance().get(refs[0]).value
            assert shard["num_microbatches"] == [2] and len(shard["micro_batch_indices"]) == 2
        outcomes = asyncio.run(group.train(rollout_id, {"data_ref": refs}))
        assert [str(o) for o in outcomes] == ["normal", "normal"]
        metrics = ray.get([a.get_metrics.remote() for a in actors])
        assert all(m["train/steps"] == 1.0 and m["rollout_id"] == rollout_id for m in metrics)
        asyncio.run(group.update_weights(rollout_id=rollout_id))
    synced = ray.get(actors[0].get_metrics.remote())
    assert synced["sync/logprob_abs_diff_max"] < 1e-4, synced
    assert weight_version(engine.url) == "4"  # 1 + three updates
    assert ray.get(manager.get_weight_version.remote()) == 4
    after = (engine_logprob(engine.url, *right), engine_logprob(engine.url, *wrong))
    assert after[0] > before[0] + 0.05, (before, after)  # the rewarded answer got likelier
    assert after[1] < before[1], (before, after)

    # export_hf through miles' group: a directory transformers loads, scoring like the engine
    out = tmp_path / "hf_export"
    asyncio.run(group.export_hf(3, str(out)))
    assert is_complete_hf_export(out)
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(out).float().eval()
    ids = torch.tensor([right[0] + right[1]])
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits[0, :-1].double(), -1)
    hf = float(logp[torch.arange(ids.shape[1] - 1), ids[0, 1:]][-len(right[1]) :].sum())
    assert abs(hf - after[0]) < 1e-4, (hf, after[0])


def test_delayed_split_and_local_schedule(miles_job: tuple[Any, Any, Any, list[Any]]) -> None:
    """--delay-split-train-data-by-dp: one store ref of the whole rollout, split on the train
    side by miles' split_train_data_by_dp_raw; the schedule then made as miles' Megatron
    iterator makes it (global batch over DP ranks, micro-batches of --micro-batch-size)."""
    import copy

    from miles.ray.rollout.rollout_data_conversion import postprocess_rollout_data
    from miles.ray.rollout.train_data_conversion import convert_samples_to_train_data
    from miles.utils import object_store

    from adapters.miles.train_data import rank_rollout_data, with_step_schedule
    from titan_core.data.tokenizer import build_tokenizer

    args = copy.deepcopy(miles_job[0])
    args.delay_split_train_data_by_dp = True
    args.global_batch_size = 4  # two optimizer steps per rollout
    data, metadata = postprocess_rollout_data(args, _samples(build_tokenizer("byte")), None)
    whole = convert_samples_to_train_data(args, data, metadata, None, None)
    ref = object_store.get_instance().put(value=whole)
    shards = []
    for rank in range(2):
        shard, got = rank_rollout_data(args, ref, rank, 2)
        with got:
            shards.append(with_step_schedule(args, shard, 2))
    assert sorted(i for s in shards for i in s["sample_indices"]) == list(range(8))
    for s in shards:  # 4 samples a rank: 2 steps of 2, one micro-batch of 2 each
        assert s["num_microbatches"] == [1, 1] and s["micro_batch_indices"] == [[0, 1], [2, 3]]
        assert len(s["total_lengths"]) == 4  # miles' shard completion ran
