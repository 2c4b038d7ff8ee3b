"""Trainer layouts of ``bench/weight_sync.py --trainer-layout``: the parser, the issue's goals
for the share of the model one trainer rank sends, and the printed table.

A layout is ``key=value`` pairs joined by commas, keys ``tp``, ``pp``, ``ep`` and ``vpp``
(e.g. ``pp=2``, ``tp=2``, ``pp=2,ep=2``, ``pp=2,vpp=2``). Its world is ``tp * pp * ep``
(data parallel = ``ep``, the expert ranks' size, so each EP rank owns distinct experts).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

#: the issue's goals for max bytes sent by one trainer rank / model bytes, by (tp, pp, ep)
GOALS: dict[tuple[int, int, int], float] = {(1, 2, 1): 0.55, (1, 2, 2): 0.35}
#: largest |engine - trainer| logprob difference after a sync that counts as parity (fp32)
PARITY_MAX = 1e-4
KEYS = ("tp", "pp", "ep", "vpp")


@dataclass(frozen=True)
class Layout:
    tp: int = 1
    pp: int = 1
    ep: int = 1
    #: virtual pipeline chunks per stage (None: no interleaving)
    vpp: int | None = None

    @property
    def world(self) -> int:
        """Trainer ranks: one per (TP, PP, DP) coordinate, with DP = EP."""
        return self.tp * self.pp * self.ep

    @property
    def moe(self) -> bool:
        """Expert parallel layouts need an MoE model."""
        return self.ep > 1

    @property
    def goal(self) -> float | None:
        return GOALS.get((self.tp, self.pp, self.ep))

    def __str__(self) -> str:
        parts = [f"{k}={getattr(self, k)}" for k in KEYS if getattr(self, k) not in (1, None)]
        return ",".join(parts) or "tp=1"


def parse_layout(text: str) -> Layout:
    """``"pp=2,ep=2"`` -> ``Layout(pp=2, ep=2)``; ValueError naming the bad part."""
    values: dict[str, int] = {}
    for part in text.split(","):
        key, sep, value = part.strip().partition("=")
        key = key.strip().lower()
        if not sep or key not in KEYS:
            raise ValueError(
                f"trainer layout {text!r}: {part.strip()!r} is not one of "
                f"{', '.join(k + '=N' for k in KEYS)} (join several with commas: pp=2,ep=2)"
            )
        if key in values:
            raise ValueError(f"trainer layout {text!r}: {key} is given twice")
        try:
            n = int(value)
        except ValueError:
            raise ValueError(
                f"trainer layout {text!r}: {key}={value!r} is not an integer"
            ) from None
        if n < 1:
            raise ValueError(f"trainer layout {text!r}: {key}={n} must be at least 1")
        values[key] = n
    if values.get("vpp", 1) > 1 and values.get("pp", 1) < 2:
        raise ValueError(f"trainer layout {text!r}: vpp needs pp of at least 2")
    return Layout(**values)


def check_fits(layout: Layout, layers: int, heads: int, kv_heads: int, experts: int) -> None:
    """ValueError saying what to change when the model cannot be split at ``layout``."""
    chunks = layout.pp * (layout.vpp or 1)
    if layers % chunks:
        raise ValueError(f"layout {layout}: {layers} layers do not split into {chunks} chunks")
    if heads % layout.tp or kv_heads % layout.tp:
        raise ValueError(f"layout {layout}: {heads}/{kv_heads} heads do not split over tp")
    if layout.moe and experts % layout.ep:
        raise ValueError(f"layout {layout}: {experts} experts do not split over ep")


def verdict(ratio: float, goal: float | None) -> str:
    if goal is None:
        return "(no goal)"
    return f"<= {goal:.2f} {'met' if ratio <= goal else 'NOT met'}"


def table(rows: list[dict[str, Any]]) -> list[str]:
    """The printed lines: one per layout x transport. A row holds ``layout`` (Layout),
    ``model`` (its name), ``transport``, ``model_bytes`` (the checkpoint's, the anchor) and
    the worker's ``metrics`` (trainer rank 0's), ``rank_bytes`` (what each rank sent) and
    ``before`` (the parity check's max |diff| before the first sync)."""
    head = (
        f"{'layout':<10} {'model':<26} {'transport':<13} {'max rank / model':>16}  "
        f"{'goal':<14} {'sync s':>7} {'transfer s':>10}  {'parity before -> after':<26} senders"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        m, layout = r["metrics"], r["layout"]
        ratio = m["sync/bytes_max_rank"] / r["model_bytes"]
        parity = m.get("sync/logprob_abs_diff_max", float("nan"))
        ok = "ok" if parity < PARITY_MAX else "NOT ok"
        before = r.get("before", float("nan"))
        lines.append(
            f"{str(layout):<10} {r['model']:<26} {r['transport']:<13} {ratio:>16.3f}  "
            f"{verdict(ratio, layout.goal):<14} {m['sync/time_s']:>7.2f} "
            f"{m['sync/transfer_s']:>10.2f}  {f'{before:.1e} -> {parity:.1e} {ok}':<26} "
            f"{int(m['sync/senders'])}"
        )
    return lines
