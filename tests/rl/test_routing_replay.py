"""Routing replay (R3) in the policy trainer against the built-in engine's routing, in fp32.

The trainer's routers are perturbed on the rows of the experts the rollout never picked (in
each layer): the replayed experts' logits, so their gates, are unchanged, while the router's
own top-k picks other experts for many tokens; with replay the logprobs must still equal the
engine's, without replay they must not."""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from titan_rl.sample import Sample
from titan_rl.trainer.batch import pack_samples

REPO = Path(__file__).resolve().parents[2]
VOCAB, LAYERS, EXPERTS, TOP_K = 256, 2, 16, 2


def _save_model(path: Path, seed: int) -> Path:
    import transformers as tf

    torch.manual_seed(seed)
    cfg = tf.Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=LAYERS,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=64,
        num_experts=EXPERTS, num_experts_per_tok=TOP_K, moe_intermediate_size=32,
        norm_topk_prob=True, tie_word_embeddings=False, eos_token_id=VOCAB + 1,
    )  # fmt: skip
    model = tf.Qwen3MoeForCausalLM(cfg)
    with torch.no_grad():  # routers with clear preferences (no near-ties), distinct experts
        for layer in model.model.layers:
            layer.mlp.gate.weight.normal_(0, 1.0)
    model.save_pretrained(path)
    return path


def _engine_samples(model_dir: Path, seed: int, n: int = 4) -> list[dict]:
    """``n`` samples (2 per prompt) from the built-in engine in fp32, with logprobs and
    routed experts."""
    from fastapi.testclient import TestClient

    from titan_rl.engine.core import Engine
    from titan_rl.engine.server import create_app

    rng = np.random.default_rng(seed)
    prompts = [rng.integers(3, VOCAB - 6, size=int(rng.integers(4, 9))).tolist()
               for _ in range(n // 2)]  # fmt: skip
    eng = Engine(str(model_dir), dtype="float32", num_threads=1, load_tokenizer=False)
    try:
        with TestClient(create_app(eng)) as client:
            resp = client.post("/generate", json={
                "input_ids": prompts, "return_logprob": True, "return_routed_experts": True,
                "sampling_params": {"max_new_tokens": int(rng.integers(4, 9)), "n": 2,
                                    "temperature": 1.0, "sampling_seed": seed,
                                    "ignore_eos": True},
            })  # fmt: skip
            assert resp.status_code == 200, resp.text
            outs = resp.json()
    finally:
        eng.shutdown()
    samples = []
    for k, out in enumerate(outs):
        prompt, response = prompts[k // 2], out["output_ids"]
        flat = np.frombuffer(base64.b64decode(out["meta_info"]["routed_experts"]), dtype="<i4")
        routed = flat.reshape(len(prompt) + len(response) - 1, LAYERS, TOP_K)
        logprobs = [lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]]
        samples.append({"prompt": prompt, "response": response, "logprobs": logprobs,
                        "routed": routed.tolist()})  # fmt: skip
    return samples


def _run_worker(tmp: Path, seed: int, nproc: int = 1, *extra: str) -> list[dict]:
    model_dir = _save_model(tmp / "hf", seed)
    (tmp / "samples.json").write_text(json.dumps(_engine_samples(model_dir, seed)))
    launch = [sys.executable]
    if nproc > 1:
        launch += ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    proc = subprocess.run(
        [*launch, str(REPO / "tests/rl/routing_replay_worker.py"), "--model-dir", str(model_dir),
         "--samples", str(tmp / "samples.json"), "--run-dir", str(tmp / "run"),
         "--out", str(tmp / "out"), "--seed", str(seed), *extra],
        capture_output=True, text=True, cwd=REPO, timeout=600,
        env={**os.environ, "PYTHONPATH": str(REPO), "PYTHONWARNINGS": "ignore"},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [json.loads((tmp / "out" / f"rank{r}.json").read_text()) for r in range(nproc)]


def _check(ranks: list[dict]) -> None:
    last = [r for r in ranks if r["same_weights"]["max_abs_diff"] is not None]
    assert last, "no rank returned logprobs"
    for r in ranks:  # agreement is reduced over every rank: the same figure everywhere
        # the engine's weights: the trainer's router picks the engine's experts
        assert r["same_weights"]["agreement"] == 1.0
        # perturbed routers choose otherwise (measured even though replay overrides them)
        assert r["perturbed_experts"] > 0
        assert r["perturbed_replay"]["agreement"] < 1.0
        # the policy update's old-logprob forward measures it too, into the step metrics
        assert r["train"]["mismatch/routing_agreement"] == r["perturbed_replay"]["agreement"]
    for r in last:
        assert r["same_weights"]["max_abs_diff"] < 1e-4
        # replay: the rollout's experts, so the engine's logprobs, whatever the router says
        assert r["perturbed_replay"]["max_abs_diff"] < 1e-4
        # without replay the perturbed routers' experts give other logprobs
        assert r["perturbed_free"]["max_abs_diff"] > 1e-3
        assert np.isfinite(r["train"]["train/loss"])


@pytest.mark.slow  # a trainer process of its own: ~15-25 s
def test_replay_gives_the_engines_logprobs_with_a_perturbed_router(tmp_path: Path) -> None:
    _check(_run_worker(tmp_path, seed=3))


@pytest.mark.slow  # two trainer processes (gloo)
@pytest.mark.parametrize("layout", [("--pp", "2"), ("--ep", "2")], ids=["pp2", "ep2"])
def test_replay_across_pipeline_and_expert_parallel(tmp_path: Path, layout: tuple) -> None:
    _check(_run_worker(tmp_path, 5, 2, *layout))


def _sample(i: int, prompt: list[int], response: list[int], routed: np.ndarray | None) -> Sample:
    return Sample(
        group_index=0, index=i, prompt="", label="", prompt_tokens=prompt,
        response_tokens=response, rollout_routed_experts=None if routed is None
        else torch.from_numpy(routed),
    )  # fmt: skip


def test_pack_aligns_routed_experts_with_tokens_and_pads_with_minus_one() -> None:
    rng = np.random.default_rng(0)
    shapes = [(3, 4), (5, 2)]
    routed = [rng.integers(0, EXPERTS, (p + r - 1, 3, 2), dtype=np.int32) for p, r in shapes]
    samples = [
        _sample(i, list(range(1, p + 1)), list(range(1, r + 1)), routed[i])
        for i, (p, r) in enumerate(shapes)
    ]
    batch = pack_samples(samples, pad_id=0, pad_to_multiple=4)
    assert batch.routed_experts.shape == (2, 8, 3, 2)
    for i, (p, r) in enumerate(shapes):
        n = p + r - 1
        assert torch.equal(batch.routed_experts[i, :n], torch.from_numpy(routed[i]).long())
        assert (batch.routed_experts[i, n:] == -1).all()  # the last token, padding
    picked = batch.select(torch.tensor([1]))
    assert torch.equal(picked.routed_experts[0], batch.routed_experts[1])


def test_pack_refuses_mixed_or_misshaped_routed_experts() -> None:
    ok = np.zeros((4, 2, 1), dtype=np.int32)
    assert pack_samples([_sample(0, [1, 2], [3, 4], None)], pad_id=0).routed_experts is None
    with pytest.raises(ValueError, match="1 of 2 samples carry no rollout_routed_experts"):
        pack_samples([_sample(0, [1, 2], [3], None), _sample(1, [1, 2], [3, 4, 5], ok)], 0)
    with pytest.raises(ValueError, match=r"expected \(3, 2, 1\)"):
        pack_samples([_sample(0, [1, 2], [3, 4], ok)], pad_id=0)


def test_routing_replay_turns_on_routed_experts_in_the_rollout() -> None:
    from titan_core.config import load_config
    from titan_rl.config import GRPOConfig
    from titan_rl.grpo import resolve_config

    math = REPO / "examples/math.yaml"
    cfg = resolve_config(load_config(GRPOConfig, math, ["algo.routing_replay=true"]))
    assert cfg.rollout.return_routed_experts is True and resolve_config(cfg) == cfg
    off = resolve_config(load_config(GRPOConfig, math, []))
    assert off.algo.routing_replay is False and off.rollout.return_routed_experts is False
