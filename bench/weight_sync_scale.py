"""Weight-sync time of a 1T-parameter MoE (Kimi-K2 shape) at scale, on paper.

    python bench/weight_sync_scale.py                 # Kimi-K2, PP=16 x EP=16, 8 engines x 32 GPUs
    python bench/weight_sync_scale.py --hf-config config.json --pp 8 --ep 32 --tp 8 --dp 32

No cluster is needed: the bytes, tensors and buckets each trainer rank sends are counted
analytically from the model's HF config, and the rates that do not depend on the network are
measured here, in the same run:

- staging: ``titan_rl.wire.bucket.flatten_into`` throughput (bytes/s, best of several copies of
  one bucket's worth of tensors) and its fixed cost per tensor, on ``--device``;
- requests: one ``/update_weights_from_tensor`` call (a one-tensor flattened bucket) to a real
  built-in engine started here: its latency (one call at a time) and its service time (calls
  from several clients at once: wall time / calls; the engine applies one update at a time).

The staging rate also stands for the engine's load copy. Without a GPU both are this CPU's
copy rate, which a GPU's device-memory copy far exceeds; ``--copy-gbps`` and ``--request-ms``
replace the measured rates with the target's.

Layout (the sync design of issue 18). In every pipeline stage the non-expert tensors are
TP-gathered and sent by the stage's source rank (DP rank 0, TP rank 0), and each EP rank of
the first expert-data-parallel replica (expert-TP rank 0) expert-TP-gathers and sends its own
experts; the stage's dense sender is EP rank 0. Each sender packs its tensors, in order, into
buckets of ``--bucket-mib`` (a larger tensor travels alone) and sends every bucket to every
engine replica; an engine of T GPUs takes 1/T of each bucket on each GPU.

Model, per transport (L: the link per GPU and direction; S: staging throughput; c_t: staging
cost per tensor; c_lat / c_svc: an update request's latency / service time at the engine;
R engines of T GPUs; M model bytes; sender i: B_i bytes, n_i tensors, k_i buckets, G_i bytes
it gathers from its TP/expert-TP peers; K = sum of k_i: the requests each engine applies):

- mooncake (P2P writes, all senders at once): send_i = G_i/L + B_i/S + n_i c_t + R B_i/L
  + k_i c_lat (per bucket the sender waits for the R engines' loads, concurrently);
  receive per engine GPU = M/(T L) + M/(T S) (the load copy) + K c_svc.
- distributed (one NCCL group per sender with all engines; senders take turns): the sum over
  senders of G_i/L + B_i/S + n_i c_t + B_i/L (a pipelined broadcast carries each byte over
  each link once) + k_i c_lat; receive per engine GPU = M/L (every rank gets whole buckets)
  + M/(T S) + K c_svc.
- tensor (colocated, CUDA IPC, no network): send_i = G_i/L + B_i/S + n_i c_t + k_i c_lat;
  receive = M/(T S) + K c_svc. Assumes each payload is staged on the device of the engine
  rank that maps it; moving payloads between devices (re-sharding) is not modelled.

Staging, wire and requests of one bucket run one after the other (as the transports do:
flatten, write, wait for the load); double buffering would make a sender's time the larger of
its staging and wire terms instead of their sum. Sync time = max(send side, receive side).
Tensors an engine replicates on its GPUs (norms, small MLA projections) are counted once.

Anchor, same run: the old design, every tensor gathered on trainer rank 0, which sends the
whole model to every engine (distributed: one group per engine, so R M/L on its link).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

#: moonshotai/Kimi-K2-Instruct's config.json (the fields that shape the weights)
KIMI_K2: dict[str, Any] = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "kimi_k2",
    "vocab_size": 163840,
    "hidden_size": 7168,
    "intermediate_size": 18432,
    "moe_intermediate_size": 2048,
    "num_hidden_layers": 61,
    "num_nextn_predict_layers": 0,
    "num_attention_heads": 64,
    "num_key_value_heads": 64,
    "n_shared_experts": 1,
    "n_routed_experts": 384,
    "num_experts_per_tok": 8,
    "first_k_dense_replace": 1,
    "moe_layer_freq": 1,
    "q_lora_rank": 1536,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "topk_method": "noaux_tc",
    "n_group": 1,
    "topk_group": 1,
    "tie_word_embeddings": False,
}

#: public figures, quoted (not measured here): (who, what, seconds)
QUOTED = [
    ("miles P2P", "Kimi-K2 1T, 32+32 H100 nodes, RDMA (broadcast: 53.3 s)", 7.2),
    ("checkpoint-engine", "Kimi-K2 1T, thousands of GPUs", 20.0),
]
GOAL_S, GOAL_GPUS, GOAL_GBPS = 5.0, 256, 400.0

# ---- model shape -----------------------------------------------------------------------------


class Tensor(NamedTuple):
    """One HF tensor: its group, layer (None outside the decoder layers), routed-expert index
    (None for the rest), shape, and whether it is a linear weight (fp8 on an fp8 wire)."""

    group: str
    layer: int | None
    expert: int | None
    shape: tuple[int, ...]
    linear: bool

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


def _linear(
    group: str, layer: int | None, rows: int, cols: int, expert: int | None = None
) -> Tensor:
    return Tensor(group, layer, expert, (rows, cols), True)


def _vector(group: str, layer: int | None, n: int) -> Tensor:
    return Tensor(group, layer, None, (n,), False)


def _mlp(
    group: str, layer: int, hidden: int, inter: int, expert: int | None = None
) -> list[Tensor]:
    """gate_proj, up_proj, down_proj."""
    return [
        _linear(group, layer, inter, hidden, expert),
        _linear(group, layer, inter, hidden, expert),
        _linear(group, layer, hidden, inter, expert),
    ]


def _mla_attention(c: dict[str, Any], layer: int) -> list[Tensor]:
    h, heads, q_lora = c["hidden_size"], c["num_attention_heads"], c.get("q_lora_rank")
    qk = c["qk_nope_head_dim"] + c["qk_rope_head_dim"]
    kv_lora, rope = c["kv_lora_rank"], c["qk_rope_head_dim"]
    out = []
    if q_lora:
        out += [_linear("attention", layer, q_lora, h), _vector("attention", layer, q_lora)]
        out.append(_linear("attention", layer, heads * qk, q_lora))
    else:
        out.append(_linear("attention", layer, heads * qk, h))
    out += [
        _linear("attention", layer, kv_lora + rope, h),  # kv_a_proj_with_mqa
        _vector("attention", layer, kv_lora),  # kv_a_layernorm
        _linear("attention", layer, heads * (c["qk_nope_head_dim"] + c["v_head_dim"]), kv_lora),
        _linear("attention", layer, h, heads * c["v_head_dim"]),  # o_proj
    ]
    return out


def _gqa_attention(c: dict[str, Any], layer: int) -> list[Tensor]:
    h, heads = c["hidden_size"], c["num_attention_heads"]
    kv, hd = c.get("num_key_value_heads") or heads, c.get("head_dim") or h // heads
    out = [
        _linear("attention", layer, heads * hd, h),
        _linear("attention", layer, kv * hd, h),
        _linear("attention", layer, kv * hd, h),
        _linear("attention", layer, h, heads * hd),
    ]
    if c.get("attention_bias", c.get("model_type") in ("qwen2", "qwen2_moe")):
        out += [_vector("attention", layer, n) for n in (heads * hd, kv * hd, kv * hd)]
    if str(c.get("model_type", "")).startswith("qwen3"):
        out += [_vector("attention", layer, hd), _vector("attention", layer, hd)]  # q/k norm
    return out


def _is_moe_layer(c: dict[str, Any], layer: int, experts: int) -> bool:
    if not experts:
        return False
    if "kv_lora_rank" in c:  # DeepSeek-V2/V3, Kimi-K2
        return (
            layer >= c.get("first_k_dense_replace", 0) and layer % c.get("moe_layer_freq", 1) == 0
        )
    if layer in (c.get("mlp_only_layers") or []):
        return False
    return (layer + 1) % c.get("decoder_sparse_step", 1) == 0


def _moe(c: dict[str, Any], layer: int, experts: int) -> list[Tensor]:
    h = c["hidden_size"]
    inter = c.get("moe_intermediate_size") or c["intermediate_size"]
    out = [_linear("router", layer, experts, h)]
    if "kv_lora_rank" in c and c.get("topk_method", "noaux_tc") == "noaux_tc":
        out.append(_vector("router", layer, experts))  # DeepSeek-V3's e_score_correction_bias
    shared = (c.get("n_shared_experts") or 0) * inter or c.get("shared_expert_intermediate_size", 0)
    if shared:
        out += _mlp("shared_expert", layer, h, shared)
        if "shared_expert_intermediate_size" in c:  # Qwen2-MoE's shared_expert_gate
            out.append(_linear("shared_expert", layer, 1, h))
    for e in range(experts):
        out += _mlp("routed_expert", layer, h, inter, e)
    return out


def model_tensors(config: dict[str, Any]) -> list[Tensor]:
    """Every tensor an HF checkpoint of ``config`` holds (what a sync sends), in HF order.

    DeepSeek-V2/V3 style (MLA: ``kv_lora_rank``; Kimi-K2) and Llama/Qwen2/Qwen3/Qwen3-MoE/
    Qwen2-MoE/Mixtral style (GQA). Multi-token-prediction layers are not synced (left out).
    """
    c = config.get("text_config") or config
    missing = [
        k
        for k in ("hidden_size", "num_hidden_layers", "vocab_size", "num_attention_heads")
        if k not in c
    ]
    if missing:
        raise ValueError(
            f"the HF config has no {', '.join(missing)}; pass a decoder LM's config.json"
        )
    experts = c.get("n_routed_experts") or c.get("num_experts") or c.get("num_local_experts") or 0
    attention = _mla_attention if "kv_lora_rank" in c else _gqa_attention
    h, vocab = c["hidden_size"], c["vocab_size"]
    out = [_linear("embedding", None, vocab, h)]
    for layer in range(c["num_hidden_layers"]):
        out += [_vector("norms", layer, h), _vector("norms", layer, h)]
        out += attention(c, layer)
        if _is_moe_layer(c, layer, experts):
            out += _moe(c, layer, experts)
        else:
            out += _mlp("dense_mlp", layer, h, c["intermediate_size"])
    out.append(_vector("norms", None, h))
    if not c.get("tie_word_embeddings", False):
        out.append(_linear("lm_head", None, vocab, h))
    return out


def num_experts(tensors: Iterable[Tensor]) -> int:
    return 1 + max((t.expert for t in tensors if t.expert is not None), default=-1)


def tensor_bytes(t: Tensor, dtype: str) -> int:
    """bf16: 2 bytes a parameter. fp8: linear weights 1 byte plus one fp32 scale per 128x128
    block (DeepSeek-V3's format), embeddings, norms and routers stay bf16."""
    if dtype == "fp8" and t.linear and t.group not in ("embedding", "lm_head", "router"):
        rows, cols = t.shape
        return t.numel + 4 * (-(-rows // 128)) * (-(-cols // 128))
    return 2 * t.numel


# ---- trainer layout and senders --------------------------------------------------------------


@dataclass(frozen=True)
class Layout:
    """Megatron's parallel sizes: ``dp`` is the (dense) data-parallel size, so the trainer has
    pp x tp x dp GPUs, and each stage's tp x dp GPUs also hold ep x etp x edp expert shards."""

    pp: int = 16
    tp: int = 1
    dp: int = 16
    ep: int = 16
    etp: int = 1
    last_stage_layers: int | None = None

    def __post_init__(self) -> None:
        for k in ("pp", "tp", "dp", "ep", "etp"):
            if getattr(self, k) < 1:
                raise ValueError(f"--{k} must be at least 1")
        if (self.tp * self.dp) % (self.ep * self.etp):
            raise ValueError(
                f"ep x etp ({self.ep} x {self.etp}) must divide tp x dp ({self.tp} x {self.dp}), "
                "as in megatron-core; raise --dp or lower --ep"
            )

    @property
    def gpus(self) -> int:
        return self.pp * self.tp * self.dp

    @property
    def edp(self) -> int:
        return self.tp * self.dp // (self.ep * self.etp)

    def stage_layers(self, layers: int) -> list[int]:
        """Layers per stage, as megatron-core splits them: evenly, or with
        ``decoder_last_pipeline_num_layers`` on the last stage and the rest even (default: the
        last-stage count nearest an even share, fewer on a tie: it also holds the lm_head)."""
        if layers < self.pp:
            raise ValueError(f"{layers} layers cannot fill --pp {self.pp} stages")
        last = self.last_stage_layers
        if last is None:
            if layers % self.pp == 0:
                return [layers // self.pp] * self.pp
            shares = range(1, (layers - 1) // (self.pp - 1) + 1)
            lasts = [layers - (self.pp - 1) * k for k in shares]
            last = min(lasts, key=lambda n: (abs(n - layers / self.pp), n))
        rest = layers - last
        if self.pp == 1:
            if last != layers:
                raise ValueError(f"--last-stage-layers must be {layers} with --pp 1")
            return [layers]
        if last < 1 or rest < self.pp - 1 or rest % (self.pp - 1):
            raise ValueError(
                f"--last-stage-layers {last}: the other {rest} layers must split evenly over "
                f"{self.pp - 1} stages, at least one each"
            )
        return [rest // (self.pp - 1)] * (self.pp - 1) + [last]


@dataclass
class Sender:
    """What one trainer rank sends in one sync (its share, once; it goes to every engine)."""

    stage: int
    ep_rank: int
    nbytes: int = 0
    local_bytes: int = 0  # held by this rank before the TP / expert-TP gather
    tensors: int = 0
    buckets: int = 0
    _open: int = 0  # bytes in the bucket being filled

    def add(self, nbytes: int, local: int, bucket_bytes: int) -> None:
        if self.buckets == 0 or self._open + nbytes > bucket_bytes:
            self.buckets, self._open = self.buckets + 1, 0
        self._open += nbytes
        self.nbytes, self.local_bytes, self.tensors = (
            self.nbytes + nbytes, self.local_bytes + local, self.tensors + 1
        )  # fmt: skip

    @property
    def gather_bytes(self) -> int:
        return self.nbytes - self.local_bytes

    def sent_bytes(self, engines: int) -> int:
        """Bytes it delivers in one sync: its share to each engine replica."""
        return self.nbytes * engines


def senders(tensors: list[Tensor], layout: Layout, bucket_bytes: int, dtype: str) -> list[Sender]:
    """The ranks that talk to the engines under the issue-18 design, with their loads."""
    layers = 1 + max(t.layer for t in tensors if t.layer is not None)
    stage_of: list[int] = []
    for stage, n in enumerate(layout.stage_layers(layers)):
        stage_of += [stage] * n
    experts = num_experts(tensors)
    if experts % layout.ep:
        raise ValueError(f"--ep {layout.ep} must divide the model's {experts} routed experts")
    if layout.ep > 1 and not experts:
        raise ValueError("a dense model has no experts to spread; use --ep 1")
    per_rank = experts // layout.ep if experts else 1
    out = {(s, r): Sender(s, r) for s in range(layout.pp) for r in range(layout.ep)}
    for t in tensors:
        if t.layer is not None:
            stage = stage_of[t.layer]
        else:
            stage = 0 if t.group == "embedding" else layout.pp - 1
        n = tensor_bytes(t, dtype)
        if t.expert is not None:
            out[stage, t.expert // per_rank].add(n, n // layout.etp, bucket_bytes)
        else:
            out[stage, 0].add(n, n // layout.tp, bucket_bytes)
    return [s for s in out.values() if s.tensors]


def funnel(
    tensors: list[Tensor], titan: list[Sender], bucket_bytes: int, dtype: str
) -> list[Sender]:
    """The old design: trainer rank 0 gathers every tensor and sends it all."""
    rank0 = Sender(0, 0)
    for t in tensors:
        rank0.add(tensor_bytes(t, dtype), 0, bucket_bytes)
    rank0.local_bytes = next(s.local_bytes for s in titan if (s.stage, s.ep_rank) == (0, 0))
    return [rank0]


# ---- rates measured here ---------------------------------------------------------------------


@dataclass(frozen=True)
class Rates:
    link: float  # bytes/s per GPU and direction
    stage: float  # bytes/s of flatten_into
    per_tensor_s: float  # flatten_into's fixed cost per tensor
    latency_s: float  # one update request, waited for by its sender
    service_s: float  # one update request's share of the engine's time under load


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _best(fn: Callable[[], Any], device: torch.device, window_s: float) -> float:
    """Fastest of the calls made in ``window_s`` (at least 5): on a shared machine the
    fastest is the one least disturbed."""
    fn()  # touch pages, warm caches
    best, calls, end = float("inf"), 0, time.perf_counter() + window_s
    while calls < 5 or time.perf_counter() < end:
        _synchronize(device)
        t0 = time.perf_counter()
        fn()
        _synchronize(device)
        best, calls = min(best, time.perf_counter() - t0), calls + 1
    return best


def measure_staging(
    device: torch.device, nbytes: int, window_s: float = 2.0
) -> tuple[float, float]:
    """flatten_into's throughput (bytes/s: 8 bf16 tensors of nbytes in all) and its fixed cost
    per tensor (s: 2,000 one-element tensors)."""
    from titan_rl.wire.bucket import flatten_into

    n = max(nbytes // 16, 1)
    big = [(f"t{i}", torch.ones(n, dtype=torch.bfloat16, device=device)) for i in range(8)]
    buf = torch.empty(16 * n, dtype=torch.uint8, device=device)
    throughput = 16 * n / _best(lambda: flatten_into(buf, big), device, window_s)
    tiny = [(f"t{i}", torch.ones(1, dtype=torch.bfloat16, device=device)) for i in range(2000)]
    per_tensor = _best(lambda: flatten_into(buf, tiny), device, window_s / 4) / len(tiny)
    return throughput, per_tensor


def measure_requests(calls: int = 100, clients: int = 4) -> tuple[float, float]:
    """An update request to a real built-in engine: latency (median of ``calls`` one at a
    time) and service time (wall / calls with ``clients`` sending at once, best of 3 rounds)."""
    import httpx
    import torch.multiprocessing as mp
    from transformers import Qwen3Config, Qwen3ForCausalLM
    from transformers.utils import logging as hf_logging

    from titan_core.net import free_port
    from titan_rl.wire.bucket import flatten_into
    from titan_rl.wire.payload import dumps_bucket

    mp.set_sharing_strategy("file_system")
    tmp = Path(tempfile.mkdtemp(prefix="titan-sync-scale-"))
    cfg = Qwen3Config(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16, tie_word_embeddings=False,
    )  # fmt: skip
    hf_logging.disable_progress_bar()
    Qwen3ForCausalLM(cfg).save_pretrained(tmp)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    engine = subprocess.Popen(
        [sys.executable, "-m", "titan_rl.engine", "--model-path", str(tmp), "--port", str(port),
         "--num-threads", "1", "--skip-tokenizer-init"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=REPO,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while True:
            if engine.poll() is not None:
                raise RuntimeError(f"the built-in engine exited with {engine.returncode}")
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError("the built-in engine did not start within 120 s")
            time.sleep(0.2)
        buf = torch.empty(4096, dtype=torch.uint8).share_memory_()
        weight = torch.ones(cfg.hidden_size)

        def call(client: httpx.Client) -> float:
            t0 = time.perf_counter()
            flat, meta = flatten_into(buf, [("model.norm.weight", weight)])
            payload = {
                "serialized_named_tensors": [dumps_bucket(flat, meta)],
                "load_format": "flattened_bucket",
                "flush_cache": False,
            }
            r = client.post(f"{url}/update_weights_from_tensor", json=payload)
            if r.status_code != 200:
                raise RuntimeError(f"update_weights_from_tensor: {r.status_code} {r.text[:200]}")
            return time.perf_counter() - t0

        with httpx.Client(timeout=60) as client:
            call(client)
            latency = statistics.median(call(client) for _ in range(calls))
        pool_clients = [httpx.Client(timeout=60) for _ in range(clients)]
        service = float("inf")
        with ThreadPoolExecutor(clients) as pool:
            for _ in range(3):  # the least disturbed of three rounds
                t0 = time.perf_counter()
                list(pool.map(call, [pool_clients[i % clients] for i in range(calls)]))
                service = min(service, (time.perf_counter() - t0) / calls)
        for c in pool_clients:
            c.close()
        return latency, service
    finally:
        engine.terminate()
        engine.wait(30)
        shutil.rmtree(tmp, ignore_errors=True)


# ---- projection ------------------------------------------------------------------------------


@dataclass
class Projection:
    send: dict[str, float]  # the critical sender's terms (distributed: summed over senders)
    receive: dict[str, float]  # one engine GPU's terms

    @property
    def send_s(self) -> float:
        return sum(self.send.values())

    @property
    def receive_s(self) -> float:
        return sum(self.receive.values())

    @property
    def total_s(self) -> float:
        return max(self.send_s, self.receive_s)

    @property
    def dominant(self) -> str:
        side, terms = (
            ("send", self.send) if self.send_s >= self.receive_s else ("receive", self.receive)
        )
        return f"{side}: {max(terms, key=terms.__getitem__)}"


def _send_terms(s: Sender, r: Rates, wire_bytes: int) -> dict[str, float]:
    return {
        "gather": s.gather_bytes / r.link,
        "staging": s.nbytes / r.stage + s.tensors * r.per_tensor_s,
        "wire": wire_bytes / r.link,
        "requests": s.buckets * r.latency_s,
    }


def project(
    transport: str,
    sends: list[Sender],
    engines: int,
    engine_size: int,
    r: Rates,
    *,
    old: bool = False,
) -> Projection:
    """One sync's time under the model in this module's docstring (``old``: the funnel's one
    group per engine for ``distributed``)."""
    model = sum(s.nbytes for s in sends)
    share = model / engine_size
    requests = sum(s.buckets for s in sends) * r.service_s
    load = share / r.stage
    if transport == "mooncake":
        per = [_send_terms(s, r, s.sent_bytes(engines)) for s in sends]
        send = max(per, key=lambda d: sum(d.values()))
        return Projection(send, {"wire": share / r.link, "load": load, "requests": requests})
    if transport == "distributed":
        per = [_send_terms(s, r, s.sent_bytes(engines if old else 1)) for s in sends]
        send = {k: sum(d[k] for d in per) for k in per[0]}
        return Projection(send, {"wire": model / r.link, "load": load, "requests": requests})
    if transport == "tensor":
        per = [_send_terms(s, r, 0) for s in sends]
        send = max(per, key=lambda d: sum(d.values()))
        del send["wire"]
        return Projection(send, {"load": load, "requests": requests})
    raise ValueError(f"unknown transport {transport!r}; use mooncake, distributed or tensor")


# ---- report ----------------------------------------------------------------------------------


def _fmt(terms: dict[str, float]) -> str:
    return ", ".join(f"{k} {v:.2f}" for k, v in terms.items())


def print_model(tensors: list[Tensor], dtype: str) -> int:
    groups: dict[str, list[int]] = {}
    for t in tensors:
        g = groups.setdefault(t.group, [0, 0, 0])
        g[0] += 1
        g[1] += t.numel
        g[2] += tensor_bytes(t, dtype)
    print(f"{'group':<15}{'tensors':>9}{'params':>18}{'GB on the wire':>16}")
    for name, (n, p, b) in groups.items():
        print(f"{name:<15}{n:>9,}{p:>18,}{b / 1e9:>16.2f}")
    params, nbytes = sum(g[1] for g in groups.values()), sum(g[2] for g in groups.values())
    print(f"{'total':<15}{len(tensors):>9,}{params:>18,}{nbytes / 1e9:>16.2f}")
    print(f"total params: {params:,} ({params / 1e12:.3f}e12); {dtype}: {nbytes / 1e9:.1f} GB")
    return params


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--hf-config", type=Path, default=None, help="config.json (default: Kimi-K2)")
    ap.add_argument("--pp", type=int, default=16)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--dp", type=int, default=16, help="megatron's data-parallel size")
    ap.add_argument("--ep", type=int, default=16)
    ap.add_argument("--etp", type=int, default=1)
    ap.add_argument("--last-stage-layers", type=int, default=None)
    ap.add_argument("--engines", type=int, default=8, help="engine replicas")
    ap.add_argument("--engine-size", type=int, default=32, help="GPUs (TP/EP size) per engine")
    ap.add_argument("--link-gbps", type=float, default=400.0, help="per GPU and direction")
    ap.add_argument("--dtype", choices=["bf16", "fp8"], default="bf16")
    ap.add_argument("--bucket-mib", type=int, default=512)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument(
        "--copy-gbps", type=float, default=None,
        help="staging/load copy GB/s to use instead of measuring it on --device (e.g. a GPU's)",
    )  # fmt: skip
    ap.add_argument(
        "--request-ms", type=float, nargs=2, default=None, metavar=("LATENCY", "SERVICE"),
        help="use these instead of measuring the built-in engine (e.g. SGLang's)",
    )  # fmt: skip
    return ap


def measure(a: argparse.Namespace, bucket: int) -> Rates:
    """The rates that do not depend on the network: measured here unless given."""
    t0 = time.perf_counter()
    stage, per_tensor = measure_staging(torch.device(a.device), min(bucket, 64 << 20))
    copy = f"{stage / 1e9:.2f} GB/s ({a.device}, {torch.get_num_threads()} threads)"
    if a.copy_gbps:
        stage, copy = a.copy_gbps * 1e9, f"{a.copy_gbps:g} GB/s (given; measured {copy})"
    if a.request_ms:
        (latency, service), where = (x / 1e3 for x in a.request_ms), "given"
    else:
        (latency, service), where = measure_requests(), "built-in engine, measured"
    print(
        f"\nrates ({time.perf_counter() - t0:.0f} s to measure): staging copy {copy} + "
        f"{per_tensor * 1e6:.1f} us/tensor; update request ({where}) latency "
        f"{latency * 1e3:.2f} ms, service {service * 1e3:.2f} ms"
    )
    return Rates(a.link_gbps * 1e9 / 8, stage, per_tensor, latency, service)


def print_layout(
    a: argparse.Namespace, layout: Layout, layers: list[int], titan: list[Sender], old: Sender
) -> None:
    model = sum(s.nbytes for s in titan)
    print(
        f"\ntrainer: PP {a.pp} x TP {a.tp} x DP {a.dp} = {layout.gpus} GPUs (EP {a.ep} x ETP "
        f"{a.etp} x EDP {layout.edp} per stage); layers per stage {layers}"
    )
    print(
        f"engines: {a.engines} x {a.engine_size} GPUs = {a.engines * a.engine_size}; link "
        f"{a.link_gbps:g} Gb/s per GPU and direction; buckets of {a.bucket_mib} MiB"
    )
    top = max(titan, key=lambda s: s.nbytes)
    print(
        f"senders: {len(titan)} (funnel: 1); max bytes sent by one trainer rank: "
        f"{top.sent_bytes(a.engines) / 1e9:.1f} GB (stage {top.stage}, EP rank {top.ep_rank}: "
        f"{top.nbytes / model:.4f} of the model to each of {a.engines} engines); funnel: "
        f"{old.sent_bytes(a.engines) / 1e9:.0f} GB (the model to each engine)"
    )
    print(
        f"update requests each engine applies: {sum(s.buckets for s in titan)} (funnel: {old.buckets})"
    )


def print_projections(
    a: argparse.Namespace, titan: list[Sender], old: list[Sender], rates: Rates, colocated: bool
) -> dict[str, float]:
    results: dict[str, float] = {}
    print("\nprojected sync time, s (send side: the slowest sender; receive side: one engine GPU)")
    for transport in ("mooncake", "distributed", "tensor"):
        if transport == "tensor" and not colocated:
            print(f"{transport}: n/a (colocated needs engines x engine-size == trainer GPUs)")
            continue
        new = project(transport, titan, a.engines, a.engine_size, rates)
        anchor = project(transport, old, a.engines, a.engine_size, rates, old=True)
        results[transport] = new.total_s
        print(
            f"{transport}: {new.total_s:.2f} s = {new.total_s / anchor.total_s:.3f} x funnel "
            f"({anchor.total_s:.1f} s); dominant {new.dominant}\n"
            f"  send {new.send_s:.2f} ({_fmt(new.send)}) | receive {new.receive_s:.2f} "
            f"({_fmt(new.receive)})\n"
            f"  funnel: send {anchor.send_s:.1f} ({_fmt(anchor.send)}) | receive "
            f"{anchor.receive_s:.1f}; dominant {anchor.dominant}"
        )
    return results


def main(argv: list[str] | None = None) -> None:
    ap = _parser()
    a = ap.parse_args(argv)
    if min(a.engines, a.engine_size, a.bucket_mib) < 1 or a.link_gbps <= 0:
        ap.error("--engines, --engine-size, --bucket-mib and --link-gbps must be positive")
    bucket = a.bucket_mib << 20
    try:
        layout = Layout(a.pp, a.tp, a.dp, a.ep, a.etp, a.last_stage_layers)
        config = json.loads(a.hf_config.read_text()) if a.hf_config else KIMI_K2
        tensors = model_tensors(config)
        titan = senders(tensors, layout, bucket, a.dtype)
    except (ValueError, OSError) as e:
        ap.error(str(e))
    old = funnel(tensors, titan, bucket, a.dtype)

    print(f"model: {a.hf_config or 'Kimi-K2 (moonshotai/Kimi-K2-Instruct config.json)'}")
    print_model(tensors, a.dtype)
    layers = layout.stage_layers(1 + max(t.layer for t in tensors if t.layer is not None))
    print_layout(a, layout, layers, titan, old[0])
    rates = measure(a, bucket)
    colocated = a.engines * a.engine_size == layout.gpus
    results = print_projections(a, titan, old, rates, colocated)

    sweep = []
    for mib in (a.bucket_mib * 2, a.bucket_mib * 4, a.bucket_mib * 8):
        p = project(
            "mooncake",
            senders(tensors, layout, mib << 20, a.dtype),
            a.engines,
            a.engine_size,
            rates,
        )
        sweep.append(f"{mib} MiB {p.total_s:.2f} s ({p.dominant})")
    print(f"mooncake with larger buckets: {'; '.join(sweep)}")

    print("\npublic figures (quoted, not measured here; other hardware and layouts):")
    for who, what, s in QUOTED:
        ratio = f"; Titan mooncake projected / quoted = {results['mooncake'] / s:.2f}"
        print(f"  {who}: {s:g} s ({what}){ratio if a.hf_config is None else ''}")
    goal = f"goal on paper: < {GOAL_S:g} s on {GOAL_GPUS} trainer GPUs at {GOAL_GBPS:g} Gb/s (mooncake)"
    if layout.gpus == GOAL_GPUS and a.link_gbps == GOAL_GBPS:
        verdict = "met" if results["mooncake"] < GOAL_S else "NOT met"
        print(f"{goal}: {verdict} ({results['mooncake']:.2f} s)")
    else:
        print(f"{goal}: not this layout ({layout.gpus} GPUs at {a.link_gbps:g} Gb/s)")


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
