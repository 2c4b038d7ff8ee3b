"""What a rollout hook of slime or miles needs from Titan, per process: one
``SGLangClient`` per (event loop, URL), the engine URL the framework's own generate posts
to, and the tokenizer of the run."""

from __future__ import annotations

import asyncio
import functools
import threading
import weakref
from typing import Any

from titan_rl.rollout.client import SGLangClient

#: per-loop connection cap; the framework's own semaphore (sglang_server_concurrency x engines)
#: bounds the requests in flight, so this only has to stay above it.
MAX_CONCURRENCY = 4096

_clients: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[str, SGLangClient]] = (
    weakref.WeakKeyDictionary()
)
_clients_lock = threading.Lock()


def engine_url(args: Any) -> str:
    """The router (or engine) URL slime's and miles' default generate post to."""
    return f"http://{args.sglang_router_ip}:{args.sglang_router_port}"


def get_client(url: str) -> SGLangClient:
    """The :class:`SGLangClient` of ``url`` for the running event loop (one per loop and URL)."""
    loop = asyncio.get_running_loop()
    with _clients_lock:
        per_loop = _clients.setdefault(loop, {})
        client = per_loop.get(url)
        if client is None:
            client = per_loop[url] = SGLangClient(url, max_concurrency=MAX_CONCURRENCY)
    return client


async def aclose_clients() -> None:
    """Close the running loop's clients (call before the loop ends to release connections)."""
    loop = asyncio.get_running_loop()
    with _clients_lock:
        per_loop = _clients.pop(loop, {})
    for client in per_loop.values():
        await client.aclose()


@functools.lru_cache(maxsize=8)
def _tokenizer(kind: str, path: str | None) -> Any:
    from titan_core.data.tokenizer import build_tokenizer

    return build_tokenizer(kind, path)


@functools.lru_cache(maxsize=8)
def _config_tokenizer(path: str) -> Any:
    from titan_core.config import load_config
    from titan_rl.config import GRPOConfig

    data = load_config(GRPOConfig, path).data
    return _tokenizer(data.tokenizer_type, data.tokenizer_model)


def run_tokenizer(args: Any, why: str = "tokenize prompts") -> Any:
    """The Titan run's tokenizer (``data.tokenizer_*`` of the Titan YAML, when the run has
    one: ``--titan-config`` / ``TITAN_CONFIG``), else the HF tokenizer of ``hf_checkpoint``."""
    from adapters.common.config import config_path

    titan_yaml = config_path(args)
    if titan_yaml is not None:
        return _config_tokenizer(titan_yaml)
    path = getattr(args, "hf_checkpoint", None)
    if not path:
        raise ValueError(f"args.hf_checkpoint is not set, but a tokenizer is needed to {why}")
    return _tokenizer("hf", str(path))
