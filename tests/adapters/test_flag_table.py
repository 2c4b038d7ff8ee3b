"""Every flag of slime's and miles' installed parsers (and the Megatron-LM flags their
scripts pass) is in exactly one class of the flag table, and each class does what it says:
an honoured flag with a Titan key changes that key, a refused one exits 2 naming it, one with
no effect here is named at start-up. adapters/README.md's flag table is generated from the
code's (TITAN_UPDATE_README=1 rewrites it)."""

from __future__ import annotations

import argparse
import os
import re
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("slime.ray.placement_group", reason="slime's wheel (../shared/peers) is needed")

from adapters.common.arguments import framework_flags, given_dests, parse  # noqa: E402
from adapters.common.config import titan_config_from_args  # noqa: E402
from adapters.common.flag_table import (  # noqa: E402
    FAMILIES,
    FLAG_TABLE,
    Honoured,
    NoEffect,
    Refused,
    entry_for,
)
from adapters.common.peer_flags import FlagSpec  # noqa: E402
from titan_core.config import ConfigError  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
README = REPO / "adapters" / "README.md"
FRAMEWORKS = ("slime", "miles")
#: the least a parse needs (both frameworks require these)
BASE = ["--rollout-batch-size", "4", "--n-samples-per-prompt", "2", "--num-rollout", "1",
        "--custom-rm-path", "adapters.slime.rewards.exact_match"]  # fmt: skip


def _specs() -> dict[str, FlagSpec]:
    out: dict[str, FlagSpec] = {}
    for fw in FRAMEWORKS:
        for spec in framework_flags(fw):
            out.setdefault(spec.dest, spec)
    return out


def _framework(dest: str) -> str:
    return next(fw for fw in FRAMEWORKS if any(s.dest == dest for s in framework_flags(fw)))


#: values for flags whose generic non-default value the config would refuse
VALUES: dict[str, list[str]] = {
    "lr": ["0.002"], "min_lr": ["1e-7"], "num_layers": ["2"], "hidden_size": ["64"],
    "num_attention_heads": ["4"], "ffn_hidden_size": ["96"], "kv_channels": ["16"],
    "seq_length": ["64"], "vocab_size": ["300"], "moe_ffn_hidden_size": ["32"],
    "moe_router_topk": ["1"], "moe_layer_freq": ["[1,1]"], "moe_router_bias_update_rate": ["0.01"],
    "moe_expert_capacity_factor": ["1.5"], "moe_shared_expert_intermediate_size": ["32"],
    "recompute_granularity": ["selective"], "recompute_method": ["uniform"],
    "recompute_num_layers": ["1"], "recompute_modules": ["mlp"], "micro_batch_size": ["2"],
    "rollout_batch_size": ["8"], "n_samples_per_prompt": ["4"], "rollout_num_gpus_per_engine": ["1"],
    "lr_warmup_iters": ["3"], "lr_decay_iters": ["50"], "advantage_estimator": ["gspo"],
    "kl_loss_type": ["k2"], "eps_clip": ["0.3"], "eps_clip_high": ["0.4"], "eps_clip_c": ["3.0"],
    "update_weight_buffer_size": ["1048576"], "tis_clip": ["3.0"], "tis_clip_low": ["0.2"],
    "fp8_format": ["e4m3"], "fp8_recipe": ["blockwise"], "transformer_impl": ["local"],
    "moe_token_dispatcher_type": ["allgather"], "moe_router_score_function": ["sigmoid"],
    "position_embedding_type": ["learned_absolute"], "normalization": ["LayerNorm"],
    "lr_decay_style": ["linear"], "rotary_base": ["500000"], "seed": ["7"],
    "distributed_timeout_minutes": ["3"], "norm_epsilon": ["0.001"], "weight_decay": ["0.2"],
    "adam_beta1": ["0.8"], "adam_beta2": ["0.9"], "adam_eps": ["0.0001"], "clip_grad": ["0.5"],
    "init_method_std": ["0.01"], "hidden_dropout": ["0.2"], "attention_dropout": ["0.2"],
    "moe_aux_loss_coeff": ["0.1"], "make_vocab_size_divisible_by": ["64"],
    "max_position_embeddings": ["256"], "moe_router_dtype": ["fp64"],
    "moe_router_load_balancing_type": ["none"], "moe_token_drop_policy": ["position"],
    "kl_loss_coef": ["0.05"], "entropy_coef": ["0.01"],
}  # fmt: skip
#: flags whose key needs another flag with it to be valid
WITH: dict[str, list[str]] = {
    "recompute_method": ["--recompute-granularity", "full", "--recompute-num-layers", "1"],
    "recompute_num_layers": ["--recompute-granularity", "full", "--recompute-method", "uniform"],
    "recompute_modules": ["--recompute-granularity", "selective"],
    "moe_ffn_hidden_size": ["--num-experts", "4"], "moe_router_topk": ["--num-experts", "4"],
    "moe_grouped_gemm": ["--num-experts", "4"], "moe_token_dispatcher_type": ["--num-experts", "4"],
    "moe_token_drop_policy": ["--num-experts", "4", "--moe-expert-capacity-factor", "1.0"],
    "moe_router_enable_expert_bias": ["--num-experts", "4", "--moe-router-score-function", "sigmoid"],
    "moe_router_bias_update_rate": ["--num-experts", "4"],
    "moe_expert_capacity_factor": ["--num-experts", "4"],
    "moe_pad_expert_input_to_capacity": ["--num-experts", "4", "--moe-expert-capacity-factor", "1.0"],
    "moe_shared_expert_intermediate_size": ["--num-experts", "4"],
    "moe_shared_expert_overlap": ["--num-experts", "4", "--moe-shared-expert-intermediate-size", "32"],
    "moe_router_score_function": ["--num-experts", "4"], "moe_aux_loss_coeff": ["--num-experts", "4"],
    "moe_router_dtype": ["--num-experts", "4"], "moe_router_load_balancing_type": ["--num-experts", "4"],
    "moe_layer_freq": ["--num-experts", "4"], "moe_flex_dispatcher_backend": ["--num-experts", "4"],
    "num_experts": ["--moe-ffn-hidden-size", "32"], "eps_clip_c": ["--eps-clip", "0.2"],
    "kl_loss_coef": ["--use-kl-loss"], "kl_loss_type": ["--use-kl-loss"],
    "tis_clip": ["--use-tis"], "tis_clip_low": ["--use-tis"], "fp8_recipe": ["--fp8-format", "e4m3"],
    "sequence_parallel": ["--tensor-model-parallel-size", "2"],
    "virtual_pipeline_model_parallel_size": ["--pipeline-model-parallel-size", "2"],
    "expert_model_parallel_size": ["--num-experts", "4"],
    "expert_tensor_parallel_size": ["--num-experts", "4"],
    "use_routing_replay": ["--num-experts", "4"],
    "overlap_param_gather": ["--use-distributed-optimizer", "--overlap-grad-reduce"],
}  # fmt: skip


def _value_argv(spec: FlagSpec) -> list[str]:
    """The flag with a value other than its default."""
    if spec.action in ("store_true", "store_false", "boolean_optional", "count"):
        return [spec.name]
    if spec.dest in VALUES:
        return [spec.name, *VALUES[spec.dest]]
    if spec.choices:
        other = [c for c in spec.choices if c != spec.default]
        return [spec.name, str(other[0])]
    value = {"int": "3", "float": "0.5", "json": "{}"}.get(spec.type, "x")
    if spec.default is not None and str(spec.default) == value:
        value = {"int": "4", "float": "0.25"}.get(spec.type, "y")
    return [spec.name, *[value] * (spec.nargs if isinstance(spec.nargs, int) else 1)]


def _get(cfg: Any, key: str) -> Any:
    for part in key.split("."):
        cfg = getattr(cfg, part)
    return cfg


def test_every_flag_is_classified_once() -> None:
    missing = [
        (fw, s.name) for fw in FRAMEWORKS for s in framework_flags(fw)
        if entry_for(s.dest, s.name) is None
    ]  # fmt: skip
    assert not missing, f"flags with no class in adapters/common/flag_table.py: {missing}"
    known = set(_specs())
    stale = sorted(d for d in FLAG_TABLE if d not in known)
    assert not stale, f"flag-table rows naming no flag of slime, miles or Megatron-LM: {stale}"
    assert len(framework_flags("slime")) > 200 and len(framework_flags("miles")) > 300


KEYED = sorted(d for d, e in FLAG_TABLE.items() if isinstance(e, Honoured) and e.key)


@pytest.mark.parametrize("dest", KEYED)
def test_honoured_flag_sets_its_key(dest: str) -> None:
    spec, entry = _specs()[dest], FLAG_TABLE[dest]
    argv = [*BASE, *WITH.get(dest, []), *_value_argv(spec)]
    args = parse(_framework(dest), argv)
    cfg = titan_config_from_args(args)
    value = getattr(args, dest)
    expected = entry.convert(value) if entry.convert else value
    got = _get(cfg, entry.key)
    assert got == expected or (isinstance(got, float) and float(expected) == got), (
        f"{spec.name} {value}: {entry.key} is {got!r}, expected {expected!r}"
    )


def test_a_flag_left_at_its_default_never_overrides_the_yaml(tmp_path: Path) -> None:
    yaml = tmp_path / "titan.yaml"
    yaml.write_text("train:\n  lr: 0.5\n  min_lr: 0.0\n  seed: 11\nalgo:\n  eps_clip: 0.1\n")
    args = parse("slime", [*BASE, "--titan-config", str(yaml), "--seed", "5"])
    cfg = titan_config_from_args(args)
    # slime's defaults (--lr 1e-6, --eps-clip 0.2) are not given: the YAML holds; --seed is
    assert (cfg.train.lr, cfg.algo.eps_clip, cfg.train.seed) == (0.5, 0.1, 5)
    # under slime's own parser the namespace has no record of what was typed: a value that
    # differs from slime's default counts as given
    ns = argparse.Namespace(**vars(args))
    del ns.titan_given
    ns.lr = 0.25
    assert {"lr"} <= given_dests(ns, "slime") and "eps_clip" not in given_dests(ns, "slime")
    assert titan_config_from_args(ns).train.lr == 0.25


REFUSED = sorted(d for d, e in FLAG_TABLE.items() if isinstance(e, Refused))


@pytest.mark.parametrize("dest", REFUSED)
def test_refused_flag_exits_2_naming_it(dest: str, capsys: pytest.CaptureFixture) -> None:
    spec = _specs()[dest]
    with pytest.raises(SystemExit) as e:
        parse(_framework(dest), [*BASE, *_value_argv(spec)])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert spec.name in err and FLAG_TABLE[dest].instead in err


NO_EFFECT = sorted(d for d, e in FLAG_TABLE.items() if isinstance(e, NoEffect))


@pytest.mark.parametrize("dest", NO_EFFECT)
def test_no_effect_flag_is_named_with_its_reason(dest: str) -> None:
    spec = _specs()[dest]
    args = parse(_framework(dest), [*BASE, *_value_argv(spec)])
    assert f"{spec.name}: {FLAG_TABLE[dest].reason}" in args.titan_no_effect


def test_generated_sglang_and_router_flags_are_named(capsys: pytest.CaptureFixture) -> None:
    args = parse("slime", [*BASE, "--sglang-cuda-graph-bs", "1", "2", "4",
                           "--router-policy", "round_robin"])  # fmt: skip
    assert args.titan_generated_flags == {
        "--sglang-cuda-graph-bs": ["1", "2", "4"],
        "--router-policy": ["round_robin"],
    }
    from adapters.common.driver import generated_args

    # what sglang.launch_server / sglang-router get where the engines are SGLang servers /
    # there is a router (the driver says at start-up where not: test_slime_scripts)
    assert generated_args(args, "--sglang-") == ["--cuda-graph-bs", "1", "2", "4"]
    assert generated_args(args, "--router-") == ["--policy", "round_robin"]
    with pytest.raises(SystemExit) as e:
        parse("slime", [*BASE, "--no-such-flag", "1"])
    assert e.value.code == 2 and "--no-such-flag" in capsys.readouterr().err


def test_refused_value_of_an_honoured_flag(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit):
        parse("slime", [*BASE, "--advantage-estimator", "ppo"])
    assert "--advantage-estimator ppo" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse("slime", [*BASE, "--rotary-percent", "0.5"])
    assert "--rotary-percent 0.5" in capsys.readouterr().err


def test_hf_checkpoint_disagreeing_with_a_model_flag_names_both(tmp_path: Path) -> None:
    import json

    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps({
        "model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "hidden_size": 64,
        "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 300, "rms_norm_eps": 1e-6,
        "rope_theta": 1e6, "tie_word_embeddings": True, "hidden_act": "silu",
    }))  # fmt: skip
    ok = parse("slime", [*BASE, "--hf-checkpoint", str(hf), "--num-layers", "2",
                         "--group-query-attention", "--num-query-groups", "2"])  # fmt: skip
    cfg = titan_config_from_args(ok)
    assert (cfg.model.num_layers, cfg.model.num_query_groups, cfg.model.kv_channels) == (2, 2, 16)
    assert cfg.policy.format == "hf" and cfg.model.qk_layernorm
    bad = parse("slime", [*BASE, "--hf-checkpoint", str(hf), "--hidden-size", "128"])
    with pytest.raises(ConfigError, match=r"--hidden-size 128 .*model.hidden_size=64"):
        titan_config_from_args(bad)


# ---- the README's table, generated -------------------------------------------------------------
BEGIN, END = "<!-- flag table: generated by tests/adapters/test_flag_table.py -->", "<!-- end -->"


def render_table() -> str:
    rows = ["| flag | slime | miles | class | what it does here |", "|---|---|---|---|---|"]
    specs = {fw: {s.dest: s for s in framework_flags(fw)} for fw in FRAMEWORKS}
    for dest in sorted(_specs(), key=lambda d: _specs()[d].name):
        spec, entry = _specs()[dest], entry_for(dest, _specs()[dest].name)
        where = ["yes" if dest in specs[fw] and specs[fw][dest].source != "megatron-lm"
                 else ("Megatron-LM" if dest in specs[fw] else "-") for fw in FRAMEWORKS]  # fmt: skip
        kind = {Honoured: "honoured", NoEffect: "no effect here", Refused: "refused"}[type(entry)]
        text = entry.describe().replace("|", "\\|")
        rows.append(f"| `{spec.name}` | {where[0]} | {where[1]} | {kind} | {text} |")
    for prefix, entry in FAMILIES.items():
        kind = {Honoured: "honoured", NoEffect: "no effect here", Refused: "refused"}[type(entry)]
        rows.append(f"| `{prefix}*` | yes | yes | {kind} | {entry.describe()} |")
    return "\n".join([BEGIN, *rows, END])


def test_readme_flag_table_is_generated_from_the_code() -> None:
    text = README.read_text()
    table = render_table()
    if os.environ.get("TITAN_UPDATE_README"):
        text = re.sub(re.escape(BEGIN) + ".*?" + re.escape(END), lambda _: table, text, flags=re.S)
        README.write_text(text)
    assert table in text, (
        "adapters/README.md's flag table is stale: rerun with TITAN_UPDATE_README=1"
    )
