"""How long a short request waits behind another client's long prompt on the built-in engine,
with chunked prefill (``--chunked-prefill-size``) against whole-prompt prefill (``-1``, the
anchor), both measured in one run.

    python bench/chunked_prefill.py                      # 30,000-token prompt, chunks of 2,048
    python bench/chunked_prefill.py --prompt-len 100000  # a longer one
    python bench/chunked_prefill.py --chunk 512 2048 8192  # several chunk sizes

Each mode starts an engine as a user does (``python -m titan_rl.engine --chunked-prefill-size
N``, a random Llama whose context holds the prompt); in each round, on each engine in turn, one
HTTP client sends the long prompt and, once the engine has admitted it (its prefill under
way), a second client sends a 4-token request. It prints the short request's latency and the
long request's total time, per round and as ratios of medians to the whole-prompt engine's.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from titan_rl.actors.config import EngineServerConfig  # noqa: E402
from titan_rl.actors.server import ServerProcess  # noqa: E402
from titan_rl.engine_settings import DEFAULT_CHUNKED_PREFILL_SIZE  # noqa: E402


def build_model(path: Path, vocab: int, hidden: int, layers: int, context: int) -> int:
    """Save a random Llama whose context holds ``context`` tokens; return its parameters."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=hidden * 8 // 3,
        num_hidden_layers=layers,
        num_attention_heads=max(1, hidden // 64),
        num_key_value_heads=max(1, hidden // 128),
        max_position_embeddings=context,
        eos_token_id=1,
        bos_token_id=0,
        pad_token_id=0,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(cfg)
    model.save_pretrained(path)
    return sum(p.numel() for p in model.parameters())


async def _generate(client: httpx.AsyncClient, ids: list[int], new_tokens: int) -> float:
    """Seconds until the whole (non-streamed) response of a greedy request has arrived."""
    t0 = time.perf_counter()
    r = await client.post(
        "/generate",
        json={
            "input_ids": ids,
            "sampling_params": {
                "max_new_tokens": new_tokens,
                "temperature": 0.0,
                "ignore_eos": True,
            },
        },
    )
    r.raise_for_status()
    assert len(r.json()["output_ids"]) == new_tokens
    return time.perf_counter() - t0


async def _admitted(client: httpx.AsyncClient) -> None:
    """Wait until the engine runs the long request (its prefill has begun)."""
    while True:
        info = (await client.get("/get_server_info")).json()
        if info["num_running_reqs"] >= 1 and info["num_queued_reqs"] == 0:
            return
        await asyncio.sleep(0.005)


async def measure(
    url: str, long: list[int], short: list[int], new_tokens: int
) -> tuple[float, float]:
    """(short request's latency, long request's total time), the short sent during the long
    one's prefill from a second client (its own connection)."""
    timeout = httpx.Timeout(3600.0)
    async with (
        httpx.AsyncClient(base_url=url, timeout=timeout) as a,
        httpx.AsyncClient(base_url=url, timeout=timeout) as b,
    ):
        await _generate(a, short, 4)  # warm-up
        long_task = asyncio.create_task(_generate(a, long, new_tokens))
        await _admitted(b)
        short_s = await _generate(b, short, 4)
        long_s = await long_task
    return short_s, long_s


def start_server(path: Path, log_dir: str, chunk: int, threads: int) -> ServerProcess:
    server = ServerProcess(
        EngineServerConfig(
            model_path=str(path),
            backend="builtin",
            num_threads=threads,
            log_dir=log_dir,
            startup_timeout_s=300,
            chunked_prefill_size=chunk,
        ),
        name=f"bench-chunk{chunk}",
    )
    server.start()
    return server


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--prompt-len", type=int, default=30_000)
    ap.add_argument(
        "--chunk",
        type=int,
        nargs="+",
        default=[DEFAULT_CHUNKED_PREFILL_SIZE],
        help="chunk sizes to time (each against the same whole-prompt engine)",
    )
    ap.add_argument(
        "--rounds", type=int, default=2, help="rounds over the engines, taking turns (medians)"
    )
    ap.add_argument("--new-tokens", type=int, default=8, help="the long request's output")
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = ap.parse_args()

    g = torch.Generator().manual_seed(1)
    long = torch.randint(2, args.vocab, (args.prompt_len,), generator=g).tolist()
    short = torch.randint(2, args.vocab, (4,), generator=g).tolist()
    modes = [-1, *args.chunk]
    times: dict[int, list[tuple[float, float]]] = {m: [] for m in modes}
    with tempfile.TemporaryDirectory(prefix="titan-bench-") as tmp:
        path = Path(tmp) / "model"
        context = args.prompt_len + args.new_tokens + 64
        n_params = build_model(path, args.vocab, args.hidden, args.layers, context)
        print(
            f"model: random Llama, {n_params / 1e6:.1f}M params (hidden {args.hidden}, "
            f"{args.layers} layers); long prompt {args.prompt_len} tokens + {args.new_tokens} "
            f"new, short prompt 4 + 4 new; {args.threads} torch threads; one engine per mode, "
            f"{args.rounds} round(s) taking turns",
            flush=True,
        )
        servers: dict[int, ServerProcess] = {}
        try:
            for m in modes:  # idle engines use no CPU: started once, measured in turns
                servers[m] = start_server(path, tmp, m, args.threads)
            for r in range(args.rounds):
                for m in modes:
                    short_s, long_s = asyncio.run(
                        measure(servers[m].url, long, short, args.new_tokens)
                    )
                    times[m].append((short_s, long_s))
                    name = "whole prompt (-1)" if m == -1 else f"chunks of {m}"
                    print(
                        f"round {r + 1}, {name:>17}: short request {short_s:7.2f} s, "
                        f"long request {long_s:7.2f} s",
                        flush=True,
                    )
        finally:
            for server in servers.values():
                server.stop()
    short_w = statistics.median(t[0] for t in times[-1])
    long_w = statistics.median(t[1] for t in times[-1])
    for m in args.chunk:
        short_c = statistics.median(t[0] for t in times[m])
        long_c = statistics.median(t[1] for t in times[m])
        print(
            f"chunks of {m} (medians): short request {short_c:.2f} s vs {short_w:.2f} s whole "
            f"= {short_w / short_c:.1f}x sooner; long request {long_c:.2f} s vs "
            f"{long_w:.2f} s whole = {long_c / long_w:.2f}x"
        )


if __name__ == "__main__":
    main()
