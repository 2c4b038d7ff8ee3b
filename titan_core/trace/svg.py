"""Charts written directly as SVG text: stacked columns, horizontal bars, a heatmap and
timeline lanes, for the trace report.

No plotting library: the report is built in milliseconds (importing matplotlib alone
takes about as long as analyzing a 30 MB trace), and the pictures stay sharp at any zoom. Every mark carries its exact value in a ``<title>``, which browsers show on
hover. Layout is estimated from character counts (no font metrics), generously.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from html import escape
from typing import NamedTuple

BLUE, ORANGE, GREEN, RED, GRAY = "#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#7f7f7f"
#: matplotlib's viridis at 0, 1/8, ..., 1 (interpolated linearly in between)
VIRIDIS = (
    "#440154",
    "#472d7b",
    "#3b528b",
    "#2c728e",
    "#21918c",
    "#28ae80",
    "#5ec962",
    "#addc30",
    "#fde725",
)
MISSING = "#e8e8e8"
WIDTH = 900
FONT = 11
_GLYPH = 0.62  # average glyph width of a sans-serif font, in font sizes


class Series(NamedTuple):
    name: str
    color: str
    values: Sequence[float]


class Mark(NamedTuple):
    """A span [start, end) on a lane; ``top`` and ``height`` are fractions of the bar."""

    start: float
    end: float
    color: str
    name: str
    top: float = 0.0
    height: float = 1.0
    opacity: float = 1.0


def ticks(hi: float, lo: float = 0.0, n: int = 5) -> list[float]:
    """About ``n`` round values (1, 2, 2.5 or 5 times a power of ten) from ``lo`` up to the
    first one at or above ``hi``."""
    if not hi > lo:
        hi = lo + (abs(lo) or 1.0)
    raw = (hi - lo) / n
    mag = 10.0 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw * (1 - 1e-9))
    first = math.floor(lo / step + 1e-9)
    last = math.ceil(hi / step - 1e-9)
    return [round(k * step, 12) for k in range(first, last + 1)]


def _tick_label(v: float, step: float) -> str:
    digits = max(0, -math.floor(math.log10(step) + 1e-9)) if step > 0 else 0
    if step > 0 and abs(step * 10**digits - round(step * 10**digits)) > 1e-6:
        digits += 1  # 2.5, 0.25, ...
    return f"{v:,.{digits}f}"


def num(v: float) -> str:
    """A value as tooltips show it: thousands separated, three decimals at most."""
    return f"{v:,.3f}".rstrip("0").rstrip(".")


def _w(text: str, size: float = FONT) -> float:
    return len(text) * size * _GLYPH


def _fit(text: str, chars: int) -> str:
    return text if len(text) <= chars else text[: chars - 1] + "\u2026"


def _f(x: float) -> str:
    return f"{x:.1f}".rstrip("0").rstrip(".")


def _text(x: float, y: float, s: str, anchor: str = "start", size: float = FONT, **kw: str) -> str:
    extra = "".join(f' {k.replace("_", "-")}="{v}"' for k, v in kw.items())
    return (
        f'<text x="{_f(x)}" y="{_f(y)}" text-anchor="{anchor}" font-size="{_f(size)}"{extra}>'
        f"{escape(s)}</text>"
    )


def _rect(x: float, y: float, w: float, h: float, fill: str, tip: str = "", **kw: str) -> str:
    extra = "".join(f' {k.replace("_", "-")}="{v}"' for k, v in kw.items())
    close = f"><title>{escape(tip)}</title></rect>" if tip else "/>"
    return (
        f'<rect x="{_f(x)}" y="{_f(y)}" width="{_f(w)}" height="{_f(h)}" fill="{fill}"{extra}'
        + close
    )


def _svg(width: float, height: float, title: str, body: list[str]) -> str:
    w, h = _f(width), _f(height)
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {w} {h}" width="{w}" '
        f'height="{h}" font-family="sans-serif" role="img"><title>{escape(title)}</title>'
        + "".join(body)
        + "</svg>"
    )


def _legend(items: Sequence[tuple[str, str]], right: float, y: float) -> list[str]:
    """Swatches and names in one row ending at ``right``."""
    widths = [14 + _w(name, FONT - 1) + 14 for name, _ in items]
    x = right - sum(widths)
    out = []
    for (name, color), w in zip(items, widths, strict=True):
        out.append(_rect(x, y - 9, 10, 10, color))
        out.append(_text(x + 14, y, name, size=FONT - 1))
        x += w
    return out


def _every(n: int, label_px: float, room_px: float) -> int:
    """Label every k-th of ``n`` slots so that labels of ``label_px`` fit in ``room_px``."""
    return max(1, math.ceil(n * label_px / max(room_px, 1.0)))


def columns(
    categories: Sequence[str],
    series: Sequence[Series],
    *,
    title: str,
    x_label: str,
    y_label: str,
    height: int = 320,
) -> str:
    """Stacked columns, one per category, one segment per series."""
    n = len(categories)
    totals = [sum(s.values[i] for s in series) for i in range(n)]
    yt = ticks(max(totals, default=0.0))
    top_v = yt[-1]
    left = 14 + max(_w(_tick_label(t, yt[1] - yt[0]), FONT - 1) for t in yt) + 6
    x0, x1, y0, y1 = left + 4, WIDTH - 10, 28.0, height - 42.0
    ph = y1 - y0
    slot = (x1 - x0) / max(n, 1)
    bar = min(slot * 0.8, 60.0)
    out = _y_axis(yt, x0, x1, y0, y1, y_label)
    for i, cat in enumerate(categories):
        base = 0.0
        for s in series:
            v = s.values[i]
            if v > 0:
                y = y1 - (base + v) / top_v * ph
                tip = f"{x_label} {cat}, {s.name}: {num(v)} ({y_label})"
                out.append(
                    _rect(x0 + slot * (i + 0.5) - bar / 2, y, bar, v / top_v * ph, s.color, tip)
                )
            base += v
    k = _every(n, max((_w(c, FONT - 2) for c in categories), default=0) + 4, x1 - x0)
    for i in range(0, n, k):
        out.append(_text(x0 + slot * (i + 0.5), y1 + 13, categories[i], "middle", FONT - 2))
    out.append(_text((x0 + x1) / 2, height - 8, x_label, "middle"))
    out += _legend([(s.name, s.color) for s in series], x1, 16)
    return _svg(WIDTH, height, title, out)


def _y_axis(
    yt: Sequence[float], x0: float, x1: float, y0: float, y1: float, label: str
) -> list[str]:
    step, top = yt[1] - yt[0], yt[-1]
    out = []
    for t in yt:
        y = y1 - (t - yt[0]) / (top - yt[0]) * (y1 - y0)
        out.append(f'<path d="M{_f(x0)} {_f(y)}H{_f(x1)}" stroke="#ddd"/>')
        out.append(_text(x0 - 5, y + 4, _tick_label(t, step), "end", FONT - 1))
    out.append(f'<path d="M{_f(x0)} {_f(y0)}V{_f(y1)}H{_f(x1)}" stroke="#333" fill="none"/>')
    mid = (y0 + y1) / 2
    out.append(_text(12, mid, label, "middle", transform=f"rotate(-90 12 {_f(mid)})"))
    return out


def _x_axis(
    xt: Sequence[float], x0: float, x1: float, y0: float, y1: float, span: float, label: str
) -> list[str]:
    """Value axis along the bottom (gridlines up to ``y0``); ``span`` maps to ``x1``."""
    step = xt[1] - xt[0] if len(xt) > 1 else 1.0
    out = []
    for t in xt:
        x = x0 + t / span * (x1 - x0)
        out.append(f'<path d="M{_f(x)} {_f(y0)}V{_f(y1)}" stroke="#ddd"/>')
        out.append(_text(x, y1 + 14, _tick_label(t, step), "middle", FONT - 1))
    out.append(f'<path d="M{_f(x0)} {_f(y0)}V{_f(y1)}H{_f(x1)}" stroke="#333" fill="none"/>')
    out.append(_text((x0 + x1) / 2, y1 + 32, label, "middle"))
    return out


def hbars(
    labels: Sequence[str],
    values: Sequence[float],
    colors: Sequence[str],
    *,
    title: str,
    x_label: str,
    legend: Sequence[tuple[str, str]] = (),
    label_chars: int = 70,
) -> str:
    """Horizontal bars, the first label on top; labels longer than ``label_chars`` are cut
    (the tooltip keeps them whole)."""
    row = 18.0
    shown = [_fit(s, label_chars) for s in labels]
    left = 8 + max((_w(s, FONT - 1) for s in shown), default=0.0)
    x0, x1, y0 = left + 6, WIDTH - 16, 28.0
    y1 = y0 + row * len(labels)
    xt = ticks(max(values, default=0.0))
    span = xt[-1]
    out = _x_axis(xt, x0, x1, y0, y1, span, x_label)
    for i, (lab, v, c) in enumerate(zip(labels, values, colors, strict=True)):
        y = y0 + i * row
        out.append(_text(x0 - 6, y + row / 2 + 4, shown[i], "end", FONT - 1))
        w = max(v, 0.0) / span * (x1 - x0)
        out.append(_rect(x0, y + 2, w, row - 4, c, f"{lab}: {num(v)} ({x_label})"))
    out += _legend(legend, x1, 16)
    return _svg(WIDTH, y1 + 44, title, out)


def _viridis(t: float) -> str:
    t = min(max(t, 0.0), 1.0) * (len(VIRIDIS) - 1)
    i = min(int(t), len(VIRIDIS) - 2)
    a, b, f = VIRIDIS[i], VIRIDIS[i + 1], t - i
    rgb = (round(int(a[k : k + 2], 16) * (1 - f) + int(b[k : k + 2], 16) * f) for k in (1, 3, 5))
    return "#" + "".join(f"{c:02x}" for c in rgb)


def heatmap(
    rows: Sequence[str],
    cols: Sequence[str],
    values: Sequence[Sequence[float | None]],
    *,
    title: str,
    x_label: str,
    y_label: str,
    value_label: str,
) -> str:
    """A row x column grid coloured by value (viridis; ``None`` cells grey) with a colour bar."""
    cell_h = min(max(14.0 if len(rows) <= 32 else 9.0, 100.0 / max(len(rows), 1)), 40.0)
    left = 26 + max((_w(r, FONT - 2) for r in rows), default=0.0)
    x0, x1, y0 = left, 560.0, 26.0
    y1 = y0 + cell_h * len(rows)
    seen = [v for line in values for v in line if v is not None]
    lo, hi = (min(seen), max(seen)) if seen else (0.0, 1.0)
    cw = (x1 - x0) / max(len(cols), 1)
    out = []
    for i, (r, line) in enumerate(zip(rows, values, strict=True)):
        for j, v in enumerate(line):
            color = MISSING if v is None else _viridis((v - lo) / (hi - lo) if hi > lo else 0.5)
            tip = f"{y_label} {r}, {x_label} {cols[j]}: " + ("no data" if v is None else num(v))
            out.append(_rect(x0 + j * cw, y0 + i * cell_h, cw + 0.3, cell_h + 0.3, color, tip))
    kr = _every(len(rows), FONT - 1, y1 - y0)
    for i in range(0, len(rows), kr):
        out.append(_text(x0 - 5, y0 + (i + 0.5) * cell_h + 3, rows[i], "end", FONT - 2))
    kc = _every(len(cols), max((_w(c, FONT - 2) for c in cols), default=0) + 6, x1 - x0)
    for j in range(0, len(cols), kc):
        out.append(_text(x0 + (j + 0.5) * cw, y1 + 13, cols[j], "middle", FONT - 2))
    out.append(_text((x0 + x1) / 2, y1 + 30, x_label, "middle"))
    mid = (y0 + y1) / 2
    out.append(_text(12, mid, y_label, "middle", transform=f"rotate(-90 12 {_f(mid)})"))
    out += _colorbar(lo, hi, x1 + 24, y0, y1, value_label)
    return _svg(x1 + 90, y1 + 40, title, out)


def _colorbar(lo: float, hi: float, x: float, y0: float, y1: float, label: str) -> list[str]:
    stops = "".join(
        f'<stop offset="{_f(100 * i / (len(VIRIDIS) - 1))}%" stop-color="{c}"/>'
        for i, c in enumerate(reversed(VIRIDIS))
    )
    out = [
        f'<defs><linearGradient id="viridis" x1="0" y1="0" x2="0" y2="1">{stops}'
        "</linearGradient></defs>",
        _rect(x, y0, 14, y1 - y0, "url(#viridis)"),
    ]
    if hi > lo:
        all_t = ticks(hi, lo, 4)
        vt = [t for t in all_t if lo - 1e-9 <= t <= hi + 1e-9]
        step = all_t[1] - all_t[0]
        for t in vt:
            y = y1 - (t - lo) / (hi - lo) * (y1 - y0)
            out.append(f'<path d="M{_f(x + 14)} {_f(y)}h4" stroke="#333"/>')
            out.append(_text(x + 21, y + 4, _tick_label(t, step), size=FONT - 1))
    else:
        out.append(_text(x + 21, (y0 + y1) / 2 + 4, num(lo), size=FONT - 1))
    out.append(_text(x + 7, y0 - 8, label, "middle", FONT - 1))
    return out


def lanes(
    labels: Sequence[str],
    marks: Sequence[Sequence[Mark]],
    span: float,
    *,
    title: str,
    x_label: str,
    unit: str,
    legend: Sequence[tuple[str, str]] = (),
) -> str:
    """One lane per label, its marks drawn in order at x in [0, ``span``]. Marks of one
    kind closer than half a pixel are drawn as one (the tooltip says how many)."""
    lane = 26.0
    left = 10 + max((_w(s, FONT - 1) for s in labels), default=0.0)
    x0, x1, y0 = left + 6, WIDTH - 16, 28.0
    y1 = y0 + lane * len(labels)
    span = span if span > 0 else 1.0
    px = (x1 - x0) / span
    xt = [t for t in ticks(span) if t <= span * (1 + 1e-9)]
    out = _x_axis(xt, x0, x1, y0, y1, span, x_label)
    for i, (name, ms) in enumerate(zip(labels, marks, strict=True)):
        top = y0 + i * lane + lane * 0.1
        out.append(_text(x0 - 6, top + lane * 0.4 + 4, name, "end", FONT - 1))
        for m, a, b, count in _merged(ms, px):
            tip = f"{m.name}{f' x{count}' if count > 1 else ''}: {num(a)}-{num(b)} {unit}"
            out.append(
                _rect(
                    x0 + a * px,
                    top + m.top * lane * 0.8,
                    max((b - a) * px, 1.0),
                    m.height * lane * 0.8,
                    m.color,
                    tip,
                    **({"fill_opacity": _f(m.opacity)} if m.opacity < 1 else {}),
                )
            )
    out += _legend(legend, x1, 16)
    return _svg(WIDTH, y1 + 44, title, out)


def _merged(marks: Sequence[Mark], px: float) -> list[tuple[Mark, float, float, int]]:
    """Runs of one kind of mark (kinds in order of first appearance, each by start) with
    gaps under half a pixel joined: (first mark, start, end, how many)."""
    kinds: dict[tuple, list[Mark]] = {}
    for m in marks:
        kinds.setdefault((m.color, m.name, m.top, m.height, m.opacity), []).append(m)
    out: list[tuple[Mark, float, float, int]] = []
    for group in kinds.values():
        group.sort(key=lambda m: m.start)
        first, a, b, n = group[0], group[0].start, group[0].end, 1
        for m in group[1:]:
            if (m.start - b) * px < 0.5:
                b, n = max(b, m.end), n + 1
            else:
                out.append((first, a, b, n))
                first, a, b, n = m, m.start, m.end, 1
        out.append((first, a, b, n))
    return out
