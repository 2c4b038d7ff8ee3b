"""Partial rollouts (``rollout.partial``) against waiting for every response, at the same
samples per step, on a long-tailed response length.

    python bench/partial_rollout.py [--steps 20] [--mode async|sync] [--tail long|light]
                                    [--prompts P --n N --max-len L --micro-batch M]

Runs ``python -m titan_rl.grpo`` twice on the same policy, data and seed: once as configured
(every step waits for its last response) and once with ``rollout.partial=true
rollout.over_sample_factor=2`` (a step takes the first ``prompts_per_step`` groups to finish;
the others are aborted, carried with their tokens and continued on the next weights). Both
train ``prompts_per_step x n_samples_per_prompt`` samples per step, in length-sorted
microbatches of ``--micro-batch`` rows (default: one group's, N).

The policy is an HF Llama (hidden 64, 2 layers, vocabulary 300) whose response lengths are
known by construction:

* ``--tail long`` (default): a two-regime chain built into the weights (attention and MLP
  outputs zero, so each next token depends on the current one only). A response's first
  token puts it in the short regime (share 85%, ending with chance 1/50 per token) or the
  long one (1/500 per token), where it stays: a mixture of geometric lengths, mean ~110
  under the default budget of 1,024, most responses short and one in seven long, the shape
  of a reasoning model's lengths, where a step that waits for all waits for the longest.
  (Measured on the built-in engine: 512 responses, mean 111, median 45, p90 266, 2.5% at
  the budget.)
* ``--tail light``: a randomly initialised Llama, near-uniform next token, so a response
  ends with chance ~1/150 per token (one of the task's two stop tokens): one geometric
  length (mean ~110) capped at the budget (default 320).

Rewards are all 0 (it never answers right), so the advantages are 0, the weights do not
move and the length distribution stays the same through the run; the trainer still runs
every forward and backward.

It prints, per run, the mean ``time/step`` (the driver's wall time of a whole step: rollout,
train, sync) over the steps after ``WARMUP`` and before the last (which evaluates), of which
the rollout and the trainer's own compute (``time/train_compute``), the response length, and
the share of trained tokens written by another weight version than the policy being trained
(``rollout/off_policy_token_share``; 1.0 under async for both) and by an older one than the
step's newest tokens (``rollout/carried_token_share``: what partial rollouts add), then the
step-time ratio. Goal: >= 1.3x.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from titan_core.training.metrics import read_metrics  # noqa: E402

if TYPE_CHECKING:
    import torch

WARMUP = 2
PARTIAL = ["rollout.partial=true", "rollout.over_sample_factor=2"]


#: --tail long: the tokens of the short and the long regime (bytes the arithmetic task's
#: prompts and answers never use), the share of responses that start short, and the mean
#: length of each regime (1 / its chance to stop per token)
SHORT_TOKENS, LONG_TOKENS = range(100, 180), range(180, 256)
SHORT_SHARE, SHORT_MEAN, LONG_MEAN = 0.85, 50, 500
#: --max-len's default per tail
DEFAULT_MAX_LEN = {"long": 1024, "light": 320}


def build_policy(path: Path, tail: str, vocab: int = 300) -> None:
    """The bench's HF Llama (see the module's docstring for ``tail``)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
        tie_word_embeddings=False,
    )  # fmt: skip
    model = LlamaForCausalLM(cfg)
    if tail == "long":
        with torch.no_grad():
            _two_regime_chain(model, _stop_ids())
    model.save_pretrained(path)


def _stop_ids() -> list[int]:
    """Where the task's responses end: the byte tokenizer's end of text and newline."""
    from titan_core.data.tokenizer import ByteTokenizer
    from titan_rl.data import stop_token_ids

    return stop_token_ids(ByteTokenizer(), ["\n"])


def _two_regime_chain(model: torch.nn.Module, stops: list[int]) -> None:
    """Make ``model`` a bigram chain: every layer's output projections zero, so the last
    hidden state is the current token's normalised embedding, one of three unit directions
    (0: the prompt's tokens, 1: the short regime's, 2: the long regime's), and the output
    rows give each direction its own next-token log-probabilities."""
    import math

    import torch

    for layer in model.model.layers:
        layer.self_attn.o_proj.weight.zero_()
        layer.mlp.down_proj.weight.zero_()
    emb = model.model.embed_tokens.weight
    emb.zero_()
    emb[:, 0] = 1.0
    for direction, tokens in ((1, SHORT_TOKENS), (2, LONG_TOKENS)):
        emb[list(tokens)] = 0.0
        emb[list(tokens), direction] = 1.0
    scale = math.sqrt(emb.shape[1])  # RMSNorm maps a unit direction to sqrt(hidden) times it
    never = -30.0
    logp = torch.full((emb.shape[0], 3), never)
    logp[list(SHORT_TOKENS), 0] = math.log(SHORT_SHARE / len(SHORT_TOKENS))
    logp[list(LONG_TOKENS), 0] = math.log((1 - SHORT_SHARE) / len(LONG_TOKENS))
    for direction, tokens, mean in ((1, SHORT_TOKENS, SHORT_MEAN), (2, LONG_TOKENS, LONG_MEAN)):
        logp[list(tokens), direction] = math.log((1 - 1 / mean) / len(tokens))
        logp[stops, direction] = math.log(1 / mean / len(stops))
    model.lm_head.weight.zero_()
    model.lm_head.weight[:, :3] = logp / scale
    model.model.norm.weight.fill_(1.0)


def model_overrides(path: Path) -> list[str]:
    from titan_core.models.hf.convert import model_config_from_hf

    model = model_config_from_hf(path, seq_length=64, transformer_impl="local")
    return [
        f"model.{k}={v}"
        for k, v in model.model_dump(exclude_none=True).items()
        if not isinstance(v, list | dict)
    ]


def run(tmp: Path, name: str, policy: Path, args: argparse.Namespace, extra: list[str]) -> dict:
    run_dir = tmp / name
    cmd = [
        sys.executable, "-m", "titan_rl.grpo", "--config", "examples/math.yaml",
        "policy.format=hf", f"policy.load={policy}", *model_overrides(policy),
        f"run.dir={run_dir}", f"run.num_steps={args.steps}", "run.eval_interval=1000",
        "run.save_interval=0", "sync.check_every=0", "data.num_eval=4",
        f"rollout.prompts_per_step={args.prompts}", f"rollout.n_samples_per_prompt={args.n}",
        f"rollout.max_response_len={args.max_len}", f"rollout.async={args.mode == 'async'}",
        f"train.micro_batch_size={args.micro_batch or args.n}", "train.ppo_steps=1", *extra,
    ]  # fmt: skip
    start = time.perf_counter()
    subprocess.run(cmd, check=True, cwd=REPO, stdout=subprocess.DEVNULL)
    wall = time.perf_counter() - start
    recs = [r for r in read_metrics(run_dir / "metrics.jsonl") if "time/step" in r]
    timed = recs[WARMUP:-1]

    def mean(key: str) -> float:
        return statistics.mean(r[key] for r in timed)

    return {
        "wall": wall,
        "step": mean("time/step"),
        "rollout": mean("time/rollout"),
        "train": mean("time/train_compute"),
        "length": mean("response/length_mean"),
        "truncated": mean("response/truncated_frac"),
        "off_policy": mean("rollout/off_policy_token_share"),
        "carried": mean("rollout/carried_token_share"),
        "lag": max(r["rollout/token_lag_max"] for r in timed),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--tail", choices=["long", "light"], default="long")
    ap.add_argument(
        "--max-len", type=int, default=0,
        help="rollout.max_response_len (default: 1024 with --tail long, 320 with light)",
    )  # fmt: skip
    ap.add_argument("--prompts", type=int, default=8, help="rollout.prompts_per_step")
    ap.add_argument("--n", type=int, default=4, help="rollout.n_samples_per_prompt")
    ap.add_argument("--mode", choices=["async", "sync"], default="async")
    ap.add_argument(
        "--micro-batch", type=int, default=0,
        help="train.micro_batch_size (default: --n, a group per microbatch, length-sorted)",
    )  # fmt: skip
    ap.add_argument("--keep", type=Path, default=None, help="keep the runs' folders here")
    args = ap.parse_args()
    args.max_len = args.max_len or DEFAULT_MAX_LEN[args.tail]
    if args.steps < WARMUP + 2:
        ap.error(f"--steps must be at least {WARMUP + 2} (warm-up, one timed step, the last)")
    with tempfile.TemporaryDirectory() as d:
        tmp = args.keep or Path(d)
        policy = tmp / "policy"
        build_policy(policy, args.tail)
        results = {
            "wait for all": run(tmp, "full", policy, args, []),
            "partial": run(tmp, "partial", policy, args, PARTIAL),
        }
    print(f"{args.mode} rollout, {args.tail} tail, {args.prompts} prompts x {args.n} samples "
          f"per step, response budget {args.max_len}; "
          f"mean over steps {WARMUP + 1}-{args.steps - 1}")  # fmt: skip
    for name, r in results.items():
        print(
            f"  {name:<13} step {r['step']:.2f} s (rollout {r['rollout']:.2f} s, train "
            f"{r['train']:.2f} s) | response "
            f"length {r['length']:.0f}, truncated {r['truncated']:.0%} | tokens off-policy "
            f"{r['off_policy']:.0%}, carried across an update {r['carried']:.0%}, lag max "
            f"{r['lag']} | whole command {r['wall']:.0f} s"
        )
    ratio = results["wait for all"]["step"] / results["partial"]["step"]
    print(f"partial rollouts: {ratio:.2f}x faster per step (goal >= 1.3x)")


if __name__ == "__main__":
    main()
