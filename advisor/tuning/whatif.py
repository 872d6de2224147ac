"""What-if verdicts from a saved profile, under the same fidelity evidence and budget as autotune.

A verdict from a profile alone is a prediction: the performance model says how fast, the
fidelity profile says how much each config distorts, and the budget says how much
distortion is allowed.  The budget comes, in this order, from an explicit number, a config
the user trusts, or the accuracy trial of an autotune result (the budget it earned on the
real cluster); with none of these it is assumed (the default reference's error), and the
verdict says so.  A verdict also says whether the plan it names was trialled for accuracy:
only a plan the given trial accepted counts as checked.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from advisor.perfmodel import Scenario
from policies.problem import BASELINES, DEFAULT_REFERENCE, TuningProblem


@dataclass
class WhatIfRow:
    config: str
    predicted_s: float
    fidelity_error: float
    within_budget: bool


@dataclass
class WhatIfVerdict:
    """Every uniform plan's predicted time and error, the best one within the budget, and why."""

    world_size: int
    compute_only_s: float
    budget: float
    budget_source: str
    fidelity_measure: str
    rows: list[WhatIfRow]
    best: str
    best_baseline: str
    compress: bool
    checked: bool
    verdict: str
    over_budget_faster: list[str] = field(default_factory=list)


def budget_evidence(budget: float | None, reference: str | None, accuracy=None) -> tuple[dict, str, set[str]]:
    """``TuningProblem.from_profile`` budget arguments, where they come from, and the configs a trial accepted.

    ``accuracy``: an :class:`advisor.tuning.accuracy.AccuracyTrialReport` (an autotune result's).
    """
    accepted: set[str] = set()
    if accuracy is not None:
        accepted = {a.description.removesuffix(" everywhere") for a in accuracy.arms
                    if a.accepted and a.description.endswith(" everywhere")}
    if budget is not None:
        return {"budget": budget}, "given", accepted
    if reference is not None:
        return {"reference": reference}, f"given: the error of {reference} everywhere", accepted
    if accuracy is not None and accuracy.budget is not None:
        return {"budget": accuracy.budget}, f"from the accuracy trial ({accuracy.budget_reason})", accepted
    return ({"reference": DEFAULT_REFERENCE},
            f"assumed: the error of {DEFAULT_REFERENCE} everywhere; no accuracy trial has earned it (pass an "
            "autotune result, or --budget/--reference)", accepted)


def what_if(profile, scenario: Scenario | None = None, *, budget: float | None = None,
            reference: str | None = None, accuracy=None, candidates: Sequence[str] | None = None) -> WhatIfVerdict:
    """Rank uniform plans by predicted time, keep those within the budget, and say how sure that is.

    Args:
        profile: a :class:`profilers.profile.ClusterProfile`.
        scenario: a :class:`advisor.perfmodel.Scenario` (more ranks, another link, ...);
            default: the profiled cluster as it is.
        budget, reference, accuracy: where the fidelity budget comes from, in that order: a
            number, a config the user trusts, or an autotune result's accuracy trial.
        candidates: the configs to rank (default: every config the profile timed).

    Returns:
        A :class:`WhatIfVerdict`: every plan's time and error, the best within the budget,
        the budget's source, and whether the best was trialled for accuracy.

    Raises:
        ValueError: a budget given twice or malformed, or a candidate the profile did not
            replay for fidelity, naming the fix.
    """
    kwargs, source, accepted = budget_evidence(budget, reference, accuracy)
    if candidates is None:  # what the profile measured
        candidates = ["none"] + sorted(profile.kernels.costs if profile.kernels else [])
    measured = {(e.bucket, e.config) for e in profile.fidelity.entries} if profile.fidelity else set()
    buckets = [b.index for b in profile.compute.buckets]
    unknown = [c for c in candidates if c != "none" and any((b, c) not in measured for b in buckets)]
    candidates = [c for c in candidates if c not in unknown]
    problem = TuningProblem.from_profile(profile, candidates, scenario=scenario, **kwargs)
    rows = []
    for c in problem.configs:
        u = problem.uniform(c)
        rows.append(WhatIfRow(c, float(problem.predict(u)[0]), float(problem.fidelity_error(u)[0]),
                              bool(problem.feasible(u)[0])))
    rows.sort(key=lambda r: r.predicted_s)
    baselines = [r for r in rows if r.config in BASELINES]
    base = min(baselines, key=lambda r: r.predicted_s)
    best = min((r for r in rows if r.within_budget), key=lambda r: r.predicted_s)
    faster_over = [r.config for r in rows if not r.within_budget and r.predicted_s < best.predicted_s]
    compress = best.config not in BASELINES and best.predicted_s < base.predicted_s
    checked = best.config in accepted or best.config == "none"
    if compress:
        verdict = (f"compress with {best.config}: predicted {base.predicted_s / best.predicted_s:.2f}x faster than "
                   f"{base.config}, within the fidelity budget ({source})")
    else:
        verdict = f"do not compress: {base.config} is the fastest predicted plan within the fidelity budget ({source})"
    if faster_over:
        verdict += f"; faster but over the budget: {', '.join(faster_over)}"
    if unknown:
        verdict += f"; left out, no fidelity measured: {', '.join(unknown)}"
    if not checked:
        verdict += (f". This rests on a prediction no trial has checked: {best.config} was not trialled for "
                    "accuracy; prove it with `advisor validate` or autotune on the cluster")
    return WhatIfVerdict(problem.model.world, problem.model.compute_only_s, problem.budget, source,
                         problem.fidelity_measure, rows, best.config, base.config, compress, checked, verdict,
                         faster_over)
