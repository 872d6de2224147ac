"""Policies on constructed profiles: feasibility, optimality against baselines, determinism."""

import numpy as np
import pytest
from constructed import tuning_profile

from policies.base import distinct_best
from policies.do_no_harm import LiveMeasurement, decide
from policies.greedy import GreedyPolicy
from policies.learned import FEATURES, MeasurementSet, ResidualModel, plan_features
from policies.optuna_search import OptunaPolicy
from policies.problem import TuningProblem
from profilers.profile import FidelityProfile


def problem_at(rate, n_buckets=20, **kwargs):
    return TuningProblem.from_profile(tuning_profile(n_buckets=n_buckets, rate=rate), **kwargs)


def best_feasible_uniform(problem):
    uniforms = np.concatenate([problem.uniform(c) for c in problem.configs])
    return float(problem.predict(distinct_best(problem, uniforms, problem.predict(uniforms), 1)[0][None, :])[0])


@pytest.mark.parametrize("rate", [1e8, 1e9, 1e11])
def test_greedy_and_optuna_stay_within_budget_and_beat_every_feasible_uniform_plan(rate):
    problem = problem_at(rate)
    greedy = GreedyPolicy().search(problem)
    optuna = OptunaPolicy(n_trials=300, batch=50).search(problem)
    for result in (greedy, optuna):
        assert result.fidelity_error <= problem.budget + 1e-9
        assert result.predicted_s <= best_feasible_uniform(problem) + 1e-12
    assert optuna.predicted_s <= greedy.predicted_s + 1e-12  # seeded with the greedy plan


def test_doing_nothing_is_the_answer_on_a_fast_network():
    problem = problem_at(1e11)
    result = OptunaPolicy(n_trials=200).search(problem)
    assert problem.describe(result.choices) == "none everywhere"


def test_compression_is_chosen_on_a_slow_network():
    problem = problem_at(1e8)
    result = GreedyPolicy().search(problem)
    assert result.predicted_s < 0.5 * float(problem.predict(problem.uniform("none"))[0])
    assert "none everywhere" != problem.describe(result.choices)


def test_a_zero_budget_allows_only_lossless_plans():
    problem = problem_at(1e8, budget=0.0)
    for result in (GreedyPolicy().search(problem), OptunaPolicy(n_trials=200).search(problem)):
        assert result.fidelity_error == 0.0
        assert problem.describe(result.choices) == "none everywhere"


def test_optuna_is_deterministic_under_a_seed():
    problem = problem_at(1e9)
    a = OptunaPolicy(n_trials=300, seed=3).search(problem)
    b = OptunaPolicy(n_trials=300, seed=3).search(problem)
    assert np.array_equal(a.choices, b.choices)


def test_a_space_no_larger_than_the_trials_is_scored_whole_and_gives_the_exact_best_feasible_plan():
    import itertools

    problem = problem_at(1e8, n_buckets=3)
    every = np.array(list(itertools.product(range(len(problem.configs)), repeat=3)))
    fastest = every[np.argmin(problem.predict(every))]
    problem.budget = 0.5 * float(problem.fidelity_error(fastest[None, :])[0])  # the fastest plan is out of budget
    feasible = every[problem.feasible(every)]
    result = OptunaPolicy(n_trials=len(every)).search(problem)
    assert result.evaluations == len(every)  # each plan once, no study
    assert result.predicted_s == pytest.approx(float(problem.predict(feasible).min()), rel=1e-12)
    assert result.fidelity_error <= problem.budget
    assert len(result.ranked) == 8 and len({r.tobytes() for r in result.ranked}) == 8


def test_optuna_study_resumes_from_storage_and_refuses_another_problem(tmp_path):
    url = f"sqlite:///{tmp_path / 'study.db'}"
    problem = problem_at(1e9, n_buckets=6)
    policy = OptunaPolicy(n_trials=40, batch=20, storage=url, study_name="s", seed_with_greedy=False)
    policy.search(problem)
    study = policy.create_study(problem)
    first = len(study.trials)
    policy.search(problem)
    assert len(policy.create_study(problem).trials) == first + 40  # the seeds are among the 40
    other = problem_at(1e9, n_buckets=7)
    with pytest.raises(ValueError, match="made for another problem"):
        policy.search(other)


def test_bad_policy_parameters_name_the_value_and_what_is_allowed():
    problem = problem_at(1e9, n_buckets=3)
    with pytest.raises(ValueError, match="n_trials=0; allowed: an integer >= 1"):
        OptunaPolicy(n_trials=0).search(problem)
    with pytest.raises(ValueError, match="sampler='annealing'; allowed: nsga2, tpe, random"):
        OptunaPolicy(sampler="annealing").search(problem)
    with pytest.raises(ValueError, match="max_rounds=-1"):
        GreedyPolicy(max_rounds=-1).search(problem)


def test_problem_names_missing_fidelity_and_reference():
    prof = tuning_profile(n_buckets=3)
    with pytest.raises(ValueError, match="reference config 'signsgd' is not among the candidates"):
        TuningProblem.from_profile(prof, reference="signsgd")
    prof.fidelity = FidelityProfile(6, 2, [e for e in prof.fidelity.entries if e.config != "fp16"])
    with pytest.raises(ValueError, match="no fidelity measurement of 'fp16' on bucket 0"):
        TuningProblem.from_profile(prof)
    with pytest.raises(ValueError, match="budget=-1"):
        TuningProblem.from_profile(tuning_profile(n_buckets=3), budget=-1)


def test_plans_map_buckets_to_parameter_names_and_back():
    problem = problem_at(1e8, n_buckets=5)
    choices = np.array([0, 1, 4, 4, 2])
    plan = problem.plan(choices)
    assert plan.config_for("l2.weight").label == problem.configs[4]
    assert plan.config_for("l0.weight").label == "none"
    assert np.array_equal(problem.choices_for(plan)[0], choices)


# --- learned residual model ------------------------------------------------------------------

def _synthetic_measurements(problem, n, rng):
    """Measured = model x (1 + 0.6 x all-gather share + 0.3 x compressed share), with 2% noise."""
    plans = rng.integers(0, len(problem.configs), size=(n, problem.n_buckets))
    X = plan_features(problem, plans)
    predicted = problem.model.predict_many(plans, problem.costs)
    truth = predicted * (1 + 0.6 * X[:, FEATURES.index("all_gather_share")]
                         + 0.3 * X[:, FEATURES.index("compressed_share")])
    return plans, X, predicted, truth * rng.normal(1, 0.02, n)


def test_residual_model_reduces_error_on_held_out_plans():
    problem = problem_at(1e8, n_buckets=12)
    rng = np.random.default_rng(0)
    _, X, predicted, measured = _synthetic_measurements(problem, 60, rng)
    model = ResidualModel().fit(X[:40], predicted[:40], measured[:40])
    raw = np.abs(predicted[40:] - measured[40:]) / measured[40:]
    corrected = np.abs(model.predict(X[40:], predicted[40:]) - measured[40:]) / measured[40:]
    assert np.median(corrected) < 0.5 * np.median(raw)


def test_the_correction_changes_the_ranking_used_by_policies():
    problem = problem_at(1e8, n_buckets=12)
    rng = np.random.default_rng(1)
    _, X, predicted, measured = _synthetic_measurements(problem, 60, rng)
    problem.correction = ResidualModel().fit(X, predicted, measured)
    plans = rng.integers(0, len(problem.configs), size=(5, problem.n_buckets))
    assert not np.allclose(problem.predict(plans), problem.model.predict_many(plans, problem.costs))


def test_residual_model_refuses_bad_measurements():
    with pytest.raises(ValueError, match="one row per measurement"):
        ResidualModel().fit(np.zeros((4, 3)), [1, 1, 1], [1, 1, 1, 1])
    with pytest.raises(ValueError, match="NaN"):
        ResidualModel().fit(np.full((4, 3), np.nan), [1] * 4, [1] * 4)
    with pytest.raises(RuntimeError, match="not fitted"):
        ResidualModel().predict(np.zeros((1, 3)), [1.0])


def test_measurement_set_round_trips_and_fits(tmp_path):
    problem = problem_at(1e8, n_buckets=4)
    rng = np.random.default_rng(2)
    plans, X, predicted, measured = _synthetic_measurements(problem, 8, rng)
    data = MeasurementSet()
    for i in range(8):
        data.add("mlp@100mbit", problem.describe(plans[i]), X[i], predicted[i], measured[i])
    data.save(tmp_path / "m.json")
    loaded = MeasurementSet.load(tmp_path / "m.json")
    assert loaded == data
    assert loaded.fit().predict(X[:1], predicted[:1]).shape == (1,)
    (tmp_path / "bad.json").write_text('{"kind": "compression-advisor/plan", "version": 1}')
    with pytest.raises(ValueError, match="not a measurement set"):
        MeasurementSet.load(tmp_path / "bad.json")


# --- do no harm --------------------------------------------------------------------------------

def m(label, kind, *ms):
    return LiveMeasurement(label, kind, [x / 1e3 for x in ms])


def test_compression_is_recommended_only_beyond_the_measured_noise():
    clear = [m("fp32", "fp32", 200, 202, 201), m("fp16", "16-bit", 130, 131, 133), m("c1", "candidate", 70, 72, 71)]
    d = decide(clear)
    # the speed-up is the geometric mean of the per-round ratios, since rounds are paired
    assert d.compress and d.chosen == "c1"
    assert d.gain_vs_best_baseline == pytest.approx((130 / 70 * 131 / 72 * 133 / 71) ** (1 / 3))
    assert d.speedup_low < d.gain_vs_best_baseline < d.speedup_high
    noisy = [m("fp32", "fp32", 200, 202, 201), m("fp16", "16-bit", 100, 130, 115), m("c1", "candidate", 105, 107, 106)]
    d = decide(noisy)
    assert not d.compress and d.chosen == "fp16" and "noise" in d.reason


def test_a_candidate_shown_faster_is_not_hidden_by_a_noisier_one_with_a_lower_median():
    # c1's median is lower, but one round in three it is slower than fp16; c2 is faster in every round
    measured = [m("fp32", "fp32", 300, 302, 301), m("fp16", "16-bit", 200, 201, 202),
                m("c1", "candidate", 120, 125, 290), m("c2", "candidate", 150, 151, 152)]
    d = decide(measured)
    assert d.compress and d.chosen == "c2" and d.best_candidate == "c2"
    assert "c1 stepped faster (125.0 ms) but is not shown faster than fp16" in d.reason
    # with none shown faster, the fastest is the one named, and the baseline stands
    measured[3] = m("c2", "candidate", 150, 151, 290)
    d = decide(measured)
    assert not d.compress and d.chosen == "fp16" and d.best_candidate == "c1"


def test_sixteen_bit_must_beat_fp32_beyond_noise_too():
    d = decide([m("fp32", "fp32", 100, 110, 105), m("fp16", "16-bit", 102, 103, 101), m("c", "candidate", 104, 105, 106)])
    assert d.chosen == "fp32" and not d.compress


def test_do_no_harm_needs_the_fp32_baseline():
    with pytest.raises(ValueError, match="fp32 baseline"):
        decide([m("c", "candidate", 1, 1, 1)])
    with pytest.raises(ValueError, match="kind 'fast'"):
        m("x", "fast", 1)


def test_rounds_are_paired_so_drift_that_hits_both_plans_cancels():
    # each round drifts by up to 8%, but fp16 is 5-10% faster in every one of them: faster
    drifting = [m("fp32", "fp32", 38.0, 35.3, 36.4), m("fp16", "16-bit", 36.3, 33.4, 33.0)]
    assert decide(drifting).chosen == "fp16"
    # the same medians, but fp16 is slower in one round: not shown faster
    mixed = [m("fp32", "fp32", 38.0, 35.3, 36.4), m("fp16", "16-bit", 33.0, 36.3, 33.4)]
    assert decide(mixed).chosen == "fp32"


def test_measurements_of_unequal_rounds_are_compared_unpaired_from_their_own_spread():
    from policies.do_no_harm import step_speedup

    base = m("fp32", "fp32", 100, 102, 98)
    fast = m("c", "candidate", 80, 81, 79, 80)
    s = step_speedup(base, fast)
    assert s.value == pytest.approx(100 / 80, rel=0.02)
    assert s.se_log == pytest.approx((base.relative_se ** 2 + fast.relative_se ** 2) ** 0.5)
    assert decide([base, fast]).compress
    unsure = m("c", "candidate", 70, 130, 97, 99)
    assert not decide([base, unsure]).compress
