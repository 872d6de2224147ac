"""Time to accuracy end to end: fp32, 16-bit and a plan from the same start and batches."""

import pytest

from advisor.runtime import Plan
from advisor.testbed.validate import ValidationReport, validate_workload

DIGITS = "advisor.workloads:digits"


@pytest.mark.slow
def test_a_harmless_plan_reaches_fp32s_accuracy_and_the_report_times_every_arm(tmp_path):
    plan = Plan.uniform("intquant(bits=8, packed=0)", warmup_steps=5, metadata={"description": "8-bit"})
    report = validate_workload(DIGITS, plan, steps=120, eval_every=20)
    fp32 = report.arm("fp32")
    assert fp32.metrics["accuracy"][-1] > 0.9 and fp32.steps == [0, 20, 40, 60, 80, 100, 120]
    assert report.metric == "loss" and not report.higher_is_better
    assert abs(report.gap()) < 0.05, report.to_json()
    assert [a.kind for a in report.arms] == ["fp32", "fp32 (other order)", "16-bit", "plan"]
    # the second fp32 run, in another batch order, measures how far apart equally good runs end
    other = report.arm("fp32 (other order)")
    assert report.noise() == pytest.approx(abs(other.final("loss") - fp32.final("loss")) / fp32.final("loss"))
    assert report.noise("accuracy") == pytest.approx(abs(other.final("accuracy") - fp32.final("accuracy")))
    # every arm starts from the same weights: the same held-out loss before the first step
    assert len({a.metrics["loss"][0] for a in report.arms}) == 1
    assert report.target == fp32.final("loss") and 0 < report.time_to_target_s["fp32"] <= fp32.seconds[-1]
    assert all(a.seconds == sorted(a.seconds) and a.step_s > 0 for a in report.arms)
    again = ValidationReport.from_json(report.to_json())
    assert again == report
    report.save_png(tmp_path / "curves.png")
    assert (tmp_path / "curves.png").stat().st_size > 10_000


@pytest.mark.slow
def test_a_harmful_plan_falls_behind_and_never_reaches_the_target():
    from advisor.testbed.workloads import build_workload

    names = [n for n, _ in build_workload(DIGITS).model.named_parameters()]
    # per-parameter groups, as autotune writes them: the harmful config on the weights, fp16 on the rest
    plan = Plan.from_assignments({n: "topk(ratio=0.001, no-ef)" if n.endswith("weight") else "fp16" for n in names},
                                 warmup_steps=0)
    report = validate_workload(DIGITS, plan, steps=60, eval_every=20)
    assert report.gap() > 0.2
    assert report.time_to_target_s["plan"] is None and report.speedup["vs_fp32"] is None


@pytest.mark.slow
def test_runs_repeat_the_comparison_in_other_batch_orders_each_timed_to_its_own_fp32():
    plan = Plan.uniform("intquant(bits=8, packed=0)", warmup_steps=0)
    report = validate_workload(DIGITS, plan, steps=40, eval_every=20, runs=3)
    assert [r.order for r in report.runs] == [0, 1, 2]
    # order 0 is the arms' own; order 1 is the other fp32 arm's order, whose run is reused
    first, second, third = report.runs
    assert first.final == {"fp32": report.arm("fp32").final("loss"), "16-bit": report.arm("16-bit").final("loss"),
                           "plan": report.arm("plan").final("loss")}
    assert second.final["fp32"] == report.arm("fp32 (other order)").final("loss") == second.target
    assert third.target == third.final["fp32"] and third.target not in (first.target, second.target)
    assert all(r.time_to_target_s["fp32"] is not None and r.step_s["plan"] > 0 for r in report.runs)
    # the gap is paired by order: its interval holds the mean of the three gaps
    mean, low, high = report.gap_interval()
    assert mean == pytest.approx(sum(r.gap(False) for r in report.runs) / 3) and low < mean < high
    assert abs(mean) < 0.05
    assert ValidationReport.from_json(report.to_json()) == report
    single = validate_workload(DIGITS, Plan.uniform("fp16", warmup_steps=0), steps=10, eval_every=10)
    assert single.runs == [] and single.gap_interval() is None


def test_bad_input_is_refused_before_training():
    with pytest.raises(ValueError, match="missing from the model"):
        validate_workload(DIGITS, Plan.from_assignments({"encoder.weight": "fp16"}))
    with pytest.raises(ValueError, match="steps=0"):
        validate_workload(DIGITS, Plan.uniform("fp16"), steps=0)
    with pytest.raises(ValueError, match="runs=0"):
        validate_workload(DIGITS, Plan.uniform("fp16"), runs=0)
    with pytest.raises(ValueError, match="sixteen='fp8'"):
        validate_workload(DIGITS, Plan.uniform("fp16"), sixteen="fp8")
    with pytest.raises(ValueError, match="does not import"):
        validate_workload("nosuch.module:f", Plan.uniform("fp16"))


@pytest.mark.slow
def test_autotune_inside_validate_takes_a_loader_and_repeats_the_same_call():
    report = validate_workload(DIGITS, None, steps=20, eval_every=10,
                               autotune_kwargs={"data": "loader", "repeats": 2, "trials": 100, "top": 1,
                                                "rounds": 2, "max_rounds": 2, "trial_s": 10.0})
    assert report.autotune is not None and len(report.repeats) == 1
    for result in [report.autotune, *report.repeats]:
        assert result["kind"] == "compression-advisor/autotune-result" and result["evidence"]
    assert report.plan == report.autotune["plan"], "the first call's advice is the plan validated"
    again = type(report).from_json(report.to_json())
    assert again.repeats == report.repeats


@pytest.mark.slow
def test_a_sharded_workload_is_autotuned_and_validated_with_its_fully_shard_groups():
    report = validate_workload(DIGITS, None, steps=20, eval_every=10, sharded=True,
                               autotune_kwargs={"trial_s": 6.0, "top": 1, "rounds": 2, "max_rounds": 2,
                                                "candidates": ["none", "bf16", "intquant(bits=8)"]})
    assert report.autotune["kind"] == "compression-advisor/sharded-autotune-result"
    # the root holds no parameters of its own here: two groups
    assert [g["name"] for g in report.autotune["profile"]["groups"]] == ["features", "classifier"]
    assert report.plan == report.autotune["plan"]
    assert [a.kind for a in report.arms] == ["fp32", "fp32 (other order)", "16-bit", "plan"]
    assert len({a.metrics["loss"][0] for a in report.arms}) == 1  # every arm from the same weights
    assert report.arm("fp32").final("accuracy") > 0.5
    assert type(report).from_json(report.to_json()) == report


def test_a_workload_that_cannot_shard_is_refused_naming_the_fix():
    # before any rank starts
    with pytest.raises(ValueError, match="says nothing of how to shard its model: give it shard="):
        validate_workload("advisor.workloads:mlp", None, steps=2, sharded=True, timeout=120)


def test_the_jobs_tell_the_tuners_to_judge_by_held_out_batches_where_the_workload_has_no_evaluate():
    # a held-out loss handed over as evaluate= is timed, and a timed cost moves the trial's
    # checkpoints with the machine's load (one call in three then gave other advice)
    from advisor.testbed.workloads import build_workload

    text = build_workload("advisor.workloads:text_lm")
    assert text.evaluate is None and text.held_out
    assert list(text.judged_by()) == ["held_out"] and len(text.judged_by()["held_out"]) == len(text.held_out)
    digits = build_workload("advisor.workloads:digits")
    assert digits.judged_by() == {"evaluate": digits.evaluate}, "a workload's own evaluate judges it"
