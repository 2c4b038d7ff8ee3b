"""Command line of the built-in engine; flag names follow ``sglang.launch_server``.

The engine's own settings (``--dtype``, ``--num-threads``, ``--tp-size``, ...) are made from
their one declaration, :class:`~titan_rl.engine_settings.EngineSettings`; the flags here are
the HTTP server's and SGLang's accepted ones.
"""

from __future__ import annotations

import argparse
import logging
import os
import resource
import sys

from titan_core import startup_gc
from titan_core.openmp import wait_said
from titan_rl.engine_settings import add_arguments, engine_problem, from_arguments

DEFAULT_MAX_REQUEST_BYTES = 64 << 20
#: file descriptors kept for the model, logs and the weight-sync transports beyond connections
_SPARE_FDS = 256


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
    p.add_argument(
        "--enable-return-routed-experts",
        action="store_true",
        help="accepted for SGLang's command line: the engine always serves return_routed_experts "
        "on MoE models",
    )
    p.add_argument(
        "--max-connections",
        type=int,
        default=1024,
        help="open HTTP connections; above it a new one is answered 503 and closed",
    )
    p.add_argument(
        "--request-read-timeout",
        type=float,
        default=30.0,
        help="seconds a connection has to send a whole request (headers and body) once it "
        "starts one; slower ones are answered 408 and closed",
    )
    p.add_argument(
        "--timeout-keep-alive",
        type=int,
        default=5,
        help="seconds an idle keep-alive connection is kept between requests (uvicorn's)",
    )
    p.add_argument("--skip-tokenizer-init", action="store_true")
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--max-request-bytes", type=int, default=DEFAULT_MAX_REQUEST_BYTES)
    p.add_argument("--log-level", default="warning")
    add_arguments(p)  # the engine's settings
    p.add_argument("--dp-size", "--dp", type=int, default=1, dest="dp_size")
    p.add_argument("--device", default="cpu")
    return p


def validate(args: argparse.Namespace) -> None:
    """Reject what the CPU engine cannot do, with the fix in the message."""
    try:
        from_arguments(args)
    except ValueError as e:
        raise SystemExit(str(e)) from None
    if (problem := engine_problem("builtin", args.tp_size, None)) is not None:
        raise SystemExit(f"--tp-size {args.tp_size}: {problem[1]}")
    if args.dp_size != 1:
        raise SystemExit("--dp-size: start several engines behind sglang-router instead")
    if args.device != "cpu":
        raise SystemExit(
            f"--device {args.device}: the built-in engine is CPU-only; use sglang.launch_server"
        )
    if not 0 < args.port < 65536:
        raise SystemExit(f"--port {args.port} is not a TCP port")
    for flag in ("max_connections", "timeout_keep_alive"):
        if getattr(args, flag) < 1:
            raise SystemExit(f"--{flag.replace('_', '-')} must be at least 1")
    if not args.request_read_timeout > 0:
        raise SystemExit("--request-read-timeout must be a positive number of seconds")
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


def fit_connections_to_fd_limit(max_connections: int) -> int:
    """Raise the soft open-file limit so ``max_connections`` fit (as SGLang's ``set_ulimit``);
    where the hard limit is lower, lower the cap with a warning instead."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = max_connections + _SPARE_FDS
    if soft != resource.RLIM_INFINITY and soft < need:
        target = need if hard == resource.RLIM_INFINITY else min(need, hard)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
    if soft != resource.RLIM_INFINITY and soft < need:
        fitted = max(1, soft - _SPARE_FDS)
        print(
            f"warning: the open-file limit is {soft}; serving at most {fitted} connections "
            f"instead of --max-connections {max_connections} (raise it with ulimit -n)",
            file=sys.stderr,
        )
        return fitted
    return max_connections


def bind_weight_groups() -> None:
    """With ``TITAN_NODE_IP`` (the GRPO job's engines on a Ray cluster: the node's address),
    the gloo groups this engine joins (``/init_weights_update_group``) listen there, as the
    trainer's node reaches it, not where the host name resolves (titan_core.parallel.nodes).
    The TP ranks' own group keeps 127.0.0.1 (it names its device)."""
    from titan_core.net import node_address

    try:
        address = node_address()
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    if address:
        from titan_core.parallel.nodes import bind_gloo  # only then: its import is work too

        bind_gloo(address)


def main(argv: list[str] | None = None) -> None:
    with startup_gc.paused():  # settled once the model is loaded (_serve)
        _serve(build_parser().parse_args(argv))


def _serve(args: argparse.Namespace) -> None:
    validate(args)
    max_connections = fit_connections_to_fd_limit(args.max_connections)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s"
    )
    import uvicorn

    from titan_rl.engine.connections import guarded_protocol
    from titan_rl.engine.core import Engine
    from titan_rl.engine.server import create_app

    startup_gc.imported()  # torch's, FastAPI's: the settle below collects the model load's
    bind_weight_groups()
    try:
        engine = Engine(
            args.model_path, from_arguments(args), load_tokenizer=not args.skip_tokenizer_init
        )
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    import torch

    print(  # what a run's engine log says it runs with (tests/rl read it back)
        f"titan_rl.engine: {torch.get_num_threads()} torch threads per TP rank {wait_said()}",
        file=sys.stderr,
        flush=True,
    )
    app = create_app(
        engine,
        api_key=args.api_key,
        max_request_bytes=args.max_request_bytes,
        served_model_name=args.served_model_name,
    )
    startup_gc.settle()
    uvicorn.run(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        access_log=False,
        timeout_graceful_shutdown=5,
        timeout_keep_alive=args.timeout_keep_alive,
        http=guarded_protocol(args.request_read_timeout, max_connections),
        ws="none",  # no WebSocket routes: an upgrade request is served as plain HTTP
    )
    engine.shutdown()


if __name__ == "__main__":
    main()
