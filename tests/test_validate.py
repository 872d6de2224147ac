"""Accuracy end to end: the tuned plan trains digits as well as fp32 from the same seed."""

import pytest

from advisor.runtime import Plan
from advisor.validate import ValidationReport, tuned_digits_plan, validate_accuracy


@pytest.mark.slow
def test_the_tuned_plan_reaches_the_baseline_accuracy_within_one_point(tmp_path):
    plan = tuned_digits_plan("100mbit", trials=300)
    assert plan.metadata["description"] != "none everywhere"  # it does compress at 100 Mbit/s
    report = validate_accuracy(plan, epochs=12)
    assert report.baseline.accuracy[-1] > 0.95
    assert abs(report.accuracy_gap) <= 1.0, report.to_json()
    assert report.compressed_time_to_target_s is not None
    again = ValidationReport.from_json(report.to_json())
    assert again.compressed.accuracy == report.compressed.accuracy
    report.save_png(tmp_path / "curves.png")
    assert (tmp_path / "curves.png").stat().st_size > 10_000


def test_a_plan_for_another_model_is_refused_before_training():
    with pytest.raises(ValueError, match="missing from the model"):
        validate_accuracy(Plan.from_assignments({"encoder.weight": "fp16"}))
    with pytest.raises(ValueError, match="epochs=0"):
        validate_accuracy(Plan.uniform("fp16"), epochs=0)
