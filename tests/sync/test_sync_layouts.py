"""Weight sync from pipeline- and expert-parallel trainers (issue 18): every stage's source
rank and every EP rank sends its own part straight to the engines, nothing funnels through
rank 0. Each layout reaches parity (< 1e-4, fp32) on two engines, one of them tensor
parallel, over every transport; the bytes each trainer rank sends are exactly its stage's
and EP rank's share of the checkpoint."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.sync.test_sync import (
    HAVE_MOONCAKE,
    run_worker,
    start_agent,
    start_engine,
    tiny_qwen3,
    tiny_qwen3_moe,
    weight_version,
)
from titan_rl.actors.server import ServerProcess

ENGINE_TP = 2
LAYER = re.compile(r"^model\.layers\.(\d+)\.")
EXPERT = re.compile(r"\.experts\.(\d+)\.")


def hf_bytes(model_dir: Path) -> dict[str, int]:
    """Bytes of every tensor of the checkpoint, by name."""
    from safetensors import safe_open

    out = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as h:
            for name in h.keys():  # noqa: SIM118
                t = h.get_slice(name)
                numel = 1
                for d in t.get_shape():
                    numel *= d
                out[name] = numel * 4  # fp32 on the wire (the trainer's dtype)
    return out


def expected_rank_bytes(
    model_dir: Path,
    pp: int,
    ep: int,
    layers: int,
    vpp: int = 1,
    experts: int = 0,
    first_stage_layers: int | None = None,
) -> list[int]:
    """What each rank (megatron's default order: EP within a stage, stages outermost) must
    send: its stage's dense tensors on EP rank 0, its own experts on every EP rank.
    ``first_stage_layers`` (without VPP): the first stage's layers, the rest evenly after."""
    per_chunk = layers // (pp * vpp)
    out = [0] * (pp * ep)
    for name, n in hf_bytes(model_dir).items():
        # embedding: first stage; final norm and output layer: last; a layer: its chunk's
        stage = 0 if "embed_tokens" in name else pp - 1
        if m := LAYER.match(name):
            layer = int(m.group(1))
            if first_stage_layers is None:
                stage = (layer // per_chunk) % pp
            elif layer < first_stage_layers:
                stage = 0
            else:
                stage = 1 + (layer - first_stage_layers) // (
                    (layers - first_stage_layers) // (pp - 1)
                )
        e = EXPERT.search(name)
        ep_rank = int(e.group(1)) // (experts // ep) if e else 0
        out[stage * ep + ep_rank] += n
    return out


@pytest.fixture(scope="module")
def deep_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_qwen3(tmp_path_factory.mktemp("qwen3-4l"), seed=0, layers=4)


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_qwen3_moe(tmp_path_factory.mktemp("qwen3-moe"), seed=0)


def _engines(model_dir: Path, tmp: Path, tag: str) -> Iterator[list[ServerProcess]]:
    servers = [
        start_engine(model_dir, tmp, f"{tag}-tp1"),
        start_engine(model_dir, tmp, f"{tag}-tp2", tp_size=ENGINE_TP),
    ]
    yield servers
    for s in servers:
        s.stop()


@pytest.fixture(scope="module")
def deep_engines(
    deep_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[list[ServerProcess]]:
    yield from _engines(deep_dir, tmp_path_factory.mktemp("deep-logs"), "deep")


@pytest.fixture(scope="module")
def moe_engines(
    moe_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[list[ServerProcess]]:
    yield from _engines(moe_dir, tmp_path_factory.mktemp("moe-logs"), "moe")


def _sync_every_transport(
    engines: list[ServerProcess], model_dir: Path, tmp: Path, *layout: str, nproc: int
) -> list[dict]:
    transports = ["tensor", "tensor-direct", "distributed", "disk"]
    agents = []
    if HAVE_MOONCAKE:
        transports.append("mooncake")
        agents = [start_agent(e.url, tmp / f"agent{i}.log") for i, e in enumerate(engines)]
    try:
        results = run_worker(
            tmp, "--engines", *(e.url for e in engines), "--model-dir", str(model_dir),
            "--disk-dir", str(tmp / "disk"), "--transports", *transports, *layout,
            *(["--agents", *(url for url, _ in agents)] if agents else []), nproc=nproc,
        )  # fmt: skip
    finally:
        for _, p in agents:
            p.terminate()
            p.wait(10)
    assert [r["transport"] for r in results] == transports
    for r in results:
        assert "error" not in r, r
        # the engines served other weights before (the check fails) and the new ones after
        assert r["before"]["sync/logprob_abs_diff_max"] > 0.1, r
        m = r["metrics"]
        assert m["sync/logprob_abs_diff_max"] < 1e-4, r
    for e in engines:
        assert weight_version(e.url) == results[-1]["version"]
    return results


@pytest.mark.slow
def test_pp2_vpp2_each_stage_sends_its_own_layers(
    deep_engines: list[ServerProcess], deep_dir: Path, tmp_path: Path
) -> None:
    results = _sync_every_transport(
        deep_engines, deep_dir, tmp_path, "--pp", "2", "--vpp", "2", nproc=2
    )
    want = expected_rank_bytes(deep_dir, pp=2, ep=1, layers=4, vpp=2)
    model = sum(hf_bytes(deep_dir).values())
    for r in results:
        assert r["rank_bytes"] == want, (r["transport"], r["rank_bytes"], want)
        m = r["metrics"]
        assert m["sync/senders"] == 2 and m["sync/bytes"] == model
        assert m["sync/bytes_max_rank"] == max(want) < model
    if not HAVE_MOONCAKE:
        pytest.skip("mooncake-transfer-engine-non-cuda is not installed: mooncake not checked")


@pytest.mark.slow
def test_uneven_pp2_each_stage_sends_its_own_layers(
    deep_engines: list[ServerProcess], deep_dir: Path, tmp_path: Path
) -> None:
    """megatron-core's uneven split (parallel.num_layers_in_first_pipeline_stage=1): the
    first stage sends the embedding and layer 0, the last layers 1-3, the norm and the head."""
    results = _sync_every_transport(
        deep_engines, deep_dir, tmp_path, "--pp", "2", "--first-stage-layers", "1", nproc=2
    )
    want = expected_rank_bytes(deep_dir, pp=2, ep=1, layers=4, first_stage_layers=1)
    even = expected_rank_bytes(deep_dir, pp=2, ep=1, layers=4)
    assert want != even
    for r in results:
        assert r["rank_bytes"] == want, (r["transport"], r["rank_bytes"], want)
        assert r["metrics"]["sync/bytes"] == sum(hf_bytes(deep_dir).values())
    if not HAVE_MOONCAKE:
        pytest.skip("mooncake-transfer-engine-non-cuda is not installed: mooncake not checked")


@pytest.mark.slow
def test_pp2_ep2_moe_each_ep_rank_sends_its_own_experts(
    moe_engines: list[ServerProcess], moe_dir: Path, tmp_path: Path
) -> None:
    results = _sync_every_transport(
        moe_engines, moe_dir, tmp_path, "--pp", "2", "--ep", "2", nproc=4
    )
    want = expected_rank_bytes(moe_dir, pp=2, ep=2, layers=2, experts=4)
    model = sum(hf_bytes(moe_dir).values())
    assert all(b > 0 for b in want)
    for r in results:
        assert r["rank_bytes"] == want, (r["transport"], r["rank_bytes"], want)
        m = r["metrics"]
        assert m["sync/senders"] == 4 and m["sync/bytes"] == model
    if not HAVE_MOONCAKE:
        pytest.skip("mooncake-transfer-engine-non-cuda is not installed: mooncake not checked")
