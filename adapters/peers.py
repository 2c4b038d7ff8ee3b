"""Importing slime's and miles' own modules, with an error that says what to install."""

from __future__ import annotations

import importlib
import importlib.util
from pathlib import Path
from types import ModuleType

#: how each framework's code gets here (neither is on PyPI under its name)
_INSTALL = {
    "slime": "pip install --no-deps ../shared/peers/slime-*.whl (`make test` does), or "
    "pip install --no-deps -e <slime checkout>",
    "miles": "pip install --no-deps ../shared/peers/miles-*.whl (`make test` does), or "
    "pip install --no-deps -e <miles checkout>",
}


class PeerImportError(ImportError):
    """A framework package the adapter needs is missing or cannot be imported."""


def _installed(package: str) -> bool:
    try:
        return importlib.util.find_spec(package) is not None
    except (ValueError, ImportError):  # e.g. sys.modules[package] is None: blocked
        return False


def import_peer(module: str) -> ModuleType:
    """``importlib.import_module(module)`` for a module of slime or miles, turning a missing
    package or a missing dependency of it into a :class:`PeerImportError` that names it."""
    package = module.split(".")[0]
    how = _INSTALL.get(package, f"pip install {package}")
    if not _installed(package):
        raise PeerImportError(
            f"the {package} package is not installed, so adapters.{package} cannot run: {how}"
        )
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as e:
        missing = e.name or "?"
        if missing == package:
            raise PeerImportError(
                f"the {package} package is not installed, so adapters.{package} cannot run: {how}"
            ) from e
        root = missing.split(".")[0]
        if root == package:
            raise PeerImportError(
                f"{package} is installed but has no module {missing!r} (needed: {module}); "
                f"this adapter was written against {package}'s code in ../shared/peers: {how}"
            ) from e
        raise PeerImportError(
            f"{module} ({package}) needs the package {root!r}, which is not installed: "
            f"pip install {root} (or `pip install -e .[peers]`)"
        ) from e
    except Exception as e:  # the package is there but its import raised
        raise PeerImportError(
            f"importing {module} ({package}) failed: {type(e).__name__}: {e}; reinstall it: {how}"
        ) from e


def peer_source(module: str) -> Path:
    """The installed source file of a slime / miles module, found without importing it or
    its parent packages (their ``__init__`` may need sglang, or select slime's
    accelerator); a :class:`PeerImportError` naming the install command when it is missing."""
    package, *rest = module.split(".")
    how = _INSTALL.get(package, f"pip install {package}")
    spec = importlib.util.find_spec(package) if _installed(package) else None
    roots = list(spec.submodule_search_locations or []) if spec is not None else []
    for root in roots:
        base = Path(root).joinpath(*rest)
        for candidate in (base.with_suffix(".py"), base / "__init__.py"):
            if candidate.is_file():
                return candidate
    raise PeerImportError(
        f"{module} ({package}) is not installed, so its flags cannot be read: {how}"
    )
