"""One value, one place (issue 17, configuration): the engines' launch resolved once in the
placement plan into a frozen spec; the sync's settings one section per transport; the RL
data keys shared with pretraining; ``pretrain_view`` checking its world size; and everything
a user can get wrong refused before anything starts, the custom reward imported once."""

from __future__ import annotations

import re
import sys
import types
from pathlib import Path

import pytest
from pydantic import ValidationError

from titan_core.config import ConfigError, load_config
from titan_core.config.pretrain import DataConfig, PretrainConfig, TrainFields
from titan_rl.actors.config import (
    EngineLaunch,
    EngineServerConfig,
    MooncakeAgentLaunch,
    RolloutEnginesConfig,
)
from titan_rl.actors.server import build_command
from titan_rl.config import MOVED_TRAIN_KEYS, GRPOConfig, RLDataConfig, RLTrainConfig
from titan_rl.grpo import main
from titan_rl.placement import EnginePlacement, Placement, Slot, plan_placement
from titan_rl.preflight import check_machine, check_reward
from titan_rl.sync.config import SyncConfig
from titan_rl.sync.transports.disk import DiskSync

REPO = Path(__file__).resolve().parents[2]
MATH = REPO / "examples" / "math.yaml"
QWEN3 = REPO / "examples" / "math_qwen3.yaml"


def _cfg(*overrides: str, path: Path = MATH) -> GRPOConfig:
    return load_config(GRPOConfig, path, list(overrides))


# ---- the engines' launch --------------------------------------------------------------------
def test_the_plan_resolves_each_engines_launch_once(tmp_path):
    cfg = _cfg(f"run.dir={tmp_path}", "engines.num_threads=3", "engines.api_key=k")
    plan = plan_placement(cfg, "cpu", None, None)
    launch = plan.engine
    assert isinstance(launch, EngineLaunch)
    assert (launch.backend, launch.device, launch.tp_size, launch.num_threads) == (
        "builtin", "cpu", 1, 3,
    )  # fmt: skip
    assert launch.model_path == str(tmp_path / "hf_start")
    assert launch.log_dir == str(tmp_path / "logs") and not launch.skip_tokenizer_init
    with pytest.raises(ValidationError, match="frozen"):
        launch.num_threads = 4  # type: ignore[misc]
    # the one value travels YAML -> EnginesConfig -> the launch -> argv
    argv = build_command(launch, 31000)
    assert argv[argv.index("--num-threads") + 1] == "3" and "k" in argv
    gpu = plan_placement(_cfg(path=QWEN3), "cuda", "GPU", 8).engine
    assert gpu is not None and (gpu.backend, gpu.device, gpu.tp_size) == ("sglang", "cuda", 2)
    assert gpu.enable_memory_saver and gpu.mem_fraction_static == 0.7


def test_placement_gives_each_engine_its_device_and_start_weights():
    cfg = _cfg("engines.colocate=false", "trainer.num_processes=4", "engines.num_engines=2",
               path=QWEN3)  # fmt: skip
    plan = plan_placement(cfg, "cuda", "GPU", 8)
    slots = [Slot(i, "10.0.0.1", device=i) for i in range(8)]
    placement = Placement(plan, None, slots)
    placed = placement.engine_launches(weight_version="7")
    assert [p.launch.base_gpu_id for p in placed] == [4, 6]
    assert {p.launch.weight_version for p in placed} == {"7"}
    assert all(p.actor_options and "scheduling_strategy" in p.actor_options for p in placed)
    assert placed[0].launch.model_copy(update={"base_gpu_id": 6}) == placed[1].launch


def test_a_hand_started_group_resolves_on_the_driver():
    from titan_rl.actors.engine_actor import RolloutEngineGroup

    cfg = load_config(
        RolloutEnginesConfig,
        None,
        ["num_engines=2", "server.model_path=/m", "server.num_threads=2"],
    )
    where = [EnginePlacement({"num_cpus": 0.2}, base_gpu_id=b, bind_node_ip=True) for b in (0, 3)]
    group = RolloutEngineGroup.from_config(cfg, where)
    launches = [p.launch for p in group.engines]
    assert [la.base_gpu_id for la in launches] == [0, 3]
    assert all(la.bind_node_ip and la.num_threads == 2 for la in launches)
    assert group.router_cfg is not None  # two engines: behind the router


@pytest.mark.parametrize(
    "make, needle",
    [
        (lambda: EngineServerConfig(model_path="m", backend="sglang").launch("cpu"),
         "backend=sglang: SGLang needs a cuda or musa accelerator"),
    ],
)  # fmt: skip
def test_the_engine_rules_read_the_same_wherever_they_are_checked(make, needle):
    with pytest.raises(ValueError, match=needle):
        make()


def test_auto_tp2_resolves_to_sglang_off_cpu():
    launch = EngineServerConfig(model_path="m", tp_size=2).launch("musa")
    assert (launch.backend, launch.device) == ("sglang", "musa")


def test_sglang_on_this_cpu_machine_is_refused_before_anything_starts(capsys, tmp_path):
    from titan_core.accelerator import get_accelerator

    if get_accelerator().name != "cpu":
        pytest.skip("the rule is about a cpu accelerator")
    args = ["--config", str(MATH), "engines.backend=sglang", f"run.dir={tmp_path / 'run'}"]
    assert main([*args, "--dry-run"]) == 0  # the plan of a GPU machine's job
    assert "needs a GPU machine" in capsys.readouterr().out
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "engines.backend=sglang: SGLang needs a cuda or musa accelerator" in err
    assert not (tmp_path / "run").exists()  # nothing started


# ---- the sync: one section per transport ----------------------------------------------------
def test_each_transport_reads_its_own_section():
    cfg = _cfg("sync.transport=disk", "sync.disk.dir=/tmp/w", "sync.disk.keep=3").sync
    assert cfg.settings == DiskSync(dir="/tmp/w", keep=3)
    dist = _cfg("sync.transport=distributed", "sync.distributed.master_port=29600").sync
    assert dist.settings.master_port == 29600  # type: ignore[union-attr]
    # a dump validates again as it is (what a trainer actor receives)
    for sync in (cfg, dist, _cfg().sync):
        assert SyncConfig.model_validate(sync.model_dump(mode="json")) == sync


@pytest.mark.parametrize(
    "overrides, needle",
    [
        (["sync.disk_dir=/x"], r"sync\.disk_dir is now sync\.disk\.dir"),
        (["sync.mooncake_agents=[a]"], r"sync\.mooncake_agents is now sync\.mooncake\.agents"),
        (["sync.tensor_format=direct"], r"sync\.tensor_format is now sync\.tensor\.format"),
        (["sync.disk.dir=/x"], r"sync\.disk is set but sync\.transport is 'tensor'"),
        (["sync.transport=disk"], r"sync\.transport=disk needs sync\.disk\.dir"),
        (["sync.transport=mooncake", "sync.mooncake.agents=[a, b]"],
         r"sync\.mooncake\.agents has 2 URLs for engines\.num_engines=1"),
        (["sync.transport=mooncake", "sync.mooncake.agents=[a]", "sync.mooncake.buffer_bytes=8"],
         r"sync\.mooncake\.buffer_bytes sizes the agents the GRPO job starts"),
    ],
)  # fmt: skip
def test_sync_mistakes_name_the_key(overrides, needle):
    with pytest.raises(ConfigError, match=needle):
        _cfg(*overrides)


def test_mooncake_without_agents_starts_one_beside_each_engine(tmp_path, capsys):
    """``sync.mooncake.agents`` empty (the default) is accepted: each engine's launch names the
    agent its actor starts, a buffer region per trainer sender; given agents start none."""
    mooncake = ("sync.transport=mooncake", "sync.bucket_bytes=1000")
    cfg = _cfg(*mooncake, "engines.num_engines=2", "engines.router=true")
    assert cfg.sync.mooncake.agents == [] and cfg.sync.mooncake.host == "auto"
    agent = plan_placement(cfg, "cpu", None, None).engine.mooncake_agent
    assert agent == MooncakeAgentLaunch(buffer_bytes=1000, protocol="tcp", device="")
    # PP 2: two senders, a region each; sync.mooncake.buffer_bytes sizes it instead
    pp2 = _cfg(*mooncake, "parallel.pipeline_model_parallel_size=2", "trainer.num_processes=2")
    assert plan_placement(pp2, "cpu", None, None).engine.mooncake_agent.buffer_bytes == 2000
    sized = _cfg(*mooncake, "sync.mooncake.buffer_bytes=4096", "sync.mooncake.protocol=rdma")
    agent = plan_placement(sized, "cpu", None, None).engine.mooncake_agent
    assert (agent.buffer_bytes, agent.protocol) == (4096, "rdma")
    given = _cfg(*mooncake, "sync.mooncake.agents=[http://10.0.0.1:30100]")
    assert plan_placement(given, "cpu", None, None).engine.mooncake_agent is None
    assert plan_placement(_cfg(), "cpu", None, None).engine.mooncake_agent is None
    # the command's checks accept it too
    assert main(["--config", str(MATH), *mooncake, f"run.dir={tmp_path}", "--dry-run"]) == 0
    assert "weight sync: mooncake" in capsys.readouterr().out


def test_mooncake_host_auto_is_each_senders_node_address(monkeypatch):
    from titan_core.net import NODE_IP_ENV, host_address
    from titan_rl.sync.transports.mooncake import sender_host

    for var in (NODE_IP_ENV, "TORCHELASTIC_RUN_ID", "MASTER_ADDR", "GROUP_WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    assert sender_host("10.0.0.7") == "10.0.0.7"  # given: as is
    monkeypatch.setitem(sys.modules, "ray", None)  # outside Ray
    assert sender_host("auto") == host_address()
    # in a Ray actor (a trainer rank): its node's IP, as Ray knows it
    node = types.SimpleNamespace(get_node_ip_address=lambda: "10.1.2.3")
    fake_ray = types.SimpleNamespace(is_initialized=lambda: True, util=node)
    monkeypatch.setitem(sys.modules, "ray", fake_ray)
    assert sender_host("auto") == "10.1.2.3"
    # TITAN_NODE_IP (the job sets it for its trainer ranks on a cluster) says it first
    monkeypatch.setenv(NODE_IP_ENV, "127.0.0.1")
    assert sender_host("auto") == "127.0.0.1"


def test_the_machine_checks_the_sync_backend():
    from titan_core.accelerator import get_accelerator

    accel = get_accelerator()
    missing = next(b for b in ("nccl", "mccl", "gloo") if b not in accel.weight_update_backends)
    cfg = _cfg("sync.transport=distributed", f"sync.distributed.backend={missing}")
    with pytest.raises(ConfigError, match=rf"sync\.distributed\.backend={missing}: not available"):
        check_machine(cfg)
    check_machine(_cfg("sync.transport=distributed", "sync.distributed.backend=gloo"))


# ---- data, the trainer's view, cross-section rules ------------------------------------------
def test_rl_data_declares_only_its_own_keys():
    shared = ("tokenizer_type", "tokenizer_model", "num_digits", "arithmetic_format")
    own = RLDataConfig.__dict__.get("__annotations__", {})
    assert not set(shared) & set(own)
    for key in shared:  # the same keys, types and defaults as pretraining's data section
        assert RLDataConfig.model_fields[key].annotation == DataConfig.model_fields[key].annotation
        assert RLDataConfig.model_fields[key].default == DataConfig.model_fields[key].default
    with pytest.raises(ConfigError, match=r"data\.tokenizer_model .* is required"):
        _cfg("data.tokenizer_type=hf")


def test_pretrain_view_checks_its_world_size():
    cfg = _cfg()  # 32 x 8 = 256 samples, micro batch 128: DP 2 at most
    assert cfg.pretrain_view(2).train.global_batch_size == 256
    with pytest.raises(
        ConfigError, match=r"train\.micro_batch_size x data-parallel size \(128 x 4"
    ):
        cfg.pretrain_view(4)
    tp2 = _cfg("parallel.tensor_model_parallel_size=2")
    with pytest.raises(
        ConfigError, match=r"trainer.num_processes=3: world size 3 is not divisible"
    ):
        tp2.pretrain_view(3)


# ---- GRPO's own keys ----------------------------------------------------------------------------
def test_grpo_train_declares_the_shared_keys_once_and_ppo_steps():
    own = set(RLTrainConfig.__dict__.get("__annotations__", {}))
    # RL's own defaults for some shared keys (a small constant LR): same types and bounds
    rl_defaults = {"micro_batch_size", "lr", "lr_warmup_iters", "lr_decay_style", "weight_decay"}
    assert own == {"ppo_steps"} | rl_defaults  # the rest is pretraining's TrainFields as is
    for key in rl_defaults:
        rl, pre = RLTrainConfig.model_fields[key], TrainFields.model_fields[key]
        assert (rl.annotation, rl.metadata) == (pre.annotation, pre.metadata), key
        assert rl.default != pre.default, key
    assert set(RLTrainConfig.model_fields) == set(TrainFields.model_fields) | own
    assert not set(RLTrainConfig.model_fields) & set(MOVED_TRAIN_KEYS)


@pytest.mark.parametrize(
    "override, use",
    [
        ("train.seed=3", "use run.seed"),
        ("train.log_interval=2", "use run.log_interval"),
        ("train.eval_interval=5", "use run.eval_interval"),
        ("train.eval_iters=2", "use data.num_eval"),
        ("train.train_iters=50", "use run.num_steps"),
        ("train.global_batch_size=256", "rollout.prompts_per_step x rollout.n_samples_per_prompt"),
        ("train.stop_at_eval_accuracy=0.5", "drop it"),
        ("ppo_steps=2", "use train.ppo_steps"),
        ("trainer_processes=2", "use trainer.num_processes"),
        ("trainer_threads=2", "use trainer.num_threads"),
    ],
)
def test_an_old_or_pretraining_key_is_refused_naming_the_one_to_use(override, use):
    key = override.split("=")[0]
    said = re.escape(f"{key} is not a titan_rl.grpo key: ") + ".*" + re.escape(use)
    with pytest.raises(ConfigError, match=said):
        _cfg(override)


def _lrs(cfg, optimizer_steps: int, batch: int) -> list[float]:
    """The LR of each optimizer step under ``cfg``'s scheduler, stepped as the trainers step it
    (``batch`` samples per optimizer step)."""
    import torch

    from titan_core.training.optim import build_scheduler

    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    sched = build_scheduler(cfg, opt)
    out = []
    for _ in range(optimizer_steps):
        out.append(opt.param_groups[0]["lr"])
        sched.step(increment=batch)
    return out


def test_the_lr_horizon_is_the_runs_optimizer_steps():
    """run.num_steps x train.ppo_steps optimizer steps, as a pretraining run of that many
    iterations on the rollout's batch decays (not pretraining's default 200, nor 10**9)."""
    sched = ["train.lr_decay_style=cosine", "train.lr=1e-3", "train.min_lr=1e-5"]
    cfg = _cfg(*sched, "run.num_steps=6", "train.ppo_steps=2", "train.lr_warmup_iters=2")
    view = cfg.pretrain_view(1)
    reference = load_config(
        PretrainConfig, REPO / "examples/pretrain_math_base.yaml",
        [*sched, "train.lr_warmup_iters=2", "train.train_iters=12",
         "train.global_batch_size=256", "train.micro_batch_size=128"],
    )  # fmt: skip
    got, want = _lrs(view, 13, 256), _lrs(reference, 13, 256)
    assert got == want
    assert got[1] < got[2] == 1e-3 > got[11] > got[12] == 1e-5  # warm-up, decay, at min_lr
    # a step count that the LR schedule does not reach is refused
    with pytest.raises(ConfigError, match=r"train\.lr_warmup_iters \(12\) must be below"):
        _cfg(*sched, "run.num_steps=6", "train.ppo_steps=2", "train.lr_warmup_iters=12")


def test_run_seed_seeds_the_trainer():
    assert _cfg("run.seed=7").pretrain_view(1).train.seed == 7


def test_entropy_with_tensor_parallelism_is_refused_on_loading():
    with pytest.raises(ConfigError, match=r"algo\.entropy_coef > 0 needs parallel\.tensor_model"):
        _cfg(
            "algo.entropy_coef=0.01", "parallel.tensor_model_parallel_size=2", "model.num_layers=4"
        )


# ---- the custom reward: imported once, before the start -------------------------------------
def test_custom_reward_is_imported_by_the_preflight_not_by_validation(tmp_path):
    log = tmp_path / "imports.log"
    fn = tmp_path / "counted_reward.py"
    fn.write_text(
        f"open({str(log)!r}, 'a').write('x')\n"
        "def score(prompt, response, label, metadata):\n    return 1.0\n"
    )
    cfg = _cfg("reward.type=custom", f"reward.custom_path={fn}:score")
    GRPOConfig.model_validate(cfg.model_dump(mode="json", by_alias=True))  # a trainer actor's
    assert not log.exists()  # validating imports nothing
    check_reward(cfg.reward)
    check_reward(cfg.reward)
    assert cfg.reward.load_custom() is not None
    assert log.read_text() == "x"  # once in this process
    bad = _cfg("reward.type=custom", f"reward.custom_path={fn}:nope")
    with pytest.raises(ConfigError, match=r"reward\.custom_path .* has no attribute 'nope'"):
        check_reward(bad.reward)


def test_a_missing_custom_reward_stops_the_dry_run(tmp_path, capsys):
    args = ["--config", str(MATH), "reward.type=custom", "reward.custom_path=no_such_mod_17:f"]
    assert main([*args, "--dry-run"]) == 2
    assert "reward.custom_path 'no_such_mod_17:f': cannot import" in capsys.readouterr().err


def test_a_train_section_that_sets_some_keys_gets_rls_defaults_for_the_rest(tmp_path):
    """Not pretraining's (lr 1e-3, cosine, warmup 20, weight decay 0.01, micro batch 8)."""
    path = tmp_path / "grpo.yaml"
    path.write_text("train:\n  lr: 2.0e-4\n")
    partial = load_config(GRPOConfig, str(path), [])
    default = load_config(GRPOConfig, None, [])
    assert partial.train.lr == 2e-4
    assert partial.train.model_dump(exclude={"lr"}) == default.train.model_dump(exclude={"lr"})


@pytest.mark.parametrize("cut", ["header", "tensors"])
def test_a_truncated_hf_policy_stops_the_dry_run_naming_the_file(tmp_path, capsys, cut):
    """A weight file cut short (a copy or download that stopped) is named at the config's
    check, not by the trainer's or the engines' load after Ray started."""
    from tests.models.hf_cases import build_hf_model

    policy = tmp_path / "hf"
    build_hf_model("llama").save_pretrained(policy)
    weights = policy / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[:1000] if cut == "header" else data[:-100])
    args = ["--config", str(MATH), "policy.format=hf", f"policy.load={policy}",
            f"run.dir={tmp_path / 'run'}"]  # fmt: skip
    assert main([*args, "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert f"policy.load: {weights} cannot be read" in err and "copy or download it" in err
    weights.write_bytes(data)  # the whole file: the same command plans the run
    assert main([*args, "--dry-run"]) == 0
