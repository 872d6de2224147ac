"""Do no harm, for accuracy: a lossy plan passes only when a paired trial *proves* it keeps up with fp32.

A paired trial trains every arm from the same weights, optimizer state and batches (see
:mod:`advisor.tuning.accuracy`); two fp32 arms that differ only in batch order measure
the noise of the trial itself (:func:`policies.evidence.trial_noise`).  All gaps are
relative to the fp32 arm and signed so that positive means worse, whichever way the
metric points; a plan's gap is its mean over the late window.

The claim to prove is "within ``tolerance`` of fp32" (1% of the metric by default), so:

* a trial is **powered** when the smallest gap it could detect (80% power, 5%) is below
  the tolerance, after at least :data:`MIN_PROOF_STEPS` steps and
  :data:`MIN_LATE_CHECKPOINTS` late checkpoints.  A trial that is not powered cannot
  clear a lossy plan, however small its gap looked: the plan is *not proven*.
* a lossy plan (a ladder rung, a candidate) is **accepted** in a powered trial when the
  upper confidence bound of its gap, extrapolated to the run's length where the trial
  showed it growing (:func:`policies.evidence.gap_at_horizon`), stays within the
  tolerance.
* a 16-bit cast is a baseline, not a claim: it is rejected only when the trial shows harm
  (the *lower* bound of its gap beyond the tolerance).  In a trial that is not powered the
  same gap is *not proven* harm: one pair of fp32 runs understates how far apart runs
  drift where the curve falls steeply (a cast that leaves a plateau a few steps later than
  fp32 is far behind at the same step), so the decision weighs the cast by its time to
  accuracy instead (:func:`advisor.tuning.steps.decide_time_to_accuracy`).
* any arm whose metric becomes NaN/Inf is rejected (it diverges).

``earned_budget``: the largest fidelity error among trialled plans that passed, where
every trialled plan with a smaller error passed too (accuracy is assumed to fall with
error, and the first failure caps the budget).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from .evidence import late_window, mean_gap, one_sided_z, signed_relative  # noqa: F401 (re-exported)

#: ``ArmResult.kind`` values
REFERENCE, NOISE, SIXTEEN_BIT, LADDER, CANDIDATE = "fp32", "fp32 (other order)", "16-bit", "ladder", "candidate"
ARM_KINDS = (REFERENCE, NOISE, SIXTEEN_BIT, LADDER, CANDIDATE)
#: arms that make a claim the trial must prove (the others are baselines)
LOSSY_KINDS = (LADDER, CANDIDATE)
#: verdicts
ACCEPTED, REJECTED, NOT_PROVEN = "accepted", "rejected", "not proven"
STATUSES = (ACCEPTED, REJECTED, NOT_PROVEN)

#: the fewest steps after which a trial may clear a lossy plan: a handful of steps from the
#: start sees fast early learning, not the long run
MIN_PROOF_STEPS = 40
#: the fewest checkpoints in the late window of a trial that may clear a lossy plan
MIN_LATE_CHECKPOINTS = 6
#: the default claim: within 1% of fp32's held-out metric
DEFAULT_TOLERANCE = 0.01


def progress(values: Sequence[float], higher_is_better: bool) -> float:
    """Relative improvement of a curve from its first to its last checkpoint (positive: it learned)."""
    if len(values) < 2:
        return 0.0
    return -signed_relative([values[-1]], [values[0]], higher_is_better)[0]


def powered(detectable: float, tolerance: float, steps: int, late_checkpoints: int) -> bool:
    """Whether a trial could have shown a gap of ``tolerance``: see the module docstring."""
    return not short_of_power(detectable, tolerance, steps, late_checkpoints)


def short_of_power(detectable: float, tolerance: float, steps: int, late_checkpoints: int) -> str:
    """What keeps a trial from being :func:`powered`, in a few words ("" where nothing does)."""
    if detectable > tolerance:
        return f"it could detect {detectable:.2%}"
    if steps < MIN_PROOF_STEPS:
        return f"it had run {steps} steps, under {MIN_PROOF_STEPS}"
    if late_checkpoints < MIN_LATE_CHECKPOINTS:
        return f"it had {late_checkpoints} late checkpoints, under {MIN_LATE_CHECKPOINTS}"
    return ""


@dataclass
class Verdict:
    status: str
    gap: float
    #: the one-sided upper (lossy plans) or lower (casts) confidence bound of the gap judged
    bound: float
    tolerance: float
    reason: str

    @property
    def accepted(self) -> bool:
        return self.status == ACCEPTED


def judge(label: str, kind: str, gap: float, se: float, tolerance: float, *, is_powered: bool,
          horizon_gap: float | None = None, horizon: int | None = None, not_powered_why: str = "") -> Verdict:
    """The verdict on one arm; see the module docstring.

    ``gap``: its mean late relative gap (``inf``: diverged); ``se``: the trial's standard
    error of a gap; ``horizon_gap``: the gap extrapolated to ``horizon`` steps (the run's
    length), where it differs from ``gap``.
    """
    z = one_sided_z()
    if not math.isfinite(gap):
        return Verdict(REJECTED, gap, gap, tolerance, f"{label}: the held-out metric became NaN/Inf (the plan diverges)")
    if kind not in LOSSY_KINDS:  # a baseline: rejected only on shown harm
        low = gap - z * se
        if low > tolerance:
            behind = f"{label}: {gap:+.2%} behind fp32, at least {low:+.2%} (95% bound), beyond the tolerance " \
                     f"({tolerance:.2%})"
            if not is_powered:
                return Verdict(NOT_PROVEN, gap, low, tolerance, f"{behind}, in a trial that is not powered ("
                               + (not_powered_why or f"it could not detect a gap of {tolerance:.2%}") + ")")
            return Verdict(REJECTED, gap, low, tolerance, behind)
        return Verdict(ACCEPTED, gap, low, tolerance, f"{label}: {gap:+.2%} against fp32 (± {z * se:.2%}), no harm "
                                                      f"shown beyond the tolerance ({tolerance:.2%})")
    judged = gap if horizon_gap is None else max(gap, horizon_gap)
    high = judged + z * se
    grown = (f", growing: {horizon_gap:+.2%} by step {horizon}" if horizon_gap is not None and horizon_gap > gap
             else "")
    if not is_powered:
        # a gap visibly beyond the tolerance is still a rejection; anything else is unproven
        if judged - z * se > tolerance:
            return Verdict(REJECTED, gap, high, tolerance, f"{label}: {gap:+.2%} behind fp32{grown}, beyond the "
                                                           f"tolerance ({tolerance:.2%}) even in a short trial")
        return Verdict(NOT_PROVEN, gap, high, tolerance, f"{label}: {gap:+.2%} against fp32{grown}, not proven: "
                                                         + (not_powered_why or "the trial could not detect a gap of "
                                                            f"{tolerance:.2%}"))
    if high > tolerance:
        return Verdict(REJECTED, gap, high, tolerance, f"{label}: {gap:+.2%} behind fp32{grown}, up to {high:+.2%} "
                                                       f"(95% bound), beyond the tolerance ({tolerance:.2%})")
    return Verdict(ACCEPTED, gap, high, tolerance, f"{label}: {gap:+.2%} against fp32{grown}, at most {high:+.2%} "
                                                   f"(95% bound), within the tolerance ({tolerance:.2%})")


def earned_budget(trialled: Sequence[tuple[float, bool]]) -> float | None:
    """``trialled``: (fidelity error, accepted) of uniform plans; the largest error passed below every failure.

    None when no plan was trialled or the least distorting one failed.
    """
    budget = None
    for error, accepted in sorted(trialled):
        if not accepted:
            break
        budget = error
    return budget
