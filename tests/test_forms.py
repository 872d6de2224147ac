"""Kernel forms: every form computes the same thing, the device's faster one is chosen, and the
plan carries it to the hook on every rank."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from advisor.compressors import SegmentLayout, parse
from advisor.compressors.forms import CHOICE_MARGIN, CHOICES, check_forms, choose_forms, form_of
from advisor.runtime import Plan
from advisor.runtime.simulate import SimulatedRanks
from advisor.testbed.launch import launch_local

BIG = SegmentLayout(("w", "b"), ((1024, 512), (512,)))  # 2^19 elements: out of cache, where forms differ


def _grads(seed: int, world: int = 2) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(BIG.numel, generator=gen) for _ in range(world)]


@pytest.mark.parametrize("spec, choice", [
    ("powersgd(rank=1)", "powersgd-outer-rank1"),
    ("powersgd(rank=4)", "powersgd-outer-rank2-4"),
    ("powersgd(rank=8)", "powersgd-projection"),
])
def test_powersgd_gives_the_same_mean_and_residual_in_every_form(spec, choice):
    results = {}
    for form in CHOICES[choice].forms:
        sim = SimulatedRanks(2, forms={choice: form})
        outs = [sim.exchange(parse(spec).build(), _grads(step), BIG)[0] for step in range(3)]  # warm Q, residuals
        results[form] = (outs, [r.norm() for r in sim.residuals])
    (a, ra), (b, rb) = results.values()
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-5)
    assert ra == pytest.approx(rb, rel=1e-4)


def test_packed_integer_quantisation_is_bitwise_the_same_through_int32_or_directly():
    outs = {}
    for form in CHOICES["intquant-conversion"].forms:
        sim = SimulatedRanks(2, forms={"intquant-conversion": form})
        outs[form] = [sim.exchange(parse("intquant(bits=8)").build(), _grads(step), BIG)[0] for step in range(2)]
    for x, y in zip(*outs.values()):
        assert torch.equal(x, y)


def test_the_faster_form_is_chosen_only_beyond_the_margin():
    timings = {"powersgd-outer-rank1": {"matmul": 1.8e-3, "rank1-updates": 1.4e-3},  # 22% faster: chosen
               "powersgd-outer-rank2-4": {"matmul": 1.0e-3, "rank1-updates": 2.9e-3},
               "powersgd-projection": {"direct": 1.0e-3, "transposed": (1 - CHOICE_MARGIN / 2) * 1e-3},  # noise
               "intquant-conversion": {"direct": 1.3e-3, "via-int32": 2.1e-3}}
    assert choose_forms(timings) == {"powersgd-outer-rank1": "rank1-updates", "powersgd-outer-rank2-4": "matmul",
                                     "powersgd-projection": "direct", "intquant-conversion": "direct"}


def test_unknown_choices_and_forms_are_refused_naming_the_allowed_ones():
    with pytest.raises(ValueError, match="unknown kernel choice 'gemm'; allowed: "):
        check_forms({"gemm": "fast"})
    with pytest.raises(ValueError, match=r"has no form 'loop'; allowed: \['direct', 'transposed'\]"):
        Plan.uniform("powersgd(rank=8)", kernel_forms={"powersgd-projection": "loop"})
    assert form_of({}, "powersgd-projection") == "direct" and form_of(None, "intquant-conversion") == "direct"


def test_a_plan_carries_its_forms_through_json_and_its_digest_tells_them_apart():
    forms = {"powersgd-outer-rank1": "rank1-updates"}
    plan = Plan.uniform("powersgd(rank=1)", kernel_forms=forms)
    again = Plan.from_json(plan.to_json())
    assert again.kernel_forms == forms and again.digest() == plan.digest()
    assert Plan.uniform("powersgd(rank=1)").digest() != plan.digest()
    assert "kernel_forms" not in Plan.uniform("fp16").to_dict()  # plans without forms read as before


def test_the_kernel_profile_chooses_forms_on_the_device_and_plans_made_from_it_carry_them():
    from profilers.kernels import profile_kernels, square_layout

    profile = profile_kernels([square_layout(1 << 12)], ["powersgd(rank=1)"], ladder=(), repeats=1)
    assert set(profile.forms) == set(CHOICES) and set(profile.form_seconds) == set(CHOICES)
    for choice, seconds in profile.form_seconds.items():
        assert set(seconds) == set(CHOICES[choice].forms) and all(t > 0 for t in seconds.values())
    assert profile.forms == choose_forms(profile.form_seconds)
    given = profile_kernels([square_layout(1 << 12)], ["fp16"], ladder=(), repeats=1,
                            forms={"powersgd-projection": "transposed"})
    assert given.forms == {"powersgd-projection": "transposed"} and given.form_seconds == {}


def hooked_forms(rank: int, world_size: int, forms: dict):
    """One step of a DDP model under a PowerSGD plan with ``forms``: the forms its outer products ran."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    import advisor
    import advisor.compressors.powersgd as powersgd

    seen = []
    original = powersgd.outer_product_

    def spy(*args, form="matmul", **kwargs):
        seen.append(form)
        return original(*args, form=form, **kwargs)

    powersgd.outer_product_ = spy
    try:
        torch.manual_seed(0)
        ddp = DDP(nn.Linear(1024, 512))
        hook = advisor.install(ddp, Plan.uniform("powersgd(rank=1)", warmup_steps=0, kernel_forms=forms))
        ddp(torch.randn(8, 1024)).sum().backward()
        hook.close()
    finally:
        powersgd.outer_product_ = original
    return sorted(set(seen))


def test_the_hook_runs_the_forms_its_plan_names():
    assert launch_local(hooked_forms, 2, ({"powersgd-outer-rank1": "rank1-updates"},), timeout=120)[0] == \
        ["rank1-updates"]
    assert launch_local(hooked_forms, 2, ({},), timeout=120)[0] == ["matmul"]


def test_a_cluster_profile_keeps_its_forms_and_a_profile_from_before_them_reads_as_defaults():
    import json

    from test_perfmodel import profile

    from profilers.profile import ClusterProfile

    prof = profile([(1 << 20, 0.01)], kernel_s_per_element={"powersgd(rank=1)": (1e-9, 1e-9)})
    prof.kernels.forms = {"powersgd-outer-rank1": "rank1-updates"}
    prof.kernels.form_seconds = {"powersgd-outer-rank1": {"matmul": 1.8e-3, "rank1-updates": 1.4e-3}}
    again = ClusterProfile.from_json(prof.to_json())
    assert again.kernels.forms == prof.kernels.forms and again.kernels.form_seconds == prof.kernels.form_seconds
    data = json.loads(prof.to_json())
    del data["kernels"]["forms"], data["kernels"]["form_seconds"]
    assert ClusterProfile.from_dict(data).kernels.forms == {}
    data["kernels"]["forms"] = {"powersgd-outer-rank1": "fast"}
    with pytest.raises(ValueError, match="has no form 'fast'"):
        ClusterProfile.from_dict(data)


def test_every_plan_the_search_makes_from_a_profile_carries_its_forms():
    from test_perfmodel import profile

    from policies.problem import TuningProblem
    from profilers.profile import FidelityEntry, FidelityProfile

    prof = profile([(1 << 20, 0.01), (1 << 18, 0.02)], kernel_s_per_element={"powersgd(rank=1)": (1e-9, 1e-9)})
    prof.kernels.forms = {"powersgd-outer-rank1": "rank1-updates"}
    prof.fidelity = FidelityProfile(4, 2, [FidelityEntry(b.index, "powersgd(rank=1)", 0.5, 0.5)
                                           for b in prof.compute.buckets])
    problem = TuningProblem.from_profile(prof, ["none", "powersgd(rank=1)"], budget=1.0)
    assert problem.plan(problem.uniform("powersgd(rank=1)")[0]).kernel_forms == prof.kernels.forms
