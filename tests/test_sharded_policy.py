"""The sharded tuning problem: the step model, the budget, the search, and the profile document."""

import numpy as np
import pytest

import policies.sharded as ps
from policies.sharded import ShardedProblem, search_sharded
from profilers.sharded import ShardedGroupProfile, ShardedProfile

CONFIGS = ["none", "bf16", "intquant(bits=8, packed=1)"]


def profile(groups=3):
    """Groups of growing size: FSDP's own reduce-scatter 10, 20, 30 ms; bf16 halves it, int8 quarters it."""
    return ShardedProfile(
        world_size=2, step_s=0.100 + sum(0.010 * (g + 1) for g in range(groups)),
        groups=[ShardedGroupProfile(f"g{g}", [f"g{g}.weight"], 1000 * (g + 1),
                                    {"none": 0.010 * (g + 1), "bf16": 0.005 * (g + 1),
                                     "intquant(bits=8, packed=1)": 0.0025 * (g + 1)},
                                    {"none": 0.0, "bf16": 0.002, "intquant(bits=8, packed=1)": 0.010})
                for g in range(groups)],
        configs=CONFIGS)


def test_a_step_is_its_compute_plus_each_groups_reduce_scatter():
    problem = ShardedProblem(profile(), CONFIGS)
    assert problem.profile.compute_s == pytest.approx(0.100)
    assert problem.predict(problem.uniform("none"))[0] == pytest.approx(0.160)
    assert problem.predict(np.array([0, 1, 2]))[0] == pytest.approx(0.100 + 0.010 + 0.010 + 0.0075)


def test_the_search_takes_the_fastest_plan_within_the_budget():
    problem = ShardedProblem(profile(), CONFIGS, budget=None)
    assert problem.describe(search_sharded(problem, 1)[0]) == "intquant(bits=8, packed=1) everywhere"
    # the budget allows bf16 everywhere and 8-bit codes on a sixth of the values at most: the smallest group
    problem.budget = 0.002 + (0.010 - 0.002) / 6
    best = search_sharded(problem, 3)
    assert list(best[0]) == [2, 1, 1]
    assert all(problem.feasible(b)[0] for b in best)
    assert problem.predict(best[0])[0] <= problem.predict(best[1])[0] <= problem.predict(best[2])[0]


def test_the_greedy_walk_finds_what_the_exhaustive_search_finds_here(monkeypatch):
    problem = ShardedProblem(profile(5), CONFIGS, budget=0.004)
    exhaustive = search_sharded(problem, 1)[0]
    monkeypatch.setattr(ps, "EXHAUSTIVE_LIMIT", 1)
    greedy = search_sharded(problem, 1)[0]
    assert problem.predict(greedy)[0] == pytest.approx(problem.predict(exhaustive)[0])
    assert problem.feasible(greedy)[0]


def test_a_plan_gives_each_groups_parameters_its_config():
    problem = ShardedProblem(profile(), CONFIGS)
    plan = problem.plan(np.array([0, 1, 2]), warmup_steps=0)
    assert [plan.config_for(f"g{g}.weight").label for g in range(3)] == CONFIGS
    with pytest.raises(ValueError, match="one choice per group"):
        problem.plan(np.array([0, 1]))


def test_the_profile_round_trips_and_refuses_what_it_cannot_hold():
    p = profile()
    assert ShardedProfile.from_json(p.to_json()) == p
    data = p.to_dict()
    del data["groups"][0]["seconds"]["bf16"]
    with pytest.raises(ValueError, match="no measurement of"):
        ShardedProfile.from_dict(data)
    data = p.to_dict()
    data["groups"][1]["error"]["bf16"] = -1.0
    with pytest.raises(ValueError, match="finite number >= 0"):
        ShardedProfile.from_dict(data)
    with pytest.raises(ValueError, match="were not profiled"):
        ShardedProblem(p, ["none", "fp16"])
