"""Routed experts (SGLang's R3 fields) from the built-in engine, and its ``--dtype``.

The experts the engine reports for each token equal the top-k of HF transformers' own router
logits (``output_router_logits=True``) over the same tokens in fp32, for prompt and generated
tokens, from ``routed_experts_start_len`` on; the client decodes them into the Sample."""

from __future__ import annotations

import asyncio
import base64
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
from fastapi.testclient import TestClient

from titan_rl.config import RolloutConfig
from titan_rl.data import Prompt
from titan_rl.engine.core import Engine
from titan_rl.engine.server import create_app
from titan_rl.rollout.client import SGLangClient
from titan_rl.rollout.generate import generate_groups
from titan_rl.rollout.rewarding import RewardCounts

VOCAB = 200
NUM_LAYERS, NUM_EXPERTS, TOP_K = 3, 8, 3
#: layer 1 is dense (its rows stay 0, as in SGLang's capture buffer)
DENSE = 1


def _save(path: Path, moe: bool, seed: int) -> Path:
    import transformers as tf

    kw = dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=NUM_LAYERS,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=128,
        eos_token_id=VOCAB + 1, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(seed)
    if moe:
        cfg = tf.Qwen3MoeConfig(
            **kw, num_experts=NUM_EXPERTS, num_experts_per_tok=TOP_K, moe_intermediate_size=32,
            norm_topk_prob=True, mlp_only_layers=[DENSE],
        )  # fmt: skip
        model = tf.Qwen3MoeForCausalLM(cfg)
        with torch.no_grad():  # routers with clear preferences (no near-ties)
            for layer in model.model.layers:
                if hasattr(layer.mlp, "gate"):
                    layer.mlp.gate.weight.normal_(0, 0.5)
    else:
        model = tf.Qwen3ForCausalLM(tf.Qwen3Config(**kw))
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _save(tmp_path_factory.mktemp("r3") / "moe", moe=True, seed=0)


@pytest.fixture(scope="module")
def engine(moe_dir: Path) -> Iterator[Engine]:
    eng = Engine(str(moe_dir), num_threads=1, load_tokenizer=False)
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def client(engine: Engine) -> Iterator[TestClient]:
    with TestClient(create_app(engine)) as c:
        yield c


def hf_routing(moe_dir: Path, tokens: list[int]) -> np.ndarray:
    """HF's own router over ``tokens``: ``[len(tokens), layers, top_k]`` sorted expert ids."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(moe_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        out = model(torch.tensor([tokens]), output_router_logits=True)
    moe_layers = [i for i in range(NUM_LAYERS) if i != DENSE]
    assert len(out.router_logits) == len(moe_layers)
    routing = np.zeros((len(tokens), NUM_LAYERS, TOP_K), dtype=np.int32)
    for layer, logits in zip(moe_layers, out.router_logits, strict=True):
        routing[:, layer] = logits.reshape(len(tokens), -1).topk(TOP_K, dim=-1).indices.numpy()
    return np.sort(routing, axis=-1)


def decode(meta: dict, rows: int) -> np.ndarray:
    flat = np.frombuffer(base64.b64decode(meta["routed_experts"]), dtype="<i4")
    return flat.reshape(rows, NUM_LAYERS, TOP_K)


@pytest.mark.parametrize("start", ["zero", "mid", "prompt_len"])
def test_routed_experts_equal_hf_router(
    client: TestClient, moe_dir: Path, start: str, seed: int = 7
) -> None:
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(3, VOCAB, size=n).tolist() for n in (5, 9)]
    starts = {"zero": 0, "mid": 3, "prompt_len": 5}
    begin = starts[start]
    resp = client.post(
        "/generate",
        json={
            "input_ids": prompts,
            "sampling_params": {"max_new_tokens": 6, "temperature": 1.0, "n": 2,
                                "sampling_seed": seed, "ignore_eos": True},
            "return_routed_experts": True,
            "routed_experts_start_len": begin,
        },
    )  # fmt: skip
    assert resp.status_code == 200, resp.text
    outs = resp.json()
    assert len(outs) == 4
    cache: dict[tuple[int, ...], np.ndarray] = {}
    for k, out in enumerate(outs):
        tokens = prompts[k // 2] + out["output_ids"]
        fed = tokens[:-1]  # the last sampled token is never fed
        rows = len(fed) - begin
        got = decode(out["meta_info"], rows)
        ref = cache.setdefault(tuple(fed), hf_routing(moe_dir, fed))[begin:]
        assert (got[:, DENSE] == 0).all()
        agreement = (np.sort(got, axis=-1) == ref).all(axis=-1).mean()
        assert agreement == 1.0
        assert got.min() >= 0 and got.max() < NUM_EXPERTS


def test_no_routed_experts_unless_asked(client: TestClient) -> None:
    resp = client.post(
        "/generate", json={"input_ids": [4, 5, 6], "sampling_params": {"max_new_tokens": 2}}
    )
    assert resp.status_code == 200
    assert "routed_experts" not in resp.json()["meta_info"]


def test_start_past_the_prompt_is_400(client: TestClient) -> None:
    resp = client.post(
        "/generate",
        json={"input_ids": [4, 5, 6], "return_routed_experts": True, "routed_experts_start_len": 4},
    )
    assert resp.status_code == 400
    assert "routed_experts_start_len" in resp.json()["error"]["message"]
    resp = client.post("/generate", json={"input_ids": [4, 5], "routed_experts_start_len": -1})
    assert resp.status_code == 400
    assert "routed_experts_start_len" in resp.json()["error"]["message"]


def test_dense_model_is_400_naming_the_field(tmp_path: Path) -> None:
    eng = Engine(
        str(_save(tmp_path / "dense", moe=False, seed=0)), num_threads=1, load_tokenizer=False
    )
    try:
        with TestClient(create_app(eng)) as c:
            resp = c.post("/generate", json={"input_ids": [4, 5], "return_routed_experts": True})
            assert resp.status_code == 400
            message = resp.json()["error"]["message"]
            assert "return_routed_experts" in message and "MoE" in message
            ok = c.post(
                "/generate", json={"input_ids": [4, 5], "sampling_params": {"max_new_tokens": 1}}
            )
            assert ok.status_code == 200
    finally:
        eng.shutdown()


def test_client_decodes_into_the_sample(engine: Engine, moe_dir: Path) -> None:
    async def run() -> tuple[list, object]:
        transport = httpx.ASGITransport(app=create_app(engine))
        async with SGLangClient("http://engine", transport=transport) as cl:
            one = await cl.generate(
                [9, 8, 7, 6], {"max_new_tokens": 3, "ignore_eos": True},
                return_routed_experts=True, routed_experts_start_len=2,
            )  # fmt: skip

            async def reward(samples: list) -> RewardCounts:
                for s in samples:
                    s.reward = float(len(s.response_tokens))
                return RewardCounts()

            cfg = RolloutConfig(
                n_samples_per_prompt=2, max_response_len=4, return_routed_experts=True
            )
            result = await generate_groups(
                cl, [Prompt(text="a", label="b", metadata={})], lambda t: [11, 12, 13],
                lambda ids: "", cfg, [], reward, want_groups=1, seed=0, num_layers=NUM_LAYERS,
            )  # fmt: skip
        return result.samples, one

    samples, one = asyncio.run(run())
    routed = one.routed_experts(NUM_LAYERS)
    fed = [9, 8, 7, 6, *one.output_ids][:-1]
    assert routed.shape == (len(fed) - 2, NUM_LAYERS, TOP_K)
    assert (np.sort(routed, axis=-1) == hf_routing(moe_dir, fed)[2:]).all()
    assert len(samples) == 2
    for s in samples:
        r = s.rollout_routed_experts
        assert isinstance(r, torch.Tensor) and r.dtype == torch.int32
        assert tuple(r.shape) == (len(s.tokens) - 1, NUM_LAYERS, TOP_K)
        ref = hf_routing(moe_dir, s.tokens[:-1])
        assert (np.sort(r.numpy(), axis=-1) == ref).all()


def test_bfloat16_engine_differs_a_little_from_fp32(engine: Engine, moe_dir: Path) -> None:
    bf16 = Engine(str(moe_dir), dtype="bfloat16", num_threads=1, load_tokenizer=False)
    try:
        assert {p.dtype for p in bf16.model.parameters()} == {torch.bfloat16}
        prompt = list(range(10, 40))
        body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": 1},
                "return_logprob": True, "logprob_start_len": 1}  # fmt: skip
        lps = []
        for eng in (engine, bf16):
            with TestClient(create_app(eng)) as c:
                meta = c.post("/generate", json=body).json()["meta_info"]
            lps.append(np.array([t[0] for t in meta["input_token_logprobs"]]))
        diff = np.abs(lps[0] - lps[1]).mean()
        assert 0 < diff < 0.05
        # weight updates are cast to the engine's dtype
        name = "model.layers.0.mlp.gate.weight"
        new = torch.randn(NUM_EXPERTS, 64)
        bf16.call(lambda: bf16.runner.load([(name, new)])).result()
        assert bf16.runner.tensor(name).dtype == torch.bfloat16
        assert torch.equal(bf16.runner.tensor(name), new.to(torch.bfloat16))
    finally:
        bf16.shutdown()
