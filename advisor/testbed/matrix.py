"""The layout matrix's verdicts: each advice against the best PyTorch setting within its budget, in
one run and pooled over runs.

One run's verdict on a row rests on that run's noise, the spread of its interleaved rounds.  The
same row measured again moves by more than that: the machine is shared, and a run's rounds all
fall within the same few minutes.  Over 32 rows a verdict at 95% also names a row or two by
chance alone.  So a row is called slower when runs *pooled* show it: its ratio is the geometric
mean over the runs that measured it, and its error is each run's own noise scaled by how much
more the rows moved between runs than their noise said (:func:`pool`).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from advisor.testbed.bench import MATCHED, PYTORCH, layout_of, pair_noise
from policies.evidence import Estimate

#: (budget, the advised setting's name, the row's advice key, its result key); the default
#: advice is held against the PyTorch settings within PowerSGD rank 4's error, the one held to
#: rank 1's budget against all of them
BUDGETS = (("default (r4)", "advisor plan", "advice", "result"),
           ("PowerSGD r1's", MATCHED, "matched_advice", "matched_result"))
#: the smallest noise a run's comparison is taken to have: a median absolute deviation of zero
#: (every round moved both settings alike) says the rounds agreed, not that the run was exact
NOISE_FLOOR = 0.005


@dataclass(frozen=True)
class Comparison:
    """One advice against the fastest PyTorch setting within its budget (chosen in hindsight), in one run."""

    ranks: int
    rate: str
    model: str
    budget: str
    #: the advised setting's name in the row's timings
    setting: str
    advice: str
    layout: str
    best: str
    best_s: float
    advisor_s: float
    floor_s: float
    #: the row's noise (its median setting's spread over rounds) and this pair's own (per-round ratios)
    noise: float
    pair: float

    @property
    def ratio(self) -> float:
        """The advice's step time over the best PyTorch setting's (above 1: the advice is slower)."""
        return self.advisor_s / self.best_s

    @property
    def key(self) -> tuple[int, str, str, str]:
        return self.ranks, self.rate, self.model, self.budget

    @property
    def name(self) -> str:
        return f"{self.model} x{self.ranks} @ {self.rate} ({self.budget})"

    @property
    def _pair(self) -> float:
        """The pair's noise, 0 where one round gave no spread to measure."""
        return self.pair if math.isfinite(self.pair) else 0.0

    @property
    def run_noise(self) -> float:
        """The noise a single run's verdict on this comparison rests on: the larger of the two."""
        return max(self.noise, self._pair, NOISE_FLOOR)

    @property
    def slower(self) -> bool:
        """One run's verdict: slower beyond both the row's noise and the pair's."""
        return self.ratio > 1 + self.noise and self.ratio > 1 + self._pair


def comparisons(rows: Sequence[Mapping[str, Any]]) -> list[Comparison]:
    """Every advice of one run's rows (``advisor.testbed.bench.run_benchmark``'s) against its best PyTorch setting."""
    out = []
    for row in rows:
        t = row["times_s"]
        for budget, setting, advice_key, result_key in BUDGETS:
            if setting not in t:
                continue
            within = [s for s in PYTORCH if budget.startswith("PowerSGD") or "r1" not in s]
            best = min(within, key=lambda s: t[s])
            out.append(Comparison(
                ranks=int(row["ranks"]), rate=str(row["rate"]), model=str(row["model"]), budget=budget,
                setting=setting, advice=str(row.get(advice_key)), layout=layout_of(row.get(result_key) or {}), best=best,
                best_s=t[best], advisor_s=t[setting], floor_s=t["compute only"], noise=float(row["noise"]),
                pair=pair_noise(row["rounds_s"], setting, best)))
    return out


@dataclass(frozen=True)
class PooledComparison:
    """One comparison over the runs that measured it: their ratios and the pooled estimate."""

    key: tuple[int, str, str, str]
    name: str
    ratios: tuple[float, ...]
    #: the geometric mean ratio, with the standard error of its logarithm and its degrees of freedom
    estimate: Estimate

    @property
    def low(self) -> float:
        return self.estimate.lower(0.975)

    @property
    def high(self) -> float:
        return self.estimate.upper(0.975)

    @property
    def slower(self) -> bool:
        """Slower than the best PyTorch setting beyond the pooled noise: the 95% interval lies above 1."""
        return self.low > 1


@dataclass(frozen=True)
class PooledMatrix:
    rows: list[PooledComparison]
    #: how much more a row's log ratio moved between runs than its runs' own noise said
    #: (1: as much as it said), and the degrees of freedom that was measured with
    spread_factor: float
    dof: int
    #: each run's median row, as a speed-up of the advice over the best PyTorch setting
    run_medians: list[float]

    @property
    def median_speedup(self) -> float:
        """The median row over the pooled ratios, as a speed-up."""
        return 1 / statistics.median(r.estimate.value for r in self.rows)

    def median_estimate(self) -> Estimate | None:
        """The median row's speed-up over runs (geometric mean of each run's), with its t interval (None: one run)."""
        if len(self.run_medians) < 2:
            return None
        logs = [math.log(m) for m in self.run_medians]
        se = statistics.stdev(logs) / math.sqrt(len(logs))
        return Estimate(math.exp(statistics.fmean(logs)), se, len(logs) - 1)

    @property
    def expected_by_chance(self) -> float:
        """How many rows a one-sided 2.5% test names slower where none is."""
        return 0.025 * len(self.rows)


def pool(runs: Sequence[Sequence[Comparison]]) -> PooledMatrix:
    """The comparisons of several runs (each :func:`comparisons`'), pooled per row.

    A row's ratio is the geometric mean of its runs'.  Its error: each run's noise
    (:attr:`Comparison.run_noise`, a median absolute deviation, taken as a standard error of the
    log ratio) scaled by a factor measured over every row with two runs or more: the root mean
    square of each run's deviation from its row's mean, in units of that run's noise.  Rows
    differ in how noisy they are (an LSTM's rounds swing more than an MLP's), so the spread is
    pooled in units of each row's own noise rather than as one number for all.
    """
    if not runs:
        raise ValueError("pooling needs at least one run's comparisons")
    by_key: dict[tuple, list[Comparison]] = {}
    for run in runs:
        for c in run:
            by_key.setdefault(c.key, []).append(c)
    squares, dof = 0.0, 0
    for measured in by_key.values():
        if len(measured) < 2:
            continue
        logs = [math.log(c.ratio) for c in measured]
        mean = statistics.fmean(logs)
        squares += sum(((x - mean) / math.log1p(c.run_noise)) ** 2 for x, c in zip(logs, measured))
        dof += len(measured) - 1
    factor = math.sqrt(squares / dof) if dof else 1.0
    rows = []
    for key, measured in by_key.items():
        logs = [math.log(c.ratio) for c in measured]
        noise = math.sqrt(statistics.fmean(math.log1p(c.run_noise) ** 2 for c in measured))
        estimate = Estimate(math.exp(statistics.fmean(logs)), factor * noise / math.sqrt(len(measured)),
                            dof if dof else math.inf)
        rows.append(PooledComparison(key, measured[0].name, tuple(c.ratio for c in measured), estimate))
    medians = [1 / statistics.median(c.ratio for c in run) for run in runs if run]
    return PooledMatrix(rows, factor, dof, medians)
