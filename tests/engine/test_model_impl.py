"""``--model-impl``: which forward the engine runs a model through, and what it refuses.
(The two forwards' outputs are checked against a plain HF forward, family by family, in
tests/rollout/test_engine_core.py.)"""

from __future__ import annotations

import pytest
import torch

from tests.rollout.conftest import make_tiny_model
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


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "qwen3_moe"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_own_forwards_norms_and_rotary_table_give_the_modules_values(
    family: str, dtype: torch.dtype, tmp_path
) -> None:
    """The own forward's RMSNorms (torch's ``rms_norm``) and its rotary table (the module's
    ``cos, sin`` made once, indexed per step) give exactly what the model's modules give, for
    each served family, in float32 and bfloat16, at hidden sizes with and without a vector
    tail, and at positions past the table's first size."""
    from transformers import AutoModelForCausalLM

    from titan_rl.engine.lean import _ROTARY_POSITIONS, _norm, _RotaryTable

    path = make_tiny_model(tmp_path / family, family)
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype).eval()
    layer = model.model.layers[0]
    norms = [model.model.norm, layer.input_layernorm, layer.post_attention_layernorm]
    norms += [m for m in (getattr(layer.self_attn, "q_norm", None),) if m is not None]
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for norm in norms:
            norm.weight.normal_(generator=g)  # not the ones they start with
            width = norm.weight.shape[0]
            for shape in [(64, 1, width), (3, 7, width), (5, 2, 3, width)]:
                x = torch.randn(shape, generator=g).to(dtype)
                assert torch.equal(_norm(norm, x), norm(x)), (type(norm).__name__, shape)
        table = _RotaryTable(model.model.rotary_emb)
        h = torch.zeros(4, 3, model.config.hidden_size, dtype=dtype)
        for top in (40, 3 * _ROTARY_POSITIONS):  # the second grows the table
            pos = torch.randint(0, top, (4, 3), generator=g)
            got, want = table(h, pos), model.model.rotary_emb(h, pos)
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_a_norm_with_a_hook_is_called_as_a_module() -> None:
    from titan_rl.engine.lean import _norm

    norm = _qwen3().model.norm
    seen = []
    norm.register_forward_hook(lambda mod, args, out: seen.append(out))
    x = torch.randn(2, 3, 32)
    out = _norm(norm, x)
    assert len(seen) == 1 and seen[0] is out
