"""``engines.dtype`` and ``rollout.return_routed_experts`` travel YAML -> the engines' launch
-> argv (the built-in engine's and SGLang's flags); the default launch is unchanged."""

from __future__ import annotations

from pathlib import Path

from titan_core.config import load_config
from titan_rl.actors.server import build_command
from titan_rl.config import GRPOConfig
from titan_rl.engine.cli import build_parser
from titan_rl.placement import plan_placement

REPO = Path(__file__).resolve().parents[2]
MATH = REPO / "examples" / "math.yaml"
QWEN3 = REPO / "examples" / "math_qwen3.yaml"


def _cfg(*overrides: str, path: Path = MATH) -> GRPOConfig:
    return load_config(GRPOConfig, path, list(overrides))


def test_engine_dtype_reaches_the_builtin_engines_argv(tmp_path: Path) -> None:
    default = plan_placement(_cfg(f"run.dir={tmp_path}"), "cpu", None, None).engine
    assert default is not None and default.dtype == "auto"
    assert "--dtype" not in build_command(default, 31000)  # the checkpoint's (fp32) as before
    cfg = _cfg(
        f"run.dir={tmp_path}", "engines.dtype=bfloat16", "rollout.return_routed_experts=true"
    )
    launch = plan_placement(cfg, "cpu", None, None).engine
    assert launch is not None and launch.dtype == "bfloat16"
    argv = build_command(launch, 31000)
    assert argv[argv.index("--dtype") + 1] == "bfloat16"
    # what the actor runs, the engine's own parser takes
    args = build_parser().parse_args(argv[argv.index("titan_rl.engine") + 1 :])
    assert args.dtype == "bfloat16"


def test_sglang_gets_dtype_and_routed_experts_flags() -> None:
    cfg = _cfg("engines.dtype=bfloat16", "rollout.return_routed_experts=true", path=QWEN3)
    gpu = plan_placement(cfg, "cuda", "GPU", 8).engine
    assert gpu is not None and gpu.backend == "sglang"
    argv = build_command(gpu, 31000)
    assert argv[argv.index("--dtype") + 1] == "bfloat16"
    assert "--enable-return-routed-experts" in argv
    off = plan_placement(_cfg(path=QWEN3), "cuda", "GPU", 8).engine
    assert off is not None and "--enable-return-routed-experts" not in build_command(off, 31000)


def test_every_engine_setting_of_a_launch_reaches_the_engine(tmp_path: Path) -> None:
    """The launch's engine settings -> argv -> ``python -m titan_rl.engine``'s parser -> the
    settings the Engine runs with: each one arrives (titan_rl/engine_settings.py lists them)."""
    from titan_rl.engine_settings import EngineSettings, from_arguments

    cfg = _cfg(
        f"run.dir={tmp_path}", "engines.dtype=bfloat16", "engines.num_threads=3",
        "engines.chunked_prefill_size=512", "engines.tp_size=2", "trainer.num_processes=2",
    )  # fmt: skip
    launch = plan_placement(cfg, "cpu", None, None).engine
    assert launch is not None
    launch = launch.model_copy(update={"context_length": 48, "weight_version": "7"})
    argv = build_command(launch, 31000)
    got = from_arguments(build_parser().parse_args(argv[argv.index("titan_rl.engine") + 1 :]))
    want = EngineSettings(
        dtype="bfloat16", context_length=48, chunked_prefill_size=512, num_threads=3,
        tp_size=2, weight_version="7",
    )  # fmt: skip
    assert got == want
    # at their defaults, no flag: the engine's own defaults stand
    default = plan_placement(_cfg(f"run.dir={tmp_path}"), "cpu", None, None).engine
    assert default is not None
    argv = build_command(default.model_copy(update={"num_threads": None}), 31000)
    assert argv[argv.index("titan_rl.engine") + 1 :] == [
        "--model-path", str(tmp_path / "hf_start"), "--host", "127.0.0.1", "--port", "31000",
    ]  # fmt: skip
