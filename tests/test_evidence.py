"""Evidence for "faster to the same accuracy": the numbers, the verdicts and the decision, on numbers."""

import dataclasses
import math
import random

import pytest

from advisor.tuning.accuracy import ArmResult
from advisor.tuning.steps import decide_time_to_accuracy, unprovable
from policies import accuracy_gate as gate
from policies import evidence as ev
from policies.do_no_harm import LiveMeasurement


# --- speed ------------------------------------------------------------------------------------------
def test_a_paired_speedup_is_the_geometric_mean_of_round_ratios_with_a_t_interval():
    s = ev.paired_speedup([0.200, 0.220, 0.210], [0.100, 0.100, 0.105])
    ratios = [2.0, 2.2, 2.0]
    assert s.value == pytest.approx(math.prod(ratios) ** (1 / 3))
    assert s.dof == 2 and s.lower() < s.value < s.upper()
    one = ev.paired_speedup([0.2], [0.1])
    assert one.value == pytest.approx(2.0) and one.lower() == 0.0, "one round says nothing about the noise"
    with pytest.raises(ValueError, match="match in number"):
        ev.paired_speedup([0.2, 0.2], [0.1])


def test_more_agreeing_rounds_narrow_the_interval():
    rng = random.Random(0)
    few = ev.paired_speedup(*zip(*[(0.2 * (1 + rng.gauss(0, 0.03)), 0.1) for _ in range(3)]))
    many = ev.paired_speedup(*zip(*[(0.2 * (1 + rng.gauss(0, 0.03)), 0.1) for _ in range(12)]))
    assert many.upper() / many.lower() < few.upper() / few.lower()


def test_a_comparison_is_resolved_when_its_bounds_leave_no_doubt_either_way():
    assert ev.resolved(ev.Estimate(1.5, 0.05))                 # clearly faster
    assert ev.resolved(ev.Estimate(0.9, 0.02))                 # clearly no faster
    assert ev.resolved(ev.Estimate(1.0, 0.005))                # at most 1% faster: not worth having
    assert not ev.resolved(ev.Estimate(1.05, 0.05))            # could be 13% faster or 3% slower


def test_estimates_multiply_with_their_errors_in_quadrature():
    a, b = ev.Estimate(2.0, 0.03, 4), ev.Estimate(0.9, 0.04)
    c = a.times(b)
    assert c.value == pytest.approx(1.8) and c.se_log == pytest.approx(0.05)
    assert 4 < c.dof < math.inf and c.lower() < 1.8 < c.upper()


# --- accuracy: noise, power, efficiency, growth ------------------------------------------------------
STEPS = list(range(0, 201, 10))


def curve(kappa=0.1, offset=0.0, wiggle=0.0, seed=0):
    """A power-law loss curve 5 s^-kappa, ``offset`` worse (relative), with white noise ``wiggle``."""
    rng = random.Random(seed)
    return [5.0 * max(s, 1) ** -kappa * (1 + offset + rng.gauss(0, wiggle)) for s in STEPS]


def test_the_trial_noise_counts_a_persistent_offset_in_full_and_averages_the_rest():
    ref = curve()
    wandering = curve(wiggle=0.005, seed=1)
    shifted = curve(offset=0.005, wiggle=0.005, seed=1)
    a = ev.trial_noise(STEPS, ref, wandering, False)
    b = ev.trial_noise(STEPS, ref, shifted, False)
    assert a.checkpoints == len(ev.late_window(STEPS)) == 10
    assert a.se < 0.005, "white noise averages down over the late checkpoints"
    assert b.se >= 0.005 > a.se, "an offset between two equally good runs does not average away"
    assert b.detectable == pytest.approx(ev.POWER_Z * b.se)
    assert ev.trial_noise(STEPS, ref, ref, False, floor=0.001).se == 0.001, "identical arms: the floor"


def test_a_correlated_wander_counts_as_fewer_observations_than_white_noise():
    ref = curve()
    rng = random.Random(3)
    walk, x = [], 0.0
    for _ in STEPS:
        x = 0.9 * x + rng.gauss(0, 0.003)
        walk.append(x)
    wandering = [r * (1 + w) for r, w in zip(ref, walk)]
    white = curve(wiggle=0.003, seed=3)
    assert ev.trial_noise(STEPS, ref, wandering, False).effective < ev.trial_noise(STEPS, ref, white, False).effective


def test_a_longer_trial_is_said_to_need_the_steps_its_noise_implies():
    noise = ev.TrialNoise(se=0.005, offset=0.0, spread=0.01, effective=5, checkpoints=10)
    assert noise.detectable == pytest.approx(0.014)
    assert noise.steps_to_detect(100, 0.01) == math.ceil(100 * 1.4 ** 2)
    assert noise.steps_to_detect(100, 0.02) == 100


def test_step_efficiency_is_read_from_fp32s_own_curve():
    ref = curve(kappa=0.1)
    kappa, kappa_se = ev.elasticity(STEPS, ref, False)
    assert kappa == pytest.approx(0.1, rel=0.05) and kappa_se < 0.01
    # a plan 1% behind on a curve with kappa 0.1 is worth exp(-0.1) fp32 steps per step
    e = ev.step_efficiency(0.01, 0.001, kappa, kappa_se)
    assert e.value == pytest.approx(math.exp(-0.01 / kappa)) and e.lower() < e.value < e.upper()
    # accuracy that rises: the same reading, signed the other way
    acc = [0.9 - 0.5 * max(s, 1) ** -0.5 for s in STEPS]
    assert ev.elasticity(STEPS, acc, True)[0] > 0
    flat = [2.0] * len(STEPS)
    assert ev.elasticity(STEPS, flat, False)[0] == 0.0
    assert ev.step_efficiency(0.01, 0.001, 0.0, 0.0) is None, "a flat curve gives no efficiency"


def test_a_growing_gap_is_extrapolated_to_the_run_and_a_steady_one_is_not():
    ref = curve()
    growing = [r * (1 + 0.002 * math.log(max(s, 1))) for r, s in zip(ref, STEPS)]
    steady = curve(offset=0.004, wiggle=0.001, seed=2)
    slope, se = ev.gap_growth(STEPS, growing, ref, False)
    assert slope == pytest.approx(0.002, rel=0.01) and slope > se
    gap = ev.mean_gap(STEPS, growing, ref, False)
    assert ev.gap_at_horizon(gap, slope, se, 200, 20_000) == pytest.approx(gap + 0.002 * math.log(100))
    assert ev.gap_at_horizon(gap, slope, se, 200, None) == gap
    s_slope, s_se = ev.gap_growth(STEPS, steady, ref, False)
    steady_gap = ev.mean_gap(STEPS, steady, ref, False)
    assert ev.gap_at_horizon(steady_gap, s_slope, s_se, 200, 20_000) == pytest.approx(steady_gap, abs=0.002)


# --- verdicts ----------------------------------------------------------------------------------------------
def test_a_trial_is_powered_only_when_long_enough_and_able_to_see_the_tolerance():
    assert gate.powered(0.008, 0.01, 60, 8)
    assert not gate.powered(0.012, 0.01, 60, 8), "could not have shown a 1% gap"
    assert not gate.powered(0.001, 0.01, 8, 8), "a handful of steps never proves a lossy plan"
    assert not gate.powered(0.001, 0.01, 60, 3)


def test_a_lossy_plan_needs_a_powered_trial_and_an_upper_bound_within_the_tolerance():
    proven = gate.judge("p", gate.CANDIDATE, 0.002, 0.003, 0.01, is_powered=True)
    assert proven.accepted and proven.bound == pytest.approx(0.002 + 1.645 * 0.003, abs=1e-4)
    too_close = gate.judge("p", gate.CANDIDATE, 0.006, 0.003, 0.01, is_powered=True)
    assert too_close.status == gate.REJECTED and "beyond the tolerance" in too_close.reason
    unproven = gate.judge("p", gate.CANDIDATE, 0.0, 0.01, 0.01, is_powered=False, not_powered_why="a reason")
    assert unproven.status == gate.NOT_PROVEN and "a reason" in unproven.reason
    plainly_bad = gate.judge("p", gate.CANDIDATE, 0.08, 0.01, 0.01, is_powered=False)
    assert plainly_bad.status == gate.REJECTED, "harm beyond doubt is a rejection even in a short trial"
    assert gate.judge("p", gate.LADDER, math.inf, 0.001, 0.01, is_powered=True).status == gate.REJECTED
    grows = gate.judge("p", gate.CANDIDATE, 0.001, 0.001, 0.01, is_powered=True, horizon_gap=0.02, horizon=10_000)
    assert grows.status == gate.REJECTED and "growing" in grows.reason


def test_growth_is_carried_to_the_runs_length_only_from_a_trial_spanning_as_many_log_steps():
    assert ev.steps_to_extrapolate(None) == 0, "no run length: nothing is carried"
    assert [ev.steps_to_extrapolate(h) for h in (1, 100, 101, 30_000, 100_000)] == [1, 10, 11, 174, 317]
    for horizon in (30_000, 100_000):
        steps = ev.steps_to_extrapolate(horizon)
        # the horizon lies no farther beyond the trial, in ln(step), than the trial spans; one step fewer, it would
        assert math.log(horizon / steps) <= math.log(steps)
        assert math.log(horizon / (steps - 1)) > math.log(steps - 1)


def test_a_cast_is_a_baseline_rejected_only_on_shown_harm():
    assert gate.judge("bf16", gate.SIXTEEN_BIT, 0.005, 0.01, 0.01, is_powered=True).accepted
    assert gate.judge("bf16", gate.SIXTEEN_BIT, 0.005, 0.01, 0.01, is_powered=False).accepted
    harmed = gate.judge("fp16", gate.SIXTEEN_BIT, 0.05, 0.01, 0.01, is_powered=True)
    assert harmed.status == gate.REJECTED and "95% bound" in harmed.reason


def test_a_trial_that_is_not_powered_leaves_a_casts_harm_not_proven_for_the_decision_to_weigh():
    behind = gate.judge("fp16", gate.SIXTEEN_BIT, 0.60, 0.10, 0.01, is_powered=False,
                        not_powered_why="the trial could detect gaps of 27% or more")
    assert behind.status == gate.NOT_PROVEN and not behind.accepted
    assert "not powered" in behind.reason and "27%" in behind.reason
    diverged = gate.judge("fp16", gate.SIXTEEN_BIT, math.inf, 0.10, 0.01, is_powered=False)
    assert diverged.status == gate.REJECTED, "a cast that diverges is rejected however short the trial"


# --- the decision: to the same accuracy ---------------------------------------------------------------------
def rounds(label, kind, *ms):
    return LiveMeasurement(label, kind, [x / 1e3 for x in ms])


MEASURED = [rounds("fp32", "fp32", 300, 310, 305), rounds("bf16", "16-bit", 200, 205, 202),
            rounds("c1", "candidate", 100, 104, 101), rounds("c2", "candidate", 150, 152, 151)]


def verdict(label, status, efficiency=None, se=0.02):
    return ArmResult(label, gate.CANDIDATE if label.startswith("c") else gate.SIXTEEN_BIT, label, [1.0], 1.0,
                     status == gate.ACCEPTED, f"{label}: {status}", 0.0, status=status,
                     efficiency=efficiency, efficiency_se=se if efficiency is not None else None)


CAST_RACE = [rounds("fp32", "fp32", 300, 310, 305, 298), rounds("fp16", "16-bit", 150, 155, 152, 149)]


def test_a_cast_an_unpowered_trial_saw_fall_behind_stands_where_its_time_to_accuracy_is_not_shown_slower():
    # fp16 left the plateau later than fp32 in a short trial: far behind at the same step, yet worth
    # 0.7 of an fp32 step at twice the speed
    late = verdict("fp16", gate.NOT_PROVEN, 0.7, se=0.2)
    decision, checked, rejected = decide_time_to_accuracy(CAST_RACE, lambda d: late)
    assert decision.chosen == "fp16" and not rejected
    assert "the cast stands" in checked and "not shown slower" in decision.reason


def test_a_cast_that_stalls_in_an_unpowered_trial_gives_way_to_fp32():
    # worth a fifth of an fp32 step at twice the speed: fp32 reaches the loss sooner
    stalled = verdict("fp16", gate.NOT_PROVEN, 0.2, se=0.1)
    decision, _, rejected = decide_time_to_accuracy(CAST_RACE, lambda d: stalled)
    assert decision.chosen == "fp32" and len(rejected) == 1 and "is shown slower" in rejected[0]
    unread = verdict("fp16", gate.NOT_PROVEN)  # no efficiency: fp32's curve was flat
    decision, _, rejected = decide_time_to_accuracy(CAST_RACE, lambda d: unread)
    assert decision.chosen == "fp32" and "cannot be read" in rejected[0]


def test_the_plan_installed_is_faster_to_the_same_accuracy_not_only_per_step():
    verdicts = {"c1": verdict("c1", gate.ACCEPTED, 0.5), "c2": verdict("c2", gate.ACCEPTED, 0.98),
                "bf16": verdict("bf16", gate.ACCEPTED)}
    decision, checked, rejected = decide_time_to_accuracy(MEASURED, lambda d: verdicts[d.chosen])
    # c1 steps 2x faster than bf16 but is worth only half an fp32 step: no faster to accuracy
    assert decision.chosen == "c2" and decision.compress
    assert decision.tta is not None and decision.tta.lower() > 1
    assert rejected and "c1" in rejected[0] and "time to accuracy" in rejected[0]
    assert "time to accuracy" in decision.reason


def test_an_unproven_plan_leaves_the_baseline_standing_with_the_reason():
    verdicts = {"c1": verdict("c1", gate.NOT_PROVEN), "c2": verdict("c2", gate.REJECTED),
                "bf16": verdict("bf16", gate.ACCEPTED)}
    decision, _, rejected = decide_time_to_accuracy(MEASURED, lambda d: verdicts[d.chosen])
    assert decision.chosen == "bf16" and not decision.compress
    assert len(rejected) == 2 and "not proven" in decision.reason


def test_an_efficiency_above_one_is_capped_so_luck_cannot_make_a_plan_look_faster():
    verdicts = {"c1": verdict("c1", gate.ACCEPTED, 1.4)}
    decision, _, _ = decide_time_to_accuracy(MEASURED, lambda d: verdicts[d.chosen])
    assert decision.tta.value == pytest.approx(decision.step_speedup().value)


def test_a_proven_plan_is_re_timed_and_its_time_to_accuracy_rests_on_the_re_timing_not_the_race():
    # the race says c1 is 1.99x bf16 per step; measured again alone it is 1.05x, which with an
    # efficiency of 0.98 cannot show it faster: c2 is re-timed in its turn and holds
    verdicts = {"c1": verdict("c1", gate.ACCEPTED, 0.98, se=0.005), "c2": verdict("c2", gate.ACCEPTED, 0.98, se=0.005)}
    again = {"c1": ev.Estimate(1.05, 0.02, 4), "c2": ev.Estimate(1.30, 0.02, 4)}
    asked = []

    def retime(decision, arm):
        asked.append((decision.chosen, decision.best_baseline, arm.label))
        return again[decision.chosen]

    decision, _, rejected = decide_time_to_accuracy(MEASURED, lambda d: verdicts[d.chosen], retime=retime)
    assert asked == [("c1", "bf16", "c1"), ("c2", "bf16", "c2")]
    assert decision.chosen == "c2" and decision.retimed is again["c2"]
    assert decision.step_speedup() is again["c2"] and decision.tta.value == pytest.approx(1.30 * 0.98)
    assert "re-timed alone beside bf16: 1.30x" in decision.reason
    assert len(rejected) == 1 and "re-timed alone beside bf16: 1.05x" in rejected[0]
    assert "the race's 1.99x" in rejected[0]


def test_once_the_fastest_is_turned_down_the_runner_up_the_race_left_unresolved_is_judged_and_timed_again():
    # c1 wins the race and falls behind fp32; c2 stepped 1.3x bf16 in the race, but too unsteadily
    # to be shown faster (the race stopped once its winner was resolved)
    measured = [rounds("fp32", "fp32", 300, 310, 305), rounds("bf16", "16-bit", 200, 205, 202),
                rounds("c1", "candidate", 100, 104, 101), rounds("c2", "candidate", 110, 240, 115)]
    verdicts = {"c1": verdict("c1", gate.REJECTED), "c2": verdict("c2", gate.ACCEPTED, 0.99, se=0.005),
                "bf16": verdict("bf16", gate.ACCEPTED)}
    judged, asked = [], []

    def judge(decision):
        judged.append(decision.chosen)
        return verdicts[decision.chosen]

    def retime(decision, arm):
        asked.append(decision.chosen)
        return ev.Estimate(1.30, 0.02, 6)

    without, _, _ = decide_time_to_accuracy(measured, judge)
    assert without.chosen == "bf16" and judged == ["c1", "bf16"]  # no re-timing: the baseline stands
    judged.clear()
    decision, _, rejected = decide_time_to_accuracy(measured, judge, retime=retime)
    assert judged == ["c1", "c2"] and asked == ["c2"]
    assert decision.chosen == "c2" and decision.compress and decision.retimed.value == 1.30
    assert decision.tta.value == pytest.approx(1.30 * 0.99)
    assert "not beyond its noise" in decision.reason and "re-timed alone beside bf16: 1.30x" in decision.reason
    assert len(rejected) == 1 and rejected[0].startswith("c1")
    # timed again and still not shown faster to accuracy: the baseline stands, with both figures
    judged.clear()
    decision, _, rejected = decide_time_to_accuracy(measured, judge, retime=lambda d, arm: ev.Estimate(1.01, 0.02, 6))
    assert decision.chosen == "bf16" and judged == ["c1", "c2", "bf16"]
    assert "c2" in rejected[1] and "re-timed alone beside bf16: 1.01x" in rejected[1]


def test_only_a_plan_the_trial_proved_is_re_timed():
    verdicts = {"c1": verdict("c1", gate.NOT_PROVEN), "c2": verdict("c2", gate.REJECTED),
                "bf16": verdict("bf16", gate.ACCEPTED)}
    asked = []
    decision, _, _ = decide_time_to_accuracy(MEASURED, lambda d: verdicts[d.chosen],
                                             retime=lambda d, arm: asked.append(d.chosen))
    assert decision.chosen == "bf16" and asked == [] and decision.retimed is None
    # proven, but fp32's curve gave no efficiency: no time to accuracy to build on a re-timing
    decision, _, rejected = decide_time_to_accuracy(MEASURED[:3], lambda d: verdict(d.chosen, gate.ACCEPTED),
                                                    retime=lambda d, arm: asked.append(d.chosen))
    assert asked == [] and decision.chosen == "bf16" and "cannot be read" in rejected[0]


# c1 and c2 are the same compressor in two layouts: the race has c1 ahead by a hair, inside its noise
CLOSE = [rounds("fp32", "fp32", 300, 310, 305), rounds("bf16", "16-bit", 200, 205, 202),
         rounds("c1", "candidate", 100, 108, 101), rounds("c2", "candidate", 103, 101, 106)]


def test_two_candidates_the_race_could_not_tell_apart_are_run_off_and_the_faster_goes_first():
    asked = []

    def runoff(leader, runner_up, race):
        asked.append((leader, runner_up))
        assert race.lower() < 1 < race.upper(), "run off only where the race could not tell them apart"
        return ev.Estimate(1.06, 0.01, 4)  # the leader's time over the runner-up's: c2 is 6% faster

    decision, _, _ = decide_time_to_accuracy(CLOSE, None, runoff=runoff)
    assert asked == [("c1", "c2")] and decision.chosen == "c2" and decision.compress
    assert "c2 went ahead of c1 in a run-off of the two alone" in decision.reason and "1.06x per step" in decision.reason
    # where the leader holds its place it stays chosen, and the reason says how sure that is
    decision, _, _ = decide_time_to_accuracy(CLOSE, None, runoff=lambda *_: ev.Estimate(0.95, 0.01, 4))
    assert decision.chosen == "c1" and "c1 went ahead of c2" in decision.reason


def test_the_run_off_sets_the_leader_beside_the_fastest_plan_in_another_bucket_layout_first():
    # c1 and c2 are two near-equal plans on DDP's buckets (the search's top few share a layout);
    # c3, one exchange for the whole model, raced a hair behind both
    joined = dataclasses.replace(rounds("c3", "candidate", 101, 106, 104), layout="in 4 MiB exchanges")
    asked = []

    def runoff(leader, runner_up, race):
        asked.append((leader, runner_up))
        return ev.Estimate(1.04, 0.01, 4)  # the joined plan 4% faster, alone

    decision, _, _ = decide_time_to_accuracy(CLOSE + [joined], None, runoff=runoff)
    assert asked == [("c1", "c3")] and decision.chosen == "c3"
    # a layout the race already showed slower leaves the run-off to the leader's own layout
    asked.clear()
    slower = dataclasses.replace(rounds("c3", "candidate", 120, 121, 122), layout="in 4 MiB exchanges")
    decision, _, _ = decide_time_to_accuracy(CLOSE + [slower], None, runoff=runoff)
    assert asked == [("c1", "c2")] and decision.chosen == "c2"


def test_no_run_off_where_the_race_already_separated_the_two_or_only_one_beat_the_baseline():
    asked = []
    decision, _, _ = decide_time_to_accuracy(MEASURED, None, runoff=lambda *a: asked.append(a))
    assert decision.chosen == "c1" and asked == []  # c2 was resolved slower than c1 in the race
    slow = CLOSE[:3] + [rounds("c2", "candidate", 150, 260, 110)]  # not shown faster than bf16
    decision, _, _ = decide_time_to_accuracy(slow, None, runoff=lambda *a: asked.append(a))
    assert decision.chosen == "c1" and asked == []


def test_a_run_off_winner_turned_down_for_accuracy_gives_the_loser_its_place_back():
    verdicts = {"c1": verdict("c1", gate.ACCEPTED, 0.99, se=0.005), "c2": verdict("c2", gate.REJECTED),
                "bf16": verdict("bf16", gate.ACCEPTED)}
    judged, asked = [], []

    def judge(decision):
        judged.append(decision.chosen)
        return verdicts[decision.chosen]

    def runoff(leader, runner_up, race):
        asked.append((leader, runner_up))
        return ev.Estimate(1.06, 0.01, 4)

    decision, _, rejected = decide_time_to_accuracy(CLOSE, judge, runoff=runoff)
    # the leader is proven first (a run-off for a plan that cannot be installed is time wasted),
    # then the run-off's winner is judged in its turn, turned down, and the leader comes back
    assert judged == ["c1", "c2", "c1"] and asked == [("c1", "c2")]
    assert decision.chosen == "c1" and len(rejected) == 1 and rejected[0].startswith("c2")
    # a leader the trial cannot prove is never run off
    asked.clear()
    unproven = {**verdicts, "c1": verdict("c1", gate.NOT_PROVEN), "c2": verdict("c2", gate.NOT_PROVEN)}
    decision, _, _ = decide_time_to_accuracy(CLOSE, lambda d: unproven[d.chosen], runoff=runoff)
    assert decision.chosen == "bf16" and asked == []


def test_the_run_off_measures_the_two_alone_until_one_is_faster_or_they_tie_and_is_reported():
    from rich.console import Console

    from advisor.runtime import Plan
    from advisor.tuning.results import AutotuneResult
    from advisor.tuning.steps import Arm, runoff_settled, runoff_timer

    # round medians: c2 steadily 4% faster than c1 from the fourth round on
    times = {"c1": [0.100, 0.104, 0.099] + [0.104] * 5, "c2": [0.101, 0.100, 0.100] + [0.100] * 5}
    calls = []

    def measure(pair, steps, first_rounds, max_rounds, settled_when):
        calls.append((sorted(pair), dict(steps), first_rounds, max_rounds))
        got = {label: [] for label in pair}
        while len(got["c1"]) < first_rounds or (len(got["c1"]) < max_rounds and not settled_when(got)):
            for label in pair:
                got[label].append(times[label][len(got[label])])
        return got

    arms = {label: Arm(label, "candidate", Plan.uniform("fp16"), None, label, 0.1, None) for label in ("c1", "c2")}
    record = []
    runoff = runoff_timer(measure, arms, turn=lambda arm: 15, max_rounds=8, record=record)
    step = runoff("c1", "c2", ev.Estimate(0.99, 0.02, 2))
    assert calls == [(["c1", "c2"], {"c1": 15, "c2": 15}, 3, 8)]
    assert len(record[0].plan_s) == 6 and step.lower() > 1, "more rounds until c2 was shown faster"
    assert runoff_settled(ev.Estimate(1.0, 0.001, 6)), "a tie within 3% settles it too"
    assert not runoff_settled(ev.Estimate(1.0, 0.05, 6))
    done = record[0]
    assert done.is_runoff and (done.label, done.baseline, done.steps) == ("c2", "c1", 15)
    result = AutotuneResult(
        plan=Plan.uniform("fp16").to_dict(), recommendation="c2", compress=True, description="c2", reason="why",
        predicted_s={}, measured=CLOSE, speedup={}, fidelity_error=0.1, fidelity_budget=0.2, reference=None,
        policy="optuna", policy_evaluations=1, seconds={}, world_size=2, where="here", retimed=[done])
    again = AutotuneResult.from_json(result.to_json())
    assert again == result and again.retimed[0].is_runoff
    console = Console(width=140, record=True)
    result.render(console)
    assert "Run-off after the race, runner-up beside leader: c2 100.0 vs c1 104.0 ms/step" in console.export_text()
    with pytest.raises(ValueError, match="purpose='other'; allowed: 'baseline', 'runoff'"):
        dataclasses.replace(done, purpose="other")


def test_without_an_optimizer_no_compressed_plan_can_be_proven():
    decision, _, rejected = decide_time_to_accuracy(MEASURED, unprovable("no optimizer"))
    assert decision.chosen == "bf16" and all("no optimizer" in r for r in rejected)


def test_without_an_optimizer_a_cast_in_another_layout_stands_as_the_cast_does():
    from constructed import tuning_profile

    from advisor.tuning.steps import short_list
    from policies.greedy import GreedyPolicy
    from policies.problem import TuningProblem

    problem = TuningProblem.from_profile(tuning_profile(n_buckets=4, numel=1024 * 1024), ["none", "bf16"], budget=0.3)
    joined = problem.with_layout(64.0)
    cast_arm = short_list(joined, GreedyPolicy().search(joined), 1)[0]
    # "c1", the fastest, is bf16 everywhere in joined exchanges; "c2" is a compressed plan
    arms = {"c1": dataclasses.replace(cast_arm, label="c1")}
    decision, _, rejected = decide_time_to_accuracy(MEASURED, unprovable("no optimizer", arms))
    assert decision.chosen == "c1" and not rejected
    # without the race's arms the judge cannot tell the cast from a compressed plan
    decision, _, rejected = decide_time_to_accuracy(MEASURED, unprovable("no optimizer"))
    assert decision.chosen == "bf16" and any(r.startswith("c1: not proven") for r in rejected)


def test_a_cast_in_smaller_buckets_is_installed_on_its_step_speed_up_with_the_casts_verdict():
    # "c1" runs bf16 everywhere on smaller DDP buckets: judged as the cast, which carries no efficiency
    cast_verdict = verdict("bf16", gate.ACCEPTED)
    decision, checked, rejected = decide_time_to_accuracy(MEASURED, lambda d: cast_verdict)
    assert decision.chosen == "c1" and decision.tta is None and not rejected
    assert checked == "bf16: accepted"


def test_a_cast_in_another_layout_shares_the_casts_one_accuracy_verdict():
    from constructed import tuning_profile

    from advisor.tuning.steps import LazyTrial, baseline_arms, short_list
    from policies.greedy import GreedyPolicy
    from policies.problem import TuningProblem

    class Trial:
        calls = []

        def start(self):
            pass

        def report(self):
            return None

        def trial(self, label, plan, kind, description, error):
            self.calls.append((label, plan, kind))
            return verdict(label, gate.ACCEPTED)

    problem = TuningProblem.from_profile(tuning_profile(n_buckets=4, numel=1024 * 1024), ["none", "fp16"], budget=0.3)
    lazy = LazyTrial(Trial(), problem, lambda _: None)
    smaller = problem.with_layout(None, 1.0)
    cast_arm = short_list(smaller, GreedyPolicy().search(smaller), 1)[0]
    lazy.judge_arm(baseline_arms(problem, "fp16")[1])
    assert lazy.judge_arm(cast_arm).accepted
    assert len(Trial.calls) == 1  # one trial of the cast, whatever its layout
    label, plan, kind = Trial.calls[0]
    assert (label, kind, plan.bucket_cap_mb, plan.exchange_mb) == ("fp16", gate.SIXTEEN_BIT, None, None)


def test_the_advices_evidence_shows_the_re_timed_step_speed_up_and_survives_json():
    from rich.console import Console

    from advisor.runtime import Plan
    from advisor.tuning.results import AutotuneResult, plan_evidence
    from policies.do_no_harm import Retiming, decide

    measured = MEASURED[:3]
    decision = decide(measured)
    decision.retimed = ev.paired_speedup([0.200, 0.204, 0.198], [0.180, 0.186, 0.181])
    timing = Retiming("c1", "bf16", 9, [0.180, 0.186, 0.181], [0.200, 0.204, 0.198], decision.retimed.value,
                      decision.retimed.lower(), decision.retimed.upper(), decision.step.value, 12.5)
    evidence = plan_evidence(measured, decision, {"c1": verdict("c1", gate.ACCEPTED, 0.99, se=0.004)})
    row = next(e for e in evidence if e.label == "c1")
    assert row.retimed and row.step_speedup == pytest.approx(decision.retimed.value)
    assert row.time_to_accuracy == pytest.approx(decision.retimed.value * 0.99)
    result = AutotuneResult(
        plan=Plan.uniform("fp16").to_dict(), recommendation="c1", compress=True, description="c1", reason="why",
        predicted_s={}, measured=measured, speedup={}, fidelity_error=0.1, fidelity_budget=0.2, reference=None,
        policy="optuna", policy_evaluations=1, seconds={}, world_size=2, where="here", evidence=evidence,
        retimed=[timing])
    assert AutotuneResult.from_json(result.to_json()) == result
    console = Console(width=120, record=True)
    result.render(console)
    shown = console.export_text()
    assert "Re-timed after the race: c1 181.0 vs bf16 200.0 ms/step, the two alone in 3 rounds of 9 steps: 1.10x" in shown
    assert "the race had said 1.99x" in shown and "per step re-timed" in shown


def test_the_best_baselines_own_time_to_accuracy_is_one_whatever_its_efficiency():
    from advisor.tuning.results import plan_evidence
    from policies.do_no_harm import decide

    decision = decide(CAST_RACE)
    assert decision.chosen == decision.best_baseline == "fp16"
    rows = {e.label: e for e in plan_evidence(CAST_RACE, decision, {"fp16": verdict("fp16", gate.NOT_PROVEN, 0.64)})}
    assert rows["fp16"].efficiency == pytest.approx(0.64) and rows["fp16"].time_to_accuracy == 1.0
    assert rows["fp32"].time_to_accuracy == pytest.approx(rows["fp32"].step_speedup)


def test_the_trial_says_what_an_evaluation_costs_and_where_it_checkpointed_and_survives_json():
    from rich.console import Console

    from advisor.runtime import Plan
    from advisor.tuning.accuracy import AccuracyTrialReport, ArmResult
    from advisor.tuning.results import AutotuneResult

    trial = AccuracyTrialReport(metric="loss", higher_is_better=False, checkpoints=[0, 4, 20, 36, 52, 68, 84, 85],
                                tolerance=0.01, se=0.3, detectable=0.9, powered=False, steps_needed=900, kappa=0.5,
                                kappa_se=0.1, progress=0.9, held_out=True, length_reason="the step budget",
                                seconds=30.0, evaluation_steps=3.84, evaluation_cost="timed")
    trial.arms = [ArmResult("fp32", gate.REFERENCE, "fp32 (native DDP)", [2.3] * 8, 5.0, True, "", 0.0,
                            efficiency=1.0, efficiency_se=0.0)]
    result = AutotuneResult(
        plan=Plan.uniform("bf16").to_dict(), recommendation="bf16", compress=False, description="bf16", reason="why",
        predicted_s={}, measured=MEASURED[:2], speedup={}, fidelity_error=0.0, fidelity_budget=0.0, reference=None,
        policy="optuna", policy_evaluations=1, seconds={}, world_size=2, where="here", accuracy=trial)
    again = AutotuneResult.from_json(result.to_json())
    assert again.accuracy.evaluation_steps == 3.84 and again.accuracy.evaluation_cost == "timed"
    console = Console(width=200, record=True)
    result.render(console)
    shown = console.export_text()
    assert "One evaluation costs about 3.8 training steps (timed); so 7 checkpoints: steps 4, 20, 36, 52, 68 ... 85" \
        in shown, shown
