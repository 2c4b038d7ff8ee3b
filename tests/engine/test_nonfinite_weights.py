"""Weight updates holding NaN or inf (issue 33): every update route of the built-in engine
(from tensor, direct and flattened, from disk, from distributed, and a TP rank's own entry)
answers 400 naming the parameter, and applies nothing: the weights, the weight version and
the outputs stay as they were. Before, the engine took them and answered ``null`` logprobs
and token 0 for every request. Through the HTTP app, on a real tiny model."""

from __future__ import annotations

import multiprocessing as mp
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from fastapi.testclient import TestClient

from tests.models.hf_cases import build_hf_model
from titan_core.net import free_port
from titan_rl.engine.core import Engine
from titan_rl.engine.server import create_app
from titan_rl.rollout.tensor_payload import serialize_named_tensors

PROMPT = [5, 6, 7, 8]
#: poisoned in each update (the last of the update's tensors: the ones before it are not
#: applied either)
BAD = "model.layers.1.mlp.down_proj.weight"
GOOD = "model.layers.0.self_attn.q_proj.weight"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path: Path = tmp_path_factory.mktemp("nonfinite") / "qwen2"
    build_hf_model("qwen2").save_pretrained(path)
    return path


def _client(engine: Engine) -> Iterator[TestClient]:
    with TestClient(create_app(engine)) as c:
        yield c


@pytest.fixture(scope="module")
def client(model_dir: Path) -> Iterator[TestClient]:
    engine = Engine(str(model_dir), dtype="float32", num_threads=1, load_tokenizer=False)
    try:
        yield from _client(engine)
    finally:
        engine.shutdown()


def _state(model_dir: Path) -> list[tuple[str, torch.Tensor]]:
    from safetensors.torch import load_file

    return sorted(load_file(str(model_dir / "model.safetensors")).items())


def poisoned(model_dir: Path, value: float) -> list[tuple[str, torch.Tensor]]:
    """The checkpoint with GOOD changed (finite) and ``value`` in three elements of BAD,
    BAD last."""
    named = dict(_state(model_dir))
    good = named[GOOD] + 1.0
    bad = named[BAD].clone()
    bad.view(-1)[[0, 7, 11]] = value
    rest = [(n, t) for n, t in named.items() if n not in (GOOD, BAD)]
    return [(GOOD, good), *rest, (BAD, bad)]


def snapshot(client: TestClient) -> dict[str, Any]:
    """What an update must not change: the version, two tensors and a greedy answer."""
    gen = client.post(
        "/generate",
        json={"input_ids": PROMPT, "return_logprob": True,
              "sampling_params": {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}},
    )  # fmt: skip
    assert gen.status_code == 200, gen.text
    meta = gen.json()["meta_info"]
    logprobs = [lp for lp, _, _ in meta["output_token_logprobs"]]
    assert all(isinstance(lp, float) for lp in logprobs), logprobs  # null = NaN served
    weights = {
        name: client.post(
            "/get_weights_by_name", json={"name": name, "truncate_size": 10**6}
        ).json()
        for name in (GOOD, BAD)
    }
    version = client.get("/get_weight_version").json()["weight_version"]
    return {"ids": gen.json()["output_ids"], "logprobs": logprobs, "weights": weights,
            "version": version}  # fmt: skip


def refused(resp: Any, *names: str) -> str:
    assert resp.status_code == 400, resp.text
    body = resp.json()
    assert body["success"] is False
    message = body["message"]
    assert "non-finite" in message and "nothing was applied" in message, message
    for name in names:
        assert repr(name) in message, message
    return message


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("load_format", [None, "flattened_bucket"])
def test_tensor_update_with_nonfinite_weights_is_refused_and_nothing_applied(
    client: TestClient, model_dir: Path, load_format: str | None, value: float
) -> None:
    before = snapshot(client)
    payload, _keep = serialize_named_tensors(poisoned(model_dir, value), load_format)
    resp = client.post(
        "/update_weights_from_tensor",
        json={"serialized_named_tensors": [payload], "load_format": load_format,
              "weight_version": "poisoned"},
    )  # fmt: skip
    message = refused(resp, BAD)
    kind = "NaN" if value != value else "inf"
    assert f"3 {kind}" in message and GOOD not in message, message
    assert snapshot(client) == before
    # the route still takes finite weights
    payload, _keep = serialize_named_tensors(_state(model_dir), load_format)
    resp = client.post(
        "/update_weights_from_tensor",
        json={"serialized_named_tensors": [payload], "load_format": load_format,
              "weight_version": before["version"]},
    )  # fmt: skip
    assert resp.status_code == 200 and resp.json()["success"], resp.text


def test_disk_update_with_nonfinite_weights_is_refused_and_nothing_applied(
    client: TestClient, model_dir: Path, tmp_path: Path
) -> None:
    from safetensors.torch import save_file

    before = snapshot(client)
    bad_dir = tmp_path / "poisoned"
    bad_dir.mkdir()
    save_file(dict(poisoned(model_dir, float("nan"))), str(bad_dir / "model.safetensors"))
    resp = client.post(
        "/update_weights_from_disk", json={"model_path": str(bad_dir), "weight_version": "x"}
    )
    assert str(bad_dir) in refused(resp, BAD)
    assert snapshot(client) == before


def test_several_nonfinite_parameters_are_named(client: TestClient, model_dir: Path) -> None:
    named = [(n, torch.full_like(t, float("nan"))) for n, t in _state(model_dir)]
    payload, _keep = serialize_named_tensors(named)
    resp = client.post("/update_weights_from_tensor", json={"serialized_named_tensors": [payload]})
    message = refused(resp, named[0][0], named[1][0], named[2][0])
    assert f"and {len(named) - 3} more" in message


def _trainer(port: int, group: str, named: list[tuple[str, torch.Tensor]]) -> None:
    """The trainer's side (rank 0) of a weight-update group: one broadcast, then leave."""
    from titan_rl.wire.group import (
        broadcast_named_tensors,
        destroy_weights_update_group,
        init_weights_update_group,
    )

    pg = init_weights_update_group("127.0.0.1", port, 0, 2, group, "gloo", 60)
    broadcast_named_tensors(pg, named, None)
    destroy_weights_update_group(pg)


def test_distributed_update_with_nonfinite_weights_is_refused_and_nothing_applied(
    client: TestClient, model_dir: Path
) -> None:
    before = snapshot(client)
    named = poisoned(model_dir, float("nan"))
    port, group = free_port(), "nonfinite"
    trainer = mp.get_context("spawn").Process(target=_trainer, args=(port, group, named))
    trainer.start()
    try:
        resp = client.post(
            "/init_weights_update_group",
            json={"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1,
                  "world_size": 2, "group_name": group, "backend": "gloo"},
        )  # fmt: skip
        assert resp.status_code == 200, resp.text
        resp = client.post(
            "/update_weights_from_distributed",
            json={"names": [n for n, _ in named], "dtypes": ["float32"] * len(named),
                  "shapes": [list(t.shape) for _, t in named], "group_name": group,
                  "weight_version": "poisoned"},
        )  # fmt: skip
        refused(resp, BAD)
        resp = client.post("/destroy_weights_update_group", json={"group_name": group})
        assert resp.status_code == 200, resp.text
    finally:
        trainer.join(60)
    assert trainer.exitcode == 0  # the broadcast was received: the sender was not left stuck
    assert snapshot(client) == before


def test_a_tp_ranks_nonfinite_entry_is_refused_on_every_rank(model_dir: Path) -> None:
    """At TP=2 rank 1 decodes its own entry: NaN there (rank 0's entry finite) refuses the
    update on both ranks."""
    engine = Engine(str(model_dir), dtype="float32", num_threads=2, load_tokenizer=False,
                    tp_size=2)  # fmt: skip
    try:
        for client in _client(engine):
            before = snapshot(client)
            clean, _k1 = serialize_named_tensors(_state(model_dir))
            bad, _k2 = serialize_named_tensors(poisoned(model_dir, float("nan")))
            resp = client.post(
                "/update_weights_from_tensor",
                json={"serialized_named_tensors": [clean, bad], "weight_version": "poisoned"},
            )
            assert "engine TP rank 1" in refused(resp, BAD)
            assert snapshot(client) == before
    finally:
        engine.shutdown()
