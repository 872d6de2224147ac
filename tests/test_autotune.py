"""autotune on real ranks: it decides, every rank agrees, the user's model is untouched."""

import math

import pytest
import torch
import torch.nn as nn

import advisor
from advisor.emulated import EmulatedCluster, unavailable_reason
from advisor.launch import launch_local
from advisor.report import AutotuneResult
from autotune_programs import tune_and_train


def test_autotune_on_loopback_agrees_on_every_rank_and_leaves_the_model_untouched():
    out = launch_local(tune_and_train, 2, ({},), timeout=300)
    results = [o["result"] for o in out]
    assert results[0].recommendation == results[1].recommendation
    assert results[0].plan == results[1].plan
    r = results[0]
    assert all(o["unchanged"] for o in out), "profiling and live measurement must not train the user's model"
    assert {m.kind for m in r.measured} >= {"fp32", "16-bit"}
    assert all(len(m.round_s) == 2 for m in r.measured)
    # never slower than the strongest baseline it measured, beyond the noise it measured
    best_baseline = min(m.median_s for m in r.measured if m.kind != "candidate")
    assert r.measured_s(r.recommendation) <= best_baseline * (1 + max(m.noise for m in r.measured))
    assert r.fidelity_error <= r.fidelity_budget + 1e-9
    assert (out[0]["hook_steps"] is None) == (r.recommendation == "fp32")
    assert all(math.isfinite(x) for o in out for x in o["losses"])
    again = AutotuneResult.from_json(r.to_json())
    assert again.recommendation == r.recommendation and again.measured == r.measured


@pytest.mark.skipif(unavailable_reason() is not None, reason=str(unavailable_reason()))
def test_autotune_compresses_on_a_slow_link_and_installs_the_plan():
    with EmulatedCluster(hosts=2, rate="200mbit") as cluster:
        out = cluster.run(tune_and_train, ({"where": "test"},), timeout=600)
    r = out[0]["result"]
    assert r.compress, r.reason
    assert r.speedup["measured_vs_fp32"] > 1.5 and r.speedup["measured_vs_16bit"] > 1.0
    assert out[0]["hook_steps"] == 4  # installed on the user's model, ran the 4 training steps
    assert all(o["unchanged"] for o in out)


def test_autotune_refuses_bad_arguments_before_doing_anything():
    with pytest.raises(TypeError, match="DistributedDataParallel"):
        advisor.autotune(nn.Linear(2, 2), lambda m, b: m(b).sum(), [torch.zeros(1, 2)])


def test_switching_to_an_uncompressed_plan_delivers_the_residual():
    from autotune_programs import switch_plans

    applied, true, history = launch_local(switch_plans, 1, timeout=120)[0]
    for a, t in zip(applied, true):
        torch.testing.assert_close(a, t, rtol=1e-5, atol=1e-6)
    assert history == ["installed", "test"]
