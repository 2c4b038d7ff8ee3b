"""Titan's GRPO against Hugging Face TRL's ``GRPOTrainer`` on one CPU machine, each run as a
user with one machine would run it: the same tiny HF model, task and work per step.

    .venv/bin/pip install -e ".[bench]"        # trl (not in the test extra)
    python bench/vs_trl.py [--m 32 128] [--modes sync async] [--pairs 3] [--steps 12]

The bench makes the model and the task itself, in a temporary folder, as HF files both
sides load: a randomly initialised Qwen3ForCausalLM (2 layers, hidden 64, ~82k parameters)
with a character-level tokenizer whose chat template is Qwen's (``<|im_start|>`` /
``<|im_end|>``; ``<|im_end|>`` is the end of text both sides stop on), and a jsonl of
two-digit additions ``a+b=`` with the sum as label. The EOS token's output row is pushed
down so that the random model ends a response rarely (a response then runs close to the
budget M on both sides: the same work), though it still does end some.

Titan: the real CLI, ``python -m titan_rl.grpo --config <yaml the bench writes>`` with
``policy.format: hf``, ``data.type: jsonl``, ``data.apply_chat_template: true`` and the
built-in exact-match reward; Titan's defaults otherwise (the built-in engine on CPU), no
eval and no checkpoint when the config accepts ``run.eval_interval=null`` /
``run.save_interval=null`` (else the largest intervals). Async mode adds
``rollout.async=true``. TRL: bench/vs_trl_trl.py, ``GRPOTrainer`` + ``GRPOConfig`` with one
optimizer step per generation of 8 prompts x 8 samples, ``max_completion_length=M``,
``beta=0``, ``num_iterations=1``, ``use_cpu``, fp32 (``bf16=False``), gradient checkpointing
off, logging every step, no saving, and a reward with Titan's exact-match rule. TRL has no
async mode on CPU: async compares Titan-async with TRL's ordinary step.

Runs alternate (Titan, TRL, Titan, TRL ...), ``--pairs`` times per (M, mode). Per-step
times: Titan's ``time/step`` from its metrics.jsonl; TRL's from a callback stamping
``on_step_end``. Medians over steps 3..N of each run, then the median over the runs. Also
printed: generated tokens/s (a step's generated tokens / its time) and the whole command's
wall time, launch to exit. The same work is checked, not assumed: tokens generated per step
(Titan: ``response/length_mean`` x samples; TRL: ``completions/mean_length`` x the samples
its reward scored), samples per step and optimizer steps; a difference in tokens per step
beyond ``--tolerance`` exits non-zero without a ratio. Ratios are Titan / TRL (below 1:
Titan takes less time; for tokens/s above 1: Titan is faster). Goals (issue 34): sync step
<= TRL's at M=32 and <= 0.7x at M=128; async <= 0.5x at both; whole command <= 1.5x.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from titan_core.training.metrics import read_metrics  # noqa: E402

#: steps before the measured ones (the first two: warm-up, as the issue measured)
WARMUP = 2
PROMPTS, SAMPLES = 8, 8
#: the character vocabulary after the three special tokens (64 ids in all, each decodable)
SPECIALS = ["<pad>", "<|im_start|>", "<|im_end|>"]
CHARS = "0123456789+=-*/ \nabcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ.,:;?!()"[:61]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
LR = 1e-5


@dataclass
class Task:
    """The files both sides load."""

    model_dir: Path
    data: Path
    #: the longest prompt after the chat template, in tokens
    prompt_len: int
    eos_id: int


def build_tokenizer(out: Path) -> object:
    """A character-level HF fast tokenizer (one token per character, special tokens whole)
    with a Qwen-style chat template, saved in ``out``."""
    from tokenizers import AddedToken, Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate([*SPECIALS, *CHARS])}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))  # no merges: characters
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens([AddedToken(t, special=True) for t in SPECIALS])
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<pad>",
        chat_template=CHAT_TEMPLATE,
    )  # fmt: skip
    hf.save_pretrained(str(out))
    return hf


def build_task(root: Path, num_prompts: int = 2000, seed: int = 0) -> Task:
    """The tiny Qwen3 (weights, config, generation config, tokenizer) in ``root/model`` and
    the arithmetic prompts in ``root/train.jsonl``."""
    import torch
    import transformers as tf

    model_dir = root / "model"
    tok = build_tokenizer(model_dir)
    eos, pad = tok.convert_tokens_to_ids(["<|im_end|>", "<pad>"])
    cfg = tf.Qwen3Config(
        vocab_size=len(SPECIALS) + len(CHARS), hidden_size=64, intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        max_position_embeddings=256, tie_word_embeddings=False,
        eos_token_id=eos, pad_token_id=pad, bos_token_id=None,
    )  # fmt: skip
    torch.manual_seed(seed)
    model = tf.Qwen3ForCausalLM(cfg)
    with torch.no_grad():
        # One embedding dimension is the same for every token, so the final norm's output
        # has a steady component there; a negative weight on it in the EOS row of the
        # output layer makes EOS rare (logit about -3 below the others'): responses run
        # close to the budget on both sides, and some still end on EOS.
        model.model.embed_tokens.weight[:, 0] = 1.0
        model.lm_head.weight[eos, 0] = -0.4
    model.generation_config = tf.GenerationConfig(
        eos_token_id=eos, pad_token_id=pad, bos_token_id=None
    )
    model.save_pretrained(str(model_dir))

    rng = random.Random(seed)
    rows = []
    for _ in range(num_prompts):
        a, b = rng.randint(10, 99), rng.randint(10, 99)  # every prompt the same length
        rows.append({"prompt": f"{a}+{b}=", "label": str(a + b)})
    data = root / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    chat = [
        tok.apply_chat_template([{"role": "user", "content": r["prompt"]}], tokenize=False,
                                add_generation_prompt=True)
        for r in rows
    ]  # fmt: skip
    prompt_len = max(len(tok(c, add_special_tokens=False).input_ids) for c in chat)
    return Task(model_dir, data, prompt_len, eos)


def num_parameters(model_dir: Path) -> int:
    from safetensors import safe_open

    with safe_open(str(model_dir / "model.safetensors"), "pt") as f:
        return sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())  # noqa: SIM118


# ---- Titan -------------------------------------------------------------------------------


def titan_config(task: Task, max_len: int, mode: str, steps: int, run_dir: Path) -> dict:
    """The YAML a user writes for this run: the model section read off config.json."""
    from titan_core.models.hf.convert import model_config_from_hf

    model = model_config_from_hf(task.model_dir, seq_length=task.prompt_len + max_len)
    batch = PROMPTS * SAMPLES
    return {
        "policy": {"format": "hf", "load": str(task.model_dir)},
        "model": model.model_dump(exclude_unset=True, mode="json"),
        "train": {
            "micro_batch_size": batch,
            "lr": LR,
            "min_lr": LR,
            "lr_warmup_iters": 0,
            "lr_decay_style": "constant",
            "weight_decay": 0.0,
            "clip_grad": 1.0,
            "ppo_steps": 1,
        },
        "rollout": {
            "prompts_per_step": PROMPTS,
            "n_samples_per_prompt": SAMPLES,
            "max_response_len": max_len,
            "temperature": 1.0,
            "async": mode == "async",
        },
        "algo": {"advantage_estimator": "grpo", "eps_clip": 0.2, "use_kl_loss": False},
        "reward": {"type": "exact_match"},
        "data": {
            "type": "jsonl",
            "path": str(task.data),
            "apply_chat_template": True,
            "tokenizer_type": "hf",
            "tokenizer_model": str(task.model_dir),
            "num_eval": 8,
        },
        "run": {"dir": str(run_dir), "num_steps": steps},
    }


def _env(threads: int | None = None) -> dict[str, str]:
    """The user's environment (less TITAN_CONFIG), output unbuffered so that each line is
    timed when it is printed; ``threads``: OMP_NUM_THREADS for TRL (``--trl-threads``)."""
    env = {k: v for k, v in os.environ.items() if k != "TITAN_CONFIG"}
    env["PYTHONPATH"] = str(REPO)
    env["PYTHONUNBUFFERED"] = "1"
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    return env


def titan_no_eval_no_save(config: Path) -> list[str]:
    """``run.eval_interval=null run.save_interval=null`` when this Titan accepts them, else
    the largest intervals (an eval before the first step and at the last, a final save)."""
    want = ["run.eval_interval=null", "run.save_interval=null"]
    cmd = [sys.executable, "-m", "titan_rl.grpo", "--config", str(config), "--dry-run", *want]
    proc = subprocess.run(cmd, cwd=REPO, env=_env(), capture_output=True, text=True)
    if proc.returncode == 0:
        return want
    print("note: this Titan has no run.eval_interval=null / run.save_interval=null; using "
          "the largest intervals (eval before step 1 and at the last, a save at the last)")  # fmt: skip
    return ["run.eval_interval=1000000", "run.save_interval=0"]


@dataclass
class Run:
    """One command's measures."""

    wall: float
    step_times: list[float]
    tokens: list[float]  # generated per step
    samples: list[int]
    optimizer_steps: int
    #: seconds from launch to the first step's start
    to_first_step: float
    extra: dict = field(default_factory=dict)

    def step(self) -> float:
        return statistics.median(self.step_times[WARMUP:])

    def tok_s(self) -> float:
        return statistics.median(
            t / s for t, s in zip(self.tokens[WARMUP:], self.step_times[WARMUP:], strict=True)
        )

    def tokens_per_step(self) -> float:
        return statistics.mean(self.tokens[WARMUP:])


def _run_logged(
    cmd: list[str], log: Path, threads: int | None = None
) -> tuple[float, list[tuple[float, str]]]:
    """Run ``cmd``; its output lines with their times since launch go to ``log``."""
    lines: list[tuple[float, str]] = []
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        cmd, cwd=REPO, env=_env(threads), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True,
    )  # fmt: skip
    with log.open("w") as f:
        for line in proc.stdout:  # type: ignore[union-attr]
            t = time.perf_counter() - t0
            lines.append((t, line.rstrip("\n")))
            f.write(f"{t:8.2f} {line}")
    code = proc.wait()
    wall = time.perf_counter() - t0
    if code != 0:
        tail = "\n".join(text for _, text in lines[-40:])
        raise RunFailed(f"command failed ({code}): {' '.join(cmd)}\n{tail}\n(log: {log})")
    return wall, lines


class RunFailed(Exception):
    """A side's command exited non-zero (the message holds its output's tail)."""

    @property
    def ray_start_timeout(self) -> bool:
        """Ray's node did not come up in Ray's fixed 30 s (a machine overloaded by others)."""
        return "timed out during startup" in str(self)


def with_retries(fn, retries: int, what: str, failures: list[str]):  # noqa: ANN001, ANN201
    """``fn()``, run again up to ``retries`` times when Ray's start-up timed out (each such
    failure noted in ``failures`` and printed); any other failure ends the bench."""
    for attempt in range(retries + 1):
        try:
            return fn()
        except RunFailed as e:
            if not e.ray_start_timeout or attempt == retries:
                raise SystemExit(str(e)) from None
            failures.append(what)
            print(f"  {what}: Ray's start-up timed out (its fixed 30 s); running it again")


def run_titan(task: Task, max_len: int, mode: str, steps: int, work: Path, extra: list[str],
              tag: str) -> Run:  # fmt: skip
    run_dir = work / f"titan_{tag}"
    config = work / f"titan_{max_len}_{mode}.yaml"
    config.write_text(yaml.safe_dump(titan_config(task, max_len, mode, steps, run_dir)))
    cmd = [sys.executable, "-m", "titan_rl.grpo", "--config", str(config), *extra]
    wall, lines = _run_logged(cmd, work / f"titan_{tag}.log")
    recs = [r for r in read_metrics(run_dir / "metrics.jsonl") if "time/step" in r]
    if len(recs) != steps:
        raise SystemExit(f"Titan logged {len(recs)} steps, not {steps} (see {run_dir})")
    times = [float(r["time/step"]) for r in recs]
    samples = [int(r["rollout/groups_generated"]) * SAMPLES for r in recs]
    tokens = [float(r["response/length_mean"]) * n for r, n in zip(recs, samples, strict=True)]
    # the first step ends when its record is written: its line is printed then
    first_end = _first_step_line(lines)
    phases = {k: statistics.median(float(r[k]) for r in recs[WARMUP:])
              for k in recs[-1] if k.startswith("time/")}  # fmt: skip
    # the start-up's phases, where this Titan writes them (the first record's time/startup/*)
    startup = {k: float(v) for k, v in recs[0].items() if k.startswith("time/startup")}
    return Run(
        wall,
        times,
        tokens,
        samples,
        # one optimizer step per step: the config's train.ppo_steps=1, each on the rollout's
        # whole batch (each record carries its step's train/grad_norm)
        sum("train/grad_norm" in r for r in recs),
        (first_end - times[0]) if first_end is not None else float("nan"),
        {"phases": phases, "startup": startup, "lines": lines},
    )


def _first_step_line(lines: list[tuple[float, str]]) -> float | None:
    """When the first step's status line (``step    1/12 | ...``) was printed."""
    return next((t for t, line in lines if re.match(r"\s*step\s+1/\d+ ", line)), None)


# ---- TRL ---------------------------------------------------------------------------------


def run_trl(task: Task, max_len: int, steps: int, work: Path, tag: str,
            threads: int | None = None) -> Run:  # fmt: skip
    out = work / f"trl_{tag}.json"
    cmd = [
        sys.executable, str(REPO / "bench/vs_trl_trl.py"), "--model", str(task.model_dir),
        "--data", str(task.data), "--max-len", str(max_len), "--steps", str(steps),
        "--prompts", str(PROMPTS), "--samples", str(SAMPLES), "--lr", str(LR),
        "--out", str(out), "--work-dir", str(work / f"trl_{tag}"),
    ]  # fmt: skip
    if threads is not None:
        cmd += ["--threads", str(threads)]
    wall, lines = _run_logged(cmd, work / f"trl_{tag}.log", threads)
    st = json.loads(out.read_text())
    if st["eos_token_ids"] != [task.eos_id]:
        raise SystemExit(f"TRL stops on {st['eos_token_ids']}, not [{task.eos_id}] (<|im_end|>)")
    stamps = [t for _, t in st["steps"]]
    times = [b - a for a, b in zip([st["train_begin"], *stamps[:-1]], stamps, strict=True)]
    logs = {r["step"]: r for r in st["logs"] if "completions/mean_length" in r}
    samples = st["reward_samples"]
    if len(samples) != steps or len(logs) != steps:
        raise SystemExit(
            f"TRL generated {len(samples)} batches and logged {len(logs)} steps for {steps}"
        )
    tokens = [logs[i + 1]["completions/mean_length"] * samples[i] for i in range(steps)]
    # launch -> its first step's start: the imports, the model, the trainer
    to_first = next(t for t, line in lines if line.startswith("vs_trl: train begins"))
    return Run(wall, times, tokens, samples, int(st["global_step"]), to_first,
               {"lines": lines})  # fmt: skip


# ---- the comparison ----------------------------------------------------------------------


def same_work(titan: list[Run], trl: list[Run], steps: int, tolerance: float) -> str:
    """The work both sides did per step, checked; a difference is a SystemExit."""
    tt = statistics.mean(r.tokens_per_step() for r in titan)
    tr = statistics.mean(r.tokens_per_step() for r in trl)
    samples = {n for r in titan + trl for n in r.samples}
    opt = {r.optimizer_steps for r in titan + trl}
    line = (f"tokens/step Titan {tt:.0f} TRL {tr:.0f} ({tt / tr - 1:+.1%}); samples/step "
            f"{sorted(samples)}; optimizer steps {sorted(opt)} for {steps} steps")  # fmt: skip
    if abs(tt - tr) > tolerance * max(tt, tr):
        raise SystemExit(
            f"not the same work, no ratio reported: {line} (tolerance {tolerance:.0%})"
        )
    if samples != {PROMPTS * SAMPLES} or opt != {steps}:
        raise SystemExit(f"not the same work, no ratio reported: {line}")
    return line


def _med(xs: list[float]) -> float:
    return statistics.median(xs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--m", type=int, nargs="+", default=[32, 128], help="response budgets")
    ap.add_argument("--modes", nargs="+", default=["sync", "async"], choices=["sync", "async"])
    ap.add_argument("--pairs", type=int, default=3, help="alternating Titan/TRL runs")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--tolerance", type=float, default=0.03,
                    help="largest relative difference in tokens per step")  # fmt: skip
    ap.add_argument("--titan-set", nargs="*", default=[],
                    help="extra key=value overrides for Titan (to try variants)")  # fmt: skip
    ap.add_argument("--trl-threads", type=int, default=None,
                    help="torch threads for TRL (default: torch's, one per core, as a user "
                    "gets; on a machine busy with other work its spinning threads can lose "
                    "far more time than one thread would)")  # fmt: skip
    ap.add_argument("--retries", type=int, default=2,
                    help="runs again a Titan command whose Ray start-up timed out")  # fmt: skip
    ap.add_argument("--keep", default=None, help="keep the model, configs and logs here")
    args = ap.parse_args()
    if args.steps <= WARMUP:
        raise SystemExit(f"--steps must exceed the {WARMUP} warm-up steps")
    try:
        import trl  # noqa: F401
    except ImportError:
        raise SystemExit('TRL is not installed: .venv/bin/pip install -e ".[bench]"') from None

    tmp = None if args.keep else tempfile.TemporaryDirectory()
    work = Path(args.keep or tmp.name)  # type: ignore[union-attr]
    work.mkdir(parents=True, exist_ok=True)
    load = os.getloadavg()[0]
    if load > 0.5:
        print(f"note: load average {load:.1f} on {os.cpu_count()} cores before the bench: "
              "other work shares the machine, so the numbers are noisy")  # fmt: skip
    task = build_task(work)
    print(f"model: tiny Qwen3, {num_parameters(task.model_dir)} parameters, prompt "
          f"{task.prompt_len} tokens; {PROMPTS} prompts x {SAMPLES} samples per step, "
          f"{args.steps} steps (medians of steps {WARMUP + 1}-{args.steps}), "
          f"{args.pairs} pair(s) per row; work in {work}")  # fmt: skip
    probe = work / "probe.yaml"
    probe.write_text(yaml.safe_dump(titan_config(task, args.m[0], "sync", 1, work / "probe")))
    extra = [*titan_no_eval_no_save(probe), *args.titan_set]

    rows = []
    failures: list[str] = []
    for max_len in args.m:
        for mode in args.modes:  # TRL runs its ordinary step in both (no async on CPU)
            titan_runs: list[Run] = []
            trl_runs: list[Run] = []
            for p in range(args.pairs):
                tag = f"{max_len}_{mode}_{p}"
                titan_runs.append(with_retries(
                    lambda tag=tag, mode=mode, max_len=max_len: run_titan(
                        task, max_len, mode, args.steps, work, extra, tag),
                    args.retries, f"Titan M={max_len} {mode} pair {p + 1}", failures,
                ))  # fmt: skip
                trl_runs.append(with_retries(
                    lambda tag=tag, max_len=max_len: run_trl(
                        task, max_len, args.steps, work, tag, args.trl_threads),
                    0, f"TRL M={max_len} pair {p + 1}", failures,
                ))  # fmt: skip
                t, r = titan_runs[-1], trl_runs[-1]
                print(f"  M={max_len} {mode} pair {p + 1}: Titan {t.step():.3f} s/step "
                      f"(command {t.wall:.1f} s, first step after {t.to_first_step:.1f} s); "
                      f"TRL {r.step():.3f} s/step (command {r.wall:.1f} s, first step after "
                      f"{r.to_first_step:.1f} s)", flush=True)  # fmt: skip
            print(f"  same work: {same_work(titan_runs, trl_runs, args.steps, args.tolerance)}")
            phases = {k: _med([r.extra["phases"][k] for r in titan_runs])
                      for k in titan_runs[0].extra["phases"]}  # fmt: skip
            print("  Titan's step (median s): " + ", ".join(
                f"{k[5:]} {v:.3f}" for k, v in phases.items()))  # fmt: skip
            startup = titan_runs[0].extra["startup"]
            if startup:
                print("  Titan's start-up (first run, s): " + ", ".join(
                    f"{k[13:] or 'total'} {v:.1f}" for k, v in startup.items()))  # fmt: skip
            rows.append((max_len, mode, titan_runs, trl_runs))

    print()
    print("ratios are Titan / TRL; medians over runs of each run's median over the measured steps")
    head = (f"{'M':>4} {'mode':>5} | {'Titan s/step':>12} {'TRL s/step':>10} {'ratio':>6} | "
            f"{'Titan tok/s':>11} {'TRL tok/s':>9} {'ratio':>6} | {'Titan cmd s':>11} "
            f"{'TRL cmd s':>9} {'ratio':>6} | {'Titan 1st':>9} {'TRL 1st':>7}")  # fmt: skip
    print(head)
    print("-" * len(head))
    for max_len, mode, tr, hf in rows:
        a, b = _med([r.step() for r in tr]), _med([r.step() for r in hf])
        c, d = _med([r.tok_s() for r in tr]), _med([r.tok_s() for r in hf])
        e, f = _med([r.wall for r in tr]), _med([r.wall for r in hf])
        g, h = _med([r.to_first_step for r in tr]), _med([r.to_first_step for r in hf])
        print(f"{max_len:>4} {mode:>5} | {a:>12.3f} {b:>10.3f} {a / b:>6.2f} | {c:>11.0f} "
              f"{d:>9.0f} {c / d:>6.2f} | {e:>11.1f} {f:>9.1f} {e / f:>6.2f} | {g:>9.1f} "
              f"{h:>7.1f}")  # fmt: skip
    if failures:
        print(f"Titan commands whose Ray start-up timed out and were run again: "
              f"{len(failures)} ({'; '.join(failures)})")  # fmt: skip
    print("goals: sync step ratio <= 1.0 at M=32, <= 0.7 at M=128; async <= 0.5; command <= 1.5")
    if tmp is not None:
        tmp.cleanup()


if __name__ == "__main__":
    main()
