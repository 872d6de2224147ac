"""Bucket layout as part of the plan: DDP's buckets exchanged together where fewer rounds pay."""

import pytest
import rank_programs as rp
from constructed import tuning_profile

from advisor.runtime import Plan
from advisor.testbed.launch import launch_local
from advisor.tuning.steps import search, search_layouts
from advisor.tuning.whatif import what_if
from policies.greedy import GreedyPolicy
from policies.problem import TuningProblem

ROUND_S = 2e-3  # a message round's fixed cost: what many small buckets pay many times over


def small_buckets(round_s=ROUND_S):
    """50 buckets of 16 KiB: latency-bound, every round costs ``round_s``."""
    profile = tuning_profile(n_buckets=50, numel=64 * 64)
    profile.network.round_s = round_s
    return profile


def test_the_model_replays_buckets_exchanged_together_as_one_round_each():
    problem = TuningProblem.from_profile(small_buckets(), budget=0.35)
    merged = problem.with_layout(1.0)  # 50 x 16 KiB: all in one exchange
    assert merged.n_buckets == 1 and merged.model.members[0] == problem.model.buckets
    apart = problem.plan(problem.uniform("fp16")[0], warmup_steps=0)
    together = merged.plan(merged.uniform("fp16")[0], warmup_steps=0)
    assert together.exchange_mb == 1.0 and apart.exchange_mb is None
    # the model follows the plan's own layout, whichever problem it came from
    timeline = problem.model.predict(together)
    assert len(timeline.buckets) == 1 and len(problem.model.predict(apart).buckets) == 50
    # 50 rounds of 2 ms outlast backward (60 ms) by far; one round does not
    assert timeline.iteration_s < 0.75 * problem.model.predict(apart).iteration_s
    # one config over the joined buckets: their error is the size-weighted mean of theirs
    assert merged.fidelity_error(merged.uniform("powersgd(rank=1)"))[0] == pytest.approx(
        problem.fidelity_error(problem.uniform("powersgd(rank=1)"))[0])


def test_the_search_joins_buckets_where_rounds_dominate_and_keeps_ddps_where_overlap_pays():
    problem = TuningProblem.from_profile(small_buckets(), budget=0.35)
    found = search(GreedyPolicy(), problem)
    chosen, best, lines = search_layouts(GreedyPolicy(), problem, found)
    assert chosen.exchange_mb is not None and best.predicted_s < 0.8 * found.predicted_s
    assert lines[0].startswith("DDP's 50 buckets") and len(lines) >= 2
    assert chosen.plan(best.choices).exchange_mb == chosen.exchange_mb

    big = TuningProblem.from_profile(tuning_profile(n_buckets=12, numel=1024 * 1024), budget=0.35)
    found = search(GreedyPolicy(), big)
    chosen, best, lines = search_layouts(GreedyPolicy(), big, found)
    assert chosen is big and best is found  # 4 MiB buckets overlap backward; joining them only delays
    assert len(lines) >= 2  # the coarser layouts were still tried, and said so


def test_whatif_names_the_layout_a_compressor_is_predicted_under():
    found = what_if(small_buckets(), budget=0.35)
    rows = {r.config: r for r in found.rows}
    assert rows["powersgd(rank=1)"].exchange_mb is not None
    assert rows["powersgd(rank=1)"].predicted_s < rows["powersgd(rank=1)"].ddp_buckets_s
    assert rows["fp16"].exchange_mb is None and rows["none"].exchange_mb is None  # baselines stay DDP's


@pytest.mark.slow
def test_ddp_for_builds_ddp_with_the_layouts_buckets_and_the_plan_without_its_join():
    plan = Plan.uniform("fp16", warmup_steps=0, exchange_mb=0.02)
    built = launch_local(rp.built_for_layout, 2, (plan.to_dict(), 4), timeout=120)
    joined = launch_local(rp.train_counting_messages, 2, (plan.to_dict(), 4), timeout=120)[0]
    assert built[0]["bucket_bytes_cap"] == int(0.02 * (1 << 20)) and built[0]["installed_exchange_mb"] is None
    rp_params = joined["params"]
    for name, value in built[0]["params"].items():
        assert (value == rp_params[name]).all(), name  # the same fp16 sums, whichever buckets carried them
    assert "bucket_cap_mb=25 given, but the plan's layout sets DDP's buckets" in built[0]["refused"]
