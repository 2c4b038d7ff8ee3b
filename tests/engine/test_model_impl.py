"""``--model-impl``: which forward the engine runs a model through, and what it refuses.
(The two forwards' outputs are checked against a plain HF forward, family by family, in
tests/rollout/test_engine_core.py.)"""

from __future__ import annotations

import pytest
import torch

from titan_rl.engine.lean import LeanForward, lean_forward
from titan_rl.engine.runner import ModelRunner, _pick_forward
from titan_rl.engine_settings import EngineSettings


def _gpt2() -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=1, n_head=2)
    return GPT2LMHeadModel(cfg).eval()


def _qwen3() -> torch.nn.Module:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16,
    )  # fmt: skip
    return Qwen3ForCausalLM(cfg).eval()


def test_auto_runs_a_served_family_on_the_engines_own_forward() -> None:
    assert EngineSettings().model_impl == "auto"
    runner = ModelRunner(_qwen3())
    assert runner.model_impl == "sglang"
    assert ModelRunner(_qwen3(), model_impl="transformers").model_impl == "transformers"


def test_a_model_the_own_forward_cannot_run_falls_back_or_is_refused_by_name() -> None:
    model = _gpt2()
    why = lean_forward(model)
    assert not isinstance(why, LeanForward)
    assert "model.embed_tokens" in why
    assert _pick_forward(model, "auto") == ("transformers", None)
    with pytest.raises(ValueError, match=r"--model-impl sglang: .*model\.embed_tokens"):
        _pick_forward(model, "sglang")


def test_the_flag_is_the_engines_cli_flag() -> None:
    from titan_rl.engine.cli import build_parser

    args = build_parser().parse_args(["--model-path", "m", "--model-impl", "transformers"])
    assert args.model_impl == "transformers"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--model-path", "m", "--model-impl", "vllm"])
