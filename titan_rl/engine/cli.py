"""Command line of the built-in engine; flag names follow ``sglang.launch_server``."""

from __future__ import annotations

import argparse
import logging
import os
import sys

DEFAULT_MAX_REQUEST_BYTES = 64 << 20


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m titan_rl.engine",
        description="Titan's built-in CPU rollout engine: serves SGLang's native HTTP API.",
    )
    p.add_argument(
        "--model-path", required=True, help="local HF model directory (never downloaded)"
    )
    p.add_argument(
        "--host", default="127.0.0.1", help="bind address (default 127.0.0.1: local only)"
    )
    p.add_argument("--port", type=int, default=30000)
    p.add_argument(
        "--api-key", default=None, help="require 'Authorization: Bearer KEY' (as SGLang)"
    )
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--context-length", type=int, default=None)
    p.add_argument("--max-running-requests", type=int, default=256)
    p.add_argument("--max-prefill-tokens", type=int, default=8192)
    p.add_argument("--weight-version", default="default")
    p.add_argument("--random-seed", type=int, default=0)
    p.add_argument("--num-threads", type=int, default=None, help="torch intra-op threads")
    p.add_argument("--skip-tokenizer-init", action="store_true")
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--max-request-bytes", type=int, default=DEFAULT_MAX_REQUEST_BYTES)
    p.add_argument("--log-level", default="warning")
    p.add_argument("--tp-size", "--tp", type=int, default=1, dest="tp_size")
    p.add_argument("--dp-size", "--dp", type=int, default=1, dest="dp_size")
    p.add_argument("--device", default="cpu")
    return p


def validate(args: argparse.Namespace) -> None:
    """Reject what the CPU engine cannot do, with the fix in the message."""
    if args.tp_size != 1:
        raise SystemExit(
            f"--tp-size {args.tp_size}: the built-in CPU engine runs one process (tp_size 1). "
            "Use SGLang on GPUs for tensor parallelism, or start several engines behind the router."
        )
    if args.dp_size != 1:
        raise SystemExit("--dp-size: start several engines behind sglang-router instead")
    if args.device != "cpu":
        raise SystemExit(
            f"--device {args.device}: the built-in engine is CPU-only; use sglang.launch_server"
        )
    if not 0 < args.port < 65536:
        raise SystemExit(f"--port {args.port} is not a TCP port")
    if not os.path.isdir(args.model_path):
        raise SystemExit(
            f"--model-path {args.model_path!r} is not a local directory (the engine never downloads)"
        )
    if args.host not in ("127.0.0.1", "localhost", "::1") and not args.api_key:
        print(
            f"warning: binding {args.host} without --api-key exposes the engine (including weight "
            "updates) to the network",
            file=sys.stderr,
        )


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    validate(args)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s"
    )
    import uvicorn

    from titan_rl.engine.core import Engine
    from titan_rl.engine.server import create_app

    try:
        engine = Engine(
            args.model_path,
            dtype=args.dtype,
            context_length=args.context_length,
            max_running_requests=args.max_running_requests,
            max_prefill_tokens=args.max_prefill_tokens,
            num_threads=args.num_threads,
            weight_version=args.weight_version,
            random_seed=args.random_seed,
            load_tokenizer=not args.skip_tokenizer_init,
        )
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    app = create_app(
        engine,
        api_key=args.api_key,
        max_request_bytes=args.max_request_bytes,
        served_model_name=args.served_model_name,
    )
    uvicorn.run(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        access_log=False,
        timeout_graceful_shutdown=5,
    )
    engine.shutdown()


if __name__ == "__main__":
    main()
