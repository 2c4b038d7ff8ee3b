"""Weight sync trainer -> built-in engine, each transport: the engine then scores a probe like
the trainer (|logprob diff| < 1e-4, CPU fp32) and reports the new weight_version; a failing
sync leaves the engine on its old weights and version and names it."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from titan_core.net import free_port
from titan_rl.actors.config import EngineServerConfig
from titan_rl.actors.server import ServerProcess
from titan_rl.rollout import SGLangClient
from titan_rl.sync import SyncConfig, WeightSync

REPO = Path(__file__).resolve().parents[2]
WORKER = str(REPO / "tests" / "sync" / "sync_worker.py")
HAVE_MOONCAKE = importlib.util.find_spec("mooncake") is not None


def tiny_qwen3(path: Path, seed: int, intermediate: int = 128, layers: int = 2) -> Path:
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen3Config(
        vocab_size=300, hidden_size=64, intermediate_size=intermediate, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
        tie_word_embeddings=False, eos_token_id=2, bos_token_id=1, pad_token_id=0,
    )  # fmt: skip
    Qwen3ForCausalLM(cfg).save_pretrained(path)
    return path


def tiny_qwen3_moe(path: Path, seed: int) -> Path:
    """4 experts (top-2), 2 layers; transformers >= 5 fuses each layer's experts into 3-D
    parameters, while the checkpoint and the sync name them per expert."""
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen3MoeConfig(
        vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
        tie_word_embeddings=False, eos_token_id=2, bos_token_id=1, pad_token_id=0,
    )  # fmt: skip
    Qwen3MoeForCausalLM(cfg).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_qwen3(tmp_path_factory.mktemp("qwen3"), seed=0)


def start_engine(model_dir: Path, log_dir: Path, name: str, tp_size: int = 1) -> ServerProcess:
    cfg = EngineServerConfig(
        model_path=str(model_dir), backend="builtin", num_threads=1, log_dir=str(log_dir),
        startup_timeout_s=120, tp_size=tp_size,
    )  # fmt: skip
    server = ServerProcess(cfg, name=name)
    server.start()
    return server


@pytest.fixture(scope="module")
def engine(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    server = start_engine(model_dir, tmp_path_factory.mktemp("logs"), "sync-engine")
    yield server
    server.stop()


def run_worker(tmp: Path, *args: str, nproc: int = 1) -> list[dict]:
    out = tmp / "result.json"
    cmd = [sys.executable, WORKER] if nproc == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        "--nproc-per-node", str(nproc), WORKER,
    ]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", PYTHONPATH=str(REPO))
    # Output to a file: torch's shm manager daemon inherits the descriptors and outlives us.
    log = tmp / "worker.log"
    with open(log, "w") as f:
        proc = subprocess.run(
            [*cmd, "--out", str(out), *args], stdout=f, stderr=subprocess.STDOUT, env=env,
            timeout=300,
        )  # fmt: skip
    assert proc.returncode == 0, log.read_text()[-5000:]
    return json.loads(out.read_text())


def weight_version(url: str) -> str:
    async def get() -> str:
        async with SGLangClient(url) as c:
            return (await c.get_model_info())["weight_version"]

    return asyncio.run(get())


def start_agent(engine_url: str, log_path: Path, buffer_bytes: int = 1 << 20) -> tuple[str, Any]:
    """A Mooncake agent beside the engine at ``engine_url``: (its URL, its process)."""
    import httpx

    port = free_port()
    log = open(log_path, "w")  # noqa: SIM115 (closed with the process)
    p = subprocess.Popen(
        [sys.executable, "-m", "titan_rl.sync.mooncake_agent", "--engine-url", engine_url,
         "--port", str(port), "--buffer-bytes", str(buffer_bytes)],
        stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ, PYTHONPATH=str(REPO)),
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    for _ in range(100):
        try:
            httpx.get(f"{url}/info", timeout=1).raise_for_status()
            return url, p
        except httpx.HTTPError:
            if p.poll() is not None:
                pytest.fail(f"mooncake agent exited: {log_path.read_text()[-2000:]}")
            time.sleep(0.2)
    p.kill()
    pytest.fail("mooncake agent did not start")


def engine_scores(url: str) -> list[list[float]]:
    from titan_rl.sync.parity import engine_logprobs, probe_batch

    async def get() -> list[list[float]]:
        async with SGLangClient(url) as c:
            return [t.tolist() for t in await engine_logprobs(c, probe_batch(2, 16, 300, 7))]

    return asyncio.run(get())


@pytest.fixture(scope="module")
def agent(engine: ServerProcess, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    if not HAVE_MOONCAKE:
        yield ""
        return
    url, p = start_agent(engine.url, tmp_path_factory.mktemp("agent") / "agent.log")
    yield url
    p.terminate()
    p.wait(10)


@pytest.mark.slow
def test_every_transport_reaches_parity(
    engine: ServerProcess, model_dir: Path, agent: str, tmp_path: Path
) -> None:
    transports = ["tensor", "tensor-direct", "distributed", "disk"]
    transports += ["mooncake"] if HAVE_MOONCAKE else []
    results = run_worker(
        tmp_path, "--engines", engine.url, "--model-dir", str(model_dir),
        "--disk-dir", str(tmp_path / "disk"), "--transports", *transports,
        *(["--agents", agent] if agent else []),
    )  # fmt: skip
    assert [r["transport"] for r in results] == transports
    for r in results:
        assert "error" not in r, r
        m = r["metrics"]
        # the engine served other weights before (the check can fail) and the new ones after
        assert r["before"]["sync/logprob_abs_diff_max"] > 0.1, r
        assert m["sync/logprob_abs_diff_mean"] < 1e-4 and m["sync/logprob_abs_diff_max"] < 1e-4, r
        assert m["sync/buckets"] > 1 and m["sync/bytes"] > 0
    assert weight_version(engine.url) == results[-1]["version"]
    if not HAVE_MOONCAKE:
        pytest.skip("mooncake-transfer-engine-non-cuda is not installed: mooncake not checked")


def _shm_segments() -> set[Path]:
    shm = Path("/dev/shm")
    return set(shm.glob("torch_*")) if shm.is_dir() else set()


def test_direct_tensor_format_sends_the_live_parameters(model_dir: Path, tmp_path: Path) -> None:
    # sync.tensor.format=direct: the trainer's parameters (moved into shared memory) travel as
    # they are and the engine copies them; q/k/v are written into shared-memory shadows, so
    # nothing is staged. Two syncs with an in-place change of the parameters in between (as an
    # optimizer step does): the second must carry the new values, and before it the engine
    # must still serve the first ones (it holds a copy, not the trainer's memory).
    segments = _shm_segments()
    engine = start_engine(model_dir, tmp_path, "direct-engine")
    try:
        before, scores = weight_version(engine.url), engine_scores(engine.url)
        (r,) = run_worker(
            tmp_path, "--engines", engine.url, "--model-dir", str(model_dir),
            "--transports", "tensor-direct", "--syncs", "2",
        )  # fmt: skip
        assert "error" not in r, r
        assert r["shared_params"] and r["staged_bytes"] == 0, r
        assert [x["version"] for x in r["rounds"]] == ["v1.1", "v1.2"]
        for rnd in r["rounds"]:
            assert rnd["before"]["sync/logprob_abs_diff_max"] > 0.1, rnd
            m = rnd["metrics"]
            assert m["sync/logprob_abs_diff_mean"] < 1e-4, rnd
            assert m["sync/logprob_abs_diff_max"] < 1e-4, rnd
            assert m["sync/buckets"] > 1 and m["sync/bytes"] > 0, rnd
        assert weight_version(engine.url) == "v1.2" != before
        assert engine_scores(engine.url) != scores
    finally:
        engine.stop()
    # The engine kept the parameters' segments mapped across syncs; with trainer and engine
    # gone, no segment is left behind.
    deadline = time.monotonic() + 20
    while _shm_segments() - segments and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _shm_segments() - segments == set()


@pytest.mark.slow
def test_tp2_trainer_syncs_gathered_weights(
    engine: ServerProcess, model_dir: Path, tmp_path: Path
) -> None:
    # direct: the TP-gathered tensors are temporaries, staged; the replicated ones go as they are
    results = run_worker(
        tmp_path, "--engines", engine.url, "--model-dir", str(model_dir), "--tp", "2",
        "--transports", "tensor", "tensor-direct", nproc=2,
    )  # fmt: skip
    for r in results:
        assert "error" not in r, r
        assert r["metrics"]["sync/logprob_abs_diff_max"] < 1e-4
    assert results[1]["staged_bytes"] > 0


@pytest.mark.slow
def test_pp2_trainer_parity_over_the_pipeline(
    engine: ServerProcess, model_dir: Path, tmp_path: Path
) -> None:
    # The trainer's probe runs through megatron's forward-only pipeline schedule; the logprobs
    # of the last stage reach rank 0 (the sync's dst, on the first stage).
    results = run_worker(
        tmp_path, "--engines", engine.url, "--model-dir", str(model_dir), "--pp", "2",
        "--disk-dir", str(tmp_path / "disk"), "--transports", "tensor", "disk", nproc=2,
    )  # fmt: skip
    for r in results:
        assert "error" not in r, r
        assert r["before"]["sync/logprob_abs_diff_max"] > 0.1, r
        m = r["metrics"]
        assert m["sync/logprob_abs_diff_mean"] < 1e-4 and m["sync/logprob_abs_diff_max"] < 1e-4, r
    assert weight_version(engine.url) == results[-1]["version"]


@pytest.mark.slow
def test_tp2_pp2_trainer_parity(engine: ServerProcess, model_dir: Path, tmp_path: Path) -> None:
    # Four ranks: vocab-parallel logits gathered over TP on the last stage, then sent to rank 0.
    (r,) = run_worker(
        tmp_path, "--engines", engine.url, "--model-dir", str(model_dir), "--tp", "2",
        "--pp", "2", "--transports", "distributed", nproc=4,
    )  # fmt: skip
    assert "error" not in r, r
    assert r["before"]["sync/logprob_abs_diff_max"] > 0.1, r
    m = r["metrics"]
    assert m["sync/logprob_abs_diff_mean"] < 1e-4 and m["sync/logprob_abs_diff_max"] < 1e-4, r


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_qwen3_moe(tmp_path_factory.mktemp("qwen3-moe"), seed=0)


@pytest.fixture(scope="module")
def moe_engine(moe_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    server = start_engine(moe_dir, tmp_path_factory.mktemp("moe-logs"), "moe-engine")
    yield server
    server.stop()


@pytest.mark.parametrize("ep", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_qwen3_moe_per_expert_names_reach_parity(
    moe_engine: ServerProcess, moe_dir: Path, tmp_path: Path, ep: int
) -> None:
    # The exporter names experts one by one; the engine's model holds them fused. direct at
    # EP=2: the experts gathered from the other rank are staged, the local ones go as they are.
    transports = ["tensor", "tensor-direct", "distributed", "disk"]
    if ep > 1:
        transports = ["tensor", "tensor-direct"]
    results = run_worker(
        tmp_path, "--engines", moe_engine.url, "--model-dir", str(moe_dir), "--ep", str(ep),
        "--disk-dir", str(tmp_path / "disk"), "--transports", *transports, nproc=ep,
    )  # fmt: skip
    assert [r["transport"] for r in results] == transports
    for r in results:
        assert "error" not in r, r
        assert r["before"]["sync/logprob_abs_diff_max"] > 0.1, r
        m = r["metrics"]
        assert m["sync/logprob_abs_diff_mean"] < 1e-4 and m["sync/logprob_abs_diff_max"] < 1e-4, r
    assert weight_version(moe_engine.url) == results[-1]["version"]


@pytest.mark.slow
def test_failure_mid_sync_restores_old_weights_and_version(model_dir: Path, tmp_path: Path) -> None:
    # A fresh engine (on its start-up weights, the restore point). A trainer whose MLP is wider than the engine's: the embedding bucket is applied, then the
    # first MLP tensor is rejected; the engine must come back to the weights it serves now.
    wide = tiny_qwen3(tmp_path / "wide", seed=5, intermediate=192)
    engine = start_engine(model_dir, tmp_path, "fresh-engine")
    try:
        before, scores = weight_version(engine.url), engine_scores(engine.url)
        (r,) = run_worker(
            tmp_path, "--engines", engine.url, "--model-dir", str(wide), "--transports",
            "tensor", "--bucket-bytes", "40000",
        )  # fmt: skip
        assert r["failed"] == [engine.url]
        assert engine.url in r["error"] and "restored the old weights" in r["error"], r["error"]
        assert weight_version(engine.url) == before
        # serving again (generation continued) and on its previous weights: same scores
        assert engine_scores(engine.url) == scores
    finally:
        engine.stop()


def _dead_url() -> str:
    """A local URL nothing listens on (an engine that died and is not back yet)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


@pytest.mark.slow
def test_an_engine_lost_mid_sync_is_left_to_its_supervisor(
    engine: ServerProcess, model_dir: Path, tmp_path: Path
) -> None:
    # One engine answers, one is gone. Unsupervised, the sync fails naming the lost one, and
    # on the first refused connection: a sync never retries, because a retry could reach a
    # restarted server that missed the calls before it. Supervised (the GRPO job), the live
    # engine takes the weights and reaches parity; the lost one is counted and not scored.
    # one trainer process for both: the tensor sync unsupervised (v1), then supervised (v2)
    dead = _dead_url()
    unsupervised, supervised = run_worker(
        tmp_path, "--engines", engine.url, dead, "--model-dir", str(model_dir),
        "--transports", "tensor", "tensor+supervised", "--no-check-before",
    )  # fmt: skip
    r = unsupervised
    assert r["failed"] == [dead], r
    assert "after 1 attempts" in r["error"], r["error"]
    # the other engine is consistent
    assert r["engine_versions"] == {engine.url: "v1", dead: None}, r
    r = supervised
    assert "error" not in r, r
    m = r["metrics"]
    assert m["sync/engines_lost"] == 1 and m["sync/parity_skipped"] == 1, m
    assert m["sync/logprob_abs_diff_max"] < 1e-4, m
    assert r["version"] == "v2" and r["engine_versions"][engine.url] == "v2", r
    assert weight_version(engine.url) == "v2"


def test_engine_keeps_the_storages_of_two_weight_versions_mapped() -> None:
    import torch

    from titan_rl.engine.server import MappedStorages

    mapped = MappedStorages(max_bytes=1000)
    a, b, c = torch.zeros(10), torch.zeros(10), torch.zeros(100)  # 40, 40, 400 bytes
    key = {n: t.untyped_storage().data_ptr() for n, t in (("a", a), ("b", b), ("c", c))}
    mapped.add([("a", a), ("a.half", a[5:])])  # one storage, however many views
    mapped.add([("b", b)])
    assert len(mapped) == 2
    mapped.new_version()  # v1: a, b
    mapped.add([("a", a)])  # v2 resends a (found mapped); b stays until v2 is complete
    assert set(mapped.current) == {key["a"]} and set(mapped.previous) == {key["a"], key["b"]}
    mapped.new_version()  # v2: a; b is dropped
    assert set(mapped.previous) == {key["a"]} and not mapped.current
    mapped.add([("c", c)])
    mapped.new_version()
    assert set(mapped.previous) == {key["c"]} and not mapped.current
    # a sender that never bumps the version: a version ends at max_bytes
    for _ in range(5):
        mapped.add([("x", torch.zeros(100))])
    assert mapped.current_bytes <= 1000 and len(mapped) <= 5


def test_config_errors_say_what_to_do() -> None:
    from titan_core.config.loader import ConfigError, load_config

    with pytest.raises(ValueError, match=r"sync\.disk\.dir"):
        SyncConfig(transport="disk")
    # mooncake without agents: the GRPO job starts them beside its engines; a sync without
    # them (none given, none started) says how to get them
    mooncake = SyncConfig(transport="mooncake")
    with pytest.raises(ValueError, match=r"the GRPO job .* starts them.*sync\.mooncake\.agents"):
        WeightSync(mooncake, ["http://127.0.0.1:1"], {})
    with pytest.raises(ValueError, match=r"sync\.mooncake\.agents has 1 URLs for 2 engines"):
        WeightSync(mooncake, ["http://127.0.0.1:1", "http://127.0.0.1:2"], {}, agents=["a"])
    given = SyncConfig(transport="mooncake", mooncake={"agents": ["http://127.0.0.1:3"]})
    with pytest.raises(ValueError, match=r"mooncake with sync\.mooncake\.agents empty"):
        WeightSync(given, ["http://127.0.0.1:1"], {}, agents=["http://127.0.0.1:4"])
    with pytest.raises(ConfigError, match="bucket_byte"):
        load_config(SyncConfig, overrides=["bucket_byte=3"])
