"""The layout benchmark's noise: a comparison is as noisy as its own two settings across interleaved rounds."""

import math

import pytest

from advisor.testbed.bench import _noise, pair_noise


def test_a_pair_is_as_noisy_as_its_per_round_ratio_not_the_median_setting():
    rounds = {"steady a": [1.0, 1.0, 1.01, 0.99, 1.0], "steady b": [2.0, 2.02, 2.0, 1.98, 2.0],
              "advisor": [1.0, 1.0, 1.0, 1.0, 1.0], "swinging": [1.0, 1.2, 0.8, 1.1, 0.9]}
    assert _noise(rounds) < 0.01  # most settings are steady
    assert pair_noise(rounds, "advisor", "swinging") > 0.08  # this comparison is not
    # a round that slows both settings alike is the machine, not a difference between them
    together = {"a": [1.0, 1.2, 0.9, 1.4, 1.1], "b": [2.0, 2.4, 1.8, 2.8, 2.2]}
    assert pair_noise(together, "a", "b") == 0.0 < _noise(together)
    assert math.isnan(pair_noise({"a": [1.0], "b": [2.0]}, "a", "b"))


def _row(model: str, advisor_ms: float, r1_ms: float = 100.0, fp16_ms: float = 100.0, swing: float = 0.02) -> dict:
    """One run's row of the layout matrix: PyTorch's settings, the two advices, five interleaved rounds
    whose step times swing by ``swing`` around the medians."""
    from advisor.testbed.bench import MATCHED, PYTORCH

    medians = {setting: 1.0 for setting in PYTORCH}  # every other PyTorch setting far slower
    medians.update({"PyTorch fp16 hook": fp16_ms / 1e3, "PyTorch PowerSGD r1 (1 bucket)": r1_ms / 1e3,
                    "compute only": 0.05, "advisor plan": advisor_ms / 1e3, MATCHED: advisor_ms / 1e3})
    wobble = [0.0, swing, -swing, swing / 2, -swing / 2]
    rounds = {s: [m * (1 + w * (1 if "advisor" in s else -1)) for w in wobble] for s, m in medians.items()}
    return {"ranks": 2, "rate": "1gbit", "model": model, "times_s": medians, "rounds_s": rounds, "noise": swing / 2,
            "advice": "fp16 everywhere", "result": {}, "matched_advice": "fp16 everywhere", "matched_result": {}}


def test_each_advice_is_held_against_the_fastest_pytorch_setting_within_its_budget():
    from advisor.testbed.matrix import comparisons

    # PowerSGD rank 1 loses more of the gradient than the default budget allows: only rank 1's budget may use it
    default, matched = comparisons([_row("mlp", advisor_ms=90.0, r1_ms=80.0, fp16_ms=100.0)])
    assert (default.budget, default.best, round(default.ratio, 3)) == ("default (r4)", "PyTorch fp16 hook", 0.9)
    assert (matched.budget, matched.best, round(matched.ratio, 3)) == ("PowerSGD r1's",
                                                                       "PyTorch PowerSGD r1 (1 bucket)", 1.125)
    assert matched.slower and not default.slower and matched.pair > 0.02


def test_pooled_runs_name_a_row_slower_every_time_and_not_one_that_was_slower_once_by_chance():
    from advisor.testbed.matrix import comparisons, pool

    def run(lucky: float, unlucky: float) -> list:
        return comparisons([_row("always slower", 108.0), _row("slower once", unlucky), _row("level", lucky)])

    runs = [run(100.0, 108.0), run(99.0, 93.0), run(101.0, 99.0)]
    assert [c.model for c in runs[0] if c.slower][:2] == ["always slower", "always slower"]
    assert any(c.model == "slower once" and c.slower for c in runs[0]), "one run alone names it slower"
    pooled = pool(runs)
    named = {r.key[2] for r in pooled.rows if r.slower}
    assert named == {"always slower"}, [(r.name, r.ratios, r.low) for r in pooled.rows]
    # the rows moved between runs by more than each run's rounds said, and the intervals say so
    assert pooled.spread_factor > 1 and pooled.dof == 2 * 3 * 2
    once = next(r for r in pooled.rows if r.key[2] == "slower once")
    assert once.ratios == pytest.approx((1.08, 0.93, 0.99)) and once.low < 1 < once.high
    assert len(pooled.run_medians) == 3 and pooled.median_estimate().dof == 2
