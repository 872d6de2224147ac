"""Time to accuracy, end to end: train fp32, 16-bit and a plan from the same start; compare.

On the user's own workload (``package.module:factory``), on local ranks or an emulated
cluster of a given link rate (so each arm's time per step is the real one on that link),
every arm trains from the same initial weights on the same batches in the same order
(each rank its own shard: batch ``rank``, ``rank + world``, ...): native DDP fp32, a 16-bit
cast, and the plan (given, or found by ``autotune`` in the same job first); the 16-bit and
plan arms train on past the step count until they reach the target (up to ``extra_steps``
times as many steps), so each arm's time to the target is measured, not extrapolated.  Every
``eval_every`` steps each rank evaluates the workload's held-out metrics; the ranks' values
are averaged.  Time is training time only (evaluation is not counted), the slowest rank's.
The report holds every arm's curves against steps and wall time, the time each arm needs
to reach the target (default: the fp32 arm's final value), and the time-to-accuracy
speed-ups of the plan over fp32 and over 16-bit: the speed-up that counts (Han et al.
2024), not the one per step.

One run decides little: two equally good fp32 runs in different batch orders can end further
apart than the 1% a plan is held to.  ``runs=N`` repeats the comparison in N batch orders (as
MLPerf asks for several runs of each submission): fp32, the 16-bit cast and the plan in each
order from the same start, each order's arms timed to its own fp32 final value.  The report's
:attr:`ValidationReport.runs` hold each replicate; the plan's gap behind fp32 is then a mean
over orders with a 95% interval (paired by order), and its time-to-accuracy speed-up a
median with its range.
"""

from __future__ import annotations

import copy
import math
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from scipy import stats
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader

from advisor.core.collectives import slowest
from advisor.core.documents import VersionedDocument, check_int
from advisor.core.speedups import speedup, speedups
from advisor.report.validation import render_validation, save_validation_png
from advisor.runtime import Plan, install
from advisor.runtime.plan import as_plan
from advisor.testbed.emulated import parse_rate, run_ranks
from advisor.testbed.workloads import build_workload, load_factory
from advisor.tuning.accuracy import evaluate_on_every_rank, higher_is_better
from advisor.tuning.autotune import StageLog, autotune
from policies.evidence import signed_relative
from policies.problem import SIXTEEN_BIT as SIXTEEN_BIT_CASTS
from profilers.training_state import preferred_sixteen_bit

VALIDATION_KIND = "compression-advisor/validation"
#: arm kinds
FP32, SIXTEEN_BIT, PLAN, NOISE = "fp32", "16-bit", "plan", "fp32 (other order)"


@dataclass
class ValidationCurve:
    """One arm: its metrics at each checkpoint (mean over ranks) and the training time to get there."""

    label: str
    kind: str
    description: str
    steps: list[int]
    seconds: list[float]
    metrics: dict[str, list[float]]
    step_s: float
    #: relative half inter-quartile range of the time per step between checkpoints (its noise)
    step_noise: float = 0.0
    #: the step count every arm is compared at (an arm may train on to reach the target)
    compared_at: int = 0

    def time_to(self, metric: str, target: float, higher: bool) -> float | None:
        """Training seconds until ``metric`` first reaches ``target`` (None: never in this run)."""
        for value, s in zip(self.metrics[metric], self.seconds):
            if (value >= target) if higher else (value <= target):
                return s
        return None

    def final(self, metric: str) -> float:
        """The metric at the step count every arm is compared at."""
        at = self.compared_at or self.steps[-1]
        return self.metrics[metric][self.steps.index(at)]


@dataclass
class ValidationRun:
    """The comparison in one batch order (a replicate): fp32, the 16-bit cast and the plan from the
    same start, each timed to ``target`` (the fixed target, else this order's fp32 final value).
    ``final``, ``time_to_target_s`` and ``step_s`` are by arm kind: ``"fp32"``, ``"16-bit"``, ``"plan"``."""

    order: int
    target: float
    final: dict[str, float]
    time_to_target_s: dict[str, float | None]
    step_s: dict[str, float]

    def gap(self, higher_is_better: bool) -> float:
        """How much worse the plan's final metric is than fp32's in this order, relative (positive: worse)."""
        return relative_gap(self.final[PLAN], self.final[FP32], higher_is_better)

    def speedup(self, kind: str = SIXTEEN_BIT) -> float | None:
        """How many times sooner than the ``kind`` arm the plan reached the target (None: one did not)."""
        return speedup(self.time_to_target_s.get(kind), self.time_to_target_s.get(PLAN))


def relative_gap(value: float, reference: float, higher_is_better: bool) -> float:
    """How much worse ``value`` is than ``reference``, relative to it (positive: worse): the trial's own
    measure (:func:`policies.evidence.signed_relative`) at one point."""
    return signed_relative([value], [reference], higher_is_better)[0]


def mean_interval(values: list[float], confidence: float = 0.95) -> tuple[float, float, float] | None:
    """``(mean, low, high)``: the mean of ``values`` (one per batch order) with its Student's t interval;
    None with fewer than two."""
    if len(values) < 2:
        return None
    mean = statistics.fmean(values)
    half = float(stats.t.ppf((1 + confidence) / 2, len(values) - 1)) * statistics.stdev(values) / math.sqrt(len(values))
    return mean, mean - half, mean + half


@dataclass
class ValidationReport(VersionedDocument):
    """Curves, time to target and speed-ups to the same accuracy, for every arm."""

    what = "validation report"
    KIND = VALIDATION_KIND
    VERSION = 3

    model: str
    where: str
    world_size: int
    steps: int
    metric: str
    higher_is_better: bool
    target: float
    target_source: str
    plan: dict[str, Any]
    description: str
    arms: list[ValidationCurve]
    time_to_target_s: dict[str, float | None]
    speedup: dict[str, float | None]
    advice: str = ""
    #: the autotune result the plan came from (None for a given plan)
    autotune: dict[str, Any] | None = None
    #: the same autotune call repeated from the same start, after the first (``repeats=N``)
    repeats: list[dict[str, Any]] = field(default_factory=list)
    #: the comparison in each batch order (``runs=N``; the first is the arms' own order), else empty
    runs: list[ValidationRun] = field(default_factory=list)
    kind: str = VALIDATION_KIND
    version: int = 3

    def arm(self, kind: str) -> ValidationCurve:
        for a in self.arms:
            if a.kind == kind:
                return a
        raise KeyError(f"no {kind} arm; arms: {[a.kind for a in self.arms]}")

    def noise(self, metric: str | None = None) -> float | None:
        """How far the two fp32 arms (batch orders) end apart: relative for the report's metric,
        absolute for another one (accuracy points, for example); None in a report without the arm."""
        metric = metric or self.metric
        try:
            other = self.arm(NOISE).final(metric)
        except KeyError:
            return None
        fp32 = self.arm(FP32).final(metric)
        return abs(other - fp32) / max(abs(fp32), 1e-12) if metric == self.metric else abs(other - fp32)

    def gap(self, kind: str = PLAN) -> float:
        """How much worse the arm's final metric is than fp32's, relative (positive: worse)."""
        return relative_gap(self.arm(kind).final(self.metric), self.arm(FP32).final(self.metric),
                            self.higher_is_better)

    def gap_interval(self, confidence: float = 0.95) -> tuple[float, float, float] | None:
        """The plan's gap behind fp32 over the batch orders: (mean, low, high), a Student's t interval of
        the per-order gaps (each paired with fp32 in the same order); None with fewer than two orders."""
        return mean_interval([r.gap(self.higher_is_better) for r in self.runs], confidence)

    def time_to_target_speedup(self, label: str) -> float | None:
        """How many times sooner than fp32 the arm ``label`` reached the target; None where one did not."""
        return speedup(self.time_to_target_s.get(FP32), self.time_to_target_s.get(label))

    def render(self, console=None) -> None:
        """The rich summary: each arm's final metric, step time and time to the target."""
        render_validation(self, console)

    def save_png(self, path) -> None:
        """The arms' held-out curves by step and by training time, with the target."""
        save_validation_png(self, path)


def _train_arm(workload, initial: dict, plan: Plan | None, batches: list, steps: int, eval_every: int,
               evaluate, metric: str, label: str, kind: str, description: str, group=None,
               until: tuple[float, bool] | None = None, max_steps: int | None = None,
               sharded: bool = False) -> ValidationCurve:
    """Train one arm for ``steps`` steps, and on (up to ``max_steps``) until ``until = (target, higher)`` is reached.

    ``sharded``: the model sharded by the workload's ``shard`` (FSDP2), the plan's reduce-scatters
    installed on its groups; else DDP, the plan's hook installed on it.
    """
    hook = None
    if sharded:  # the sharded model trains and is evaluated itself
        from advisor.runtime.sharded import install_sharded

        model = ddp = _sharded_copy(workload, initial)
        if plan is not None:
            install_sharded(ddp, plan, group)
    else:
        model = copy.deepcopy(workload.model)
        model.load_state_dict(initial)
        # a plan tuned for smaller DDP buckets runs on DDP built with them, as advisor.ddp_for builds it
        smaller = {"bucket_cap_mb": plan.bucket_cap_mb} if plan is not None and plan.bucket_cap_mb else {}
        ddp = DistributedDataParallel(model, process_group=group, **smaller)
        hook = install(ddp, plan, group=group) if plan is not None else None
    opt = workload.optimizer(model)
    checkpoints, seconds, curve, times = [0], [0.0], [], []
    curve.append(evaluate_on_every_rank(evaluate, [model], metric, group, require_finite=True)[0])
    trained, last = 0.0, max_steps or steps
    try:
        for step in range(1, last + 1):
            t0 = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            workload.loss_fn(ddp, batches[(step - 1) % len(batches)]).backward()
            opt.step()
            times.append(time.perf_counter() - t0)
            if step % eval_every == 0 or step in (steps, last):
                mine = trained + sum(times)
                trained += sum(times)
                times.clear()
                checkpoints.append(step)
                seconds.append(slowest([mine], group)[0])
                curve.append(evaluate_on_every_rank(evaluate, [model], metric, group)[0])
                if step >= steps and (until is None or _reached(curve[-1][metric], *until)):
                    break  # the same all-reduced value on every rank: every rank stops here
    finally:
        if hook is not None:
            hook.close()
    metrics = {k: [c.get(k, float("nan")) for c in curve] for k in curve[0]}
    per_step = [(b - a) / (sb - sa) for a, b, sa, sb in zip(seconds, seconds[1:], checkpoints, checkpoints[1:])]
    step_s = statistics.median(per_step)
    quartiles = statistics.quantiles(per_step, n=4) if len(per_step) >= 2 else [step_s, step_s, step_s]
    noise = (quartiles[2] - quartiles[0]) / 2 / step_s if step_s > 0 else 0.0
    return ValidationCurve(label, kind, description, checkpoints, seconds, metrics, step_s, noise, steps)


def _sharded_copy(workload, initial: dict):
    """A copy of the workload's model from ``initial``, sharded by its ``shard`` (every rank)."""
    model = copy.deepcopy(workload.model)
    model.load_state_dict(initial)
    workload.shard(model)
    return model


def _reached(value: float, target: float, higher: bool) -> bool:
    return value >= target if higher else value <= target


def _validate_rank(rank: int, world: int, spec: str, plan_dict: dict | None, steps: int, eval_every: int,
                   sixteen: str | None, target: float | None, extra: float, autotune_kwargs: dict, where: str,
                   sharded: bool = False, runs: int = 1, progress: bool = False):
    say = StageLog() if progress and rank == 0 else None

    def train(*args, **kwargs) -> ValidationCurve:
        curve = _train_arm(*args, **kwargs)
        if say is not None:
            say(f"trained {curve.label}: {curve.steps[-1]} steps, {curve.step_s * 1e3:.1f} ms a step, "
                f"held-out {metric} {curve.final(metric):.4g} at step {curve.compared_at}")
        return curve

    workload = build_workload(spec)
    metric = workload.metric
    if sixteen is None:
        sixteen = preferred_sixteen_bit(workload.optimizer(copy.deepcopy(workload.model)))
    evaluate = workload.evaluator()
    if evaluate is None:
        raise ValueError(f"workload {spec!r} has neither evaluate nor held_out batches: give it one, so "
                         "accuracy can be measured on data training does not see")
    initial = copy.deepcopy(workload.model.state_dict())
    batches = list(workload.batches)
    mine = batches[rank::world] if len(batches) >= world else batches
    advice, tuned_result, repeats = "", None, []
    if plan_dict is None:
        autotune_kwargs = dict(autotune_kwargs)
        if say is not None:
            autotune_kwargs.setdefault("progress", say)
        data, times = autotune_kwargs.pop("data", None), autotune_kwargs.pop("repeats", 1)
        for i in range(times):  # the same call from the same start: does the advice hold?
            if sharded:
                from advisor.tuning.sharded import autotune_sharded

                tuned = ddp = _sharded_copy(workload, initial)
                result = autotune_sharded(tuned, workload.loss_fn, tuning_data(mine, data), workload.optimizer(tuned),
                                          build=lambda: _sharded_copy(workload, initial), **workload.judged_by(),
                                          metric=workload.metric, install_plan=False, **autotune_kwargs)
            else:
                tuned = copy.deepcopy(workload.model)
                ddp = DistributedDataParallel(tuned)
                result = autotune(ddp, workload.loss_fn, tuning_data(mine, data), workload.optimizer(tuned),
                                  **workload.judged_by(), metric=workload.metric, install_plan=False, where=where,
                                  **autotune_kwargs)
            repeats.append(result.to_dict() if rank == 0 else None)
            if i == 0:  # every rank validates the first call's plan (the calls may disagree)
                plan_dict, advice = result.plan, f"autotune's advice: {result.reason}"
            del ddp, tuned
        tuned_result = repeats[0]
    plan = Plan.from_dict(plan_dict)
    description = plan.metadata.get("description") or _describe(plan)
    native = plan.metadata.get("native") or _describe(plan) == "none everywhere"
    arms = [train(workload, initial, None, mine, steps, eval_every, evaluate, workload.metric,
                       FP32, FP32, "fp32 (native DDP)", sharded=sharded)]
    # the same run in another batch order: how far apart two equally good runs end (the noise
    # every final value is judged against)
    shuffled = random.Random(1).sample(mine, len(mine))
    arms.append(train(workload, initial, None, shuffled, steps, eval_every, evaluate, workload.metric,
                           NOISE, NOISE, "fp32, batches in another order", sharded=sharded))
    fixed = target if target is not None else workload.target

    def cast_and_plan(fp32: ValidationCurve, order: list, suffix: str = "") -> list[ValidationCurve]:
        """The 16-bit and plan arms in ``order``: they train on (up to ``extra`` times the steps) until
        they reach the target, ``fp32``'s final value unless one is fixed: their time to accuracy."""
        goal = fixed if fixed is not None else fp32.final(metric)
        until = {"until": (goal, higher_is_better(metric)), "max_steps": math.ceil(extra * steps)}
        cast = train(workload, initial, Plan.uniform(sixteen, warmup_steps=0), order, steps, eval_every,
                          evaluate, metric, sixteen + suffix, SIXTEEN_BIT, f"{sixteen} everywhere", sharded=sharded,
                          **until)
        if native:
            return [cast, ValidationCurve(**{**fp32.__dict__, "label": "plan" + suffix, "kind": PLAN,
                                             "description": "the plan: fp32 (native DDP, no hook)"})]
        if _describe(plan) == f"{sixteen} everywhere":
            return [cast, ValidationCurve(**{**cast.__dict__, "label": "plan" + suffix, "kind": PLAN,
                                             "description": f"the plan: {sixteen} everywhere"})]
        return [cast, train(workload, initial, plan, order, steps, eval_every, evaluate, metric, "plan" + suffix,
                                 PLAN, f"the plan: {description}", sharded=sharded, **until)]

    arms += cast_and_plan(arms[0], mine)
    replicates = [] if runs == 1 else [_replicate(0, arms[0], arms[2], arms[3], metric, fixed)]
    for order in range(1, runs):  # order 1 is the other fp32 arm's
        shuffled = random.Random(order).sample(mine, len(mine))
        fp32 = arms[1] if order == 1 else train(workload, initial, None, shuffled, steps, eval_every, evaluate,
                                                      metric, f"fp32, order {order}", FP32, "fp32", sharded=sharded)
        replicates.append(_replicate(order, fp32, *cast_and_plan(fp32, shuffled, f", order {order}"), metric, fixed))
    return {"arms": arms, "plan": plan.to_dict(), "description": description, "advice": advice,
            "metric": metric, "target": workload.target, "where": where, "autotune": tuned_result,
            "repeats": repeats[1:], "runs": replicates}


def _replicate(order: int, fp32: ValidationCurve, cast: ValidationCurve, plan: ValidationCurve, metric: str,
               fixed: float | None) -> ValidationRun:
    """One order's comparison, each arm timed to the fixed target, else to this order's fp32 final value."""
    goal = fixed if fixed is not None else fp32.final(metric)
    higher = higher_is_better(metric)
    curves = {FP32: fp32, SIXTEEN_BIT: cast, PLAN: plan}
    return ValidationRun(order, goal, {k: c.final(metric) for k, c in curves.items()},
                         {k: c.time_to(metric, goal, higher) for k, c in curves.items()},
                         {k: c.step_s for k, c in curves.items()})


def tuning_data(batches: list, data) -> Any:
    """The batches autotune sees, as a user would hand them over: ``None`` the rank's whole shard
    (a list), an integer the first that many (a short list), ``"loader"`` a DataLoader over it."""
    if data is None:
        return batches
    if data == "loader":
        return DataLoader(batches, batch_size=None, shuffle=False)
    check_int("data", data)
    return batches[:data]


def _describe(plan: Plan) -> str:
    configs = {c.label for c in plan.configs()}
    return f"{plan.default.label} everywhere" if len(configs) == 1 else "a per-bucket plan"


def validate_workload(spec: str, plan=None, *, nproc: int = 2, rate: str | None = None, steps: int = 300,
                      eval_every: int | None = None, sixteen: str | None = None, target: float | None = None,
                      extra_steps: float = 2.0, autotune_kwargs: dict | None = None,
                      timeout: float = 3000.0, sharded: bool = False, runs: int = 1,
                      progress: bool = False) -> ValidationReport:
    """Train fp32, ``sixteen`` and ``plan`` on ``nproc`` ranks for ``steps`` steps; compare time to accuracy.

    Args:
        spec: the workload factory, ``package.module:function``; it needs ``evaluate`` or
            ``held_out`` batches.
        plan: a Plan, its dict or a JSON path; None: autotune in the same job first.
        rate: an emulated link rate (``"1gbit"``, root and iproute2), or None for loopback.
        eval_every: steps between evaluations (default: ``steps // 20``, at least 1).
        sixteen: the 16-bit cast trained as the strong baseline (``fp16`` or ``bf16``; default: the
            one the workload's optimizer keeps more of, bf16 for Adam-like ones, else fp16).
        target: the metric every arm is timed to (default: the workload's target, else the
            fp32 arm's final value).
        extra_steps: the 16-bit and plan arms train on, up to this many times ``steps``,
            until they reach the target (their metrics are still compared at ``steps``).
        autotune_kwargs: arguments of :func:`advisor.autotune` where no plan is given, and
            two of the job's own: ``data``, the batches autotune sees (see :func:`tuning_data`),
            and ``repeats``, how many times the same call runs from the same start (the first
            one's plan is validated; the others are in ``report.repeats``).
        sharded: shard every arm's model with the workload's ``shard`` (FSDP2), install plans on its
            ``fully_shard`` groups (:func:`advisor.install_sharded`), and autotune with
            :func:`advisor.autotune_sharded` where no plan is given.
        runs: the comparison in this many batch orders (fp32, 16-bit and the plan in each; see the
            module doc); 1: one order, with fp32 also in a second one (the noise).
        progress: rank 0 prints a line on stderr as each arm (and autotune's each stage) ends.

    Returns:
        A :class:`ValidationReport`: each arm's curve, its time to the target and its
        speed-up over fp32 and over the 16-bit cast.

    Raises:
        ValueError: a bad argument, a plan for another model, or a workload without a
            way to evaluate, before any training; an ``evaluate`` that fails, on every rank.
    """
    load_factory(spec)
    for name, value in (("nproc", nproc), ("steps", steps), ("runs", runs)):
        check_int(name, value)
    if not (isinstance(timeout, (int, float)) and timeout > 0):
        raise ValueError(f"timeout={timeout!r}; allowed: seconds > 0")
    eval_every = eval_every if eval_every is not None else max(1, steps // 20)
    check_int("eval_every", eval_every)
    if not extra_steps >= 1:
        raise ValueError(f"extra_steps={extra_steps!r}; allowed: a number >= 1")
    if sixteen is not None and sixteen not in SIXTEEN_BIT_CASTS:
        raise ValueError(f"sixteen={sixteen!r}; allowed: {', '.join(SIXTEEN_BIT_CASTS)}")
    if rate is not None:
        parse_rate(rate)
    plan_dict = None
    if plan is not None or sharded:
        workload = build_workload(spec)
        if sharded and workload.shard is None:
            raise ValueError(f"workload {spec!r} says nothing of how to shard its model: give it shard= (a function "
                             "applying fully_shard to its blocks, then its root)")
    if plan is not None:
        plan = as_plan(plan)
        plan.check_against(n for n, p in workload.model.named_parameters() if p.requires_grad)
        plan_dict = plan.to_dict()
    kwargs = dict(autotune_kwargs or {})

    def args(where: str):
        return (spec, plan_dict, steps, eval_every, sixteen, target, extra_steps, kwargs, where, sharded, runs,
                progress)

    if progress:
        print(f"training fp32, {sixteen or 'the 16-bit cast'} and the plan for {steps} steps each on {nproc} ranks"
              + (f", in {runs} batch orders" if runs > 1 else "") + ("" if plan is not None else ", autotuning first")
              + f", within {timeout:g} s; rank 0's stages:", file=sys.stderr, flush=True)
    out = run_ranks(_validate_rank, nproc, args, rate=rate, timeout=timeout)[0]
    arms: list[ValidationCurve] = out["arms"]
    metric = out["metric"]
    higher = higher_is_better(metric)
    fp32 = next(a for a in arms if a.kind == FP32)
    if not math.isfinite(fp32.final(metric)):
        bad = next(st for st, v in zip(fp32.steps, fp32.metrics[metric]) if not math.isfinite(v))
        raise ValueError(f"the fp32 arm's held-out {metric} became {fp32.final(metric)} by step {bad} of {steps}: "
                         f"{spec} diverges without any compression; lower its learning rate (or clip gradients in "
                         "its loss_fn) before judging plans against it")
    if target is not None:
        goal, source = float(target), "given"
    elif out["target"] is not None:
        goal, source = float(out["target"]), "the workload's target"
    else:
        goal, source = fp32.final(metric), f"the fp32 arm's final value after {steps} steps"
    tta = {a.label: a.time_to(metric, goal, higher) for a in arms}
    plan_tta = tta["plan"]
    sixteen_label = next(a.label for a in arms if a.kind == SIXTEEN_BIT)
    speedup = speedups({"vs_fp32": tta[FP32], "vs_16bit": tta[sixteen_label]}, plan_tta)
    return ValidationReport(
        model=spec, where=out["where"], world_size=nproc, steps=steps, metric=metric, higher_is_better=higher,
        target=goal, target_source=source, plan=out["plan"], description=out["description"], arms=arms,
        time_to_target_s=tta, speedup=speedup, advice=out["advice"], autotune=out.get("autotune"),
        repeats=out.get("repeats", []), runs=out.get("runs", []))


