"""Bad files are reported by name and the rest analyzed; ROCm and CPU-only traces parse."""

import gzip
import json
import shutil
from pathlib import Path

import msgspec
import pytest

from titan_core.trace.analyze import build_summary, load_ranks
from titan_core.trace.cli import main
from titan_core.trace.parse import Events, parse_file


def test_bad_files_reported_rest_analyzed(traces: Path, tmp_path: Path) -> None:
    d = tmp_path / "job"
    d.mkdir()
    shutil.copy(traces / "trace_filter/sampled_rank-0.json.gz", d / "rank0.json.gz")
    shutil.copy(traces / "trace_filter/sampled_rank-1.json.gz", d / "rank1.json.gz")
    raw = gzip.decompress((traces / "trace_filter/sampled_rank-1.json.gz").read_bytes())
    (d / "truncated.json.gz").write_bytes(gzip.compress(raw[: len(raw) // 2]))
    (d / "cut_gzip.json.gz").write_bytes((d / "rank1.json.gz").read_bytes()[:5000])
    (d / "garbage.json").write_text("{not json")
    shutil.copy(traces / "rank_unavailable/rank_not_found.json.gz", d / "norank.json.gz")
    results, problems = load_ranks(d, workers=2, progress=False)
    assert sorted(r.rank for r in results) == [0, 1]
    bad = {Path(p["file"]).name: p["reason"] for p in problems}
    assert set(bad) == {"truncated.json.gz", "cut_gzip.json.gz", "garbage.json", "norank.json.gz"}
    assert "no rank" in bad["norank.json.gz"]
    out = tmp_path / "report"
    assert (
        main(["analyze", str(d), "--out", str(out), "--no-cache", "--quiet", "--workers", "1"]) == 0
    )
    summary = json.loads((out / "summary.json").read_text())
    assert len(summary["problems"]) == 4
    assert (out / "report.html").read_text().count("<svg ") >= 3


def test_rocm_and_cpu_only_parse(traces: Path) -> None:
    amd = parse_file(next((traces / "amd_trace").glob("*.gz")))
    assert amd.meta["device"] == "rocm" and amd.events.height > 0
    cpu = parse_file(next((traces / "cpu_only").glob("*.gz")))
    assert cpu.rank == 34 and cpu.meta["device"] == "cpu"
    results, _ = load_ranks(traces / "cpu_only", workers=1, progress=False)
    s = build_summary(results, [])
    r = s["ranks"][0]
    assert r["compute_stream"] == "cpu"
    assert r["comm_ops"] == 10  # the gloo:all_reduce ranges
    assert r["steps"][0]["comm_total_us"] > 0


def test_single_rankless_file_is_rank_zero(traces: Path) -> None:
    results, problems = load_ranks(traces / "amd_trace", workers=1, progress=False)
    assert [r.rank for r in results] == [0] and not problems
    assert results[0].kernel_time_us["computation"] > 0


def test_parse_cache_roundtrip(traces: Path, tmp_path: Path) -> None:
    src = traces / "nccl_parser_config"
    a, _ = load_ranks(src, workers=1, progress=False, cache_dir=tmp_path)
    assert list(tmp_path.glob("*.msgpack"))
    b, _ = load_ranks(src, workers=1, progress=False, cache_dir=tmp_path)
    assert a[0].kernel_time_us == b[0].kernel_time_us
    assert len(a[0].comm_ops) == len(b[0].comm_ops) == 21


def test_packed_columns_roundtrip(traces: Path) -> None:
    """The columns a helper process or the parse cache packs come back equal, comm args
    included; repeated names and thread ids are one object each, on both sides."""
    ev = parse_file(next((traces / "nccl_parser_config").glob("*.gz"))).events
    assert any(x is not None for x in ev.dev_info) and any(x is None for x in ev.dev_info)
    back = Events.from_builtins(msgspec.msgpack.decode(msgspec.msgpack.encode(ev.to_builtins())))
    assert back.__dict__ == ev.__dict__
    for events in (ev, back):
        for col in (events.dev_name, events.launch_tid, events.host_name):
            assert len({id(x) for x in col}) == len(set(col)) < len(col)


def test_import_is_light() -> None:
    import subprocess
    import sys

    code = (
        "import sys, titan_core.trace.cli, titan_core.trace.analyze; "
        "print(*(m in sys.modules for m in ('torch', 'megatron', 'numpy', 'polars')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    # numpy and polars stay off the analysis path too (the report imports them itself)
    assert out.stdout.split() == ["False"] * 4


def test_worker_processes_match_inline(traces: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """One process, forked helpers (a small job on 2 cores) and the spawned process pool
    give the same per-rank results."""
    import titan_core.trace.analyze as analyze

    inline, _ = load_ranks(traces / "trace_filter", workers=1, progress=False)
    forked, _ = load_ranks(traces / "trace_filter", workers=2, progress=False)
    monkeypatch.setattr(analyze, "INLINE_BYTES_PER_WORKER", 0)  # force the process pool
    pooled, problems = load_ranks(traces / "trace_filter", workers=2, progress=False)
    assert not problems
    assert [r.rank for r in pooled] == [r.rank for r in forked] == [r.rank for r in inline]
    assert [r.rank for r in inline] == [0, 1]
    for a, b, c in zip(inline, forked, pooled, strict=True):
        assert a.kernel_time_us == b.kernel_time_us == c.kernel_time_us
        assert a.steps == b.steps == c.steps
        assert a.comm_ops == b.comm_ops == c.comm_ops


@pytest.mark.slow
def test_ray_tasks_match_inline(traces: Path) -> None:
    """``--ray`` (files as Ray tasks, for jobs spread over nodes) on a local Ray gives the
    per-rank results one process gives."""
    ray = pytest.importorskip("ray")
    inline, _ = load_ranks(traces / "trace_filter", workers=1, progress=False)
    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        spread, problems = load_ranks(traces / "trace_filter", progress=False, use_ray=True)
    finally:
        if started:
            ray.shutdown()
    assert not problems and [r.rank for r in spread] == [0, 1]
    assert spread == inline


@pytest.mark.parametrize("parts", [2, 3])
def test_split_parse_equals_one_process(
    traces: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, parts: int
) -> None:
    """Decoding a file over several forked processes gives the same columns, in file order."""
    import titan_core.trace.parse as parse

    monkeypatch.setattr(parse, "SPLIT_MIN_TEXT_BYTES", 0)
    src = next((traces / "nccl_parser_config").glob("*.gz"))
    one = parse_file(src, parts=1)
    split = parse_file(src, parts=parts)
    assert split.events.__dict__ == one.events.__dict__
    assert split.rank == one.rank and split.meta == one.meta
    # a file cut short is still named by whichever process reads its end
    raw = gzip.decompress(src.read_bytes())
    cut = tmp_path / "cut.json.gz"
    cut.write_bytes(gzip.compress(raw[: len(raw) * 3 // 4]))
    with pytest.raises(parse.TraceError, match="truncated|never ends"):
        parse_file(cut, parts=parts)


@pytest.mark.parametrize("parts", [1, 2])
def test_runs_without_complete_events_change_nothing(
    traces: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, parts: int
) -> None:
    """Long runs of memory (instant) events, which the parser skips undecoded, leave the
    parsed columns exactly as they are without them."""
    import titan_core.trace.parse as parse
    from titan_core.trace.sorter import Sorter

    monkeypatch.setattr(parse, "SPLIT_MIN_TEXT_BYTES", 0)
    src = next((traces / "nccl_parser_config").glob("*.gz"))
    raw = gzip.decompress(src.read_bytes())
    sep = b"\n  },\n  {"
    memory = (
        b'\n    "ph": "i", "cat": "cpu_instant_event", "s": "t", "name": "[memory]",'
        b'\n    "pid": 7, "tid": 7,\n    "ts": 1000,\n    "args": {\n      "Ev Idx": 3, '
        b'"Device Type": 1, "Bytes": 512, "Total Allocated": 1024\n    }'
    )
    run = sep + sep.join([memory] * 4000) + sep
    # two runs of ~1 MB each: after the first event and in the middle of the file
    cut = raw.index(sep, len(raw) // 2)
    first = raw.index(sep)
    padded = raw[:first] + run + raw[first + len(sep) : cut] + run + raw[cut + len(sep) :]
    (tmp_path / "padded.json.gz").write_bytes(gzip.compress(padded))
    decoded = []  # pieces handed to the sorter (in this process)
    add = Sorter.add
    monkeypatch.setattr(Sorter, "add", lambda s, *a: decoded.append(1) or add(s, *a))
    plain = parse_file(src, parts=parts)
    n_plain = len(decoded)
    with_runs = parse_file(tmp_path / "padded.json.gz", parts=parts)
    assert with_runs.events.__dict__ == plain.events.__dict__
    assert len(with_runs.events.dev_ts) > 0
    if parts == 1:  # the runs (~27 pieces of text) were mostly not decoded
        assert len(decoded) - 2 * n_plain < 10


def test_device_stream_mirrors_of_steps_are_not_more_steps(traces: Path, tmp_path: Path) -> None:
    """The ROCm trace holds ``ProfilerStep#1`` twice: the host's range and its mirror on the
    device stream (``gpu_user_annotation``). Its one rank has one step 1, the host's, and no
    peer to be slow against."""
    out = tmp_path / "report"
    args = ["analyze", str(traces / "amd_trace"), "--out", str(out), "--no-cache", "--quiet"]
    assert main([*args, "--workers", "1"]) == 0
    summary = json.loads((out / "summary.json").read_text())
    (rank,) = summary["ranks"]
    events = json.loads(gzip.decompress(next((traces / "amd_trace").glob("*.gz")).read_bytes()))
    host = [
        e for e in events["traceEvents"]
        if e.get("name") == "ProfilerStep#1" and e.get("cat") == "user_annotation"
    ]  # fmt: skip
    assert len(host) == 1
    assert [s["step"] for s in rank["steps"]] == [1]
    # the step is the host's range (9.3 ms), not the device mirror's (1.0 ms)
    assert rank["steps"][0]["step_time_us"] > 0.9 * host[0]["dur"]
    assert summary["slow_ranks"] == []


def test_rl_phases_count_the_host_ranges_once(tmp_path: Path) -> None:
    """A ``titan/rl/<phase>`` range mirrored on the device stream counts once, the host's."""

    def ev(name: str, cat: str, ts: int, dur: int, pid: int, tid: int, **args: int) -> dict:
        return {"ph": "X", "cat": cat, "name": name, "pid": pid, "tid": tid, "ts": ts,
                "dur": dur, "args": args}  # fmt: skip

    events = [
        ev("ProfilerStep#1", "user_annotation", 1000, 5000, 1, 1),
        ev("titan/rl/train", "user_annotation", 1500, 3000, 1, 1),
        ev("cudaLaunchKernel", "cuda_runtime", 1600, 10, 1, 1, correlation=1),
        ev("gemm", "kernel", 1700, 2000, 0, 7, stream=7, correlation=1),
        ev("ProfilerStep#1", "gpu_user_annotation", 1700, 2000, 0, 7, stream=7),
        ev("titan/rl/train", "gpu_user_annotation", 1700, 2000, 0, 7, stream=7),
        ev("ProfilerStep#2", "user_annotation", 6000, 5000, 1, 1),
    ]
    d = tmp_path / "job"
    d.mkdir()
    (d / "rank0.json").write_text(json.dumps({"distributedInfo": {"rank": 0},
                                              "traceEvents": events}))  # fmt: skip
    results, problems = load_ranks(d, workers=1, progress=False)
    assert not problems
    steps = build_summary(results, problems)["ranks"][0]["steps"]
    assert steps[0]["step"] == 1
    assert steps[0]["rl_phases_us"] == {"train": 3000}


def test_a_rank_is_never_its_own_peer() -> None:
    """A step number one rank's trace holds twice is that rank's step, not a peer's: with
    no other rank at that step, nothing is slow."""
    from types import SimpleNamespace

    from titan_core.trace.stragglers import compute_outliers

    def rank(r: int, *steps: tuple[int, int]) -> SimpleNamespace:
        return SimpleNamespace(
            rank=r, steps=[SimpleNamespace(step=n, computation=c) for n, c in steps]
        )

    assert compute_outliers([rank(0, (1, 300), (1, 9000))], {}) == {}
    # with peers: the rank's two ranges of step 1 are one step of 9,300 us against 1,000s
    ranks = [rank(0, (1, 300), (1, 9000)), *(rank(r, (1, 1000 + r)) for r in (1, 2, 3))]
    out = compute_outliers(ranks, {})
    assert set(out) == {0} and out[0]["steps"] == 1
    assert out[0]["excess_us"] == 9300 - 1002


def test_critical_path_tells_compute_from_idle(traces: Path, tmp_path: Path) -> None:
    """The alexnet benchmark trace (one rank, no profiler steps): its 12.9 s are ~11 ms of
    kernels and host time between them. The critical path says so (compute as the step's
    own computation, within the 20 us gaps the path's coarse intervals close), not 12.9 s
    of compute."""
    out = tmp_path / "report"
    args = ["analyze", str(traces / "critical_path"), "--out", str(out), "--no-cache", "--quiet"]
    assert main([*args, "--workers", "1"]) == 0
    summary = json.loads((out / "summary.json").read_text())
    (step,) = summary["ranks"][0]["steps"]
    (cp,) = summary["critical_path"]["steps"]
    kinds = cp["critical_path"]["time_by_kind_us"]
    assert kinds["compute"] == pytest.approx(step["computation_us"], rel=0.05)
    assert kinds["compute"] + kinds["idle"] == pytest.approx(cp["critical_path"]["length_us"])
    assert kinds["idle"] > 0.99 * step["step_time_us"]


def test_the_printed_summary_says_steps_and_slow_ranks_in_words(
    traces: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "report"
    assert main(["analyze", str(traces / "trace_filter"), "--out", str(out), "--no-cache"]) == 0
    printed = capsys.readouterr().out
    summary = json.loads((out / "summary.json").read_text())
    for r in summary["ranks"]:
        mean = sum(x["step_time_us"] for x in r["steps"]) / len(r["steps"])
        assert f"rank {r['rank']:>5}: {len(r['steps'])} steps of {mean / 1e3:.1f} ms" in printed
    (slow,) = summary["slow_ranks"]
    ev = slow["evidence"]
    line = next(x for x in printed.splitlines() if x.startswith(f"  slow rank {slow['rank']}:"))
    assert (
        f"in {ev['compute_outlier_steps']} steps (+{ev['compute_excess_us'] / 1e3:.2f} ms" in line
    )
    assert "{" not in line
