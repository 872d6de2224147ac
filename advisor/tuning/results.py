"""The autotune result: a typed, versioned document of what was found, measured and chosen."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

import numpy as np

from advisor.core.documents import VersionedDocument
from advisor.core.speedups import speedup
from advisor.report.results import render_result, save_measured_vs_predicted_png
from advisor.runtime.plan import Plan
from advisor.tuning.accuracy import AccuracyTrialReport
from policies.baselines import SIXTEEN_BIT
from policies.do_no_harm import LiveMeasurement
from policies.learned import Measurement

RESULT_KIND = "compression-advisor/autotune-result"
RESULT_VERSION = 1


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
    kind: str = RESULT_KIND
    version: int = RESULT_VERSION

    def save_png(self, path) -> None:
        """Measured vs predicted step time of every plan measured live."""
        save_measured_vs_predicted_png(self, path)

    def plan_object(self) -> Plan:
        return Plan.from_dict(self.plan)

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
