"""The tuning problem every policy solves: one compressor config per DDP bucket.

A :class:`TuningProblem` holds, for every bucket (rows) and candidate config (columns),
what the performance model and the fidelity profile say: encode/comm/decode costs and the
relative error the config leaves on that bucket's real gradients.  A plan is a vector of
column indices, one per bucket (``choices``); many plans are a (plans x buckets) matrix,
so policies evaluate thousands at once.

The accuracy budget follows L-GreCo: a plan's error is the size-weighted mean of its
buckets' errors, and it may not exceed an explicit number (``autotune`` earns it in a
paired accuracy trial) or the error of a uniform reference the user trusts.  The error
is the gradient error by default; ``fidelity_measure="update"`` budgets the error of the
update the user's optimizer makes instead, where the profile measured it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from advisor.compressors.registry import parse
from advisor.perfmodel import PerformanceModel, Scenario
from advisor.perfmodel.model import CandidateCosts
from advisor.runtime.plan import Plan
from profilers.profile import FIDELITY_MEASURES

from .baselines import BASELINES, DEFAULT_REFERENCE, SIXTEEN_BIT, UNCOMPRESSED  # noqa: F401 (re-exported)
from .learned import plan_features

#: feasibility slack: errors are measured, their last digits are noise
_TOLERANCE = 1e-9


@dataclass
class TuningProblem:
    """Costs and errors of every candidate on every bucket, and the accuracy budget.

    Build with :meth:`from_profile`.  ``budget`` bounds :meth:`fidelity_error`;
    ``correction`` (a fitted :class:`policies.learned.ResidualModel`) adjusts the
    performance model's predictions when set.
    """

    model: PerformanceModel
    costs: CandidateCosts
    errors: np.ndarray
    weights: np.ndarray
    budget: float
    reference: str | None = None
    correction: object | None = None
    parameter_names: list[list[str]] = field(default_factory=list)
    fidelity_measure: str = "gradient"
    #: the kernel forms the profiled device runs faster; every plan made here carries them
    kernel_forms: dict[str, str] = field(default_factory=dict)

    # --- construction ---------------------------------------------------------------
    @classmethod
    def from_profile(
        cls,
        profile,
        candidates: Sequence[str] | None = None,
        *,
        budget: float | None = None,
        reference: str | None = DEFAULT_REFERENCE,
        scenario: Scenario | None = None,
        overlap: float = 1.0,
        fidelity_measure: str | None = None,
        exchange_mb: float | None = None,
        bucket_cap_mb: float | None = None,
    ) -> TuningProblem:
        """Candidates default to the baselines plus every config the profile measured.

        Every candidate needs a kernel cost in the profile and, unless it is lossless
        (``none``), a fidelity entry for every bucket; the error names what is missing.
        ``fidelity_measure``: ``"gradient"`` (default) or ``"update"`` (where measured).
        ``exchange_mb``, ``bucket_cap_mb``: the bucket layout (:class:`advisor.runtime.Plan`);
        the problem's buckets are then the groups of DDP buckets exchanged together, or the
        buckets of DDP built with that cap.
        """
        measure = _fidelity_measure(profile, fidelity_measure)
        model = PerformanceModel(profile, scenario, overlap=overlap, exchange_mb=exchange_mb,
                                 bucket_cap_mb=bucket_cap_mb)
        problem = cls._of_model(model, _candidate_labels(profile, candidates), measure, budget=0.0,
                                kernel_forms=dict(profile.kernels.forms) if profile.kernels is not None else {})
        costs = problem.costs
        if budget is None:
            if reference is None:
                raise ValueError("give an accuracy budget (budget=...) or a reference config (reference=...)")
            ref = parse(reference).label
            if ref not in costs.configs:
                raise ValueError(
                    f"reference config {ref!r} is not among the candidates {costs.configs}; add it, "
                    "or give an explicit budget"
                )
            problem.budget = float(problem.fidelity_error(problem.uniform(ref))[0])
            problem.reference = ref
        else:
            if not (np.isfinite(budget) and budget >= 0):
                raise ValueError(f"budget={budget!r}; allowed: a finite relative error >= 0")
            problem.budget = float(budget)
        return problem

    @classmethod
    def _of_model(cls, model: PerformanceModel, labels: Sequence[str], measure: str, **fields) -> TuningProblem:
        """Costs, errors and size weights of ``labels`` on ``model``'s buckets (its layout's units)."""
        costs = model.candidate_costs(labels)
        numel = np.array([b.numel for b in model.buckets], dtype=np.float64)
        return cls(model, costs, _error_matrix(model.profile, model, costs.configs, measure), numel / numel.sum(),
                   parameter_names=[list(b.parameters) for b in model.buckets], fidelity_measure=measure, **fields)

    def with_layout(self, exchange_mb: float | None, bucket_cap_mb: float | None = None, *,
                    join_in_ddp: bool | None = None) -> TuningProblem:
        """The same problem (candidates, budget, correction) under another bucket layout;
        ``join_in_ddp``: price a join as DDP built with buckets of its size runs it, not joined
        in the hook (:meth:`advisor.perfmodel.PerformanceModel.with_layout`)."""
        model = self.model.with_layout(exchange_mb, bucket_cap_mb, join_in_ddp=join_in_ddp)
        return self._of_model(model, self.configs, self.fidelity_measure,
                              budget=self.budget, reference=self.reference, correction=self.correction,
                              kernel_forms=dict(self.kernel_forms))

    @property
    def exchange_mb(self) -> float | None:
        return self.model.exchange_mb

    @property
    def bucket_cap_mb(self) -> float | None:
        return self.model.bucket_cap_mb

    # --- plans as index vectors -----------------------------------------------------
    @property
    def n_buckets(self) -> int:
        return self.errors.shape[0]

    @property
    def configs(self) -> list[str]:
        return self.costs.configs

    def index(self, config: str) -> int:
        label = parse(config).label
        try:
            return self.costs.configs.index(label)
        except ValueError:
            raise ValueError(f"config {label!r} is not a candidate; candidates: {self.costs.configs}") from None

    def uniform(self, config: str) -> np.ndarray:
        """One plan (1 x buckets): ``config`` on every bucket."""
        return np.full((1, self.n_buckets), self.index(config), dtype=np.int64)

    def baselines(self) -> list[str]:
        return [c for c in self.configs if c in BASELINES]

    # --- evaluation -----------------------------------------------------------------
    def predict(self, choices: np.ndarray) -> np.ndarray:
        """Predicted iteration seconds per plan (corrected by the learned model if set)."""
        choices = np.atleast_2d(choices)
        seconds = self.model.predict_many(choices, self.costs)
        if self.correction is not None:
            seconds = self.correction.predict(plan_features(self, choices), seconds)
        return seconds

    def fidelity_error(self, choices: np.ndarray) -> np.ndarray:
        """Size-weighted mean relative error per plan."""
        choices = np.atleast_2d(choices)
        rows = np.arange(self.n_buckets)[None, :]
        return (self.errors[rows, choices] * self.weights[None, :]).sum(axis=1)

    def feasible(self, choices: np.ndarray) -> np.ndarray:
        return self.fidelity_error(choices) <= self.budget + _TOLERANCE

    def plan(self, choices: np.ndarray, **kwargs) -> Plan:
        """The runtime plan: each bucket's parameters get that bucket's config, in the profiled kernel forms."""
        choices = np.asarray(choices).reshape(-1)
        if choices.shape[0] != self.n_buckets:
            raise ValueError(f"a plan needs one choice per bucket ({self.n_buckets}), got {choices.shape[0]}")
        assignments = {}
        for names, c in zip(self.parameter_names, choices):
            label = self.configs[int(c)]
            if label != "none":
                for name in names:
                    assignments[name] = label
        return Plan.from_assignments(assignments, **{"kernel_forms": self.kernel_forms, "exchange_mb": self.exchange_mb,
                                                     "bucket_cap_mb": self.bucket_cap_mb, **kwargs})

    def choices_for(self, plan: Plan) -> np.ndarray:
        """The index vector of ``plan`` (each bucket takes its first parameter's config)."""
        out = np.zeros((1, self.n_buckets), dtype=np.int64)
        for b, names in enumerate(self.parameter_names):
            out[0, b] = self.index(plan.config_for(names[0]).label)
        return out

    def describe(self, choices: np.ndarray) -> str:
        """``fp16 x3, topk(ratio=0.01) x2`` style summary of one plan (and its bucket layout, where it joins buckets)."""
        labels = [self.configs[int(c)] for c in np.asarray(choices).reshape(-1)]
        counts: dict[str, int] = {}
        for label in labels:
            counts[label] = counts.get(label, 0) + 1
        layout = describe_layout(self.exchange_mb, self.bucket_cap_mb, ", ")
        if len(counts) == 1:
            return f"{labels[0]} everywhere{layout}"
        return ", ".join(f"{k} x{v}" for k, v in sorted(counts.items(), key=lambda kv: -kv[1])) + layout


def describe_layout(exchange_mb: float | None, bucket_cap_mb: float | None, lead: str = "") -> str:
    """``in 16 MiB exchanges`` / ``with DDP's buckets at 1 MiB`` (after ``lead``), or "" for DDP's own buckets."""
    if exchange_mb is not None:
        return f"{lead}in {exchange_mb:g} MiB exchanges"
    if bucket_cap_mb is not None:
        return f"{lead}with DDP's buckets at {bucket_cap_mb:g} MiB"
    return ""


def _candidate_labels(profile, candidates: Sequence[str] | None) -> list[str]:
    if candidates is None:
        measured = sorted(profile.kernels.costs) if profile.kernels is not None else []
        labels = list(BASELINES) + [c for c in measured if c not in BASELINES]
    else:
        if not candidates:
            raise ValueError("candidates is empty; give at least one config, e.g. ['none', 'fp16']")
        labels = []
        for c in candidates:
            label = parse(c).label  # raises naming the bad config and the allowed ones
            if label not in labels:
                labels.append(label)
        if "none" not in labels:
            labels.insert(0, "none")  # the fp32 baseline is always a valid answer
    return labels


def _fidelity_measure(profile, requested: str | None) -> str:
    available = profile.fidelity.measures if profile.fidelity is not None else ("gradient",)
    if requested is None:
        # the gradient error predicted the accuracy trial's gaps as well or better on the bundled
        # tasks (tests/test_accuracy.py); the update error stays measured, and can be chosen
        return "gradient"
    if requested not in FIDELITY_MEASURES:
        raise ValueError(f"fidelity_measure={requested!r}; allowed: {', '.join(FIDELITY_MEASURES)}")
    if requested not in available:
        raise ValueError(f"the profile has no {requested} errors (measured: {', '.join(available)}); profile "
                         "with the training optimizer to measure update errors")
    return requested


def _error_matrix(profile, model: PerformanceModel, labels: Sequence[str], measure: str = "gradient") -> np.ndarray:
    """Each of ``model``'s units' error under each config: the size-weighted mean of its parameters' errors,
    each parameter taking the error measured on the profiled DDP bucket it lies in.

    Buckets exchanged together keep their own compression (per matrix, per block), and a bucket
    DDP would make smaller holds the same matrices, so a parameter's error does not depend on
    which unit carries it.
    """
    errors = np.full((len(model.buckets), len(labels)), np.nan)
    by_key = {}
    if profile.fidelity is not None:
        by_key = {(e.bucket, e.config): e.update_error if measure == "update" else e.relative_error
                  for e in profile.fidelity.entries}
    bucket_of = {name: b.index for b in profile.compute.buckets for name in b.parameters}
    numel = {p.name: p.numel for p in profile.compute.parameters}
    for j, label in enumerate(labels):
        lossless = label == "none"
        for i, unit in enumerate(model.buckets):
            values, sizes = [], []
            for name in unit.parameters:
                value = 0.0 if lossless else by_key.get((bucket_of[name], label))
                if value is None:
                    raise ValueError(
                        f"the profile has no fidelity measurement of {label!r} on bucket {bucket_of[name]}; "
                        f"profile with it among the candidate configs (advisor profile --configs ...)"
                    )
                values.append(value)
                sizes.append(numel[name])
            errors[i, j] = float(np.dot(values, sizes) / max(sum(sizes), 1))
    return errors
