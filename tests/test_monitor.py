"""The fidelity monitor, and the watch that backs a plan off when what it delivers drifts."""

from __future__ import annotations

import pytest
import torch.nn as nn

from advisor.runtime import FidelityMonitor, FidelityReading
from advisor.testbed.launch import launch_local


@pytest.fixture(scope="module")
def windows():
    """Two windows of 4 synchronised steps (and 4 under no_sync) per plan, on 2 ranks."""
    from autotune_programs import monitored_steps

    return {label: launch_local(monitored_steps, 2, (label, 4), timeout=300)
            for label in ("topk(ratio=0.05)", "fp16")}


def test_each_window_is_read_once_on_every_rank_alike_and_steps_under_no_sync_do_not_count(windows):
    for label, ranks in windows.items():
        first, second = ranks[0]["readings"]
        assert (first["first_step"], first["steps"]) == (0, 4)
        assert (second["first_step"], second["steps"]) == (4, 4)
        assert ranks[0]["readings"] == ranks[1]["readings"], label


def test_a_sample_of_coordinates_reads_the_error_of_the_whole_gradient(windows):
    for label, ranks in windows.items():
        sampled, whole = ranks[0]["readings"][0]["error"], ranks[0]["whole_window_error"]
        assert sampled == pytest.approx(whole, rel=0.2), label
    assert windows["fp16"][0]["readings"][0]["error"] < 1e-3  # rounding only, at these magnitudes


def test_error_feedback_counts_what_one_step_leaves_out_and_the_next_sends(windows):
    reading = windows["topk(ratio=0.05)"][0]["readings"][0]
    assert reading["error"] < 0.8 * reading["step_error"]


@pytest.fixture(scope="module")
def converging():
    """Noiseless regression under AdamW, 400 steps: fp32, bf16 and fp16 watched, and fp16 unwatched."""
    from autotune_programs import converging_regression

    runs = [("none", 2048, False), ("bf16", 2048, False), ("fp16", 2048, False), ("fp16", 0, False),
            ("fp16", 2048, True)]
    return launch_local(converging_regression, 2, (400, runs), timeout=300)


def test_fp16_passes_early_then_stalls_late_when_nothing_watches_it(converging):
    fp32, _, _, unwatched, _ = converging[0]
    assert unwatched["curve"][1] == pytest.approx(fp32["curve"][1], rel=0.2)  # step 100: as good as fp32
    assert unwatched["curve"][-1] > 100 * fp32["curve"][-1]  # step 400: its gradients flushed to zero


def test_the_watch_backs_fp16_off_to_bf16_late_on_every_rank_and_then_reaches_fp32s_loss(converging):
    watched = converging[0][2]
    assert watched["digest"] == converging[1][2]["digest"] and watched["final"] == "bf16"
    backoffs = [(step, detail) for step, what, detail in watched["events"] if what == "back-off"]
    assert len(backoffs) == 1 and "fp16 -> bf16" in backoffs[0][1], watched["events"]
    assert backoffs[0][0] > 100  # late: the first windows were its reference and stayed close to it
    drift = next(d for s, w, d in watched["events"] if w == "fidelity" and s == backoffs[0][0])
    assert "two windows in a row" in drift and "flushed to zero" in drift
    assert watched["curve"][-1] < 3 * converging[0][0]["curve"][-1]


def test_a_plan_installed_elsewhere_is_watched_through_its_hook_which_outlives_the_watch(converging):
    wrapped, installed = converging[0][2], converging[0][4]
    assert installed["events"][0][2].startswith("watching the installed plan")
    assert [(s, w) for s, w, _ in installed["events"][1:]] == [(s, w) for s, w, _ in wrapped["events"][1:]]
    assert installed["final"] == "bf16" and installed["curve"] == pytest.approx(wrapped["curve"], rel=1e-6)
    assert installed["hook_steps"] == 410  # the last 10 steps ran under the hook after the watch closed


def test_wrap_refuses_a_hook_it_cannot_watch_naming_the_fix():
    from autotune_programs import wrong_hooks

    other, not_a_hook, with_plan = launch_local(wrong_hooks, 1, timeout=60)[0]
    assert other.startswith("ValueError") and "installed on another model" in other
    assert not_a_hook.startswith("TypeError") and "result.hook" in not_a_hook
    assert with_plan.startswith("ValueError") and "pass plan= or trend_steps= only without it" in with_plan


def test_the_watch_does_not_fire_on_fp32_or_bf16_over_the_same_run(converging):
    fp32, bf16 = converging[0][0], converging[0][1]
    for run in (fp32, bf16):
        assert not [e for e in run["events"] if e[1] == "back-off"], run["events"]
    assert fp32["readings"] == []  # plan none: nothing is compressed, nothing to sample
    assert len(bf16["readings"]) >= 14 and max(r[2] for r in bf16["readings"]) < 0.01


def test_the_monitor_refuses_bad_settings_naming_them():
    class Hook:
        observers, deliveries = [], []

    params = list(nn.Linear(2, 2).named_parameters())
    with pytest.raises(ValueError, match="sample=0"):
        FidelityMonitor(Hook(), params, sample=0)
    with pytest.raises(ValueError, match="window=1"):
        FidelityMonitor(Hook(), params, window=1)


def test_a_reading_describes_itself_with_its_numbers():
    reading = FidelityReading(first_step=25, steps=25, coordinates=900, error=0.6, step_error=0.7, zeroed=0.73,
                              per_coordinate=True, by_config={"fp16": 0.6})
    text = reading.describe()
    assert "steps 25-49" in text and "60.00% summed" in text and "73.0% of entries flushed" in text
    assert text.startswith("per-coordinate")


def test_a_periodic_re_trial_backs_off_a_plan_shown_behind_fp32_and_clears_one_that_is_not():
    from autotune_programs import retrialled_digits

    out = launch_local(retrialled_digits, 2, (["randomk(ratio=0.001, no-ef)", "bf16", "none"], 310), timeout=600)
    harmful, cast, fp32 = (out[0][label] for label in ("randomk(ratio=0.001, no-ef)", "bf16", "none"))
    for label in out[0]:
        assert out[0][label]["final"] == out[1][label]["final"], label  # every rank backed off alike
    (step, gap, status), = harmful["retrials"]
    # the plan learns nothing while fp32 leaves its plateau: far behind, by however much its early stop reads
    assert step == 300 and status == "rejected" and gap > 0.5
    at, backoff = next((s, d) for s, w, d in harmful["events"] if w == "back-off")
    assert at == 300 and "randomk(ratio=0.001, no-ef) ->" in backoff and "re-trial showed it" in backoff
    assert cast["retrials"][0][2] == "accepted" and "back-off" not in [w for _, w, _ in cast["events"]]
    assert "next at step" in next(d for _, w, d in cast["events"] if w == "re-trial")
    assert fp32["retrials"] == []  # plan none: nothing to re-trial


def test_a_plans_warm_up_steps_are_not_read_as_its_reference():
    from autotune_programs import monitored_after_warmup

    readings = launch_local(monitored_after_warmup, 2, timeout=120)[0]
    assert [first for first, _ in readings] == [3, 5]  # steps 0-2 crossed uncompressed
    assert all(error > 0.1 for _, error in readings)  # top-k 5%'s own error, not the warm-up's zero
