"""Do no harm, for speed: a plan is faster only when the lower bound of its step speed-up says so.

The top candidates are measured live next to the baselines (fp32, 16-bit) in interleaved
rounds; each round gives one median step time per plan (slowest rank).  Rounds are
paired: a baseline's round ``i`` over a plan's round ``i`` cancels what drifted between
rounds, and the spread of those ratios is the noise of the comparison
(:func:`policies.evidence.paired_speedup`).  Both tuners measure this way: autotune on a
shadow copy, the online race on the user's own steps.

16-bit replaces fp32 as the baseline when the lower bound of its speed-up over fp32 exceeds
``1 + min_gain``; a compressed plan is chosen when the lower bound of its speed-up over the
best baseline does.  Otherwise the best baseline stands, with the numbers.  This is the
speed half of the decision; :func:`advisor.tuning.steps.decide_time_to_accuracy` adds the
step efficiency the accuracy trial measured, so that the plan installed is faster *to the
same accuracy*.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field

from .evidence import Estimate, independent_speedup, paired_speedup

FP32 = "fp32"
SIXTEEN_BIT = "16-bit"
CANDIDATE = "candidate"
KINDS = (FP32, SIXTEEN_BIT, CANDIDATE)


@dataclass
class LiveMeasurement:
    """One plan's step times: the median of each interleaved round (slowest rank)."""

    label: str
    kind: str
    round_s: list[float]
    predicted_s: float | None = None
    description: str = ""
    #: the bucket layout it ran in ("" for DDP's own buckets): plans in one layout share what the
    #: performance model misjudges most, how much of the exchange hides behind backward
    layout: str = ""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"measurement kind {self.kind!r}; allowed: {KINDS}")
        if not self.round_s or any(not (t > 0) for t in self.round_s):
            raise ValueError(f"{self.label}: round times must be positive seconds, got {self.round_s}")

    @property
    def median_s(self) -> float:
        return statistics.median(self.round_s)

    @property
    def noise(self) -> float:
        """Relative half-spread of the round medians (0 with one round)."""
        return (max(self.round_s) - min(self.round_s)) / 2 / self.median_s

    @property
    def relative_se(self) -> float:
        """The relative standard error of the median step time (inf with one round)."""
        if len(self.round_s) < 2:
            return math.inf
        return statistics.stdev(self.round_s) / math.sqrt(len(self.round_s)) / self.median_s


#: what a :class:`Retiming` measured the plan against
RETIMED_BESIDE_BASELINE = "baseline"
RUNOFF = "runoff"


@dataclass
class Retiming:
    """A plan's step speed-up measured again after the race: the plan alone beside one other arm
    in interleaved rounds of longer turns (each round's median step time, slowest rank), with
    the estimate (the other's time over the plan's), its 95% bounds and what the race had said.

    ``purpose``: ``"baseline"``, the plan the race chose beside the best baseline, or
    ``"runoff"``, the race's runner-up (``label``) beside its leader (``baseline``), two
    candidates the race could not tell apart.
    """

    label: str
    baseline: str
    #: timed steps of each turn of the plan
    steps: int
    plan_s: list[float]
    baseline_s: list[float]
    speedup: float
    low: float
    high: float
    race_speedup: float
    #: seconds the re-timing took
    seconds: float = 0.0
    purpose: str = RETIMED_BESIDE_BASELINE

    def __post_init__(self) -> None:
        if self.purpose not in (RETIMED_BESIDE_BASELINE, RUNOFF):
            raise ValueError(f"purpose={self.purpose!r}; allowed: {RETIMED_BESIDE_BASELINE!r}, {RUNOFF!r}")
        if len(self.plan_s) != len(self.baseline_s) or not self.plan_s:
            raise ValueError(f"re-timing of {self.label}: paired rounds must match in number, got "
                             f"{len(self.plan_s)} vs {len(self.baseline_s)}")

    @property
    def is_runoff(self) -> bool:
        """The runner-up beside the leader, not a plan beside the best baseline."""
        return self.purpose == RUNOFF


def step_speedup(baseline: LiveMeasurement, plan: LiveMeasurement) -> Estimate:
    """The baseline's step time over the plan's: paired by round where both were measured in the
    same interleaved rounds, else from each one's own spread."""
    if len(baseline.round_s) == len(plan.round_s):
        return paired_speedup(baseline.round_s, plan.round_s)
    return independent_speedup(baseline.median_s, baseline.relative_se, plan.median_s, plan.relative_se)


@dataclass
class Decision:
    """The speed decision: the plan chosen, the best baseline, and the chosen plan's step speed-up
    over it with its 95% one-sided bounds (1 where the baseline itself is chosen)."""

    chosen: str
    kind: str
    compress: bool
    best_baseline: str
    best_candidate: str | None
    #: the relative half-width of the step speed-up's interval (its noise)
    margin: float
    gain_vs_best_baseline: float
    reason: str
    ranking: list[str] = field(default_factory=list)
    #: the step speed-up's estimate in the race (for the time to accuracy; not part of a document)
    step: Estimate | None = None
    #: the time-to-accuracy speed-up over the best baseline, once the accuracy trial proved the plan
    tta: Estimate | None = None
    #: the step speed-up measured again, the chosen plan alone beside the best baseline (None: not re-timed)
    retimed: Estimate | None = None

    def step_speedup(self) -> Estimate:
        """The re-timed step speed-up where there is one, else the race's.

        The race's winner is the fastest of several noisy arms, so its own race time is
        biased in its favour (the winner's curse); a measurement taken after the choice is not.
        """
        if self.retimed is not None:
            return self.retimed
        return self.step if self.step is not None else Estimate(self.gain_vs_best_baseline, 0.0)

    @property
    def speedup_low(self) -> float:
        """The 95% lower bound of the chosen plan's step speed-up (1 where the baseline is chosen)."""
        return self.step_speedup().lower() if self.compress else 1.0

    @property
    def speedup_high(self) -> float:
        """The 95% upper bound of the chosen plan's step speed-up (1 where the baseline is chosen)."""
        return self.step_speedup().upper() if self.compress else 1.0


def decide(measurements: list[LiveMeasurement], min_gain: float = 0.0) -> Decision:
    """The recommendation from live measurements; see the module docstring."""
    if not 0 <= min_gain < 1:
        raise ValueError(f"min_gain={min_gain!r}; allowed: 0 <= min_gain < 1")
    fp32 = [m for m in measurements if m.kind == FP32]
    if not fp32:
        raise ValueError("do-no-harm needs the fp32 baseline among the measurements")
    base = min(fp32, key=lambda m: m.median_s)
    why_base = f"{base.label} is the baseline"
    for m in sorted((m for m in measurements if m.kind == SIXTEEN_BIT), key=lambda m: m.median_s):
        gain = step_speedup(base, m)
        if gain.lower() > 1 + min_gain:
            why_base = (f"{m.label} beats {base.label} by {1 - 1 / gain.value:.1%} per step (at least "
                        f"{1 - 1 / gain.lower():.1%}, 95% bound)")
            base = m
        break
    ranking = [m.label for m in sorted(measurements, key=lambda m: m.median_s)]
    candidates = [m for m in measurements if m.kind == CANDIDATE]
    if not candidates:
        return Decision(base.label, base.kind, False, base.label, None, 0.0, 1.0,
                        f"no compressed candidate was measured; {why_base}", ranking)
    gains = {m.label: step_speedup(base, m) for m in candidates}
    # the fastest of the candidates shown faster: a noisier one with a lower median does not hide it
    shown = [m for m in candidates if gains[m.label].lower() > 1 + min_gain]
    fastest = min(candidates, key=lambda m: m.median_s)
    best = min(shown, key=lambda m: m.median_s) if shown else fastest
    gain = gains[best.label]
    low, high = gain.lower(), gain.upper()
    name = best.description or best.label
    if shown:
        reason = (f"{name} measured {best.median_s * 1e3:.1f} ms/step vs {base.median_s * 1e3:.1f} ms for the best "
                  f"baseline ({base.label}): {gain.value:.2f}x per step, at least {low:.2f}x (95% bound, noise "
                  f"±{gain.noise:.1%})")
        if best is not fastest:
            other = gains[fastest.label]
            reason += (f"; {fastest.description or fastest.label} stepped faster ({fastest.median_s * 1e3:.1f} ms) "
                       f"but is not shown faster than {base.label} ({other.lower():.2f}-{other.upper():.2f}x)")
        return Decision(best.label, best.kind, True, base.label, best.label, gain.noise, gain.value, reason, ranking,
                        gain)
    reason = (f"the best compressed plan ({name}, {best.median_s * 1e3:.1f} ms/step, {gain.value:.2f}x per step, "
              f"{low:.2f}-{high:.2f}x) is not shown faster than {base.label} ({base.median_s * 1e3:.1f} ms/step) "
              f"beyond the measured noise (±{gain.noise:.1%})" + (f" and min_gain={min_gain:.0%}" if min_gain else "")
              + f"; {why_base}")
    return Decision(base.label, base.kind, False, base.label, best.label, gain.noise, gain.value, reason, ranking,
                    step=gain)
