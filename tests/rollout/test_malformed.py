"""Malformed and hostile requests: each answered 4xx with a message; the server keeps serving."""

from __future__ import annotations

import base64
import os
import pickle
from pathlib import Path

import httpx
import pytest

from titan_rl.actors.server import ServerProcess

VOCAB = 300


def _gen(**kw: object) -> dict:
    body = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2}}
    body.update(kw)
    return body


def _sp(**kw: object) -> dict:
    return _gen(sampling_params={"max_new_tokens": 2, **kw})


class _Evil:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple:
        return (os.system, (f"touch {self.marker}",))


# (path, body: dict | bytes | str, expected status, fragment of the message)
CASES = [
    ("/generate", b"{not json", 400, "not valid JSON"),
    ("/generate", b"[1, 2]", 400, "JSON object"),
    ("/generate", {}, 400, "exactly one of"),
    ("/generate", {"input_ids": [1], "text": "hi"}, 400, "exactly one of"),
    ("/generate", {"text": "hello"}, 400, "no tokenizer"),
    ("/generate", {"input_ids": ["a", "b"]}, 400, "input_ids"),
    ("/generate", {"input_ids": []}, 400, "input_ids"),
    ("/generate", {"input_ids": [VOCAB + 5]}, 400, "outside the vocabulary"),
    ("/generate", {"input_ids": [-1]}, 400, "outside the vocabulary"),
    ("/generate", {"input_ids": list(range(1, 257))}, 400, "context length"),
    ("/generate", _sp(foo=1), 400, "unknown sampling parameter"),
    ("/generate", _sp(temperature=-1), 400, "temperature"),
    ("/generate", _sp(top_p=0), 400, "top_p"),
    ("/generate", _sp(top_p=1.5), 400, "top_p"),
    ("/generate", _sp(top_k=0), 400, "top_k"),
    ("/generate", _sp(min_p=2), 400, "min_p"),
    ("/generate", _sp(max_new_tokens=-1), 400, "max_new_tokens"),
    ("/generate", _sp(max_new_tokens="ten"), 400, "max_new_tokens"),
    ("/generate", _sp(n=0), 400, "n"),
    ("/generate", _sp(repetition_penalty=0), 400, "repetition_penalty"),
    ("/generate", _sp(frequency_penalty=3), 400, "frequency_penalty"),
    ("/generate", _sp(stop_token_ids=[1000]), 400, "outside the vocabulary"),
    ("/generate", _sp(stop=")"), 400, "send their token ids as stop_token_ids"),
    ("/generate", _sp(stop=["", "\n"]), 400, "stop texts cannot be matched"),
    ("/generate", _sp(min_new_tokens=5), 400, "min_new_tokens"),
    ("/generate", _sp(json_schema="{}"), 400, "not supported"),
    ("/generate", _sp(logit_bias={"abc": 1.0}), 400, "logit_bias"),
    ("/generate", _sp(logit_bias={"5": 1e300}, temperature=0.5), 400, "logit_bias"),
    ("/generate", _gen(sampling_params=[{}, {}]), 400, "sampling_params has 2 entries"),
    ("/generate", _gen(sampling_params="fast"), 400, "JSON object"),
    ("/generate", _gen(return_logprob="yes"), 400, "return_logprob"),
    ("/generate", _gen(rid=5), 400, "rid"),
    ("/generate", _gen(stream="yes"), 400, "stream"),
    ("/generate", _gen(logprob_start_len=10), 400, "logprob_start_len"),
    ("/generate", b"x" * (2 << 20), 413, "exceeds the limit"),
    ("/update_weights_from_disk", {}, 400, "model_path"),
    ("/update_weights_from_disk", {"model_path": "/nonexistent/dir"}, 400, "cannot load weights"),
    ("/update_weights_from_tensor", {"serialized_named_tensors": ["%%%"]}, 400, "base64"),
    ("/update_weights_from_tensor", {"serialized_named_tensors": "abc"}, 400, "wrong type"),
    (
        "/update_weights_from_tensor",
        {"serialized_named_tensors": [base64.b64encode(pickle.dumps([("w", 1)])).decode()]},
        400,
        "pairs",
    ),
    (
        "/init_weights_update_group",
        {
            "master_address": "127.0.0.1",
            "master_port": 1234,
            "rank_offset": 1,
            "world_size": 2,
            "backend": "nccl",
        },
        400,
        "gloo",
    ),
    ("/init_weights_update_group", {"master_address": "127.0.0.1"}, 400, "master_port"),
    (
        "/update_weights_from_distributed",
        {"names": ["x"], "dtypes": ["float32"], "shapes": [[1]], "group_name": "nope"},
        400,
        "no weight update group",
    ),
    (
        "/update_weights_from_distributed",
        {"names": [], "dtypes": [], "shapes": []},
        400,
        "non-empty",
    ),
    (
        "/update_weights_from_distributed",
        {"names": ["x"], "dtypes": ["float33"], "shapes": [[1]]},
        400,
        "unknown dtype",
    ),
    ("/pause_generation", {"mode": "sometimes"}, 400, "mode"),
    ("/abort_request", {}, 400, "rid"),
    ("/release_memory_occupation", {"tags": ["gpu"]}, 400, "tags"),
    ("/update_weight_version", {}, 400, "new_version"),
    ("/get_weights_by_name", {"name": "no.such.param"}, 400, "unknown parameter"),
]


def _post(client: httpx.Client, path: str, body: dict | bytes) -> httpx.Response:
    if isinstance(body, bytes):
        return client.post(path, content=body, headers={"content-type": "application/json"})
    return client.post(path, json=body)


@pytest.mark.parametrize(
    ("path", "body", "status", "fragment"), CASES, ids=[f"{i}:{c[0]}" for i, c in enumerate(CASES)]
)
def test_malformed_request_is_4xx_and_server_survives(
    engine: ServerProcess, path: str, body: dict | bytes, status: int, fragment: str
) -> None:
    with httpx.Client(base_url=engine.url, timeout=30) as client:
        resp = _post(client, path, body)
        assert resp.status_code == status, resp.text
        assert fragment.lower() in resp.text.lower(), resp.text
        # still serving
        assert client.get("/health").status_code == 200
        ok = client.post("/generate", json=_gen())
        assert ok.status_code == 200 and len(ok.json()["output_ids"]) == 2


def test_tensor_update_cannot_run_code(engine: ServerProcess, tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    payload = base64.b64encode(pickle.dumps([("model.norm.weight", _Evil(str(marker)))])).decode()
    with httpx.Client(base_url=engine.url, timeout=30) as client:
        resp = client.post(
            "/update_weights_from_tensor", json={"serialized_named_tensors": [payload]}
        )
        assert resp.status_code == 400 and "not allowed" in resp.json()["message"]
        assert not marker.exists()
        assert client.post("/generate", json=_gen()).status_code == 200


def test_unknown_route_is_404_json(engine: ServerProcess) -> None:
    with httpx.Client(base_url=engine.url, timeout=30) as client:
        resp = client.get("/no/such/route")
        assert resp.status_code == 404 and "error" in resp.json()
