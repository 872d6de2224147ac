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

The trial's length is chosen from the power it needs: the two fp32 arms run in chunks
until the smallest gap the trial could detect is below the tolerance of the claim (1% of
the metric by default; :mod:`policies.evidence`, :mod:`policies.accuracy_gate`), or
until its budget (a share of the user's run, or seconds) is spent.  A trial that ends
without that power clears no lossy plan; its report says how long one would need.  Every
later arm trains for the trial's length, unless it falls so far behind (``stop_behind``
times the tolerance, in the late window) that more steps cannot save it.

Batches are drawn lazily from whatever the user holds (:class:`advisor.tuning.data.BatchStream`).
"""

from __future__ import annotations

import math
import re
import statistics
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel

from advisor.core.collectives import every_rank, mean_over_ranks, rank, slowest, world_size
from advisor.core.documents import check_int
from advisor.runtime import Plan, install
from advisor.tuning.data import BatchStream, draw_on_every_rank, set_aside_on_every_rank
from advisor.tuning.exchange_free import ExchangeFreeArm, is_elementwise, supports_exchange_free
from advisor.tuning.live import LossFn, shadow_ddp
from policies import accuracy_gate as gate
from policies import evidence
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


@dataclass
class ArmResult:
    """One arm of the trial: its metric at every checkpoint (mean over ranks) and the verdict.

    ``status``: accepted, rejected or not proven (:mod:`policies.accuracy_gate`);
    ``gap``: its mean late gap behind fp32 (relative, positive: worse; None: diverged or
    not trained); ``efficiency``: fp32 steps per step of this arm, read from fp32's curve,
    with the standard error of its logarithm (None where it cannot be read);
    ``horizon_gap``: the gap extrapolated to the run's length where the trial showed it
    growing.
    """

    label: str
    kind: str
    description: str
    values: list[float]
    seconds: float
    accepted: bool
    reason: str
    gap: float | None = None
    fidelity_error: float | None = None
    status: str = ""
    efficiency: float | None = None
    efficiency_se: float | None = None
    horizon_gap: float | None = None

    def __post_init__(self) -> None:
        if self.kind not in gate.ARM_KINDS:
            raise ValueError(f"arm kind {self.kind!r}; allowed: {gate.ARM_KINDS}")
        if not self.status:
            self.status = gate.ACCEPTED if self.accepted else gate.REJECTED
        if self.status not in gate.STATUSES:
            raise ValueError(f"arm status {self.status!r}; allowed: {gate.STATUSES}")
        if self.accepted != (self.status == gate.ACCEPTED):
            raise ValueError(f"arm {self.label!r}: accepted={self.accepted} contradicts status {self.status!r}")

    def efficiency_estimate(self) -> evidence.Estimate | None:
        """The step efficiency with its error, or None where the trial could not read it."""
        if self.efficiency is None or self.efficiency_se is None:
            return None
        return evidence.Estimate(self.efficiency, self.efficiency_se)


@dataclass
class AccuracyTrialReport:
    """What the trial measured: its noise and power, its length and why, every arm's curve and verdict.

    ``tolerance``: the claim a lossy plan must prove (within this relative gap of fp32);
    ``se``: the standard error of an arm's gap, from the two fp32 arms; ``detectable``:
    the smallest gap the trial could detect (80% power, 5%); ``powered``: whether that
    is within the tolerance and the trial long enough, so that lossy plans can be proven
    at all; ``steps_needed``: about how many steps would make it so; ``kappa``: how fast
    fp32 still improved late (a relative gap of ``kappa`` is worth a factor e in steps).
    """

    metric: str
    higher_is_better: bool
    checkpoints: list[int]
    tolerance: float
    se: float
    detectable: float
    powered: bool
    steps_needed: int
    kappa: float
    kappa_se: float
    progress: float
    held_out: bool
    length_reason: str
    seconds: float
    arms: list[ArmResult] = field(default_factory=list)
    budget: float | None = None
    budget_reason: str = ""
    fidelity_measure: str = "gradient"
    #: the run length the trial's gaps are extrapolated to (None: unknown)
    horizon: int | None = None
    warnings: list[str] = field(default_factory=list)
    #: what one evaluation costs in training steps, which sets how far apart the checkpoints are:
    #: "counted" from the held-out batches, or "timed" for the user's ``evaluate`` (None: not known)
    evaluation_steps: float | None = None
    evaluation_cost: str = ""
    #: whether the fp32 arms and 16-bit casts trained exchange-free: every rank computed every
    #: rank's gradients, and no gradient crossed the link (:mod:`advisor.tuning.exchange_free`)
    exchange_free: bool = False
    exchange_reason: str = ""
    #: why a trial that cleared every bar at its last checkpoint is still not powered: the one
    #: before did not ("" where that is not why)
    powered_once: str = ""
    #: the two fp32 arms' mean relative difference over the late window (the other order's gap):
    #: the part of ``se`` that a longer trial removes only if the two orders draw together
    fp32_offset: float = 0.0

    @property
    def informative(self) -> bool:
        """Whether fp32 improved by more than the trial could tell from noise: otherwise no harm
        short of divergence shows."""
        return self.progress > self.detectable

    @property
    def steps(self) -> int:
        return self.checkpoints[-1]

    def arm(self, label: str) -> ArmResult:
        for a in self.arms:
            if a.label == label:
                return a
        raise KeyError(f"no arm {label!r} in the accuracy trial; arms: {[a.label for a in self.arms]}")

    def rejected(self) -> list[ArmResult]:
        return [a for a in self.arms if a.status == gate.REJECTED]

    def what_would_prove(self) -> str:
        """What a trial would need to prove lossy plans, where this one could not ("" where it can)."""
        if self.powered:
            return ""
        if not self.informative:
            if self.progress > 2 * self.tolerance:  # it learned, but two fp32 runs end as far apart
                return (f"fp32 improved the held-out {self.metric} {self.progress:.1%} in {self.steps} steps, but "
                        f"two fp32 runs in different batch orders ended too far apart to read a gap (the trial "
                        f"could detect {self.detectable:.1%}): judge by another metric (evaluate=, metric=), or "
                        "more held-out data")
            return (f"fp32 did not improve the held-out {self.metric} beyond the trial's noise in {self.steps} steps "
                    f"({self.progress:+.2%}), so no gap can be read: pass batches of real data, or evaluate=")
        late = len(evidence.late_window(self.checkpoints))
        if self.detectable > self.tolerance:
            seen = (f"the trial could detect gaps of {self.detectable:.2%} or more after {self.steps} steps, not "
                    f"{self.tolerance:.2%}")
        elif self.steps < gate.MIN_PROOF_STEPS or late < gate.MIN_LATE_CHECKPOINTS:
            seen = (f"the trial ran {self.steps} steps with {late} late checkpoints; a compressed plan is proven "
                    f"only after {gate.MIN_PROOF_STEPS} steps and {gate.MIN_LATE_CHECKPOINTS} late checkpoints")
        elif self.powered_once:
            seen = self.powered_once
        else:
            seen = (f"fp32's held-out {self.metric} no longer improved late in the trial, so a plan's gap cannot "
                    "be read as steps")
        caveat = ""
        hidden = evidence.POWER_Z * abs(self.fp32_offset)
        if hidden >= self.tolerance:
            # steps_needed shrinks the whole error with length; the orders' mean gap need not shrink
            caveat = (f"; that assumes the two fp32 orders draw together: their mean gap over the late checkpoints "
                      f"({abs(self.fp32_offset):.2%}) alone hides gaps below {hidden:.2%}, and a longer trial removes it "
                      "only if they do")
        return (f"{seen}; about {self.steps_needed} steps an arm would do (pass expected_steps= with your run's "
                f"length, or a larger trial_share= or trial_s=){caveat}")


@dataclass
class TrialArm:
    """One shadow the trial trains: ``model`` (stepped), ``module`` (evaluated: the model without a
    wrapper that would run collectives of its own), its ``optimizer``, and ``close()`` to remove
    whatever was installed on it.  ``train(batch, start, count)``, where given, trains it instead
    of the usual loop over ``loss_fn(model, batch(i)).backward()`` and ``optimizer.step()``."""

    model: nn.Module
    module: nn.Module
    optimizer: torch.optim.Optimizer
    close: Callable[[], None]
    train: Callable[[Callable[[int], Any], int, int], None] | None = None


class AccuracyTrial:
    """Paired trials of plans against fp32; every rank calls every method in the same order.

    Call :meth:`start` once (it runs the two fp32 arms and fixes the trial's length), then
    :meth:`trial` per plan, then :meth:`report`.  ``evaluate(model) -> {metric: value}``
    judges a model on this rank (default: the held-out loss over ``held_out``; without
    either, held-out batches come from ``batches``: see :meth:`BatchStream.held_out`).

    The fp32 pair trains until the trial is *powered*, the smallest gap it could detect
    below ``tolerance`` (:mod:`policies.accuracy_gate`), or until its budget: at most
    ``budget_steps`` training steps over all ``arms_expected`` arms (the fp32 pair
    included; a share of the user's run), ``time_budget_s`` seconds, and ``max_steps``
    steps an arm.  It also stops once fp32 learns nothing its noise lets it see (after
    ``min_steps``).  ``horizon``: the run's length in steps, to which growing gaps are
    extrapolated.  ``se_floor`` bounds the noise from below (two fp32 arms can agree
    exactly, with one batch for example).  ``judge_unpowered``: train lossy plans even in a
    trial that is not powered, to measure their gaps (they are still never accepted).
    ``exchange_free``: train the fp32 arms and elementwise plans (16-bit casts) with every
    rank's gradients computed on each rank, so none crosses the link
    (:mod:`advisor.tuning.exchange_free`; for a slow link, where that is cheaper);
    ``exchange_reason``: why the arms exchange as they do, for the report.  ``budget_reason``:
    how ``budget_steps`` was found, for the report.
    """

    def __init__(self, ddp: DistributedDataParallel | nn.Module, loss_fn: LossFn, batches: Iterable[Any] | BatchStream,
                 optimizer: torch.optim.Optimizer, *, evaluate: Evaluator | None = None,
                 held_out: Sequence[Any] | None = None, metric: str = "loss",
                 higher_is_better: bool | None = None, tolerance: float = gate.DEFAULT_TOLERANCE,
                 min_steps: int = 8, max_steps: int = 2000, eval_every: int = 4, se_floor: float = 0.0005,
                 stop_behind: float = 4.0, time_budget_s: float | None = 60.0, budget_steps: int | None = None,
                 horizon: int | None = None, arms_expected: int = 6, judge_unpowered: bool = False, group=None,
                 progress: Callable[[str], None] | None = None,
                 shadows: Callable[[Plan | None], TrialArm] | None = None, exchange_free: bool = False,
                 exchange_reason: str = "", budget_reason: str = "a share of the run") -> None:
        if shadows is None and not isinstance(ddp, DistributedDataParallel):
            raise TypeError(f"the accuracy trial needs a DistributedDataParallel model (or shadows= that copies "
                            f"another kind), got {type(ddp).__name__}")
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"the accuracy trial needs the training optimizer, got {type(optimizer).__name__}")
        for name, value, minimum in (("min_steps", min_steps, 1), ("max_steps", max_steps, 1),
                                     ("eval_every", eval_every, 1), ("arms_expected", arms_expected, 2)):
            check_int(name, value, minimum)
        if max_steps < min_steps:
            raise ValueError(f"max_steps={max_steps} < min_steps={min_steps}; allowed: max_steps >= min_steps")
        if not (isinstance(stop_behind, (int, float)) and stop_behind > 0):
            raise ValueError(f"stop_behind={stop_behind!r}; allowed: a number > 0")
        check_tolerance(tolerance)
        if time_budget_s is not None and not (isinstance(time_budget_s, (int, float)) and time_budget_s > 0):
            raise ValueError(f"time_budget_s={time_budget_s!r}; allowed: a number of seconds > 0, or None")
        for name, value in (("budget_steps", budget_steps), ("horizon", horizon)):
            if value is not None:
                check_int(name, value, 1)
        if not 0 <= se_floor < 1:
            raise ValueError(f"se_floor={se_floor!r}; allowed: 0 <= se_floor < 1")
        check_evaluate(evaluate)
        if exchange_free:
            if shadows is not None:
                raise ValueError("exchange_free=True trains copies of a DDP model's module; it does not apply to "
                                 "shadows= of another kind (leave exchange_free=False)")
            supported, why = supports_exchange_free(ddp)
            if not supported:
                raise ValueError(f"exchange_free=True cannot replay this model's exchange: {why}; leave "
                                 "exchange_free=False")
        self.exchange_free, self.exchange_reason = bool(exchange_free), str(exchange_reason)
        self.budget_reason = str(budget_reason)
        self.ddp, self.loss_fn, self.optimizer, self.group = ddp, loss_fn, optimizer, group
        self._shadows = shadows or self._ddp_shadow
        self.metric = metric
        self.higher = higher_is_better if higher_is_better is not None else _metric_higher_is_better(metric)
        self.min_steps, self.max_steps, self.eval_every = min_steps, max_steps, eval_every
        self.tolerance, self.se_floor, self.stop_behind = float(tolerance), float(se_floor), float(stop_behind)
        self.time_budget_s, self.budget_steps, self.horizon = time_budget_s, budget_steps, horizon
        self.arms_expected, self.judge_unpowered = arms_expected, judge_unpowered
        self.say = progress or (lambda msg: None)
        self._evaluate_arg, self._held_out_arg = evaluate, held_out
        self.stream = batches if isinstance(batches, BatchStream) else BatchStream(batches)
        self._report: AccuracyTrialReport | None = None

    # --- the fp32 pair ---------------------------------------------------------------
    def start(self) -> AccuracyTrialReport:
        """Run the fp32 reference and the other-order fp32 arm; fix noise, power and length."""
        t0 = time.perf_counter()
        self.evaluate, held_out, eval_batches = self._evaluator()
        # what one evaluation costs in training steps: counted where the evaluator is the held-out
        # loss (a batch's forward is about a third of a training step), so the same call on the
        # same data checkpoints at the same steps whatever the machine's timing (checkpoints that
        # move move the trial's noise and verdicts); a user's evaluate= can only be timed
        # (_timed_evaluation_cost), robustly and coarsely
        eval_steps = slowest([len(eval_batches)], self.group)[0] / 3 if eval_batches is not None else None
        eval_cost = "counted" if eval_steps is not None else "timed"
        ref, noise_arm = self._arm(None), self._arm(None)
        eval_times: list[float] = []
        first = self._checkpoint([ref.module, noise_arm.module], initial=True, times=eval_times)
        self.initial = first[0]
        curves = [[first[0]], [first[1]]]
        checkpoints, step, chunk = [0], 0, self.eval_every
        was_powered = is_powered = False
        # what kept the last two checkpoints from being powered ("" where nothing did)
        short_before = short_now = ""
        # a powered trial still goes on, within its budget, until a growing gap may be carried to
        # the run's length: read too early, the arms' parting looks like growth
        long_enough, powered_at, first_powered = evidence.steps_to_extrapolate(self.horizon), None, None
        while True:
            draw_on_every_rank(self.stream, step + chunk, self.group)
            self._steps(ref, self.stream.train, step, chunk)
            self._steps(noise_arm, self.stream.other_order, step, chunk)
            first_chunk = step == 0
            step += chunk
            values = self._checkpoint([ref.module, noise_arm.module], times=eval_times)
            curves[0].append(values[0])
            curves[1].append(values[1])
            checkpoints.append(step)
            if not all(math.isfinite(v) for c in curves for v in c):
                raise FloatingPointError(
                    f"the fp32 arm's held-out {self.metric} became NaN/Inf within {step} steps of the accuracy "
                    "trial; training diverges without compression too: check the learning rate and the batches")
            noise = evidence.trial_noise(checkpoints, curves[0], curves[1], self.higher, self.se_floor)
            kappa, _ = evidence.elasticity(checkpoints, curves[0], self.higher)
            learned = gate.progress(curves[0], self.higher)
            late = len(evidence.late_window(checkpoints))
            short_before, short_now = short_now, gate.short_of_power(noise.detectable, self.tolerance, step, late) or (
                f"fp32's held-out {self.metric} had not improved late" if kappa <= 0 else "")
            was_powered, is_powered = is_powered, not short_now
            # twice in a row: one lucky noise estimate does not end it
            powered_at = (powered_at or step) if is_powered and was_powered else None
            first_powered = first_powered or powered_at
            if powered_at is not None and step >= long_enough:
                why = (f"powered after {step} steps: it could detect a gap of {noise.detectable:.2%} (tolerance "
                       f"{self.tolerance:.2%}); fp32 improved {learned:.1%}")
                if first_powered < step:
                    why += (f" (first powered at step {first_powered}; it went on to at least {long_enough} steps, so "
                            f"that a gap's growth is carried to step {self.horizon} no farther, in ln(step), than the "
                            "trial spans)")
                break
            if self._learns_nothing(step, late, learned, noise.detectable):
                why = (f"stopped after {step} steps: fp32's held-out {self.metric} improved {learned:+.2%}, no more "
                       f"than the trial could tell from noise ({noise.detectable:.2%}), so it can only catch "
                       "divergence")
                break
            # evaluate about a dozen times per doubling of the trial, and spend at most about a
            # fifth of the trial's time evaluating
            if eval_steps is None and first_chunk:
                eval_steps = self._timed_evaluation_cost(ref.module, eval_times)
            chunk = max(1, math.ceil(step / 12), math.ceil(4 * eval_steps))
            # the trial stops on its checkpoint schedule, at the last checkpoint its budget allows,
            # where that forgoes little (a chunk of at most an eighth of the trial so far): a budget
            # priced from measured speeds moves a few percent between calls of the same job, and a
            # last chunk cut to it moved the last checkpoint, the noise read from the late window, and
            # verdicts near the tolerance.  A chunk set by a costly evaluation is cut to the budget.
            room, bound = self._room(t0, step)
            if room < 1 or room < chunk <= step / 8:
                why = (f"stopped after {step} steps at {bound}, " + (
                    f"powered (it could detect {noise.detectable:.2%}) but short of the {long_enough} steps from "
                    f"which a gap's growth is carried to step {self.horizon} no farther, in ln(step), than the trial "
                    "spans" if powered_at is not None else
                    f"powered at this checkpoint only, not twice in a row (it could detect {noise.detectable:.2%})"
                    if is_powered else f"not powered: it could detect {noise.detectable:.2%}"))
                break
            chunk = min(chunk, room)
        kappa, kappa_se = evidence.elasticity(checkpoints, curves[0], self.higher)
        powered_once = ""
        if is_powered and not was_powered:
            powered_once = (f"the trial was powered at its last checkpoint only (step {step}: it could detect "
                            f"{noise.detectable:.2%}; at step {checkpoints[-2]} {short_before}); a plan is proven only "
                            "where two checkpoints in a row are powered, so that one lucky estimate of the noise "
                            "proves nothing")
        notes = [w for w in [self.stream.warn_if_memorising(step, self.say)] if w]
        if self.stream.distinct == 1:
            notes.append("one training batch: both fp32 arms see the same batches, so the noise is not measured")
        self._report = AccuracyTrialReport(
            metric=self.metric, higher_is_better=self.higher, checkpoints=checkpoints, tolerance=self.tolerance,
            se=noise.se, detectable=noise.detectable, powered=is_powered and was_powered,
            steps_needed=max(noise.steps_to_detect(step, self.tolerance), gate.MIN_PROOF_STEPS, long_enough),
            kappa=kappa,
            kappa_se=kappa_se,
            progress=learned, held_out=held_out, length_reason=why, seconds=0.0, horizon=self.horizon,
            warnings=notes, evaluation_steps=eval_steps, evaluation_cost=eval_cost, exchange_free=self.exchange_free,
            exchange_reason=self.exchange_reason, powered_once=powered_once, fp32_offset=noise.offset)
        seconds = self._elapsed(t0)
        self._report.arms.append(ArmResult("fp32", gate.REFERENCE, "fp32 (native DDP)", curves[0], seconds / 2,
                                           True, "the reference", 0.0, 0.0, efficiency=1.0, efficiency_se=0.0))
        self._report.arms.append(self._judged("fp32 (other order)", gate.NOISE, "fp32, batches in another order",
                                              curves[1], seconds / 2, 0.0, ""))
        self._report.seconds = seconds
        return self._report

    def _timed_evaluation_cost(self, module: nn.Module, eval_times: list[float]) -> float:
        """What one evaluation by the user's ``evaluate`` costs in training steps, the same on every rank.

        The checkpoints' spacing follows from it, and the trial's noise and verdicts from the
        checkpoints, so it must move as little as it can with the machine's timing.  It is
        timed against what it is made of, forward passes: the median evaluation over the
        median of three forwards of a training batch (no collective, no backward, whose times
        vary most), at a third of a step each as where it is counted.  It is not rounded: a
        grid puts some task's cost on a boundary, where the spacing then jumps with the noise
        (one timed chunk of steps rounded to a power of two gave the same call on the same data
        checkpoints 16 and 32 steps apart); unrounded, noise moves a checkpoint a step or two.
        """
        forwards = []
        was_training = module.training
        module.eval()
        try:
            with torch.no_grad():
                for _ in range(3):
                    t0 = time.perf_counter()
                    self.loss_fn(module, self.stream.train(0))
                    forwards.append(time.perf_counter() - t0)
        finally:
            module.train(was_training)
        eval_s, forward_s = mean_over_ranks([statistics.median(eval_times), statistics.median(forwards)], self.group)
        return eval_s / max(3 * forward_s, 1e-9)

    def _learns_nothing(self, step: int, late: int, learned: float, detectable: float) -> bool:
        """fp32 that learns nothing (random batches) ends the trial at once; progress that the
        noise swamps may still emerge (fast early training differs most between batch orders),
        so that trial is declared uninformative only later."""
        if step < self.min_steps or late < 4 or learned > detectable:
            return False
        return learned <= 2 * evidence.POWER_Z * self.se_floor or step >= 3 * max(self.min_steps, gate.MIN_PROOF_STEPS)

    def _room(self, t0: float, step: int) -> tuple[int, str]:
        """How many more steps an arm may train within ``max_steps`` and the step and time budgets
        (over every expected arm), and which of them bounds it."""
        rooms = [(self.max_steps - step, f"max_steps={self.max_steps}")]
        if self.budget_steps is not None:
            rooms.append((self.budget_steps // self.arms_expected - step,
                          f"the step budget ({self.budget_steps} steps for {self.arms_expected} arms, {self.budget_reason})"))
        if self.time_budget_s is not None:
            arm_step_s = self._elapsed(t0) / 2 / step  # both fp32 arms so far, evaluation included
            rooms.append((math.floor(self.time_budget_s / (self.arms_expected * max(arm_step_s, 1e-9))) - step,
                          f"the time budget ({self.time_budget_s:g} s for {self.arms_expected} arms)"))
        return min(rooms, key=lambda room: room[0])

    # --- one plan -------------------------------------------------------------------
    def trial(self, label: str, plan: Plan, kind: str = gate.CANDIDATE, description: str = "",
              fidelity_error: float | None = None) -> ArmResult:
        """Train ``plan`` for the trial's length from the same start and batches; judge it against fp32.

        A lossy plan in a trial that is not powered is not trained at all: nothing it could
        show would prove it.  Its verdict says what a trial would need.
        """
        report = self._require_started()
        if kind in gate.LOSSY_KINDS and not report.powered and not self.judge_unpowered:
            arm = ArmResult(label, kind, description or label, [], 0.0, False,
                            f"{description or label}: not proven: {report.what_would_prove()}", None, fidelity_error,
                            status=gate.NOT_PROVEN)
            report.arms.append(arm)
            return arm
        self.say(f"accuracy trial: {label} ({report.steps} steps)")
        t0 = time.perf_counter()
        shadow = self._arm(plan)
        reference = report.arm("fp32").values
        late = set(evidence.late_window(report.checkpoints))
        limit = self.stop_behind * max(report.tolerance, report.detectable)
        stopped, behind = "", math.nan
        try:
            curve = [self.initial]
            for i, start in enumerate(report.checkpoints[:-1]):
                self._steps(shadow, self.stream.train, start, report.checkpoints[i + 1] - start)
                curve.append(self._checkpoint([shadow.module])[0])
                if i + 1 in late and i + 2 < len(report.checkpoints):
                    behind = evidence.signed_relative(curve[-1:], reference[i + 1 : i + 2], self.higher)[0]
                    if not math.isfinite(curve[-1]) or behind > limit:
                        stopped = f" (stopped at step {report.checkpoints[i + 1]}: {behind:+.1%} behind)"
                        break
        finally:
            shadow.close()
        arm = self._judged(label, kind, description or label, curve, self._elapsed(t0), fidelity_error, stopped,
                           behind)
        report.arms.append(arm)
        report.seconds += arm.seconds
        return arm

    def _judged(self, label: str, kind: str, description: str, curve: list[float], seconds: float,
                fidelity_error: float | None, stopped: str, behind: float = math.nan) -> ArmResult:
        """An arm's gap, efficiency, growth and verdict, from its curve."""
        report = self._report
        checkpoints, reference = report.checkpoints, report.arm("fp32").values
        if stopped:  # judged by how far behind it was where it stopped
            gap = behind if math.isfinite(curve[-1]) else math.inf
            slope, slope_se = 0.0, math.inf
        else:
            gap = evidence.mean_gap(checkpoints, curve, reference, self.higher)
            slope, slope_se = evidence.gap_growth(checkpoints, curve, reference, self.higher)
        horizon_gap = evidence.gap_at_horizon(gap, slope, slope_se, report.steps, report.horizon)
        if kind == gate.NOISE:  # it measures the trial; there is nothing to judge
            verdict = gate.Verdict(gate.ACCEPTED, gap, gap, report.tolerance, "the noise of the trial")
        else:
            verdict = gate.judge(description, kind, gap, report.se, report.tolerance, is_powered=report.powered,
                                 horizon_gap=horizon_gap, horizon=report.horizon,
                                 not_powered_why=report.what_would_prove())
        efficiency = evidence.step_efficiency(gap, report.se, report.kappa, report.kappa_se)
        return ArmResult(label, kind, description, curve, seconds, verdict.accepted, verdict.reason + stopped,
                         gap if math.isfinite(gap) else None, fidelity_error, status=verdict.status,
                         efficiency=efficiency.value if efficiency else None,
                         efficiency_se=efficiency.se_log if efficiency else None,
                         horizon_gap=horizon_gap if horizon_gap != gap and math.isfinite(horizon_gap) else None)

    def report(self) -> AccuracyTrialReport:
        return self._require_started()

    # --- the pieces --------------------------------------------------------------------
    def _require_started(self) -> AccuracyTrialReport:
        if self._report is None:
            raise RuntimeError("call AccuracyTrial.start() before trialling plans")
        return self._report

    def _evaluator(self) -> tuple[Evaluator, bool, list | None]:
        """The evaluator, whether it judges on data that training never sees, and the batches it
        evaluates on (None: the user's ``evaluate``)."""
        if self._evaluate_arg is not None or self._held_out_arg:
            set_aside_on_every_rank(self.stream, 0, self.group)
            if self._evaluate_arg is not None:
                return self._evaluate_arg, True, None
            return held_out_loss(self.loss_fn, self._held_out_arg), True, list(self._held_out_arg)
        held = set_aside_on_every_rank(self.stream, None, self.group)
        if held:
            return held_out_loss(self.loss_fn, held), True, list(held)
        head = self.stream.head(8)
        return held_out_loss(self.loss_fn, head), False, list(head)

    def _ddp_shadow(self, plan: Plan | None) -> TrialArm:
        """An arm of a DDP model: a copy in its own DDP wrapper, with ``plan``'s hook (none: native DDP)."""
        model = shadow_ddp(self.ddp)
        opt = clone_optimizer(self.optimizer, self.ddp.module, model.module)
        hook = install(model, plan, group=self.group) if plan is not None else None
        return TrialArm(model, model.module, opt, hook.close if hook is not None else lambda: None)

    def _arm(self, plan: Plan | None) -> TrialArm:
        """The arm that trains ``plan`` (None: fp32): exchange-free where asked and the plan's exchange
        is elementwise, else a shadow."""
        if self.exchange_free and is_elementwise(plan):
            arm = ExchangeFreeArm(self.ddp, self.loss_fn, self.optimizer, plan, self.group)
            return TrialArm(arm.model, arm.module, arm.optimizer, arm.close, arm.train)
        return self._shadows(plan)

    def _steps(self, arm: TrialArm, batch: Callable[[int], Any], start: int, count: int) -> None:
        if arm.train is not None:
            arm.train(batch, start, count)
            return
        model, opt = arm.model, arm.optimizer
        for i in range(start, start + count):
            opt.zero_grad(set_to_none=True)
            self.loss_fn(model, batch(i)).backward()
            opt.step()

    def _elapsed(self, t0: float) -> float:
        """Seconds since ``t0``, averaged over ranks (every rank must agree on when to stop)."""
        return mean_over_ranks([time.perf_counter() - t0], self.group)[0]

    def _checkpoint(self, models: Sequence[torch.nn.Module], initial: bool = False,
                    times: list[float] | None = None) -> list[float]:
        """The decisive metric of each model, averaged over ranks (``times``: this rank's seconds per
        model's evaluation are appended)."""
        found = evaluate_on_every_rank(self.evaluate, models, self.metric, self.group, require_finite=initial,
                                       times=times)
        return [m[self.metric] for m in found]


def check_tolerance(tolerance) -> None:
    """Refuse a tolerance that is not a relative gap in (0, 1), naming what is allowed."""
    if isinstance(tolerance, bool) or not isinstance(tolerance, (int, float)) or not 0 < tolerance < 1:
        raise ValueError(f"tolerance={tolerance!r}; allowed: a relative gap 0 < tolerance < 1 (0.01: within 1% of "
                         "fp32's held-out metric)")


def check_evaluate(evaluate) -> None:
    """Refuse an ``evaluate`` that is given but cannot be called, naming what is allowed."""
    if evaluate is not None and not callable(evaluate):
        raise TypeError(f"evaluate={evaluate!r}; allowed: a callable evaluate(model) -> {{metric: value}}")


def evaluate_on_every_rank(evaluate: Evaluator, models: Sequence[torch.nn.Module], metric: str, group=None,
                           require_finite: bool = False, times: list[float] | None = None) -> list[dict[str, float]]:
    """Each model's metrics, averaged over ranks; an ``evaluate`` that fails, fails on every rank.

    Every rank calls it with its own held-out data.  One all-reduce carries every value and
    a failure flag per rank; only when one is set are the ranks' messages gathered, so the
    error names each failing rank and its exception.  ``require_finite``: a non-finite
    value counts as a failure of ``evaluate`` (on weights known to be finite).  ``times``: the
    seconds each evaluation took on this rank are appended to it.
    """
    world, me = world_size(group), rank(group)
    found: list[dict[str, float]] = []
    problem = None
    for model in models:
        try:
            t0 = time.perf_counter()
            found.append(_metrics(evaluate(model), metric))
            if times is not None:
                times.append(time.perf_counter() - t0)
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

