"""``autotune``: profile the live cluster, search plans, prove the best live, install it.

Called on every rank of a running job with the user's DDP model, a loss function and
batches (a list, or the DataLoader itself: batches are drawn as they are needed)::

    result = advisor.autotune(ddp_model, loss_fn, loader, optimizer, expected_steps=20_000)
    result.render()            # rich summary; result.to_json() for scripts

1. Profile (compute, network, compressor kernels, fidelity) on the real ranks.
2. The accuracy trial's fp32 pair measures how sure a trial of this model can be, within a
   share of the run (``trial_share`` of ``expected_steps``); the fidelity budget is earned
   from uniform plans the trial proves.
3. Rank 0 searches (Optuna by default, seeded with the baselines and the greedy plan)
   for the fastest predicted plan within the fidelity budget and broadcasts the top few.
4. Every rank measures them live, interleaved with native DDP fp32 and the 16-bit cast, on
   a shadow copy of the model (the user's model and optimizer end as they began), in more
   rounds while the comparison that decides is still unresolved.
5. Do no harm to the time to accuracy: a compressed plan is installed only when the trial
   proves it within the tolerance of fp32 and the lower bound of its time-to-accuracy
   speed-up (step speed-up x step efficiency) beats the best baseline.  The step speed-up
   it rests on is measured again once the trial has proven the plan: the plan alone beside
   the best baseline, in longer turns (the race's winner is favoured by its own race time).
   Where the race could not tell its two fastest candidates apart, they first run off alone,
   in the same longer turns, and the faster goes first.
   Where the evidence cannot be had in the budget, the advice is the baseline, with what a
   trial would need.  Rank 0 decides and broadcasts.
6. The chosen plan is installed on the user's model, unless the advice is fp32: then
   no hook is installed at all (native DDP is the fastest fp32 path).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from advisor.compressors.registry import parse
from advisor.core.collectives import rank, slowest
from advisor.core.documents import check_int
from advisor.core.speedups import speedups
from advisor.runtime import Plan, install
from advisor.tuning.accuracy import AccuracyTrial, Evaluator, check_evaluate
from advisor.tuning.data import BatchStream, draw_on_every_rank, set_aside_on_every_rank
from advisor.tuning.exchange_free import batch_bytes, exchange_free_pays, exchange_free_step_s, supports_exchange_free
from advisor.tuning.live import LossFn, measure_plans
from advisor.tuning.results import AutotuneResult, TunedResult, bucket_rows, plan_evidence
from advisor.tuning.steps import (
    DEFAULT_CANDIDATES,
    DEFAULT_TRIAL_SHARE,
    RETIME_LONGER,
    Arm,
    LazyTrial,
    baseline_arms,
    candidate_labels,
    check_trial_budget,
    close_layouts_to_race,
    decide_time_to_accuracy,
    fidelity_error,
    final_plan,
    not_ddp,
    retimer,
    runoff_timer,
    search,
    search_layouts,
    settled,
    shared_profile,
    short_list,
    sixteen_bit_baseline,
    trial_budget,
    turn_steps,
    unprovable,
)
from policies import accuracy_gate as gate
from policies.base import Policy
from policies.do_no_harm import FP32, SIXTEEN_BIT, LiveMeasurement, Retiming
from policies.greedy import GreedyPolicy
from policies.learned import MeasurementSet, plan_features
from policies.optuna_search import OptunaPolicy
from policies.problem import BASELINES, DEFAULT_REFERENCE, TuningProblem
from profilers.cluster import profile_cluster
from profilers.network import NETWORK_REUSE_S

log = logging.getLogger("advisor.autotune")

POLICIES = ("optuna", "greedy")
#: batches the profilers and the live timing cycle through (timing needs no fresh data)
TIMING_BATCHES = 8


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
    batches: Iterable[Any],
    optimizer: torch.optim.Optimizer | None = None,
    *,
    expected_steps: int | None = None,
    trial_share: float = DEFAULT_TRIAL_SHARE,
    tolerance: float = gate.DEFAULT_TOLERANCE,
    candidates: Sequence[str] = DEFAULT_CANDIDATES,
    budget: float | None = None,
    reference: str | None = None,
    evaluate: Evaluator | None = None,
    held_out: Sequence[Any] | None = None,
    metric: str = "loss",
    accuracy_trial: bool = True,
    trial_s: float | None = None,
    trial_options: Mapping[str, Any] | None = None,
    fidelity_measure: str | None = None,
    policy: str | Policy = "optuna",
    trials: int = 2000,
    top: int = 3,
    rounds: int = 3,
    max_rounds: int = 8,
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
    search_layout: bool = True,
) -> TunedResult:
    """Find, prove and install the best plan for this model on this cluster; every rank calls it.

    Args:
        ddp_model: the user's DDP model; it ends with the weights it began with.
        loss_fn: ``loss_fn(model, batch) -> loss``.
        batches: training batches: a list, or any iterable such as the DataLoader itself.
            They are drawn as they are needed (the accuracy trial draws as many as it trains
            on); a short list is cycled, with a warning where the trial would memorise it.
        optimizer: the training optimizer; the accuracy trial and the update-error fidelity
            replay clones of it (its state too).  Without it accuracy cannot be trialled,
            and no compressed plan can be proven.
        expected_steps: the length of the run, in steps: the accuracy trial may take
            ``trial_share`` of it (over all its arms), and gaps that grow are extrapolated
            to it.  Without it the trial gets ``trial_s`` seconds.
        trial_share: the share of the run the accuracy trial may take (0.02: 2%).
        tolerance: the claim to prove: a compressed plan's held-out metric within this
            relative gap of fp32's (0.01: 1%).
        candidates: configs the policy may choose per bucket (``none`` is always one).
        budget: the largest size-weighted fidelity error allowed.  Default: earned in the
            accuracy trial (the largest error of a uniform plan that kept up with fp32).
        reference: a config the user trusts; the budget is then its error everywhere.
        evaluate: ``evaluate(model) -> {metric: value}`` on held-out data (default: the
            held-out loss over ``held_out``, or over the last quarter of ``batches``).
        metric: the value of ``evaluate`` that decides (lower is better unless it names an
            accuracy-like metric).
        accuracy_trial: prove every plan that would be installed in a paired trial (the gate);
            False decides on speed alone and trusts the budget (the result says so).
        trial_s: the accuracy trial's time budget in seconds (default: 60 s where
            ``expected_steps`` is not given, else none beyond the share).
        trial_options: more keyword arguments of :class:`advisor.tuning.accuracy.AccuracyTrial`
            (``eval_every``, ``max_steps``, ``se_floor``, ...).
        fidelity_measure: ``"gradient"`` (default) or ``"update"`` (through the optimizer).
        top, rounds, max_rounds, steps, measure_s: how many of the best predicted plans are
            measured live, in how many interleaved rounds (up to ``max_rounds`` while the
            comparison that decides is unresolved) of up to how many steps (about
            ``measure_s`` a plan and round).
        warmup_steps: uncompressed steps at the start of the installed plan.
        residual_model: a fitted :class:`policies.learned.ResidualModel` (or the path of a
            measurement set) that corrects predictions when ranking.
        measurements_path: append this run's live measurements to that measurement set file.
        search_layout: also search other bucket layouts: DDP's buckets exchanged together
            (``Plan.exchange_mb``), or DDP built with smaller ones (``Plan.bucket_cap_mb``);
            each is measured on a shadow DDP built for it as :func:`advisor.ddp_for` builds it
            (a join on DDP's own buckets of that size, without the hook's copies); the result's
            ``bucket_cap_mb`` then says how to build DDP for the advice.  A layout the model cannot
            tell from the chosen one (within 3%) races its best plan too (the nearest joined
            one and the nearest finer one).

    Returns:
        A :class:`TunedResult`: the :class:`AutotuneResult` document (``result.to_json()``,
        ``result.accuracy`` the trial's report) with ``result.hook`` beside it, the installed
        hook (None when the advice is native fp32).

    Raises:
        ValueError: a bad argument (before any work), or an ``evaluate`` that fails or
            returns non-finite values during the trial (on every rank; nothing changed).
        advisor.tuning.data.BatchSourceError: the batches could not be drawn (the iterable
            raised, or yielded none), on every rank, naming it.
    """
    labels, earn = _checked_arguments(ddp_model, candidates, budget, reference, trials, top, rounds, max_rounds,
                                      steps, warmup_steps, min_gain, measure_s, trial_s, evaluate, expected_steps,
                                      trial_share, tolerance)
    gated = accuracy_trial and optimizer is not None
    chosen_policy = _policy(policy, trials)
    say = progress or (lambda msg: None)
    t_start = time.perf_counter()
    stream = BatchStream(batches)
    # held-out batches leave the stream before any training batch is drawn
    set_aside_on_every_rank(stream, 0 if evaluate is not None or held_out else None, group)
    draw_on_every_rank(stream, TIMING_BATCHES, group)
    batches = stream.head(TIMING_BATCHES)

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
        trial = _accuracy_trial(ddp_model, loss_fn, stream, optimizer, problem, earn, sixteen,
                                trial_budget(expected_steps, trial_share, trial_s),
                                dict(evaluate=evaluate, held_out=held_out, metric=metric, tolerance=tolerance,
                                     group=group, progress=say, **dict(trial_options or {})), say)
    budget_source = _set_budget(problem, trial, chosen_policy, sixteen, earn, optimizer, reference, budget, group)
    t_trialled = time.perf_counter()

    # 2. search (rank 0)
    say(f"searching plans ({chosen_policy.name})")
    found = search(chosen_policy, problem, group)
    # and under other bucket layouts: DDP's buckets joined into fewer exchanges, or DDP built with smaller ones
    layout_problem, layout_found, layout_lines, close = (search_layouts(chosen_policy, problem, found, group)
                                                         if search_layout else (problem, found, [], []))
    for line in layout_lines:
        say(f"bucket layout: {line}")
    t_searched = time.perf_counter()

    # 3. short-list: the search's best, a diverse uniform plan, and the baselines (on DDP's own
    # buckets); where another layout won, DDP's own buckets' best plan races beside its plans, and
    # the best plan of each layout the model could not tell apart from the chosen one (the nearest
    # joined one and the nearest finer one) races too
    candidates = short_list(layout_problem, layout_found, top, diverse=True)
    if layout_problem is not problem:
        candidates += short_list(problem, found, 1)
    for other, other_found in close_layouts_to_race(close):
        candidates += short_list(other, other_found, 1)
    arms = {arm.label: arm for arm in baseline_arms(problem, sixteen)
            + [dataclasses.replace(arm, label=f"candidate {i}") for i, arm in enumerate(candidates, 1)]}

    # 4. measure them live, interleaved, on a shadow copy
    t_measuring = time.perf_counter()
    rounds_s = _measure(ddp_model, loss_fn, batches, optimizer, arms, rounds, max_rounds, steps, measure_s, min_gain,
                        group, say)
    measured = _measurements_of(arms, rounds_s)
    t_measured = time.perf_counter()

    # 5. decide: faster to the same accuracy beyond the noise; rank 0 decides
    if trial is not None:
        judge = lambda d: trial.judge_arm(arms[d.chosen])  # noqa: E731
    elif accuracy_trial:
        judge = unprovable("no optimizer was given, so no accuracy trial could run; pass the training optimizer", arms)
    else:
        judge = None
    retimings: list[Retiming] = []
    measure_again = _measurer(ddp_model, loss_fn, batches, optimizer, group, say)
    longer = lambda arm: turn_steps(arm, RETIME_LONGER * steps, RETIME_LONGER * measure_s)  # noqa: E731
    retime = retimer(measure_again, arms, turn=longer, max_rounds=max_rounds, min_gain=min_gain, say=say,
                     record=retimings)
    runoff = runoff_timer(measure_again, arms, turn=longer, max_rounds=max_rounds, say=say, record=retimings)
    decision, checked, _ = decide_time_to_accuracy(measured, judge, min_gain=min_gain, group=group,
                                                   retime=retime if judge is not None else None, runoff=runoff)
    if checked and trial is not None:
        checked = f"in autotune's {trial.trial.report().steps}-step trial: {checked}"
    t_decided = time.perf_counter()

    # 6. install, unless the advice is native fp32 (no hook is the fastest fp32 path)
    chosen = arms[decision.chosen]
    final = final_plan(problem, chosen, warmup_steps=warmup_steps,
                       metadata={"advisor": "autotune", **({"accuracy": checked} if checked else {})})
    hook = install(ddp_model, final, group=group) if install_plan and decision.kind != FP32 else None

    verdicts = trial.verdicts() if trial is not None else {}
    retime_s = sum(r.seconds for r in retimings)
    # the search's best plans, in the layout whose plans were raced first
    searched_top = [layout_problem.describe(c) for c in layout_found.top(top)]
    result = _result(problem, found, searched_top, decision, measured, rounds_s, arms, final, profile, where,
                     layout_lines,
                     trial.report(problem.budget, budget_source) if trial is not None else None, budget_source,
                     plan_evidence(measured, decision, verdicts),
                     "" if accuracy_trial else "accuracy_trial=False: decided on speed per step alone",
                     {"profile": t_profiled - t_start,
                      "accuracy": (t_trialled - t_profiled) + (t_decided - t_measured) - retime_s,
                      "search": t_searched - t_trialled, "measure": t_measured - t_measuring, "retime": retime_s,
                      "total": time.perf_counter() - t_start}, retimings)
    if measurements_path is not None and rank(group) == 0:
        _append_measurements(measurements_path, result.measurements)
    return TunedResult.beside(result, hook)


def _checked_arguments(ddp_model, candidates, budget, reference, trials, top, rounds, max_rounds, steps, warmup_steps,
                       min_gain, measure_s, trial_s, evaluate, expected_steps, trial_share,
                       tolerance) -> tuple[list[str], bool]:
    """Refuse a bad argument before any work; return the config labels and whether the budget is to be earned."""
    if not isinstance(ddp_model, DistributedDataParallel):
        raise not_ddp("autotune", ddp_model)
    if not dist.is_initialized():
        raise RuntimeError("autotune needs an initialised process group (torchrun, or advisor.testbed.launch)")
    labels = candidate_labels(candidates, budget, reference)
    earn = budget is None and reference is None
    for name, value, minimum in (("trials", trials, 1), ("top", top, 1), ("rounds", rounds, 1),
                                 ("max_rounds", max_rounds, rounds), ("steps", steps, 1),
                                 ("warmup_steps", warmup_steps, 0)):
        check_int(name, value, minimum)
    check_trial_budget(expected_steps, trial_share, tolerance)
    if not 0 <= min_gain < 1:
        raise ValueError(f"min_gain={min_gain!r}; allowed: 0 <= min_gain < 1")
    if not measure_s > 0:
        raise ValueError(f"measure_s={measure_s!r}; allowed: > 0 seconds")
    if trial_s is not None and not (isinstance(trial_s, (int, float)) and trial_s > 0):
        raise ValueError(f"trial_s={trial_s!r}; allowed: > 0 seconds, or None")
    check_evaluate(evaluate)
    return labels, earn


def _accuracy_trial(ddp_model, loss_fn, batches, optimizer, problem, earn: bool, sixteen: str | None, budget: dict,
                    options: dict, say) -> LazyTrial:
    """The trial that gates every plan, sized for the arms it will likely run: ``budget`` (from
    :func:`trial_budget`) priced in time where the run's length is known, then ``options``
    (``trial_options=`` among them, which may set any of it)."""
    lossy = [c for c in problem.configs if c not in BASELINES]
    probes = math.ceil(math.log2(len(lossy) + 1)) if earn else 0
    arms = 3 + probes + 1
    group = options.get("group")
    one_batch = int(slowest([float(batch_bytes(batches.train(0)))], group)[0])
    if "exchange_free" not in options:
        free, why = _exchange_free_choice(ddp_model, problem, one_batch)
        options = {**options, "exchange_free": free, "exchange_reason": why}
        say(f"accuracy trial: {'exchange-free' if free else 'arms exchange over the link'} ({why})")
    if budget.get("budget_steps") is not None:
        dense_s = exchange_free_step_s(problem.model, one_batch) if options.get("exchange_free") else None
        steps, why = priced_trial_budget(problem, budget["budget_steps"], arms, sixteen, dense_s)
        budget = {**budget, "budget_steps": steps, "budget_reason": why}
    options = {**budget, **options}
    return LazyTrial(AccuracyTrial(ddp_model, loss_fn, batches, optimizer, arms_expected=arms, **options),
                     problem, say)


def priced_trial_budget(problem, share_steps: int, arms: int, sixteen: str | None,
                        exchange_free_s: float | None) -> tuple[int, str]:
    """The trial's budget in arm-steps, and how it was found: ``share_steps`` training steps' worth
    of the run's *time*, where the trial's steps are predicted cheaper than the run's.

    A run step costs the best baseline's predicted step.  The trial's arms, priced from the same
    profile: the fp32 pair and the 16-bit arm at an exchange-free step (``exchange_free_s``) or
    over the link, and every lossy arm at the slowest uniform lossy plan (the arms it will
    train are not known yet; all of them compress).  It is never less than ``share_steps``:
    on a fast link the trial's arms may cost more than a run step, and the budget stays one
    of steps.  Predictions from the shared profile, so every rank finds the same.
    """
    def step_s(config: str) -> float:
        return float(problem.predict(problem.uniform(config))[0])

    casts = [c for c in [sixteen] if c is not None]
    run_s = min(step_s(c) for c in ["none", *casts])
    dense = exchange_free_s if exchange_free_s is not None else step_s("none")
    cast = exchange_free_s if exchange_free_s is not None else (step_s(sixteen) if sixteen else dense)
    lossy = [c for c in problem.configs if c not in BASELINES]
    lossy_s = max((step_s(c) for c in lossy), default=run_s)
    arm_s = (2 * dense + cast + max(arms - 3, 0) * lossy_s) / arms
    priced = math.floor(share_steps * run_s / arm_s)
    plain = "a share of the run"
    if priced <= share_steps:
        return share_steps, plain
    return priced, (f"{plain}'s time: {share_steps} run steps of {run_s * 1e3:.0f} ms, the trial's arm-steps "
                    f"predicted at {arm_s * 1e3:.0f} ms on average (fp32 {dense * 1e3:.0f} ms"
                    f"{', exchange-free' if exchange_free_s is not None else ''}; lossy plans at most "
                    f"{lossy_s * 1e3:.0f} ms)")


def _exchange_free_choice(ddp_model, problem, one_batch_bytes: int) -> tuple[bool, str]:
    """Whether the trial's fp32 arms and casts train exchange-free, and why; the same on every rank
    (the shared profile's prediction, and the largest batch any rank holds)."""
    supported, why_not = supports_exchange_free(ddp_model)
    if not supported:
        return False, why_not
    return exchange_free_pays(problem.model, one_batch_bytes)


def _set_budget(problem, trial: LazyTrial | None, policy: Policy, sixteen: str | None, earn: bool, optimizer,
                reference: str | None, budget: float | None, group) -> str:
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
    report = trial.ensure_started()
    if not report.powered:
        problem.budget = _uniform_error(problem, parse(DEFAULT_REFERENCE).label)
        return (f"not earned: {report.what_would_prove()}; the search used the error of {DEFAULT_REFERENCE} "
                "everywhere, and no compressed plan it found can be installed")
    lossy = sorted((c for c in problem.configs if c not in BASELINES),
                   key=lambda c: _uniform_error(problem, c))
    problem.budget, source = _earn_budget(problem, trial, lossy, sixteen)
    return source


def _measure(ddp_model, loss_fn, batches, optimizer, arms: dict[str, Arm], rounds: int, max_rounds: int,
             steps: int, measure_s: float, min_gain: float, group, say) -> dict[str, list[float]]:
    """Each arm's round medians; fp32 runs as native DDP, without a hook.

    A slow plan is measured with fewer steps, about ``measure_s`` of steps per plan and
    round (at least one), so a slow baseline on a slow link does not dominate the tuning time.
    After ``rounds`` rounds, more follow (up to ``max_rounds``) while the comparisons that
    decide are unresolved (:func:`settled`).
    """
    plan_steps = {label: turn_steps(arm, steps, measure_s) for label, arm in arms.items()}
    say(f"measuring {len(arms)} plans live, {rounds} interleaved rounds (up to {max_rounds} while unresolved)")
    measure = _measurer(ddp_model, loss_fn, batches, optimizer, group, say)
    return measure(arms, plan_steps, rounds, max_rounds, lambda r: settled(_measurements_of(arms, r), min_gain))


def _measurer(ddp_model, loss_fn, batches, optimizer, group, say):
    """``measure(arms, steps, rounds, max_rounds, settled)``: the arms given, interleaved, fp32 natively
    and plans on a shadow (the race's, and the re-timing's)."""
    def measure(pair: Mapping[str, Arm], steps: Mapping[str, int], rounds: int, max_rounds: int, settled_when):
        plans = {label: arm.plan for label, arm in pair.items() if arm.kind != FP32}
        native = any(arm.kind == FP32 for arm in pair.values())
        return measure_plans(ddp_model, loss_fn, batches, optimizer, plans, native=native, rounds=rounds,
                             steps=dict(steps), max_rounds=max_rounds, settled=settled_when, group=group, progress=say)
    return measure


def _measurements_of(arms: dict[str, Arm], rounds_s: Mapping[str, list[float]]) -> list[LiveMeasurement]:
    return [LiveMeasurement(label, arms[label].kind, list(rounds_s[label]), arms[label].predicted_s,
                            arms[label].description, arms[label].layout) for label in rounds_s]


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
        plan = Plan.uniform(lossy[mid], warmup_steps=0, kernel_forms=problem.kernel_forms)
        arm = trial.judge(lossy[mid], plan, problem.uniform(lossy[mid])[0], gate.LADDER, f"{lossy[mid]} everywhere")
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


def _result(problem, found, searched_top: list[str], decision, measured, rounds_s, arms: dict[str, Arm], final,
            profile, where: str,
            layout_lines: list[str],
            accuracy, budget_source: str, evidence, unproven: str, seconds: dict[str, float],
            retimed: list[Retiming]) -> AutotuneResult:
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
        fidelity_error=fidelity_error(chosen.problem, chosen.choices),
        fidelity_budget=problem.budget,
        reference=problem.reference,
        policy=found.policy,
        policy_evaluations=int(found.evaluations),
        seconds=seconds,
        world_size=profile.environment.world_size,
        where=where,
        buckets=bucket_rows(chosen.problem, chosen.choices),
        searched_top=searched_top,
        layouts=layout_lines,
        exchange_mb=final.exchange_mb,
        measurements=_measurements(problem, arms, rounds_s, where),
        accuracy=accuracy,
        budget_source=budget_source,
        fidelity_measure=problem.fidelity_measure,
        evidence=evidence,
        accuracy_unproven=unproven,
        retimed=retimed,
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
        arm = arms[label]
        choices, problem = arm.choices[None, :], arm.problem or problem
        predicted = float(problem.model.predict_many(choices, problem.costs)[0])
        data.add(where, arm.description, plan_features(problem, choices)[0], predicted, statistics.median(rounds))
    return data.measurements


def _append_measurements(path, measurements) -> None:
    data = MeasurementSet.load(path) if os.path.exists(path) else MeasurementSet()
    data.measurements.extend(measurements)
    data.save(path)
