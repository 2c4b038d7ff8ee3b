"""The parent side of ``bench/weight_sync.py --trainer-layout``: the models, the engines (and
Mooncake agents), one torchrun trainer per layout (``bench/weight_sync_worker.py``), the table.

Models: a dense Qwen3 for layouts without EP, a Qwen3-MoE for layouts with EP, shaped so the
experts hold most of the weights as in real MoE models (76% here; Qwen3-30B-A3B ~95%).
Engines: ``--engines`` built-in engine servers per model, each ``--engine-tp`` ranks when the
engine serves it, else TP 1 with a line saying why.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from weight_sync_layouts import Layout, check_fits, table

REPO = Path(__file__).resolve().parents[1]
WORKER = REPO / "bench" / "weight_sync_worker.py"


@dataclass(frozen=True)
class Shape:
    """The benchmark model of one kind (Qwen3 / Qwen3-MoE geometry)."""

    hidden: int = 512
    layers: int = 8
    vocab: int = 32000
    heads: int = 8
    kv_heads: int = 4
    intermediate: int = 1536
    experts: int = 0
    top_k: int = 0
    moe_intermediate: int = 0


DENSE = Shape()
#: 32 experts (top 4), 76% of the weights (a real MoE's embeddings are a smaller share still)
MOE = Shape(vocab=16384, experts=32, top_k=4, moe_intermediate=192)


def build_model(path: Path, shape: Shape) -> tuple[str, int]:
    """Save a random HF model of ``shape`` at ``path``: (its name, its fp32 bytes, the sync's
    anchor: every trainer parameter is sent once, in the trainer's dtype)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    common = dict(
        vocab_size=shape.vocab, hidden_size=shape.hidden, num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads,
        head_dim=shape.hidden // shape.heads, max_position_embeddings=1024,
        tie_word_embeddings=False, intermediate_size=shape.intermediate,
    )  # fmt: skip
    if shape.experts:
        cfg = Qwen3MoeConfig(
            **common, num_experts=shape.experts, num_experts_per_tok=shape.top_k,
            moe_intermediate_size=shape.moe_intermediate, norm_topk_prob=True,
        )  # fmt: skip
        model: Any = Qwen3MoeForCausalLM(cfg)
    else:
        model = Qwen3ForCausalLM(Qwen3Config(**common))
    model.save_pretrained(path)
    n = sum(p.numel() for p in model.parameters())
    if shape.experts:
        experts = sum(p.numel() for k, p in model.named_parameters() if ".experts." in k)
        name = f"Qwen3-MoE {n / 1e6:.0f}M E{shape.experts} {experts / n:.0%}"
    else:
        name = f"Qwen3 {n / 1e6:.0f}M"
    return name, n * 4


def engine_tp_problem(tp: int) -> str | None:
    """Why the built-in engine cannot serve ``tp`` ranks here (None: it says nothing against)."""
    from titan_rl.actors.config import engine_problem

    problem = engine_problem("builtin", tp, "cpu")
    return None if problem is None else problem[1]


def _start(model_dir: Path, logs: Path, name: str, tp: int) -> Any:
    from titan_rl.actors.config import EngineServerConfig
    from titan_rl.actors.server import ServerProcess

    server = ServerProcess(
        EngineServerConfig(
            model_path=str(model_dir), backend="builtin", num_threads=1, log_dir=str(logs),
            startup_timeout_s=300, tp_size=tp,
        ),
        name=name,
    )  # fmt: skip
    try:
        server.start()
    except BaseException:
        server.stop()
        raise
    return server


@contextmanager
def engines(model_dir: Path, logs: Path, n: int, tp: int) -> Iterator[tuple[list[Any], int]]:
    """``n`` engines serving ``model_dir``, ``tp`` ranks each when the engine can, else TP 1
    (printing why): (the servers, the TP they run)."""
    with ExitStack() as stack:
        why = engine_tp_problem(tp) if tp > 1 else None
        servers: list[Any] = []
        if why is None:
            try:
                servers.append(_start(model_dir, logs, f"{model_dir.name}-0", tp))
            except RuntimeError as e:
                if tp == 1:
                    raise
                lines = [s for s in str(e).splitlines() if s.strip()]
                why = lines[-1] if lines else repr(e)
        if why is not None:
            print(f"engine TP {tp}: figure skipped, engines run TP 1 ({why})", flush=True)
            tp = 1
        for s in servers:
            stack.callback(s.stop)
        for i in range(len(servers), n):
            s = _start(model_dir, logs, f"{model_dir.name}-{i}", tp)
            stack.callback(s.stop)
            servers.append(s)
        yield servers, tp


@contextmanager
def agents(urls: list[str], logs: Path, buffer_bytes: int) -> Iterator[list[str]]:
    """A Mooncake agent beside each engine: their URLs."""
    import httpx

    from titan_core.net import free_port

    with ExitStack() as stack:
        out = []
        for i, url in enumerate(urls):
            port = free_port()
            log = stack.enter_context(open(logs / f"agent{i}.log", "w"))
            p = subprocess.Popen(
                [sys.executable, "-m", "titan_rl.sync.mooncake_agent", "--engine-url", url,
                 "--port", str(port), "--buffer-bytes", str(buffer_bytes)],
                stdout=log, stderr=subprocess.STDOUT, env=_env(),
            )  # fmt: skip
            stack.callback(_stop, p)
            agent = f"http://127.0.0.1:{port}"
            for _ in range(300):
                if p.poll() is not None:
                    raise RuntimeError(f"mooncake agent exited: see {logs / f'agent{i}.log'}")
                try:
                    httpx.get(f"{agent}/info", timeout=1).raise_for_status()
                    break
                except httpx.HTTPError:
                    time.sleep(0.2)
            else:
                raise TimeoutError(f"mooncake agent {agent} did not answer")
            out.append(agent)
        yield out


def _stop(p: subprocess.Popen) -> None:
    p.terminate()
    try:
        p.wait(10)
    except subprocess.TimeoutExpired:
        p.kill()


def _env() -> dict[str, str]:
    paths = [str(REPO), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    return dict(
        os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore",
        PYTHONPATH=os.pathsep.join(paths),
    )  # fmt: skip


def run_trainer(layout: Layout, model_dir: Path, urls: list[str], transports: list[str],
                agent_urls: list[str], tmp: Path, bucket_bytes: int, repeats: int,
                ) -> list[dict[str, Any]]:  # fmt: skip
    """torchrun the layout's ranks syncing into ``urls``; the worker's per-transport results."""
    tag = str(layout).replace(",", "_").replace("=", "")
    out, log = tmp / f"{tag}.json", tmp / f"{tag}.log"
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        "--nproc-per-node", str(layout.world), str(WORKER), "--layout", str(layout),
        "--model-dir", str(model_dir), "--engines", *urls, "--transports", *transports,
        "--bucket-bytes", str(bucket_bytes), "--repeats", str(repeats),
        "--disk-dir", str(tmp / f"disk-{tag}"), "--out", str(out),
        *(["--agents", *agent_urls] if agent_urls else []),
    ]  # fmt: skip
    # output to a file: torch's shm manager daemon inherits the descriptors and outlives us
    with open(log, "w") as f:
        proc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=_env())
    if proc.returncode != 0:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-40:])
        raise RuntimeError(f"layout {layout}: the trainer exited {proc.returncode}:\n{tail}")
    return json.loads(out.read_text())


def run_layouts(layouts: list[Layout], transports: list[str], n_engines: int, engine_tp: int,
                tmp: Path, bucket_bytes: int, repeats: int) -> None:  # fmt: skip
    """Every layout x transport, grouped by model (the engines serve one model each); prints
    the table in the order asked."""
    if "mooncake" in transports and importlib.util.find_spec("mooncake") is None:
        print("mooncake: skipped (pip install mooncake-transfer-engine-non-cuda)")
        transports = [t for t in transports if t != "mooncake"]
    for layout in layouts:
        shape = MOE if layout.moe else DENSE
        check_fits(layout, shape.layers, shape.heads, shape.kv_heads, shape.experts)
    rows: dict[Layout, list[dict[str, Any]]] = {}
    for shape in (DENSE, MOE):
        group = [lay for lay in layouts if lay.moe == bool(shape.experts)]
        if not group:
            continue
        model_dir = tmp / ("moe" if shape.experts else "dense")
        name, model_bytes = build_model(model_dir, shape)
        print(f"model: {name}, fp32 {model_bytes / 2**20:.0f} MiB", flush=True)
        logs = tmp / f"logs-{model_dir.name}"
        with ExitStack() as stack:
            servers, tp = stack.enter_context(engines(model_dir, logs, n_engines, engine_tp))
            urls = [s.url for s in servers]
            agent_urls: list[str] = []
            if "mooncake" in transports:
                agent_urls = stack.enter_context(agents(urls, logs, bucket_bytes))
            for layout in group:
                t0 = time.perf_counter()
                found = run_trainer(
                    layout, model_dir, urls, transports, agent_urls, tmp, bucket_bytes, repeats
                )
                rows[layout] = [
                    {"layout": layout, "model": name, "model_bytes": model_bytes, **r}
                    for r in found
                ]
                print(
                    f"layout {layout}: {layout.world} trainer ranks -> {n_engines} engines "
                    f"(TP {tp}), {time.perf_counter() - t0:.0f} s; MiB sent per rank: "
                    + "; ".join(
                        f"{r['transport']} "
                        + " ".join(f"{(b or 0) / 2**20:.0f}" for b in r["rank_bytes"])
                        for r in rows[layout]
                    ),
                    flush=True,
                )
                for r in rows[layout]:
                    if r["metrics"]["sync/bytes"] != model_bytes:
                        print(
                            f"  note: {r['transport']} sent {r['metrics']['sync/bytes']:.0f} "
                            f"bytes, the checkpoint holds {model_bytes}"
                        )
    print()
    for line in table([r for lay in layouts for r in rows[lay]]):
        print(line)
