"""The online race: the arms take turns in interleaved rounds and it stops once the decision is settled."""

import numpy as np
import pytest

from advisor.runtime import Plan
from advisor.tuning.accuracy import ArmResult
from advisor.tuning.online.trial import TRIAL_SETTLE, OnlineRetimes, Race, RetimeNeeded
from advisor.tuning.steps import RETIME_LONGER, Arm, decide_time_to_accuracy
from policies import accuracy_gate as gate
from policies.do_no_harm import CANDIDATE, FP32, SIXTEEN_BIT, decide


class RecordingHook:
    """Stands in for the CompressionHook: the race only sets plans on it."""

    def __init__(self):
        self.plan = None
        self.reasons = []

    def set_plan(self, plan, reason="", verify=True):
        self.plan = plan
        self.reasons.append(reason)


def arm(label, kind, config):
    return Arm(label, kind, Plan.uniform(config, warmup_steps=0), np.zeros(1, dtype=int), label, 0.1)


ARMS = [arm("fp32", FP32, "none"), arm("fp16", SIXTEEN_BIT, "fp16"), arm("c1", CANDIDATE, "powersgd(rank=4)")]


def run_race(race, hook, step_s, max_steps=500):
    """Drive the race as the tuner does: a step's time is ``step_s(label, round, i)`` for the arm in use.

    Returns the number of steps the race took.
    """
    labels = {id(a.plan): a.label for a in ARMS}
    now = 0.0
    race.start(now)
    for i in range(max_steps):
        now += step_s(labels[id(hook.plan)], race.rounds, i)
        if race.step_starts(now):
            return i + 1
    raise AssertionError("the race never ended")


def test_each_round_gives_every_arm_a_settling_step_and_its_timed_steps_in_turn_starting_one_arm_later():
    hook = RecordingHook()
    race = Race(ARMS, hook, steps=3, min_rounds=3, max_rounds=3)
    seen = []

    def step_s(label, r, i):
        seen.append(label)
        return {"fp32": 0.200, "fp16": 0.150, "c1": 0.100}[label]

    steps = run_race(race, hook, step_s)
    assert steps == 3 * race.steps_per_round == 3 * 3 * (TRIAL_SETTLE + 3)
    per_round = race.steps_per_round
    assert seen[:per_round] == ["fp32"] * 4 + ["fp16"] * 4 + ["c1"] * 4
    # no arm always follows the same one: round 2 starts at the second arm, round 3 at the third
    assert seen[per_round: 2 * per_round] == ["fp16"] * 4 + ["c1"] * 4 + ["fp32"] * 4
    assert seen[2 * per_round:] == ["c1"] * 4 + ["fp32"] * 4 + ["fp16"] * 4
    # the round times stay with their arms whatever the order they ran in
    assert {k: pytest.approx(v) for k, v in race.round_s.items()} == {"fp32": [0.2] * 3, "fp16": [0.15] * 3, "c1": [0.1] * 3}
    assert len(hook.reasons) == 9 and hook.reasons[3] == "online race: fp16, round 2"


def test_the_settling_step_is_left_out_of_the_timing():
    hook = RecordingHook()
    race = Race(ARMS[:2], hook, steps=2, min_rounds=2, max_rounds=2)
    # each arm's first step under its plan costs ten times more: it must not move the medians
    counts = {}

    def step_s(label, r, i):
        counts[(label, r)] = counts.get((label, r), 0) + 1
        return (1.0 if counts[(label, r)] == 1 else 0.1) * (2 if label == "fp32" else 1)

    run_race(race, hook, step_s)
    assert {k: pytest.approx(v) for k, v in race.round_s.items()} == {"fp32": [0.2, 0.2], "fp16": [0.1, 0.1]}


def test_a_clear_race_stops_after_its_first_rounds_and_a_close_one_runs_to_its_limit():
    rng = np.random.default_rng(0)

    def clear(label, r, i):
        return {"fp32": 0.200, "fp16": 0.150, "c1": 0.080}[label] * (1 + 0.01 * rng.standard_normal())

    hook = RecordingHook()
    race = Race(ARMS, hook, steps=3, min_rounds=3, max_rounds=8)
    run_race(race, hook, clear)
    assert race.rounds == 3 and race.ended == "decided after 3 rounds"
    assert decide(race.measurements()).chosen == "c1"

    # the candidate is 15% faster than fp16 in even rounds and 8% slower in odd ones: about 4% faster
    # on average, too unsteady to settle in 6 rounds
    def close(label, r, i):
        return 0.150 * (0.85 if r % 2 == 0 else 1.08) if label == "c1" else {"fp32": 0.200, "fp16": 0.150}[label]

    hook = RecordingHook()
    race = Race(ARMS, hook, steps=3, min_rounds=3, max_rounds=6)
    run_race(race, hook, close)
    assert race.rounds == 6 and "unresolved after 6 rounds" in race.ended


def test_rounds_pair_the_arms_so_drift_between_rounds_cancels():
    # every round is 30% slower than the last, and the candidate is 10% faster within each
    def drifting(label, r, i):
        return {"fp32": 0.100, "fp16": 0.100, "c1": 0.090}[label] * 1.3 ** r

    hook = RecordingHook()
    race = Race(ARMS, hook, steps=2, min_rounds=3, max_rounds=8)
    run_race(race, hook, drifting)
    decision = decide(race.measurements())
    assert race.rounds == 3 and decision.chosen == "c1"
    assert abs(decision.gain_vs_best_baseline - 1 / 0.9) < 1e-6 and decision.margin < 1e-6


def test_autotunes_live_rounds_start_one_plan_later_each_round_and_warm_each_model_up_once():
    from advisor.tuning.live import _interleaved

    calls = []

    def run(label, settle, finite):
        calls.append((label, settle))
        finite.append(True)
        return {"fp32": 0.2, "a": 0.1, "b": 0.15}[label]

    # "b" runs on a shadow built with smaller DDP buckets: a model of its own, with its own bucket rebuild
    models = {"fp32": "native", "a": None, "b": 1.0}
    result = {label: [] for label in models}
    _interleaved(list(models), run, models.get, result, 3, None, None, 2, None, None)
    assert [label for label, _ in calls] == ["fp32", "a", "b", "a", "b", "fp32", "b", "fp32", "a"]
    assert [settle for _, settle in calls[:3]] == [2, 2, 2] and all(settle == 1 for _, settle in calls[3:])
    assert result == {"fp32": [0.2] * 3, "a": [0.1] * 3, "b": [0.15] * 3}


def test_online_a_proven_plan_races_the_best_baseline_alone_in_longer_turns_and_the_claim_rests_on_that():
    hook = RecordingHook()
    race = Race(ARMS, hook, steps=2, min_rounds=3, max_rounds=3)
    # in the race c1 looks 1.9x fp16; alone beside it, it is 1.25x (what the claim must rest on)
    truth = {"fp32": 0.200, "fp16": 0.150, "c1": 0.120}
    run_race(race, hook, lambda label, r, i: 0.080 if label == "c1" else truth[label])
    proven = ArmResult("c1", gate.CANDIDATE, "c1", [1.0], 1.0, True, "c1: within the tolerance", 0.0,
                       status=gate.ACCEPTED, efficiency=0.98, efficiency_se=0.005)
    judged = []

    def judge(decision):
        judged.append(decision.chosen)
        return proven

    retimes = OnlineRetimes({a.label: a for a in ARMS}, hook, steps=race.steps, max_rounds=6)
    with pytest.raises(RetimeNeeded) as asked:
        decide_time_to_accuracy(race.measurements(), judge, retime=retimes.retime)
    timing = retimes.race(asked.value)
    seen = []

    def alone(label, r, i):
        seen.append(label)
        return truth[label]

    steps = run_race(timing, hook, alone)
    assert set(seen) == {"fp16", "c1"} and timing.steps == RETIME_LONGER * race.steps
    assert timing.rounds == 3 and steps == 3 * timing.steps_per_round  # clear after its first rounds
    done = retimes.finished(timing)
    assert (done.label, done.baseline, done.steps) == ("c1", "fp16", 6)
    assert done.speedup == pytest.approx(1.25) and done.race_speedup == pytest.approx(1.875)
    decision, _, _ = decide_time_to_accuracy(race.measurements(), judge, retime=retimes.retime)
    assert decision.chosen == "c1" and decision.retimed.value == pytest.approx(1.25)
    assert decision.tta.value == pytest.approx(1.25 * 0.98)
    assert "re-timed alone beside fp16: 1.25x" in decision.reason and retimes.record == [done]


def test_a_cast_raced_in_another_bucket_layout_carries_the_casts_verdict_under_its_race_label():
    # its step efficiency is the cast's, so its time to accuracy can be read (without it, a call
    # that advised fp16 in 1 MiB buckets showed no time to accuracy and its repeats "disagreed")
    from constructed import tuning_profile

    from advisor.tuning.steps import LazyTrial
    from policies.problem import TuningProblem

    problem = TuningProblem.from_profile(tuning_profile(n_buckets=4))
    joined = problem.with_layout(4.0)

    class StubTrial:
        def __init__(self):
            self.trialled = []

        def start(self):
            pass

        def report(self):
            return None

        def trial(self, label, plan, kind, description, fidelity_error):
            self.trialled.append(label)
            return ArmResult(label, kind, description, [1.0, 0.9], 1.0, True, "kept up", 0.0, fidelity_error,
                             efficiency=1.0, efficiency_se=0.03)

    stub = StubTrial()
    lazy = LazyTrial(stub, problem, lambda msg: None)
    choices = joined.uniform("fp16")[0]
    cast = Arm("candidate 4", CANDIDATE, joined.plan(choices), choices,
               "fp16 everywhere, in 4 MiB exchanges", 0.1, joined)
    verdict = lazy.judge_arm(cast)
    assert stub.trialled == ["fp16"], "judged as the cast, on the cast's own arm"
    assert lazy.verdicts()["candidate 4"] is verdict and lazy.verdicts()["fp16"] is verdict
