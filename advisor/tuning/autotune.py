"""``autotune``: profile the live cluster, search plans, prove the best live, install it.

Called on every rank of a running job with the user's DDP model, a loss function and a
few batches::

    result = advisor.autotune(ddp_model, loss_fn, batches, optimizer)
    result.render()            # rich summary; result.to_json() for scripts

1. Profile (compute, network, compressor kernels, fidelity) on the real ranks.
2. Rank 0 searches (Optuna by default, seeded with the baselines and the greedy plan)
   for the fastest predicted plan within the fidelity budget and broadcasts the top few.
3. Every rank measures them live, interleaved with native DDP fp32 and the 16-bit casts,
   on a shadow copy of the model (the user's model and optimizer end as they began).
4. Do no harm: compression is recommended only when it beats the best baseline by more
   than the measured noise.  Rank 0 decides and broadcasts; the others check that their
   own decision from the same (all-reduced) numbers agrees.
5. The chosen plan is installed on the user's model, unless the advice is fp32: then
   no hook is installed at all (native DDP is the fastest fp32 path).
"""

from __future__ import annotations

import logging
import math
import os
import statistics
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from advisor.compressors.registry import parse
from advisor.core.collectives import rank
from advisor.core.documents import check_int
from advisor.core.speedups import speedups
from advisor.runtime import Plan, install
from advisor.tuning.accuracy import AccuracyTrial, Evaluator, check_evaluate
from advisor.tuning.live import LossFn, measure_plans
from advisor.tuning.results import AutotuneResult, TunedResult, bucket_rows
from advisor.tuning.steps import (
    DEFAULT_CANDIDATES,
    Arm,
    LazyTrial,
    baseline_arms,
    candidate_labels,
    decide_for_accuracy,
    fidelity_error,
    final_plan,
    search,
    shared_profile,
    short_list,
    sixteen_bit_baseline,
)
from policies import accuracy_gate as gate
from policies.base import Policy
from policies.do_no_harm import FP32, SIXTEEN_BIT, LiveMeasurement
from policies.greedy import GreedyPolicy
from policies.learned import MeasurementSet, plan_features
from policies.optuna_search import OptunaPolicy
from policies.problem import BASELINES, DEFAULT_REFERENCE, TuningProblem
from profilers.cluster import profile_cluster
from profilers.network import NETWORK_REUSE_S

log = logging.getLogger("advisor.autotune")

POLICIES = ("optuna", "greedy")


def _policy(policy, trials: int) -> Policy:
    if isinstance(policy, Policy):
        return policy
    if policy == "optuna":
        return OptunaPolicy(n_trials=trials)
    if policy == "greedy":
        return GreedyPolicy()
    raise ValueError(f"policy={policy!r}; allowed: {', '.join(POLICIES)} or a policies.Policy instance")


def autotune(
    ddp_model: DistributedDataParallel,
    loss_fn: LossFn,
    batches: Sequence[Any],
    optimizer: torch.optim.Optimizer | None = None,
    *,
    candidates: Sequence[str] = DEFAULT_CANDIDATES,
    budget: float | None = None,
    reference: str | None = None,
    evaluate: Evaluator | None = None,
    held_out: Sequence[Any] | None = None,
    metric: str = "loss",
    accuracy_trial: bool = True,
    trial_s: float = 40.0,
    trial_options: Mapping[str, Any] | None = None,
    fidelity_measure: str | None = None,
    policy: str | Policy = "optuna",
    trials: int = 2000,
    top: int = 3,
    rounds: int = 3,
    steps: int = 5,
    measure_s: float = 1.0,
    warmup_steps: int = 10,
    min_gain: float = 0.0,
    residual_model=None,
    measurements_path: str | None = None,
    profile=None,
    install_plan: bool = True,
    group=None,
    progress: Callable[[str], None] | None = None,
    where: str = "",
) -> TunedResult:
    """Find, prove and install the best plan for this model on this cluster; every rank calls it.

    Args:
        ddp_model: the user's DDP model; it ends with the weights it began with.
        loss_fn: ``loss_fn(model, batch) -> loss``.
        batches: representative training batches (the profilers, the accuracy trial and
            the live runs cycle through them; more batches make the trial surer).
        optimizer: the training optimizer; the accuracy trial and the update-error fidelity
            replay clones of it (its state too).  Without it accuracy cannot be trialled.
        candidates: configs the policy may choose per bucket (``none`` is always one).
        budget: the largest size-weighted fidelity error allowed.  Default: earned in the
            accuracy trial (the largest error of a uniform plan that kept up with fp32).
        reference: a config the user trusts; the budget is then its error everywhere.
        evaluate: ``evaluate(model) -> {metric: value}`` on held-out data (default: the
            held-out loss over ``held_out``, or over the last quarter of ``batches``).
        metric: the value of ``evaluate`` that decides (lower is better unless it names an
            accuracy-like metric).
        accuracy_trial: trial every short-listed plan for accuracy (the gate); False trusts
            the budget alone.
        trial_s: the accuracy trial's time budget in seconds.
        trial_options: more keyword arguments of :class:`advisor.tuning.accuracy.AccuracyTrial`
            (``eval_every``, ``signal_to_noise``, ``min_tolerance``, ``max_steps``, ...).
        fidelity_measure: ``"gradient"`` (default) or ``"update"`` (through the optimizer).
        top, rounds, steps, measure_s: how many of the best predicted plans are measured live,
            in how many interleaved rounds of up to how many steps (about ``measure_s`` a plan
            and round).
        warmup_steps: uncompressed steps at the start of the installed plan.
        residual_model: a fitted :class:`policies.learned.ResidualModel` (or the path of a
            measurement set) that corrects predictions when ranking.
        measurements_path: append this run's live measurements to that measurement set file.

    Returns:
        A :class:`TunedResult`: the :class:`AutotuneResult` document (``result.to_json()``,
        ``result.accuracy`` the trial's report) with ``result.hook`` beside it, the installed
        hook (None when the advice is native fp32).

    Raises:
        ValueError: a bad argument (before any work), or an ``evaluate`` that fails or
            returns non-finite values during the trial (on every rank; nothing changed).
    """
    labels, earn = _checked_arguments(ddp_model, candidates, budget, reference, trials, top, rounds, steps,
                                      warmup_steps, min_gain, measure_s, trial_s, evaluate)
    gated = accuracy_trial and optimizer is not None
    chosen_policy = _policy(policy, trials)
    batches = list(batches)
    if not batches:
        raise ValueError("autotune needs at least one batch")
    say = progress or (lambda msg: None)
    t_start = time.perf_counter()

    # 1. profile, on every rank; rank 0's profile is everyone's
    if profile is None:
        profile = profile_cluster(ddp_model, loss_fn, batches, optimizer,
                                  configs=[c for c in labels if c != "none"], group=group, note=where,
                                  network_budget_s=15.0, network_reuse_s=NETWORK_REUSE_S, progress=say)
    profile = shared_profile(profile, group)
    t_profiled = time.perf_counter()

    # the budget: given, a trusted reference's, or earned in the accuracy trial
    problem = TuningProblem.from_profile(profile, labels, budget=0.0 if earn and gated else budget,
                                         reference=DEFAULT_REFERENCE if earn and not gated else reference,
                                         fidelity_measure=fidelity_measure)
    if residual_model is not None:
        if isinstance(residual_model, (str, os.PathLike)):
            residual_model = MeasurementSet.load(residual_model).fit()
        problem.correction = residual_model
    sixteen = sixteen_bit_baseline(problem, optimizer)
    trial = None
    if gated:
        trial = _accuracy_trial(ddp_model, loss_fn, batches, optimizer, problem, earn,
                                dict(evaluate=evaluate, held_out=held_out, metric=metric, time_budget_s=trial_s,
                                     group=group, progress=say, **dict(trial_options or {})), say)
    budget_source = _set_budget(problem, trial, chosen_policy, sixteen, earn, optimizer, reference, budget,
                                metric, group)
    t_trialled = time.perf_counter()

    # 2. search (rank 0)
    say(f"searching plans ({chosen_policy.name})")
    found = search(chosen_policy, problem, group)
    t_searched = time.perf_counter()

    # 3. short-list: the search's best, a diverse uniform plan, and the baselines
    arms = {arm.label: arm for arm in baseline_arms(problem, sixteen)
            + short_list(problem, found, top, diverse=True, label=lambda i, _: f"candidate {i}")}

    # 4. measure them live, interleaved, on a shadow copy
    t_measuring = time.perf_counter()
    rounds_s = _measure(ddp_model, loss_fn, batches, optimizer, arms, rounds, steps, measure_s, group, say)
    measured = [LiveMeasurement(label, arms[label].kind, rounds_s[label], arms[label].predicted_s,
                                arms[label].description) for label in rounds_s]
    t_measured = time.perf_counter()

    # 5. decide: fastest beyond the noise, then proven for accuracy; rank 0 decides
    judge = (lambda d: trial.judge_arm(arms[d.chosen])) if trial is not None else None
    decision, checked, _ = decide_for_accuracy(measured, judge, min_gain=min_gain, group=group)
    if checked:
        checked = f"in autotune's {trial.trial.report().steps}-step trial: {checked}"
    t_decided = time.perf_counter()

    # 6. install, unless the advice is native fp32 (no hook is the fastest fp32 path)
    chosen = arms[decision.chosen]
    final = final_plan(problem, chosen, warmup_steps=warmup_steps,
                       metadata={"advisor": "autotune", **({"accuracy": checked} if checked else {})})
    hook = install(ddp_model, final, group=group) if install_plan and decision.kind != FP32 else None

    result = _result(problem, found, top, decision, measured, rounds_s, arms, final, profile, where,
                     trial.report(problem.budget, budget_source) if trial is not None else None, budget_source,
                     {"profile": t_profiled - t_start, "accuracy": (t_trialled - t_profiled) + (t_decided - t_measured),
                      "search": t_searched - t_trialled, "measure": t_measured - t_measuring,
                      "total": time.perf_counter() - t_start})
    if measurements_path is not None and rank(group) == 0:
        _append_measurements(measurements_path, result.measurements)
    return TunedResult.beside(result, hook)


def _checked_arguments(ddp_model, candidates, budget, reference, trials, top, rounds, steps, warmup_steps, min_gain,
                       measure_s, trial_s, evaluate) -> tuple[list[str], bool]:
    """Refuse a bad argument before any work; return the config labels and whether the budget is to be earned."""
    if not isinstance(ddp_model, DistributedDataParallel):
        raise TypeError(f"autotune needs a DistributedDataParallel model, got {type(ddp_model).__name__}")
    if not dist.is_initialized():
        raise RuntimeError("autotune needs an initialised process group (torchrun, or advisor.testbed.launch)")
    labels = candidate_labels(candidates, budget, reference)
    earn = budget is None and reference is None
    for name, value, minimum in (("trials", trials, 1), ("top", top, 1), ("rounds", rounds, 1),
                                 ("steps", steps, 1), ("warmup_steps", warmup_steps, 0)):
        check_int(name, value, minimum)
    if not 0 <= min_gain < 1:
        raise ValueError(f"min_gain={min_gain!r}; allowed: 0 <= min_gain < 1")
    if not measure_s > 0:
        raise ValueError(f"measure_s={measure_s!r}; allowed: > 0 seconds")
    if not (isinstance(trial_s, (int, float)) and trial_s > 0):
        raise ValueError(f"trial_s={trial_s!r}; allowed: > 0 seconds")
    check_evaluate(evaluate)
    return labels, earn


def _accuracy_trial(ddp_model, loss_fn, batches, optimizer, problem, earn: bool, options: dict, say) -> LazyTrial:
    """The trial that gates every plan, sized for the arms it will likely run."""
    lossy = [c for c in problem.configs if c not in BASELINES]
    probes = math.ceil(math.log2(len(lossy) + 1)) if earn else 0
    return LazyTrial(AccuracyTrial(ddp_model, loss_fn, batches, optimizer, arms_expected=3 + probes + 1, **options),
                     problem, say)


def _set_budget(problem, trial: LazyTrial | None, policy: Policy, sixteen: str | None, earn: bool, optimizer,
                reference: str | None, budget: float | None, metric: str, group) -> str:
    """Set ``problem.budget`` where it is to be earned; return where the budget came from."""
    if earn and trial is None:
        return (f"assumed: the error of {DEFAULT_REFERENCE} everywhere (no accuracy trial: "
                + ("accuracy_trial=False)" if optimizer is not None else "no optimizer given)"))
    if not earn:
        return f"given: the error of {problem.reference} everywhere" if reference is not None and budget is None \
            else "given"
    pays, why_not = _compression_can_pay(problem, policy, sixteen, group)
    if not pays:
        problem.budget = _uniform_error(problem, sixteen)
        return (f"not earned: {why_not}, so no compressed plan was trialled; the budget is the "
                f"error of {sixteen or 'fp32'} everywhere")
    if not trial.ensure_started().informative:
        problem.budget = _uniform_error(problem, parse(DEFAULT_REFERENCE).label)
        return (f"assumed: the error of {DEFAULT_REFERENCE} everywhere; fp32 did not improve the "
                f"held-out {metric} in the trial ({trial.trial.report().progress:+.2%}), so no budget "
                "could be earned (pass batches of real data, or evaluate=)")
    lossy = sorted((c for c in problem.configs if c not in BASELINES),
                   key=lambda c: _uniform_error(problem, c))
    problem.budget, source = _earn_budget(problem, trial, lossy, sixteen)
    return source


def _measure(ddp_model, loss_fn, batches, optimizer, arms: dict[str, Arm], rounds: int, steps: int,
             measure_s: float, group, say) -> dict[str, list[float]]:
    """Each arm's round medians; fp32 runs as native DDP, without a hook.

    A slow plan is measured with fewer steps, about ``measure_s`` of steps per plan and
    round (at least one), so a slow baseline on a slow link does not dominate the tuning time.
    """
    plans = {label: arm.plan for label, arm in arms.items() if arm.kind != FP32}
    plan_steps = {label: max(1, min(steps, math.ceil(measure_s / max(arm.predicted_s, 1e-6))))
                  for label, arm in arms.items()}
    say(f"measuring {len(plans) + 1} plans live, {rounds} interleaved rounds")
    return measure_plans(ddp_model, loss_fn, batches, optimizer, plans, rounds=rounds, steps=plan_steps,
                         group=group, progress=say)


def _uniform_error(problem, config: str | None) -> float:
    """The fidelity error of ``config`` everywhere; 0 for none (fp32 stands) or a config not profiled."""
    if config is None or config not in problem.configs:
        return 0.0
    return fidelity_error(problem, problem.uniform(config)[0])


def _compression_can_pay(problem, policy: Policy, sixteen: str | None, group) -> tuple[bool, str]:
    """Whether any plan, at any error, is predicted faster than the best baseline by more than 3%.

    Where none is, no budget can change the advice and earning one would waste the trial.
    """
    best_baseline = min(float(problem.predict(problem.uniform(c))[0]) for c in ["none", *([sixteen] if sixteen else [])])
    budget, problem.budget = problem.budget, math.inf
    try:
        fastest = float(problem.predict(search(policy, problem, group).choices[None, :])[0])
    finally:
        problem.budget = budget
    if fastest < best_baseline * (1 - _PAYING_GAIN):
        return True, ""
    return False, (f"no plan at any error is predicted faster than the best baseline by more than "
                   f"{_PAYING_GAIN:.0%} here ({fastest * 1e3:.1f} vs {best_baseline * 1e3:.1f} ms/step)")


#: the predicted gain below which compression is not worth proving (the model's median error is a few %)
_PAYING_GAIN = 0.03


def _earn_budget(problem, trial: LazyTrial, lossy: Sequence[str], sixteen: str | None) -> tuple[float, str]:
    """Bisect the uniform lossy plans (sorted by error) for the largest error that keeps up with fp32.

    Accuracy is taken to fall as the error grows, so ceil(log2(n + 1)) trials find it.
    """
    low, high = -1, len(lossy)  # every plan up to ``low`` passed; the first failure is at or below ``high``
    while high - low > 1:
        mid = (low + high) // 2
        arm = trial.judge(lossy[mid], Plan.uniform(lossy[mid], warmup_steps=0), problem.uniform(lossy[mid])[0],
                          gate.LADDER, f"{lossy[mid]} everywhere")
        low, high = (mid, high) if arm.accepted else (low, mid)
    trialled = [(a.fidelity_error, a.accepted) for a in trial.arms.values() if a.fidelity_error is not None]
    earned = gate.earned_budget(trialled)
    steps = trial.trial.report().steps
    if earned is not None and low >= 0:
        return earned, (f"earned: the {problem.fidelity_measure} error of {lossy[low]} everywhere, the most "
                        f"distorting uniform plan that kept up with fp32 in a {steps}-step trial")
    floor = _uniform_error(problem, sixteen)
    return floor, (f"earned: every uniform compressed plan trialled fell behind fp32 in a {steps}-step trial, so "
                   f"the budget is the error of {sixteen or 'fp32'} everywhere")


def _result(problem, found, top: int, decision, measured, rounds_s, arms: dict[str, Arm], final, profile, where: str,
            accuracy, budget_source: str, seconds: dict[str, float]) -> AutotuneResult:
    """The result document: what was searched, measured, trialled and chosen, and what it cost."""
    where = where or profile.environment.note or "this cluster"
    by_label = {m.label: m for m in measured}
    fp32 = by_label["fp32"].median_s
    sixteen = [m for m in measured if m.kind == SIXTEEN_BIT]
    best16 = min(sixteen, key=lambda m: m.median_s) if sixteen else None
    chosen = arms[decision.chosen]
    speedup = speedups({"measured_vs_fp32": fp32, "measured_vs_16bit": best16.median_s if best16 else None},
                       by_label[decision.chosen].median_s, known_only=True)
    speedup.update(speedups({"predicted_vs_fp32": arms["fp32"].predicted_s,
                             "predicted_vs_16bit": min(arms[m.label].predicted_s for m in sixteen) if sixteen else None},
                            chosen.predicted_s, known_only=True))
    return AutotuneResult(
        plan=final.to_dict(),
        recommendation=decision.chosen,
        compress=decision.compress,
        description=chosen.description,
        reason=decision.reason,
        predicted_s={**{label: arm.predicted_s for label, arm in arms.items()}, "compute_only": problem.model.compute_only_s},
        measured=measured,
        speedup=speedup,
        fidelity_error=fidelity_error(problem, chosen.choices),
        fidelity_budget=problem.budget,
        reference=problem.reference,
        policy=found.policy,
        policy_evaluations=int(found.evaluations),
        seconds=seconds,
        world_size=profile.environment.world_size,
        where=where,
        buckets=bucket_rows(problem, chosen.choices),
        searched_top=[problem.describe(c) for c in found.top(top)],
        measurements=_measurements(problem, arms, rounds_s, where),
        accuracy=accuracy,
        budget_source=budget_source,
        fidelity_measure=problem.fidelity_measure,
    )


class StageLog:
    """Prints each stage with the seconds since the start, on stderr (one rank's view of a job)."""

    def __init__(self) -> None:
        self.t0 = time.perf_counter()

    def __call__(self, message: str) -> None:
        print(f"  {time.perf_counter() - self.t0:6.1f} s  {message}", file=sys.stderr, flush=True)


def _measurements(problem, arms: dict[str, Arm], rounds_s, where):
    """Model features, uncorrected prediction and measured median of every live plan."""
    data = MeasurementSet()
    for label, rounds in rounds_s.items():
        choices = arms[label].choices[None, :]
        predicted = float(problem.model.predict_many(choices, problem.costs)[0])
        data.add(where, arms[label].description, plan_features(problem, choices)[0], predicted,
                 statistics.median(rounds))
    return data.measurements


def _append_measurements(path, measurements) -> None:
    data = MeasurementSet.load(path) if os.path.exists(path) else MeasurementSet()
    data.measurements.extend(measurements)
    data.save(path)
