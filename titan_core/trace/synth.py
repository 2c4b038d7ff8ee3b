"""Generate Kineto-format traces of a pipeline-parallel job with known ground truth.

Used by the tests (bubbles, slow rank and critical path known by construction) and by
``bench/trace_scale.py``. Each rank runs a 1F1B schedule (warm-up forwards, steady 1F1B,
cool-down backwards) with one NCCL P2P kernel per transfer, a data-parallel all-reduce at
the end of the step, ProfilerStep ranges and Titan's microbatch ranges; ``filler`` adds
realistic numbers of small compute kernels (with their launches) per microbatch,
``clock_skew`` a known clock offset per rank, ``p2p_jitter`` uneven transfer times, and
``packed`` steps without a barrier between them (each rank starts its next step as soon as
its own all-reduce is done, so the later stages post the next step's receives while the
first stages still run this step's backwards, and the ranks' step ranges overlap),
``optimizer`` compute after a rank's all-reduce, ``microbatch_ranges=False`` traces without
Titan's microbatch ranges (as other trainers write them).
"""

from __future__ import annotations

import gzip
import random
from pathlib import Path
from typing import Any

import orjson


def _schedule(p: int, m: int, s: int) -> list[tuple[str, int]]:
    warm = min(p - s - 1, m)
    ops = [("fwd", i) for i in range(warm)]
    f, b = warm, 0
    while f < m:
        ops.append(("fwd", f))
        f += 1
        ops.append(("bwd", b))
        b += 1
    while b < m:
        ops.append(("bwd", b))
        b += 1
    return ops


def simulate(
    pp: int,
    dp: int,
    m: int,
    steps: int,
    t_fwd: float,
    slow: dict[int, float] | None = None,
    p2p_jitter: float = 0.0,
    seed: int = 0,
    packed: bool = False,
    optimizer: dict[int, float] | None = None,
) -> dict[int, list[dict[str, Any]]]:
    """Event-level simulation: per rank the list of (kind, start, end, ...) segments.
    Each P2P transfer takes 20 us plus a uniform draw from [0, ``p2p_jitter``). After
    its data-parallel all-reduce a rank runs ``optimizer[rank]`` us of optimizer compute
    (none by default). Steps start together after a barrier, or with ``packed`` each
    rank's 100 us after its own previous step's end."""
    slow = slow or {}
    optimizer = optimizer or {}
    rng = random.Random(seed)
    t_ar = 500.0

    def p2p_time() -> float:
        return 20.0 + (rng.uniform(0.0, p2p_jitter) if p2p_jitter else 0.0)

    world = pp * dp
    out: dict[int, list[dict[str, Any]]] = {r: [] for r in range(world)}
    t0 = 1_000_000.0
    starts = {r: t0 for r in range(world)}  # each rank's next step start
    for step in range(steps):
        step_start = dict(starts) if packed else {r: t0 for r in range(world)}
        step_end = {}
        for d in range(dp):
            ranks = [d + k * dp for k in range(pp)]
            fwd_done: dict[tuple[int, int], float] = {}
            bwd_done: dict[tuple[int, int], float] = {}
            xfer: dict[tuple[str, int, int], float] = {}  # (phase, sender stage, mb) -> time
            clock = {s: step_start[ranks[s]] for s in range(pp)}
            scheds = {s: _schedule(pp, m, s) for s in range(pp)}
            ptr = {s: 0 for s in range(pp)}
            while any(ptr[s] < len(scheds[s]) for s in range(pp)):
                moved = False
                for s in range(pp):
                    if ptr[s] >= len(scheds[s]):
                        continue
                    kind, mb = scheds[s][ptr[s]]
                    r = ranks[s]
                    f = slow.get(r, 1.0)
                    if kind == "fwd":
                        if s > 0 and (s - 1, mb) not in fwd_done:
                            continue
                        ready = fwd_done[(s - 1, mb)] if s > 0 else clock[s]
                        if s > 0:
                            rs = clock[s]
                            t_p2p = xfer[("fwd", s - 1, mb)]
                            out[r].append(
                                {
                                    "k": "recv",
                                    "peer": ranks[s - 1],
                                    "ts": rs,
                                    "end": max(rs, ready) + t_p2p,
                                    "step": step,
                                }
                            )
                            clock[s] = max(rs, ready) + t_p2p
                        a = clock[s]
                        b = a + t_fwd * f
                        out[r].append({"k": "fwd", "mb": mb, "ts": a, "end": b, "step": step})
                        clock[s] = b
                        if s < pp - 1:
                            t_p2p = xfer[("fwd", s, mb)] = p2p_time()
                            out[r].append(
                                {
                                    "k": "send",
                                    "peer": ranks[s + 1],
                                    "ts": b,
                                    "end": b + t_p2p,
                                    "step": step,
                                }
                            )
                            clock[s] = b + t_p2p
                        fwd_done[(s, mb)] = b
                    else:
                        if s < pp - 1 and (s + 1, mb) not in bwd_done:
                            continue
                        if s < pp - 1:
                            ready = bwd_done[(s + 1, mb)]
                            rs = clock[s]
                            t_p2p = xfer[("bwd", s + 1, mb)]
                            out[r].append(
                                {
                                    "k": "recv",
                                    "peer": ranks[s + 1],
                                    "ts": rs,
                                    "end": max(rs, ready) + t_p2p,
                                    "step": step,
                                }
                            )
                            clock[s] = max(rs, ready) + t_p2p
                        a = clock[s]
                        b = a + 2 * t_fwd * f
                        out[r].append({"k": "bwd", "mb": mb, "ts": a, "end": b, "step": step})
                        clock[s] = b
                        if s > 0:
                            t_p2p = xfer[("bwd", s, mb)] = p2p_time()
                            out[r].append(
                                {
                                    "k": "send",
                                    "peer": ranks[s - 1],
                                    "ts": b,
                                    "end": b + t_p2p,
                                    "step": step,
                                }
                            )
                            clock[s] = b + t_p2p
                        bwd_done[(s, mb)] = b
                    ptr[s] += 1
                    moved = True
                assert moved, "schedule deadlock"
            for s in range(pp):
                step_end[ranks[s]] = clock[s]
        # data-parallel all-reduce per stage, across the dp replicas
        for s in range(pp):
            members = [d + s * dp for d in range(dp)]
            start = max(step_end[r] for r in members)
            for r in members:
                out[r].append(
                    {
                        "k": "allreduce",
                        "ts": step_end[r],
                        "end": start + t_ar,
                        "step": step,
                        "pg": members,
                    }
                )
                step_end[r] = start + t_ar
                if optimizer.get(r):  # the rank's optimizer step: one compute kernel
                    a, b = step_end[r], step_end[r] + optimizer[r]
                    out[r].append({"k": "opt", "ts": a, "end": b, "step": step})
                    step_end[r] = b
        t_next = max(step_end.values()) + 100.0
        for r in range(world):
            starts[r] = step_end[r] + 100.0 if packed else t_next
            out[r].append({"k": "step", "ts": step_start[r], "end": starts[r] - 50.0, "step": step})
        t0 = t_next
    return out


def write_job(
    out_dir: str | Path,
    pp: int = 4,
    dp: int = 2,
    m: int = 8,
    steps: int = 3,
    t_fwd: float = 1000.0,
    slow: dict[int, float] | None = None,
    filler: int = 0,
    clock_skew: dict[int, float] | None = None,
    gz: bool = True,
    cpu: bool = False,
    p2p_jitter: float = 0.0,
    seed: int = 0,
    packed: bool = False,
    microbatch_ranges: bool = True,
    optimizer: dict[int, float] | None = None,
) -> dict[int, list[dict[str, Any]]]:
    """Write one trace per rank; ``filler`` small kernels (with launches) per microbatch
    phase make the per-rank event count realistic; ``clock_skew`` (us per rank) is added
    to all of a rank's timestamps; ``p2p_jitter``, ``seed``, ``packed`` and ``optimizer``:
    see :func:`simulate`;
    ``microbatch_ranges=False`` leaves Titan's microbatch ranges out of GPU traces (as other
    trainers' traces have none; CPU-only traces keep them, they are their computation).
    Returns the simulated segments (on the true clock, without the skew)."""
    sim = simulate(pp, dp, m, steps, t_fwd, slow, p2p_jitter, seed, packed, optimizer)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    world = pp * dp
    skew = clock_skew or {}
    for r in range(world):
        off = skew.get(r, 0.0)
        ev: list[dict[str, Any]] = []
        corr = [1]
        tid_cpu, tid_gpu, tid_comm = 100, 7, 20

        def annotate(
            name: str,
            ts: float,
            end: float,
            ev: list = ev,
            r: int = r,
            off: float = off,
            tid_cpu: int = tid_cpu,
        ) -> None:
            """A host-side ``user_annotation`` range on the rank's CPU thread."""
            ev.append({"ph": "X", "cat": "user_annotation", "name": name, "pid": r,
                       "tid": tid_cpu, "ts": ts + off, "dur": end - ts, "args": {}})  # fmt: skip

        def kernel(
            name: str,
            ts: float,
            end: float,
            stream: int,
            args: dict | None = None,
            ev: list = ev,
            corr: list = corr,
            r: int = r,
            off: float = off,
            tid_cpu: int = tid_cpu,
        ) -> None:
            c = corr[0]
            corr[0] += 1
            launch = ts - 5.0
            ev.append(
                {
                    "ph": "X",
                    "cat": "cuda_runtime",
                    "name": "cudaLaunchKernel",
                    "pid": r,
                    "tid": tid_cpu,
                    "ts": launch + off,
                    "dur": 3.0,
                    "args": {"correlation": c, "External id": c},
                }
            )
            a = {"correlation": c, "stream": stream, "device": r % 8, "External id": c}
            a.update(args or {})
            ev.append(
                {
                    "ph": "X",
                    "cat": "kernel",
                    "name": name,
                    "pid": r,
                    "tid": stream,
                    "ts": ts + off,
                    "dur": end - ts,
                    "args": a,
                }
            )

        for seg in sim[r]:
            k, ts, end = seg["k"], seg["ts"], seg["end"]
            if k == "step":
                ev.append(
                    {
                        "ph": "X",
                        "cat": "user_annotation",
                        "name": f"ProfilerStep#{seg['step']}",
                        "pid": r,
                        "tid": tid_cpu,
                        "ts": ts - 10 + off,
                        "dur": end - ts,
                        "args": {},
                    }
                )
            elif k == "opt":
                if not cpu:  # CPU-only traces' computation is their microbatch ranges
                    kernel("void multi_tensor_apply_kernel<AdamFunctor>(float*)", ts, end, tid_gpu)
            elif cpu and k in ("send", "recv", "allreduce"):
                annotate("gloo:all_reduce" if k == "allreduce" else f"gloo:{k}", ts, end)
            elif cpu:
                annotate(f"titan/microbatch/{k}/mb{seg['mb']}/vs0", ts, end)
            elif k in ("fwd", "bwd"):
                if microbatch_ranges:  # the range opens on the host just before its kernels
                    annotate(f"titan/microbatch/{k}/mb{seg['mb']}/vs0", ts - 6, end - 6)
                n = max(1, filler)
                dt = (end - ts) / n
                for i in range(n):
                    kernel(
                        "void gemm_kernel<128>(Params)"
                        if i % 3 == 0
                        else "void elementwise_kernel<4>(float*)",
                        ts + i * dt,
                        ts + (i + 1) * dt - (0.2 if n > 1 else 0.0),
                        tid_gpu,
                    )
                    if filler:
                        ev.append(
                            {
                                "ph": "X",
                                "cat": "cpu_op",
                                "name": "aten::mm",
                                "pid": r,
                                "tid": tid_cpu,
                                "ts": ts + i * dt - 6 + off,
                                "dur": 2.0,
                                "args": {"External id": 0},
                            }
                        )
            elif k in ("send", "recv"):
                arrow = f"{r}->{seg['peer']}" if k == "send" else f"{r}<-{seg['peer']}"
                ev.append(
                    {
                        "ph": "X",
                        "cat": "user_annotation",
                        "name": f"nccl:{k} {arrow}",
                        "pid": r,
                        "tid": tid_cpu,
                        "ts": ts - 8 + off,
                        "dur": 7.0,
                        "args": {},
                    }
                )
                kernel(
                    "ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)",
                    ts,
                    end,
                    tid_comm,
                    {
                        "Collective name": k,
                        "In msg nelems": 1 << 20,
                        "dtype": "BFloat16",
                        "Group size": 2,
                    },
                )
            elif k == "allreduce":
                kernel(
                    "ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)",
                    ts,
                    end,
                    tid_comm + 1,
                    {
                        "Collective name": "allreduce",
                        "In msg nelems": 1 << 24,
                        "Out msg nelems": 1 << 24,
                        "dtype": "BFloat16",
                        "Group size": len(seg["pg"]),
                        "Process Group Name": f"dp{seg['pg'][0]}",
                        "Process Group Ranks": str(seg["pg"]),
                    },
                )
        doc = {
            "schemaVersion": 1,
            "deviceProperties": [{"id": r % 8, "name": "NVIDIA H100"}],
            "distributedInfo": {"backend": "nccl", "rank": r, "world_size": world},
            "traceEvents": ev,
        }
        data = orjson.dumps(doc, option=orjson.OPT_INDENT_2)
        path = out / (f"rank-{r}.pt.trace.json" + (".gz" if gz else ""))
        path.write_bytes(gzip.compress(data, 1) if gz else data)
    return sim
