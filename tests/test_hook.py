"""The hook on real gloo process groups (2 and 3 local ranks)."""

import pytest
import rank_programs as rp
import torch

from advisor.runtime import Plan
from advisor.testbed.launch import RankFailed, launch_local

pytestmark = pytest.mark.slow

NONE = Plan.uniform("none", warmup_steps=0).to_dict()


def assert_same_params(a, b, exact=True):
    assert a.keys() == b.keys()
    for name in a:
        if exact:
            assert torch.equal(a[name], b[name]), name
        else:
            assert torch.allclose(a[name], b[name]), name


@pytest.mark.parametrize("world", [2, 3])
def test_mixed_plan_on_many_buckets_runs_in_lockstep(world):
    results = launch_local(rp.train_with_plan, world, (rp.mixed_plan().to_dict(), 110), timeout=240)
    assert results[0]["buckets"] >= 8
    assert results[0]["hook_step"] == 110
    for other in results[1:]:
        assert_same_params(results[0]["params"], other["params"])  # every rank applied the same update
    norms = results[0]["residual_norms"]
    assert all(torch.isfinite(torch.tensor(norms)))
    assert max(norms[55:]) < 2 * max(norms[:55])  # residuals stay bounded


@pytest.mark.parametrize("world", [2, 3])
def test_plan_none_is_bitwise_identical_to_ddp_without_a_hook(world):
    hooked = launch_local(rp.train_with_plan, world, (NONE, 12), timeout=120)
    plain = launch_local(rp.train_with_plan, world, (None, 12), timeout=120)
    assert_same_params(hooked[0]["params"], plain[0]["params"])
    assert hooked[0]["losses"] == plain[0]["losses"]


@pytest.mark.parametrize("spec,dtype", [("fp16", torch.float16), ("bf16", torch.bfloat16)])
def test_16_bit_casts_match_ddp_within_the_dtype_tolerance(spec, dtype):
    plan = Plan.uniform(spec, warmup_steps=0).to_dict()
    cast = launch_local(rp.grads_after_one_step, 2, (plan,), timeout=120)[0]
    exact = launch_local(rp.grads_after_one_step, 2, (None,), timeout=120)[0]
    for name in exact:
        info = torch.finfo(dtype)
        scale = exact[name].abs().max()
        subnormal_step = info.smallest_normal * info.eps  # absolute resolution near zero
        assert (cast[name] - exact[name]).abs().max() <= 4 * (info.eps * scale + subnormal_step), name


def test_checkpoint_and_resume_is_bitwise_identical_to_an_uninterrupted_run():
    plan = rp.mixed_plan(warmup_steps=5).to_dict()
    resumed = launch_local(rp.checkpoint_resume, 2, (plan, 20, 20), timeout=180)
    straight = launch_local(rp.uninterrupted, 2, (plan, 40), timeout=180)
    for r in range(2):
        assert_same_params(resumed[r], straight[r])


def test_warmup_steps_are_uncompressed():
    warm = launch_local(rp.train_with_plan, 2, (rp.mixed_plan(warmup_steps=6).to_dict(), 6), timeout=120)
    plain = launch_local(rp.train_with_plan, 2, (None, 6), timeout=120)
    assert_same_params(warm[0]["params"], plain[0]["params"])
    assert all(n == 0 for n in warm[0]["residual_norms"])


def _bad(plan: Plan, **change):
    d = plan.to_dict()
    d.update(change)
    return d


def test_a_plan_naming_missing_parameters_is_refused_on_every_rank():
    good = rp.mixed_plan().to_dict()
    bad = Plan.from_assignments({**rp.MIXED, "encoder.weight": "fp16"}).to_dict()
    results = launch_local(rp.install_expecting_error, 2, ([good, bad],), timeout=120)
    for r in results:
        assert r["error"] is not None and "rank 1" in r["error"]
        assert "missing from the model: 'encoder.weight'" in r["error"]
        assert r["alive"] == 2.0  # no rank hangs, the group still works


def test_ranks_with_different_plans_are_refused_on_every_rank():
    a = rp.mixed_plan().to_dict()
    b = Plan.from_assignments({**rp.MIXED, "fc1.weight": "powersgd(rank=4)"}).to_dict()
    results = launch_local(rp.install_expecting_error, 2, ([a, b],), timeout=120)
    for r in results:
        assert "ranks hold different plans" in r["error"]


def test_nan_on_one_rank_sends_that_bucket_uncompressed_and_resets_its_residual():
    plan = rp.mixed_plan().to_dict()
    reports = launch_local(rp.nonfinite_step, 2, (plan, 1, 8, 20), timeout=180)
    for rep in reports:
        at_bad = rep["grads_finite_at_bad_step"]
        assert at_bad["fc1.weight"] is False  # the NaN reaches every rank, as without compression
        assert all(ok for name, ok in at_bad.items() if name != "fc1.weight")
        assert rep["residuals_at_bad_step"]["fc1.weight"].abs().sum() == 0
        assert rep["residuals_at_bad_step"]["fc2.weight"].abs().sum() > 0  # others untouched
        assert rep["finite_steps"] == [s for s in range(20) if s != 8]
        assert rep["params_finite"]
        assert rep["events"] == 1
        assert sum("non-finite" in w for w in rep["warnings"]) == 1
        assert all(torch.isfinite(t).all() for t in rep["residuals_end"].values())
    assert_same_params(reports[0]["params"], reports[1]["params"])


def test_world_size_one_issues_no_collectives():
    result = launch_local(rp.count_collectives, 1, (rp.mixed_plan(warmup_steps=2).to_dict(), 8), timeout=120)[0]
    assert result["channel"] == "LocalChannel"
    assert result["step"] == 8
    assert all(torch.isfinite(p).all() for p in result["params"].values())


def test_a_plan_that_one_rank_cannot_read_is_refused_on_every_rank():
    plans = [rp.mixed_plan().to_dict(), {"kind": "y"}]
    results = launch_local(rp.install_expecting_error, 2, (plans,), timeout=120)
    for r in results:
        assert "rank 1: not a plan: 'kind' is 'y'" in r["error"]
        assert r["alive"] == 2.0


def test_an_unknown_compressor_names_the_parameter_and_the_allowed_names():
    bad = rp.mixed_plan().to_dict()
    bad["groups"][0]["compressor"] = {"name": "zip", "params": {}}
    results = launch_local(rp.install_expecting_error, 2, ([bad, bad],), timeout=120)
    for r in results:
        assert "plan group 0 (conv.weight): unknown compressor 'zip'; allowed: bf16, fp16" in r["error"]


def test_a_failing_rank_is_reported_by_number_not_a_hang():
    with pytest.raises(RankFailed, match="rank 1 failed"):
        launch_local(rp.fail_on_rank, 2, (1,), timeout=60)


def test_a_hanging_rank_ends_the_job_at_the_timeout():
    import time

    start = time.monotonic()
    with pytest.raises(RankFailed, match=r"did not finish within 8 s"):
        launch_local(rp.hang_on_rank, 2, (1,), timeout=8)
    assert time.monotonic() - start < 30


def test_the_hook_releases_itself_after_a_with_block_when_its_model_is_collected_and_when_pickled():
    from rank_programs import hook_lifetime

    for out in launch_local(hook_lifetime, 2, timeout=120):
        assert out["before"] == 0 and out["inside_with"] == 1 and out["after_with"] == 0, out
        assert out["running"] == 1 and out["after_collect"] == 0, out
        assert out["pickled_hook"] is None  # a result sent to another process carries data only


def test_buckets_exchanged_together_give_the_same_result_in_fewer_messages():
    plain = launch_local(rp.train_counting_messages, 2, (None, 6), timeout=120)[0]
    for spec in ("none", "fp16"):
        apart = Plan.uniform(spec, warmup_steps=0)
        joint = Plan.uniform(spec, warmup_steps=0, exchange_mb=1.0)  # the whole model in one exchange
        apart = launch_local(rp.train_counting_messages, 2, (apart.to_dict(), 6), timeout=120)[0]
        together = launch_local(rp.train_counting_messages, 2, (joint.to_dict(), 6), timeout=120)[0]
        assert_same_params(apart["params"], together["params"])  # exact: the same sums, element by element
        assert together["losses"] == apart["losses"], spec
        assert apart["messages_per_step"] >= 8 and together["messages_per_step"] == 1, spec
        if spec == "none":
            assert_same_params(plain["params"], together["params"])  # still DDP's own result, bitwise


@pytest.mark.parametrize("world", [2, 3])
def test_a_mixed_plan_exchanged_in_pairs_of_buckets_runs_in_lockstep(world):
    plan = Plan.from_assignments(rp.MIXED, warmup_steps=2, exchange_mb=0.008)  # about two buckets an exchange
    results = launch_local(rp.train_counting_messages, world, (plan.to_dict(), 12), timeout=180)
    assert results[0]["hook_step"] == 12
    for other in results[1:]:
        assert_same_params(results[0]["params"], other["params"])
        assert other["messages_per_step"] == results[0]["messages_per_step"]
    assert all(torch.isfinite(torch.tensor(results[0]["losses"])))
