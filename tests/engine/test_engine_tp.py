"""The built-in engine with ``--tp-size 2``: the same logprobs, tokens and routed experts as at
TP=1 (fp32, within 1e-5), weight updates by every transport land on every TP rank, full
tensors read back, and its failures named (entry count, heads, a worker that cannot load).

Tiny random fp32 models: a dense Qwen3 (4 heads, 2 KV heads) and a Qwen3-MoE (4 experts,
top-2, one dense layer). Each TP=2 engine is TP rank 0 in this process plus one worker process."""

from __future__ import annotations

import base64
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import pytest
import torch
from fastapi.testclient import TestClient

from titan_core.net import free_port
from titan_rl.actors.config import EngineServerConfig
from titan_rl.actors.server import build_command
from titan_rl.engine.core import Engine
from titan_rl.engine.server import create_app
from titan_rl.rollout.tensor_payload import serialize_named_tensors

VOCAB, LAYERS, EXPERTS, TOP_K = 160, 3, 4, 2
TOL = 1e-5


def _save(path: Path, moe: bool, seed: int) -> Path:
    """A random fp32 model (routers with clear preferences, so no expert is a near-tie)."""
    import transformers as tf

    kw = dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=LAYERS,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=128,
        eos_token_id=VOCAB - 1, tie_word_embeddings=False, dtype="float32",
    )  # fmt: skip
    torch.manual_seed(seed)
    if moe:
        cfg = tf.Qwen3MoeConfig(
            **kw, num_experts=EXPERTS, num_experts_per_tok=TOP_K, moe_intermediate_size=32,
            norm_topk_prob=True, mlp_only_layers=[1],
        )  # fmt: skip
        model = tf.Qwen3MoeForCausalLM(cfg)
    else:
        model = tf.Qwen3ForCausalLM(tf.Qwen3Config(**kw))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.normal_(0, 0.5)
            elif "norm" not in name:  # larger than HF's init: logprobs far from uniform
                p.normal_(0, 0.08)
    model.save_pretrained(path)
    return path


def _engine(path: Path, tp: int) -> Engine:
    return Engine(str(path), dtype="float32", num_threads=tp, load_tokenizer=False, tp_size=tp)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tp")
    return {"dense": _save(root / "dense", False, 0), "moe": _save(root / "moe", True, 1)}


@pytest.fixture(scope="module")
def clients(dirs: dict[str, Path]) -> Iterator[dict[tuple[str, int], TestClient]]:
    """TP=1 and TP=2 engines of each model, behind the HTTP app."""
    engines = {(kind, tp): _engine(path, tp) for kind, path in dirs.items() for tp in (1, 2)}
    out = {key: TestClient(create_app(e)) for key, e in engines.items()}
    try:
        for c in out.values():
            c.__enter__()
        yield out
    finally:
        for c in out.values():
            c.__exit__(None, None, None)
        for e in engines.values():
            e.shutdown()


def _prompts(seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, VOCAB - 1, size=n).tolist() for n in (3, 6, 6, 9)]


def generate(client: TestClient, prompts: list[list[int]], moe: bool) -> list[dict[str, Any]]:
    resp = client.post(
        "/generate",
        json={
            "input_ids": prompts,
            "sampling_params": {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True},
            "return_logprob": True,
            "logprob_start_len": 0,
            "return_routed_experts": moe,
        },
    )
    assert resp.status_code == 200, resp.text
    return resp.json()


def logprobs(out: dict[str, Any]) -> np.ndarray:
    meta = out["meta_info"]
    rows = meta["input_token_logprobs"][1:] + meta["output_token_logprobs"]
    return np.array([lp for lp, _, _ in rows])


def max_diff(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> float:
    """Max |logprob diff| over prompt and output tokens; the tokens must be the same."""
    assert [o["output_ids"] for o in a] == [o["output_ids"] for o in b]
    return max(float(np.abs(logprobs(x) - logprobs(y)).max()) for x, y in zip(a, b, strict=True))


def routed(out: dict[str, Any]) -> np.ndarray:
    return np.frombuffer(base64.b64decode(out["meta_info"]["routed_experts"]), dtype="<i4")


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_tp2_equals_tp1(clients: dict, kind: str, seed: int = 3) -> None:
    moe = kind == "moe"
    prompts = _prompts(seed)
    one = generate(clients[kind, 1], prompts, moe)
    two = generate(clients[kind, 2], prompts, moe)
    diff = max_diff(one, two)
    print(f"{kind}: TP=2 vs TP=1 max |logprob diff| {diff:.3g}")
    assert diff < TOL
    if moe:
        for a, b, p in zip(one, two, prompts, strict=True):
            assert routed(a).size == (len(p) + len(a["output_ids"]) - 1) * LAYERS * TOP_K
            np.testing.assert_array_equal(routed(a), routed(b))


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_tp2_chunked_prefill_equals_tp1_whole(clients: dict, kind: str, seed: int = 4) -> None:
    """Every TP rank's runner takes the prompt's chunks (``--chunked-prefill-size``): prompts
    prefilled 8 tokens an iteration at TP=2 give TP=1's whole-prompt output and experts."""
    moe = kind == "moe"
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(0, VOCAB - 1, size=n).tolist() for n in (50, 9, 23)]
    engine = clients[kind, 2].app.state.server.engine
    size = engine.chunked_prefill_size
    engine.call(lambda: setattr(engine, "chunked_prefill_size", 8)).result(timeout=30)
    try:
        chunks = engine.prefill_chunks
        two = generate(clients[kind, 2], prompts, moe)
        assert engine.prefill_chunks - chunks >= 50 // 8 + 23 // 8
    finally:
        engine.call(lambda: setattr(engine, "chunked_prefill_size", size)).result(timeout=30)
    one = generate(clients[kind, 1], prompts, moe)
    assert max_diff(one, two) < TOL
    if moe:
        for a, b in zip(one, two, strict=True):
            np.testing.assert_array_equal(routed(a), routed(b))


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_tp2_copies_of_a_prompt_each_equal_it_alone_at_tp1(
    clients: dict, kind: str, seed: int = 6
) -> None:
    """Equal prompts in one batch are prefilled once on every TP rank (one cache row each):
    every copy gives what its prompt gives alone at TP=1, experts too."""
    moe = kind == "moe"
    p, q = _prompts(seed)[1:3]
    engine = clients[kind, 2].app.state.server.engine
    chunks = engine.prefill_chunks
    two = generate(clients[kind, 2], [p, q, p, p, q], moe)
    assert engine.prefill_chunks - chunks == 1  # one forward: 2 rows for 5 prompts
    alone = {tuple(x): generate(clients[kind, 1], [x], moe)[0] for x in (p, q)}
    want = [alone[tuple(x)] for x in (p, q, p, p, q)]
    assert max_diff(want, two) < TOL
    if moe:
        for a, b in zip(want, two, strict=True):
            np.testing.assert_array_equal(routed(a), routed(b))


def test_server_info_reports_tp_size(clients: dict) -> None:
    for (_, tp), client in clients.items():
        assert client.get("/get_server_info").json()["tp_size"] == tp


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_get_weights_by_name_returns_the_full_tensor(clients: dict, dirs: dict, kind: str) -> None:
    """TP=2 answers the whole tensor, as the unsharded TP=1 engine (loaded alike) does."""
    from safetensors.torch import load_file

    names = list(load_file(str(dirs[kind] / "model.safetensors")))
    sharded = [n for n in names if any(k in n for k in ("_proj", "experts"))]
    assert len(sharded) > 10
    for name in [*sharded, "model.embed_tokens.weight", "model.layers.0.self_attn.q_norm.weight"]:
        body = {"name": name, "truncate_size": 10**7}
        one, two = (clients[kind, tp].post("/get_weights_by_name", json=body) for tp in (1, 2))
        assert two.status_code == 200, two.text
        assert one.json() == two.json(), name


def _state(path: Path) -> list[tuple[str, torch.Tensor]]:
    from safetensors.torch import load_file

    return sorted(load_file(str(path / "model.safetensors")).items())


def _trainer(ports: list[int], path: str, groups: list[str], formats: list[str | None]) -> None:
    """The trainer side (group rank 0) of two weight-update groups, one half of the
    tensors each, used one after the other (as one group per pipeline stage)."""
    from titan_rl.wire.group import (
        broadcast_named_tensors,
        destroy_weights_update_group,
        init_weights_update_group,
    )

    named = _state(Path(path))
    halves = [named[: len(named) // 2], named[len(named) // 2 :]]
    pgs = [
        init_weights_update_group("127.0.0.1", port, 0, 3, g, "gloo", 60)
        for port, g in zip(ports, groups, strict=True)
    ]
    for pg, half, fmt in zip(pgs, halves, formats, strict=True):
        broadcast_named_tensors(pg, half, fmt)
    for pg in pgs:
        destroy_weights_update_group(pg)


def _update_distributed(client: TestClient, path: Path) -> None:
    groups, formats = ["titan-pp_0", "titan-pp_1"], [None, "flattened_bucket"]
    ports = [free_port(), free_port()]  # each group's store has its own port
    trainer = mp.get_context("spawn").Process(
        target=_trainer, args=(ports, str(path), groups, formats)
    )
    trainer.start()
    try:
        for port, g in zip(ports, groups, strict=True):
            resp = client.post(
                "/init_weights_update_group",
                json={"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1,
                      "world_size": 3, "group_name": g, "backend": "gloo"},
            )  # fmt: skip
            assert resp.status_code == 200, resp.text
        named = _state(path)
        halves = [named[: len(named) // 2], named[len(named) // 2 :]]
        for g, half, fmt in zip(groups, halves, formats, strict=True):
            resp = client.post(
                "/update_weights_from_distributed",
                json={"names": [n for n, _ in half], "dtypes": ["float32"] * len(half),
                      "shapes": [list(t.shape) for _, t in half], "group_name": g,
                      "load_format": fmt},
            )  # fmt: skip
            assert resp.status_code == 200, resp.text
        for g in groups:
            resp = client.post("/destroy_weights_update_group", json={"group_name": g})
            assert resp.status_code == 200, resp.text
    finally:
        trainer.join(60)
    assert trainer.exitcode == 0


def _update(client: TestClient, path: Path, transport: str) -> None:
    if transport == "distributed":
        _update_distributed(client, path)
        return
    if transport == "disk":
        body: dict[str, Any] = {"model_path": str(path)}
        resp = client.post("/update_weights_from_disk", json=body)
    else:
        fmt = "flattened_bucket" if transport == "tensor_bucket" else None
        # one payload per TP rank, each its own dump (a dump is loaded once)
        payloads = [serialize_named_tensors(_state(path), fmt) for _ in range(2)]
        body = {"serialized_named_tensors": [p for p, _ in payloads], "load_format": fmt}
        resp = client.post("/update_weights_from_tensor", json=body)
    assert resp.status_code == 200 and resp.json()["success"], resp.text


@pytest.mark.parametrize(
    "transport, seed", [("tensor", 11), ("tensor_bucket", 12), ("disk", 13), ("distributed", 14)]
)
def test_weight_update_at_tp2_equals_tp1_loaded_alike(
    clients: dict, tmp_path: Path, transport: str, seed: int
) -> None:
    new = _save(tmp_path / "new", moe=True, seed=seed)
    one, two = clients["moe", 1], clients["moe", 2]
    prompts = _prompts(seed)
    before = generate(two, prompts, True)
    _update(one, new, "disk")
    _update(two, new, transport)
    after_one, after_two = generate(one, prompts, True), generate(two, prompts, True)
    assert max_diff(after_one, after_two) < TOL
    for a, b in zip(after_one, after_two, strict=True):
        np.testing.assert_array_equal(routed(a), routed(b))
    changed = max(
        float(np.abs(logprobs(x)[: len(p) - 1] - logprobs(y)[: len(p) - 1]).max())
        for x, y, p in zip(before, after_two, prompts, strict=True)
    )
    assert changed > 100 * TOL  # the update took effect on every rank
    weight = "model.layers.0.self_attn.o_proj.weight"
    got = two.post("/get_weights_by_name", json={"name": weight, "truncate_size": 10**7})
    assert torch.equal(torch.tensor(got.json()), dict(_state(new))[weight].flatten())


def test_released_weights_come_back_on_every_rank(clients: dict, dirs: dict) -> None:
    """Release and resume reach the worker (its weights are NaN until the next update)."""
    one, two = clients["dense", 1], clients["dense", 2]
    prompts = _prompts(21)
    want = generate(one, prompts, False)
    for route in ("/release_memory_occupation", "/resume_memory_occupation"):
        assert two.post(route, json={}).status_code == 200
    _update(two, dirs["dense"], "tensor")
    assert max_diff(want, generate(two, prompts, False)) < TOL


def test_tensor_update_needs_one_entry_per_tp_rank(clients: dict, dirs: dict) -> None:
    payload, _keep = serialize_named_tensors(_state(dirs["dense"])[:1])
    resp = clients["dense", 2].post(
        "/update_weights_from_tensor", json={"serialized_named_tensors": [payload]}
    )
    assert resp.status_code == 400
    assert (
        "tp_size 2" in resp.json()["message"]
        and "1 serialized_named_tensors" in (resp.json()["message"])
    )


def test_heads_not_divisible_fail_at_start_up(dirs: dict) -> None:
    with pytest.raises(ValueError, match=r"--tp-size 3 does not divide the model's 4 attention"):
        _engine(dirs["dense"], 3)
    from titan_rl.engine.cli import main

    # python -m titan_rl.engine runs this main: the message goes to stderr, exit status 1
    with pytest.raises(
        SystemExit, match=r"error: --tp-size 3 does not divide the model's 4 attention heads"
    ):
        main(["--model-path", str(dirs["dense"]), "--tp-size", "3", "--port", str(free_port())])


def test_a_worker_that_cannot_load_fails_start_up(tmp_path: Path) -> None:
    from titan_rl.engine.tp.comm import Comm
    from titan_rl.engine.tp.leader import Workers

    workers = Workers(str(tmp_path / "missing"), "float32", 2, 1)
    try:
        with pytest.raises(ValueError, match="engine TP rank 1 failed to start: OSError"):
            workers.connect(Comm())
    finally:
        workers.close()


def test_single_process_and_tp_runners_share_one_interface() -> None:
    """The engine runs its model through ``Runner`` only: the single-process runner and the
    TP leader implement every operation of it, with the same parameters."""
    import inspect

    from titan_rl.engine.runner import ModelRunner, Runner
    from titan_rl.engine.tp.leader import TPRunner

    ops = [n for n, v in vars(Runner).items() if not n.startswith("_") and callable(v)]
    assert {"prefill", "decode", "load", "update", "release_weights", "close"} <= set(ops)
    for impl in (ModelRunner, TPRunner):
        assert isinstance(vars(impl).get("alive"), property), impl
        for name in ops:
            want = list(inspect.signature(getattr(Runner, name)).parameters)
            assert list(inspect.signature(getattr(impl, name)).parameters) == want, (impl, name)


def test_builtin_engines_launch_with_tp() -> None:
    launch = EngineServerConfig(model_path="/m", backend="builtin", tp_size=2).launch("cpu")
    cmd = build_command(launch, 30000)
    assert cmd[cmd.index("--tp-size") + 1] == "2"


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


@pytest.mark.slow
def test_workers_exit_with_a_killed_server(dirs: dict) -> None:
    import httpx

    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "titan_rl.engine", "--model-path", str(dirs["dense"]),
         "--port", str(port), "--tp-size", "2", "--num-threads", "2", "--skip-tokenizer-init"],
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])},
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while True:
            assert server.poll() is None, "the server exited"
            try:
                info = httpx.get(f"http://127.0.0.1:{port}/get_server_info", timeout=2).json()
                break
            except httpx.HTTPError:
                assert time.monotonic() < deadline, "the server did not start"
                time.sleep(0.5)
        assert info["tp_size"] == 2
        workers = [p.pid for p in psutil.Process(server.pid).children()]
        assert len(workers) == 1
    finally:
        server.send_signal(signal.SIGKILL)
        server.wait(10)
    deadline = time.monotonic() + 30
    while not all(_gone(pid) for pid in workers):
        assert time.monotonic() < deadline, "the TP worker outlived its server"
        time.sleep(0.2)


class _ThreadGroup:
    """An all-reduce over threads (one per rank) in this process: the sharded forwards of
    every rank side by side without processes."""

    def __init__(self, size: int) -> None:
        self.barrier = threading.Barrier(size)
        self.parts: list[torch.Tensor | None] = [None] * size

    def reduce(self, rank: int) -> Any:
        def all_reduce(t: torch.Tensor) -> torch.Tensor:
            self.parts[rank] = t.clone()
            self.barrier.wait()
            total = sum(self.parts[1:], self.parts[0])  # the same order on every rank
            self.barrier.wait()
            return total

        return all_reduce


def _family(kind: str, seed: int) -> torch.nn.Module:
    import transformers as tf

    kw = dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=8, num_key_value_heads=2, head_dim=8, max_position_embeddings=64,
    )  # fmt: skip
    torch.manual_seed(seed)
    if kind == "llama_bias":  # biases on q/k/v/o and the MLP: row-parallel biases added once
        model = tf.LlamaForCausalLM(tf.LlamaConfig(**kw, attention_bias=True, mlp_bias=True))
    elif kind == "qwen2":
        model = tf.Qwen2ForCausalLM(tf.Qwen2Config(**kw))
    elif kind == "qwen3":
        model = tf.Qwen3ForCausalLM(tf.Qwen3Config(**kw))
    else:
        cfg = tf.Qwen3MoeConfig(
            **kw, num_experts=EXPERTS, num_experts_per_tok=TOP_K, moe_intermediate_size=32,
            mlp_only_layers=[1],
        )  # fmt: skip
        model = tf.Qwen3MoeForCausalLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(0, 0.5 if name.endswith("mlp.gate.weight") else 0.08)
    return model.eval().requires_grad_(False)


@pytest.mark.parametrize(
    "kind, size", [("llama_bias", 2), ("qwen2", 2), ("qwen3", 4), ("qwen3_moe", 2)]
)
def test_shards_of_every_rank_compute_the_full_model(kind: str, size: int, seed: int = 5) -> None:
    """``size`` ranks (4 > 2 KV heads: each KV head replicated on two ranks) give the full
    model's logits, and every sharded tensor joins back to the full one."""
    import copy

    from titan_rl.engine.runner import build_runner
    from titan_rl.engine.weights import checkpoint_tensors

    full = _family(kind, seed)
    ids = torch.tensor(_prompts(seed)[1:3])
    with torch.no_grad():
        want = full(input_ids=ids).logits
    group = _ThreadGroup(size)
    runners = [build_runner(copy.deepcopy(full), r, size, group.reduce(r)) for r in range(size)]
    got: list[torch.Tensor | None] = [None] * size

    def forward(rank: int) -> None:
        with torch.no_grad():
            got[rank] = runners[rank].model(input_ids=ids).logits

    threads = [threading.Thread(target=forward, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    for logits in got:
        assert logits is not None and (logits - want).abs().max() < TOL
    targets = checkpoint_tensors(full)[0]
    assert len(runners[0].splits) > 6
    for name, split in runners[0].splits.items():
        shards = [r.tensor(name) for r in runners]
        assert shards[0].numel() * size == targets[name].numel() or size > split.parts
        assert torch.equal(split.join(shards), targets[name]), name
