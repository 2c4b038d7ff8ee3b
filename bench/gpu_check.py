"""GPU checks of the paths a CPU machine cannot run, in one short script (about 5 minutes).

Run on a machine with one CUDA GPU, from the repository root:

    python bench/gpu_check.py --out OUT_DIR

Each section prints one line of figures and writes ``OUT_DIR/gpu_check.json``:

- ``pretrain``: ``python -m titan_core.pretrain`` on examples/pretrain_tiny.yaml (dense) and
  examples/pretrain_tiny_moe.yaml (MoE, alltoall dispatcher), each run as a user runs it
  (fresh process, set-up included), on the GPU in fp32 and bf16 and, as the reference, on
  the same machine's CPU (``TITAN_ACCELERATOR=cpu``) in fp32. Figures: loss at the first and
  last step (the GPU and CPU initialise from different random streams, so their curves are
  not expected to match step by step) and the mean step time of the steady steps (after the
  fifth), CPU over GPU bf16 as a ratio.
- ``trace``: the GPU bf16 dense run profiles two steps; ``python -m titan_core.trace analyze``
  reads the trace (its report included) and the kernel share of the step is printed.
- ``fp8``: blockwise FP8 GEMMs (1x128 activation tiles, 128x128 weight blocks, e4m3, fp32
  scales) through ``torch.nn.functional.scaled_mm`` against the same quantization computed
  in fp32 (relative error) and against a bf16 GEMM of the same shape (speed ratio).
- ``ipc``: a direct-format weight-sync payload of GPU tensors (``titan_rl.wire.payload``) is
  opened in another process as SGLang opens it (``ForkingPickler``), values compared.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]


def _run(args: list[str], env: dict[str, str] | None = None, timeout: float = 300) -> float:
    t0 = time.perf_counter()
    proc = subprocess.run(
        args,
        cwd=ROOT,
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    return time.perf_counter() - t0


def _metrics(run_dir: Path) -> list[dict[str, Any]]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "loss" in r and "step" in r]


def pretrain(out: Path, steps: int) -> dict[str, Any]:
    res: dict[str, Any] = {}
    for name, cfg in (
        ("dense", "examples/pretrain_tiny.yaml"),
        ("moe", "examples/pretrain_tiny_moe.yaml"),
    ):
        runs: dict[str, list[dict[str, Any]]] = {}
        walls: dict[str, float] = {}
        for mode, env, extra in (
            ("cpu_fp32", {"TITAN_ACCELERATOR": "cpu"}, []),
            ("gpu_fp32", {}, []),
            ("gpu_bf16", {}, ["train.bf16=true"]),
        ):
            run_dir = out / f"{name}_{mode}"
            profile = ["profile.steps=[20,21]"] if (name, mode) == ("dense", "gpu_bf16") else []
            walls[mode] = _run(
                [
                    sys.executable,
                    "-m",
                    "titan_core.pretrain",
                    "--config",
                    cfg,
                    f"train.train_iters={steps}",
                    "train.log_interval=1",
                    "checkpoint.save_interval=0",
                    f"run.dir={run_dir}",
                    *extra,
                    *profile,
                ],
                env,
            )
            runs[mode] = _metrics(run_dir)
        steady = {
            m: statistics.mean(r["step_time_s"] for r in rows[5:]) for m, rows in runs.items()
        }
        res[name] = {
            "loss_first": {m: rows[0]["loss"] for m, rows in runs.items()},
            "loss_last": {m: rows[-1]["loss"] for m, rows in runs.items()},
            "steady_step_s": steady,
            "cpu_over_gpu_bf16_step": steady["cpu_fp32"] / steady["gpu_bf16"],
            "command_wall_s": walls,
        }
        print(f"pretrain {name}: {json.dumps(res[name])}", flush=True)
    return res


def trace(out: Path) -> dict[str, Any]:
    traces = out / "dense_gpu_bf16" / "traces"
    report = out / "trace_report"
    wall = _run(
        [
            sys.executable,
            "-m",
            "titan_core.trace",
            "analyze",
            str(traces),
            "--out",
            str(report),
            "--no-cache",
        ]
    )
    summary = json.loads((report / "summary.json").read_text())
    res = {
        "analyze_wall_s": wall,
        "trace_bytes": sum(p.stat().st_size for p in traces.iterdir()),
        "summary_keys": sorted(summary)[:20],
    }
    for key in ("ranks", "temporal", "kernels", "problems"):
        if key in summary:
            res[key] = summary[key] if len(json.dumps(summary[key], default=str)) < 2000 else "…"
    print(f"trace: {json.dumps(res, default=str)[:3000]}", flush=True)
    return res


def _quant_1x128(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3 with one fp32 scale per 1x128 tile of rows; returns (fp8, decode scale (M, K/128))."""
    m, k = x.shape
    tiles = x.float().reshape(m, k // 128, 128)
    amax = tiles.abs().amax(-1).clamp(min=1e-12)
    scale = 448.0 / amax
    q = (tiles * scale[..., None]).clamp(-448, 448).to(torch.float8_e4m3fn).reshape(m, k)
    return q, scale.reciprocal()


def _quant_128x128(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3 with one fp32 scale per 128x128 block; returns (fp8, decode scale (N/128, K/128))."""
    n, k = w.shape
    blocks = w.float().reshape(n // 128, 128, k // 128, 128)
    amax = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12)
    scale = 448.0 / amax
    q = (blocks * scale[:, None, :, None]).clamp(-448, 448).to(torch.float8_e4m3fn).reshape(n, k)
    return q, scale.reciprocal()


def _timed(fn: Any, iters: int = 20) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / iters


def fp8() -> dict[str, Any]:
    import torch.nn.functional as F

    res: dict[str, Any] = {"torch": torch.__version__}
    if not hasattr(F, "scaled_mm"):
        res["error"] = "torch.nn.functional.scaled_mm is missing in this torch"
        print(f"fp8: {res}", flush=True)
        return res
    torch.manual_seed(0)
    for m, n, k in ((4096, 4096, 4096), (8192, 8192, 8192)):
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        xq, xs = _quant_1x128(x)
        wq, ws = _quant_128x128(w)
        # reference: the same quantized values and scales, multiplied in fp32
        xr = (xq.float().reshape(m, k // 128, 128) * xs[..., None]).reshape(m, k)
        wr = (wq.float().reshape(n // 128, 128, k // 128, 128) * ws[:, None, :, None]).reshape(n, k)
        ref = xr @ wr.t()
        exact = x.float() @ w.float().t()
        row: dict[str, Any] = {"shape": [m, n, k]}
        # 1x128 scales are read outer-dim-major: (M, K/128) with stride (1, M). The 128x128
        # scale of mat_b (K, N) is (K/128, N/128); which memory order the kernel takes is
        # tried in turn and reported.
        sa = xs.t().contiguous().t()
        tries = {"k_major": ws.t(), "n_major": ws.t().contiguous()}
        errors = {}
        for layout, sb in tries.items():

            def mm(xq=xq, wq=wq, sa=sa, sb=sb) -> torch.Tensor:  # noqa: ANN001
                return F.scaled_mm(
                    xq,
                    wq.t(),
                    sa,
                    F.ScalingType.BlockWise1x128,
                    sb,
                    F.ScalingType.BlockWise128x128,
                    output_dtype=torch.bfloat16,
                )

            try:
                out = mm()
            except Exception as e:  # the kernel's layout rules differ between torch versions
                errors[layout] = f"{type(e).__name__}: {str(e)[:300]}"
                continue
            row["fp8_blockwise"] = {
                "scale_b_layout": layout,
                "rel_err_vs_same_quant_fp32": float((out.float() - ref).norm() / ref.norm()),
                "rel_err_vs_unquantized_fp32": float((out.float() - exact).norm() / exact.norm()),
                "tflops": 2 * m * n * k / _timed(mm) / 1e12,
            }
            break
        if errors:
            row["errors"] = errors
        bf = _timed(lambda x=x, w=w: x @ w.t())
        row["bf16_tflops"] = 2 * m * n * k / bf / 1e12
        if "fp8_blockwise" in row:
            row["fp8_over_bf16_speed"] = row["fp8_blockwise"]["tflops"] / row["bf16_tflops"]
        res[f"{m}x{n}x{k}"] = row
        print(f"fp8: {json.dumps(row)}", flush=True)
    return res


_CHILD = r"""
import base64, io, sys, pickle, torch
from multiprocessing.reduction import ForkingPickler
payload = sys.stdin.read()
named = ForkingPickler.loads(base64.b64decode(payload))
print(repr([(n, t.device.type, float(t.double().sum())) for n, t in named]))
"""


def ipc() -> dict[str, Any]:
    from titan_rl.wire.payload import dumps_named

    torch.manual_seed(0)
    named = [("w", torch.randn(1024, 1024, device="cuda")), ("b", torch.randn(4096, device="cuda"))]
    view = torch.randn(64, 256, device="cuda")
    named.append(("qkv_slice", view[:, 64:128]))  # a strided view of a larger storage
    payload = dumps_named(named)
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD],
        input=payload,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    expected = [(n, "cuda", float(t.double().sum())) for n, t in named]
    res: dict[str, Any] = {"payload_b64_bytes": len(payload)}
    if proc.returncode != 0:
        res["error"] = proc.stderr[-1500:]
    else:
        got = eval(proc.stdout.strip())  # the child prints a plain repr of (str, str, float)
        res["equal"] = all(
            g[0] == e[0] and g[1] == e[1] and abs(g[2] - e[2]) < 1e-6
            for g, e in zip(got, expected, strict=True)
        )
        res["got"], res["expected"] = got, expected
    print(f"ipc: {json.dumps(res)}", flush=True)
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--only", nargs="*", default=["ipc", "fp8", "pretrain", "trace"])
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to check", file=sys.stderr)
        return 1
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
    }
    print(f"device: {results}", flush=True)
    sections = {
        "ipc": ipc,
        "fp8": fp8,
        "pretrain": lambda: pretrain(out, args.steps),
        "trace": lambda: trace(out),
    }
    for name in args.only:
        t0 = time.perf_counter()
        try:
            results[name] = sections[name]()
        except Exception as e:
            results[name] = {"error": f"{type(e).__name__}: {e}"[-4000:]}
            print(f"{name}: FAILED {results[name]['error']}", flush=True)
        print(f"[{name} took {time.perf_counter() - t0:.1f} s]", flush=True)
        (out / "gpu_check.json").write_text(json.dumps(results, indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
