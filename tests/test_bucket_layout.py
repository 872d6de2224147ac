"""Bucket layout as part of the plan: DDP's buckets exchanged together where fewer rounds pay."""

import dataclasses

import pytest
import rank_programs as rp
from constructed import tuning_profile

from advisor.runtime import Plan
from advisor.testbed.launch import launch_local
from advisor.tuning.steps import close_layouts_to_race, search, search_layouts, short_list, uniform_cast
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
    chosen, best, lines, _ = search_layouts(GreedyPolicy(), problem, found)
    assert chosen.exchange_mb is not None and best.predicted_s < 0.8 * found.predicted_s
    assert lines[0].startswith("DDP's 50 buckets") and len(lines) >= 2
    assert chosen.plan(best.choices).exchange_mb == chosen.exchange_mb

    # a 16-bit cast in joined exchanges is no baseline (those send DDP's buckets one by one):
    # it is raced as a candidate and judged for accuracy as the cast
    casts = TuningProblem.from_profile(small_buckets(), ["none", "bf16"], budget=0.35)
    assert all(uniform_cast(arm) is None for arm in short_list(casts, search(GreedyPolicy(), casts), 3))
    joined = casts.with_layout(1.0)
    arms = short_list(joined, search(GreedyPolicy(), joined), 3)
    assert uniform_cast(arms[0]) == "bf16" and arms[0].plan.exchange_mb == 1.0

    big = TuningProblem.from_profile(tuning_profile(n_buckets=12, numel=1024 * 1024), budget=0.35)
    found = search(GreedyPolicy(), big)
    chosen, best, lines, _ = search_layouts(GreedyPolicy(), big, found)
    assert chosen is big and best is found  # 4 MiB buckets overlap backward; joining them only delays
    assert len(lines) >= 2  # the coarser layouts were still tried, and said so


def test_a_join_is_priced_as_it_runs_on_ddp_built_for_it_or_joined_in_the_hook():
    # advisor.ddp_for runs a join as DDP's own buckets of its size, which DDP fills itself; on a DDP
    # model built otherwise the hook copies the joined buckets into one buffer and the result back
    profile = small_buckets()
    profile.compute.copy_s_per_byte = 3e-8  # slow copies: 2 x 800 KiB of them cost 49 ms
    problem = TuningProblem.from_profile(profile, budget=0.35)
    in_hook, in_ddp = problem.with_layout(1.0), problem.with_layout(1.0, join_in_ddp=True)
    assert in_ddp.exchange_mb == 1.0 and in_ddp.model.members == [[b] for b in in_ddp.model.buckets]
    assert [b.parameters for b in in_ddp.model.buckets] == [b.parameters for b in problem.with_layout(None, 1.0).model.buckets]
    hook_s, ddp_s = in_hook.predict(in_hook.uniform("fp16"))[0], in_ddp.predict(in_ddp.uniform("fp16"))[0]
    joined_bytes = sum(b.numel for b in problem.model.buckets) * 4
    assert hook_s - ddp_s == pytest.approx(2 * joined_bytes * 3e-8)  # a copy in and one out
    # a plan keeps the pricing of the problem it came from
    plan = in_ddp.plan(in_ddp.uniform("fp16")[0], warmup_steps=0)
    assert in_ddp.model.predict(plan).iteration_s == pytest.approx(ddp_s)
    assert problem.model.predict(plan).iteration_s == pytest.approx(hook_s)

    # so the copies decide the layout only where the hook must join: autotune's search (DDP built
    # for the advice) joins, a tuner on the user's own DDP keeps DDP's buckets
    found = search(GreedyPolicy(), problem)
    assert search_layouts(GreedyPolicy(), problem, found).problem.exchange_mb is not None
    assert search_layouts(GreedyPolicy(), problem, found, rebuild_ddp=False).problem is problem


def test_whatif_names_the_layout_a_compressor_is_predicted_under():
    found = what_if(small_buckets(), budget=0.35)
    rows = {r.config: r for r in found.rows}
    assert rows["powersgd(rank=1)"].exchange_mb is not None
    assert rows["powersgd(rank=1)"].predicted_s < rows["powersgd(rank=1)"].ddp_buckets_s
    assert rows["fp16"].exchange_mb is None and rows["none"].exchange_mb is None  # baselines stay DDP's


@pytest.mark.slow
def test_ddp_for_builds_ddp_with_the_layouts_buckets_and_the_plan_without_its_join():
    plan = Plan.uniform("fp16", warmup_steps=0, exchange_mb=0.02)
    built = launch_local(rp.built_for_layout, 2, (plan.to_dict(), 4, 0.01), timeout=120)
    joined = launch_local(rp.train_counting_messages, 2, (plan.to_dict(), 4), timeout=120)[0]
    assert built[0]["bucket_bytes_cap"] == int(0.02 * (1 << 20)) and built[0]["installed_exchange_mb"] is None
    rp_params = joined["params"]
    for name, value in built[0]["params"].items():
        assert (value == rp_params[name]).all(), name  # the same fp16 sums, whichever buckets carried them
    assert "bucket_cap_mb=25 given, but the plan's layout sets DDP's buckets" in built[0]["refused"]

    # a plan for buckets smaller than DDP's: DDP is built with that cap, and its rebuilt buckets are
    # the ones the performance model prices for it
    finer = built[0]
    assert finer["finer_cap"] == int(0.01 * (1 << 20))
    assert len(finer["finer_buckets"]) > 2 and finer["finer_buckets"] == finer["modelled_buckets"]
    assert finer["finer_warnings"] == []
    # on DDP built with its default buckets the plan runs, and says it was measured on others
    assert any("tuned for DDP built with bucket_cap_mb=0.01" in w and "advisor.ddp_for" in w
               for w in finer["other_warnings"])


def one_bucket(profile):
    """``profile`` as DDP built with one big bucket: every parameter in bucket 0, its errors the size-weighted mean."""
    from profilers.profile import Bucket, FidelityEntry

    compute = profile.compute
    sizes = {b.index: b.numel for b in compute.buckets}
    total = sum(sizes.values())
    entries = []
    for config in sorted({e.config for e in profile.fidelity.entries}):
        mine = [e for e in profile.fidelity.entries if e.config == config]
        mean = sum(e.relative_error * sizes[e.bucket] for e in mine) / total
        entries.append(FidelityEntry(0, config, mean, 1.0 - mean))
    order = sorted(compute.parameters, key=lambda p: p.ready_s)
    compute.buckets = [Bucket(0, [p.name for p in order], total)]
    profile.fidelity.entries = entries
    return profile


def test_the_search_takes_smaller_ddp_buckets_where_one_big_bucket_leaves_communication_after_backward():
    # 12 parameters of 4 MiB ready evenly through 60 ms of backward, in one bucket at 1 Gbit/s:
    # all 48 MiB cross after backward; in buckets of one parameter each, most cross during it
    problem = TuningProblem.from_profile(one_bucket(tuning_profile(n_buckets=12, numel=1024 * 1024)), budget=0.35)
    assert problem.n_buckets == 1
    finer = problem.with_layout(None, 1.0)
    assert finer.n_buckets == 12 and finer.bucket_cap_mb == 1.0
    # a parameter's error is its bucket's, whichever bucket carries it
    assert finer.fidelity_error(finer.uniform("powersgd(rank=1)"))[0] == pytest.approx(
        problem.fidelity_error(problem.uniform("powersgd(rank=1)"))[0])
    fp16 = finer.plan(finer.uniform("fp16")[0], warmup_steps=0)
    assert fp16.bucket_cap_mb == 1.0 and fp16.exchange_mb is None
    assert len(problem.model.predict(fp16).buckets) == 12  # the model follows the plan's layout
    assert problem.model.predict(fp16).iteration_s < 0.8 * problem.model.predict(
        Plan.uniform("fp16", warmup_steps=0)).iteration_s

    found = search(GreedyPolicy(), problem)
    chosen, best, lines, _ = search_layouts(GreedyPolicy(), problem, found)
    assert chosen.bucket_cap_mb == 1.0 and best.predicted_s < 0.9 * found.predicted_s
    assert any(line.startswith("DDP's buckets at 1 MiB (12)") for line in lines)
    assert search_layouts(GreedyPolicy(), problem, found, rebuild_ddp=False)[0] is problem  # wrap's race cannot run it

    # the 16-bit cast in smaller buckets is raced as a candidate, judged for accuracy as the cast
    casts = TuningProblem.from_profile(one_bucket(tuning_profile(n_buckets=12, numel=1024 * 1024)),
                                       ["none", "fp16"], budget=0.35)
    assert short_list(casts, search(GreedyPolicy(), casts), 3) == []  # on DDP's own buckets: the baseline
    smaller = casts.with_layout(None, 1.0)
    arms = short_list(smaller, search(GreedyPolicy(), smaller), 3)
    assert uniform_cast(arms[0]) == "fp16" and arms[0].plan.bucket_cap_mb == 1.0
    # whatif: a cast may take smaller buckets, fp32 stays native DDP on its own
    rows = {r.config: r for r in what_if(one_bucket(tuning_profile(n_buckets=12, numel=1024 * 1024)),
                                         budget=0.35).rows}
    assert rows["fp16"].bucket_cap_mb == 1.0 and rows["fp16"].predicted_s < rows["fp16"].ddp_buckets_s
    assert rows["fp16"].layout == " with DDP's buckets at 1 MiB"
    assert rows["none"].bucket_cap_mb is None and rows["none"].exchange_mb is None


def test_a_plan_holds_one_layout_and_names_the_two():
    with pytest.raises(ValueError, match="give one layout: exchange_mb joins DDP's buckets in the hook, "
                                         "bucket_cap_mb needs DDP built with smaller buckets"):
        Plan.uniform("fp16", exchange_mb=4, bucket_cap_mb=1)
    with pytest.raises(ValueError, match="bucket_cap_mb=-1; allowed: a size in MiB > 0"):
        Plan.uniform("fp16", bucket_cap_mb=-1)
    plan = Plan.uniform("fp16", bucket_cap_mb=1)
    assert Plan.from_dict(plan.to_dict()) == plan and plan.digest() != Plan.uniform("fp16").digest()


def test_a_layout_the_model_cannot_tell_from_the_chosen_one_is_named_for_the_race():
    # at this round cost joining the 50 small buckets is predicted 1% faster: inside the 3% margin, so
    # DDP's own buckets stay the choice and the join is handed to the race to settle
    problem = TuningProblem.from_profile(small_buckets(round_s=1.28e-3), budget=0.35)
    found = search(GreedyPolicy(), problem)
    chosen, best, _, close = search_layouts(GreedyPolicy(), problem, found)
    assert chosen is problem and best is found
    (joined, joined_best), = close
    assert joined.exchange_mb == 4.0 and found.predicted_s * 0.97 < joined_best.predicted_s < found.predicted_s
    # where the join wins by more than the margin, nothing is left close (DDP's own races beside it anyway)
    problem = TuningProblem.from_profile(small_buckets(), budget=0.35)
    assert search_layouts(GreedyPolicy(), problem, search(GreedyPolicy(), problem)).close == []


def test_the_report_tells_how_to_build_ddp_for_an_advice_in_smaller_buckets():
    from types import SimpleNamespace

    from rich.console import Console

    from advisor.report.results import render_layouts

    console = Console(record=True, width=200)
    render_layouts(SimpleNamespace(layouts=["DDP's 2 buckets: 10.0 ms (fp16 everywhere)",
                                            "DDP's buckets at 1 MiB (6): 8.0 ms (fp16 everywhere, with DDP's buckets "
                                            "at 1 MiB)"], exchange_mb=None, bucket_cap_mb=1.0), console)
    text = " ".join(console.export_text().split())
    assert "DDP's buckets at 1 MiB, smaller than the ones this DDP model was built with" in text
    assert "bucket_cap_mb=1 (advisor.ddp_for(module, result))" in text


def test_the_report_says_a_joined_advice_was_measured_on_ddp_built_for_it_and_runs_slower_joined():
    from types import SimpleNamespace

    from rich.console import Console

    from advisor.report.results import render_layouts

    console = Console(record=True, width=200)
    render_layouts(SimpleNamespace(layouts=["DDP's 2 buckets: 10.0 ms (fp16 everywhere)",
                                            "16 MiB exchanges (1): 8.0 ms (fp16 everywhere, in 16 MiB exchanges)"],
                                   exchange_mb=16.0, bucket_cap_mb=16.0), console)
    text = " ".join(console.export_text().split())
    assert "exchanged together up to 16 MiB, measured on a copy of DDP built with bucket_cap_mb=16" in text
    assert "advisor.ddp_for(module, result)" in text and "with a copy each, more slowly" in text


def test_the_race_settles_the_nearest_close_layout_in_each_direction():
    # the model can misjudge overlap against rounds either way, so a close finer layout (DDP rebuilt
    # with smaller buckets) must not shut out a close join, which 4 ranks on 2 cores measured faster
    problem = TuningProblem.from_profile(one_bucket(tuning_profile(n_buckets=12, numel=1024 * 1024)), budget=0.35)
    found = search(GreedyPolicy(), problem)
    finer, finer_too = problem.with_layout(None, 1.0), problem.with_layout(None, 4.0)
    joined, joined_too = problem.with_layout(16.0), problem.with_layout(64.0)

    def at(seconds):
        return dataclasses.replace(found, predicted_s=seconds)

    close = [(finer, at(0.100)), (finer_too, at(0.101)), (joined, at(0.102)), (joined_too, at(0.103))]
    raced = close_layouts_to_race(close)
    assert [p for p, _ in raced] == [finer, joined]  # the nearest each way, fastest predicted first
    assert close_layouts_to_race([(joined_too, at(0.1)), (joined, at(0.2))]) == [(joined_too, at(0.1))]
    assert close_layouts_to_race([]) == []
