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
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from policies.base import Policy
from policies.do_no_harm import CANDIDATE, FP32, SIXTEEN_BIT, LiveMeasurement, decide
from policies.greedy import GreedyPolicy
from policies.learned import MeasurementSet, plan_features
from policies.optuna_search import OptunaPolicy
from policies.problem import DEFAULT_REFERENCE, TuningProblem

from .compressors.registry import parse
from .live import LossFn, measure_plans
from .report import AutotuneResult, bucket_rows
from .runtime import Plan, install
from .schema import check_int

log = logging.getLogger("advisor.autotune")

#: Several PowerSGD ranks, so buckets can trade accuracy between them under one budget
#: (L-GreCo): a cheap rank on a big bucket paid for by a precise config on a small one.
DEFAULT_CANDIDATES = (
    "none", "fp16", "bf16", "powersgd(rank=1)", "powersgd(rank=2)", "powersgd(rank=4)",
    "powersgd(rank=8)", "topk(ratio=0.01)", "intquant(bits=8, packed=0)",
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


def _broadcast(obj, group=None):
    """Rank 0's ``obj`` on every rank."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0) if group is not None else 0, group=group)
    return box[0]


def _rank(group=None) -> int:
    return dist.get_rank(group) if dist.is_initialized() else 0


def autotune(
    ddp_model: DistributedDataParallel,
    loss_fn: LossFn,
    batches: Sequence[Any],
    optimizer: torch.optim.Optimizer | None = None,
    *,
    candidates: Sequence[str] = DEFAULT_CANDIDATES,
    budget: float | None = None,
    reference: str | None = DEFAULT_REFERENCE,
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

    ``loss_fn(model, batch) -> loss``; ``batches``: a few representative batches (the
    profilers and the live runs cycle through them).  ``candidates``: configs the policy may
    choose per bucket (``none`` is always one).  ``budget``: the largest size-weighted
    fidelity error allowed (default: that of ``reference`` everywhere).  ``top``: how many
    of the best predicted plans are measured live, in ``rounds`` interleaved rounds of up to
    ``steps`` steps (fewer for slow plans: about ``measure_s`` seconds a plan and round).  ``residual_model``: a fitted
    :class:`policies.learned.ResidualModel` that corrects predictions when ranking, or the
    path of a measurement set to fit one from; ``measurements_path``: append this run's live
    measurements (with their model features) to that measurement set file.
    ``warmup_steps``: uncompressed steps at the start of the installed plan.  Returns an
    :class:`AutotuneResult`; ``result.hook`` is the installed hook (None when the advice is
    native fp32).
    """
    # --- validate everything before any work --------------------------------------
    if not isinstance(ddp_model, DistributedDataParallel):
        raise TypeError(f"autotune needs a DistributedDataParallel model, got {type(ddp_model).__name__}")
    if not dist.is_initialized():
        raise RuntimeError("autotune needs an initialised process group (torchrun, or advisor.launch)")
    labels = list(dict.fromkeys(parse(c).label for c in ["none", *candidates]))
    if reference is not None and budget is None and parse(reference).label not in labels:
        labels.append(parse(reference).label)
    chosen_policy = _policy(policy, trials)
    for name, value, minimum in (("trials", trials, 1), ("top", top, 1), ("rounds", rounds, 1),
                                 ("steps", steps, 1), ("warmup_steps", warmup_steps, 0)):
        check_int(name, value, minimum)
    if not 0 <= min_gain < 1:
        raise ValueError(f"min_gain={min_gain!r}; allowed: 0 <= min_gain < 1")
    if not measure_s > 0:
        raise ValueError(f"measure_s={measure_s!r}; allowed: > 0 seconds")
    batches = list(batches)
    if not batches:
        raise ValueError("autotune needs at least one batch")
    say = progress or (lambda msg: None)
    t_start = time.perf_counter()

    # --- 1. profile -----------------------------------------------------------------
    if profile is None:
        from profilers.cluster import profile_cluster

        say("profiling compute, network, compressor kernels and fidelity")
        profile = profile_cluster(ddp_model, loss_fn, batches, optimizer,
                                  configs=[c for c in labels if c != "none"], group=group, note=where,
                                  network_budget_s=15.0)
    from profilers.profile import ClusterProfile

    profile = ClusterProfile.from_dict(_broadcast(profile.to_dict(), group))  # one profile for all ranks
    t_profiled = time.perf_counter()

    # --- 2. search (rank 0) ---------------------------------------------------------
    problem = TuningProblem.from_profile(profile, labels, budget=budget, reference=reference)
    if residual_model is not None:
        if isinstance(residual_model, (str, os.PathLike)):
            residual_model = MeasurementSet.load(residual_model).fit()
        problem.correction = residual_model
    found = None
    if _rank(group) == 0:
        say(f"searching plans ({chosen_policy.name})")
        found = chosen_policy.search(problem)
    found = _broadcast(found, group)
    t_searched = time.perf_counter()

    # --- 3. measure the top candidates live next to the baselines ------------------------
    plans: dict[str, Plan] = {}
    kinds: dict[str, str] = {"fp32": FP32}
    described: dict[str, str] = {"fp32": "fp32 (native DDP, no hook)"}
    predicted: dict[str, float] = {"fp32": float(problem.predict(problem.uniform("none"))[0])}
    choices_of: dict[str, np.ndarray] = {"fp32": problem.uniform("none")[0]}
    # the 16-bit baseline: the cast the model predicts faster (fp16 on a tie: finer mantissa);
    # both cost the same bytes, and measuring one saves cluster time on slow links
    sixteen = [c for c in ("fp16", "bf16") if c in problem.configs]
    if sixteen:
        c = min(sixteen, key=lambda c: float(problem.predict(problem.uniform(c))[0]) * (1 + 0.02 * (c == "bf16")))
        plans[c] = Plan.uniform(c, warmup_steps=0)
        kinds[c], described[c] = SIXTEEN_BIT, f"{c} everywhere"
        choices_of[c] = problem.uniform(c)[0]
        predicted[c] = float(problem.predict(problem.uniform(c))[0])
    seen = {v.tobytes() for v in choices_of.values()} | {problem.uniform(c)[0].tobytes() for c in sixteen}
    # for diversity, the fastest feasible uniform compressed plan joins the search's top plans:
    # neighbours of one plan tend to share the model's blind spots
    uniform = [problem.uniform(c)[0] for c in problem.configs if c not in ("none", "fp16", "bf16")]
    uniform = [u for u in uniform if problem.feasible(u[None, :])[0]]
    extra = [min(uniform, key=lambda u: float(problem.predict(u[None, :])[0]))] if uniform else []
    for choices in found.top(top) + extra:
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
    rounds_s = measure_plans(ddp_model, loss_fn, batches, optimizer, plans, rounds=rounds, steps=plan_steps,
                             group=group, progress=say)
    measured = [LiveMeasurement(label, kinds[label], rounds_s[label], predicted[label], described[label])
                for label in rounds_s]
    t_measured = time.perf_counter()

    # --- 4. decide: rank 0 decides, the others verify --------------------------------------
    mine = decide(measured, min_gain=min_gain)
    decision = _broadcast(mine, group)
    if decision.chosen != mine.chosen:
        log.warning("rank %d would have chosen %s; following rank 0's decision (%s)", _rank(group),
                    mine.chosen, decision.chosen)

    # --- 5. install ----------------------------------------------------------------------
    chosen_choices = choices_of[decision.chosen]
    if decision.kind == CANDIDATE:
        final = problem.plan(chosen_choices, warmup_steps=warmup_steps,
                             metadata={"advisor": "autotune", "description": described[decision.chosen]})
    elif decision.kind == SIXTEEN_BIT:
        final = Plan.uniform(decision.chosen, warmup_steps=0, metadata={"advisor": "autotune"})
    else:
        final = Plan.uniform("none", warmup_steps=0, metadata={"advisor": "autotune", "native": True})
    hook = None
    if install_plan and decision.kind != FP32:
        hook = install(ddp_model, final, group=group)

    result = _result(problem, found, decision, measured, predicted, described, final, chosen_choices,
                     profile, where, {"profile": t_profiled - t_start, "search": t_searched - t_profiled,
                                      "measure": t_measured - t_searched,
                                      "total": time.perf_counter() - t_start})
    result.searched_top = [problem.describe(c) for c in found.top(top)]
    result.measurements = _measurements(problem, choices_of, described, rounds_s, result.where)
    if measurements_path is not None and _rank(group) == 0:
        _append_measurements(measurements_path, result.measurements)
    result.hook = hook
    return result


def _result(problem, found, decision, measured, predicted, described, final, choices, profile, where, seconds):
    by_label = {m.label: m for m in measured}
    fp32 = by_label["fp32"].median_s
    sixteen = [m for m in measured if m.kind == SIXTEEN_BIT]
    best16 = min(sixteen, key=lambda m: m.median_s) if sixteen else None
    chosen_s = by_label[decision.chosen].median_s
    speedup = {"measured_vs_fp32": fp32 / chosen_s, "predicted_vs_fp32": predicted["fp32"] / predicted[decision.chosen]}
    if best16 is not None:
        speedup["measured_vs_16bit"] = best16.median_s / chosen_s
        speedup["predicted_vs_16bit"] = min(predicted[m.label] for m in sixteen) / predicted[decision.chosen]
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


def _autotune_rank(rank: int, world_size: int, spec: str, kwargs: dict):
    from .workloads import build_workload

    workload = build_workload(spec)
    ddp = DistributedDataParallel(workload.model)
    result = autotune(ddp, workload.loss_fn, workload.batches, workload.optimizer(), **kwargs)
    if result.hook is not None:
        result.hook.close()
    result.hook = None
    return result if rank == 0 else None


def autotune_model(spec: str, nproc: int = 2, *, rate: str | None = None, timeout: float = 900.0,
                   **kwargs: Any) -> AutotuneResult:
    """Launch ``nproc`` ranks for the workload ``spec`` and autotune it there (rank 0's result).

    ``rate`` (e.g. ``"1gbit"``) runs on an emulated cluster with links of that rate (root
    and iproute2); otherwise local processes over loopback.
    """
    from .emulated import run_ranks
    from .workloads import load_factory

    load_factory(spec)  # fail fast on a factory that does not import

    def args(where: str):
        return (spec, {"where": where, **kwargs})

    return run_ranks(_autotune_rank, nproc, args, rate=rate, timeout=timeout)[0]


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
