"""Placement: ray.init arguments, the --dry-run plan (which actor on which device), impossible
layouts as errors naming the key, and, on a real local Ray, both layouts' placement group."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from titan_core.config import ConfigError, load_config
from titan_rl.config import GRPOConfig, RayConfig
from titan_rl.placement import (
    ENGINE_SHARE,
    TRAINER_SHARE_COLOCATED,
    placement_plan,
    plan_placement,
    rank_coords,
    ray_init_kwargs,
)

REPO = Path(__file__).resolve().parents[2]
QWEN3 = REPO / "examples/math_qwen3.yaml"
MATH = REPO / "examples/math.yaml"


def _cfg(path: Path | None, *overrides: str) -> GRPOConfig:
    return load_config(GRPOConfig, path, list(overrides))


def _gpu_plan(cfg: GRPOConfig, devices: int | None = 8):
    return plan_placement(cfg, "cuda", "GPU", devices)


# ---- ray.init ---------------------------------------------------------------------------------
def test_ray_init_kwargs_local_sizes_the_ray_for_the_plan():
    plan = plan_placement(
        _cfg(MATH, "trainer.num_processes=4", "train.micro_batch_size=64"), "cpu", None, None
    )
    kw = ray_init_kwargs(RayConfig(), plan)
    assert kw["address"] == "local"  # a new local Ray even where RAY_ADDRESS is set
    assert kw["num_cpus"] >= plan.num_bundles == 5 and kw["include_dashboard"] is False
    assert "num_gpus" not in kw
    assert ray_init_kwargs(RayConfig(num_cpus=7), plan)["num_cpus"] == 7
    gpu = ray_init_kwargs(RayConfig(), _gpu_plan(_cfg(QWEN3)))
    assert gpu["num_gpus"] == 8 and gpu["num_cpus"] >= 8  # one CPU per bundle


def test_ray_init_kwargs_for_a_cluster_carry_only_its_address():
    plan = _gpu_plan(_cfg(QWEN3, "ray.address=10.0.0.1:6379", "ray.namespace=titan"), None)
    kw = ray_init_kwargs(RayConfig(address="10.0.0.1:6379", namespace="titan"), plan)
    assert kw == {
        "address": "10.0.0.1:6379",
        "namespace": "titan",
        "log_to_driver": True,
        "configure_logging": False,
    }
    with pytest.raises(ConfigError, match=r"ray\.num_cpus applies to a local Ray only"):
        _cfg(MATH, "ray.address=auto", "ray.num_cpus=4")


# ---- the plan ---------------------------------------------------------------------------------
def test_rank_coords_follow_megatrons_rank_generator():
    from megatron.core.parallel_state import RankGenerator

    world, tp, cp, pp, ep, etp = 16, 2, 1, 2, 2, 1
    dense = RankGenerator(
        tp=tp, ep=1, dp=world // (tp * cp * pp), pp=pp, cp=cp, order="tp-cp-ep-dp-pp"
    )
    expert = RankGenerator(
        tp=etp, ep=ep, dp=world // (etp * ep * pp), pp=pp, cp=1, order="tp-cp-ep-dp-pp"
    )
    coords = [rank_coords(r, world, tp, cp, pp, ep, etp) for r in range(world)]
    for gen, names in (
        (dense, {"tp": "tp", "dp": "dp", "pp": "pp"}),
        (expert, {"tp": "etp", "ep": "ep", "dp": "edp"}),
    ):
        for token, field in names.items():
            for group in gen.get_ranks(token):
                # along a group only this coordinate moves, 0, 1, 2, ... in megatron's order
                assert [getattr(coords[r], field) for r in group] == list(range(len(group)))
                others = [f for f in names.values() if f != field]
                assert len({tuple(getattr(coords[r], f) for f in others) for r in group}) == 1


def test_colocated_plan_names_each_actors_device():
    lines = "\n".join(_gpu_plan(_cfg(QWEN3)).describe())
    assert "8 bundle(s) {'GPU': 1, 'CPU': 1}" in lines and "colocated" in lines
    assert "TP2 x PP1 x CP1 x DP4" in lines
    assert "  rank 0 -> GPU 0: tp 0, pp 0, dp 0" in lines
    assert "  rank 5 -> GPU 5: tp 1, pp 0, dp 2" in lines
    assert "  engine 0 -> GPUs 0..1 (base_gpu_id" in lines and "  engine 3 -> GPUs 6..7" in lines
    assert f"{TRAINER_SHARE_COLOCATED} of one each" in lines
    assert "8 GPU(s) needed, 8 available" in lines


def test_disaggregated_plan_puts_engines_after_the_trainer():
    cfg = _cfg(QWEN3, "engines.colocate=false", "trainer.num_processes=4", "engines.num_engines=2")
    plan = _gpu_plan(cfg)
    assert plan.num_bundles == 8 and plan.dp == 2 and plan.trainer_share == 1.0
    assert [list(plan.engine_slots(i)) for i in range(2)] == [[4, 5], [6, 7]]
    lines = "\n".join(plan.describe())
    assert "disaggregated" in lines and "  engine 1 -> GPUs 6..7" in lines
    assert "  rank 3 -> GPU 3: tp 1, pp 0, dp 1" in lines and "a whole bundle each" in lines


def test_moe_plan_shows_expert_coordinates():
    cfg = _cfg(
        MATH, "trainer.num_processes=4", "model.num_moe_experts=4", "parallel.expert_model_parallel_size=4",
        "train.micro_batch_size=64",
    )  # fmt: skip
    lines = "\n".join(plan_placement(cfg, "cpu", None, None).describe())
    assert "DP4, EP4" in lines and "  rank 2 -> CPU slot 2: tp 0, pp 0, dp 2, ep 2" in lines


def test_dry_run_plan_on_this_machine():
    lines = placement_plan(_cfg(MATH))
    text = "\n".join(lines)
    assert lines[0].startswith("accelerator: ") and "ray: local" in text
    assert "trainer: 1 Megatron process(es)" in text and "engines: 1 x " in text
    assert "  rank 0 -> " in text and "  engine 0 -> " in text


# ---- impossible layouts -----------------------------------------------------------------------
@pytest.mark.parametrize(
    "overrides, needle",
    [
        (["trainer.num_processes=3", "parallel.tensor_model_parallel_size=2"], "trainer.num_processes=3: world size 3 is not divisible by tensor x pipeline"),
        (
            ["trainer.num_processes=2", "parallel.tensor_model_parallel_size=2", "model.num_moe_experts=4",
             "parallel.expert_model_parallel_size=2"],
            "parallel.expert_model_parallel_size",
        ),
        (["parallel.expert_model_parallel_size=2"], "model.num_moe_experts"),
        (["trainer.num_processes=2", "parallel.pipeline_model_parallel_size=2", "model.num_layers=3"], "model.num_layers (3)"),
        (["trainer.num_processes=4"], "rollout.prompts_per_step x n_samples_per_prompt (256)"),
        (["engines.colocate=true", "engines.num_engines=2", "engines.router=true"], "engines.colocate=true: engines.num_engines x engines.tp_size"),
        (["ray.num_cpus=1"], "only 1 are available (ray.num_cpus)"),
    ],
)  # fmt: skip
def test_impossible_layouts_name_the_key(overrides, needle):
    with pytest.raises(
        ConfigError, match=needle.replace(".", r"\.").replace("(", r"\(").replace(")", r"\)")
    ):
        plan_placement(_cfg(MATH, *overrides), "cpu", None, None)


def test_gpu_layouts_beyond_the_devices_name_the_keys():
    with pytest.raises(
        ConfigError, match=r"engines\.num_engines x engines\.tp_size = 8 \+ 4 x 2 = 16 GPU"
    ):
        _gpu_plan(_cfg(QWEN3, "engines.colocate=false"))
    with pytest.raises(ConfigError, match=r"trainer.num_processes=8 needs 8 GPU\(s\), but only 4"):
        _gpu_plan(_cfg(QWEN3), devices=4)
    with pytest.raises(
        ConfigError, match=r"ray\.num_cpus=4: the placement group needs one CPU per bundle"
    ):
        _gpu_plan(_cfg(QWEN3, "ray.num_cpus=4"))
    # an existing cluster's devices are unknown until it is reached: planned, checked at start
    plan = _gpu_plan(_cfg(QWEN3, "engines.colocate=false", "ray.address=auto"), devices=None)
    assert plan.num_bundles == 16 and "checked against the cluster at auto" in "\n".join(
        plan.describe()
    )


def test_dry_run_of_an_impossible_layout_exits_2(capsys):
    from titan_rl.grpo import main

    code = main(["--config", str(MATH), "--dry-run", "trainer.num_processes=3",
                 "parallel.tensor_model_parallel_size=2"])  # fmt: skip
    out, err = capsys.readouterr()
    assert code == 2 and "trainer.num_processes=3" in err, err
    assert out == ""


# ---- on a real local Ray ----------------------------------------------------------------------
@pytest.fixture(scope="module")
def local_ray():
    ray = pytest.importorskip("ray")
    plan = plan_placement(_cfg(MATH), "cpu", None, None)
    ray.init(**{**ray_init_kwargs(RayConfig(num_cpus=2), plan), "log_to_driver": False})
    yield ray
    ray.shutdown()


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory) -> Path:
    from tests.models.hf_cases import build_hf_model

    path = tmp_path_factory.mktemp("llama")
    build_hf_model("llama").save_pretrained(path)
    return path


def _bundle_free(ray, pg, index: int) -> float:
    return ray.available_resources().get(f"CPU_group_{index}_{pg.id.hex()}", 0.0)


@pytest.mark.slow  # a local Ray and a built-in engine: ~25-40 s each on 2 loaded cores
@pytest.mark.parametrize("colocate", [True, False], ids=["colocated", "disaggregated"])
def test_layout_on_a_local_ray(local_ray, hf_model, tmp_path, colocate):
    """The trainer rank and the built-in engine land on their bundles of one placement group;
    rank 0's master address is its node's IP."""
    ray = local_ray
    from titan_rl.actors.config import EngineServerConfig, RolloutEnginesConfig, RouterConfig
    from titan_rl.actors.engine_actor import RolloutEngineGroup
    from titan_rl.placement import reserve
    from titan_rl.trainer.group import TrainerWorker

    plan = plan_placement(
        _cfg(MATH, f"engines.colocate={str(colocate).lower()}"), "cpu", None, None
    )
    placement = reserve(plan)
    engine_bundle = 0 if colocate else 1
    assert len(placement.slots) == plan.num_bundles == (1 if colocate else 2)
    trainer = ray.remote(TrainerWorker).options(**placement.trainer_options(0)).remote({}, 0, 1, 0)
    engines = RolloutEngineGroup.from_config(
        RolloutEnginesConfig(
            server=EngineServerConfig(
                model_path=str(hf_model), backend="builtin", num_threads=1, log_dir=str(tmp_path),
                startup_timeout_s=120,
            ),
            router=RouterConfig(enabled=False),
        ),
        placement.engines(),
    )  # fmt: skip
    try:
        addr, port = ray.get(trainer.master_address.remote())
        assert addr == ray.util.get_node_ip_address() and port > 0
        url = engines.start()
        assert httpx.get(url + "/health", timeout=10).status_code == 200
        if colocate:
            assert _bundle_free(ray, placement.pg, 0) == pytest.approx(
                1 - TRAINER_SHARE_COLOCATED - ENGINE_SHARE
            )
        else:
            assert _bundle_free(ray, placement.pg, 0) == pytest.approx(0.0)
            assert _bundle_free(ray, placement.pg, engine_bundle) == pytest.approx(1 - ENGINE_SHARE)
    finally:
        engines.stop()
        ray.kill(trainer)
        placement.remove()


@pytest.mark.slow
def test_reserve_checks_the_running_ray_before_waiting_on_it(local_ray):
    """A placement group Ray cannot place would wait forever: it is an error naming the keys."""
    from titan_rl.placement import reserve

    plan = plan_placement(
        _cfg(MATH, "trainer.num_processes=4", "train.micro_batch_size=64"), "cpu", None, None
    )
    with pytest.raises(ConfigError, match=r"= 5 CPU slot\(s\).*the Ray cluster has 2 CPU"):
        reserve(plan)


@pytest.mark.slow
def test_joining_an_existing_cluster_by_address(local_ray):
    """ray.address: the job joins that cluster (Ray refuses num_cpus there) and places on it."""
    address = local_ray.get_runtime_context().gcs_address
    script = (
        "import ray\n"
        "from titan_core.config import load_config\n"
        "from titan_rl.config import GRPOConfig\n"
        "from titan_rl.placement import machine_plan, ray_init_kwargs, reserve\n"
        f"cfg = load_config(GRPOConfig, {str(MATH)!r}, ['ray.address={address}'])\n"
        "plan = machine_plan(cfg)\n"
        "ray.init(**ray_init_kwargs(cfg.ray, plan))\n"
        "placement = reserve(plan)\n"
        "print(ray.get_runtime_context().gcs_address, len(placement.slots))\n"
        "placement.remove()\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, cwd=REPO, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == [address, "2"]
