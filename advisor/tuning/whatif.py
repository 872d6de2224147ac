"""What-if verdicts from a saved profile, under the same fidelity evidence and budget as autotune.

A verdict from a profile alone is a prediction: the performance model says how fast, the
fidelity profile says how much each config distorts, and the budget says how much
distortion is allowed.  The budget comes, in this order, from an explicit number, a config
the user trusts, or the accuracy trial of an autotune result (the budget it earned on the
real cluster); with none of these it is assumed (the default reference's error), and the
verdict says so.  A verdict also says whether the plan it names was trialled for accuracy:
only a plan the given trial accepted counts as checked.

Where the trial measured a uniform plan's step efficiency, the row also gives its time to
accuracy against the best baseline: predicted step speed-up times efficiency, with the
efficiency's 95% interval (the prediction's own error is not in it).  As in autotune, a
lossy plan is advised only where the trial accepted it and that lower bound beats the
best baseline; a faster plan no trial has proven is named, and the advice stays the baseline.

A compressor's row is predicted under the best bucket layout autotune would search (DDP's
buckets exchanged together, :data:`advisor.tuning.steps.LAYOUT_GRID_MB`), and says which.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from advisor.perfmodel import Scenario
from advisor.tuning.steps import LAYOUT_MARGIN, layouts_to_try
from policies import accuracy_gate as gate
from policies.baselines import SIXTEEN_BIT
from policies.evidence import Estimate, time_to_accuracy
from policies.problem import BASELINES, DEFAULT_REFERENCE, TuningProblem, describe_layout


@dataclass
class WhatIfRow:
    """One uniform plan: its predicted step, its error, and what the accuracy trial said of it.

    ``trial``: the trial's verdict on the config everywhere ("" where it was not trialled);
    ``to_accuracy`` and ``to_accuracy_low``: how many times sooner than the best baseline it
    reaches the same accuracy (point and 95% lower bound), where the trial measured its
    efficiency.
    """

    config: str
    predicted_s: float
    fidelity_error: float
    within_budget: bool
    trial: str = ""
    efficiency: float | None = None
    efficiency_se: float | None = None
    to_accuracy: float | None = None
    to_accuracy_low: float | None = None
    #: the bucket layout ``predicted_s`` is for (both None: DDP's own buckets; see
    #: :class:`advisor.runtime.Plan`) and the time on DDP's own
    exchange_mb: float | None = None
    ddp_buckets_s: float | None = None
    bucket_cap_mb: float | None = None

    @property
    def layout(self) -> str:
        """`` in 16 MiB exchanges`` / `` with DDP's buckets at 1 MiB``, or "" on DDP's own buckets."""
        return describe_layout(self.exchange_mb, self.bucket_cap_mb, " ")


@dataclass
class WhatIfVerdict:
    """Every uniform plan's predicted time and error, the fastest within the budget, the advice, and why.

    ``best``: the fastest predicted plan within the budget; ``advice``: what to train with,
    ``best`` only where the trial proved it (else the best baseline); ``compress``: whether
    the advice compresses beyond a baseline.
    """

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
    advice: str = ""


def budget_evidence(budget: float | None, reference: str | None, accuracy=None) -> tuple[dict, str, set[str]]:
    """``TuningProblem.from_profile`` budget arguments, where they come from, and the configs a trial accepted.

    ``accuracy``: an :class:`advisor.tuning.accuracy.AccuracyTrialReport` (an autotune result's).
    """
    accepted = {config for config, arm in _uniform_arms(accuracy).items() if arm.accepted}
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
    trialled = _uniform_arms(accuracy)
    # a compressor may run faster with DDP's buckets exchanged together or made smaller (as
    # autotune searches); fp32 stays native DDP on its own buckets, and a 16-bit cast may take
    # smaller buckets only (joining them is a compressed plan's trade); a join is priced as
    # advisor.ddp_for runs it, on DDP built with buckets of its size, as autotune's race times it
    layouts = [problem.with_layout(layout.exchange_mb, layout.bucket_cap_mb, join_in_ddp=True)
               for layout in layouts_to_try(problem)]
    rows = []
    for c in problem.configs:
        u = problem.uniform(c)
        arm = trialled.get(c)
        ddp_s = float(problem.predict(u)[0])
        seconds, exchange_mb, bucket_cap_mb = ddp_s, None, None
        allowed = [] if c == "none" else [m for m in layouts if c not in SIXTEEN_BIT or m.bucket_cap_mb is not None]
        for other in allowed:
            other_s = float(other.predict(other.uniform(c))[0])
            if other_s < ddp_s * (1 - LAYOUT_MARGIN) and other_s < seconds:
                seconds, exchange_mb, bucket_cap_mb = other_s, other.exchange_mb, other.bucket_cap_mb
        rows.append(WhatIfRow(c, seconds, float(problem.fidelity_error(u)[0]),
                              bool(problem.feasible(u)[0]), trial=arm.status if arm is not None else "",
                              efficiency=arm.efficiency if arm is not None else None,
                              efficiency_se=arm.efficiency_se if arm is not None else None,
                              exchange_mb=exchange_mb, ddp_buckets_s=ddp_s, bucket_cap_mb=bucket_cap_mb))
    rows.sort(key=lambda r: r.predicted_s)
    baselines = [r for r in rows if r.config in BASELINES]
    # a baseline's time to accuracy: its step over its efficiency (1 where it was not trialled)
    base = min(baselines, key=lambda r: r.predicted_s / min(r.efficiency or 1.0, 1.0))
    base_tta_s = base.predicted_s / min(base.efficiency or 1.0, 1.0)
    for r in rows:
        if r.efficiency is not None and r.efficiency_se is not None and r.efficiency > 0:
            tta = time_to_accuracy(Estimate(base_tta_s / r.predicted_s, 0.0), Estimate(r.efficiency, r.efficiency_se))
            r.to_accuracy, r.to_accuracy_low = tta.value, tta.lower()
    best = min((r for r in rows if r.within_budget), key=lambda r: r.predicted_s)
    faster_over = [r.config for r in rows if not r.within_budget and r.predicted_s < best.predicted_s]
    proven = [r for r in rows if r.config not in BASELINES and r.within_budget and r.trial == gate.ACCEPTED
              and r.to_accuracy_low is not None and r.to_accuracy_low > 1]
    checked = best.config in accepted or best.config == "none"
    if proven:
        advice = max(proven, key=lambda r: r.to_accuracy)
        verdict = (f"compress with {advice.config}{advice.layout}: to the same accuracy {advice.to_accuracy:.2f}x sooner than "
                   f"{base.config}{base.layout} (at least {advice.to_accuracy_low:.2f}x: predicted "
                   f"{base.predicted_s / advice.predicted_s:.2f}x per step, step efficiency {advice.efficiency:.2f} "
                   f"in the accuracy trial), within the fidelity budget ({source})")
    elif best.config not in BASELINES and best.predicted_s < base.predicted_s:
        advice = base
        step = base.predicted_s / best.predicted_s
        if best.trial == gate.REJECTED:
            why = "the accuracy trial rejected it"
        elif best.to_accuracy is not None:
            why = (f"to the same accuracy it is {best.to_accuracy:.2f}x, at least {best.to_accuracy_low:.2f}x "
                   f"(step efficiency {best.efficiency:.2f}): not shown faster")
        elif best.trial:
            why = f"the accuracy trial found it {best.trial}"
        else:
            why = "no trial has checked its accuracy; prove it with `advisor validate` or autotune on the cluster"
        verdict = (f"do not compress: {best.config}{best.layout} is predicted {step:.2f}x faster per step than "
                   f"{base.config}{base.layout}, within the fidelity budget ({source}), but {why}; the advice is "
                   f"{base.config}{base.layout}")
    else:
        advice = base
        verdict = (f"do not compress: {base.config}{base.layout} is the fastest predicted plan within the fidelity "
                   f"budget ({source})")
    if faster_over:
        verdict += f"; faster but over the budget: {', '.join(faster_over)}"
    if unknown:
        verdict += f"; left out, no fidelity measured: {', '.join(unknown)}"
    compress = advice.config not in BASELINES
    return WhatIfVerdict(problem.model.world, problem.model.compute_only_s, problem.budget, source,
                         problem.fidelity_measure, rows, best.config, base.config, compress, checked, verdict,
                         faster_over, advice.config)


def _uniform_arms(accuracy) -> dict:
    """The trial's arms that ran one config everywhere, by config (the ladder, the 16-bit cast)."""
    if accuracy is None:
        return {}
    return {a.description.removesuffix(" everywhere"): a for a in accuracy.arms
            if a.description.endswith(" everywhere")}
