"""autotune_sharded: profile, trial, search, measure, decide and install for an FSDP2 model (2 ranks, gloo)."""

import pytest
import sharded_programs as sp
import torch
from events import happened_in_order, proven_online

from advisor.runtime import Plan
from advisor.runtime.sharded import EXACT_FP32
from advisor.testbed.launch import launch_local

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tuned():
    return launch_local(sp.autotune_wide, 2, ({"trial_s": 8.0},), timeout=600)


def test_every_rank_gets_the_same_advice_and_the_model_and_optimizer_end_as_they_began(tuned):
    a, b = tuned
    assert a["error"] is None and b["error"] is None, (a["error"], b["error"])
    assert a["result"]["plan"] == b["result"]["plan"]
    assert a["result"]["recommendation"] == b["result"]["recommendation"]
    assert a["kept"] and b["kept"]
    assert a["round_trip"] and b["round_trip"]


def test_the_profile_times_and_measures_every_config_of_every_group(tuned):
    profile = tuned[0]["result"]["profile"]
    assert [g["name"] for g in profile["groups"]] == ["(root)", "blocks.0", "blocks.1", "blocks.2"]
    block = profile["groups"][1]
    # 64x256 + 256 + 256x64 + 64 values, every rank's row of them (already even: no padding)
    assert block["numel"] == 64 * 256 + 256 + 256 * 64 + 64
    for g in profile["groups"]:
        assert set(g["seconds"]) == set(g["error"]) == set(profile["configs"])
        e = g["error"]
        # FSDP's own reduce-scatter is exact; fp16 keeps 10 mantissa bits, bf16 7, the 8-bit codes fewer
        assert e["none"] < 1e-6 < e["fp16"] < e["bf16"] < e["intquant(bits=8, packed=1)"] < 0.05, e
        # PowerSGD's rank-16 approximation loses less than rank 4's (the root's head is too small at 16: exact)
        assert e["powersgd(rank=16)"] < e["powersgd(rank=4)"] < 1.0, e
    assert profile["step_s"] > 0


def test_the_advice_is_measured_against_both_fp32_paths_and_installed_as_it_says(tuned):
    result = tuned[0]["result"]
    labels = [m["label"] for m in result["measured"]]
    assert "fp32" in labels and "fp32, exact all-to-all" in labels
    assert all(len(m["round_s"]) >= 3 for m in result["measured"])
    plan = Plan.from_dict(result["plan"])
    exact = plan.metadata.get(EXACT_FP32) == "all-to-all"
    for name, comm in tuned[0]["comms"].items():
        group = next(g for g in result["profile"]["groups"] if g["name"] == (name or "(root)"))
        config = plan.config_for(group["parameters"][0]).label
        expected = {"none": "ExactReduceScatter" if exact else "DefaultReduceScatter", "fp16": "ExactReduceScatter",
                    "bf16": "ExactReduceScatter"}.get(config, "PowerSGDReduceScatter" if config.startswith("powersgd")
                                                      else "IntReduceScatter")
        assert comm == expected, (name, config, comm)
    # the memory error feedback would cost is reported against the sharded parameters'
    memory = result["memory"]
    assert memory["sharded_parameter_bytes"] == 4 * (3 * (64 * 256 + 256 + 256 * 64 + 64) + 64 * 10 + 10) // 2
    uses_powersgd = any(c.name == "powersgd" for c in plan.configs())
    assert (memory["residual_bytes"] > 0) == uses_powersgd
    # training on under the advice keeps every rank's parameters identical
    for n, value in tuned[0]["full"].items():
        torch.testing.assert_close(value, tuned[1]["full"][n], rtol=0, atol=0)


def test_a_lossy_plan_is_installed_only_with_the_trials_proof(tuned):
    result = tuned[0]["result"]
    trial = result["accuracy"]
    assert trial is not None and trial["arms"][0]["label"] == "fp32"
    if result["compress"]:
        assert "accuracy:" in result["reason"] and trial["powered"]
    else:
        assert not any(e["status"] == "accepted" and e["kind"] == "candidate" and e["tta_low"] and e["tta_low"] > 1
                       for e in result["evidence"])
    assert "earned" in result["budget_reason"]
    if result["compress"]:  # its time to accuracy rests on a re-timing of it alone beside the baseline
        assert result["retimed"] and result["retimed"][-1]["label"] == result["recommendation"]


def test_a_proven_plan_is_re_timed_on_the_sharded_model_itself_which_ends_as_it_began(tuned):
    for o in tuned:
        retimed = o["retimed"]
        assert retimed["record"] == [("c", "fp32", 1, 3, 2.0)] and retimed["kept"]
        assert {line.split(": ")[-1] for line in retimed["said"] if line.startswith("round")} == {"fp32", "c"}


def test_autotune_sharded_refuses_a_missing_or_wrong_build_on_every_rank():
    wrong = launch_local(sp.autotune_wide, 2, ({"trial_s": 5.0}, "other"), timeout=300)
    for r in wrong:
        assert "build() made a model unlike the one being tuned" in r["error"], r["error"]
    missing = launch_local(sp.autotune_wide, 2, ({"trial_s": 5.0}, "none"), timeout=300)
    for r in missing:
        assert "pass build=" in r["error"] and "accuracy_trial=False" in r["error"], r["error"]


def test_the_ddp_tuners_refuse_a_sharded_model_naming_autotune_sharded():
    for said in launch_local(sp.ddp_tuners_on_a_sharded_model, 2, (), timeout=120):
        assert len(said) == 2
        for message in said:
            assert "it is sharded with fully_shard (FSDP2): tune it with advisor.autotune_sharded" in message, message


QUICK_RACE = {"observe_steps": 3, "trial_steps": 2, "trial_rounds": 2, "max_trial_rounds": 3, "repeats": 1,
              "candidates": ["none", "bf16", "intquant(bits=8)", "powersgd(rank=4)"]}


def test_wrap_sharded_races_the_baselines_in_the_users_loop_and_every_rank_keeps_the_same_plan():
    out = launch_local(sp.wrap_sharded_loop, 2, (40, QUICK_RACE, False), timeout=300)
    a, b = out
    assert a["error"] is None, a["error"]
    assert a["phase"] == "decided" and a["plan"] == b["plan"]
    assert [e[:2] for e in a["events"]] == [e[:2] for e in b["events"]]  # texts hold each rank's own timings
    assert a["steps"] == 40  # evaluation passes were not counted
    whats = [w for _, w, _ in a["events"]]
    assert whats[0] == "profiled" and "decided" in whats
    # no loss_fn, batches and build: no accuracy evidence, so only the baselines raced
    assert set(a["measured"]) <= {"fp32", "fp32, exact all-to-all", "bf16"} and "fp32" in a["measured"]
    assert "unproven" in whats
    assert not any(c.startswith(("IntReduceScatter", "PowerSGD")) for c in a["comms"].values())
    for n, value in a["full"].items():
        torch.testing.assert_close(value, b["full"][n], rtol=0, atol=0)


def test_wrap_sharded_with_the_gate_races_compressed_plans_and_needs_all_of_its_arguments():
    out = launch_local(sp.wrap_sharded_loop, 2, (60, {**QUICK_RACE, "trial_s": 5.0}, True), timeout=300)
    a, b = out
    assert a["error"] is None, a["error"]
    assert a["phase"] == "decided" and a["plan"] == b["plan"]
    assert [e[:2] for e in a["events"]] == [e[:2] for e in b["events"]]
    assert any(label not in ("fp32", "fp32, exact all-to-all", "bf16") for label in a["measured"])
    decided = next(d for _, w, d in a["events"] if w == "decided")
    plan = Plan.from_dict(a["plan"])
    if any(c.name in ("intquant", "powersgd") for c in plan.configs()):
        assert a["accuracy"] and "accuracy:" in decided  # a compressed plan only with the trial's proof
    assert all("needs loss_fn, batches and build together" in r["refused"] for r in out)


def test_wrap_sharded_re_trials_a_compressed_plan_and_backs_off_only_the_one_that_falls_behind():
    out = launch_local(sp.retrialled_sharded, 2, (["powersgd(rank=1, no-ef)", "intquant(bits=8)", "bf16"], 130, 0.02),
                       timeout=600)
    a, b = out
    for label in a:
        assert [e[:2] for e in a[label]["events"]] == [e[:2] for e in b[label]["events"]], label
        assert a[label]["plan"] == b[label]["plan"], label
    harmful, fine, cast = (a[label] for label in ("powersgd(rank=1, no-ef)", "intquant(bits=8)", "bf16"))
    # the first re-trial comes once 120 steps (6% of 2,000 over a 100% share) have paid for it
    (step, gap, status), = harmful["retrials"]
    assert step == 120 and status == "rejected" and gap > 0.01, harmful["events"]
    back_off = next(d for _, w, d in harmful["events"] if w == "back-off")
    assert "-> fp16 everywhere" in back_off and "behind fp32" in back_off
    assert Plan.from_dict(harmful["plan"]).default.label == "fp16"  # SGD's cast, from PowerSGD
    assert not any("PowerSGD" in c for c in harmful["comms"])
    # intquant(bits=8) keeps up: re-trialled, no harm shown, kept
    assert [s for _, _, s in fine["retrials"]] in (["accepted"], ["not proven"]), fine["events"]
    assert "back-off" not in [w for _, w, _ in fine["events"]] and fine["plan"]["default"]["name"] == "intquant"
    assert cast["retrials"] == [] and "not re-trialled" in cast["events"][0][2]  # a cast is a baseline


def test_wrap_sharded_times_a_proven_plan_again_beside_the_baseline_and_builds_its_claim_on_that(proving_runs):
    a, b = proving_runs["sharded, long enough"]
    assert [e[:2] for e in a["events"]] == [e[:2] for e in b["events"]] and a["plan"] == b["plan"]

    def agreed(retimings):  # the seconds each rank spent are its own
        return [{k: v for k, v in r.items() if k != "seconds"} for r in retimings]

    assert agreed(a["retimed"]) == agreed(b["retimed"])
    # proven by the trial, then raced alone beside the best fp32 path on the loop's own steps, then decided
    happened_in_order(a["events"], "re-timing", "re-timed", "decided")
    (retimed,) = a["retimed"]
    assert retimed["label"].startswith("intquant(bits=8") and retimed["baseline"] in ("fp32", "fp32, exact all-to-all")
    assert retimed["steps"] == 3 * 2 and len(retimed["plan_s"]) >= 3  # turns 3x the race's 2 timed steps
    decided = next(d for _, w, d in a["events"] if w == "decided")
    assert "re-timed alone beside" in decided, decided
    # the claim rests on the second figure, not on the race's; installed only where it clears the bar
    assert a["step_speedup"] == pytest.approx(retimed["speedup"])
    if Plan.from_dict(a["plan"]).default.name == "intquant":
        assert a["tta"] is not None and a["tta"] <= retimed["speedup"] + 1e-9
    for n, value in a["full"].items():
        torch.testing.assert_close(value, b["full"][n], rtol=0, atol=0)


def test_wrap_sharded_goes_on_proving_online_a_plan_its_first_trial_was_too_short_for_and_installs_it_once_proven(
        proving_runs):
    a, b = proving_runs["sharded, too short"]
    assert [e[:2] for e in a["events"]] == [e[:2] for e in b["events"]] and a["plan"] == b["plan"]
    _, _, retimed = proven_online(a["events"], a["retimed"], "intquant(bits=8, packed=1)")
    assert Plan.from_dict(a["plan"]).config_for("linear.weight").name == "intquant"
    assert a["comms"] == ["IntReduceScatter"] and a["phase"] == "decided"
    assert a["step_speedup"] == pytest.approx(retimed["speedup"]) and a["tta"] <= retimed["speedup"] + 1e-9
    for n, value in a["full"].items():
        torch.testing.assert_close(value, b["full"][n], rtol=0, atol=0)


def test_wrap_sharded_loss_watch_backs_off_a_stalled_loss_on_every_rank_and_not_one_that_follows_its_trend():
    watch = {"trend_steps": 30, "watch_every": 10, "fidelity_sample": 0}
    runs = [("trend", "intquant(bits=8)", 90, watch), ("stall", "intquant(bits=8)", 90, watch),
            ("real", "intquant(bits=8)", 90, watch)]
    out = launch_local(sp.loss_watched_sharded, 2, (runs,), timeout=300)
    for a, b in zip(*out):
        assert [e[:2] for e in a["events"]] == [e[:2] for e in b["events"]] and a["plan"] == b["plan"]
        assert a["losses"] == 90
        given = [(step, d) for step, w, d in a["events"] if w == "given"]
        assert [step for step, _ in given] == [0, 30] and "after 30 steps" in given[0][1]  # the trend's fp32 steps
    following, stalled, real = out[0]
    # a loss that goes on along the fp32 steps' trend, and real training under 8-bit quantisation: no alarm
    for run in (following, real):
        assert "loss-watch" not in [w for _, w, _ in run["events"]], run["events"]
        assert run["plan"]["default"]["name"] == "intquant"
    # a loss that stops falling once the plan is in: two windows above the trend, then a back-off
    said = {w: (step, d) for step, w, d in stalled["events"]}
    assert said["loss-watch"][1].startswith("training loss") and "two windows in a row" in said["loss-watch"][1]
    assert said["back-off"][0] == said["loss-watch"][0] == 50, stalled["events"]
    assert "-> fp16 everywhere" in said["back-off"][1] and "the loss fell behind its trend" in said["back-off"][1]
    assert Plan.from_dict(stalled["plan"]).default.label == "fp16"  # SGD's cast


def test_wrap_sharded_refuses_bad_loss_watch_settings_naming_them():
    import torch.nn as nn

    import advisor

    for kwargs, said in (({"watch_every": 0}, "watch_every"), ({"loss_z": 0}, "loss_z=0"),
                         ({"trend_steps": -1, "plan": "bf16"}, "trend_steps"),
                         ({"trend_steps": 10}, "trend_steps=10 runs fp32 steps before a given plan; pass plan=")):
        with pytest.raises(ValueError, match=said):
            advisor.wrap_sharded(nn.Linear(2, 2), None, **kwargs)
