"""bench/weight_sync.py --trainer-layout: the layout parser, the world it launches and the
goal verdicts (no trainer, no engine)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

REPO = Path(__file__).resolve().parents[2]


def _load() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "weight_sync_layouts", REPO / "bench/weight_sync_layouts.py"
    )
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


wl = _load()


@pytest.mark.parametrize(
    ("text", "tp", "pp", "ep", "vpp", "world"),
    [
        ("pp=2", 1, 2, 1, None, 2),
        ("tp=2", 2, 1, 1, None, 2),
        ("pp=2,ep=2", 1, 2, 2, None, 4),
        (" EP=2 , pp=2 ", 1, 2, 2, None, 4),
        ("tp=2,pp=2,ep=2", 2, 2, 2, None, 8),
        ("pp=2,vpp=2", 1, 2, 1, 2, 2),
    ],
)
def test_parse_layout(text: str, tp: int, pp: int, ep: int, vpp: int | None, world: int) -> None:
    layout = wl.parse_layout(text)
    assert (layout.tp, layout.pp, layout.ep, layout.vpp) == (tp, pp, ep, vpp)
    assert layout.world == world
    assert layout.moe == (ep > 1)
    assert wl.parse_layout(str(layout)) == layout  # the printed name parses back


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("pp", "is not one of"),
        ("dp=2", "is not one of"),
        ("pp=two", "not an integer"),
        ("pp=0", "at least 1"),
        ("pp=2,pp=4", "given twice"),
        ("vpp=2", "vpp needs pp"),
    ],
)
def test_parse_layout_refuses(text: str, says: str) -> None:
    with pytest.raises(ValueError, match=says):
        wl.parse_layout(text)


def test_goals_are_the_issues() -> None:
    assert wl.parse_layout("pp=2").goal == 0.55
    assert wl.parse_layout("pp=2,ep=2").goal == 0.35
    assert wl.parse_layout("tp=2").goal is None
    assert wl.verdict(0.5, 0.55).endswith(" met") and "NOT met" in wl.verdict(0.6, 0.55)


def test_check_fits_names_what_does_not_split() -> None:
    wl.check_fits(wl.parse_layout("pp=2,ep=2"), layers=8, heads=8, kv_heads=4, experts=32)
    with pytest.raises(ValueError, match="layers"):
        wl.check_fits(wl.parse_layout("pp=3"), layers=8, heads=8, kv_heads=4, experts=0)
    with pytest.raises(ValueError, match="experts"):
        wl.check_fits(wl.parse_layout("ep=3"), layers=8, heads=8, kv_heads=4, experts=32)


def test_table_ratio_is_max_rank_over_model_bytes() -> None:
    row = {
        "layout": wl.parse_layout("pp=2"), "model": "m", "transport": "tensor",
        "model_bytes": 1000, "before": 0.5, "rank_bytes": [600, 400],
        "metrics": {"sync/bytes_max_rank": 600.0, "sync/time_s": 1.0, "sync/transfer_s": 0.5,
                    "sync/logprob_abs_diff_max": 2e-6, "sync/senders": 2.0},
    }  # fmt: skip
    line = wl.table([row])[-1]
    assert " 0.600 " in line and "NOT met" in line and "ok" in line
