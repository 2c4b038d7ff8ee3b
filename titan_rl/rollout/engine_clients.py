"""Engine clients by name, the table ``engines.client`` chooses from:
``make_engine_client(url, options, client="sglang")``.

A client is made by a factory ``(url, ClientOptions) -> EngineClient``. ``sglang`` (SGLang's
HTTP API: SGLang, its router, Titan's built-in engine) is built in. Another API plugs in with
one module that defines its client and its factory, named in one of three ways:

- registered by name in the process that imports it: ``register_engine_client("mine", make)``;
- registered by name for every process, by the package that holds it: an entry point of the
  group ``titan_rl.engine_clients`` (``mine = "my_pkg.my_engine:make"`` in its pyproject's
  ``[project.entry-points."titan_rl.engine_clients"]``), loaded on first use;
- by its path, ``"my_pkg.my_engine:make"`` (or ``"path/to/file.py:make"``), imported on first
  use in each process.

The GRPO job makes clients in the driver (the rollout, the recovery, colocated engines'
memory) and in the trainer processes (the weight sync): a name registered by a call reaches
only the process that made it; an entry point or a path reaches them all.
"""

from __future__ import annotations

from collections.abc import Callable
from importlib.metadata import entry_points

from titan_rl.rollout.client import SGLangClient
from titan_rl.rollout.engine_api import ClientOptions, EngineClient
from titan_rl.user_code import load_attr, split_spec

ClientFactory = Callable[[str, ClientOptions], EngineClient]

#: the client every caller gets unless it names another (``engines.client``'s default)
DEFAULT_CLIENT = "sglang"
#: the entry-point group installed packages register their clients' factories in
ENTRY_POINT_GROUP = "titan_rl.engine_clients"
#: the config key that names the client (for messages)
KEY = "engines.client"
EXAMPLE = "my_pkg.my_engine:make"


def _sglang(url: str, options: ClientOptions) -> SGLangClient:
    return SGLangClient(
        url,
        api_key=options.api_key,
        max_concurrency=options.max_concurrency,
        control_timeout_s=options.control_timeout_s,
        retry=options.retry,
    )


_FACTORIES: dict[str, ClientFactory] = {DEFAULT_CLIENT: _sglang}


def register_engine_client(name: str, factory: ClientFactory) -> None:
    """Make ``client=name`` (``engines.client: name``) build clients with ``factory``.
    Registering a name again with the same factory changes nothing; with another one it is
    an error."""
    if ":" in name or not name:
        raise ValueError(f"engine client name {name!r} must be non-empty and hold no ':'")
    known = _FACTORIES.get(name)
    if known is not None and known is not factory:
        raise ValueError(f"engine client {name!r} is already registered ({known!r})")
    _FACTORIES[name] = factory


def _entry_points() -> dict[str, str]:
    """Installed packages' clients: name -> ``"module:function"``."""
    return {ep.name: ep.value for ep in entry_points(group=ENTRY_POINT_GROUP)}


def registered_clients() -> list[str]:
    """Every client name known here: registered in this process or by an entry point."""
    return sorted({*_FACTORIES, *_entry_points()})


def client_problem(client: str) -> str | None:
    """Why ``client`` names no engine client, importing nothing: a registered name (this
    process or an entry point) or the form ``"module.path:function"``; else a message naming
    ``engines.client`` and the registered names."""
    if client in _FACTORIES:
        return None
    if ":" in client:
        try:
            split_spec(client, KEY, EXAMPLE)
        except ValueError as e:
            return str(e)
        return None
    if client in _entry_points():
        return None
    return (
        f"{KEY} {client!r} is not a registered engine client; registered: "
        f"{', '.join(registered_clients())}; register it (titan_rl.rollout."
        "register_engine_client, or an entry point of the group "
        f"{ENTRY_POINT_GROUP}) or give 'module.path:function' of a factory "
        "(url, ClientOptions) -> EngineClient"
    )


def engine_client_factory(client: str) -> ClientFactory:
    """The factory of ``client``: a registered name, an entry point's, or the one
    ``"module.path:function"`` names (imported now); ValueError naming engines.client."""
    if client in _FACTORIES:
        return _FACTORIES[client]
    problem = client_problem(client)
    if problem:
        raise ValueError(problem)
    spec = client if ":" in client else _entry_points()[client]
    _, factory = load_attr(spec, KEY, EXAMPLE)
    if not callable(factory):
        raise ValueError(f"{KEY} {client!r}: {spec} is not a function")
    if ":" not in client:  # an entry point's: loaded once
        _FACTORIES[client] = factory
    return factory


def make_engine_client(
    url: str, options: ClientOptions | None = None, *, client: str = DEFAULT_CLIENT
) -> EngineClient:
    """A client of the engine (or router) at ``url``, made by ``client``'s factory."""
    made = engine_client_factory(client)(url, options or ClientOptions())
    if not isinstance(made, EngineClient):
        missing = [m for m in _protocol_members() if not hasattr(made, m)]
        raise TypeError(
            f"engine client {client!r} made a {type(made).__name__} without "
            f"{', '.join(missing)}; an engine client implements titan_rl.rollout.EngineClient"
        )
    return made


def _protocol_members() -> list[str]:
    """The names an EngineClient has (methods and ``base_url``)."""
    names = set(EngineClient.__annotations__)
    names |= {n for n, v in vars(EngineClient).items() if callable(v) and not n.startswith("_")}
    return sorted(names)
