"""Engine clients by backend name: ``make_engine_client(url, options, backend="sglang")``.

A backend is a factory ``(url, ClientOptions) -> EngineClient``. ``sglang`` (SGLang's HTTP
API: SGLang, its router, Titan's built-in engine) is built in. Another API plugs in with one
module that defines its client and either registers the factory
(``register_engine_client("mybackend", make)`` when it is imported) or is named by its path,
``backend="my_pkg.my_engine:make"``, which this module imports on first use.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

from titan_rl.rollout.client import SGLangClient
from titan_rl.rollout.engine_api import ClientOptions, EngineClient

ClientFactory = Callable[[str, ClientOptions], EngineClient]

#: the backend every caller gets unless it names another
DEFAULT_BACKEND = "sglang"


def _sglang(url: str, options: ClientOptions) -> SGLangClient:
    return SGLangClient(
        url,
        api_key=options.api_key,
        max_concurrency=options.max_concurrency,
        control_timeout_s=options.control_timeout_s,
        retry=options.retry,
    )


_FACTORIES: dict[str, ClientFactory] = {"sglang": _sglang}


def register_engine_client(name: str, factory: ClientFactory) -> None:
    """Make ``backend=name`` build clients with ``factory``. Registering a name again
    with the same factory changes nothing; with another one it is an error."""
    if ":" in name or not name:
        raise ValueError(f"backend name {name!r} must be non-empty and hold no ':'")
    known = _FACTORIES.get(name)
    if known is not None and known is not factory:
        raise ValueError(f"engine client backend {name!r} is already registered ({known!r})")
    _FACTORIES[name] = factory


def engine_client_factory(backend: str) -> ClientFactory:
    """The factory of ``backend``: a registered name, or ``"module.path:function"``."""
    if backend in _FACTORIES:
        return _FACTORIES[backend]
    if ":" in backend:
        module, _, attr = backend.partition(":")
        try:
            factory = getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError) as e:
            raise ValueError(
                f"engine client backend {backend!r}: cannot load {attr!r} from {module!r} "
                f"({type(e).__name__}: {e}); give 'module.path:function' of an importable module"
            ) from None
        if not callable(factory):
            raise ValueError(f"engine client backend {backend!r} is not a function")
        return factory
    raise ValueError(
        f"unknown engine client backend {backend!r}; known: {sorted(_FACTORIES)}, or give "
        "'module.path:function' of a factory (url, ClientOptions) -> EngineClient"
    )


def make_engine_client(
    url: str, options: ClientOptions | None = None, *, backend: str = DEFAULT_BACKEND
) -> EngineClient:
    """A client of the engine (or router) at ``url`` for ``backend``."""
    client = engine_client_factory(backend)(url, options or ClientOptions())
    if not isinstance(client, EngineClient):
        missing = [m for m in _protocol_members() if not hasattr(client, m)]
        raise TypeError(
            f"engine client backend {backend!r} made a {type(client).__name__} without "
            f"{', '.join(missing)}; an engine client implements titan_rl.rollout.EngineClient"
        )
    return client


def _protocol_members() -> list[str]:
    """The names an EngineClient has (methods and ``base_url``)."""
    names = set(EngineClient.__annotations__)
    names |= {n for n, v in vars(EngineClient).items() if callable(v) and not n.startswith("_")}
    return sorted(names)
