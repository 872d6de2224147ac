"""The accuracy trial: train plans briefly from the user's weights, next to fp32, and judge them.

Every arm is a *shadow*: a copy of the user's module (its current weights) in its own DDP
wrapper, with a clone of the user's optimizer (its state too), so the user's model and
optimizer are never stepped.  The fp32 reference arm (native DDP, no hook) and every plan's
arm train on the same batches in the same order; a second fp32 arm trains on the same
batches in another order, and the two fp32 arms' difference is the trial's own noise.
Every ``eval_every`` steps each rank evaluates its arm on held-out batches (batches the
trial does not train on), and one all-reduce averages the ranks' metrics; that one
collective also carries each rank's failure flag, so an ``evaluate`` that raises ends the
trial on every rank with the same error.

The trial's length is chosen from its noise: the two fp32 arms run in chunks until the
noise is estimated from at least ``noise_checkpoints`` paired checkpoints in the late
window and the reference has improved ``signal_to_noise`` times the tolerance it judges
with (see :mod:`policies.accuracy_gate`), up to ``max_steps`` or the time budget; every
later arm trains for that many steps, unless it falls so far behind (``stop_behind`` times
the tolerance, in the late window) that more steps cannot save it.
"""

from __future__ import annotations

import math
import random
import re
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel

from advisor.core.collectives import every_rank, mean_over_ranks, rank, slowest, world_size
from advisor.core.documents import check_int
from advisor.runtime import Plan, install
from advisor.tuning.live import LossFn, shadow_ddp
from policies import accuracy_gate as gate
from profilers.training_state import clone_optimizer

Evaluator = Callable[[nn.Module], Mapping[str, float]]

#: metric names read as "higher is better" when a workload does not say (all others: lower)
_HIGHER_IS_BETTER = re.compile(r"acc|f1|auc|bleu|score|precision|recall", re.IGNORECASE)


def higher_is_better(metric: str) -> bool:
    """Whether a larger value of ``metric`` is better (accuracy) or worse (loss, perplexity)."""
    return bool(_HIGHER_IS_BETTER.search(metric))


_metric_higher_is_better = higher_is_better  # AccuracyTrial's argument of that name hides the function



def held_out_loss(loss_fn: Callable[[nn.Module, Any], torch.Tensor], batches: Sequence[Any]) -> Evaluator:
    """An evaluator: the mean of ``loss_fn`` over ``batches``, without gradients, in eval mode."""
    batches = list(batches)
    if not batches:
        raise ValueError("held-out loss needs at least one held-out batch")

    def evaluate(model: nn.Module) -> dict[str, float]:
        was_training = model.training
        model.eval()
        try:
            with torch.no_grad():
                total = sum(float(loss_fn(model, b)) for b in batches)
        finally:
            model.train(was_training)
        return {"loss": total / len(batches)}

    return evaluate


#: min_steps multiples before a trial whose fp32 progress stays inside its noise stops as uninformative
UNINFORMATIVE_AFTER = 3


@dataclass
class ArmResult:
    """One arm of the trial: its metric at every checkpoint (mean over ranks) and the verdict."""

    label: str
    kind: str
    description: str
    values: list[float]
    seconds: float
    accepted: bool
    reason: str
    gap: float | None = None
    fidelity_error: float | None = None

    def __post_init__(self) -> None:
        if self.kind not in gate.ARM_KINDS:
            raise ValueError(f"arm kind {self.kind!r}; allowed: {gate.ARM_KINDS}")


@dataclass
class AccuracyTrialReport:
    """What the trial measured: noise, length, every arm's curve and verdict, the earned budget."""

    metric: str
    higher_is_better: bool
    checkpoints: list[int]
    noise: float
    tolerance: float
    progress: float
    held_out: bool
    length_reason: str
    seconds: float
    arms: list[ArmResult] = field(default_factory=list)
    budget: float | None = None
    budget_reason: str = ""
    fidelity_measure: str = "gradient"

    @property
    def informative(self) -> bool:
        """Whether fp32 improved by more than the tolerance: otherwise no harm short of divergence shows."""
        return self.progress > self.tolerance

    @property
    def steps(self) -> int:
        return self.checkpoints[-1]

    def arm(self, label: str) -> ArmResult:
        for a in self.arms:
            if a.label == label:
                return a
        raise KeyError(f"no arm {label!r} in the accuracy trial; arms: {[a.label for a in self.arms]}")

    def rejected(self) -> list[ArmResult]:
        return [a for a in self.arms if not a.accepted]


class AccuracyTrial:
    """Paired short trials of plans against fp32; every rank calls every method in the same order.

    Call :meth:`start` once (it runs the two fp32 arms and fixes the trial's length), then
    :meth:`trial` per plan, then :meth:`report`.  ``evaluate(model) -> {metric: value}``
    judges a model on this rank (default: the held-out loss over ``held_out``; without
    either, the last quarter of ``batches`` (at most 8) is held out when there are 8 or more, else
    the trial evaluates on the batches it trains on and says so).  ``min_tolerance``
    is the smallest relative gap ever counted as harm (the fp32 arms can agree exactly,
    with one batch for example).  ``time_budget_s`` bounds the whole trial, with
    ``arms_expected`` arms in all (the fp32 pair included).
    """

    def __init__(self, ddp: DistributedDataParallel, loss_fn: LossFn, batches: Sequence[Any],
                 optimizer: torch.optim.Optimizer, *, evaluate: Evaluator | None = None,
                 held_out: Sequence[Any] | None = None, metric: str = "loss",
                 higher_is_better: bool | None = None, min_steps: int = 8, max_steps: int = 200,
                 eval_every: int = 4, noise_checkpoints: int = 4, signal_to_noise: float = 8.0,
                 min_tolerance: float = 0.002, stop_behind: float = 4.0, time_budget_s: float = 30.0,
                 arms_expected: int = 6, group=None,
                 progress: Callable[[str], None] | None = None) -> None:
        if not isinstance(ddp, DistributedDataParallel):
            raise TypeError(f"the accuracy trial needs a DistributedDataParallel model, got {type(ddp).__name__}")
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"the accuracy trial needs the training optimizer, got {type(optimizer).__name__}")
        for name, value, minimum in (("min_steps", min_steps, 1), ("max_steps", max_steps, 1),
                                     ("eval_every", eval_every, 1), ("arms_expected", arms_expected, 2),
                                     ("noise_checkpoints", noise_checkpoints, 1)):
            check_int(name, value, minimum)
        if max_steps < min_steps:
            raise ValueError(f"max_steps={max_steps} < min_steps={min_steps}; allowed: max_steps >= min_steps")
        for name, value in (("signal_to_noise", signal_to_noise), ("time_budget_s", time_budget_s),
                            ("stop_behind", stop_behind)):
            if not (isinstance(value, (int, float)) and value > 0):
                raise ValueError(f"{name}={value!r}; allowed: a number > 0")
        if not 0 <= min_tolerance < 1:
            raise ValueError(f"min_tolerance={min_tolerance!r}; allowed: 0 <= min_tolerance < 1")
        check_evaluate(evaluate)
        batches = list(batches)
        if not batches:
            raise ValueError("the accuracy trial needs at least one batch")
        self.ddp, self.loss_fn, self.optimizer, self.group = ddp, loss_fn, optimizer, group
        self.metric = metric
        self.higher = higher_is_better if higher_is_better is not None else _metric_higher_is_better(metric)
        self.min_steps, self.max_steps, self.eval_every = min_steps, max_steps, eval_every
        self.signal_to_noise, self.min_tolerance = float(signal_to_noise), float(min_tolerance)
        self.noise_checkpoints, self.stop_behind = noise_checkpoints, float(stop_behind)
        self.time_budget_s, self.arms_expected = float(time_budget_s), arms_expected
        self.say = progress or (lambda msg: None)
        self._evaluate_arg, self._held_out_arg, self._batches = evaluate, held_out, batches
        self._report: AccuracyTrialReport | None = None

    # --- the fp32 pair ---------------------------------------------------------------
    def start(self) -> AccuracyTrialReport:
        """Run the fp32 reference and the other-order fp32 arm; fix noise, tolerance and length."""
        t0 = time.perf_counter()
        self.train, self.evaluate, held_out = self._split()
        n = len(self.train)
        self.order = list(range(n))
        other = list(range(n))
        random.Random(1).shuffle(other)
        ref, noise_arm = self._arm(None)[:2], self._arm(None)[:2]
        t_eval = time.perf_counter()
        first = self._checkpoint([ref[0].module, noise_arm[0].module], initial=True)
        eval_s = self._elapsed(t_eval) / 2  # one evaluation of one model
        self.initial = first[0]
        curves = [[first[0]], [first[1]]]
        checkpoints, step = [0], 0
        chunk = self.eval_every
        while True:
            t_chunk = time.perf_counter()
            for (model, opt), order in ((ref, self.order), (noise_arm, other)):
                self._steps(model, opt, order, step, chunk)
            step_s = self._elapsed(t_chunk) / (2 * chunk)
            step += chunk
            values = self._checkpoint([ref[0].module, noise_arm[0].module])
            curves[0].append(values[0])
            curves[1].append(values[1])
            checkpoints.append(step)
            noise = gate.noise_band(checkpoints, curves[0], curves[1], self.higher)
            learned = gate.progress(curves[0], self.higher)
            per_arm_s = self._elapsed(t0) / 2
            if not all(math.isfinite(v) for c in curves for v in c):
                raise FloatingPointError(
                    f"the fp32 arm's held-out {self.metric} became NaN/Inf within {step} steps of the accuracy "
                    "trial; training diverges without compression too: check the learning rate and the batches")
            enough_noise = len(gate.late_window(checkpoints)) >= self.noise_checkpoints
            if step >= self.min_steps and enough_noise and gate.long_enough(learned, noise, self.signal_to_noise,
                                                                            self.min_tolerance):
                why = (f"fp32 improved {learned:.1%} in {step} steps, {self.signal_to_noise:g}x the "
                       f"tolerance ({max(noise, self.min_tolerance):.2%}, from {self.noise_checkpoints} "
                       "late checkpoints)")
                break
            # fp32 that learns nothing (random batches) ends the trial at once; a noise band that
            # swamps real progress may still settle (fast early training differs most between
            # batch orders), so that trial is declared uninformative only later
            swamped = learned <= max(noise, self.min_tolerance)
            flat = swamped and learned <= 2 * self.min_tolerance
            if step >= self.min_steps and enough_noise and (
                    flat or (swamped and step >= UNINFORMATIVE_AFTER * self.min_steps)):
                why = (f"stopped after {step} steps: fp32 did not improve the held-out {self.metric} by more than "
                       f"the noise ({learned:+.2%} vs {max(noise, self.min_tolerance):.2%}), so the trial can only "
                       "catch divergence")
                break
            if step + chunk > self.max_steps:
                why = f"stopped at max_steps={self.max_steps} (fp32 improved {learned:.1%}; noise {noise:.2%})"
                break
            # where a step costs much more than an evaluation (a slow link), evaluate more often,
            # so that even a short trial has late checkpoints enough for the sign test
            chunk = max(1, min(self.eval_every, math.ceil(3 * eval_s / max(step_s, 1e-9))))
            projected = per_arm_s * (step + chunk) / step * self.arms_expected
            if step >= self.min_steps and projected > self.time_budget_s:
                why = (f"stopped after {step} steps at the trial's time budget ({self.time_budget_s:g} s for "
                       f"{self.arms_expected} arms; fp32 improved {learned:.1%}, noise {noise:.2%}): "
                       "a short trial sees only large harm")
                break
        if n == 1:
            why += "; one training batch: both fp32 arms see the same batches, so the noise is not measured"
        tolerance = max(noise, self.min_tolerance)
        self._report = AccuracyTrialReport(
            metric=self.metric, higher_is_better=self.higher, checkpoints=checkpoints, noise=noise,
            tolerance=tolerance, progress=learned, held_out=held_out, length_reason=why, seconds=0.0)
        seconds = self._elapsed(t0)
        self._report.arms.append(ArmResult("fp32", gate.REFERENCE, "fp32 (native DDP)", curves[0], seconds / 2,
                                           True, "the reference", 0.0, 0.0))
        gap = gate.relative_gap(checkpoints, curves[1], curves[0], self.higher)
        self._report.arms.append(ArmResult("fp32 (other order)", gate.NOISE, "fp32, batches in another order",
                                           curves[1], seconds / 2, True, "the noise of the trial", gap, 0.0))
        self._report.seconds = seconds
        return self._report

    # --- one plan -------------------------------------------------------------------
    def trial(self, label: str, plan: Plan, kind: str = gate.CANDIDATE, description: str = "",
              fidelity_error: float | None = None) -> ArmResult:
        """Train ``plan`` for the trial's length from the same start and batches; judge it against fp32."""
        report = self._require_started()
        self.say(f"accuracy trial: {label} ({report.steps} steps)")
        t0 = time.perf_counter()
        model, opt, hook = self._arm(plan)
        reference = report.arm("fp32").values
        tolerance = report.tolerance if report.informative else math.inf
        late = set(gate.late_window(report.checkpoints))
        stopped, behind = "", math.nan
        try:
            curve = [self.initial]
            for i, start in enumerate(report.checkpoints[:-1]):
                self._steps(model, opt, self.order, start, report.checkpoints[i + 1] - start)
                curve.append(self._checkpoint([model.module])[0])
                if i + 1 in late and i + 2 < len(report.checkpoints):
                    behind = gate.signed_relative(curve[-1:], reference[i + 1 : i + 2], self.higher)[0]
                    if not math.isfinite(curve[-1]) or behind > self.stop_behind * tolerance:
                        stopped = f" (stopped at step {report.checkpoints[i + 1]}: {behind:+.1%} behind)"
                        break
        finally:
            if hook is not None:
                hook.close()
        if stopped:  # judged by how far behind it was where it stopped
            gap = behind if math.isfinite(curve[-1]) else math.inf
        else:
            gap = gate.relative_gap(report.checkpoints, curve, reference, self.higher)
        behind = (not stopped and report.informative
                  and gate.consistently_behind(report.checkpoints, curve, reference, self.higher))
        verdict = gate.judge(description or label, gap, report.tolerance, behind, self.min_tolerance,
                             informative=report.informative)
        verdict.reason += stopped
        arm = ArmResult(label, kind, description or label, curve, self._elapsed(t0), verdict.accepted,
                        verdict.reason, gap if math.isfinite(gap) else None, fidelity_error)
        report.arms.append(arm)
        report.seconds += arm.seconds
        return arm

    def report(self) -> AccuracyTrialReport:
        return self._require_started()

    # --- the pieces --------------------------------------------------------------------
    def _require_started(self) -> AccuracyTrialReport:
        if self._report is None:
            raise RuntimeError("call AccuracyTrial.start() before trialling plans")
        return self._report

    def _split(self) -> tuple[list[Any], Evaluator, bool]:
        batches = self._batches
        if self._evaluate_arg is not None:
            return batches, self._evaluate_arg, True
        if self._held_out_arg:
            return batches, held_out_loss(self.loss_fn, self._held_out_arg), True
        if len(batches) >= 8:  # a quarter held out, at most 8 batches: each checkpoint evaluates them all
            cut = len(batches) - min(8, max(2, len(batches) // 4))
            return batches[:cut], held_out_loss(self.loss_fn, batches[cut:]), True
        return batches, held_out_loss(self.loss_fn, batches), False

    def _arm(self, plan: Plan | None):
        model = shadow_ddp(self.ddp)
        opt = clone_optimizer(self.optimizer, self.ddp.module, model.module)
        hook = install(model, plan, group=self.group) if plan is not None else None
        return model, opt, hook

    def _steps(self, model, opt, order: Sequence[int], start: int, count: int) -> None:
        for i in range(start, start + count):
            opt.zero_grad(set_to_none=True)
            self.loss_fn(model, self.train[order[i % len(order)]]).backward()
            opt.step()

    def _elapsed(self, t0: float) -> float:
        """Seconds since ``t0``, averaged over ranks (every rank must agree on when to stop)."""
        return mean_over_ranks([time.perf_counter() - t0], self.group)[0]

    def _checkpoint(self, models: Sequence[torch.nn.Module], initial: bool = False) -> list[float]:
        """The decisive metric of each model, averaged over ranks."""
        found = evaluate_on_every_rank(self.evaluate, models, self.metric, self.group, require_finite=initial)
        return [m[self.metric] for m in found]


def check_evaluate(evaluate) -> None:
    """Refuse an ``evaluate`` that is given but cannot be called, naming what is allowed."""
    if evaluate is not None and not callable(evaluate):
        raise TypeError(f"evaluate={evaluate!r}; allowed: a callable evaluate(model) -> {{metric: value}}")


def evaluate_on_every_rank(evaluate: Evaluator, models: Sequence[torch.nn.Module], metric: str, group=None,
                           require_finite: bool = False) -> list[dict[str, float]]:
    """Each model's metrics, averaged over ranks; an ``evaluate`` that fails, fails on every rank.

    Every rank calls it with its own held-out data.  One all-reduce carries every value and
    a failure flag per rank; only when one is set are the ranks' messages gathered, so the
    error names each failing rank and its exception.  ``require_finite``: a non-finite
    value counts as a failure of ``evaluate`` (on weights known to be finite).
    """
    world, me = world_size(group), rank(group)
    found: list[dict[str, float]] = []
    problem = None
    for model in models:
        try:
            found.append(_metrics(evaluate(model), metric))
        except Exception as exc:  # the user's evaluate may fail in any way; every rank must hear of it
            problem = f"{type(exc).__name__}: {exc}"
            break
    if problem is None and require_finite:
        bad = [f"{k}={v}" for m in found for k, v in m.items() if not math.isfinite(v)]
        if bad:
            problem = f"it returned {', '.join(bad)} for the model's current weights"
    keys = sorted(found[0]) if found and problem is None else []
    width = len(models) * len(keys)
    values = [m[k] for m in found for k in keys] if problem is None else []
    # every rank sends the same length: its values (or zeros), its key count, a flag per rank
    n = int(slowest([width], group)[0])
    flags = [0.0] * world
    flags[me] = 1.0 if problem is not None or len(values) != n else 0.0
    if problem is None and len(values) != n:
        problem = f"it returned {len(keys)} metrics ({', '.join(keys)}), unlike another rank's"
    t = mean_over_ranks((values if len(values) == n else [0.0] * n) + flags, group)
    failed = [r for r in range(world) if t[n + r] > 0]
    if failed:
        messages = every_rank(problem, group)
        detail = "; ".join(f"rank {r}: {messages[r]}" for r in failed)
        raise ValueError(f"evaluate(model) failed ({detail}); it must return a dict of finite numbers including "
                         f"{metric!r}. Nothing of the model or optimizer changed")
    averaged = t[:n]
    per = len(keys)
    return [dict(zip(keys, averaged[i * per : (i + 1) * per])) for i in range(len(models))]


def _metrics(metrics: Any, metric: str) -> dict[str, float]:
    if not isinstance(metrics, Mapping):
        raise TypeError(f"evaluate returned {type(metrics).__name__}; it must return a dict {{metric: value}}")
    if metric not in metrics:
        raise KeyError(f"evaluate returned {sorted(metrics)}, without the metric {metric!r} that decides")
    return {str(k): float(v) for k, v in metrics.items()}

