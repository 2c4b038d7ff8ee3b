"""Shared fixtures: tiny random HF models written to tmp dirs, and built-in engine servers."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

if importlib.util.find_spec("titan_rl") is None:  # plain `pytest` without the package installed
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from titan_rl.actors.config import EngineServerConfig  # noqa: E402
from titan_rl.actors.server import ServerProcess  # noqa: E402

VOCAB = 300
EOS = 2


def make_tiny_model(path: Path, family: str = "llama", seed: int = 0) -> Path:
    """Save a random ~100k-parameter causal LM of ``family`` to ``path`` (no download)."""
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
        Qwen3MoeConfig,
        Qwen3MoeForCausalLM,
    )

    kw = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        eos_token_id=EOS,
        bos_token_id=1,
        pad_token_id=0,
        tie_word_embeddings=False,
    )
    classes = {
        "llama": (LlamaConfig, LlamaForCausalLM),
        "qwen2": (Qwen2Config, Qwen2ForCausalLM),
        "qwen3": (Qwen3Config, Qwen3ForCausalLM),
        "qwen3_moe": (Qwen3MoeConfig, Qwen3MoeForCausalLM),
    }
    cfg_cls, model_cls = classes[family]
    extra: dict = {"head_dim": 16} if family.startswith("qwen3") else {}
    if family == "qwen3_moe":  # 4 experts, top-2, as Titan's exporter maps them
        extra.update(
            num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True
        )
    torch.manual_seed(seed)
    model = model_cls(cfg_cls(**kw, **extra))
    # larger logits make greedy outputs depend clearly on the weights
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def make_model() -> Callable[..., Path]:
    """``make_model(path, family="llama", seed=0)``: save a tiny random model, return its dir."""
    return make_tiny_model


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny-llama"), "llama")


def start_engine(model: Path, log_dir: Path, name: str, **kw: object) -> ServerProcess:
    cfg = EngineServerConfig(
        model_path=str(model),
        backend="builtin",
        num_threads=1,
        log_dir=str(log_dir),
        startup_timeout_s=120,
        **kw,
    )
    server = ServerProcess(cfg, name=name)
    server.start()
    return server


@pytest.fixture(scope="session")
def engine(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """One built-in engine shared by the read-only tests."""
    server = start_engine(
        tiny_model,
        tmp_path_factory.mktemp("logs"),
        "shared-engine",
        extra_args=["--max-request-bytes", str(1 << 20)],
    )
    yield server
    server.stop()


@pytest.fixture(scope="session")
def engine_factory(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Callable[..., ServerProcess]]:
    """``engine_factory(model_dir, name, **config)``: start a built-in engine; stopped at the end."""
    started: list[ServerProcess] = []
    log_dir = tmp_path_factory.mktemp("engine-logs")

    def factory(model: Path, name: str, **kw: object) -> ServerProcess:
        server = start_engine(model, log_dir, name, **kw)
        started.append(server)
        return server

    yield factory
    for server in started:
        server.stop()
