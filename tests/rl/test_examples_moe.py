"""The MoE GRPO example (examples/math_moe.yaml) and its base recipe: they load, agree on
the model, and export to the built-in engine as Qwen3-MoE (the --dry-run of every example is
in test_grpo_cli)."""

from __future__ import annotations

from pathlib import Path

import pytest

from titan_core.config import ConfigError, load_config
from titan_core.config.pretrain import ModelConfig, PretrainConfig
from titan_core.models.hf.convert import model_config_from_hf
from titan_core.models.hf.from_titan import hf_config_for
from titan_rl.config import GRPOConfig
from titan_rl.grpo import main, resolve_config

REPO = Path(__file__).resolve().parents[2]
SHAPE = (
    "num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size", "seq_length",
    "max_position_embeddings", "untie_embeddings_and_output_weights", "qk_layernorm",
    "num_moe_experts", "moe_router_topk", "moe_ffn_hidden_size",
)  # fmt: skip


@pytest.fixture(scope="module")
def job() -> GRPOConfig:
    return resolve_config(load_config(GRPOConfig, REPO / "examples/math_moe.yaml"))


def test_the_job_is_moe_bf16_with_replay(job: GRPOConfig) -> None:
    assert job.model.num_moe_experts == 8 and job.model.moe_router_topk == 2
    assert job.engines.dtype == "bfloat16"
    assert job.algo.routing_replay and job.rollout.return_routed_experts


def test_the_base_recipe_builds_the_jobs_model(job: GRPOConfig) -> None:
    assert job.policy.pretrain_config is not None
    base = load_config(PretrainConfig, REPO / job.policy.pretrain_config)
    assert base.data.type == "arithmetic_sft" and base.train.stop_at_eval_accuracy
    assert Path(job.policy.load).parent == Path(base.run.dir)
    for key in SHAPE:
        assert getattr(job.model, key) == getattr(base.model, key), key


def test_the_moe_model_exports_as_qwen3_moe_and_maps_back(job: GRPOConfig) -> None:
    hf = hf_config_for(job.model, vocab_size=320, eos_token_id=3)
    assert hf["model_type"] == "qwen3_moe" and hf["norm_topk_prob"] is True
    back = model_config_from_hf(hf, seq_length=job.model.seq_length)
    for key in SHAPE:
        assert getattr(back, key) == getattr(job.model, key), key


def test_a_dense_model_still_exports_as_llama() -> None:
    assert hf_config_for(ModelConfig(), vocab_size=320)["model_type"] == "llama"


def test_moe_without_qk_norm_is_refused_with_the_key_to_set() -> None:
    model = ModelConfig(num_moe_experts=4, moe_router_topk=2)
    with pytest.raises(ConfigError, match="model.qk_layernorm=true"):
        hf_config_for(model, vocab_size=320)


def test_dry_run(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--config", str(REPO / "examples/math_moe.yaml"), "--dry-run"]) == 0
    assert "engines: 1 x builtin" in capsys.readouterr().out
