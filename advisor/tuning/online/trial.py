"""Phase 3 of the online tuner: race the short-listed plans on the user's own steps."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence

from advisor.core.collectives import slowest
from advisor.runtime import CompressionHook
from advisor.tuning.steps import Arm
from policies.do_no_harm import LiveMeasurement

TRIAL = "trial"
#: steps under a new plan left out of its timing (the first ones pay for buffers and caches)
TRIAL_SETTLE = 2


def robust_median(times: Sequence[float]) -> tuple[float, float]:
    """(median, relative standard error of the median) of step times, outliers beyond 5 MADs dropped.

    The standard error of a median is about 1.25 * 1.4826 * MAD / sqrt(n) for normal noise.
    """
    med = statistics.median(times)
    mad = statistics.median(abs(t - med) for t in times)
    kept = [t for t in times if abs(t - med) <= 5 * mad] if mad > 0 else list(times)
    med = statistics.median(kept)
    mad = statistics.median(abs(t - med) for t in kept)
    return med, 1.25 * 1.4826 * mad / math.sqrt(len(kept)) / med if med > 0 else 0.0


class Race:
    """Each arm in turn trains the user's steps until its median step time is known well enough.

    An arm is timed for at least ``min_steps`` and at most ``max_steps`` steps, after
    :data:`TRIAL_SETTLE` warm-up steps, and stops early once its median's standard error is
    below ``precision`` on every rank (the least precise rank decides, so every rank moves
    on at the same step).
    """

    name = TRIAL

    def __init__(self, arms: Sequence[Arm], hook: CompressionHook, *, min_steps: int, max_steps: int,
                 precision: float, group=None) -> None:
        self.arms = {arm.label: arm for arm in arms}
        self.hook, self.group = hook, group
        self.min_steps, self.max_steps, self.precision = min_steps, max_steps, precision
        #: each arm's timed step seconds (this rank), in race order
        self.times: dict[str, list[float]] = {}
        self._queue = list(arms)
        self._current: Arm | None = None
        self._count = 0
        self._last_start = 0.0

    def start(self, now: float) -> None:
        self._next(now)

    def step_starts(self, now: float) -> bool:
        """A step starts: time the one that ended; True when every arm has been timed."""
        self._count += 1
        times = self.times[self._current.label]
        if self._count > TRIAL_SETTLE:  # the first steps under a new plan warm it up
            times.append(now - self._last_start)
        self._last_start = now
        if len(times) < self.min_steps:
            return False
        if len(times) < self.max_steps and slowest([robust_median(times)[1]], self.group)[0] > self.precision:
            return False
        if not self._queue:
            return True
        self._next(now)
        return False

    def close(self) -> None:
        """Nothing to remove: the race only sets the hook's plan."""

    def measurements(self) -> list[LiveMeasurement]:
        """Every arm's median (slowest rank) with its relative standard error (the least precise rank's).

        The arms ran one after another, not in paired rounds, so each carries its own error.
        """
        labels = list(self.times)
        stats = [robust_median(self.times[label]) for label in labels]
        # medians and their standard errors share one collective; the slowest rank sets the pace
        merged = slowest([m for m, _ in stats] + [e for _, e in stats], self.group)
        medians, errors = merged[: len(labels)], merged[len(labels):]
        return [LiveMeasurement(label, self.arms[label].kind, [m], self.arms[label].predicted_s,
                                self.arms[label].description, se=e)
                for label, m, e in zip(labels, medians, errors)]

    def _next(self, now: float) -> None:
        self._current = self._queue.pop(0)
        self.times[self._current.label] = []
        self.hook.set_plan(self._current.plan, reason=f"online trial: {self._current.label}", verify=False)
        self._last_start = now
        self._count = 0
