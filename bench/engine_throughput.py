"""Output tokens/s of the built-in CPU engine for N concurrent requests, against sequential HF
``generate`` on the same model, prompts and lengths, measured in one run.

    python bench/engine_throughput.py            # 64 concurrent requests, 128 new tokens each

The engine runs as a real server (``python -m titan_rl.engine``) and is driven over HTTP by the
project's client; both sides use the same number of torch threads and greedy decoding.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from titan_rl.actors.config import EngineServerConfig  # noqa: E402
from titan_rl.actors.server import ServerProcess  # noqa: E402
from titan_rl.rollout import SGLangClient  # noqa: E402


def build_model(path: Path, vocab: int, hidden: int, layers: int) -> int:
    """Save a random Llama to ``path``; return its parameter count."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=hidden * 8 // 3,
        num_hidden_layers=layers,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=1024,
        eos_token_id=1,
        bos_token_id=0,
        pad_token_id=0,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(cfg)
    model.save_pretrained(path)
    return sum(p.numel() for p in model.parameters())


def make_prompts(n: int, vocab: int, min_len: int, max_len: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    lens = torch.randint(min_len, max_len + 1, (n,), generator=g).tolist()
    return [torch.randint(2, vocab, (n_tok,), generator=g).tolist() for n_tok in lens]


def hf_sequential(
    path: Path, prompts: list[list[int]], new_tokens: int, threads: int
) -> tuple[int, float]:
    """Generate for each prompt in turn with HF ``generate`` (greedy, KV cache); (tokens, seconds)."""
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(threads)
    model = AutoModelForCausalLM.from_pretrained(str(path)).eval()
    kw = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        model.generate(
            torch.tensor([prompts[0]]), **{**kw, "max_new_tokens": 4, "min_new_tokens": 4}
        )
        total, t0 = 0, time.perf_counter()
        for p in prompts:
            out = model.generate(torch.tensor([p]), **kw)
            total += out.shape[1] - len(p)
        return total, time.perf_counter() - t0


async def engine_concurrent(
    url: str, prompts: list[list[int]], new_tokens: int
) -> tuple[int, float]:
    params = {"max_new_tokens": new_tokens, "temperature": 0.0, "ignore_eos": True}
    async with SGLangClient(url, max_concurrency=len(prompts)) as client:
        await client.generate(prompts[0], {**params, "max_new_tokens": 4})  # warm-up
        t0 = time.perf_counter()
        outs = await asyncio.gather(*[client.generate(p, params) for p in prompts])
        elapsed = time.perf_counter() - t0
    return sum(len(o.output_ids) for o in outs), elapsed


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--prompt-len", type=int, nargs=2, default=[16, 48], metavar=("MIN", "MAX"))
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = ap.parse_args()

    with tempfile.TemporaryDirectory(prefix="titan-bench-") as tmp:
        path = Path(tmp) / "model"
        n_params = build_model(path, args.vocab, args.hidden, args.layers)
        prompts = make_prompts(args.requests, args.vocab, *args.prompt_len)
        print(
            f"model: random Llama, {n_params / 1e6:.1f}M params; {args.requests} requests x "
            f"{args.new_tokens} new tokens, prompts {args.prompt_len[0]}-{args.prompt_len[1]} tokens; "
            f"{args.threads} torch threads"
        )

        server = ServerProcess(
            EngineServerConfig(
                model_path=str(path),
                backend="builtin",
                num_threads=args.threads,
                log_dir=tmp,
                startup_timeout_s=300,
                extra_args=["--max-running-requests", str(max(args.requests, 1))],
            ),
            name="bench-engine",
        )
        try:
            server.start()
            eng_tokens, eng_s = asyncio.run(engine_concurrent(server.url, prompts, args.new_tokens))
        finally:
            server.stop()
        hf_tokens, hf_s = hf_sequential(path, prompts, args.new_tokens, args.threads)

    eng_tps, hf_tps = eng_tokens / eng_s, hf_tokens / hf_s
    print(
        f"built-in engine, {args.requests} concurrent over HTTP: {eng_tokens} tokens in {eng_s:.2f}s "
        f"= {eng_tps:.0f} tok/s"
    )
    print(
        f"HF generate, sequential:                 {hf_tokens} tokens in {hf_s:.2f}s = {hf_tps:.0f} tok/s"
    )
    print(f"ratio: {eng_tps / hf_tps:.2f}x (goal >= 5x)")


if __name__ == "__main__":
    main()
