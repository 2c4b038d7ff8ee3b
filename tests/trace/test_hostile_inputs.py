"""Hostile or broken trace files cost bounded memory and linear time, and are reported
per file: gzip bombs, huge events, text that is no JSON, empty ranks, impossible times."""

from __future__ import annotations

import gzip
import json
import struct
import subprocess
import sys
import time
import zlib
from pathlib import Path
from typing import Any

import pytest

from titan_core.trace.analyze import load_ranks
from titan_core.trace.categories import TraceConfig
from titan_core.trace.cli import main
from titan_core.trace.parse import TraceError, parse_file


class Lit(str):
    """A JSON literal written as is (numbers Python's json cannot write, like 1e400)."""


def _value(v: Any) -> str:
    return str(v) if isinstance(v, Lit) else json.dumps(v)


def kernel(name: str, ts: Any, dur: Any, **extra: Any) -> dict[str, Any]:
    e = {"ph": "X", "cat": "kernel", "name": name, "pid": 0, "tid": 7, "ts": ts, "dur": dur}
    e["args"] = {"stream": 7, "correlation": 1, **extra}
    return e


def kineto_text(events: list[dict[str, Any]], rank: int = 0, tail: str = "") -> bytes:
    """A trace in the profiler's layout: each event's fields on its own lines."""
    body = ",\n".join(
        "  {\n    " + ", ".join(f'"{k}": {_value(v)}' for k, v in e.items()) + "\n  }"
        for e in events
    )
    head = f'{{\n  "schemaVersion": 1,\n  "distributedInfo": {{"rank": {rank}}},\n'
    return f'{head}  "traceEvents": [\n{body}\n]{tail}\n}}'.encode()


def compact_text(events: list[dict[str, Any]], rank: int = 0, tail: str = "") -> bytes:
    """The same trace as compact JSON (``}, {`` between events, no line breaks)."""
    body = ", ".join(
        "{" + ", ".join(f'"{k}": {_value(v)}' for k, v in e.items()) + "}" for e in events
    )
    return f'{{"distributedInfo": {{"rank": {rank}}}, "traceEvents": [{body}]{tail}}}'.encode()


LAYOUTS = {"kineto": kineto_text, "compact": compact_text}


def gzip_bomb(path: Path, head: bytes, block: bytes, repeats: int, foot: bytes) -> None:
    """One gzip member inflating to head + block * repeats + foot, written from one
    compressed block repeated (deflate after a full flush refers to nothing before it),
    so a 3 GiB text takes a few MB and a second to make."""
    c = zlib.compressobj(9, zlib.DEFLATED, -15)
    h = c.compress(head) + c.flush(zlib.Z_FULL_FLUSH)
    b = c.compress(block) + c.flush(zlib.Z_FULL_FLUSH)
    f = c.compress(foot) + c.flush()
    crc = zlib.crc32(head)
    for _ in range(repeats):
        crc = zlib.crc32(block, crc)
    crc = zlib.crc32(foot, crc)
    size = len(head) + len(block) * repeats + len(foot)
    with open(path, "wb") as out:
        out.write(b"\x1f\x8b\x08\x00\x00\x00\x00\x00\x02\xff" + h)
        for _ in range(repeats):
            out.write(b)
        out.write(f + struct.pack("<II", crc, size & 0xFFFFFFFF))


#: the CLI, then its peak RSS: its own from /proc (getrusage's would include the pytest
#: process it was started from: Linux keeps the larger of the two across exec) and that
#: of its forked helpers
_PEAK = (
    "import resource, sys\n"
    "from titan_core.trace.cli import main\n"
    "main(sys.argv[1:])\n"
    "own = next(int(ln.split()[1]) for ln in open('/proc/self/status') if ln.startswith('VmHWM'))\n"
    "print('PEAK_KB', max(own, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss))\n"
)


def analyze_peak(trace_dir: Path, out: Path, *extra: str) -> tuple[dict[str, Any], float]:
    """The CLI in a fresh process: summary.json and the peak RSS (MiB) of the process
    and its helpers."""
    if sys.platform != "linux":
        pytest.skip("peak memory is read from /proc")
    args = ["analyze", str(trace_dir), "--out", str(out), "--no-cache", "--no-report"]
    run = subprocess.run(
        [sys.executable, "-c", _PEAK, *args, "--quiet", "--workers", "2", *extra],
        capture_output=True,
        text=True,
        timeout=600,
    )
    peak = [ln for ln in run.stdout.splitlines() if ln.startswith("PEAK_KB")]
    assert peak, run.stderr[-2000:]
    return json.loads((out / "summary.json").read_text()), int(peak[0].split()[1]) / 1024


def problems_by_file(summary: dict[str, Any]) -> dict[str, str]:
    return {Path(p["file"]).name: p["reason"] for p in summary["problems"]}


# ------------------------------------------------------------------ size caps, bombs

GIB = 1 << 30
_BOMB_HEAD = b'{\n  "distributedInfo": {"rank": 0},\n  "traceEvents": [\n'


def _events_block(size: int) -> bytes:
    """Whole profiler-layout events (each ending in ``,\\n``) filling about ``size`` bytes."""
    one = kineto_text([kernel("gemm", 10, 5)]).split(b"[\n", 1)[1].rsplit(b"\n]", 1)[0]
    return (one + b",\n") * (size // (len(one) + 2))


@pytest.mark.slow
@pytest.mark.parametrize("fill", ["whitespace", "zeros", "events"])
def test_gzip_bomb_is_reported_in_bounded_memory(tmp_path: Path, fill: str) -> None:
    """A few MB of gzip inflating to GiBs: 3 GiB of whitespace (no event boundary: stops at the
    default 256 MiB event cap), zeros (no JSON: stops at once) or valid events (stops at
    the text cap, set to 256 MiB in the config). Each is a problem named for its file;
    peak memory stays near the cap, far below the 3 GiB text."""
    d = tmp_path / "job"
    d.mkdir()
    block = {"whitespace": b" " * (1 << 20), "zeros": bytes(1 << 20)}.get(fill)
    block = block or _events_block(1 << 20)
    # 3 GiB of text; valid events compress less well (~4 MB per GiB): 1 GiB of them
    repeats = (1 if fill == "events" else 3) * GIB // len(block)
    foot = b'  {"ph": "i", "name": "end"}\n]}' if fill == "events" else b"\n]}"
    gzip_bomb(d / "bomb.json.gz", _BOMB_HEAD, block, repeats, foot)
    assert (d / "bomb.json.gz").stat().st_size < 8 << 20
    (d / "rank1.json").write_bytes(kineto_text([kernel("gemm", 10, 5)], rank=1))
    cap = 256 << 20
    assert TraceConfig().max_event_bytes == cap
    cfg = tmp_path / "caps.yaml"
    cfg.write_text(f"max_trace_bytes: {cap}\n")
    extra = ("--config", str(cfg)) if fill == "events" else ()
    summary, peak_mib = analyze_peak(d, tmp_path / "out", *extra)
    reason = problems_by_file(summary)["bomb.json.gz"]
    expected = {
        "whitespace": "max_event_bytes",
        "zeros": "not valid JSON at byte",
        "events": "max_trace_bytes",
    }
    assert expected[fill] in reason
    assert [r["rank"] for r in summary["ranks"]] == [1]  # the other file is analyzed
    assert peak_mib < cap / 2**20 + 150, f"peak {peak_mib:.0f} MiB"


def test_text_cap_stops_a_plain_file_before_reading(tmp_path: Path) -> None:
    path = tmp_path / "big.json"
    path.write_bytes(kineto_text([kernel("gemm", 10 * i, 5) for i in range(2000)]))
    cfg = TraceConfig(max_trace_bytes=path.stat().st_size - 1)
    with pytest.raises(TraceError, match="max_trace_bytes"):
        parse_file(path, cfg)
    assert parse_file(path, TraceConfig(max_trace_bytes=path.stat().st_size)).events.n_events


def test_caps_come_from_the_config_file_and_are_checked(tmp_path: Path) -> None:
    good = tmp_path / "caps.yaml"
    good.write_text("max_event_bytes: 1048576\nmax_trace_bytes: 5000000000\n")
    cfg = TraceConfig.from_file(good)
    assert (cfg.max_event_bytes, cfg.max_trace_bytes) == (1 << 20, 5_000_000_000)
    for bad in ("0", "-5", "'1GB'", "1.5", "true"):
        path = tmp_path / "bad.yaml"
        path.write_text(f"max_event_bytes: {bad}\n")
        with pytest.raises(ValueError, match="max_event_bytes"):
            TraceConfig.from_file(path)


def test_caps_from_the_command_line(tmp_path: Path) -> None:
    """``--max-event-mb`` lowers (or raises) the cap, and the problem names the flag."""
    from titan_core.trace.cli import main

    d = tmp_path / "traces"
    d.mkdir()
    big = [kernel("gemm", 10, 5), kernel("big", 20, 5, blob="a" * (3 << 20))]
    (d / "rank0.json").write_bytes(kineto_text([*big, kernel("gemm", 30, 5)], rank=0))
    (d / "rank1.json").write_bytes(kineto_text([kernel("gemm", 10, 5)], rank=1))
    args = ["analyze", str(d), "--no-cache", "--quiet", "--workers", "1", "--no-report"]
    assert main([*args, "--out", str(tmp_path / "a"), "--max-event-mb", "2"]) == 0
    problems = problems_by_file(json.loads((tmp_path / "a" / "summary.json").read_text()))
    assert "--max-event-mb" in problems["rank0.json"]
    assert main([*args, "--out", str(tmp_path / "b"), "--max-event-mb", "4"]) == 0
    assert json.loads((tmp_path / "b" / "summary.json").read_text())["problems"] == []
    with pytest.raises(SystemExit):
        main([*args, "--out", str(tmp_path / "c"), "--max-trace-mb", "0"])


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_event_cap_names_the_event(tmp_path: Path, layout: str) -> None:
    events = [kernel("gemm", 10, 5), kernel("big", 20, 5, blob="a" * (3 << 20))]
    path = tmp_path / "t.json"
    path.write_bytes(LAYOUTS[layout](events + [kernel("gemm", 30, 5)]))
    with pytest.raises(TraceError, match="max_event_bytes=2097152"):
        parse_file(path, TraceConfig(max_event_bytes=2 << 20))
    ev = parse_file(path, TraceConfig(max_event_bytes=4 << 20)).events
    assert ev.dev_name == ["gemm", "big", "gemm"]


# ------------------------------------------------------------------ huge single events


def _huge_event_file(path: Path, mib: int) -> None:
    events = [kernel("k0", 10, 5), kernel("big", 20, 5, blob="a" * (mib << 20))]
    path.write_bytes(kineto_text([*events, kernel("k2", 30, 5)]))


def _cpu_seconds(path: Path) -> float:
    best = float("inf")
    for _ in range(3):
        t = time.process_time()
        rt = parse_file(path)
        best = min(best, time.process_time() - t)
    assert rt.events.dev_name == ["k0", "big", "k2"]
    assert rt.events.dev_end == [15, 25, 35]
    return best


@pytest.mark.slow
def test_huge_event_reads_in_linear_time(tmp_path: Path) -> None:
    """A single 64 MB event in the profiler's layout costs about 4x a 16 MB one (each
    byte is searched once), not 16x (the whole buffer searched again per 64 KB read)."""
    small, large = tmp_path / "e16.json", tmp_path / "e64.json"
    _huge_event_file(small, 16)
    _huge_event_file(large, 64)
    ratio = _cpu_seconds(large) / _cpu_seconds(small)
    assert ratio < 8, f"64 MB / 16 MB event parse time ratio {ratio:.1f}"


@pytest.mark.slow
def test_huge_event_memory_stays_near_its_size(tmp_path: Path) -> None:
    d = tmp_path / "job"
    d.mkdir()
    _huge_event_file(d / "rank0.json", 96)
    summary, peak_mib = analyze_peak(d, tmp_path / "out")
    assert not summary["problems"] and summary["ranks"][0]["kernel_counts"]
    # the event is held once (no copy of the buffer, no copy of the text's tail)
    assert peak_mib < 96 + 100, f"peak {peak_mib:.0f} MiB"


@pytest.mark.parametrize("parts", [1, 2])
def test_huge_event_split_over_processes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, parts: int
) -> None:
    import titan_core.trace.parse as parse

    monkeypatch.setattr(parse, "SPLIT_MIN_TEXT_BYTES", 0)
    events = [kernel(f"k{i}", 10 * i, 5) for i in range(3000)]
    events.insert(1500, kernel("big", 15000, 5, blob="b" * (2 << 20)))
    path = tmp_path / "t.json.gz"
    path.write_bytes(gzip.compress(kineto_text(events), compresslevel=1))
    ev = parse_file(path, parts=parts).events
    assert ev.dev_name == [e["name"] for e in events]
    assert ev.dev_ts == [e["ts"] for e in events]


# ------------------------------------------------------------------ text that is no JSON


def _count_read(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Patch the reader to count the text bytes it takes in."""
    import titan_core.trace.reader as reader

    seen = [0]
    inner = reader.iter_text

    def counting(path: Path, cap: int):  # type: ignore[no-untyped-def]
        for chunk in inner(path, cap):
            seen[0] += len(chunk)
            yield chunk

    monkeypatch.setattr(reader, "iter_text", counting)
    return seen


_GOOD = kineto_text([kernel("gemm", 10 * i, 5) for i in range(1000)])[:-4]  # cut in the array


@pytest.mark.parametrize(
    ("prefix", "gz"),
    [
        (b"", False),
        (b"", True),
        (b'{"schemaVersion": 1, ', False),
        (_GOOD + b",\n  {", False),
        (_GOOD + b",\n  {", True),
    ],
)
def test_non_json_fails_at_its_first_bad_byte(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, prefix: bytes, gz: bool
) -> None:
    """8 MB of text that is no JSON after a valid start is named at its first bad byte,
    having read little past it (not the whole file)."""
    seen = _count_read(monkeypatch)
    text = prefix + b"this is not JSON at all; " * (8 << 20 >> 5)
    path = tmp_path / ("bad.json.gz" if gz else "bad.json")
    path.write_bytes(gzip.compress(text, compresslevel=1) if gz else text)
    with pytest.raises(TraceError, match=r"not valid JSON at byte (\d+)") as err:
        parse_file(path)
    at = int(err.value.args[0].split("at byte ")[1].split()[0])
    assert len(prefix) <= at <= len(prefix) + 8
    assert seen[0] < len(prefix) + (1 << 20) < len(text) // 4


def test_problems_named_per_file(tmp_path: Path) -> None:
    """Broken, empty and timestamp-damaged files in one job: each broken or empty one is a
    problem naming its file; damaged ranks are analyzed with a warning."""
    d = tmp_path / "job"
    d.mkdir()
    good = [kernel("gemm", 100 * i, 40) for i in range(50)]
    (d / "rank0.json").write_bytes(kineto_text(good, rank=0))
    bad_times = [kernel("gemm", -5, 40), kernel("gemm", Lit("1e30"), 40)]
    (d / "rank1.json").write_bytes(kineto_text(good + bad_times, rank=1))
    (d / "rank2.json").write_bytes(kineto_text([], rank=2))
    meta_only = [{"ph": "M", "name": "process_name", "pid": 0, "args": {"name": "x"}}]
    (d / "rank3.json").write_bytes(kineto_text(meta_only, rank=3))
    (d / "rank4.json").write_bytes(kineto_text(bad_times, rank=4))
    (d / "rank5.json").write_bytes(b"\x00" * (1 << 20))
    (d / "rank6.json.gz").write_bytes(gzip.compress(b'{"traceEvents": [}'))
    out = tmp_path / "out"
    assert (
        main(["analyze", str(d), "--out", str(out), "--no-cache", "--quiet", "--workers", "1"]) == 0
    )
    summary = json.loads((out / "summary.json").read_text())
    problems = problems_by_file(summary)
    assert set(problems) == {f"rank{i}.json" for i in (2, 3, 4, 5)} | {"rank6.json.gz"}
    for name in ("rank2.json", "rank3.json", "rank4.json"):
        assert problems[name].startswith("empty rank")
    assert "impossible" in problems["rank4.json"]
    assert "not valid JSON at byte 0" in problems["rank5.json"]
    assert "not valid JSON at byte" in problems["rank6.json.gz"]
    ranks = {r["rank"]: r for r in summary["ranks"]}
    assert sorted(ranks) == [0, 1]
    assert ranks[1]["kernel_time_us"] == ranks[0]["kernel_time_us"]
    assert ranks[1]["kernel_time_us"]["computation"] == 50 * 40
    assert len(ranks[1]["warnings"]) == 1 and "2 complete events" in ranks[1]["warnings"][0]
    assert not ranks[0]["warnings"]


# ------------------------------------------------------------------ impossible times

_IMPOSSIBLE = [
    ("neg_ts", -5, 5),
    ("huge_ts", Lit("1e30"), 5),
    ("huge_int_ts", Lit("1" + "0" * 40), 5),
    ("inf_ts", Lit("1e400"), 5),
    ("str_ts", "123", 5),
    ("null_ts", None, 5),
    ("neg_dur", 50, -1),
    ("str_dur", 50, "5"),
]


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("parts", [1, 2])
def test_impossible_times_left_out_and_flagged(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, layout: str, parts: int
) -> None:
    """Negative, huge, infinite, string and null times, and missing durations, are left
    out of the rank's columns (not summed into absurd totals) and counted in a warning;
    the same with the file decoded by several processes."""
    import titan_core.trace.parse as parse

    monkeypatch.setattr(parse, "SPLIT_MIN_TEXT_BYTES", 0)
    good = [kernel(f"k{i}", 100 * i, 40) for i in range(2000)]
    bad = [kernel(name, ts, dur) for name, ts, dur in _IMPOSSIBLE]
    no_dur = kernel("no_dur", 70, 5)
    del no_dur["dur"]
    bad.append(no_dur)
    events = list(good)
    for i, e in enumerate(bad):  # spread over the file (several pieces)
        events.insert(200 * i + 7, e)
    path = tmp_path / "t.json.gz"
    path.write_bytes(gzip.compress(LAYOUTS[layout](events)))
    rt = parse_file(path, parts=parts)
    assert rt.events.dev_name == [e["name"] for e in good]
    assert rt.events.dev_end == [e["ts"] + e["dur"] for e in good]
    assert rt.events.n_bad_times == len(bad)
    assert [w for w in rt.warnings if f"{len(bad)} complete events" in w]


def test_all_times_impossible_is_an_empty_rank(tmp_path: Path) -> None:
    path = tmp_path / "t.json"
    path.write_bytes(kineto_text([kernel(n, ts, d) for n, ts, d in _IMPOSSIBLE]))
    with pytest.raises(TraceError, match=f"empty rank: all {len(_IMPOSSIBLE)} complete events"):
        parse_file(path)


# ------------------------------------------------------------------ other layouts


def _awkward_events(n: int) -> list[dict[str, Any]]:
    """Kernels whose args hold what looks like event boundaries: ``}, {`` inside strings
    and between objects of nested lists, some events larger than a read."""
    events = []
    for i in range(n):
        extra: dict[str, Any] = {"note": "a}, {b" * (i % 3), "dims": [{"x": i}, {"y": [{}, {}]}]}
        if i % 500 == 250:
            extra["blob"] = "}, {" * 40000  # 160 KB
        events.append(kernel(f"k{i}", 10 * i, 5, **extra))
    return events


@pytest.mark.parametrize("parts", [1, 2])
@pytest.mark.parametrize("indent", [None, 1, 4])
def test_other_layouts_parse_exactly(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, indent: int | None, parts: int
) -> None:
    """Compact JSON and other indentations are cut at confirmed boundaries only; the
    document's keys after the events (here deviceProperties, a long list of objects)
    count.
    With one space of indent the events look like the profiler's layout, but so do the
    device properties after them: split over processes, the file is read again by one."""
    import titan_core.trace.parse as parse

    monkeypatch.setattr(parse, "SPLIT_MIN_TEXT_BYTES", 0)
    events = _awkward_events(1500)
    props = [{"id": i, "name": "AMD Instinct MI300X"} for i in range(20000)]  # ~1 MB
    doc = {"distributedInfo": {"rank": 3}, "traceEvents": events, "deviceProperties": props}
    path = tmp_path / "t.json"
    path.write_text(json.dumps(doc, indent=indent))
    rt = parse_file(path, parts=parts)
    assert rt.rank == 3 and rt.meta["device"] == "rocm"
    assert rt.events.dev_name == [e["name"] for e in events]
    assert rt.events.dev_ts == [e["ts"] for e in events]
    assert rt.events.n_events == len(events)


def test_multi_member_gzip_reads_through(tmp_path: Path) -> None:
    text = kineto_text([kernel(f"k{i}", 10 * i, 5) for i in range(3000)])
    path = tmp_path / "t.json.gz"
    third = len(text) // 3
    path.write_bytes(
        b"".join(gzip.compress(text[i : i + third]) for i in range(0, len(text), third))
    )
    assert parse_file(path).events.dev_name == [f"k{i}" for i in range(3000)]


def test_long_header(tmp_path: Path) -> None:
    """The traceEvents key after 8 MB of header (device properties) is found; a document
    without one is named as such, or as too large once its header passes the cap."""
    props = [{"id": i, "name": "NVIDIA H100", "pad": "p" * 1000} for i in range(8000)]
    head = json.dumps({"deviceProperties": props})[:-1].encode() + b", "
    text = kineto_text([kernel("gemm", 10, 5)]).replace(b"{\n", head, 1)
    path = tmp_path / "t.json"
    path.write_bytes(text)
    rt = parse_file(path)
    assert rt.events.dev_name == ["gemm"] and rt.rank == 0
    path.write_bytes(head[:-2] + b"}")
    with pytest.raises(TraceError, match="no traceEvents array"):
        parse_file(path)
    with pytest.raises(TraceError, match="before the traceEvents array"):
        parse_file(path, TraceConfig(max_event_bytes=1 << 20))


def test_a_job_of_empty_files_has_no_ranks(tmp_path: Path) -> None:
    """Loading a job whose files are all empty gives no ranks and one problem each."""
    d = tmp_path / "job"
    d.mkdir()
    for i in range(3):
        (d / f"rank{i}.json").write_bytes(kineto_text([], rank=i))
    results, problems = load_ranks(d, workers=1, progress=False)
    assert not results and len(problems) == 3
    assert all(p["reason"].startswith("empty rank") for p in problems)
