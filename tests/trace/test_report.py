"""The report's pictures: SVG written into report.html, drawn from the summary's own
numbers, with no plotting library on the command's path."""

from __future__ import annotations

import json
import math
import random
import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from titan_core.trace import svg
from titan_core.trace.analyze import build_summary, load_ranks
from titan_core.trace.cli import main
from titan_core.trace.report import write_report
from titan_core.trace.synth import write_job

NS = "{http://www.w3.org/2000/svg}"


def _num(s: str) -> float:
    return float(s.replace(",", ""))


def _figures(html: str) -> dict[str, ET.Element]:
    """Each inline SVG (parsed as XML, so it is well formed) by the heading above it."""
    found = re.findall(r"<h2>([^<]*)</h2>(<svg .*?</svg>)", html, re.S)
    return {title: ET.fromstring(body) for title, body in found}


def _marks(fig: ET.Element) -> list[tuple[ET.Element, str]]:
    """(rect, tooltip) of every mark that has a tooltip."""
    out = []
    for r in fig.iter(f"{NS}rect"):
        t = r.find(f"{NS}title")
        if t is not None:
            out.append((r, t.text or ""))
    return out


@pytest.fixture(scope="module")
def pp_job(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, list, dict[str, ET.Element]]:
    d = tmp_path_factory.mktemp("pp")
    write_job(d, pp=2, dp=2, m=4, steps=3, slow={3: 1.4}, clock_skew={2: 3000.0})
    results, problems = load_ranks(d, workers=1, progress=False)
    summary = build_summary(results, problems)
    out = tmp_path_factory.mktemp("report") / "report.html"
    write_report(summary, results, out)
    return summary, results, _figures(out.read_text(encoding="utf-8"))


def test_every_picture_is_svg(pp_job: tuple) -> None:
    summary, _, figs = pp_job
    g = summary["pipeline"]["groups"][0]
    assert list(figs) == [
        "Time breakdown per rank",
        f"Pipeline group {g['ranks']} timeline, step {g['steps'][-1]}",
        "Step time, rank x step",
        "Top kernels",
        "Communication bandwidth by collective",
    ]
    for fig in figs.values():
        assert fig.tag == f"{NS}svg" and float(fig.get("width", 0)) > 0
        assert _marks(fig)


def test_breakdown_columns_are_the_summary(pp_job: tuple) -> None:
    summary, _, figs = pp_job
    marks = _marks(figs["Time breakdown per rank"])
    scale = set()
    seen = 0
    for r in summary["ranks"]:
        for key, name, color in (
            ("computation_us", "computation", svg.BLUE),
            ("communication_exposed_us", "communication (exposed)", svg.ORANGE),
            ("idle_us", "idle", svg.RED),
        ):
            want = sum(st[key] for st in r["steps"]) / 1e3
            if want == 0:
                continue
            (rect, tip), *more = [m for m in marks if m[1].startswith(f"rank {r['rank']}, {name}:")]
            assert not more and rect.get("fill") == color
            assert _num(tip.split(": ")[1].split(" ")[0]) == pytest.approx(want, abs=1e-3)
            scale.add(round(float(rect.get("height", 0)) / want, 1))
            seen += 1
    assert seen >= 2 * len(summary["ranks"])
    # one ms-to-pixel scale for every segment (heights rounded to 0.1 px)
    assert max(scale) - min(scale) <= 0.1 * len(summary["ranks"])


def test_heatmap_cells_are_step_times(pp_job: tuple) -> None:
    summary, _, figs = pp_job
    cells = {t.split(":")[0]: (r, t) for r, t in _marks(figs["Step time, rank x step"])}
    times = {
        f"rank {r['rank']}, step {st['step']}": st["step_time_us"] / 1e3
        for r in summary["ranks"]
        for st in r["steps"]
    }
    assert set(cells) == set(times)
    for key, want in times.items():
        assert _num(cells[key][1].split(": ")[1]) == pytest.approx(want, abs=1e-3)
    lo, hi = min(times, key=times.__getitem__), max(times, key=times.__getitem__)
    assert cells[lo][0].get("fill") == svg.VIRIDIS[0]
    assert cells[hi][0].get("fill") == svg.VIRIDIS[-1]


def test_pipeline_lanes_cover_compute(pp_job: tuple) -> None:
    """Blue spans of each stage cover its compute intervals in the step window (the window
    on the common clock, moved onto each rank's own); what they add is only gaps narrower
    than half a pixel."""
    summary, results, figs = pp_job
    g = summary["pipeline"]["groups"][0]
    step = g["steps"][-1]
    lo, hi = g["step_windows"][str(step)]
    fig = next(f for t, f in figs.items() if t.startswith("Pipeline group"))
    labels = [t.text for t in fig.iter(f"{NS}text") if t.text and t.text.startswith("stage ")]
    assert labels == [f"stage {i} (rank {r})" for i, r in enumerate(g["ranks"])]
    marks = _marks(fig)
    lane_h = 26.0
    px_per_ms = (svg.WIDTH - 16 - float(marks[0][0].get("x", 0))) / ((hi - lo) / 1e3)
    by_rank = {r.rank: r for r in results}
    offsets = summary["clock_offsets_us"]
    assert offsets["2"] != 0 and 2 in g["ranks"]  # the skewed rank is drawn
    for i, rank in enumerate(g["ranks"]):
        top = 28 + i * lane_h
        o = round(offsets[str(rank)])
        spans = []
        for rect, tip in marks:
            y = float(rect.get("y", 0))
            if top <= y < top + lane_h and tip.startswith("compute"):
                a, b = (_num(x) for x in tip.split(": ")[1].removesuffix(" ms").split("-"))
                spans.append((a, b, int(tip.split(":")[0].partition(" x")[2] or 1)))
        cs, ce = by_rank[rank].compute_coarse
        clipped = [
            ((max(a - o, lo) - lo) / 1e3, (min(b - o, hi) - lo) / 1e3)
            for a, b in zip(cs, ce, strict=True)
            if b - o > lo and a - o < hi
        ]
        assert sum(n for *_, n in spans) == len(clipped) > 0
        for a, b in clipped:
            assert any(x - 1e-3 <= a and b <= y + 1e-3 for x, y, _ in spans)
        added = sum(b - a for a, b, _ in spans) - sum(b - a for a, b in clipped)
        joins = sum(n - 1 for *_, n in spans)
        assert -1e-3 <= added <= joins * 0.5 / px_per_ms + 1e-3


def test_top_kernels_in_order_with_escaped_names(pp_job: tuple) -> None:
    summary, _, figs = pp_job
    tips = [t for _, t in _marks(figs["Top kernels"])]
    top = summary["top_kernels"][:15]
    assert any("<" in k["name"] for k in top)  # parsed back from XML: escaping held
    assert [t.rsplit(": ", 1)[0] for t in tips] == [k["name"] for k in top]
    for t, k in zip(tips, top, strict=True):
        assert _num(t.rsplit(": ", 1)[1].split(" ")[0]) == pytest.approx(k["sum_us"] / 1e3)


@pytest.mark.parametrize("seed", range(5))
def test_ticks_are_round_and_cover(seed: int) -> None:
    rng = random.Random(seed)
    for _ in range(200):
        hi = 10 ** rng.uniform(-4, 7)
        t = svg.ticks(hi)
        step = t[1] - t[0]
        mant = step / 10 ** math.floor(math.log10(step) + 1e-9)
        assert any(abs(mant - m) < 1e-6 for m in (1, 2, 2.5, 5))
        assert t[0] == 0 and t[-2] < hi <= t[-1] * (1 + 1e-12)
        assert 3 <= len(t) <= 7


def test_lanes_join_only_subpixel_gaps() -> None:
    span = 100.0  # 1 unit is several pixels wide
    marks = [svg.Mark(0, 10, svg.BLUE, "compute"), svg.Mark(10.001, 20, svg.BLUE, "compute")]
    marks += [svg.Mark(40, 50, svg.BLUE, "compute"), svg.Mark(60, 61, svg.GREEN, "P2P")]
    fig = ET.fromstring(svg.lanes(["a"], [marks], span, title="t", x_label="x", unit="ms"))
    tips = sorted(t for _, t in _marks(fig))
    assert tips == ["P2P: 60-61 ms", "compute x2: 0-20 ms", "compute: 40-50 ms"]


def test_command_imports_no_plotting_library(traces: Path, tmp_path: Path) -> None:
    code = (
        "import sys; from titan_core.trace.cli import main; "
        f"main(['analyze', {str(traces / 'trace_filter')!r}, '--out', {str(tmp_path)!r}, "
        "'--no-cache', '--quiet', '--workers', '1']); "
        "print(*(m in sys.modules for m in ('matplotlib', 'numpy', 'pandas', 'polars')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split()[-4:] == ["False"] * 4
    figs = _figures((tmp_path / "report.html").read_text(encoding="utf-8"))
    assert len(figs) >= 3 and json.loads((tmp_path / "summary.json").read_text())["num_ranks"] == 2


def test_cli_names_both_outputs(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    d = tmp_path / "job"
    write_job(d, pp=2, dp=1, m=2, steps=2)
    assert (
        main(["analyze", str(d), "--out", str(tmp_path / "o"), "--no-cache", "--workers", "1"]) == 0
    )
    assert "report.html" in capsys.readouterr().out.splitlines()[-1]
    assert (
        main(
            [
                "analyze",
                str(d),
                "--out",
                str(tmp_path / "n"),
                "--no-cache",
                "--workers",
                "1",
                "--no-report",
            ]
        )
        == 0
    )
    assert "report.html" not in capsys.readouterr().out.splitlines()[-1]
    assert not (tmp_path / "n" / "report.html").exists()
