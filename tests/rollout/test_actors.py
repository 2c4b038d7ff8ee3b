"""Engine actors: command lines, typed configs, Ray group + router (supervision and restart:
tests/rollout/test_engine_restart.py)."""

from __future__ import annotations

import asyncio
import importlib.util
import os
import sys
from pathlib import Path

import httpx
import pytest

from titan_core.accelerator import get_accelerator
from titan_core.config import ConfigError, load_config
from titan_rl.actors.config import (
    EngineServerConfig,
    RolloutEnginesConfig,
    RouterConfig,
    resolve_backend,
)
from titan_rl.actors.engine_actor import RolloutEngineGroup
from titan_rl.actors.router import build_router_command
from titan_rl.actors.server import ServerProcess, build_command
from titan_rl.rollout import SGLangClient


def test_sglang_command_line() -> None:
    cfg = EngineServerConfig(
        model_path="/models/qwen3",
        backend="sglang",
        tp_size=4,
        base_gpu_id=4,
        mem_fraction_static=0.7,
        enable_memory_saver=True,
        api_key="k",
        weight_version="v3",
        extra_args=["--disable-radix-cache"],
    )
    for device in ("cuda", "musa"):
        cmd = build_command(cfg.launch(device), 31000)
        assert cmd[:3] == [sys.executable, "-m", "sglang.launch_server"]
        flags = " ".join(cmd[3:])
        for expected in (
            "--model-path /models/qwen3",
            "--host 127.0.0.1",
            "--port 31000",
            "--tp-size 4",
            "--base-gpu-id 4",
            "--mem-fraction-static 0.7",
            "--enable-memory-saver",
            f"--device {device}",
            "--api-key k",
            "--weight-version v3",
        ):
            assert expected in flags
        assert cmd[-1] == "--disable-radix-cache"


def test_builtin_command_line_and_backend_choice(tiny_model: Path) -> None:
    cfg = EngineServerConfig(model_path=str(tiny_model), num_threads=2)
    if get_accelerator().name == "cpu":
        assert (cfg.launch().backend, cfg.launch().device) == ("builtin", "cpu")
        with pytest.raises(ValueError, match=r"backend builtin \(or auto\), on CPU"):
            EngineServerConfig(model_path="m", backend="sglang").launch()
    assert (
        resolve_backend("auto", "cpu") == "builtin" and resolve_backend("auto", "cuda") == "sglang"
    )
    cmd = build_command(cfg.launch("cpu"), 31001)
    assert (
        cmd[1:3] == ["-m", "titan_rl.engine"] and "--num-threads" in cmd and "--tp-size" not in cmd
    )
    router = build_router_command(RouterConfig(policy="round_robin"), 32000, api_key="k")
    assert router[1:3] == ["-m", "sglang_router.launch_router"]
    assert "--worker-urls" not in router and "--api-key" in router  # workers come via POST /workers


def test_typed_config_names_the_bad_key(tmp_path: Path) -> None:
    good = tmp_path / "rollout.yaml"
    good.write_text(
        "num_engines: 2\nserver:\n  model_path: /m\n  tp_size: 2\nrouter:\n  policy: random\n"
    )
    cfg = load_config(RolloutEnginesConfig, good, ["server.mem_fraction_static=0.5"])
    assert (
        cfg.num_engines == 2
        and cfg.server.mem_fraction_static == 0.5
        and cfg.router.policy == "random"
    )
    bad = tmp_path / "bad.yaml"
    bad.write_text("server:\n  model_path: /m\n  tp_szie: 2\n")
    with pytest.raises(ConfigError, match=r"server\.tp_szie: unknown key"):
        load_config(RolloutEnginesConfig, bad)
    with pytest.raises(ConfigError, match="leave server.port unset"):
        load_config(
            RolloutEnginesConfig,
            None,
            ["num_engines=2", "server.model_path=/m", "server.port=30000"],
        )
    tp2 = load_config(  # the built-in engine runs tensor parallel too
        RolloutEnginesConfig,
        None,
        ["server.model_path=/m", "server.backend=builtin", "server.tp_size=2"],
    )
    assert tp2.server.tp_size == 2


@pytest.mark.slow
def test_ray_engine_group_behind_router(
    tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ray = pytest.importorskip("ray")
    monkeypatch.setenv("RAY_raylet_start_wait_time_s", "240")  # loaded CI machines start slowly
    cfg = load_config(
        RolloutEnginesConfig,
        None,
        [
            "num_engines=2",
            f"server.model_path={tiny_model}",
            "server.num_threads=1",
            f"server.log_dir={tmp_path}",
            "router.policy=round_robin",
            f"router.log_dir={tmp_path}",
        ],
    )
    try:  # a fresh local cluster, never someone else's
        ray.init(
            address="local",
            num_cpus=2,
            include_dashboard=False,
            log_to_driver=False,
            runtime_env={"env_vars": {"PYTHONPATH": str(Path.cwd())}},
        )
    except Exception as e:  # Ray's own start-up, before any Titan code runs
        ray.shutdown()
        pytest.skip(f"a local Ray cluster could not start on this machine: {e}")
    group = RolloutEngineGroup.from_config(cfg)
    try:
        url = group.start()
        assert len(group.urls) == 2 and len(set(group.urls)) == 2

        async def main() -> list:
            async with SGLangClient(url) as client:
                return await asyncio.gather(
                    *[
                        client.generate([i + 2], {"max_new_tokens": 3, "ignore_eos": True})
                        for i in range(6)
                    ]
                )

        outs = asyncio.run(main())
        assert all(len(o.output_ids) == 3 for o in outs)
        pids = ray.get([a.pid.remote() for a in group.actors])
    finally:
        group.stop()
        ray.shutdown()
    for pid in pids:  # the servers are gone after stop()
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


@pytest.mark.gpu
@pytest.mark.skipif(
    get_accelerator().name == "cpu" or importlib.util.find_spec("sglang") is None,
    reason="launching real SGLang needs a CUDA/MUSA device and the sglang package",
)
def test_real_sglang_server_starts(tiny_model: Path, tmp_path: Path) -> None:
    cfg = EngineServerConfig(
        model_path=str(tiny_model),
        backend="sglang",
        mem_fraction_static=0.3,
        skip_tokenizer_init=True,
        log_dir=str(tmp_path),
    )
    server = ServerProcess(cfg, name="sglang")
    try:
        server.start()
        out = httpx.post(
            server.url + "/generate",
            json={"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2}},
            timeout=120,
        )
        assert out.status_code == 200 and len(out.json()["output_ids"]) == 2
    finally:
        server.stop()
