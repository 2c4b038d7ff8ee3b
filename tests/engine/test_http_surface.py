"""The engine's HTTP surface, pinned: every SGLang endpoint it serves (a route cannot silently
disappear), and an invalid request answered 400 in SGLang's error shape naming the field
(the app in-process on a real tiny model, over Starlette's test client)."""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from pathlib import Path

import annotated_types
import pytest
from fastapi.testclient import TestClient

from tests.models.hf_cases import build_hf_model
from titan_rl.engine.core import Engine
from titan_rl.engine.sampling import SamplingParams
from titan_rl.engine.server import create_app

#: SGLang's native endpoints the built-in engine serves (shared/reference/sglang-http-api.md)
SGLANG_ENDPOINTS = {
    ("/generate", "POST"),
    ("/generate", "PUT"),
    ("/health", "GET"),
    ("/health_generate", "GET"),
    ("/get_model_info", "GET"),
    ("/model_info", "GET"),
    ("/get_server_info", "GET"),
    ("/server_info", "GET"),
    ("/get_weight_version", "GET"),
    ("/weight_version", "GET"),
    ("/flush_cache", "GET"),
    ("/flush_cache", "POST"),
    ("/update_weights_from_disk", "POST"),
    ("/update_weights_from_tensor", "POST"),
    ("/init_weights_update_group", "POST"),
    ("/update_weights_from_distributed", "POST"),
    ("/destroy_weights_update_group", "POST"),
    ("/update_weight_version", "POST"),
    ("/get_weights_by_name", "POST"),
    ("/release_memory_occupation", "POST"),
    ("/resume_memory_occupation", "POST"),
    ("/pause_generation", "POST"),
    ("/continue_generation", "POST"),
    ("/abort_request", "POST"),
}
#: SGLang 0.5.23 endpoints this engine answers 404, as older SGLang servers do (clients probe)
NOT_SERVED = ("/begin_weight_update", "/end_weight_update")

PROMPT = [5, 6, 7]


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    path: Path = tmp_path_factory.mktemp("engine-model") / "qwen2"
    build_hf_model("qwen2").save_pretrained(path)
    eng = Engine(str(path), num_threads=1)
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def client(engine: Engine) -> Iterator[TestClient]:
    with TestClient(create_app(engine)) as c:
        yield c


def served_routes(engine: Engine) -> set[tuple[str, str]]:
    """(path, method) of every route of the app, from its OpenAPI description."""
    with warnings.catch_warnings():  # routes with two methods share an operation id
        warnings.simplefilter("ignore")
        paths = create_app(engine).openapi()["paths"]
    return {(path, method.upper()) for path, ops in paths.items() for method in ops}


def test_routes_are_sglangs_endpoints(engine: Engine) -> None:
    served = served_routes(engine)
    assert served == SGLANG_ENDPOINTS, (
        f"missing: {sorted(SGLANG_ENDPOINTS - served)}, unlisted: {sorted(served - SGLANG_ENDPOINTS)}"
    )


@pytest.mark.parametrize("path", NOT_SERVED)
def test_unserved_sglang_endpoints_are_404_json(client: TestClient, path: str) -> None:
    resp = client.post(path, json={})
    assert resp.status_code == 404
    assert resp.json()["error"]["code"] == 404


def _violations() -> list[tuple[str, object]]:
    """For each range-limited sampling parameter, a value just outside its range."""
    out = []
    for name, field in SamplingParams.model_fields.items():
        for c in field.metadata:
            step = 1 if field.annotation is int else 0.5
            if isinstance(c, annotated_types.Ge):
                out.append((name, c.ge - step))
            elif isinstance(c, annotated_types.Gt):
                out.append((name, c.gt))
            elif isinstance(c, annotated_types.Le):
                out.append((name, c.le + step))
            elif isinstance(c, annotated_types.Lt):
                out.append((name, c.lt))
    return out


BAD_SAMPLING = [
    *_violations(),
    ("top_k", 0),
    ("top_k", -2),
    ("temperature", -1e-3),
    ("max_new_tokens", "ten"),
    ("stop_token_ids", [-1]),
    ("ignore_eos", "maybe"),
    ("no_such_parameter", 1),
]


def _error_of(resp) -> str:  # noqa: ANN001
    assert resp.status_code == 400, resp.text
    body = resp.json()
    assert body["error"]["code"] == 400
    return body["error"]["message"]


@pytest.mark.parametrize(
    ("name", "value"), BAD_SAMPLING, ids=[f"{n}={v!r}" for n, v in BAD_SAMPLING]
)
def test_invalid_sampling_parameter_is_400_naming_it(
    client: TestClient, name: str, value: object
) -> None:
    resp = client.post("/generate", json={"input_ids": PROMPT, "sampling_params": {name: value}})
    assert f"sampling_params.{name}" in _error_of(resp)


def test_invalid_parameter_of_one_prompt_names_its_index(client: TestClient) -> None:
    body = {
        "input_ids": [PROMPT, PROMPT, PROMPT],
        "sampling_params": [{}, {}, {"top_k": 0}],
    }
    assert "sampling_params[2].top_k" in _error_of(client.post("/generate", json=body))


@pytest.mark.parametrize("input_ids", [5, "5 6 7", [5, [6]], [[5], 6], [5.0, 6.0], {"0": 5}])
def test_input_ids_that_are_not_token_lists_are_400(client: TestClient, input_ids: object) -> None:
    message = _error_of(client.post("/generate", json={"input_ids": input_ids}))
    assert message.startswith("input_ids")


def test_server_keeps_serving_after_rejections(client: TestClient) -> None:
    for name, value in BAD_SAMPLING[:3]:
        client.post("/generate", json={"input_ids": PROMPT, "sampling_params": {name: value}})
    body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 3, "ignore_eos": True}}
    resp = client.post("/generate", json=body)
    assert resp.status_code == 200 and len(resp.json()["output_ids"]) == 3


def test_apps_do_not_share_state(engine: Engine) -> None:
    """Each app holds its own weight-update groups and mapped storages (no module globals)."""
    first, second = create_app(engine), create_app(engine)
    first.state.server.groups["g"] = object()
    assert second.state.server.groups == {}
    assert first.state.server.engine is second.state.server.engine is engine
