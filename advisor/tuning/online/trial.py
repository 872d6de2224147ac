"""Phase 3 of the online tuner: race the short-listed plans on the user's own steps."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping, Sequence

from advisor.core.collectives import slowest
from advisor.runtime import CompressionHook
from advisor.tuning.steps import RETIME_LONGER, RETIME_ROUNDS, Arm, retime_settled, retiming_of, settled
from policies import evidence
from policies.do_no_harm import Decision, LiveMeasurement, Retiming

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
    ``decided(round_s) -> bool``, where given, replaces that rule (a re-timing stops once its
    time to accuracy is resolved).
    """

    name = TRIAL

    def __init__(self, arms: Sequence[Arm], hook: CompressionHook, *, steps: int, min_rounds: int, max_rounds: int,
                 min_gain: float = 0.0, group=None,
                 decided: Callable[[Mapping[str, list[float]]], bool] | None = None) -> None:
        self.arms = {arm.label: arm for arm in arms}
        self._decided = decided
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
        if self._decided(self.round_s) if self._decided is not None else settled(self.measurements(),
                                                                                  self.min_gain):
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
                                self.arms[label].description, self.arms[label].layout)
                for label, rounds in self.round_s.items()]

    def _arm_now(self) -> Arm:
        """The arm whose turn it is: round ``r`` starts at arm ``r`` and wraps."""
        return self._order[(self.rounds + self._turn) % len(self._order)]

    def _begin_turn(self, now: float) -> None:
        arm = self._arm_now()
        self.hook.set_plan(arm.plan, reason=f"online race: {arm.label}, round {self.rounds + 1}", verify=False)
        self._times, self._count, self._last_start = [], 0, now


class RetimeNeeded(Exception):
    """Raised inside :func:`advisor.tuning.steps.decide_time_to_accuracy` when a proven plan has
    not been re-timed yet: the tuner leaves the decision, races the two on the next steps
    (:meth:`OnlineRetimes.race`) and decides again with their figure.  Every rank raises it at
    the same point, as every rank holds the same decision."""

    def __init__(self, decision: Decision, verdict) -> None:
        super().__init__(f"{decision.chosen} is to be re-timed beside {decision.best_baseline}")
        self.decision, self.verdict = decision, verdict


class OnlineRetimes:
    """Re-timings of proven plans on the user's own steps, for the online tuners.

    The ``retime`` of :func:`advisor.tuning.steps.decide_time_to_accuracy` cannot train steps
    itself online: the steps are the user's.  So :meth:`retime` answers with the figure of an
    earlier re-timing of the same plan beside the same baseline, or raises
    :class:`RetimeNeeded`; :meth:`race` builds that re-timing (the two alone, in turns
    :data:`~advisor.tuning.steps.RETIME_LONGER` times the race's, at least
    :data:`~advisor.tuning.steps.RETIME_ROUNDS` rounds and more while the time to accuracy
    is unresolved), and :meth:`finished` keeps its figure for the next decision.  Why again:
    the race's winner is the fastest of several arms, so its race time errs in its favour.
    """

    def __init__(self, arms: Mapping[str, Arm], hook, *, steps: int, max_rounds: int, min_gain: float = 0.0,
                 group=None) -> None:
        self.arms, self.hook, self.group = arms, hook, group
        self.steps, self.max_rounds, self.min_gain = RETIME_LONGER * steps, max(max_rounds, RETIME_ROUNDS), min_gain
        #: every re-timing finished, in order
        self.record: list[Retiming] = []
        self._estimates: dict[tuple[str, str], evidence.Estimate] = {}
        self._pending: tuple[RetimeNeeded, float] | None = None

    def retime(self, decision: Decision, verdict) -> evidence.Estimate:
        """The re-timed step speed-up of ``decision.chosen`` beside its best baseline, if measured."""
        estimate = self._estimates.get((decision.chosen, decision.best_baseline))
        if estimate is None:
            raise RetimeNeeded(decision, verdict)
        return estimate

    def race(self, need: RetimeNeeded) -> Race:
        """The re-timing ``need`` asks for, as a race of the two arms on the user's next steps."""
        decision = need.decision
        pair = [self.arms[decision.best_baseline], self.arms[decision.chosen]]
        self._pending = (need, time.perf_counter())
        return Race(pair, self.hook, steps=self.steps, min_rounds=RETIME_ROUNDS, max_rounds=self.max_rounds,
                    min_gain=self.min_gain, group=self.group,
                    decided=retime_settled(decision, need.verdict, self.min_gain))

    def announce(self, need: RetimeNeeded, timing: Race, proven_by: str) -> str:
        """The event that starts the re-timing ``timing`` of the plan ``proven_by`` proved."""
        decision = need.decision
        rounds = (f"{timing.min_rounds}" if timing.min_rounds == timing.max_rounds else
                  f"{timing.min_rounds} to {timing.max_rounds}")
        return (f"{self.arms[decision.chosen].description} was proven by {proven_by}; it races "
                f"{decision.best_baseline} alone now, {timing.steps} timed steps a turn, {rounds} rounds, before its "
                f"time to accuracy is judged (the race's {decision.step_speedup().describe()} chose it, so errs in "
                "its favour)")

    @staticmethod
    def describe(done: Retiming, race: Race) -> str:
        """The event of the re-timing ``done`` that ``race`` ran."""
        return (f"{done.label} beside {done.baseline}: {done.speedup:.2f}x ({done.low:.2f}-{done.high:.2f}) per step "
                f"over {len(done.plan_s)} rounds, against the race's {done.race_speedup:.2f}x ({race.ended}, "
                f"{done.seconds:.1f} s)")

    def finished(self, race: Race) -> Retiming:
        """Keep the figure of the re-timing :meth:`race` built, now that it ended."""
        need, started = self._pending
        decision = need.decision
        done = retiming_of(decision, race.round_s, self.steps, time.perf_counter() - started)
        self.record.append(done)
        self._estimates[(decision.chosen, decision.best_baseline)] = evidence.paired_speedup(
            race.round_s[decision.best_baseline], race.round_s[decision.chosen])
        self._pending = None
        return done
