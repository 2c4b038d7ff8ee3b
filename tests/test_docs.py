"""The README is a front door and the manual lives in docs/: every relative link in the
repository's Markdown resolves (a file that exists, a heading that exists), and the README's
layout map names real paths and every package of titan_core and titan_rl."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
#: the Markdown a user reads: the front door, the manual, the benchmarks, the packages' own
DOCS = sorted(
    [REPO / "README.md", REPO / "CONTRIBUTING.md", REPO / "bench" / "README.md"]
    + list((REPO / "docs").rglob("*.md"))
    + [REPO / "adapters" / "README.md", REPO / "titan_core" / "trace" / "README.md"]
)
_LINK = re.compile(r"\]\(([^)\s]+)\)")
_FENCE = re.compile(r"^```.*?^```", re.S | re.M)


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = heading.strip().lower().replace("`", "")
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    text = _FENCE.sub("", path.read_text())
    return {_slug(m) for m in re.findall(r"^#+ (.+)$", text, re.M)}


def _links(path: Path) -> list[str]:
    return [
        link
        for link in _LINK.findall(_FENCE.sub("", path.read_text()))
        if not re.match(r"[a-z]+:", link)  # http:, https:, mailto:
    ]


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(REPO)))
def test_relative_links_resolve(doc: Path):
    assert doc.is_file(), f"{doc.relative_to(REPO)} is missing"
    broken = []
    for link in _links(doc):
        target, _, anchor = link.partition("#")
        path = (doc.parent / target).resolve() if target else doc
        if not path.exists():
            broken.append(f"{link} (no file {path.relative_to(REPO)})")
        elif anchor and path.suffix == ".md" and anchor not in _anchors(path):
            broken.append(f"{link} (no heading #{anchor} in {path.relative_to(REPO)})")
    assert not broken, f"{doc.relative_to(REPO)} links to what does not exist: {broken}"


def _layout() -> list[str]:
    """Paths of the README's layout map: a top-level entry, or one indented under it."""
    section = re.search(
        r"^## Layout\n.*?^```\n(.*?)^```", (REPO / "README.md").read_text(), re.S | re.M
    )
    assert section, "README.md has no '## Layout' section with a code block"
    paths, parent = [], ""
    for line in section.group(1).splitlines():
        name = line.split()[0]
        if line.startswith(" "):
            paths.append(parent + name)
        else:
            parent = name if name.endswith("/") else ""
            paths.append(name)
    return paths


def test_layout_map_is_true():
    paths = _layout()
    missing = [p for p in paths if not (REPO / p).exists()]
    assert not missing, f"README's layout names paths that do not exist: {missing}"
    packages = [
        f"{d.parent.name}/{d.name}/"
        for root in ("titan_core", "titan_rl")
        for d in sorted((REPO / root).iterdir())
        if (d / "__init__.py").is_file()
    ]
    unnamed = [p for p in packages if p not in paths]
    assert not unnamed, f"README's layout (## Layout) leaves out these packages: {unnamed}"


def test_layout_map_names_every_top_level_folder():
    try:
        tracked = subprocess.run(
            ["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True
        ).stdout.splitlines()
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    folders = {f.split("/")[0] + "/" for f in tracked if "/" in f and not f.startswith(".")}
    unnamed = sorted(folders - set(_layout()))
    assert not unnamed, f"README's layout (## Layout) leaves out these folders: {unnamed}"


def test_bench_readme_names_every_script():
    text = (REPO / "bench" / "README.md").read_text()
    unnamed = [p.name for p in sorted((REPO / "bench").glob("*.py")) if p.name not in text]
    assert not unnamed, f"bench/README.md does not say what these scripts time: {unnamed}"
