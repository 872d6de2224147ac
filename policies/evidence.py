"""Evidence for "faster to the same accuracy": how sure a paired trial and a few timed rounds can be.

A plan is worth installing when it reaches fp32's accuracy sooner than the best baseline.
That time-to-accuracy speed-up is the product of two measured numbers, each with an error:

* the **step speed-up** ``v``: a baseline's step time over the plan's, from interleaved
  rounds (:func:`paired_speedup`: rounds are paired, so drift that hits one round hits every
  plan in it alike);
* the **step efficiency** ``e``: how many fp32 steps one step of the plan is worth, read
  from fp32's own held-out curve in the paired accuracy trial (:func:`step_efficiency`).

Both errors are carried as standard errors of the logarithm, so the time-to-accuracy
speed-up ``v·e`` has a one-sided lower bound (:class:`Estimate`), and a lossy plan is
installed only when that bound beats the best baseline.

How sure the trial is comes from its own noise (:func:`trial_noise`): two fp32 arms that
differ only in batch order.  Their relative difference over the late window has two parts:
an offset that persists across checkpoints (one sample of the run-to-run spread: counted
in full) and a fluctuation that averages down over the effectively independent checkpoints
(lag-1 autocorrelation, biased up for short series).  The standard error of a plan's mean
gap is at most theirs (the plan shares fp32's batch order, the noise arm does not).  A
paired comparison detects a gap ``delta`` with 80% power at 5% two-sided when
``delta >= 2.8 * se`` (:data:`POWER_Z`), so a trial *could have shown* a gap of the
tolerance only when its :attr:`TrialNoise.detectable` gap is below the tolerance.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from scipy import stats

#: z(0.975) + z(0.8): the smallest gap a paired comparison detects at 5% two-sided with 80% power,
#: in standard errors (about 8 (sigma / delta)^2 observations, as the background's rule says)
POWER_Z = 1.96 + 0.84
#: one-sided confidence of every lower or upper bound reported here
CONFIDENCE = 0.95
#: the largest lag-1 autocorrelation believed (beyond it a series holds about one observation)
_MAX_RHO = 0.95


def one_sided_z(confidence: float = CONFIDENCE) -> float:
    return float(stats.norm.ppf(confidence))


def late_window(steps: Sequence[int]) -> list[int]:
    """Indices of the checkpoints past half of the last one (at least the last two, or one)."""
    if not steps:
        raise ValueError("a trial curve needs at least one checkpoint")
    half = steps[-1] / 2
    late = [i for i, s in enumerate(steps) if s > half]
    return late if len(late) >= 2 else list(range(max(0, len(steps) - 2), len(steps)))


def signed_relative(values: Sequence[float], reference: Sequence[float], higher_is_better: bool) -> list[float]:
    """Per checkpoint, how much worse ``values`` is than ``reference``, relative to it (positive: worse)."""
    if len(values) != len(reference):
        raise ValueError(f"curves of different lengths: {len(values)} vs {len(reference)} checkpoints")
    sign = -1.0 if higher_is_better else 1.0
    return [sign * (v - r) / max(abs(r), 1e-12) for v, r in zip(values, reference)]


# --- an estimate with its error ------------------------------------------------------------------
@dataclass
class Estimate:
    """A positive ratio (a speed-up, an efficiency) with the standard error of its logarithm.

    ``dof``: the degrees of freedom of that error (``inf`` for a normal one); the bounds
    use Student's t with them.
    """

    value: float
    se_log: float
    dof: float = math.inf

    def _quantile(self, confidence: float) -> float:
        return float(stats.t.ppf(confidence, self.dof)) if math.isfinite(self.dof) else one_sided_z(confidence)

    def lower(self, confidence: float = CONFIDENCE) -> float:
        return self.value * math.exp(-self._quantile(confidence) * self.se_log)

    def upper(self, confidence: float = CONFIDENCE) -> float:
        return self.value * math.exp(self._quantile(confidence) * self.se_log)

    @property
    def noise(self) -> float:
        """The relative half-width of the two-sided interval at :data:`CONFIDENCE` (for reports)."""
        return math.exp(self._quantile(1 - (1 - CONFIDENCE) / 2) * self.se_log) - 1

    def times(self, other: Estimate) -> Estimate:
        """The product of two independent estimates (errors add in quadrature, on the log scale).

        The product's degrees of freedom follow Welch-Satterthwaite.
        """
        se = math.hypot(self.se_log, other.se_log)
        terms = [(s, d) for s, d in ((self.se_log, self.dof), (other.se_log, other.dof)) if s > 0]
        if se == 0 or all(not math.isfinite(d) for _, d in terms):
            dof = math.inf
        else:
            dof = se ** 4 / sum(s ** 4 / d for s, d in terms if math.isfinite(d))
        return Estimate(self.value * other.value, se, dof)

    def describe(self, unit: str = "x") -> str:
        return f"{self.value:.2f}{unit} ({self.lower():.2f}-{self.upper():.2f})"


# --- speed: interleaved rounds -------------------------------------------------------------------
def paired_speedup(baseline_rounds: Sequence[float], plan_rounds: Sequence[float]) -> Estimate:
    """The baseline's step time over the plan's, from rounds measured side by side.

    Round ``i`` of both was measured in the same interleaved round, so their ratio cancels
    what drifted between rounds; the estimate is the geometric mean of the per-round
    ratios, its error their spread (Student's t, rounds - 1 degrees of freedom).  With one
    round the error is unknown (infinite).
    """
    if len(baseline_rounds) != len(plan_rounds) or not baseline_rounds:
        raise ValueError(f"paired rounds must match in number: {len(baseline_rounds)} vs {len(plan_rounds)}")
    if any(not (t > 0) for t in [*baseline_rounds, *plan_rounds]):
        raise ValueError("round times must be positive seconds")
    logs = [math.log(b / p) for b, p in zip(baseline_rounds, plan_rounds)]
    if len(logs) == 1:
        return Estimate(math.exp(logs[0]), math.inf, 1.0)
    return Estimate(math.exp(statistics.fmean(logs)), statistics.stdev(logs) / math.sqrt(len(logs)), len(logs) - 1)


def time_to_accuracy(step_speedup: Estimate, efficiency: Estimate) -> Estimate:
    """How many times sooner a plan reaches the same accuracy: its step speed-up times its step
    efficiency, the efficiency capped at 1 (a compressed gradient is not taken to learn faster
    than the exact one: an efficiency above 1 is luck in the trial)."""
    return step_speedup.times(Estimate(min(efficiency.value, 1.0), efficiency.se_log, efficiency.dof))


def independent_speedup(baseline_s: float, baseline_se: float, plan_s: float, plan_se: float) -> Estimate:
    """The baseline's step time over the plan's from two medians measured apart, each with
    its relative standard error (rounds that cannot be paired: their numbers differ)."""
    return Estimate(baseline_s / plan_s, math.hypot(baseline_se, plan_se))


def resolved(speedup: Estimate, margin: float = 0.0, worth: float = 0.03) -> bool:
    """Whether more rounds would not change the verdict on ``speedup``: its lower bound shows
    the plan faster than ``1 + margin``, or its upper bound shows it no faster than
    ``1 + max(margin, worth)``, a gain too small to be worth having."""
    return speedup.lower() > 1 + margin or speedup.upper() < 1 + max(margin, worth)


# --- accuracy: the paired trial --------------------------------------------------------------------
@dataclass
class TrialNoise:
    """How sure a paired trial is, from its two fp32 arms (see the module docstring).

    ``se``: standard error of a plan's mean relative gap over the late window; ``offset``
    and ``spread``: the fp32 arms' mean difference and the standard deviation around it;
    ``effective``: the late checkpoints' effective number of independent observations;
    ``checkpoints``: how many late checkpoints there were.
    """

    se: float
    offset: float
    spread: float
    effective: float
    checkpoints: int

    @property
    def detectable(self) -> float:
        """The smallest relative gap the trial detects with 80% power at 5% (two-sided)."""
        return POWER_Z * self.se

    def steps_to_detect(self, steps: int, tolerance: float) -> int:
        """About how many steps a trial needs before it detects a gap of ``tolerance``.

        The error is taken to fall as one over the square root of the trial's length (more
        late checkpoints, a flatter curve); a guide for the report, not a promise.
        """
        if self.detectable <= tolerance:
            return steps
        return int(math.ceil(steps * (self.detectable / tolerance) ** 2))


def trial_noise(steps: Sequence[int], first: Sequence[float], second: Sequence[float], higher_is_better: bool,
                floor: float = 0.0) -> TrialNoise:
    """The trial's noise from its two fp32 arms (``first`` is the reference); ``floor`` bounds
    the standard error from below (two arms can agree exactly, with one batch for example)."""
    late = late_window(steps)
    d = signed_relative([second[i] for i in late], [first[i] for i in late], higher_is_better)
    m = len(d)
    offset = statistics.fmean(d)
    if m < 2:
        return TrialNoise(max(abs(offset), floor), offset, 0.0, 1.0, m)
    resid = [x - offset for x in d]
    spread = statistics.stdev(d)
    power = sum(r * r for r in resid)
    rho = sum(a * b for a, b in zip(resid, resid[1:])) / power if power > 0 else 0.0
    # the lag-1 estimate is biased low by about (1 + 4 rho) / m on short series (Kendall)
    rho = min(max(rho + (1 + 4 * rho) / m, 0.0), _MAX_RHO)
    effective = max(1.0, m * (1 - rho) / (1 + rho))
    se = math.sqrt(offset ** 2 + spread ** 2 / effective)
    return TrialNoise(max(se, floor), offset, spread, effective, m)


def mean_gap(steps: Sequence[int], values: Sequence[float], reference: Sequence[float],
             higher_is_better: bool) -> float:
    """Mean signed relative difference over the late window; ``inf`` if any value there is not finite."""
    late = late_window(steps)
    picked = [values[i] for i in late]
    if not all(math.isfinite(v) for v in picked):
        return math.inf
    return statistics.fmean(signed_relative(picked, [reference[i] for i in late], higher_is_better))


def elasticity(steps: Sequence[int], values: Sequence[float], higher_is_better: bool) -> tuple[float, float]:
    """How fast the curve still improves late: ``(kappa, se)`` where a relative change of the
    metric of ``kappa`` is worth a factor ``e`` more steps.

    Fitted over the late window as ``value = a + b ln(step)``: ``kappa = -b / |mean value|``
    (``+b`` where higher is better).  A plan ``g`` behind (relative) is then worth
    ``exp(-g / kappa)`` fp32 steps per step.  ``kappa <= 0``: the curve no longer improves.
    """
    late = [i for i in late_window(steps) if steps[i] > 0]
    if len(late) < 3:
        return 0.0, math.inf
    x = [math.log(steps[i]) for i in late]
    y = [values[i] for i in late]
    fit = stats.linregress(x, y)
    scale = max(abs(statistics.fmean(y)), 1e-12)
    sign = 1.0 if higher_is_better else -1.0
    return sign * float(fit.slope) / scale, float(fit.stderr) / scale


def step_efficiency(gap: float, gap_se: float, kappa: float, kappa_se: float) -> Estimate | None:
    """fp32 steps per step of a plan ``gap`` behind, read from fp32's curve (see :func:`elasticity`).

    None where fp32's curve no longer improves (the efficiency cannot be read from it).
    """
    if not (kappa > 0 and math.isfinite(gap)):
        return None
    log_e = -gap / kappa
    se = math.hypot(gap_se / kappa, gap * kappa_se / kappa ** 2) if math.isfinite(kappa_se) else math.inf
    return Estimate(math.exp(log_e), se)


def gap_growth(steps: Sequence[int], values: Sequence[float], reference: Sequence[float],
               higher_is_better: bool) -> tuple[float, float]:
    """``(slope, se)`` of the relative gap against ln(step), over the late window.

    A harmless plan's gap wanders around zero; a harmful one's grows as training goes on.
    Every arm starts from the same weights, so every gap rises from zero while the arms
    part early on; only the late window says whether it is still growing.
    """
    idx = [i for i in late_window(steps) if steps[i] > 0]
    if len(idx) < 3 or not all(math.isfinite(values[i]) for i in idx):
        return 0.0, math.inf
    gaps = signed_relative([values[i] for i in idx], [reference[i] for i in idx], higher_is_better)
    fit = stats.linregress([math.log(steps[i]) for i in idx], gaps)
    return float(fit.slope), float(fit.stderr)


#: standard errors above zero at which a gap's growth counts as shown (about 97.5% one-sided)
GROWTH_Z = 2.0


def steps_to_extrapolate(horizon: int | None) -> int:
    """The fewest steps a trial trains, within its budget, before a gap's growth read from it is
    carried to ``horizon``: the horizon no farther beyond the trial's end, in ln(step), than the
    trial spans from its first step (the square root of the horizon; 0 without one).

    Every arm's gap rises while the arms part early on, and a short trial's late window is still
    in that phase: its slope, carried six ln-units on, rejects plans whose gap has stopped
    growing (PowerSGD rank 16 on the text LM: 0.13% behind and flat from step 107, rejected at
    step 70 as 0.8% behind by step 30,000; docs/benchmarks.md)."""
    return 0 if horizon is None else math.isqrt(max(horizon, 1) - 1) + 1


def gap_at_horizon(gap: float, slope: float, slope_se: float, steps: int, horizon: int | None) -> float:
    """The gap extrapolated to ``horizon`` steps, along ln(step), where the trial showed it
    growing (its slope :data:`GROWTH_Z` standard errors above zero), else the gap as measured.

    Growth in ln(step) is the slow form: a gap that grows linearly in steps grows faster,
    so a plan this rejects is not rescued by a faster form, only one it keeps is at risk."""
    if horizon is None or horizon <= steps or not math.isfinite(gap) or not slope > GROWTH_Z * slope_se:
        return gap
    return gap + slope * math.log(horizon / steps)
