"""What the model predicts for one plan on one profile, next to the fp32 and 16-bit baselines.

The data behind ``advisor report PLAN --profile PROFILE``: computed here, drawn by
:func:`advisor.report.text.render_plan`, printed as JSON by ``--json``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from advisor.core.speedups import speedup
from advisor.perfmodel import PerformanceModel, Timeline
from advisor.runtime.plan import Plan
from policies.baselines import SIXTEEN_BIT as SIXTEEN_BIT_CASTS
from profilers.profile import ClusterProfile


@dataclass
class BucketPrediction:
    """One bucket under the plan: its compressor, the model's times and bytes, its fidelity error."""

    bucket: int
    parameters: int
    numel: int
    config: str
    encode_s: float
    wait_s: float
    comm_s: float
    decode_s: float
    wire_bytes: int
    #: None where the profile did not replay this config on this bucket
    fidelity_error: float | None


@dataclass
class PlanPrediction:
    """A plan's predicted iteration, per bucket, against the baselines; ``to_dict`` is the JSON report."""

    plan_digest: str
    predicted_s: float
    compute_only_s: float
    #: plan ``none`` (fp32) and each 16-bit cast the profile timed, seconds per iteration
    baselines_s: dict[str, float]
    speedup_vs_fp32: float
    speedup_vs_16bit: float | None
    buckets: list[BucketPrediction]
    #: the plan's own record of live measurements, if it carries one
    measured: Any
    #: the accuracy trial the plan's metadata names ("" when none checked it)
    accuracy: str
    timeline: Timeline
    world_size: int
    where: str

    @property
    def accuracy_checked(self) -> bool:
        return bool(self.accuracy)

    def to_dict(self) -> dict[str, Any]:
        return {"plan_digest": self.plan_digest, "predicted_s": self.predicted_s, "compute_only_s": self.compute_only_s,
                "baselines_s": self.baselines_s, "speedup_vs_fp32": self.speedup_vs_fp32,
                "speedup_vs_16bit": self.speedup_vs_16bit, "buckets": [vars(b) for b in self.buckets],
                "measured": self.measured, "accuracy_checked": self.accuracy_checked}


def predict_plan(plan: Plan, profile: ClusterProfile) -> PlanPrediction:
    """The model's view of ``plan`` on ``profile``, bucket by bucket, and of the baselines.

    Args:
        plan: the plan (its parameter names must be the profile's; see :meth:`Plan.check_against`).
        profile: the cluster profile to predict on.

    Returns:
        A :class:`PlanPrediction`; ``to_dict()`` is the JSON of ``advisor report PLAN --json``.

    Raises:
        ValueError: the profile lacks the kernel costs of a config the plan uses.
    """
    model = PerformanceModel(profile)
    timeline = model.predict(plan)
    timed = profile.kernels.costs if profile.kernels is not None else {}
    base = {c: model.predict(Plan.uniform(c, warmup_steps=0)).iteration_s
            for c in ("none", *SIXTEEN_BIT_CASTS) if c == "none" or c in timed}
    sixteen = min((base[c] for c in SIXTEEN_BIT_CASTS if c in base), default=None)
    fidelity = {}
    if profile.fidelity is not None:
        fidelity = {(e.bucket, e.config): e.relative_error for e in profile.fidelity.entries}
    buckets = [
        BucketPrediction(bucket.index, len(bucket.parameters), bucket.numel, span.config,
                         span.encode_end_s - span.encode_start_s, span.wait_s, span.comm_end_s - span.comm_start_s,
                         span.decode_end_s - span.comm_end_s, span.wire_bytes,
                         fidelity.get((bucket.index, span.config), 0.0 if span.config == "none" else None))
        for span, bucket in zip(timeline.buckets, model.buckets)
    ]
    return PlanPrediction(
        plan_digest=plan.digest(), predicted_s=timeline.iteration_s, compute_only_s=timeline.compute_only_s,
        baselines_s=base, speedup_vs_fp32=speedup(base["none"], timeline.iteration_s),
        speedup_vs_16bit=speedup(sixteen, timeline.iteration_s), buckets=buckets,
        measured=plan.metadata.get("measured"), accuracy=str(plan.metadata.get("accuracy") or ""),
        timeline=timeline, world_size=profile.environment.world_size, where=profile.environment.note,
    )
