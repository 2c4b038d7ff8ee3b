"""No module of ``titan_core``, ``titan_rl`` or ``adapters`` imports a module that imports it
back, within a package or across them (issue 17).

The import graph is read from the source with :mod:`ast` (nothing is imported), so every
import statement counts: those inside functions and under ``TYPE_CHECKING`` too. Running
this file prints the import cycles of the packages named (all three together by default)::

    .venv/bin/python tests/trace/test_module_graph.py [titan_core titan_rl adapters]
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import networkx as nx

REPO = Path(__file__).resolve().parents[2]
#: the packages whose modules must not import each other back
PACKAGES = ("titan_core", "titan_rl", "adapters")


def _module_names(root: Path) -> dict[str, Path]:
    """Dotted name -> file of every module of the package folder ``root``."""
    out = {}
    for f in sorted(root.rglob("*.py")):
        parts = f.relative_to(root.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = f
    return out


def _known(name: str, modules: dict[str, Path]) -> str | None:
    """``name`` or the longest of its prefixes that is one of ``modules``."""
    parts = name.split(".")
    for n in range(len(parts), 0, -1):
        candidate = ".".join(parts[:n])
        if candidate in modules:
            return candidate
    return None


def _targets(module: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The modules of ``modules`` that ``module``'s import statements name."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out: set[str | None] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(_known(a.name, modules) for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: up ``level - 1`` packages from this one
                up = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*up, base] if base else up)
            for a in node.names:  # ``from pkg import submodule`` imports the submodule
                sub = f"{base}.{a.name}"
                out.add(sub if sub in modules else _known(base, modules))
    out.discard(None)
    out.discard(module)
    return out  # type: ignore[return-value]


def import_graph(*roots: Path) -> nx.DiGraph:
    """The import graph of the package folders ``roots``: an edge a -> b when module a has an
    import statement naming module b (imports of other packages are left out; a package's
    ``__init__`` counts as a module, implicit imports of parent packages do not)."""
    modules = {name: f for root in roots for name, f in _module_names(root).items()}
    graph = nx.DiGraph()
    graph.add_nodes_from(modules)
    for name, path in modules.items():
        graph.add_edges_from((name, t) for t in _targets(name, path, modules))
    return graph


def import_cycles(*roots: Path) -> list[list[str]]:
    """One cycle through each group of modules that import each other (directly or
    through others), sorted; empty when the graph has none."""
    graph = import_graph(*roots)
    cycles = []
    for group in nx.strongly_connected_components(graph):
        if len(group) > 1:
            sub = graph.subgraph(group)
            cycles.append([a for a, _ in nx.find_cycle(sub, source=min(group))])
    return sorted(cycles)


def test_trace_modules_import_no_cycle() -> None:
    cycles = [
        c
        for c in import_cycles(REPO / "titan_core")
        if any(m.startswith("titan_core.trace") for m in c)
    ]
    assert cycles == [], f"import cycles through titan_core.trace: {cycles}"


def test_no_module_imports_one_that_imports_it_back() -> None:
    """Within each package and across them (core never imports what imports core)."""
    cycles = import_cycles(*(REPO / p for p in PACKAGES))
    assert cycles == [], "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_graph_spans_packages(tmp_path: Path) -> None:
    """A cycle through two packages is one cycle of their joint graph, and of neither alone."""
    _write(tmp_path, {"one/__init__.py": "", "one/a.py": "from two.b import f\n"})
    _write(tmp_path, {"two/__init__.py": "", "two/b.py": "def f():\n    import one.a\n"})
    assert import_cycles(tmp_path / "one") == [] and import_cycles(tmp_path / "two") == []
    assert import_cycles(tmp_path / "one", tmp_path / "two") == [["one.a", "two.b"]]


def test_comm_does_not_import_breakdown() -> None:
    """The per-rank breakdown uses the comm ops; both read the device events from a third
    module, so comm needs nothing of the breakdown."""
    graph = import_graph(REPO / "titan_core")
    trace = "titan_core.trace"
    assert not graph.has_edge(f"{trace}.comm", f"{trace}.breakdown")
    assert graph.has_edge(f"{trace}.comm", f"{trace}.device_events")
    assert graph.has_edge(f"{trace}.breakdown", f"{trace}.comm")


def test_engine_and_sync_share_only_the_wire_formats() -> None:
    """The engine (receiver) and the sync and rollout client (senders) both read the wire
    formats from titan_rl.wire, and neither reaches the other, directly or through others;
    the wire package imports neither (issue 18)."""
    graph = import_graph(REPO / "titan_core", REPO / "titan_rl")

    def reaches(src: str, dst: str) -> list[tuple[str, str]]:
        return [
            (a, b)
            for a in graph
            if a == src or a.startswith(src + ".")
            for b in nx.descendants(graph, a)
            if b == dst or b.startswith(dst + ".")
        ]

    for a, b in [
        ("titan_rl.engine", "titan_rl.sync"),
        ("titan_rl.engine", "titan_rl.rollout"),
        ("titan_rl.sync", "titan_rl.engine"),
        ("titan_rl.rollout", "titan_rl.engine"),
        ("titan_rl.wire", "titan_rl.engine"),
        ("titan_rl.wire", "titan_rl.sync"),
    ]:
        assert reaches(a, b) == [], f"{a} reaches {b}: {reaches(a, b)[:3]}"
    assert graph.has_edge("titan_rl.engine.weights", "titan_rl.wire.payload")
    assert graph.has_edge("titan_rl.sync.transports.tensor", "titan_rl.wire.payload")


def _write(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root / "pkg"


def test_finds_cycles_of_every_import_form(tmp_path: Path) -> None:
    """Relative, ``from pkg import module``, in-function and ``TYPE_CHECKING`` imports all
    count; imports of other packages and names that are no modules do not."""
    root = _write(
        tmp_path,
        {
            "pkg/__init__.py": "",
            "pkg/a.py": "from pkg.b import thing\nimport os\n",
            "pkg/b.py": "def f():\n    from . import a\n",
            "pkg/sub/__init__.py": "",
            "pkg/sub/c.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
            "    from ..sub import d\n",
            "pkg/sub/d.py": "import pkg.sub.c as c\nfrom pkg import a\n",
            "pkg/e.py": "from pkg import sub\nfrom pkg.a import x\n",
        },
    )
    graph = import_graph(root)
    assert set(graph.edges) == {
        ("pkg.a", "pkg.b"),
        ("pkg.b", "pkg.a"),
        ("pkg.sub.c", "pkg.sub.d"),
        ("pkg.sub.d", "pkg.sub.c"),
        ("pkg.sub.d", "pkg.a"),
        ("pkg.e", "pkg.sub"),
        ("pkg.e", "pkg.a"),
    }
    assert import_cycles(root) == [["pkg.a", "pkg.b"], ["pkg.sub.c", "pkg.sub.d"]]


def test_finds_a_cycle_through_several_modules(tmp_path: Path) -> None:
    root = _write(
        tmp_path,
        {
            "pkg/__init__.py": "",
            "pkg/a.py": "from pkg import b\n",
            "pkg/b.py": "from pkg import c\n",
            "pkg/c.py": "from pkg.a import f\n",
            "pkg/d.py": "from pkg import a\n",
        },
    )
    assert import_cycles(root) == [["pkg.a", "pkg.b", "pkg.c"]]


if __name__ == "__main__":
    packages = sys.argv[1:] or list(PACKAGES)
    found = import_cycles(*(REPO / p for p in packages))
    print(f"{' + '.join(packages)}: {len(found)} import cycle(s)")
    for cycle in found:
        print("  " + " -> ".join([*cycle, cycle[0]]))
