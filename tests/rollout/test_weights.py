"""Weight updates by each transport (disk, tensor, distributed) change the outputs to those of
the new weights and set ``weight_version``; also the API key check."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import pytest
import torch

from titan_core.net import free_port
from titan_rl.actors.server import ServerProcess
from titan_rl.engine.weights import join_weight_update_group
from titan_rl.rollout import (
    SGLangClient,
    SGLangRequestError,
    WeightUpdateError,
    serialize_named_tensors,
)
from titan_rl.wire.group import broadcast_named_tensors

PROMPT = [5, 17, 33, 2, 9]
NEW = 8
KEY = "test-secret"


def greedy_reference(model_dir: Path) -> list[int]:
    """Greedy continuation by a plain HF forward loop (no cache) of the model in ``model_dir``."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir)).eval()
    ids = list(PROMPT)
    with torch.no_grad():
        for _ in range(NEW):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(PROMPT) :]


def state_of(model_dir: Path) -> list[tuple[str, torch.Tensor]]:
    from safetensors.torch import load_file

    return sorted(load_file(str(model_dir / "model.safetensors")).items())


@pytest.fixture(scope="module")
def models(
    tmp_path_factory: pytest.TempPathFactory, make_model, tiny_model: Path
) -> dict[str, Path]:
    return {
        "a": tiny_model,
        "b": make_model(tmp_path_factory.mktemp("model-b"), "llama", seed=1),
        "c": make_model(tmp_path_factory.mktemp("model-c"), "llama", seed=2),
    }


@pytest.fixture(scope="module")
def refs(models: dict[str, Path]) -> dict[str, list[int]]:
    out = {k: greedy_reference(p) for k, p in models.items()}
    assert len({tuple(v) for v in out.values()}) == 3, "reference models must differ"
    return out


@pytest.fixture(scope="module")
def keyed_engine(engine_factory, models: dict[str, Path]) -> ServerProcess:
    return engine_factory(models["a"], "weights-engine", api_key=KEY)


async def _greedy(client: SGLangClient) -> tuple[list[int], str | None]:
    out = await client.generate(
        PROMPT, {"max_new_tokens": NEW, "temperature": 0, "ignore_eos": True}
    )
    return out.output_ids, out.weight_version


def test_api_key_required(keyed_engine: ServerProcess) -> None:
    async def main() -> None:
        async with SGLangClient(keyed_engine.url) as anon:
            assert await anon.health()  # /health stays open, as in SGLang
            with pytest.raises(SGLangRequestError) as err:
                await anon.generate(PROMPT, {"max_new_tokens": 1})
            assert err.value.status == 401
        async with SGLangClient(keyed_engine.url, api_key="wrong") as bad:
            with pytest.raises(SGLangRequestError):
                await bad.update_weight_version("x")

    asyncio.run(main())


def test_update_from_disk(keyed_engine: ServerProcess, models: dict[str, Path], refs: dict) -> None:
    async def main() -> None:
        async with SGLangClient(keyed_engine.url, api_key=KEY) as client:
            await client.update_weights_from_disk(str(models["a"]), weight_version="a0")
            assert await _greedy(client) == (refs["a"], "a0")
            await client.update_weights_from_disk(str(models["b"]), weight_version="disk-1")
            assert await _greedy(client) == (refs["b"], "disk-1")
            with pytest.raises(WeightUpdateError, match="cannot load weights"):
                await client.update_weights_from_disk("/no/such/checkpoint")
            assert await _greedy(client) == (refs["b"], "disk-1")

    asyncio.run(main())


@pytest.mark.parametrize("load_format", [None, "flattened_bucket"])
def test_update_from_tensor(
    keyed_engine: ServerProcess, models: dict[str, Path], refs: dict, load_format: str | None
) -> None:
    async def main() -> None:
        async with SGLangClient(keyed_engine.url, api_key=KEY) as client:
            await client.update_weights_from_disk(str(models["a"]), weight_version="a0")
            payload, keep_alive = serialize_named_tensors(state_of(models["c"]), load_format)
            await client.update_weights_from_tensor(
                [payload], load_format=load_format, weight_version=f"tensor-{load_format}"
            )
            del keep_alive
            assert await _greedy(client) == (refs["c"], f"tensor-{load_format}")
            # an unknown parameter name is refused and nothing changes
            bad, _keep = serialize_named_tensors([("model.no_such.weight", torch.zeros(2))])
            with pytest.raises(WeightUpdateError, match="unknown parameter"):
                await client.update_weights_from_tensor([bad], weight_version="never")
            assert await _greedy(client) == (refs["c"], f"tensor-{load_format}")

    asyncio.run(main())


@pytest.mark.parametrize("load_format", [None, "flattened_bucket"])
def test_update_from_distributed(
    keyed_engine: ServerProcess, models: dict[str, Path], refs: dict, load_format: str | None
) -> None:
    named = state_of(models["b"])
    port = free_port()
    group = f"g-{load_format}"

    async def main() -> None:
        async with SGLangClient(keyed_engine.url, api_key=KEY) as client:
            await client.update_weights_from_disk(str(models["a"]), weight_version="a0")
            assert await _greedy(client) == (refs["a"], "a0")
            box: dict = {}
            trainer = threading.Thread(
                target=lambda: box.update(
                    pg=join_weight_update_group("127.0.0.1", port, 0, 2, group, "gloo")
                )
            )
            trainer.start()
            await client.init_weights_update_group(
                "127.0.0.1", port, 1, 2, group_name=group, backend="gloo"
            )
            trainer.join(30)
            pg = box["pg"]

            sender = threading.Thread(target=broadcast_named_tensors, args=(pg, named, load_format))
            sender.start()
            await client.update_weights_from_distributed(
                [n for n, _ in named],
                [str(t.dtype).removeprefix("torch.") for _, t in named],
                [list(t.shape) for _, t in named],
                group_name=group,
                load_format=load_format,
                weight_version=f"dist-{load_format}",
            )
            sender.join(30)
            assert await _greedy(client) == (refs["b"], f"dist-{load_format}")
            await client.destroy_weights_update_group(group)

    asyncio.run(main())


async def _until_running(client: SGLangClient, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while (await client.get_server_info())["num_running_reqs"] == 0:
        assert time.monotonic() < deadline, "request never reached the engine"
        await asyncio.sleep(0.02)


def test_update_waits_for_running_requests_unless_paused(
    keyed_engine: ServerProcess, models: dict[str, Path], refs: dict
) -> None:
    long_params = {"max_new_tokens": 200, "temperature": 0, "ignore_eos": True}

    async def main() -> None:
        async with SGLangClient(keyed_engine.url, api_key=KEY) as client:
            await client.update_weights_from_disk(str(models["a"]), weight_version="a0")
            # not paused: the update waits, so the running request is answered by one version
            long = asyncio.create_task(client.generate(PROMPT, long_params))
            await _until_running(client)
            await client.update_weights_from_disk(str(models["b"]), weight_version="gated")
            assert long.done()
            res = long.result()
            assert res.weight_version == "a0" and res.output_ids[:NEW] == refs["a"]
            assert await _greedy(client) == (refs["b"], "gated")
            # paused in place: the update lands between steps, the request continues after
            long = asyncio.create_task(client.generate(PROMPT, long_params))
            await _until_running(client)
            await client.pause_generation("in_place")
            try:
                await client.update_weights_from_disk(str(models["a"]), weight_version="a1")
                assert not long.done()
            finally:
                await client.continue_generation()
            res = await asyncio.wait_for(long, 60)
            assert res.weight_version == "a1" and len(res.output_ids) == 200

    asyncio.run(main())
