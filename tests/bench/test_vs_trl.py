"""bench/vs_trl.py without TRL: the model and task it makes are files both sides load (Titan's
CLI accepts the YAML it writes, transformers loads the model and the chat template, both
stop on ``<|im_end|>``), and a difference in work per step refuses a ratio. With trl
installed (the bench extra): TRL's side runs a step on them."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]


def _load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("vs_trl", REPO / "bench/vs_trl.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


vs = _load()


@pytest.fixture(scope="module")
def task(tmp_path_factory):  # noqa: ANN201
    return vs.build_task(tmp_path_factory.mktemp("vs_trl"), num_prompts=64)


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k != "TITAN_CONFIG"}


def test_model_and_task_load_as_hf_files(task) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from titan_core.data.tokenizer import HFTokenizer

    tok = AutoTokenizer.from_pretrained(task.model_dir)
    text = tok.apply_chat_template(
        [{"role": "user", "content": "12+34="}], tokenize=False, add_generation_prompt=True
    )
    assert text == "<|im_start|>user\n12+34=<|im_end|>\n<|im_start|>assistant\n"
    ids = tok(text, add_special_tokens=False).input_ids
    assert len(ids) == task.prompt_len and tok.decode(ids) == text  # one token per character
    # the end of text: the tokenizer's (TRL), Titan's tokenizer's and the model's (engine)
    assert tok.eos_token_id == HFTokenizer(str(task.model_dir)).eod == task.eos_id
    model = AutoModelForCausalLM.from_pretrained(task.model_dir)
    assert model.config.eos_token_id == model.generation_config.eos_token_id == task.eos_id
    assert vs.num_parameters(task.model_dir) == sum(p.numel() for p in model.parameters())
    assert vs.num_parameters(task.model_dir) == 82304
    # the random model ends a response rarely: its EOS probability is well below uniform
    with torch.no_grad():
        probs = model(torch.tensor([ids])).logits[0, -1].softmax(-1)
    assert probs[task.eos_id] < 0.1 / model.config.vocab_size
    rows = [json.loads(line) for line in task.data.read_text().splitlines()]
    assert len(rows) == 64
    assert all(int(r["label"]) == sum(map(int, r["prompt"][:-1].split("+"))) for r in rows)


def test_titan_cli_accepts_the_bench_config(task, tmp_path) -> None:
    config = tmp_path / "titan.yaml"
    cfg = vs.titan_config(task, 32, "async", 12, tmp_path / "run")
    config.write_text(yaml.safe_dump(cfg))
    extra = vs.titan_no_eval_no_save(config)
    proc = subprocess.run(
        [sys.executable, "-m", "titan_rl.grpo", "--config", str(config), "--dry-run", *extra],
        cwd=REPO, env=_env(), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert cfg["model"]["seq_length"] == task.prompt_len + 32
    assert cfg["rollout"]["async"] is True


def _run(tokens: float) -> object:
    return vs.Run(1.0, [0.5] * 4, [tokens] * 4, [64] * 4, 4, 1.0)


def test_a_difference_in_work_refuses_a_ratio() -> None:
    assert "tokens/step Titan 2000 TRL 2020" in vs.same_work([_run(2000)], [_run(2020)], 4, 0.03)
    with pytest.raises(SystemExit, match="not the same work"):
        vs.same_work([_run(2000)], [_run(2100)], 4, 0.03)
    short = _run(2000)
    short.optimizer_steps = 3
    with pytest.raises(SystemExit, match="not the same work"):
        vs.same_work([short], [_run(2000)], 4, 0.03)


@pytest.mark.slow  # trl's imports and two steps: ~30 s
def test_trl_side_runs_on_the_bench_task(task, tmp_path) -> None:
    pytest.importorskip("trl", reason='TRL is the bench extra: pip install -e ".[bench]"')
    out = tmp_path / "trl.json"
    proc = subprocess.run(
        [sys.executable, str(REPO / "bench/vs_trl_trl.py"), "--model", str(task.model_dir),
         "--data", str(task.data), "--max-len", "8", "--steps", "2", "--out", str(out),
         "--work-dir", str(tmp_path / "trl")],
        cwd=REPO, env=_env(), capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    st = json.loads(out.read_text())
    assert st["eos_token_ids"] == [task.eos_id]
    assert st["global_step"] == 2 and st["reward_samples"] == [64, 64]
    lengths = [r["completions/mean_length"] for r in st["logs"] if "completions/mean_length" in r]
    assert len(lengths) == 2 and all(7 <= n <= 8 for n in lengths)
