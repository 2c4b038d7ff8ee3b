"""clock_offsets on hand-built comm ops: collectives, P2P links, their mix and outliers."""

from __future__ import annotations

import random

import pytest

from titan_core.trace.breakdown import RankResult
from titan_core.trace.clock import _solve, clock_offsets, low_quantile
from titan_core.trace.comm import CommOp
from titan_core.trace.matching import op_keys, participants


def _rank(rank: int, ops: list[CommOp]) -> RankResult:
    ops.sort(key=lambda o: o.ts)
    return RankResult(rank, "", {}, "gpu", {}, {}, [], [], ops, ([], []), 0)


class _Job:
    """Comm ops written on the true clock, stored on each rank's skewed clock."""

    def __init__(self, skew: dict[int, float]) -> None:
        self.skew = skew
        self.ops: dict[int, list[CommOp]] = {r: [] for r in skew}

    def coll(self, ranks: list[int], starts: list[float], end: float) -> None:
        for r, s in zip(ranks, starts, strict=True):
            o = self.skew[r]
            self.ops[r].append(
                CommOp(round(s + o), round(end + o), "allreduce", pg=str(ranks), step=0)
            )

    def p2p(self, src: int, dst: int, t_send: float, t_recv: float, dur: float) -> None:
        """A send issued at ``t_send``, its receive at ``t_recv``; the data moves from the
        later of the two, for ``dur``; the send does not wait for the receiver."""
        done = max(t_send, t_recv) + dur
        a, b = self.skew[src], self.skew[dst]
        self.ops[src].append(
            CommOp(round(t_send + a), round(t_send + dur + a), "send", p2p=[("send", dst)], step=0)
        )
        self.ops[dst].append(
            CommOp(round(t_recv + b), round(done + b), "recv", p2p=[("recv", src)], step=0)
        )

    def offsets(self) -> dict[int, float]:
        results = [_rank(r, ops) for r, ops in self.ops.items()]
        return clock_offsets(results, participants(op_keys(results)))

    def want(self) -> dict[int, float]:
        return {r: s - self.skew[min(self.skew)] for r, s in self.skew.items()}


def _skews(n: int, seed: int) -> dict[int, float]:
    rng = random.Random(seed)
    return {r: float(rng.randint(-5000, 5000)) for r in range(n)}


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_overlapping_collective_groups(seed: int) -> None:
    """TP groups {0,1},{2,3} and DP groups {0,2},{1,3}: every rank in two groups."""
    job = _Job(_skews(4, seed))
    rng = random.Random(seed)
    t = 0.0
    for _ in range(6):
        for g in ([0, 1], [2, 3], [0, 2], [1, 3]):
            starts = [t + rng.uniform(0, 300) for _ in g]
            job.coll(g, starts, max(starts) + 100)
            t += 1000
    got = job.offsets()
    for r, v in job.want().items():
        assert got[r] == pytest.approx(v, abs=1.0)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_p2p_links_collective_sets(seed: int) -> None:
    """Two stages of two DP ranks: all-reduces within a stage, sends both ways between."""
    job = _Job(_skews(4, seed))
    rng = random.Random(seed)
    t = 0.0
    for _ in range(20):
        for a, b in ((0, 2), (1, 3)):
            # forward: stage 0 sends, stage 1 is sometimes waiting, sometimes late
            job.p2p(a, b, t, t + rng.uniform(-200, 200), 20)
            job.p2p(b, a, t + 500, t + 500 + rng.uniform(-200, 200), 20)
        t += 1000
    for g in ([0, 1], [2, 3]):
        starts = [t + rng.uniform(0, 300) for _ in g]
        job.coll(g, starts, max(starts) + 100)
    got = job.offsets()
    for r, v in job.want().items():
        assert got[r] == pytest.approx(v, abs=1.0)


def test_one_direction_only() -> None:
    """Forward-only traffic: the receive is taken to end when its send does."""
    job = _Job({0: 0.0, 1: 2500.0, 2: -1800.0})
    rng = random.Random(3)
    for i in range(30):
        t = 1000.0 * i
        job.p2p(0, 1, t, t + rng.uniform(-100, 100), 20)
        job.p2p(1, 2, t + 300, t + 300 + rng.uniform(-100, 100), 20)
    got = job.offsets()
    for r, v in job.want().items():
        assert got[r] == pytest.approx(v, abs=1.0)


def test_cycle_of_links_is_least_squares() -> None:
    """Three P2P-only ranks in a ring (interleaved schedules wrap around): with consistent
    links the solution is exact whichever link the spanning tree leaves out."""
    job = _Job({0: 0.0, 1: 3000.0, 2: -4000.0})
    rng = random.Random(4)
    for i in range(20):
        t = 1000.0 * i
        for k, (a, b) in enumerate(((0, 1), (1, 2), (2, 0))):
            job.p2p(a, b, t + 100 * k, t + 100 * k + rng.uniform(-80, 80), 20)
            job.p2p(b, a, t + 500 + 100 * k, t + 500 + 100 * k + rng.uniform(-80, 80), 20)
    got = job.offsets()
    for r, v in job.want().items():
        assert got[r] == pytest.approx(v, abs=1.0)


def test_mismatched_pairs_do_not_move_the_bound() -> None:
    """A few pairs matched to the wrong transfer (a receive that seems to end long before
    its send started) stay below the low quantile."""
    job = _Job({0: 0.0, 1: 2000.0})
    rng = random.Random(5)
    for i in range(40):
        t = 1000.0 * i
        job.p2p(0, 1, t, t + rng.uniform(-100, 100), 20)
        job.p2p(1, 0, t + 500, t + 500 + rng.uniform(-100, 100), 20)
    # one receive on rank 1 that is a kilosecond early: its pair's bound is far too low
    bad = next(o for o in job.ops[1] if o.p2p == [("recv", 0)])
    bad.end -= 900
    bad.ts -= 900
    got = job.offsets()
    assert got[1] == pytest.approx(2000.0, abs=1.0)


def test_unlinked_groups_each_start_at_their_lowest_rank() -> None:
    job = _Job({0: 0.0, 1: 700.0, 2: 50.0, 3: 950.0})
    for i in range(3):
        job.coll([0, 1], [100.0 * i, 100.0 * i + 5], 100.0 * i + 50)
        job.coll([2, 3], [100.0 * i, 100.0 * i + 5], 100.0 * i + 50)
    got = job.offsets()
    assert got == pytest.approx({0: 0.0, 1: 700.0, 2: 0.0, 3: 900.0}, abs=1.0)


def test_low_quantile() -> None:
    assert low_quantile([5.0, 3.0, 9.0]) == 3.0  # small samples: the minimum
    v = [float(x) for x in range(100)]
    random.Random(0).shuffle(v)
    assert low_quantile(v) == 5.0
    assert low_quantile(v, 0.0) == 0.0


def test_groupless_collectives_matched_within_a_stage() -> None:
    """All-reduces naming no group (older gloo traces) are joined per pipeline stage
    only; named groups are matched as they are."""
    ops = {
        r: [
            CommOp(0, 10, "allreduce", pg="allreduce/0", step=0),
            CommOp(20, 30, "allreduce", pg="[0, 1, 2, 3]", pg_ranks=[0, 1, 2, 3], step=0),
        ]
        for r in range(4)
    }
    results = [_rank(r, o) for r, o in ops.items()]
    groups = [[0, 2], [1, 3]]  # stage 0: ranks 0, 1; stage 1: ranks 2, 3
    parts = participants(op_keys(results, groups))
    members = sorted(sorted(r for r, _ in m) for m in parts.values())
    assert members == [[0, 1], [0, 1, 2, 3], [2, 3]]
    # without the pipeline groups, the group-less one joins all four
    parts = participants(op_keys(results))
    assert sorted(sorted(r for r, _ in m) for m in parts.values()) == [[0, 1, 2, 3]] * 2


def test_inconsistent_cycle_spreads_the_misfit() -> None:
    """Links 0->1 = 10, 1->2 = 10, 0->2 = 23 (equal weights): least squares puts 1 at 11
    and 2 at 22, each link off by 1; the lowest set is the anchor."""
    shift, anchor = _solve(
        [0, 1, 2, 5], {(0, 1): (10.0, 1.0), (1, 2): (10.0, 1.0), (0, 2): (23.0, 1.0)}
    )
    assert shift[0] == 0.0 and shift[5] == 0.0
    assert shift[1] == pytest.approx(11.0, abs=0.05)
    assert shift[2] == pytest.approx(22.0, abs=0.05)
    assert anchor == {0: 0, 1: 0, 2: 0, 5: 5}
