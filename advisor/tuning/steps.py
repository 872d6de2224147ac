"""The steps both tuners take, offline (:func:`advisor.autotune`) and online (:func:`advisor.wrap`).

profile -> search -> short-list -> measure -> decide -> install.  The tuners differ in how
they profile (dedicated steps, or observed training steps) and how they measure (a shadow
copy, or the user's own steps); everything between and after is here, so a plan is
searched, short-listed, judged and installed the same way by both.

Every function is called on every rank in the same order.  Where one rank's choice must
become everyone's (the search, the decision), rank 0's is broadcast.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np
import torch

from advisor.compressors.registry import parse
from advisor.core.collectives import from_rank_zero, rank
from advisor.core.documents import check_int
from advisor.runtime import Plan
from advisor.runtime.plan import exchange_groups
from advisor.tuning.accuracy import AccuracyTrial, ArmResult, check_tolerance
from policies import accuracy_gate as gate
from policies import evidence
from policies.base import Policy, PolicyResult
from policies.baselines import BASELINES, DEFAULT_REFERENCE
from policies.baselines import SIXTEEN_BIT as SIXTEEN_BIT_CASTS
from policies.do_no_harm import (
    CANDIDATE,
    FP32,
    RUNOFF,
    SIXTEEN_BIT,
    Decision,
    LiveMeasurement,
    Retiming,
    decide,
    step_speedup,
)
from policies.problem import TuningProblem, describe_layout
from profilers.profile import ClusterProfile
from profilers.training_state import preferred_sixteen_bit

log = logging.getLogger("advisor.tuning")

#: Several PowerSGD ranks, so buckets can trade accuracy between them under one budget
#: (L-GreCo): a cheap rank on a big bucket paid for by a precise config on a small one.
#: The precise end (rank 16, 8-bit integers summed in the all-reduce) stays available when the
#: accuracy trial rejects the aggressive configs.
DEFAULT_CANDIDATES = (
    "none", "fp16", "bf16", "powersgd(rank=1)", "powersgd(rank=2)", "powersgd(rank=4)",
    "powersgd(rank=8)", "powersgd(rank=16)", "topk(ratio=0.01)", "intquant(bits=8, packed=0)",
)


#: the accuracy trial's time budget where the run's length is not given
DEFAULT_TRIAL_S = 60.0
#: the share of the run the accuracy trial may take, where its length is given
DEFAULT_TRIAL_SHARE = 0.02


def check_trial_budget(expected_steps, trial_share, tolerance) -> None:
    """Refuse a bad run length, trial share or tolerance, naming the allowed values."""
    if expected_steps is not None:
        check_int("expected_steps", expected_steps, 1)
    if isinstance(trial_share, bool) or not isinstance(trial_share, (int, float)) or not 0 < trial_share <= 1:
        raise ValueError(f"trial_share={trial_share!r}; allowed: a share of the run 0 < trial_share <= 1 (0.02: 2%)")
    check_tolerance(tolerance)


def trial_budget(expected_steps: int | None, share: float, trial_s: float | None) -> dict[str, Any]:
    """The accuracy trial's budget (:class:`AccuracyTrial` arguments): ``share`` of the run, in
    training steps over every arm, where its length is known (and gaps are extrapolated to
    it); else ``trial_s`` seconds (default :data:`DEFAULT_TRIAL_S`)."""
    if expected_steps is None:
        return {"budget_steps": None, "horizon": None, "time_budget_s": trial_s if trial_s is not None else DEFAULT_TRIAL_S}
    return {"budget_steps": max(1, math.ceil(share * expected_steps)), "horizon": expected_steps,
            "time_budget_s": trial_s}


def candidate_labels(candidates: Sequence[str], budget: float | None = None, reference: str | None = None) -> list[str]:
    """The configs to profile and search: ``none``, the candidates, and the budget's reference.

    Without a budget, the reference's error sets it (the given one, else the default one),
    so its fidelity must be profiled too.

    Raises:
        ValueError: a config that cannot be read, naming the allowed ones.
    """
    labels = list(dict.fromkeys(parse(c).label for c in ["none", *candidates]))
    fallback = reference if reference is not None else DEFAULT_REFERENCE
    if budget is None and parse(fallback).label not in labels:
        labels.append(parse(fallback).label)
    return labels


@dataclass
class Arm:
    """One plan in the live race: its label, kind (fp32, 16-bit, candidate), plan and prediction."""

    label: str
    kind: str
    plan: Plan
    #: one config index per bucket of the tuning problem
    choices: np.ndarray
    description: str
    predicted_s: float
    #: the tuning problem ``choices`` index: the bucket layout the plan was searched under
    problem: TuningProblem | None = field(default=None, repr=False, compare=False)

    @property
    def layout(self) -> str:
        """The plan's bucket layout in words ("" for DDP's own buckets)."""
        return describe_layout(self.plan.exchange_mb, self.plan.bucket_cap_mb)


def not_ddp(who: str, model) -> TypeError:
    """The refusal of a model that is not DDP, naming what to call instead for a sharded one."""
    from torch.distributed.fsdp import FSDPModule

    sharded = isinstance(model, torch.nn.Module) and any(isinstance(m, FSDPModule) for m in model.modules())
    return TypeError(f"{who} needs a DistributedDataParallel model, got {type(model).__name__}" + (
        "; it is sharded with fully_shard (FSDP2): tune it with advisor.autotune_sharded(model, loss_fn, batches, "
        "optimizer, build=...)" if sharded else ""))


# --- 1. profile ---------------------------------------------------------------------------
def shared_profile(profile: ClusterProfile, group=None) -> ClusterProfile:
    """Rank 0's profile on every rank: every later step must start from the same numbers."""
    return ClusterProfile.from_dict(from_rank_zero(profile.to_dict(), group))


# --- 2. search ----------------------------------------------------------------------------
def search(policy: Policy, problem: TuningProblem, group=None) -> PolicyResult:
    """Rank 0 searches (the policy may be random); every rank gets its result."""
    found = policy.search(problem) if rank(group) == 0 else None
    return from_rank_zero(found, group)


#: bucket layouts tried beside DDP's own buckets (MiB exchanged together; the whole model in one
#: exchange is always tried too)
LAYOUT_GRID_MB = (4.0, 16.0, 64.0)
#: DDP bucket caps tried below DDP's own buckets (MiB): smaller buckets leave backward sooner and
#: overlap more of it, at the cost of more rounds; only DDP can make them (Plan.bucket_cap_mb)
FINER_GRID_MB = (1.0, 4.0)
#: a layout must be predicted this much faster than DDP's own buckets to be searched on: it
#: trades overlap with backward against rounds, which the model may misjudge
LAYOUT_MARGIN = 0.03


@dataclass(frozen=True)
class Layout:
    """A bucket layout beside DDP's own: buckets joined in the hook up to ``exchange_mb``, or DDP
    rebuilt with ``bucket_cap_mb`` (:class:`advisor.runtime.Plan`); one of the two is set."""

    exchange_mb: float | None = None
    bucket_cap_mb: float | None = None

    def describe(self) -> str:
        return (f"{self.exchange_mb:g} MiB exchanges" if self.exchange_mb is not None
                else f"DDP's buckets at {self.bucket_cap_mb:g} MiB")


def layouts_to_try(problem: TuningProblem, rebuild_ddp: bool = True) -> list[Layout]:
    """The layouts that group ``problem``'s parameters differently from DDP's buckets and from each
    other: coarser (the join grid, then the whole model in one exchange), then (``rebuild_ddp``,
    as :func:`search_layouts`) finer.  A join size is tried where the hook would join some of DDP's
    buckets at it, and DDP built at that size (``rebuild_ddp``) groups the parameters anew."""
    sizes = [b.numel * 4 for b in problem.model.buckets]

    def grouping(model) -> tuple:
        return tuple(tuple(b.parameters) for b in model.buckets)

    seen = {grouping(problem.model)}
    out = []
    for mb in (*LAYOUT_GRID_MB, float(math.ceil(sum(sizes) / (1 << 20)))):
        if len(exchange_groups(sizes, mb)) == len(sizes):
            continue  # the hook would join nothing at this size
        key = grouping(problem.model.with_layout(mb, join_in_ddp=rebuild_ddp))
        if key not in seen:
            seen.add(key)
            out.append(Layout(exchange_mb=mb))
    for mb in FINER_GRID_MB if rebuild_ddp else ():
        key = grouping(problem.model.with_layout(None, mb))
        if key not in seen and len(key) > problem.n_buckets:
            seen.add(key)
            out.append(Layout(bucket_cap_mb=mb))
    return out


class LayoutSearch(NamedTuple):
    """:func:`search_layouts`' answer: the layout to race (``problem``, its search ``found``), a line
    per layout tried, and the other layouts whose best plan the model cannot tell from the chosen one
    (within :data:`LAYOUT_MARGIN`): ``[(problem, found), ...]``, for the race to settle."""

    problem: TuningProblem
    found: PolicyResult
    lines: list[str]
    close: list[tuple[TuningProblem, PolicyResult]]


def search_layouts(policy: Policy, problem: TuningProblem, found: PolicyResult, group=None, *,
                   rebuild_ddp: bool = True) -> LayoutSearch:
    """The search again under each other bucket layout (``problem`` has DDP's own); the layout
    whose best plan is predicted fastest, by :data:`LAYOUT_MARGIN` over DDP's buckets, the others
    predicted as fast within that margin, and a line per layout tried.

    ``rebuild_ddp``: the advice runs on DDP built for it (:func:`advisor.ddp_for`, as autotune's
    race measures it), so layouts finer than DDP's buckets are searched too and a join is priced
    as the buckets DDP builds at its size, without the hook's copies.  False, for a tuner on the
    user's own DDP model: finer layouts are left out (only a rebuilt DDP has them) and a join is
    priced with the copies the hook makes to join DDP's buckets."""
    if problem.model.layout != (None, None):
        raise ValueError("search_layouts starts from DDP's own buckets (a problem without a layout)")
    best = (problem, found)
    tried = []
    lines = [f"DDP's {problem.n_buckets} buckets: {found.predicted_s * 1e3:.1f} ms ({problem.describe(found.choices)})"]
    for layout in layouts_to_try(problem, rebuild_ddp):
        other = problem.with_layout(layout.exchange_mb, layout.bucket_cap_mb, join_in_ddp=rebuild_ddp)
        result = search(policy, other, group)
        tried.append((other, result))
        lines.append(f"{layout.describe()} ({other.n_buckets}): {result.predicted_s * 1e3:.1f} ms "
                     f"({other.describe(result.choices)})")
        if result.predicted_s < found.predicted_s * (1 - LAYOUT_MARGIN) and result.predicted_s < best[1].predicted_s:
            best = (other, result)
    bar = best[1].predicted_s * (1 + LAYOUT_MARGIN)
    close = sorted(((p, r) for p, r in tried if p is not best[0] and r.predicted_s <= bar),
                   key=lambda pr: pr[1].predicted_s)
    return LayoutSearch(best[0], best[1], lines, close)


def close_layouts_to_race(close: Sequence[tuple[TuningProblem, PolicyResult]]) -> list[tuple[TuningProblem, PolicyResult]]:
    """Of the close layouts (:attr:`LayoutSearch.close`, fastest predicted first), the ones the race
    should settle: the nearest joined one and the nearest with DDP rebuilt finer.  The model can
    misjudge overlap against rounds either way (more ranks than cores starve the overlap it
    assumes), so the nearest in one direction must not shut out the other; further ones in the
    same direction add race time for a layout that is a variant of one already racing."""
    picked: dict[bool, tuple[TuningProblem, PolicyResult]] = {}
    for other, found in close:
        picked.setdefault(other.exchange_mb is not None, (other, found))
    return sorted(picked.values(), key=lambda pr: pr[1].predicted_s)


# --- 3. short-list ------------------------------------------------------------------------
def sixteen_bit_baseline(problem: TuningProblem, optimizer=None) -> str | None:
    """The 16-bit cast to race: the one predicted faster; on a tie (within 2%) the one the
    optimizer prefers (:func:`profilers.training_state.preferred_sixteen_bit`).

    Both send the same bytes, so measuring one saves cluster time on slow links.
    """
    casts = [c for c in SIXTEEN_BIT_CASTS if c in problem.configs]
    if not casts:
        return None
    preferred = preferred_sixteen_bit(optimizer)
    return min(casts, key=lambda c: float(problem.predict(problem.uniform(c))[0]) * (1 + 0.02 * (c != preferred)))


def baseline_arms(problem: TuningProblem, sixteen: str | None) -> list[Arm]:
    """fp32 (plan ``none``) and, where one is a candidate, the 16-bit cast everywhere."""
    arms = [_arm(problem, "fp32", FP32, problem.uniform("none")[0], "fp32 (native DDP, no hook)")]
    if sixteen is not None:
        arms.append(_arm(problem, sixteen, SIXTEEN_BIT, problem.uniform(sixteen)[0], f"{sixteen} everywhere"))
    return arms


def short_list(problem: TuningProblem, found: PolicyResult, top: int, *, diverse: bool = False,
               label: Callable[[int, str], str] | None = None) -> list[Arm]:
    """The search's ``top`` distinct plans as candidate arms, leaving out any that is a baseline.

    Under any layout but DDP's own buckets (joined exchanges, ``problem.exchange_mb``, or DDP
    rebuilt, ``problem.bucket_cap_mb``) a 16-bit cast everywhere is no baseline (those run on the
    buckets DDP has, one message each) and stays; its accuracy is the cast's
    (:meth:`LazyTrial.judge_arm`).  ``diverse`` adds the fastest feasible uniform
    compressed plan: neighbours of one plan tend to share the model's blind spots.
    ``label(i, description)`` names the i-th candidate (from 1); by default its description.
    """
    ranked = list(found.top(top))
    if diverse:
        uniform = [problem.uniform(c)[0] for c in problem.configs if c not in BASELINES]
        uniform = [u for u in uniform if problem.feasible(u[None, :])[0]]
        ranked += [min(uniform, key=lambda u: float(problem.predict(u[None, :])[0]))] if uniform else []
    own_buckets = problem.bucket_cap_mb is None and problem.exchange_mb is None
    seen = {problem.uniform(c)[0].tobytes() for c in problem.baselines() if own_buckets or c not in SIXTEEN_BIT_CASTS}
    arms: list[Arm] = []
    for choices in ranked:
        if choices.tobytes() in seen:
            continue
        seen.add(choices.tobytes())
        description = problem.describe(choices)
        name = label(len(arms) + 1, description) if label is not None else description
        arms.append(_arm(problem, name, CANDIDATE, choices, description))
    return arms


def _arm(problem: TuningProblem, label: str, kind: str, choices: np.ndarray, description: str) -> Arm:
    if kind == CANDIDATE:
        plan = problem.plan(choices, warmup_steps=0)
    else:  # a baseline: the cast everywhere, or plan none (fp32 through the hook, online)
        plan = Plan.uniform(label if kind == SIXTEEN_BIT else "none", warmup_steps=0)
    return Arm(label, kind, plan, choices, description, float(problem.predict(choices[None, :])[0]), problem)


# --- 5. decide ----------------------------------------------------------------------------
def decide_time_to_accuracy(measured: Sequence[LiveMeasurement], judge: Callable[[Decision], Any] | None, *,
                            min_gain: float = 0.0, group=None,
                            retime: Callable[[Decision, Any], evidence.Estimate] | None = None,
                            runoff: Callable[[str, str, evidence.Estimate], evidence.Estimate] | None = None,
                            ) -> tuple[Decision, str, list[str]]:
    """Do no harm to the time to accuracy: the decision and why its accuracy stands.

    Every rank calls it with the same measurements; rank 0's decision is broadcast.  The
    plan that do-no-harm chooses on speed is judged (``judge(decision) -> ArmResult``, the
    accuracy trial).  A 16-bit cast stands unless the trial shows it harmful.  A compressed
    plan must be proven within the tolerance, and the lower bound of its time-to-accuracy
    speed-up, its step speed-up times its step efficiency (capped at 1: a compressed
    gradient is not taken to learn faster than the exact one), must still beat the best
    baseline by ``min_gain``.  A plan that fails leaves the race and the choice falls to
    the next, down to fp32, which needs no trial.  ``judge=None``: speed alone decides
    (the user turned the accuracy trial off).

    ``retime(decision, arm) -> Estimate``, where given, measures a compressed plan's step
    speed-up again once the trial has proven it: the plan alone beside the best baseline, on
    every rank.  That estimate, free of the race's selection, is the one the time to accuracy
    is built on and must clear the bar.  With it, once a plan has been turned down, the next
    candidate whose race median beat the baseline is judged and re-timed even where the race
    left it unresolved: the race stops once its winner is resolved, not the runner-up, and a
    re-timing measures on while the time to accuracy is unresolved.

    ``runoff(leader, runner_up, race) -> Estimate``, where given, settles the race's leader
    against a runner-up it could not tell apart from it (``race``: the leader's time over the
    runner-up's, in the race): the two alone, in longer turns (:func:`runoff_timer`); it
    returns the same ratio.  With a ``judge`` the leader is proven first and the run-off comes
    before its re-timing; without one, it comes at once.  The runner-up (:func:`_rival`: the
    fastest in another bucket layout first) goes first where it was faster there, ahead of the
    plans the race put between the two, and is judged in its turn; the loser stays next in
    line, should the winner be turned down.  One run-off a call at most.

    Returns ``(decision, accepted_reason, rejected_reasons)``; ``accepted_reason`` is ""
    when nothing was judged, and the decision's reason names every rejection with its
    numbers.  A compressed decision carries its time-to-accuracy speed-up in ``tta``.
    """
    measured = list(measured)
    rejected: list[str] = []
    checked = ""
    lost_to: dict[str, str] = {}  # a run-off's loser: its winner, ahead of it while the winner is in the race
    ran_off: list[str] = []

    def _run_off(decision: Decision, pool: list[LiveMeasurement]) -> bool:
        """At most one run-off (it settles the race's first place, the costliest error, at a bounded
        cost); True where the runner-up won it."""
        rival = _rival(decision, pool, min_gain) if runoff is not None and not ran_off else None
        if rival is None:
            return False
        leader = next(m for m in pool if m.label == decision.chosen)
        race = step_speedup(leader, rival)
        step = runoff(leader.label, rival.label, race)
        winner, loser = (rival, leader) if step.value > 1 else (leader, rival)
        lost_to[loser.label] = winner.label
        if winner is rival:
            # a rival from another layout beat the leader: the plans the race put between the two,
            # not shown faster than the winner there, go behind it with the leader
            for m in pool:
                if (m.kind == CANDIDATE and m not in (winner, loser) and m.median_s < winner.median_s
                        and not step_speedup(winner, m).lower() > 1):
                    lost_to[m.label] = winner.label
        ran_off.append(_runoff_note(winner, loser, race, step, winner is rival))
        return winner is rival

    while True:
        alive = {m.label for m in measured}
        pool = [m for m in measured if lost_to.get(m.label) not in alive]
        mine = decide(pool, min_gain=min_gain)
        decision = from_rank_zero(mine, group)
        if decision.chosen != mine.chosen:
            log.warning("rank %d would have chosen %s; following rank 0's decision (%s)", rank(group),
                        mine.chosen, decision.chosen)
        if judge is not None and retime is not None and rejected:
            decision = _second_look(decision, pool, min_gain) or decision
        if judge is None:
            if _run_off(decision, pool):
                continue  # decided again, with the runner-up ahead of the leader
            break
        if decision.kind == FP32:
            break
        arm = judge(decision)
        if decision.kind == SIXTEEN_BIT and arm.status == gate.NOT_PROVEN:
            arm = _cast_weighed_by_time_to_accuracy(arm, decision, pool)
        # a proven plan's place is settled before it is re-timed; a run-off's winner is then judged in turn
        if arm.accepted and decision.kind == CANDIDATE and arm.kind != gate.SIXTEEN_BIT and _run_off(decision, pool):
            continue
        why_not = "" if arm.accepted else arm.reason
        # a cast in another bucket layout learns as the cast does: its step speed-up is the claim
        if arm.accepted and decision.kind == CANDIDATE and arm.kind != gate.SIXTEEN_BIT:
            retimed = ""
            # without an efficiency there is no time to accuracy to build on a re-timing
            if retime is not None and arm.efficiency_estimate() is not None:
                race = decision.step_speedup()
                decision.retimed = retime(decision, arm)
                retimed = (f"re-timed alone beside {decision.best_baseline}: {decision.retimed.describe()} per step "
                           f"(the race's {race.describe()})")
            tta = time_to_accuracy(decision, arm)
            decision.tta = tta
            if tta is None or not tta.lower() > 1 + min_gain:
                why_not = (f"{arm.description}: proven within the tolerance, but its time to accuracy "
                           + (f"{tta.describe()} vs {decision.best_baseline} (step speed-up x efficiency, 95% bounds) "
                              "is not shown faster" if tta is not None else "cannot be read (fp32's curve is flat)")
                           + (f"; {retimed}" if retimed else ""))
            elif retimed:
                decision.reason += f"; {retimed}"
        if not why_not:
            decision.reason += f"; accuracy: {arm.reason}"
            if decision.tta is not None:
                decision.reason += (f"; time to accuracy {decision.tta.describe()} vs {decision.best_baseline} "
                                    "(95% bounds)")
            checked = arm.reason
            break
        rejected.append(why_not)
        measured = [m for m in measured if m.label != decision.chosen]
    if rejected:
        decision.reason = decision.reason.replace("no compressed candidate was measured",
                                                  "no measured compressed candidate was proven for accuracy")
        decision.reason += "; not installed for accuracy: " + "; ".join(_grouped(rejected))
    if ran_off:
        decision.reason += "; " + "; ".join(ran_off)
    return decision, checked, rejected


def _cast_weighed_by_time_to_accuracy(arm: ArmResult, decision: Decision,
                                      measured: Sequence[LiveMeasurement]) -> ArmResult:
    """A cast whose harm a trial that is not powered could not prove (:func:`policies.accuracy_gate.judge`):
    it stands unless its time to accuracy, its step speed-up over fp32 times its step efficiency, is
    shown slower than fp32's.  A cast that only leaves a plateau later than fp32 is worth most of an
    fp32 step; one whose gradients stall (fp16 underflow) is worth little, and fp32 is then sooner."""
    # decide() has raced fp32 beside it, and the cast judged is the one decided on
    fp32 = next(m for m in measured if m.kind == FP32)
    cast = next(m for m in measured if m.label == decision.chosen)
    efficiency = arm.efficiency_estimate()
    if efficiency is None:
        return dataclasses.replace(arm, accepted=False, status=gate.REJECTED,
                                   reason=f"{arm.reason}; its time to accuracy cannot be read (fp32's curve is flat)")
    tta = evidence.time_to_accuracy(step_speedup(fp32, cast), efficiency)
    stands = tta.upper() >= 1
    return dataclasses.replace(arm, accepted=stands, status=gate.ACCEPTED if stands else gate.REJECTED, reason=(
        f"{arm.reason}; {'the cast stands: ' if stands else ''}its time to accuracy {tta.describe()} vs fp32 "
        f"(step speed-up x efficiency, 95% bounds) is {'not shown slower' if stands else 'shown slower'}"))


def _rival(decision: Decision, pool: Sequence[LiveMeasurement], min_gain: float) -> LiveMeasurement | None:
    """The candidate a run-off should set beside the chosen one: the fastest other candidate also shown
    faster than the best baseline and not already shown slower than the chosen, in another bucket
    layout where there is one.

    Why another layout first: the search sends its top few plans in one layout, which differ in
    what the model prices well (a small bucket's rank), and one plan for each close layout, which
    differs in what it prices worst (how much of the exchange hides behind backward, with ranks
    starved of cores).  The fastest of several near-equal plans in one layout is also the
    race's luckiest, so its own layout's runner-up is the smaller error to settle."""
    if not decision.compress or decision.kind != CANDIDATE:
        return None
    by_label = {m.label: m for m in pool}
    base, leader = by_label[decision.best_baseline], by_label[decision.chosen]
    others = [m for m in pool if m.kind == CANDIDATE and m is not leader
              and step_speedup(base, m).lower() > 1 + min_gain and not step_speedup(leader, m).upper() < 1]
    if not others:
        return None
    elsewhere = [m for m in others if m.layout != leader.layout]
    return min(elsewhere or others, key=lambda m: m.median_s)


def _runoff_note(winner: LiveMeasurement, loser: LiveMeasurement, race: evidence.Estimate,
                 step: evidence.Estimate, runner_up_won: bool) -> str:
    """The run-off in words, each ratio as the winner's speed-up over the loser (``race`` and ``step``
    are the leader's time over the runner-up's)."""
    def as_winner(e: evidence.Estimate) -> tuple[float, float, float]:
        return (e.value, e.lower(), e.upper()) if runner_up_won else (1 / e.value, 1 / e.upper(), 1 / e.lower())
    value, low, high = as_winner(step)
    return (f"{winner.description or winner.label} went ahead of {loser.description or loser.label} in a run-off of "
            f"the two alone, which the race could not tell apart ({as_winner(race)[0]:.2f}x): {value:.2f}x per step "
            f"({low:.2f}-{high:.2f}x, 95%)")


def _second_look(decision: Decision, measured: Sequence[LiveMeasurement], min_gain: float) -> Decision | None:
    """The baseline's decision turned into a provisional one for the candidate that stepped faster
    in the race but not beyond its noise, so that the trial and a re-timing can settle it; None
    where there is none."""
    step = decision.step
    if decision.compress or decision.best_candidate is None or step is None or not step.value > 1 + min_gain:
        return None
    plan = next(m for m in measured if m.label == decision.best_candidate)
    name = plan.description or plan.label
    return dataclasses.replace(
        decision, chosen=plan.label, kind=CANDIDATE, compress=True, gain_vs_best_baseline=step.value,
        margin=step.noise, reason=(f"{name} stepped {step.describe()} per step vs {decision.best_baseline} in the race, "
                                   "not beyond its noise; the faster plans were turned down, so it was judged and "
                                   "timed again"))


#: rounds of a re-timing at the least, and how many times longer its turns are than the race's
RETIME_ROUNDS = 3
RETIME_LONGER = 3


def retimer(measure: Callable[..., Mapping[str, list[float]]], arms: Mapping[str, Arm], *,
            turn: Callable[[Arm], int], max_rounds: int, min_gain: float = 0.0,
            say: Callable[[str], None] | None = None,
            record: list[Retiming] | None = None) -> Callable[[Decision, Any], evidence.Estimate]:
    """The ``retime`` of :func:`decide_time_to_accuracy`: the chosen plan and the best baseline
    measured again, the two alone, in interleaved rounds of ``turn(arm)`` timed steps a turn
    (:data:`RETIME_LONGER` times the race's, as the callers set it).

    Why again: the race's winner is the fastest of several arms measured in short turns, so
    its race time errs in its favour, by more than the race's own spread shows where all its
    rounds shared a bias.  ``measure(arms, steps, rounds, max_rounds, settled)`` measures the
    ``{label: Arm}`` given (fp32 natively) and returns each one's round medians, the slowest
    rank's.  Rounds go on past :data:`RETIME_ROUNDS` while the time to accuracy is unresolved,
    up to ``max_rounds``.  Each re-timing is appended to ``record``.
    """
    say = say or (lambda message: None)

    def retime(decision: Decision, verdict) -> evidence.Estimate:
        base, plan = arms[decision.best_baseline], arms[decision.chosen]
        pair = {base.label: base, plan.label: plan}
        per_turn = {label: turn(arm) for label, arm in pair.items()}
        say(f"re-timing {plan.description} beside {base.label}: the two alone, {per_turn[plan.label]} steps a turn")
        started = time.perf_counter()
        rounds_s = measure(pair, per_turn, RETIME_ROUNDS, max(max_rounds, RETIME_ROUNDS),
                           retime_settled(decision, verdict, min_gain))
        done = retiming_of(decision, rounds_s, per_turn[plan.label], time.perf_counter() - started)
        if record is not None:
            record.append(done)
        return evidence.paired_speedup(rounds_s[base.label], rounds_s[plan.label])

    return retime


def runoff_timer(measure: Callable[..., Mapping[str, list[float]]], arms: Mapping[str, Arm], *,
                 turn: Callable[[Arm], int], max_rounds: int, say: Callable[[str], None] | None = None,
                 record: list[Retiming] | None = None) -> Callable[[str, str, evidence.Estimate], evidence.Estimate]:
    """The ``runoff`` of :func:`decide_time_to_accuracy`: the race's leader and runner-up measured
    again, the two alone, in interleaved rounds of ``turn(arm)`` timed steps a turn, as a
    re-timing is (:func:`retimer`).

    Why: the race goes on until its leader is resolved against the best baseline, not against
    the runner-up, and picks the lower median.  Two candidates inside its noise (often the same
    compressor in two bucket layouts) are then a coin toss, and the loser may be the faster.
    Rounds go on past :data:`RETIME_ROUNDS`, up to ``max_rounds``, until one is shown faster or
    the two are shown within :data:`RUNOFF_EQUAL` of each other.  Returns the leader's time over
    the runner-up's; the run-off is appended to ``record`` (purpose ``"runoff"``).
    """
    say = say or (lambda message: None)

    def runoff(leader: str, runner_up: str, race: evidence.Estimate) -> evidence.Estimate:
        pair = {label: arms[label] for label in (leader, runner_up)}
        per_turn = {label: turn(arm) for label, arm in pair.items()}
        say(f"run-off: {arms[runner_up].description} beside {arms[leader].description}, which the race could not "
            f"tell apart; the two alone, {per_turn[leader]} steps a turn")
        started = time.perf_counter()
        rounds_s = measure(pair, per_turn, RETIME_ROUNDS, max(max_rounds, RETIME_ROUNDS),
                           lambda r: runoff_settled(evidence.paired_speedup(r[leader], r[runner_up])))
        step = evidence.paired_speedup(rounds_s[leader], rounds_s[runner_up])
        if record is not None:
            record.append(Retiming(runner_up, leader, per_turn[runner_up], list(rounds_s[runner_up]),
                                   list(rounds_s[leader]), step.value, step.lower(), step.upper(), race.value,
                                   time.perf_counter() - started, purpose=RUNOFF))
        return step

    return runoff


#: two plans within this of each other per step (both 95% bounds) are as fast as each other
RUNOFF_EQUAL = 0.03


def runoff_settled(step: evidence.Estimate) -> bool:
    """Whether a run-off may stop: one of the two is shown faster, or both bounds lie within
    :data:`RUNOFF_EQUAL` of a tie, where more rounds would not buy a difference worth having."""
    return step.lower() > 1 or step.upper() < 1 or (step.lower() > 1 / (1 + RUNOFF_EQUAL)
                                                   and step.upper() < 1 + RUNOFF_EQUAL)


def retime_settled(decision: Decision, verdict, min_gain: float = 0.0
                   ) -> Callable[[Mapping[str, list[float]]], bool]:
    """When a re-timing of ``decision.chosen`` beside ``decision.best_baseline`` may stop: once the
    time to accuracy built on its rounds (``{label: round medians}``) is resolved either way."""
    base, plan = decision.best_baseline, decision.chosen
    efficiency = verdict.efficiency_estimate() if verdict is not None else None

    def decided(rounds_s: Mapping[str, list[float]]) -> bool:
        step = evidence.paired_speedup(rounds_s[base], rounds_s[plan])
        return efficiency is None or evidence.resolved(evidence.time_to_accuracy(step, efficiency), min_gain)

    return decided


def retiming_of(decision: Decision, rounds_s: Mapping[str, list[float]], steps: int, seconds: float) -> Retiming:
    """The record of a re-timing of ``decision.chosen`` beside its best baseline, from each one's
    round medians, with what the race had said."""
    base, plan = decision.best_baseline, decision.chosen
    step = evidence.paired_speedup(rounds_s[base], rounds_s[plan])
    return Retiming(plan, base, steps, list(rounds_s[plan]), list(rounds_s[base]), step.value, step.lower(),
                    step.upper(), decision.step_speedup().value, seconds)


def turn_steps(arm: Arm, steps: int, measure_s: float) -> int:
    """Timed steps of ``arm``'s turn: about ``measure_s`` of its predicted steps, at least one, at most ``steps``
    (``steps`` where nothing is predicted)."""
    predicted = arm.predicted_s
    if predicted is None or not math.isfinite(predicted) or predicted <= 0:
        return steps
    return max(1, min(steps, math.ceil(measure_s / predicted)))



def settled(measured: Sequence[LiveMeasurement], min_gain: float = 0.0) -> bool:
    """Whether more rounds would not change the speed decision: the 16-bit cast's speed-up over
    fp32 and the fastest candidate's over the best baseline are each resolved
    (:func:`policies.evidence.resolved`)."""
    decision = decide(list(measured), min_gain=min_gain)
    by_label = {m.label: m for m in measured}
    fp32 = min((m for m in measured if m.kind == FP32), key=lambda m: m.median_s)
    pairs = [(fp32, m) for m in measured if m.kind == SIXTEEN_BIT][:1]
    if decision.best_candidate is not None:
        pairs.append((by_label[decision.best_baseline], by_label[decision.best_candidate]))
    return all(evidence.resolved(step_speedup(base, plan), min_gain) for base, plan in pairs)


def _grouped(reasons: Sequence[str]) -> list[str]:
    """Reasons of the form "plan: why", with the plans that share a "why" named once together."""
    by_why: dict[str, list[str]] = {}
    for reason in reasons:
        plan, _, why = reason.partition(": ")
        by_why.setdefault(why, []).append(plan)
    return [f"{' and '.join(plans)}: {why}" if why else plans[0] for why, plans in by_why.items()]


def time_to_accuracy(decision: Decision, arm) -> evidence.Estimate | None:
    """The time-to-accuracy speed-up of a candidate over the best baseline: step speed-up x
    step efficiency (capped at 1), each with its error; None where the efficiency is unknown."""
    efficiency = arm.efficiency_estimate()
    return evidence.time_to_accuracy(decision.step_speedup(), efficiency) if efficiency is not None else None


def unprovable(why: str, arms: Mapping[str, Arm] | None = None) -> Callable[[Decision], Any]:
    """A judge for when no accuracy trial can run: casts stand, compressed plans are not proven.

    ``arms`` (the race's, by label) lets a 16-bit cast in another bucket layout (a candidate)
    stand as the cast does: the layout changes how gradients cross, not what arrives.
    """
    def judge(decision: Decision):
        arm = arms.get(decision.chosen) if arms is not None else None
        kind = gate.SIXTEEN_BIT if arm is not None and uniform_cast(arm) is not None else _trial_kind(decision.kind)
        status = gate.ACCEPTED if kind == gate.SIXTEEN_BIT else gate.NOT_PROVEN
        return ArmResult(decision.chosen, kind, decision.chosen, [], 0.0, status == gate.ACCEPTED,
                         f"{decision.chosen}: " + ("a 16-bit cast, not trialled" if status == gate.ACCEPTED
                                                   else f"not proven: {why}"), status=status)
    return judge


def uniform_cast(arm: Arm) -> str | None:
    """The 16-bit cast ``arm`` runs on every bucket (a baseline, or one in another bucket layout), else None."""
    if arm.kind == SIXTEEN_BIT:
        return arm.label
    problem = arm.problem
    labels = {problem.configs[int(c)] for c in np.asarray(arm.choices).reshape(-1)} if problem is not None else set()
    return next(iter(labels)) if len(labels) == 1 and labels <= set(SIXTEEN_BIT_CASTS) else None


def _trial_kind(kind: str) -> str:
    """The accuracy trial's kind of arm for a raced plan's kind: a 16-bit cast is judged as one."""
    return gate.SIXTEEN_BIT if kind == SIXTEEN_BIT else gate.CANDIDATE


def fidelity_error(problem: TuningProblem, choices) -> float:
    return float(problem.fidelity_error(np.asarray(choices)[None, :])[0])


class LazyTrial:
    """The accuracy trial, started on first use; remembers every plan's verdict by its choices.

    Its fp32 pair costs steps on the cluster; when nothing needs proving (no compressed plan
    can pay and fp32 stays the fastest) it never runs.
    """

    def __init__(self, trial: AccuracyTrial, problem: TuningProblem, say: Callable[[str], None]) -> None:
        self.trial, self.problem, self.say = trial, problem, say
        self.arms: dict[str, Any] = {}  # by the digest of the plan without its layout
        self.raced: dict[str, Any] = {}  # a raced plan's verdict by its race label
        self.started = False

    def ensure_started(self):
        """The trial's report, after running its fp32 pair if that has not happened yet."""
        if not self.started:
            self.say("accuracy trial: fp32 twice, in two batch orders")
            self.trial.start()
            self.started = True
        return self.trial.report()

    def judge(self, label: str, plan: Plan, choices, kind: str, description: str,
              problem: TuningProblem | None = None):
        """``plan``'s verdict (``choices`` index ``problem``, by default the trial's); a plan
        that differs only in its bucket layout compresses alike and keeps the verdict (the
        trial's shadow copies run it on their own buckets)."""
        plan = dataclasses.replace(plan, exchange_mb=None, bucket_cap_mb=None)
        key = dataclasses.replace(plan, warmup_steps=0, metadata={}).digest()
        if key not in self.arms:
            self.ensure_started()
            self.arms[key] = self.trial.trial(label, plan, kind, description,
                                              fidelity_error(problem or self.problem, choices))
        return self.arms[key]

    def judge_arm(self, arm: Arm):
        """The verdict on a raced arm; a 16-bit cast everywhere is judged as the cast, in any layout."""
        cast = uniform_cast(arm)
        if cast is not None:
            verdict = self.judge(cast, Plan.uniform(cast, warmup_steps=0), arm.choices, gate.SIXTEEN_BIT,
                                 arm.description, arm.problem)
        else:
            verdict = self.judge(arm.label, arm.plan, arm.choices, _trial_kind(arm.kind), arm.description,
                                 arm.problem)
        self.raced[arm.label] = verdict
        return verdict

    def verdicts(self) -> dict[str, Any]:
        """Every plan judged so far, by its arm label, and every raced plan's verdict by its race label
        (a cast in another bucket layout is judged as the cast's arm, whose label differs)."""
        return {**{arm.label: arm for arm in self.arms.values()}, **self.raced}

    def report(self, budget: float, budget_source: str):
        if not self.started:
            return None
        report = self.trial.report()
        report.budget, report.budget_reason = budget, budget_source
        report.fidelity_measure = self.problem.fidelity_measure
        return report


# --- 6. install ---------------------------------------------------------------------------
def final_plan(problem: TuningProblem, arm: Arm, *, warmup_steps: int, metadata: dict[str, Any]) -> Plan:
    """The plan to train with: the chosen candidate after ``warmup_steps`` uncompressed steps,
    a 16-bit cast from the start, or plan ``none`` marked native (no hook is needed)."""
    if arm.kind == CANDIDATE:
        return (arm.problem or problem).plan(arm.choices, warmup_steps=warmup_steps,
                                             metadata={**metadata, "description": arm.description})
    if arm.kind == SIXTEEN_BIT:
        return Plan.uniform(arm.label, warmup_steps=0, metadata=metadata)
    return Plan.uniform("none", warmup_steps=0, metadata={**metadata, "native": True})
