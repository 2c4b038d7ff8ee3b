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
