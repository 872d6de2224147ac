"""The autotune result: a typed, versioned document of what was found, measured and chosen."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

import numpy as np

from advisor.core.documents import VersionedDocument
from advisor.core.speedups import speedup
from advisor.report.results import render_result, save_measured_vs_predicted_png
from advisor.runtime.plan import Plan
from advisor.tuning.accuracy import AccuracyTrialReport
from advisor.tuning.online.tuner import OnlineTuner
from policies.baselines import SIXTEEN_BIT
from policies.do_no_harm import FP32, LiveMeasurement, Retiming, step_speedup
from policies.evidence import Estimate, time_to_accuracy
from policies.learned import Measurement

RESULT_KIND = "compression-advisor/autotune-result"
#: 2: the time-to-accuracy evidence of every measured plan (``evidence``), ``accuracy_unproven``;
#: 3: the chosen plan's step speed-up measured again after the race (``retimed``)
RESULT_VERSION = 3


@dataclass
class BucketRow:
    """One DDP bucket under the chosen plan, as the performance model sees it."""

    index: int
    parameters: int
    numel: int
    config: str
    encode_s: float
    comm_s: float
    decode_s: float
    wire_bytes: int
    fidelity_error: float


@dataclass
class PlanEvidence:
    """One live-measured plan's case against the best baseline, each number with its 95%
    one-sided bounds: the step speed-up (interleaved rounds), the step efficiency (fp32 steps
    per step, from the accuracy trial) and their product, the time-to-accuracy speed-up.
    ``status``: the trial's verdict (accepted, rejected, not proven), "" where the plan was
    not trialled; the efficiency and the time to accuracy are None where it was not read.
    ``retimed``: the step speed-up is the re-timing's (the plan alone beside the baseline
    after the race chose it), not the race's."""

    label: str
    kind: str
    step_speedup: float
    step_low: float
    step_high: float
    efficiency: float | None = None
    efficiency_low: float | None = None
    efficiency_high: float | None = None
    time_to_accuracy: float | None = None
    tta_low: float | None = None
    tta_high: float | None = None
    status: str = ""
    retimed: bool = False


def plan_evidence(measured: Sequence[LiveMeasurement], decision, verdicts: Mapping[str, Any]) -> list[PlanEvidence]:
    """Every measured plan's evidence against ``decision``'s best baseline; ``verdicts``: the
    accuracy trial's arms by label (fp32 needs none: its efficiency is 1 by definition)."""
    by_label = {m.label: m for m in measured}
    base = by_label[decision.best_baseline]
    rows = []
    for m in sorted(measured, key=lambda m: m.median_s):
        step = step_speedup(base, m) if m.label != base.label else Estimate(1.0, 0.0)
        retimed = m.label == decision.chosen and decision.retimed is not None
        if retimed:
            step = decision.retimed
        arm = verdicts.get(m.label)
        efficiency = Estimate(1.0, 0.0) if m.kind == FP32 else (arm.efficiency_estimate() if arm else None)
        row = PlanEvidence(m.label, m.kind, step.value, step.lower(), step.upper(),
                           status=arm.status if arm is not None else "", retimed=retimed)
        if efficiency is not None:
            # every row's time to accuracy is against the best baseline's, so that one's is 1 by
            # definition (a cast an unpowered trial saw lag keeps its efficiency in its own columns)
            tta = Estimate(1.0, 0.0) if m.label == base.label else time_to_accuracy(step, efficiency)
            row.efficiency, row.efficiency_low, row.efficiency_high = (efficiency.value, efficiency.lower(),
                                                                       efficiency.upper())
            row.time_to_accuracy, row.tta_low, row.tta_high = tta.value, tta.lower(), tta.upper()
        rows.append(row)
    return rows


def bucket_rows(problem, choices) -> list[BucketRow]:
    """The model's view of each bucket under ``choices`` (one config index per bucket)."""
    costs = problem.costs
    return [
        BucketRow(int(problem.model.buckets[b].index), len(problem.parameter_names[b]),
                  int(problem.model.buckets[b].numel), problem.configs[int(c)], float(costs.encode_s[b, c]),
                  float(costs.comm_s[b, c]), float(costs.decode_s[b, c]), int(costs.wire_bytes[b, c]),
                  float(problem.errors[b, c]))
        for b, c in enumerate(np.asarray(choices).reshape(-1))
    ]


@dataclass
class AutotuneResult(VersionedDocument):
    """What autotune found, predicted, measured and chose, and why."""

    what = "autotune result"
    KIND = RESULT_KIND
    VERSION = RESULT_VERSION

    plan: dict[str, Any]
    recommendation: str
    compress: bool
    description: str
    reason: str
    predicted_s: dict[str, float]
    measured: list[LiveMeasurement]
    speedup: dict[str, float]
    fidelity_error: float
    fidelity_budget: float
    reference: str | None
    policy: str
    policy_evaluations: int
    seconds: dict[str, float]
    world_size: int
    where: str
    buckets: list[BucketRow] = field(default_factory=list)
    #: the policy's best distinct plans, best first (the top ones are measured live)
    searched_top: list[str] = field(default_factory=list)
    #: every live-measured plan with its model features: data for the learned correction
    measurements: list[Measurement] = field(default_factory=list)
    #: the accuracy trial (None when none ran) and where the fidelity budget came from
    accuracy: AccuracyTrialReport | None = None
    budget_source: str = ""
    fidelity_measure: str = "gradient"
    #: every measured plan's step speed-up, step efficiency and time-to-accuracy speed-up
    evidence: list[PlanEvidence] = field(default_factory=list)
    #: why accuracy was not trialled where the user turned the trial off ("" otherwise)
    accuracy_unproven: str = ""
    #: the bucket layouts searched (a line each: DDP's own buckets first) and the chosen plan's
    #: (``exchange_mb``: DDP's buckets exchanged together up to that many MiB; None: DDP's own)
    layouts: list[str] = field(default_factory=list)
    exchange_mb: float | None = None
    #: every proven plan's step speed-up measured again after the race chose it (the last one
    #: is the advice's where the advice compresses)
    retimed: list[Retiming] = field(default_factory=list)
    kind: str = RESULT_KIND
    version: int = RESULT_VERSION

    def save_png(self, path) -> None:
        """Measured vs predicted step time of every plan measured live."""
        save_measured_vs_predicted_png(self, path)

    def plan_object(self) -> Plan:
        return Plan.from_dict(self.plan)

    @property
    def bucket_cap_mb(self) -> float | None:
        """DDP's ``bucket_cap_mb`` that makes the chosen layout's buckets itself: joined ones, sparing
        the hook the copy that joins them, or the smaller ones only DDP can make (the plan's
        ``bucket_cap_mb``); :func:`advisor.ddp_for` builds DDP so.  None: keep DDP's own."""
        return self.exchange_mb if self.exchange_mb is not None else self.plan.get("bucket_cap_mb")

    def measured_s(self, label: str) -> float | None:
        for m in self.measured:
            if m.label == label:
                return m.median_s
        return None

    def render(self, console=None) -> None:
        """The rich summary: advice, why, live measurements, accuracy trial, cost, buckets."""
        render_result(self, console)


class TunedResult(AutotuneResult):
    """What :func:`advisor.autotune` returns: the result document with the hook it installed beside it.

    ``hook`` is the installed :class:`advisor.runtime.CompressionHook`, or None when the
    advice is native fp32 (or nothing was installed).  It is live state of this process (a
    worker thread, a process group), not part of the document: not in the JSON, and dropped
    when the result is pickled to another process.
    """

    hook: Any = None

    @classmethod
    def beside(cls, result: AutotuneResult, hook) -> TunedResult:
        tuned = cls(**_field_values(result))
        tuned.hook = hook
        return tuned

    def watch(self, ddp_model, optimizer=None, **settings):
        """Keep checking the installed plan during training: an :class:`~advisor.tuning.online.OnlineTuner`
        watching ``hook`` (fidelity, gain and loss watches; see :func:`advisor.wrap`), or None
        where nothing was installed (native fp32 has nothing to check).

        Call on every rank, before the next training step.  ``settings`` are ``wrap``'s watch
        settings (``fidelity_sample``, ``fidelity_window``, ``fidelity_drift``, ``watch_every``,
        ``backoff``, ``candidates``).
        """
        if self.hook is None:
            return None
        return OnlineTuner(ddp_model, optimizer, hook=self.hook, **settings)

    def document(self) -> AutotuneResult:
        """The result alone, as data."""
        return AutotuneResult(**_field_values(self))

    def __getstate__(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k != "hook"}


def search_summary(problem, found, rows: list[BucketRow]) -> dict:
    """Predicted times of a searched plan and the baselines, and its per-bucket ``rows`` (JSON-ready)."""
    predicted = {c: float(problem.predict(problem.uniform(c))[0]) for c in problem.baselines()}
    best_base = min(predicted, key=predicted.get)
    chosen_s = float(found.predicted_s)
    sixteen = [predicted[c] for c in SIXTEEN_BIT if c in predicted]
    return {
        "description": problem.describe(found.choices), "policy": found.policy,
        "evaluations": int(found.evaluations), "search_s": found.seconds,
        "predicted_s": chosen_s, "baselines_s": predicted, "best_baseline": best_base,
        "speedup_vs_fp32": speedup(predicted["none"], chosen_s),
        "speedup_vs_16bit": speedup(min(sixteen), chosen_s) if sixteen else None,
        "compute_only_s": problem.model.compute_only_s,
        "fidelity_error": float(found.fidelity_error), "fidelity_budget": problem.budget,
        "reference": problem.reference, "world_size": problem.model.world,
        "buckets": [{"bucket": r.index, "parameters": r.parameters, "numel": r.numel, "config": r.config,
                     "encode_s": r.encode_s, "comm_s": r.comm_s, "decode_s": r.decode_s,
                     "wire_bytes": r.wire_bytes, "fidelity_error": r.fidelity_error} for r in rows],
    }


def _field_values(result: AutotuneResult) -> dict[str, Any]:
    return {f.name: getattr(result, f.name) for f in fields(result) if f.init}
