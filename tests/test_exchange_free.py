"""Exchange-free trial arms: they train what DDP trains, and run only where they are cheaper."""

from __future__ import annotations

import math

import pytest
from accuracy_programs import exchange_free_beside_ddp
from constructed import tuning_profile

from advisor.perfmodel.model import PerformanceModel
from advisor.runtime import Plan
from advisor.testbed.launch import launch_local
from advisor.tuning.exchange_free import batch_bytes, exchange_free_pays, is_elementwise


def test_only_fp32_and_16_bit_casts_are_replayed_exchange_free():
    assert is_elementwise(None), "native fp32"
    assert is_elementwise(Plan.uniform("fp16")) and is_elementwise(Plan.uniform("bf16"))
    assert is_elementwise(Plan.from_assignments({"l0.weight": "bf16"}))
    for lossy in ("powersgd(rank=1)", "topk(ratio=0.01)", "intquant(bits=8)"):
        assert not is_elementwise(Plan.uniform(lossy)), lossy
    assert not is_elementwise(Plan.from_assignments({"l0.weight": "fp16", "l1.weight": "powersgd(rank=1)"}))


def test_exchange_free_arms_run_where_the_link_costs_more_than_the_extra_compute():
    import torch

    one_batch = batch_bytes((torch.zeros(32, 64), torch.zeros(32, dtype=torch.long)))
    assert one_batch == 32 * 64 * 4 + 32 * 8
    slow = PerformanceModel(tuning_profile(rate=1e8))  # 52 MB of fp32 gradients over 100 Mbit/s
    pays, why = exchange_free_pays(slow, one_batch)
    assert pays, why
    assert "exchange-free" in why and "over the link" in why
    fast = PerformanceModel(tuning_profile(rate=1e12))  # the link is no cost: twice the compute is
    pays, why = exchange_free_pays(fast, one_batch)
    assert not pays, why
    one_rank = PerformanceModel(tuning_profile(rate=1e8, world=1))
    assert exchange_free_pays(one_rank, one_batch) == (False, "one rank: nothing crosses a link")
    # a batch as large as the gradients costs more to gather than the exchange it saves
    assert not exchange_free_pays(slow, 60 * 1024 * 1024)[0]


def _worst_relative(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b), (a, b)
    return max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b))


# two ranks: a sum of two numbers has one order, so DDP's arithmetic is replayed exactly (the bound
# leaves room only for a library summing in another order); on four, gloo adds the ranks' values in
# another order than rank after rank, so fp32 differs in its last bits and a 16-bit cast in its own
@pytest.mark.slow
@pytest.mark.parametrize(("batchnorm", "world", "bounds"), [
    (False, 2, {"fp32": 1e-5, "fp32 (other order)": 1e-5, "fp16": 1e-5}),
    (True, 4, {"fp32": 1e-6, "fp32 (other order)": 1e-6, "fp16": 1e-4}),
], ids=["conv net, 2 ranks", "with BatchNorm, 4 ranks"])
def test_an_exchange_free_trial_trains_the_curves_ddp_trains(batchnorm, world, bounds):
    out = launch_local(exchange_free_beside_ddp, world, (batchnorm, 24), timeout=300)
    assert all(o["unchanged"] for o in out), "neither trial may step the user's model or optimizer"
    real, free = out[0]["real"], out[0]["free"]
    assert all(o["free"].arm("fp32").values == free.arm("fp32").values for o in out), \
        "every rank holds the same numbers"
    assert free.exchange_free and not real.exchange_free
    assert free.checkpoints == real.checkpoints
    for label, bound in bounds.items():
        worst = _worst_relative(free.arm(label).values, real.arm(label).values)
        assert worst < bound, (label, free.arm(label).values, real.arm(label).values)
    lossy = free.arm("powersgd")
    assert lossy.values and all(math.isfinite(v) for v in lossy.values), "a lossy plan trains on a real shadow beside"
    assert free.arm("fp32").values != free.arm("fp32 (other order)").values, "the pair still sees two orders"


def test_a_batch_sliced_from_a_corpus_gathers_its_own_bytes_not_the_corpus():
    import pickle

    import torch

    from advisor.tuning.exchange_free import _to_cpu

    corpus = torch.arange(1_000_000)
    batch = (corpus[:512].view(8, 64), {"mask": corpus[1000:1064]})
    assert len(pickle.dumps(batch)) > 8_000_000, "a pickled view carries its whole storage"
    sent = _to_cpu(batch)
    assert len(pickle.dumps(sent)) < 10_000
    assert torch.equal(sent[0], batch[0]) and torch.equal(sent[1]["mask"], batch[1]["mask"])


def test_on_a_slow_link_the_trials_share_of_the_run_is_priced_in_time_and_buys_more_steps():
    from advisor.tuning.autotune import priced_trial_budget
    from policies.problem import TuningProblem

    slow = TuningProblem.from_profile(tuning_profile(rate=1e8))
    free_s = 0.15  # an exchange-free fp32 step, far below fp32's seconds over this link
    steps, why = priced_trial_budget(slow, 600, 7, "fp16", free_s)
    assert steps > 600 and "exchange-free" in why and "600 run steps" in why, why
    over_the_link, why_link = priced_trial_budget(slow, 600, 7, "fp16", None)
    assert 600 <= over_the_link < steps, "dense arms over the link cost more, so they buy fewer steps"
    # priced at the slowest lossy plan, the trial's arm-steps cost no more than the run's share
    run_s = min(float(slow.predict(slow.uniform(c))[0]) for c in ("none", "fp16"))
    lossy_s = max(float(slow.predict(slow.uniform(c))[0]) for c in slow.configs if c not in ("none", "fp16", "bf16"))
    assert steps / 7 * (3 * free_s + 4 * lossy_s) <= 600 * run_s * 1.001
    fast = TuningProblem.from_profile(tuning_profile(rate=1e12))
    assert priced_trial_budget(fast, 600, 7, "fp16", None) == (600, "a share of the run"), \
        "where the trial's steps cost a run step or more, the budget stays one of steps"
