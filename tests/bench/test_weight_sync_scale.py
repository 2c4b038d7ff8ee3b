"""bench/weight_sync_scale.py: the analytic model of who sends what (no engine, no cluster)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]


def _load() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "weight_sync_scale", REPO / "bench/weight_sync_scale.py"
    )
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


ws = _load()

#: megatron-core layouts of the same 256 or 512 GPUs: (pp, tp, dp, ep, etp)
LAYOUTS = [
    (16, 1, 16, 16, 1),
    (8, 8, 32, 32, 1),
    (4, 2, 32, 16, 2),
    (2, 4, 8, 8, 4),
    (1, 1, 4, 2, 1),
]
RATES = ws.Rates(link=50e9, stage=1e12, per_tensor_s=0.0, latency_s=0.0, service_s=0.0)


def _hf_counts(cfg) -> int:
    """Elements in the state dict of transformers' own model of ``cfg`` (on the meta device)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    return sum(v.numel() for v in model.state_dict().values())


def _tiny_configs() -> list:
    from transformers import (
        DeepseekV3Config,
        MixtralConfig,
        Qwen2MoeConfig,
        Qwen3Config,
        Qwen3MoeConfig,
    )

    common = dict(vocab_size=96, hidden_size=64, num_attention_heads=4, tie_word_embeddings=False)
    mla = dict(
        kv_lora_rank=16,
        qk_nope_head_dim=8,
        qk_rope_head_dim=4,
        v_head_dim=8,
        n_group=1,
        topk_group=1,
    )
    return [
        DeepseekV3Config(
            **common, **mla, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=4,
            num_key_value_heads=4, n_routed_experts=8, n_shared_experts=2, num_experts_per_tok=2,
            first_k_dense_replace=1, q_lora_rank=24,
        ),
        DeepseekV3Config(
            **common, **mla, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
            num_key_value_heads=4, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
            first_k_dense_replace=2, q_lora_rank=None,
        ),
        Qwen3MoeConfig(
            **common, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=4,
            num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
            decoder_sparse_step=2, mlp_only_layers=[3],
        ),
        Qwen2MoeConfig(
            **common, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2,
            shared_expert_intermediate_size=48, num_key_value_heads=2, num_experts=8,
            num_experts_per_tok=2,
        ),
        MixtralConfig(
            **common, intermediate_size=32, num_hidden_layers=2, num_key_value_heads=2,
            num_local_experts=4,
        ),
        Qwen3Config(**common, intermediate_size=96, num_hidden_layers=2, num_key_value_heads=2, head_dim=16),
    ]  # fmt: skip


@pytest.mark.parametrize("index", range(6))
def test_parameter_count_matches_transformers(index: int) -> None:
    cfg = _tiny_configs()[index]
    assert sum(t.numel for t in ws.model_tensors(cfg.to_dict())) == _hf_counts(cfg)


def test_kimi_k2_is_about_a_trillion_parameters() -> None:
    params = sum(t.numel for t in ws.model_tensors(ws.KIMI_K2))
    assert abs(params / 1.03e12 - 1) < 0.01
    # DeepSeek-V3 has the same shape with 256 experts, 128 heads, 3 dense layers: 671B public
    v3 = dict(ws.KIMI_K2, vocab_size=129280, first_k_dense_replace=3, n_routed_experts=256,
              num_attention_heads=128, num_key_value_heads=128)  # fmt: skip
    assert abs(sum(t.numel for t in ws.model_tensors(v3)) / 671e9 - 1) < 0.001


def test_tied_embeddings_are_sent_once() -> None:
    untied = ws.model_tensors(ws.KIMI_K2)
    tied = ws.model_tensors(dict(ws.KIMI_K2, tie_word_embeddings=True))
    assert untied[:-1] == tied and untied[-1].group == "lm_head"


def test_fp8_wire_bytes() -> None:
    t = ws.Tensor("routed_expert", 3, 0, (256, 300), True)
    assert ws.tensor_bytes(t, "fp8") == 256 * 300 + 4 * 2 * 3  # one fp32 scale per 128x128 block
    assert ws.tensor_bytes(t, "bf16") == 2 * 256 * 300
    emb = ws.Tensor("embedding", None, None, (1000, 64), True)
    assert ws.tensor_bytes(emb, "fp8") == ws.tensor_bytes(emb, "bf16")


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("engines", [1, 3])
def test_bytes_per_sender_sum_to_model_bytes_times_replicas(layout: tuple, engines: int) -> None:
    tensors = ws.model_tensors(ws.KIMI_K2)
    model = sum(ws.tensor_bytes(t, "bf16") for t in tensors)
    lay = ws.Layout(*layout)
    sends = ws.senders(tensors, lay, 512 << 20, "bf16")
    assert sum(s.sent_bytes(engines) for s in sends) == model * engines
    assert len(sends) == lay.pp * lay.ep  # every EP rank of every stage sends its experts
    assert sum(s.tensors for s in sends) == len(tensors)
    # each EP rank sends its own experts only: the stage's expert bytes split evenly
    for stage in range(lay.pp):
        experts = [s.nbytes for s in sends if s.stage == stage and s.ep_rank > 0]
        assert len(set(experts)) <= 1
    old = ws.funnel(tensors, sends, 512 << 20, "bf16")
    assert len(old) == 1 and old[0].sent_bytes(engines) == model * engines


def test_pp2_halves_a_dense_models_max_rank_bytes() -> None:
    from transformers import Qwen3Config

    cfg = Qwen3Config(
        vocab_size=1024, hidden_size=256, intermediate_size=768, num_hidden_layers=8,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, tie_word_embeddings=False,
    ).to_dict()  # fmt: skip
    tensors = ws.model_tensors(cfg)
    edge = max(ws.tensor_bytes(t, "bf16") for t in tensors if t.group in ("embedding", "lm_head"))
    one = ws.senders(tensors, ws.Layout(pp=1, tp=1, dp=1, ep=1), 1 << 20, "bf16")
    two = ws.senders(tensors, ws.Layout(pp=2, tp=1, dp=1, ep=1), 1 << 20, "bf16")
    max1, max2 = max(s.sent_bytes(2) for s in one), max(s.sent_bytes(2) for s in two)
    assert len(one) == 1 and len(two) == 2
    assert (
        abs(max2 - max1 / 2) <= 2 * edge
    )  # x 2 engines; the rest is the embedding/lm_head imbalance
    assert max2 < 0.55 * max1


@pytest.mark.parametrize(
    ("layers", "pp", "last", "split"),
    [(61, 16, None, [4] * 15 + [1]), (61, 8, None, [8] * 7 + [5]), (64, 16, None, [4] * 16),
     (61, 4, 1, [20, 20, 20, 1]), (61, 4, None, [15, 15, 15, 16]), (61, 2, None, [31, 30]),
     (5, 1, None, [5])],
)  # fmt: skip
def test_stage_split_as_megatron(layers: int, pp: int, last: int | None, split: list[int]) -> None:
    assert ws.Layout(pp=pp, tp=1, dp=1, ep=1, last_stage_layers=last).stage_layers(layers) == split


@pytest.mark.parametrize(
    ("kwargs", "layers", "message"),
    [(dict(pp=4, last_stage_layers=2), 61, "split evenly"), (dict(pp=8), 4, "cannot fill"),
     (dict(dp=4, ep=8), 61, "must divide tp x dp")],
)  # fmt: skip
def test_bad_layouts_say_what_to_change(kwargs: dict, layers: int, message: str) -> None:
    base = dict(pp=1, tp=1, dp=1, ep=1)
    with pytest.raises(ValueError, match=message):
        ws.Layout(**{**base, **kwargs}).stage_layers(layers)


def test_ep_must_divide_the_experts() -> None:
    with pytest.raises(ValueError, match="must divide the model's 384"):
        ws.senders(ws.model_tensors(ws.KIMI_K2), ws.Layout(pp=1, tp=1, dp=5, ep=5), 1 << 30, "bf16")


def test_projection_terms() -> None:
    """With copies, tensors and requests free, the terms are the network's, and the slowest
    mooncake sender is the one with the most bytes."""
    tensors = ws.model_tensors(ws.KIMI_K2)
    sends = ws.senders(tensors, ws.Layout(), 512 << 20, "bf16")
    model = sum(s.nbytes for s in sends)
    engines, size = 8, 32
    moon = ws.project("mooncake", sends, engines, size, RATES)
    assert moon.send["wire"] == pytest.approx(max(s.nbytes for s in sends) * engines / RATES.link)
    assert moon.receive["wire"] == pytest.approx(model / size / RATES.link)
    assert moon.total_s == pytest.approx(max(moon.send_s, moon.receive_s))
    dist = ws.project("distributed", sends, engines, size, RATES)
    assert dist.send["wire"] == pytest.approx(model / RATES.link)  # one sender at a time
    old = ws.funnel(tensors, sends, 512 << 20, "bf16")
    anchor = ws.project("mooncake", old, engines, size, RATES, old=True)
    assert anchor.send["wire"] == pytest.approx(model * engines / RATES.link)
    assert moon.total_s < anchor.total_s / 50
    slow = ws.Rates(link=50e9, stage=1e12, per_tensor_s=0.0, latency_s=0.0, service_s=1.0)
    busy = ws.project("mooncake", sends, engines, size, slow)
    assert busy.receive["requests"] == sum(s.buckets for s in sends)
    assert busy.dominant == "receive: requests"


def test_main_prints_the_projection(capsys: pytest.CaptureFixture[str]) -> None:
    ws.main(
        ["--bucket-mib", "16", "--request-ms", "2", "1", "--device", "cpu", "--copy-gbps", "1000"]
    )
    out = capsys.readouterr().out
    params = sum(t.numel for t in ws.model_tensors(ws.KIMI_K2))
    assert f"total params: {params:,}" in out
    assert "= 256 GPUs" in out and "x funnel" in out and "goal on paper" in out
    assert "quoted, not measured" in out
