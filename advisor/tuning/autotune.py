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

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from advisor.compressors.registry import parse
from advisor.core.collectives import from_rank_zero, rank
from advisor.core.documents import check_int
from advisor.core.speedups import speedups
from advisor.runtime import Plan, install
from advisor.tuning.accuracy import AccuracyTrial, Evaluator, check_evaluate
from advisor.tuning.live import LossFn, measure_plans
from advisor.tuning.results import AutotuneResult, bucket_rows
from policies import accuracy_gate as gate
from policies.base import Policy
from policies.do_no_harm import CANDIDATE, FP32, SIXTEEN_BIT, LiveMeasurement, decide
from policies.greedy import GreedyPolicy
from policies.learned import MeasurementSet, plan_features
from policies.optuna_search import OptunaPolicy
from policies.problem import BASELINES, DEFAULT_REFERENCE, TuningProblem
from policies.problem import SIXTEEN_BIT as SIXTEEN_BIT_CASTS
from profilers.cluster import profile_cluster
from profilers.network import NETWORK_REUSE_S
from profilers.profile import ClusterProfile
from profilers.training_state import preferred_sixteen_bit

log = logging.getLogger("advisor.autotune")

#: Several PowerSGD ranks, so buckets can trade accuracy between them under one budget
#: (L-GreCo): a cheap rank on a big bucket paid for by a precise config on a small one.
#: The precise end (rank 16, 8-bit integers summed in the all-reduce) stays available when the
#: accuracy trial rejects the aggressive configs.
DEFAULT_CANDIDATES = (
    "none", "fp16", "bf16", "powersgd(rank=1)", "powersgd(rank=2)", "powersgd(rank=4)",
    "powersgd(rank=8)", "powersgd(rank=16)", "topk(ratio=0.01)", "intquant(bits=8, packed=0)",
)
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
) -> AutotuneResult:
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
        An :class:`AutotuneResult`; ``result.hook`` is the installed hook (None when the
        advice is native fp32); ``result.accuracy`` the trial's report.

    Raises:
        ValueError: a bad argument (before any work), or an ``evaluate`` that fails or
            returns non-finite values during the trial (on every rank; nothing changed).
    """
    # --- validate everything before any work --------------------------------------
    if not isinstance(ddp_model, DistributedDataParallel):
        raise TypeError(f"autotune needs a DistributedDataParallel model, got {type(ddp_model).__name__}")
    if not dist.is_initialized():
        raise RuntimeError("autotune needs an initialised process group (torchrun, or advisor.testbed.launch)")
    labels = list(dict.fromkeys(parse(c).label for c in ["none", *candidates]))
    earn = budget is None and reference is None
    gated = accuracy_trial and optimizer is not None
    # the reference sets the budget when given, and when none can be earned (it is then assumed)
    fallback = reference if reference is not None else (DEFAULT_REFERENCE if earn else None)
    if fallback is not None and budget is None and parse(fallback).label not in labels:
        labels.append(parse(fallback).label)
    chosen_policy = _policy(policy, trials)
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
    batches = list(batches)
    if not batches:
        raise ValueError("autotune needs at least one batch")
    say = progress or (lambda msg: None)
    t_start = time.perf_counter()

    # --- 1. profile -----------------------------------------------------------------
    if profile is None:

        profile = profile_cluster(ddp_model, loss_fn, batches, optimizer,
                                  configs=[c for c in labels if c != "none"], group=group, note=where,
                                  network_budget_s=15.0, network_reuse_s=NETWORK_REUSE_S, progress=say)

    profile = ClusterProfile.from_dict(from_rank_zero(profile.to_dict(), group))  # one profile for all ranks
    t_profiled = time.perf_counter()

    # --- 2. the budget: given, a trusted reference's, or earned in the accuracy trial ------
    if earn and not gated:
        reference = DEFAULT_REFERENCE  # nothing to earn a budget with: say so in the result
    problem = TuningProblem.from_profile(profile, labels, budget=0.0 if earn and gated else budget,
                                         reference=reference, fidelity_measure=fidelity_measure)
    if residual_model is not None:
        if isinstance(residual_model, (str, os.PathLike)):
            residual_model = MeasurementSet.load(residual_model).fit()
        problem.correction = residual_model
    if earn and not gated:
        budget_source = (f"assumed: the error of {reference} everywhere (no accuracy trial: "
                         + ("accuracy_trial=False)" if optimizer is not None else "no optimizer given)"))
    elif reference is not None and budget is None:
        budget_source = f"given: the error of {problem.reference} everywhere"
    else:
        budget_source = "given" if not earn else "earned"
    sixteen = _sixteen_bit(problem, optimizer)
    trial = None
    if gated:
        lossy = sorted((c for c in problem.configs if c not in BASELINES),
                       key=lambda c: float(problem.fidelity_error(problem.uniform(c))[0]))
        probes = math.ceil(math.log2(len(lossy) + 1)) if earn else 0
        trial = LazyTrial(AccuracyTrial(ddp_model, loss_fn, batches, optimizer, evaluate=evaluate,
                                        held_out=held_out, metric=metric, time_budget_s=trial_s, group=group,
                                        progress=say, arms_expected=3 + probes + 1, **dict(trial_options or {})),
                          problem, say)
        if earn:
            pays, why_not = _compression_can_pay(problem, chosen_policy, sixteen, group)
            if pays and trial.ensure_started().informative:
                problem.budget, budget_source = _earn_budget(problem, trial, lossy, sixteen)
            elif pays:
                problem.budget = _reference_budget(problem, DEFAULT_REFERENCE)
                budget_source = (f"assumed: the error of {DEFAULT_REFERENCE} everywhere; fp32 did not improve the "
                                 f"held-out {metric} in the trial ({trial.trial.report().progress:+.2%}), so no budget "
                                 "could be earned (pass batches of real data, or evaluate=)")
            else:
                problem.budget = _error(problem, problem.uniform(sixteen)[0]) if sixteen else 0.0
                budget_source = (f"not earned: {why_not}, so no compressed plan was trialled; the budget is the "
                                 f"error of {sixteen or 'fp32'} everywhere")
    t_trialled = time.perf_counter()

    # --- 3. search (rank 0) ---------------------------------------------------------
    found = None
    if rank(group) == 0:
        say(f"searching plans ({chosen_policy.name})")
        found = chosen_policy.search(problem)
    found = from_rank_zero(found, group)
    t_searched = time.perf_counter()

    # --- 4. measure the short-list live next to the baselines ----------------------------
    plans: dict[str, Plan] = {}
    kinds: dict[str, str] = {"fp32": FP32}
    described: dict[str, str] = {"fp32": "fp32 (native DDP, no hook)"}
    predicted: dict[str, float] = {"fp32": float(problem.predict(problem.uniform("none"))[0])}
    choices_of: dict[str, np.ndarray] = {"fp32": problem.uniform("none")[0]}
    if sixteen is not None:
        plans[sixteen] = Plan.uniform(sixteen, warmup_steps=0)
        kinds[sixteen], described[sixteen] = SIXTEEN_BIT, f"{sixteen} everywhere"
        choices_of[sixteen] = problem.uniform(sixteen)[0]
        predicted[sixteen] = float(problem.predict(problem.uniform(sixteen))[0])
    seen = {v.tobytes() for v in choices_of.values()} | {problem.uniform(c)[0].tobytes() for c in SIXTEEN_BIT_CASTS
                                                         if c in problem.configs}
    for choices in _short_list(problem, found, top):
        if choices.tobytes() in seen:
            continue
        seen.add(choices.tobytes())
        label = f"candidate {sum(k == CANDIDATE for k in kinds.values()) + 1}"
        choices_of[label] = choices
        plans[label] = problem.plan(choices, warmup_steps=0)
        kinds[label], described[label] = CANDIDATE, problem.describe(choices)
        predicted[label] = float(problem.predict(choices[None, :])[0])
    # a slow plan is measured with fewer steps: about measure_s of steps per plan and round
    # (at least one), so a slow baseline on a slow link does not dominate the tuning time
    plan_steps = {label: max(1, min(steps, math.ceil(measure_s / max(predicted[label], 1e-6))))
                  for label in ["fp32", *plans]}
    say(f"measuring {len(plans) + 1} plans live, {rounds} interleaved rounds")
    t_measuring = time.perf_counter()
    rounds_s = measure_plans(ddp_model, loss_fn, batches, optimizer, plans, rounds=rounds, steps=plan_steps,
                             group=group, progress=say)
    measured = [LiveMeasurement(label, kinds[label], rounds_s[label], predicted[label], described[label])
                for label in rounds_s]
    t_measured = time.perf_counter()

    # --- 5. decide: fastest beyond the noise, then proven for accuracy; rank 0 decides -------
    # Only the plan do-no-harm would choose is trialled; a rejected one leaves the race and
    # the choice falls to the next, down to fp32, which needs no trial.
    judge = None
    if trial is not None:
        def judge(d):
            return trial.judge(d.chosen, plans[d.chosen], choices_of[d.chosen],
                               gate.SIXTEEN_BIT if d.kind == SIXTEEN_BIT else gate.CANDIDATE, described[d.chosen])
    decision, checked, _ = decide_for_accuracy(measured, judge, min_gain=min_gain, group=group)
    if checked:
        checked = f"in autotune's {trial.trial.report().steps}-step trial: {checked}"
    t_decided = time.perf_counter()

    # --- 6. install ----------------------------------------------------------------------
    chosen_choices = choices_of[decision.chosen]
    accuracy = {"accuracy": checked} if checked else {}
    if decision.kind == CANDIDATE:
        final = problem.plan(chosen_choices, warmup_steps=warmup_steps,
                             metadata={"advisor": "autotune", "description": described[decision.chosen], **accuracy})
    elif decision.kind == SIXTEEN_BIT:
        final = Plan.uniform(decision.chosen, warmup_steps=0, metadata={"advisor": "autotune", **accuracy})
    else:
        final = Plan.uniform("none", warmup_steps=0, metadata={"advisor": "autotune", "native": True})
    hook = None
    if install_plan and decision.kind != FP32:
        hook = install(ddp_model, final, group=group)

    result = _result(problem, found, decision, measured, predicted, described, final, chosen_choices,
                     profile, where, {"profile": t_profiled - t_start, "accuracy": (t_trialled - t_profiled)
                                      + (t_decided - t_measured), "search": t_searched - t_trialled,
                                      "measure": t_measured - t_measuring,
                                      "total": time.perf_counter() - t_start})
    result.searched_top = [problem.describe(c) for c in found.top(top)]
    result.measurements = _measurements(problem, choices_of, described, rounds_s, result.where)
    result.accuracy = trial.report(problem.budget, budget_source) if trial is not None else None
    result.budget_source = budget_source
    result.fidelity_measure = problem.fidelity_measure
    if measurements_path is not None and rank(group) == 0:
        _append_measurements(measurements_path, result.measurements)
    result.hook = hook
    return result


def decide_for_accuracy(measured: Sequence[LiveMeasurement], judge: Callable[[Any], Any] | None, *,
                        min_gain: float = 0.0, group=None):
    """Do no harm for speed, then for accuracy: the decision and why its accuracy stands.

    Every rank calls it with the same measurements; rank 0's decision is broadcast.  Only the
    plan do-no-harm chooses is judged (``judge(decision) -> ArmResult``, the accuracy trial);
    a rejected one leaves the race and the choice falls to the next, down to fp32, which
    needs no trial.  Returns ``(decision, accepted_reason, rejected_reasons)``;
    ``accepted_reason`` is "" when nothing was judged, and the decision's reason names every
    rejection with its numbers.
    """
    measured = list(measured)
    rejected: list[str] = []
    checked = ""
    while True:
        mine = decide(measured, min_gain=min_gain)
        decision = from_rank_zero(mine, group)
        if decision.chosen != mine.chosen:
            log.warning("rank %d would have chosen %s; following rank 0's decision (%s)", rank(group),
                        mine.chosen, decision.chosen)
        if judge is None or decision.kind == FP32:
            break
        arm = judge(decision)
        if arm.accepted:
            decision.reason += f"; accuracy: {arm.reason}"
            checked = arm.reason
            break
        rejected.append(arm.reason)
        measured = [m for m in measured if m.label != decision.chosen]
    if rejected:
        decision.reason = decision.reason.replace("no compressed candidate was measured",
                                                  "no measured compressed candidate passed the accuracy trial")
        decision.reason += "; rejected for accuracy: " + "; ".join(rejected)
    return decision, checked, rejected


def _sixteen_bit(problem, optimizer=None) -> str | None:
    """The 16-bit baseline: the cast the model predicts faster; on a tie (within 2%) the one the
    optimizer prefers (:func:`profilers.training_state.preferred_sixteen_bit`).

    Both cost the same bytes; measuring one saves cluster time on slow links.
    """
    sixteen = [c for c in SIXTEEN_BIT_CASTS if c in problem.configs]
    if not sixteen:
        return None
    preferred = preferred_sixteen_bit(optimizer)
    return min(sixteen, key=lambda c: float(problem.predict(problem.uniform(c))[0]) * (1 + 0.02 * (c != preferred)))


def _reference_budget(problem, reference: str) -> float:
    label = parse(reference).label
    if label not in problem.configs:
        return 0.0
    return float(problem.fidelity_error(problem.uniform(label))[0])


def _error(problem, choices) -> float:
    return float(problem.fidelity_error(np.asarray(choices)[None, :])[0])


class LazyTrial:
    """The accuracy trial, started on first use; remembers every plan's verdict by its choices.

    Autotune's fp32 pair costs steps on the cluster; when nothing needs proving (no
    compressed plan can pay and fp32 stays the fastest) it never runs.
    """

    def __init__(self, trial: AccuracyTrial, problem, say: Callable[[str], None]) -> None:
        self.trial, self.problem, self.say = trial, problem, say
        self.arms: dict[bytes, Any] = {}
        self.started = False

    def ensure_started(self):
        """The trial's report, after running its fp32 pair if that has not happened yet."""
        if not self.started:
            self.say("accuracy trial: fp32 twice, in two batch orders")
            self.trial.start()
            self.started = True
        return self.trial.report()

    def judge(self, label: str, plan: Plan, choices, kind: str, description: str):
        key = np.asarray(choices).tobytes()
        if key not in self.arms:
            self.ensure_started()
            self.arms[key] = self.trial.trial(label, plan, kind, description, _error(self.problem, choices))
        return self.arms[key]

    def report(self, budget: float, budget_source: str):
        if not self.started:
            return None
        report = self.trial.report()
        report.budget, report.budget_reason = budget, budget_source
        report.fidelity_measure = self.problem.fidelity_measure
        return report


def _compression_can_pay(problem, policy: Policy, sixteen: str | None, group) -> tuple[bool, str]:
    """Whether any plan, at any error, is predicted faster than the best baseline by more than 3%.

    Where none is, no budget can change the advice and earning one would waste the trial.
    """
    best_baseline = min(float(problem.predict(problem.uniform(c))[0]) for c in ["none", *([sixteen] if sixteen else [])])
    budget, problem.budget = problem.budget, math.inf
    try:
        fastest = None
        if rank(group) == 0:
            found = policy.search(problem)
            fastest = float(problem.predict(found.choices[None, :])[0])
        fastest = from_rank_zero(fastest, group)
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
    floor = _error(problem, problem.uniform(sixteen)[0]) if sixteen else 0.0
    return floor, (f"earned: every uniform compressed plan trialled fell behind fp32 in a {steps}-step trial, so "
                   f"the budget is the error of {sixteen or 'fp32'} everywhere")


def _short_list(problem, found, top: int) -> list[np.ndarray]:
    """The search's top plans, plus the fastest feasible uniform compressed plan for diversity:
    neighbours of one plan tend to share the model's blind spots."""
    uniform = [problem.uniform(c)[0] for c in problem.configs if c not in BASELINES]
    uniform = [u for u in uniform if problem.feasible(u[None, :])[0]]
    extra = [min(uniform, key=lambda u: float(problem.predict(u[None, :])[0]))] if uniform else []
    return list(found.top(top)) + extra


def _result(problem, found, decision, measured, predicted, described, final, choices, profile, where, seconds):
    by_label = {m.label: m for m in measured}
    fp32 = by_label["fp32"].median_s
    sixteen = [m for m in measured if m.kind == SIXTEEN_BIT]
    best16 = min(sixteen, key=lambda m: m.median_s) if sixteen else None
    chosen_s = by_label[decision.chosen].median_s
    speedup = speedups({"measured_vs_fp32": fp32, "measured_vs_16bit": best16.median_s if best16 else None},
                       chosen_s, known_only=True)
    speedup.update(speedups({"predicted_vs_fp32": predicted["fp32"],
                             "predicted_vs_16bit": min(predicted[m.label] for m in sixteen) if sixteen else None},
                            predicted[decision.chosen], known_only=True))
    return AutotuneResult(
        plan=final.to_dict(),
        recommendation=decision.chosen,
        compress=decision.compress,
        description=described[decision.chosen],
        reason=decision.reason,
        predicted_s={**predicted, "compute_only": problem.model.compute_only_s},
        measured=measured,
        speedup=speedup,
        fidelity_error=float(problem.fidelity_error(choices[None, :])[0]),
        fidelity_budget=problem.budget,
        reference=problem.reference,
        policy=found.policy,
        policy_evaluations=int(found.evaluations),
        seconds=seconds,
        world_size=profile.environment.world_size,
        where=where or profile.environment.note or "this cluster",
        buckets=bucket_rows(problem, choices),
    )


class StageLog:
    """Prints each stage with the seconds since the start, on stderr (one rank's view of a job)."""

    def __init__(self) -> None:
        self.t0 = time.perf_counter()

    def __call__(self, message: str) -> None:
        print(f"  {time.perf_counter() - self.t0:6.1f} s  {message}", file=sys.stderr, flush=True)


def _measurements(problem, choices_of, described, rounds_s, where):
    """Model features, uncorrected prediction and measured median of every live plan."""
    data = MeasurementSet()
    for label, rounds in rounds_s.items():
        choices = choices_of[label][None, :]
        predicted = float(problem.model.predict_many(choices, problem.costs)[0])
        data.add(where, described[label], plan_features(problem, choices)[0], predicted, statistics.median(rounds))
    return data.measurements


def _append_measurements(path, measurements) -> None:
    data = MeasurementSet.load(path) if os.path.exists(path) else MeasurementSet()
    data.measurements.extend(measurements)
    data.save(path)
