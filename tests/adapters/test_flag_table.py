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
    # warmup below the run's length (slime's train_iters; Megatron asserts it)
    "lr_warmup_iters": ["--num-rollout", "4"],
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
    yaml.write_text(
        "train:\n  lr: 0.5\n  min_lr: 0.0\n  micro_batch_size: 8\nrun:\n  seed: 11\n"
        "algo:\n  eps_clip: 0.1\n"
    )
    args = parse("slime", [*BASE, "--titan-config", str(yaml), "--seed", "5"])
    cfg = titan_config_from_args(args)
    # slime's defaults (--lr 1e-6, --eps-clip 0.2) are not given: the YAML holds; --seed is
    assert (cfg.train.lr, cfg.algo.eps_clip, cfg.run.seed) == (0.5, 0.1, 5)
    # under slime's own parser the namespace has no record of what was typed: a value that
    # differs from slime's default counts as given
    ns = argparse.Namespace(**vars(args))
    del ns.titan_given
    ns.lr = 0.25
    assert {"lr"} <= given_dests(ns, "slime") and "eps_clip" not in given_dests(ns, "slime")
    assert titan_config_from_args(ns).train.lr == 0.25


def test_num_rollout_is_the_lr_schedules_horizon(tmp_path: Path) -> None:
    """slime's and miles' ``train_iters``: --num-rollout rollouts (one optimizer step each
    here: ``train.ppo_steps`` 1), whatever the YAML's ``run.num_steps``."""
    yaml = tmp_path / "titan.yaml"
    yaml.write_text("train:\n  micro_batch_size: 8\n  lr_warmup_iters: 0\nrun:\n  num_steps: 3\n")
    args = parse("slime", [*BASE, "--titan-config", str(yaml), "--num-rollout", "7"])
    cfg = titan_config_from_args(args)
    assert (cfg.run.num_steps, cfg.pretrain_view(1).train.train_iters) == (7, 7)


def test_mooncake_needs_its_agents_named_in_the_adapters() -> None:
    """The GRPO job starts Mooncake agents beside its engines where ``sync.mooncake.agents`` is
    empty; the adapters start none (the framework may own the engines): miles' p2p transfer
    mode without them is refused naming the key, and works with them."""
    from adapters.miles.arguments import parse_args

    p2p = [*BASE, "--update-weight-transfer-mode", "p2p"]
    with pytest.raises(ConfigError, match=r"sync\.mooncake\.agents in the slime / miles adapters"):
        titan_config_from_args(parse_args(p2p))
    agents = ["--titan-override", "sync.mooncake.agents=[http://127.0.0.1:30100]"]
    cfg = titan_config_from_args(parse_args([*p2p, *agents]))
    assert cfg.sync.transport == "mooncake"
    assert cfg.sync.mooncake.agents == ["http://127.0.0.1:30100"]


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
    """One row per flag; a flag one framework classes apart (``FRAMEWORK_ROWS``) gets a row
    per framework."""
    kinds = {Honoured: "honoured", NoEffect: "no effect here", Refused: "refused"}
    rows = ["| flag | slime | miles | class | what it does here |", "|---|---|---|---|---|"]
    specs = {fw: {s.dest: s for s in framework_flags(fw)} for fw in FRAMEWORKS}
    for dest in sorted(_specs(), key=lambda d: _specs()[d].name):
        spec = _specs()[dest]
        where = ["yes" if dest in specs[fw] and specs[fw][dest].source != "megatron-lm"
                 else ("Megatron-LM" if dest in specs[fw] else "-") for fw in FRAMEWORKS]  # fmt: skip
        entries = {fw: entry_for(dest, spec.name, fw) for fw in FRAMEWORKS if dest in specs[fw]}
        groups = [(fws, e) for e in {id(e): e for e in entries.values()}.values()
                  for fws in [[fw for fw, x in entries.items() if x is e]]]  # fmt: skip
        for fws, entry in groups:
            cols = where if len(groups) == 1 else [w if fw in fws else "-"
                                                  for fw, w in zip(FRAMEWORKS, where, strict=True)]  # fmt: skip
            text = entry.describe().replace("|", "\\|")
            rows.append(
                f"| `{spec.name}` | {cols[0]} | {cols[1]} | {kinds[type(entry)]} | {text} |"
            )
    for prefix, entry in FAMILIES.items():
        rows.append(f"| `{prefix}*` | yes | yes | {kinds[type(entry)]} | {entry.describe()} |")
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


# ---- each honoured flag without a key: the test that shows it acting ---------------------------
def _sp(argv: list[str], evaluation: bool = False) -> dict[str, Any]:
    from adapters.common.rollout import sampling_params

    return sampling_params(parse("slime", [*BASE, "--rollout-max-response-len", "8", *argv]),
                           evaluation)  # fmt: skip


def _cfg(argv: list[str], fw: str = "slime") -> Any:
    return titan_config_from_args(parse(fw, [*BASE, *argv]))


#: flag -> a check on what the parse, the config or the sampling parameters do with it
ACTS: dict[str, Any] = {
    "rollout_temperature": lambda: _sp(["--rollout-temperature", "0.3"])["temperature"] == 0.3,
    "rollout_top_p": lambda: _sp(["--rollout-top-p", "0.5"])["top_p"] == 0.5,
    "rollout_top_k": lambda: _sp(["--rollout-top-k", "5"])["top_k"] == 5,
    "rollout_max_response_len": lambda: _sp([])["max_new_tokens"] == 8,
    "rollout_stop": lambda: _sp(["--rollout-stop", "##"])["stop"] == ["##"],
    "rollout_stop_token_ids": lambda: _sp(["--rollout-stop-token-ids", "7"])["stop_token_ids"] == [7],
    "rollout_skip_special_tokens": lambda: _sp(["--rollout-skip-special-tokens"])["skip_special_tokens"],
    "eval_temperature": lambda: _sp(["--eval-temperature", "0"], True)["temperature"] == 0,
    "eval_top_p": lambda: _sp(["--eval-top-p", "0.7"], True)["top_p"] == 0.7,
    "eval_top_k": lambda: _sp(["--eval-top-k", "3"], True)["top_k"] == 3,
    "eval_max_response_len": lambda: _sp(["--eval-max-response-len", "4"], True)["max_new_tokens"] == 4,
    "eval_min_new_tokens": lambda: _sp(["--eval-min-new-tokens", "2"], True)["min_new_tokens"] == 2,
    "global_batch_size": lambda: parse("slime", [*BASE, "--global-batch-size", "4"]).global_batch_size == 4,
    "num_steps_per_rollout": lambda: _finish(["--num-steps-per-rollout", "2"]).global_batch_size == 4,
    "offload": lambda: _finish(["--offload"]).offload_train is True,
    "colocate": lambda: _finish(["--colocate"]).offload_rollout is True,
    "offload_train": lambda: _finish(["--offload-train"]).offload_train is True,
    "offload_rollout": lambda: _finish(["--offload-rollout"]).offload_rollout is True,
    "rollout_num_gpus": lambda: _finish(["--rollout-num-gpus", "3"]).rollout_num_gpus == 3,
    "actor_num_gpus_per_node": lambda: _finish(["--actor-num-gpus-per-node", "3"]).rollout_num_gpus == 3,
    "actor_num_nodes": lambda: _finish(["--actor-num-nodes", "2", "--actor-num-gpus-per-node", "1"]).rollout_num_gpus == 2,
    "prompt_data": lambda: _prompt_cfg().data.path.endswith("p.jsonl"),
    "input_key": lambda: _prompt_cfg().data.prompt_key == "question",
    "label_key": lambda: _prompt_cfg().data.label_key == "answer",
    "apply_chat_template": lambda: _prompt_cfg().data.apply_chat_template is True,
    "group_query_attention": lambda: _cfg(["--group-query-attention", "--num-query-groups", "2"]).model.num_query_groups == 2,
    "num_query_groups": lambda: _cfg(["--num-query-groups", "2"]).model.num_query_groups != 2,
    "custom_config_path": lambda: getattr(_custom_config(), "my_hook_setting", None) == 5,
    "optimizer": lambda: parse("slime", [*BASE, "--optimizer", "adam"]).optimizer == "adam",
    "rotary_percent": lambda: parse("slime", [*BASE, "--rotary-percent", "1.0"]).rotary_percent == 1.0,
    "train_backend": lambda: parse("miles", [*BASE, "--train-backend", "megatron"]).train_backend == "megatron",
    "megatron_to_hf_mode": lambda: parse("miles", [*BASE, "--megatron-to-hf-mode", "raw"]).megatron_to_hf_mode == "raw",
    "ckpt_format": lambda: parse("slime", [*BASE, "--ckpt-format", "torch_dist"]).ckpt_format == "torch_dist",
    "kl_coef": lambda: parse("slime", [*BASE, "--kl-coef", "0"]).kl_coef == 0,
    "loss_type": lambda: parse("slime", [*BASE, "--loss-type", "policy_loss"]).loss_type == "policy_loss",
    # read by slime's own code from the args this parser builds
    "start_rollout_id": lambda: _slime_reads("ray/placement_group.py", "args.start_rollout_id is None")
    and parse("slime", [*BASE, "--start-rollout-id", "5"]).start_rollout_id == 5,
    "rm_url": lambda: _slime_reads("rollout/rm_hub/__init__.py", "args.rm_url")
    and parse("slime", [*BASE, "--rm-url", "http://h:1"]).rm_url == "http://h:1",
}  # fmt: skip


def _slime_reads(path: str, text: str) -> bool:
    import slime

    return text in (Path(slime.__file__).parent / path).read_text()


#: flag -> the test (file::function) that runs it through the user's command
ELSEWHERE: dict[str, str] = {
    **dict.fromkeys(
        ["hf_checkpoint", "ref_load", "load", "save", "save_interval", "rm_type", "num_rollout",
         "eval_interval", "eval_prompt_data", "n_samples_per_eval_prompt", "rollout_shuffle",
         "balance_data", "rollout_global_dataset", "rollout_seed", "data_source_path",
         "rollout_function_path", "eval_function_path", "num_gpus_per_node"],
        "test_slime_scripts.py::test_run_qwen3_4b_script_trains_and_resumes"),
    **dict.fromkeys(["custom_rm_path", "group_rm", "custom_generate_function_path"],
                    "test_slime_hooks.py::test_exact_match_single_and_batched"),
    **dict.fromkeys(["custom_reward_post_process_path", "custom_convert_samples_to_train_data_path",
                     "rewards_normalization", "grpo_std_normalization", "reward_key",
                     "balance_by_flops", "use_rollout_routing_replay"],
                    "test_slime_train_data.py::test_train_data_is_slimes"),
    **dict.fromkeys(["save_hf", "save_retain_interval"],
                    "test_checkpoint_interop.py::test_layout_and_retain_interval"),
    **dict.fromkeys(["update_weight_transport", "update_weight_disk_dir",
                     "update_weight_disk_keep_files", "update_weight_mode", "train_env_vars"],
                    "test_slime_actor.py::test_train_and_sync_under_slime_group"),
    **dict.fromkeys(["rollout_external", "rollout_external_engine_addrs",
                     "update_weight_transfer_mode"],
                    "test_miles.py::test_train_sync_and_export_under_miles_group"),
    **dict.fromkeys(["sglang_pp_size", "sglang_pipeline_parallel_size"],
                    "test_flag_table.py::test_refused_value_of_an_honoured_flag"),
    **dict.fromkeys(["rollout_max_context_len", "eval_max_context_len", "sglang_server_concurrency",
                     "eval_reward_key"],
                    "test_flag_table.py::test_context_cap_concurrency_and_eval_reward_key"),
    **dict.fromkeys(["eval_input_key", "eval_label_key", "eval_max_prompt_len",
                     "apply_chat_template_kwargs", "metadata_key", "tool_key", "eval_tool_key",
                     "rollout_max_prompt_len"],
                    "test_flag_table.py::test_eval_sets_read_by_slimes_dataset"),
    "num_epoch": "test_slime_scripts.py::test_run_qwen3_4b_script_trains_and_resumes",
    "save_debug_rollout_data": "test_slime_scripts.py::test_run_qwen3_4b_script_trains_and_resumes",
    "skip_eval_before_train": "test_slime_scripts.py::test_run_qwen3_30b_a3b_script_runs_moe",
    "ft_components": "test_miles_scripts.py::test_fault_tolerance_components",
    "train_memory_margin_bytes":
        "test_miles_scripts.py::test_train_memory_margin_bytes_sets_the_savers_margin",
}  # fmt: skip
#: the tracking flags: adapters/common/tracking.py hands them to slime's / miles' own code
_TRACKING = {
    d: "test_tracking.py::test_slime_tensorboard_and_wandb_offline"
    for d in FLAG_TABLE
    if d.startswith(("wandb_", "use_wandb", "use_tensorboard", "tb_", "use_mlflow", "mlflow_",
                     "use_prometheus", "prometheus_"))
}  # fmt: skip


def _finish(argv: list[str]) -> argparse.Namespace:
    from adapters.slime.arguments import parse_args

    return parse_args([*BASE, *argv])


def _prompt_cfg() -> Any:
    return _cfg(["--prompt-data", "/tmp/p.jsonl", "--input-key", "question", "--label-key",
                 "answer", "--apply-chat-template"], fw="miles")  # fmt: skip


def _custom_config() -> argparse.Namespace:
    import tempfile

    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
        f.write("my_hook_setting: 5\n")
    return _finish(["--custom-config-path", f.name])


ACTS_ONLY = sorted(d for d, e in FLAG_TABLE.items() if isinstance(e, Honoured) and not e.key)


@pytest.mark.parametrize("dest", ACTS_ONLY)
def test_honoured_flag_acts(dest: str) -> None:
    """Each honoured flag without a key is checked here or names the test that runs it."""
    if dest in ACTS:
        assert ACTS[dest](), f"--{dest.replace('_', '-')} did not act"
        return
    where = ELSEWHERE.get(dest) or _TRACKING.get(dest)
    assert where, f"--{dest.replace('_', '-')} is honoured but no test shows it acting"
    file, func = where.split("::")
    assert f"def {func}(" in (REPO / "tests" / "adapters" / file).read_text()


def test_context_cap_concurrency_and_eval_reward_key() -> None:
    import asyncio

    from slime.utils.types import Sample

    from adapters.common.rollout import _capped, generate_and_score, summary

    args = parse("slime", [*BASE, "--rollout-max-context-len", "12",
                           "--sglang-server-concurrency", "1", "--eval-reward-key", "score"])  # fmt: skip
    sample = Sample(tokens=list(range(10)))
    assert _capped(args, sample, {"max_new_tokens": 8}, 12)["max_new_tokens"] == 2
    assert _capped(args, sample, {"max_new_tokens": 8}, None)["max_new_tokens"] == 8
    in_flight, most, seen = 0, 0, []

    async def generate(args: Any, s: Any, params: dict[str, Any]) -> Any:
        nonlocal in_flight, most
        in_flight += 1
        most = max(most, in_flight)
        await asyncio.sleep(0.01)
        in_flight -= 1
        seen.append(params["max_new_tokens"])
        s.response_length = 1
        return s

    async def rm(args: Any, s: Any) -> dict[str, float]:
        return {"score": 0.25, "acc": 1.0}

    groups = [[Sample(tokens=list(range(10))) for _ in range(3)]]
    asyncio.run(generate_and_score(args, groups, {"max_new_tokens": 8}, generate, rm, 12, True))
    assert most == 1 and seen == [2, 2, 2]  # --sglang-server-concurrency 1; the context cap
    assert summary(args, groups[0], True, None)["eval/reward"] == 0.25  # --eval-reward-key


@pytest.mark.parametrize("value", [float("nan"), float("inf"), 1e39, None, "1", {"score": 1.0}])
def test_reward_that_is_not_a_score_stops_naming_the_flag(value: Any) -> None:
    """What slime's / miles' rm hub returns is checked as titan_rl checks a reward: a bool or
    a number finite in float32 (1e39 is inf there); anything else stops the rollout naming
    the flag that chose the reward, the value and the sample."""
    import asyncio

    from slime.utils.types import Sample

    from adapters.common.rollout import generate_and_score
    from titan_rl.rewards.errors import InvalidRewardError

    args = parse("slime", [*BASE, "--custom-rm-path", "my_rewards.score"])

    async def generate(args: Any, s: Any, params: dict[str, Any]) -> Any:
        s.response = "42"
        return s

    async def rm(args: Any, s: Any) -> Any:
        return value

    groups = [[Sample(prompt="6*7=", label="42", tokens=[1, 2])]]
    with pytest.raises(InvalidRewardError) as e:
        asyncio.run(generate_and_score(args, groups, {"max_new_tokens": 8}, generate, rm))
    msg = str(e.value)
    assert msg.startswith(f"--custom-rm-path my_rewards.score returned {value!r}"), msg
    assert "prompt '6*7='" in msg and "reward.on_invalid" not in msg


def test_eval_sets_read_by_slimes_dataset(tmp_path: Path) -> None:
    import json

    from slime.rollout.data_source import RolloutDataSource

    from adapters.slime.rollout import eval_datasets
    from tests.adapters.slime_scripts import tiny_qwen3

    hf, _ = tiny_qwen3(tmp_path / "hf")
    rows = [{"q": [{"role": "user", "content": "1+1?"}], "a": "2", "m": {"k": 1}},
            {"q": [{"role": "user", "content": "x" * 200}], "a": "9", "m": {"k": 2}}]  # fmt: skip
    path = tmp_path / "e.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    args = parse("slime", [*BASE, "--hf-checkpoint", str(hf), "--eval-prompt-data", "s1", str(path),
                           "--eval-input-key", "q", "--eval-label-key", "a", "--apply-chat-template",
                           "--eval-max-prompt-len", "64", "--metadata-key", "m",
                           "--apply-chat-template-kwargs", '{"enable_thinking": false}'])  # fmt: skip
    [(name, samples)] = eval_datasets(args)
    assert name == "s1" and [s.label for s in samples] == ["2"]  # the long prompt is dropped
    assert samples[0].prompt.startswith("<|im_start|>user\n1+1?") and samples[0].metadata == {
        "k": 1
    }
    # the training source is slime's own, over the same flags
    train = parse("slime", [*BASE, "--hf-checkpoint", str(hf), "--prompt-data", str(path),
                            "--input-key", "q", "--label-key", "a", "--apply-chat-template",
                            "--rollout-max-prompt-len", "64", "--metadata-key", "m",
                            "--tool-key", "tools"])  # fmt: skip
    source = RolloutDataSource(train)
    got = source.get_samples(1)[0][0]
    assert got.label == "2" and got.metadata == {"k": 1} and len(source.dataset) == 1


def test_eval_data_per_named_set() -> None:
    from slime.utils.types import Sample

    from adapters.common.rollout import eval_data

    args = parse("slime", [*BASE, "--eval-reward-key", "acc"])
    groups = [
        [Sample(reward={"acc": 1.0}), Sample(reward={"acc": 0.0})],
        [Sample(reward={"acc": 1.0})],
    ]
    metrics: dict[str, float] = {}
    data = eval_data(args, groups, ["a", "b"], metrics)
    assert metrics == {"eval/a": 0.5, "eval/b": 1.0} and len(data["a"]["samples"]) == 2
    assert list(eval_data(args, groups, None, {})) == ["eval"]
