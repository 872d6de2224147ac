"""Do no harm, for accuracy: a plan passes only if its held-out metric keeps up with fp32's.

A short paired trial trains every arm from the same weights, optimizer state and batches
(see :mod:`advisor.tuning.accuracy`).  Two fp32 arms that differ only in batch order measure the
noise of the trial itself; a plan is rejected when its metric falls behind the first fp32
arm by more than that noise.  All values are relative to the fp32 arm and signed so that
positive means worse, whichever way the metric points.

* ``relative_gap``: the mean of the signed relative differences over the *late window*
  (the checkpoints in the second half of the trial, where early transients have settled).
* ``noise_band``: twice the root mean square of the two fp32 arms' relative differences
  over the same window (about a 95% band for a difference of two such runs).
* ``progress``: how much the fp32 arm improved over the trial, relative to its start.  A
  trial is long enough once its progress is ``signal_to_noise`` times its noise: a plan
  that loses a visible share of the progress is then told apart from noise.
* ``consistently_behind``: a sign test on the paired differences.  Every arm trains on the
  same batches in the same order, so a harmless plan's differences from fp32 fluctuate
  around zero; one behind at each of ``k >= 4`` late checkpoints (chance ``2**-k`` for
  symmetric noise) is systematically worse, and such gaps grow as training goes on (a
  PowerSGD plan on the bundled LM: +0.5% after 8 steps, +5% after 300).  A trial cut short
  by its time budget may have fewer late checkpoints; the test then takes the last ``k``
  after the start.  It is rejected
  when its mean gap also exceeds the smallest gap counted as harm.
* ``earned_budget``: the largest fidelity error among trialled plans that passed, where
  every trialled plan with a smaller error passed too (accuracy is assumed to fall with
  error, and the first failure caps the budget).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

#: ``ArmResult.kind`` values
REFERENCE, NOISE, SIXTEEN_BIT, LADDER, CANDIDATE = "fp32", "fp32 (other order)", "16-bit", "ladder", "candidate"
ARM_KINDS = (REFERENCE, NOISE, SIXTEEN_BIT, LADDER, CANDIDATE)


def signed_relative(values: Sequence[float], reference: Sequence[float], higher_is_better: bool) -> list[float]:
    """Per checkpoint, how much worse ``values`` is than ``reference``, relative to it (positive: worse)."""
    if len(values) != len(reference):
        raise ValueError(f"curves of different lengths: {len(values)} vs {len(reference)} checkpoints")
    sign = -1.0 if higher_is_better else 1.0
    return [sign * (v - r) / max(abs(r), 1e-12) for v, r in zip(values, reference)]


def late_window(steps: Sequence[int]) -> list[int]:
    """Indices of the checkpoints past half of the last one (at least the last two, or one)."""
    if not steps:
        raise ValueError("a trial curve needs at least one checkpoint")
    half = steps[-1] / 2
    late = [i for i, s in enumerate(steps) if s > half]
    return late if len(late) >= 2 else list(range(max(0, len(steps) - 2), len(steps)))


def relative_gap(steps: Sequence[int], values: Sequence[float], reference: Sequence[float],
                 higher_is_better: bool) -> float:
    """Mean signed relative difference over the late window; ``inf`` if any value there is not finite."""
    late = late_window(steps)
    picked = [values[i] for i in late]
    if not all(math.isfinite(v) for v in picked):
        return math.inf
    diffs = signed_relative(picked, [reference[i] for i in late], higher_is_better)
    return sum(diffs) / len(diffs)


def noise_band(steps: Sequence[int], first: Sequence[float], second: Sequence[float],
               higher_is_better: bool) -> float:
    """Twice the RMS relative difference of two fp32 arms over the late window."""
    late = late_window(steps)
    diffs = signed_relative([second[i] for i in late], [first[i] for i in late], higher_is_better)
    return 2.0 * math.sqrt(sum(d * d for d in diffs) / len(diffs))


#: late checkpoints a sign test needs (all behind by chance: 1 in 16)
SIGN_TEST_CHECKPOINTS = 4


def sign_test_window(steps: Sequence[int]) -> list[int]:
    """Indices the sign test looks at: the late window, or where that has fewer than
    :data:`SIGN_TEST_CHECKPOINTS` (a trial cut short by its time budget), the last that many
    checkpoints after the start; empty when there are not that many."""
    late = late_window(steps)
    if len(late) >= SIGN_TEST_CHECKPOINTS:
        return late
    after_start = list(range(1, len(steps)))
    return after_start[-SIGN_TEST_CHECKPOINTS:] if len(after_start) >= SIGN_TEST_CHECKPOINTS else []


def consistently_behind(steps: Sequence[int], values: Sequence[float], reference: Sequence[float],
                        higher_is_better: bool) -> bool:
    """Whether the curve is behind the reference at every checkpoint of the sign test's window,
    with enough of them to tell (see :func:`sign_test_window`)."""
    window = sign_test_window(steps)
    if not window:
        return False
    diffs = signed_relative([values[i] for i in window], [reference[i] for i in window], higher_is_better)
    return all(d > 0 for d in diffs)


def progress(values: Sequence[float], higher_is_better: bool) -> float:
    """Relative improvement of a curve from its first to its last checkpoint (positive: it learned)."""
    if len(values) < 2:
        return 0.0
    return -signed_relative([values[-1]], [values[0]], higher_is_better)[0]


def long_enough(progress_so_far: float, noise: float, signal_to_noise: float, floor: float) -> bool:
    """Whether the fp32 arm has improved ``signal_to_noise`` times the tolerance it is judged with."""
    return progress_so_far >= signal_to_noise * max(noise, floor)


@dataclass
class Verdict:
    accepted: bool
    gap: float
    tolerance: float
    reason: str


def judge(label: str, gap: float, tolerance: float, behind_throughout: bool = False,
          floor: float = 0.0, informative: bool = True) -> Verdict:
    """Accept a plan whose gap is finite and within the tolerance, unless it is behind at every
    late checkpoint by more than ``floor`` on average (see :func:`consistently_behind`).

    Where fp32 did not improve by more than the noise (``informative=False``) the gap still
    counts against the noise, but the sign test does not: small systematic gaps mean
    nothing when fp32 itself learned nothing the trial can see."""
    if not math.isfinite(gap):
        return Verdict(False, gap, tolerance, f"{label}: the held-out metric became NaN/Inf (the plan diverges)")
    if not math.isfinite(tolerance):
        return Verdict(True, gap, tolerance, f"{label}: {gap:+.2%} against fp32; fp32 itself did not improve, "
                                             "so the trial can only reject divergence")
    if not informative:
        if gap > tolerance:
            return Verdict(False, gap, tolerance, f"{label}: {gap:+.2%} behind fp32, more than the trial's noise "
                                                  f"({tolerance:.2%}), although fp32 itself improved within it")
        return Verdict(True, gap, tolerance, f"{label}: {gap:+.2%} against fp32, within the trial's noise "
                                             f"({tolerance:.2%}); fp32 improved within the noise too, so only "
                                             "large harm shows")
    if gap > tolerance:
        return Verdict(False, gap, tolerance, f"{label}: {gap:+.2%} behind fp32, more than the trial's "
                                              f"noise ({tolerance:.2%})")
    if behind_throughout and gap > floor:
        return Verdict(False, gap, tolerance, f"{label}: {gap:+.2%} behind fp32 at every late checkpoint (within "
                                              f"the noise, {tolerance:.2%}, but systematic: such gaps grow)")
    return Verdict(True, gap, tolerance, f"{label}: {gap:+.2%} against fp32, within the trial's noise "
                                         f"({tolerance:.2%})")


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
