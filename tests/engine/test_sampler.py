"""The batched sampler's draws: seeded rows from the counter-based uniform, every row by
inverse CDF, checked against the distribution they sample."""

from __future__ import annotations

import math

import torch

from titan_rl.engine.sampling import SamplingParams, sample, seeded_uniform

#: chi-square critical values at p = 0.001 by degrees of freedom
CHI2_999 = {2: 13.82, 5: 20.52}


def _uniform(u: torch.Tensor) -> bool:
    """Kolmogorov-Smirnov against U(0, 1), accepted at p = 0.001 (D < 1.95 / sqrt(n))."""
    x, _ = u.sort()
    n = len(x)
    grid = torch.arange(1, n + 1, dtype=torch.float64) / n
    d = torch.maximum(grid - x, x - (grid - 1 / n)).max()
    return float(d) < 1.95 / math.sqrt(n)


def _fits(counts: torch.Tensor, probs: torch.Tensor) -> bool:
    """Pearson's chi-square of ``counts`` against ``probs``, accepted at p = 0.001."""
    want = probs.double() * counts.sum()
    chi2 = float(((counts.double() - want) ** 2 / want).sum())
    return chi2 < CHI2_999[len(counts) - 1]


def test_seeded_uniform_is_uniform_and_keyed_by_seed_and_step() -> None:
    seeds = torch.arange(20_000, dtype=torch.long) * 7919 + 2**40
    steps = torch.arange(20_000, dtype=torch.long) % 97
    u = seeded_uniform(seeds, steps)
    assert u.dtype == torch.float64 and bool(((u >= 0) & (u < 1)).all())
    assert _uniform(u)
    # a pure function of (seed, step): the same pair again, alone, gives the same draw
    again = seeded_uniform(seeds[[5, 17]], steps[[5, 17]])
    assert torch.equal(again, u[[5, 17]])
    # consecutive steps of one seed, and neighbouring seeds at one step, are uncorrelated
    one_seed = seeded_uniform(torch.full((5000,), 42), torch.arange(5000))
    assert abs(float(torch.corrcoef(torch.stack([one_seed[:-1], one_seed[1:]]))[0, 1])) < 0.05
    assert _uniform(one_seed)
    near = seeded_uniform(torch.arange(5000) + 1, torch.zeros(5000, dtype=torch.long))
    assert _uniform(near)
    # the largest seed a request may carry (2**63 - 1) is accepted
    big = seeded_uniform(torch.tensor([2**63 - 1]), torch.tensor([3]))
    assert 0 <= float(big) < 1


def _draws(logits: torch.Tensor, params: SamplingParams, seeded: bool, n: int) -> torch.Tensor:
    rows = logits.expand(n, -1)
    seeds = list(range(1000, 1000 + n)) if seeded else [None] * n
    tokens, _ = sample(rows, [params] * n, seeds, [3] * n, torch.Generator().manual_seed(0))
    return tokens


def test_draws_follow_the_tempered_filtered_distribution() -> None:
    logits = torch.log(torch.tensor([0.4, 0.25, 0.15, 0.1, 0.06, 0.04]))
    n = 40_000
    for seeded in (True, False):
        params = SamplingParams(temperature=0.7)
        want = torch.softmax(logits / 0.7, dim=-1)
        counts = torch.bincount(_draws(logits, params, seeded, n), minlength=6)
        assert _fits(counts, want)
        # top-k 3: the others are never drawn, the three kept renormalised
        counts = torch.bincount(_draws(logits, SamplingParams(top_k=3), seeded, n), minlength=6)
        assert counts[3:].sum() == 0
        want = torch.tensor([0.4, 0.25, 0.15]) / 0.8
        assert _fits(counts[:3], want)


def test_greedy_and_sampled_rows_share_a_batch() -> None:
    logits = torch.tensor([[0.0, 3.0, 1.0], [5.0, 0.0, 0.0], [0.0, 0.0, 9.0]])
    params = [SamplingParams(temperature=0.0), SamplingParams(), SamplingParams(top_k=1)]
    tokens, logprobs = sample(logits, params, [None, 7, 8], [0, 0, 0], torch.Generator())
    assert tokens[0] == 1 and tokens[2] == 2  # greedy, and the only token top-k 1 keeps
    assert torch.allclose(logprobs, torch.log_softmax(logits, dim=-1))


def test_an_engines_batch_sampler_draws_what_a_fresh_sample_draws() -> None:
    """The engine's sampler keeps a batch's per-row settings while its rows come back; step
    by step, as rows leave and join, it draws exactly what :func:`sample` draws."""
    from titan_rl.engine.sampling import BatchSampler

    kinds = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.8, top_k=5),
        SamplingParams(temperature=1.2, top_p=0.7),
        SamplingParams(temperature=1.0, min_p=0.1),
        SamplingParams(temperature=1.0),
    ]
    params = [kinds[i % len(kinds)] for i in range(12)]
    seeds = [None if i % 3 == 0 else 1000 + i for i in range(12)]
    cached = BatchSampler(torch.Generator().manual_seed(5))
    fresh = torch.Generator().manual_seed(5)
    rows = list(range(12))
    logits_gen = torch.Generator().manual_seed(1)
    for step in range(8):
        if step == 3:
            rows = rows[2:]  # rows finished
        if step == 6:
            rows = [*rows, 0]  # a row joined
        logits = torch.randn(len(rows), 40, generator=logits_gen) * 3
        p, s, k = [params[r] for r in rows], [seeds[r] for r in rows], [step] * len(rows)
        got_ids, got_lp = cached.sample(logits, p, s, k)
        ref_ids, ref_lp = sample(logits, p, s, k, fresh)
        assert torch.equal(got_ids, ref_ids)
        assert torch.equal(got_lp, ref_lp)
