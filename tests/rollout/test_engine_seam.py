"""The rollout-engine seam: SGLangClient is an EngineClient, method for method, and a client
of an engine that does not speak SGLang's HTTP API plugs in as one module (a factory
registered by name, by an entry point, or named by its path) and is what the factory makes."""

from __future__ import annotations

import asyncio
import inspect
from typing import Any

import pytest

from titan_rl.rollout import (
    ClientOptions,
    EngineClient,
    EngineUnavailableError,
    RetryPolicy,
    SGLangClient,
    SGLangUnavailableError,
    engine_clients,
    make_engine_client,
    register_engine_client,
)
from titan_rl.rollout.engine_clients import engine_client_factory


def _protocol_methods() -> dict[str, Any]:
    return {n: v for n, v in vars(EngineClient).items() if callable(v) and not n.startswith("_")}


class FakeEngineClient(EngineClient):
    """A client of another API in its smallest form: it declares the protocol (whose stubs
    answer None) and records what it was made with."""

    def __init__(self, url: str, options: ClientOptions) -> None:
        self.base_url = url
        self.options = options
        self.closed = False

    async def aclose(self) -> None:
        self.closed = True


def make_fake(url: str, options: ClientOptions) -> FakeEngineClient:
    """The factory a client module exposes (named by path in a test below)."""
    return FakeEngineClient(url, options)


@pytest.fixture
def registry(monkeypatch: pytest.MonkeyPatch) -> dict:
    """The clients' table, restored after the test."""
    table = dict(engine_clients._FACTORIES)
    monkeypatch.setattr(engine_clients, "_FACTORIES", table)
    return table


def _accepts(impl: Any, proto: Any) -> list[str]:
    """What a call written against ``proto`` could pass that ``impl`` does not take as the
    protocol does: each parameter by name, kind and default (``impl`` may default one the
    protocol requires), positional ones in order; ``impl`` may take more optional ones."""
    want = list(inspect.signature(proto).parameters.values())
    got = inspect.signature(impl).parameters
    problems = [
        p.name
        for p in want
        if p.name not in got
        or got[p.name].kind != p.kind
        or (p.default is not p.empty and got[p.name].default != p.default)
    ]
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    order = [p.name for p in want if p.kind in positional]
    if [n for n in got if got[n].kind in positional][: len(order)] != order:
        problems.append("positional order")
    extra_required = [
        n for n, p in got.items() if n not in {q.name for q in want} and p.default is p.empty
        and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
    ]  # fmt: skip
    return problems + [f"requires {n}" for n in extra_required]


def test_sglang_client_takes_every_protocol_call_as_the_protocol_does() -> None:
    """A static check of the protocol: every method async, every parameter Titan passes
    taken by name, kind and default."""
    methods = _protocol_methods()
    assert {"generate", "update_weights_from_disk", "weight_version", "aclose"} <= set(methods)
    for name, proto in methods.items():
        impl = getattr(SGLangClient, name)
        assert impl is not proto, f"SGLangClient.{name} is the protocol's stub"
        assert inspect.iscoroutinefunction(impl), f"SGLangClient.{name} is not async"
        assert _accepts(impl, proto) == [], f"SGLangClient.{name}"


def test_the_signature_check_sees_a_missing_or_required_parameter() -> None:
    async def proto(self, path: str, *, flush_cache: bool = True) -> None: ...
    async def no_flush(self, path: str) -> None: ...
    async def needs_more(self, path: str, version: str, *, flush_cache: bool = True) -> None: ...
    async def other_default(self, path: str, *, flush_cache: bool = False) -> None: ...

    assert _accepts(proto, proto) == []
    assert _accepts(no_flush, proto) == ["flush_cache"]
    assert _accepts(needs_more, proto) == ["requires version"]
    assert _accepts(other_default, proto) == ["flush_cache"]


def test_sglang_client_is_an_engine_client_and_the_default_client() -> None:
    retry = RetryPolicy(timeout_s=0.0, max_retries=0)
    options = ClientOptions(api_key="k", max_concurrency=3, control_timeout_s=7.0, retry=retry)
    client = make_engine_client("http://127.0.0.1:1/", options)
    assert isinstance(client, SGLangClient) and isinstance(client, EngineClient)
    assert client.base_url == "http://127.0.0.1:1"
    assert client.retry is retry
    assert client._http.headers["Authorization"] == "Bearer k"
    assert client._ctl_timeout.read == 7.0
    assert client._sem._value == 3
    assert make_engine_client("http://127.0.0.1:1").retry == RetryPolicy()


def test_an_unreachable_sglang_engine_is_an_unavailable_engine() -> None:
    """The sync tells a lost engine from a failed one by the seam's error, not SGLang's."""
    assert issubclass(SGLangUnavailableError, EngineUnavailableError)


def test_a_registered_client_is_what_the_factory_makes(registry: dict) -> None:
    register_engine_client("fake", make_fake)
    register_engine_client("fake", make_fake)  # again, the same: nothing changes
    options = ClientOptions(api_key="secret")
    client = make_engine_client("fake://engine-0", options, client="fake")
    assert isinstance(client, FakeEngineClient) and isinstance(client, EngineClient)
    assert (client.base_url, client.options) == ("fake://engine-0", options)
    asyncio.run(client.aclose())  # the fake's own method, not the protocol's stub
    assert client.closed
    with pytest.raises(ValueError, match="already registered"):
        register_engine_client("fake", lambda url, options: make_fake(url, options))


def test_a_client_module_named_by_path_needs_no_registration(registry: dict) -> None:
    path = f"{__name__}:make_fake"
    client = make_engine_client("fake://engine-1", client=path)
    assert type(client).__name__ == "FakeEngineClient"
    assert client.base_url == "fake://engine-1" and client.options == ClientOptions()
    assert engine_client_factory(path).__name__ == "make_fake"


def test_unknown_or_broken_clients_are_errors_that_say_what_to_give(registry: dict) -> None:
    with pytest.raises(ValueError, match=r"engines.client 'vllm' is not a registered .*sglang"):
        make_engine_client("http://x", client="vllm")
    with pytest.raises(ValueError, match="has no attribute 'nope'"):
        make_engine_client("http://x", client=f"{__name__}:nope")
    register_engine_client("half", lambda url, options: object())
    with pytest.raises(TypeError, match="without .*generate.*EngineClient"):
        make_engine_client("http://x", client="half")


def test_an_installed_packages_entry_point_is_a_registered_name(
    registry: dict, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A package registers its client for every process (the driver and the trainers) with
    an entry point of the group titan_rl.engine_clients, loaded on first use."""
    from importlib.metadata import EntryPoint

    ep = EntryPoint("installed", f"{__name__}:make_fake", engine_clients.ENTRY_POINT_GROUP)
    monkeypatch.setattr(
        engine_clients,
        "entry_points",
        lambda group: [ep] if group == engine_clients.ENTRY_POINT_GROUP else [],
    )
    assert engine_clients.registered_clients() == ["installed", "sglang"]
    assert engine_clients.client_problem("installed") is None
    client = make_engine_client("fake://engine-2", client="installed")
    assert type(client).__name__ == "FakeEngineClient"
    assert "installed" in registry  # loaded once
