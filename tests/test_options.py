"""The DDP options and training set-ups users write, under the hook (see option_programs.py)."""

from __future__ import annotations

import math

import pytest
import torch
from events import event_kinds

from advisor.testbed.launch import launch_local

CASES = {
    "find_unused_parameters, a module never used": {"unused": True, "ddp": {"find_unused_parameters": True}},
    "find_unused_parameters, a branch used every other step": {"sometimes": True,
                                                               "ddp": {"find_unused_parameters": True}},
    "find_unused_parameters and the user's all-reduce of the loss": {
        "unused": True, "log_loss": True, "ddp": {"find_unused_parameters": True}},
    "static_graph": {"ddp": {"static_graph": True}},
    "gradient_as_bucket_view": {"ddp": {"gradient_as_bucket_view": True}},
    "broadcast_buffers with BatchNorm": {"batchnorm": True, "ddp": {"broadcast_buffers": True}},
    "the user's all-reduce of the loss between steps": {"log_loss": True},
    "bf16 weights": {"dtype": torch.bfloat16},
    "fp16 weights": {"dtype": torch.float16},
    "bf16 autocast": {"autocast": "bf16"},
    "fp16 autocast with a GradScaler that overflows at first": {"autocast": "fp16", "scaler": 2.0 ** 19, "clip": True},
    "gradient accumulation with no_sync": {"no_sync": True},
    "frozen parameters": {"frozen": True},
    "parameter groups and gradient clipping": {"groups": True, "clip": True},
    "uneven inputs under Join": {"uneven": True},
    "torch.compile(model) inside DDP": {"compile": "aot_eager"},
    "torch.compile(ddp_model)": {"compile_ddp": "aot_eager"},
}


@pytest.fixture(scope="module")
def matrix():
    from option_programs import option_matrix

    out = launch_local(option_matrix, 2, (CASES,), timeout=600)
    assert out[0].keys() == out[1].keys()
    return out


@pytest.mark.parametrize("case", list(CASES))
def test_the_hook_trains_like_ddp_under(matrix, case):
    for rank, results in enumerate(matrix):
        r = results[case]
        assert r["error"] is None, f"rank {rank}: {r['error']}"
        assert r["none_bitwise"], "plan none is not bitwise DDP"
        assert r["ranks_agree"], "ranks ended with different parameters"
        ddp, mixed = r["ddp_losses"], r["mixed_losses"]
        assert all(math.isfinite(v) for v in mixed), mixed
        # a lossy plan trains on: its last loss stays near DDP's (these are 6 steps from the same start)
        assert abs(mixed[-1] - ddp[-1]) <= 0.25 * abs(ddp[0]), (ddp, mixed)
        assert math.isfinite(r["mixed_residual"])
        if CASES[case].get("scaler"):
            # the first scale overflows: DDP, plan none and the mixed plan all skip steps, the
            # mixed plan's residuals are reset there (not poisoned) and it trains on
            assert r["skipped"][0] >= 1 and r["skipped"][0] == r["skipped"][1], r["skipped"]
            assert r["skipped"][2] >= 1 and r["mixed_residual"] > 0, (r["skipped"], r["mixed_residual"])


AUTOTUNE_CASES = {name: CASES[name] for name in (
    "find_unused_parameters, a module never used", "find_unused_parameters, a branch used every other step",
    "static_graph", "bf16 weights", "fp16 weights", "uneven inputs under Join", "torch.compile(ddp_model)")}


@pytest.fixture(scope="module")
def autotuned():
    from option_programs import autotune_matrix

    return launch_local(autotune_matrix, 2, (AUTOTUNE_CASES,), timeout=600)


@pytest.mark.parametrize("case", list(AUTOTUNE_CASES))
def test_autotune_profiles_tunes_and_installs_under(autotuned, case):
    for rank, results in enumerate(autotuned):
        r = results[case]
        assert r["error"] is None, f"rank {rank}: {r['error']}\n{r.get('where', '')}"
        assert r["ranks_agree"], "ranks ended with different parameters"
        assert all(math.isfinite(v) for v in r["losses"]), r["losses"]
    assert autotuned[0][case]["advice"] == autotuned[1][case]["advice"]


WRAP_CASES = {name: case for name, case in CASES.items() if not case.get("uneven")}


@pytest.fixture(scope="module")
def wrapped():
    from option_programs import wrap_matrix

    return launch_local(wrap_matrix, 2, (WRAP_CASES,), timeout=600)


@pytest.mark.parametrize("case", list(WRAP_CASES))
def test_wrap_tunes_inside_the_loop_and_watches_a_plan_under(wrapped, case):
    for mode in ("tune", "watch"):
        runs = [results[f"{case}, {mode}"] for results in wrapped]
        for rank, r in enumerate(runs):
            assert r["error"] is None, f"{mode}, rank {rank}: {r['error']}"
            assert r["ranks_agree"], f"{mode}: ranks ended with different parameters"
            assert all(math.isfinite(v) for v in r["losses"]), r["losses"]
        assert event_kinds(runs[0]["events"]) == event_kinds(runs[1]["events"]) and runs[0]["plan"] == runs[1]["plan"]
    assert any(e.startswith("decided") for e in wrapped[0][f"{case}, tune"]["events"])
    assert any(e.startswith("fidelity: reference") for e in wrapped[0][f"{case}, watch"]["events"])


def test_wrap_refuses_uneven_inputs_under_join_on_every_rank_and_names_what_works():
    from option_programs import wrap_matrix

    for results in launch_local(wrap_matrix, 2, ({"uneven": CASES["uneven inputs under Join"]},), timeout=120):
        for mode in ("tune", "watch"):
            message = results[f"uneven, {mode}"]["error"]
            assert "wrap cannot tune under ddp.join()" in message and "advisor.autotune" in message, message


#: cases whose logic depends on the number of ranks (who joins early, who used which branch)
THREE_RANK_CASES = {name: CASES[name] for name in (
    "find_unused_parameters, a branch used every other step", "find_unused_parameters and the user's all-reduce of the loss",
    "uneven inputs under Join")}


@pytest.fixture(scope="module")
def three_ranks():
    from option_programs import option_matrix

    return launch_local(option_matrix, 3, (THREE_RANK_CASES,), timeout=600)


@pytest.mark.parametrize("case", list(THREE_RANK_CASES))
def test_the_hook_trains_like_ddp_on_three_ranks_under(three_ranks, case):
    for rank, results in enumerate(three_ranks):
        r = results[case]
        assert r["error"] is None, f"rank {rank}: {r['error']}"
        assert r["none_bitwise"] and r["ranks_agree"]
        assert abs(r["mixed_losses"][-1] - r["ddp_losses"][-1]) <= 0.25 * abs(r["ddp_losses"][0])


def test_sparse_gradients_cross_uncompressed_like_pytorchs_own_hook_and_the_tuners_tune_the_rest():
    from option_programs import sparse_matrix

    ranks = launch_local(sparse_matrix, 2, timeout=120)
    for r in ranks:
        assert r["none"]["digest"] == r["ddp"]["digest"], "plan none is not bitwise DDP with a sparse embedding"
        assert r["none"]["ranks_agree"] and r["lossy"]["ranks_agree"]
        assert all(math.isfinite(v) for v in r["lossy"]["losses"])
        assert abs(r["lossy"]["losses"][-1] - r["ddp"]["losses"][-1]) <= 0.25 * r["ddp"]["losses"][0]
        assert r["lossy"]["wire_bytes"] > 0
        assert r["autotune"]["searched_numel"] == 8 * 4 + 4, "only the dense head is searched"
        assert "decided" in r["wrap"]["events"] and r["wrap"]["ranks_agree"]
    assert ranks[0]["autotune"]["advice"] == ranks[1]["autotune"]["advice"]
