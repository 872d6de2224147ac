"""The DDP options and training set-ups users write, under the hook (see option_programs.py)."""

from __future__ import annotations

import math

import pytest
import torch

from advisor.launch import launch_local

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
    "bf16 autocast": {"autocast": True},
    "gradient accumulation with no_sync": {"no_sync": True},
    "frozen parameters": {"frozen": True},
    "parameter groups and gradient clipping": {"groups": True, "clip": True},
    "uneven inputs under Join": {"uneven": True},
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


AUTOTUNE_CASES = {name: CASES[name] for name in (
    "find_unused_parameters, a module never used", "find_unused_parameters, a branch used every other step",
    "static_graph", "bf16 weights")}


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


def test_sparse_gradients_are_refused_before_the_first_step_on_every_rank_with_the_way_out():
    from option_programs import sparse_refusal

    for message in launch_local(sparse_refusal, 2, timeout=120):
        assert "['0.weight'] have sparse gradients" in message and "sparse=False" in message, message
