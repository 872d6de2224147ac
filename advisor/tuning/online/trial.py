"""Phase 3 of the online tuner: race the short-listed plans on the user's own steps."""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence

from advisor.core.collectives import slowest
from advisor.runtime import CompressionHook
from advisor.tuning.steps import Arm, settled
from policies.do_no_harm import LiveMeasurement

TRIAL = "trial"
#: steps under a newly set plan left out of its timing (the first one pays for buffers and caches)
TRIAL_SETTLE = 1


class Race:
    """The arms take turns on the user's steps in interleaved rounds, as :func:`advisor.autotune` measures.

    In each round every arm trains ``steps`` timed steps after :data:`TRIAL_SETTLE` untimed
    ones; the round's median step time of each arm (the slowest rank's, one collective per
    round) is one paired observation.  Round ``i`` of every arm ran in the same stretch of
    the job, so a baseline's round over a plan's round cancels what drifted between rounds
    (the same statistic as autotune's live measurement: :func:`policies.do_no_harm.step_speedup`).
    After ``min_rounds`` rounds, more follow while the comparisons that decide are unresolved
    (:func:`advisor.tuning.steps.settled`), up to ``max_rounds``: the race stops once it is
    decided, or once more rounds are no longer worth their steps.  Every rank holds the same
    round times, so every rank stops at the same step.  Each round starts one arm later than
    the last (as autotune's rounds do), so that no arm always follows the same one.
    """

    name = TRIAL

    def __init__(self, arms: Sequence[Arm], hook: CompressionHook, *, steps: int, min_rounds: int, max_rounds: int,
                 min_gain: float = 0.0, group=None) -> None:
        self.arms = {arm.label: arm for arm in arms}
        self.hook, self.group = hook, group
        self.steps, self.min_rounds, self.max_rounds, self.min_gain = steps, min_rounds, max_rounds, min_gain
        #: each arm's round medians (slowest rank), in race order
        self.round_s: dict[str, list[float]] = {arm.label: [] for arm in arms}
        #: why the race ended (set when it does)
        self.ended = ""
        self._order = list(arms)
        self._turn = 0  # index of the arm training now
        self._times: list[float] = []  # this turn's timed steps (this rank)
        self._local: dict[str, float] = {}  # this round's medians so far (this rank), by label
        self._count = 0
        self._last_start = 0.0

    @property
    def rounds(self) -> int:
        """Rounds completed."""
        return len(next(iter(self.round_s.values())))

    @property
    def steps_per_round(self) -> int:
        return len(self._order) * (TRIAL_SETTLE + self.steps)

    def start(self, now: float) -> None:
        self._begin_turn(now)

    def step_starts(self, now: float, say: Callable[[str], None] | None = None) -> bool:
        """A step starts: time the one that ended; True once the race is decided (or out of rounds)."""
        self._count += 1
        if self._count > TRIAL_SETTLE:  # the first step under a newly set plan warms it up
            self._times.append(now - self._last_start)
        self._last_start = now
        if len(self._times) < self.steps:
            return False
        self._local[self._arm_now().label] = statistics.median(self._times)
        self._turn += 1
        if self._turn < len(self._order):
            self._begin_turn(now)
            return False
        # the round is complete: one collective gives every rank the slowest rank's medians
        medians = slowest([self._local[arm.label] for arm in self._order], self.group)
        for arm, seconds in zip(self._order, medians):
            self.round_s[arm.label].append(seconds)
        self._local, self._turn = {}, 0
        done = self._done()
        if say is not None:
            say(f"race round {self.rounds}: " + ", ".join(f"{label} {r[-1] * 1e3:.1f} ms" for label, r in
                                                          self.round_s.items()) + ("" if not done else f"; {self.ended}"))
        if not done:
            self._begin_turn(now)
        return done

    def _done(self) -> bool:
        if self.rounds < self.min_rounds:
            return False
        if settled(self.measurements(), self.min_gain):
            self.ended = f"decided after {self.rounds} rounds"
            return True
        if self.rounds >= self.max_rounds:
            self.ended = f"still unresolved after {self.rounds} rounds (max_trial_rounds): the noise decides"
            return True
        return False

    def close(self) -> None:
        """Nothing to remove: the race only sets the hook's plan."""

    def measurements(self) -> list[LiveMeasurement]:
        """Every arm's round medians (slowest rank), paired by round."""
        return [LiveMeasurement(label, self.arms[label].kind, list(rounds), self.arms[label].predicted_s,
                                self.arms[label].description) for label, rounds in self.round_s.items()]

    def _arm_now(self) -> Arm:
        """The arm whose turn it is: round ``r`` starts at arm ``r`` and wraps."""
        return self._order[(self.rounds + self._turn) % len(self._order)]

    def _begin_turn(self, now: float) -> None:
        arm = self._arm_now()
        self.hook.set_plan(arm.plan, reason=f"online race: {arm.label}, round {self.rounds + 1}", verify=False)
        self._times, self._count, self._last_start = [], 0, now
