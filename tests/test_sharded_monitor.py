"""The fidelity monitor on sharded (FSDP2) models, and wrap_sharded backing a plan off when it drifts."""

from __future__ import annotations

import pytest
import sharded_programs as sp

from advisor.testbed.launch import launch_local


@pytest.fixture(scope="module")
def runs():
    """One 2-rank launch: a mixed plan's windows beside the whole buffers, and the converging regression."""
    return launch_local(sp.sharded_monitor_runs, 2, timeout=600)


def test_each_window_is_read_alike_on_every_rank_and_steps_without_sync_do_not_count(runs):
    a, b = (r["windows"] for r in runs)
    assert len(a["readings"]) == 2  # 8 synced steps in windows of 4; the 8 unsynced steps ran no reduce-scatter
    assert [(r["first_step"], r["steps"]) for r in a["readings"]] == [(0, 4), (4, 4)]
    for mine, theirs in zip(a["readings"], b["readings"]):
        assert {k: v for k, v in mine.items() if k != "whole"} == {k: v for k, v in theirs.items() if k != "whole"}


def test_a_sample_of_positions_reads_the_error_of_every_groups_whole_buffer(runs):
    for reading in runs[0]["windows"]["readings"]:
        assert reading["error"] == pytest.approx(reading["whole"], rel=0.2)
        assert reading["whole"] > 0.05  # PowerSGD rank 2 is far from exact: the check has something to see
        # each compressed group read on its own; the root's group, under FSDP's own path, is exact and not sampled
        by_name = {label.split("(")[0]: error for label, error in reading["by_config"].items()}
        assert set(by_name) == {"intquant", "powersgd", "fp16"}
        assert by_name["fp16"] < 1e-2 < by_name["powersgd"]


def test_the_monitor_detaches_from_every_comm_when_closed(runs):
    assert runs[0]["windows"]["watchers"] == [1, 1, 1]  # only the recorder is left


def test_wrap_sharded_backs_fp16_off_to_bf16_late_on_every_rank_and_then_reaches_fp32s_loss(runs):
    fp32, bf16, unwatched, watched = runs[0]["converging"]
    assert [e[:2] for e in watched["events"]] == [e[:2] for e in runs[1]["converging"][3]["events"]]
    assert unwatched["curve"][1] == pytest.approx(fp32["curve"][1], rel=0.2)  # step 100: as good as fp32
    assert unwatched["curve"][-1] > 100 * fp32["curve"][-1]  # step 400: its gradients flushed to zero
    backoffs = [(step, detail) for step, what, detail in watched["events"] if what == "back-off"]
    assert len(backoffs) == 1 and "-> bf16 everywhere" in backoffs[0][1], watched["events"]
    assert backoffs[0][0] > 100 and watched["final"] == "bf16"
    # bf16 is watched in turn, though the held-out passes leave the root's parameters unsharded
    assert not [d for _, w, d in watched["events"] if "not monitored" in d]
    assert max(first for first, *_ in watched["readings"]) >= backoffs[0][0]
    drift = next(d for s, w, d in watched["events"] if w == "fidelity" and s == backoffs[0][0])
    assert "two windows in a row" in drift and "flushed to zero" in drift
    assert watched["curve"][-1] < 3 * fp32["curve"][-1]


def test_wrap_sharded_does_not_fire_on_fp32_or_bf16_over_the_same_run(runs):
    fp32, bf16, _, _ = runs[0]["converging"]
    for run in (fp32, bf16):
        assert not [e for e in run["events"] if e[1] == "back-off"], run["events"]
    assert fp32["readings"] == []  # FSDP's own reduce-scatter: nothing compressed, nothing to sample
    assert len(bf16["readings"]) >= 14 and max(r[2] for r in bf16["readings"]) < 0.01


def test_wrap_sharded_refuses_bad_monitor_settings_naming_them():
    import torch.nn as nn

    import advisor

    for kwargs, said in (({"fidelity_window": 1}, "fidelity_window=1"), ({"fidelity_drift": 1}, "fidelity_drift=1"),
                         ({"fidelity_sample": -1}, "fidelity_sample=-1")):
        with pytest.raises(ValueError, match=said):
            advisor.wrap_sharded(nn.Linear(2, 2), None, **kwargs)
