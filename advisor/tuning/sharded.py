"""autotune for sharded training (FSDP2, ``fully_shard``): a config per parameter group, proven as for DDP.

::

    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    result = advisor.autotune_sharded(model, loss_fn, loader, optimizer, build=make_sharded_model,
                                      expected_steps=50_000)

The same steps as :func:`advisor.autotune`, on the group as the unit:

1. **profile** (:func:`profilers.sharded.profile_sharded`): a step under FSDP's own path; per
   group, each config's reduce-scatter timed on the group's real gradient rows, and its error
   against the exact sum on them;
2. **accuracy trial** (:class:`advisor.tuning.accuracy.AccuracyTrial`): fp32 twice in two batch
   orders from the current weights, on *shadows*: a sharded model cannot be deep-copied, so
   ``build()`` makes a fresh one of the same architecture on every rank, the weights and the
   optimizer's state are copied into it, and the plan's reduce-scatters installed on it.  The
   uniform lossy plans are trialled first; the budget is the largest error of one that kept up
   with fp32 (else the 16-bit cast's);
3. **search** (:func:`policies.sharded.search_sharded`) on the performance model
   (:class:`advisor.perfmodel.sharded.ShardedModel`) within that budget;
4. **measure** live (:func:`advisor.tuning.live.measure_sharded_plans`): FSDP's own fp32
   reduce-scatter, the exact fp32 all-to-all (gloo's own moves about twice the bytes, so the
   speed-ups claimed are against the better of the two), the 16-bit cast and the best plans,
   in interleaved rounds on the model itself, more while the decision is unresolved;
5. **decide** (:func:`advisor.tuning.steps.decide_time_to_accuracy`): a compressed plan only
   when the trial proves it within the tolerance and its time-to-accuracy speed-up beats the
   best baseline at its 95% lower bound;
6. **install** (:func:`advisor.runtime.sharded.install_sharded`).

The model and the optimizer end with the weights and state they began with.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from advisor.core.documents import VersionedDocument, check_int
from advisor.runtime import Plan
from advisor.runtime.sharded import EXACT_FP32, SHARDED_CONFIGS, install_sharded, sharded_groups
from advisor.tuning.accuracy import AccuracyTrial, AccuracyTrialReport, Evaluator, TrialArm, check_evaluate
from advisor.tuning.data import BatchStream, draw_on_every_rank, set_aside_on_every_rank
from advisor.tuning.live import LossFn, measure_sharded_plans
from advisor.tuning.results import PlanEvidence, plan_evidence
from advisor.tuning.steps import (
    DEFAULT_TRIAL_SHARE,
    RETIME_LONGER,
    Arm,
    check_trial_budget,
    decide_time_to_accuracy,
    retimer,
    runoff_timer,
    settled,
    trial_budget,
    unprovable,
)
from policies import accuracy_gate as gate
from policies.do_no_harm import CANDIDATE, FP32, SIXTEEN_BIT, LiveMeasurement, Retiming, step_speedup
from policies.sharded import ShardedProblem, search_sharded
from profilers.sharded import ShardedProfile, check_sharded_configs, profile_sharded
from profilers.training_state import clone_optimizer, preferred_sixteen_bit

SHARDED_RESULT_KIND = "compression-advisor/sharded-autotune-result"
#: batches the profile and the live measurement cycle through
TIMING_BATCHES = 4
#: the arm labels of the two fp32 baselines
NATIVE, EXACT = "fp32", "fp32, exact all-to-all"


@dataclass
class ShardedAutotuneResult(VersionedDocument):
    """What :func:`autotune_sharded` profiled, trialled, measured and chose, and why."""

    what = "sharded autotune result"
    KIND = SHARDED_RESULT_KIND
    #: 2: the chosen plan's step speed-up measured again after the race (``retimed``)
    VERSION = 2
    REDO = "run autotune_sharded again with this version"

    recommendation: str
    description: str
    compress: bool
    reason: str
    plan: dict
    profile: ShardedProfile
    measured: list[LiveMeasurement]
    evidence: list[PlanEvidence]
    predicted_s: dict[str, float]
    budget: float | None
    budget_reason: str
    accuracy: AccuracyTrialReport | None = None
    seconds: dict[str, float] = field(default_factory=dict)
    #: per rank: the sharded parameters' bytes and the installed plan's residuals' (error feedback)
    memory: dict[str, int] = field(default_factory=dict)
    #: every proven plan's step speed-up measured again after the race chose it
    retimed: list[Retiming] = field(default_factory=list)
    kind: str = SHARDED_RESULT_KIND
    version: int = 2

    def installed_plan(self) -> Plan:
        return Plan.from_dict(self.plan)

    def summary(self) -> list[str]:
        """The advice and every measured plan's evidence, a line each."""
        lines = [f"advice: {self.description} ({self.reason})"]
        if self.memory.get("residual_bytes"):
            lines.append(f"error feedback keeps {self.memory['residual_bytes'] / 2**20:.1f} MiB of residuals a rank, "
                         f"against {self.memory['sharded_parameter_bytes'] / 2**20:.1f} MiB of sharded parameters")
        for e in self.evidence:
            tta = (f", to accuracy {e.time_to_accuracy:.2f}x ({e.tta_low:.2f}-{e.tta_high:.2f})"
                   if e.time_to_accuracy is not None else "")
            status = f" [{e.status}]" if e.status else ""
            median = next(m.median_s for m in self.measured if m.label == e.label)
            lines.append(f"  {e.label}: {median * 1e3:.1f} ms/step, {e.step_speedup:.2f}x per step "
                         f"({e.step_low:.2f}-{e.step_high:.2f}{', re-timed' if e.retimed else ''}){tta}{status}")
        for r in self.retimed:
            lines.append(f"  re-timed after the race: {r.label} beside {r.baseline}, the two alone in {len(r.plan_s)} "
                         f"rounds of {r.steps} steps: {r.speedup:.2f}x per step ({r.low:.2f}-{r.high:.2f}); the race "
                         f"had said {r.race_speedup:.2f}x")
        return lines


def sharded_shadows(model: torch.nn.Module, optimizer: torch.optim.Optimizer, build: Callable[[], torch.nn.Module],
                    group=None) -> Callable[[Plan | None], TrialArm]:
    """The accuracy trial's arms for a sharded model: ``build()`` (a fresh sharded model of the
    same architecture, every rank), the current weights and optimizer state copied in, and the
    plan's reduce-scatters installed (``None``: FSDP's own)."""
    shapes = {n: tuple(t.shape) for n, t in model.state_dict().items()}

    def make(plan: Plan | None) -> TrialArm:
        shadow = build()
        theirs = {n: tuple(t.shape) for n, t in shadow.state_dict().items()}
        if theirs != shapes:
            differ = sorted(set(theirs) ^ set(shapes)) or [n for n in shapes if theirs[n] != shapes[n]]
            raise ValueError(f"build() made a model unlike the one being tuned (they differ in {differ[:3]}); it must "
                             "return a fresh model of the same architecture, sharded the same way")
        shadow.load_state_dict(model.state_dict())
        opt = clone_optimizer(optimizer, model, shadow)
        if plan is not None:
            install_sharded(shadow, plan, group)
        return TrialArm(shadow, shadow, opt, lambda: None)

    return make


def autotune_sharded(
    model: torch.nn.Module,
    loss_fn: LossFn,
    batches: Iterable[Any],
    optimizer: torch.optim.Optimizer | None = None,
    *,
    build: Callable[[], torch.nn.Module] | None = None,
    expected_steps: int | None = None,
    trial_share: float = DEFAULT_TRIAL_SHARE,
    tolerance: float = gate.DEFAULT_TOLERANCE,
    candidates: Sequence[str] = SHARDED_CONFIGS,
    evaluate: Evaluator | None = None,
    held_out: Sequence[Any] | None = None,
    metric: str = "loss",
    accuracy_trial: bool = True,
    trial_s: float | None = None,
    trial_options: Mapping[str, Any] | None = None,
    top: int = 2,
    rounds: int = 3,
    max_rounds: int = 8,
    steps: int = 3,
    install_plan: bool = True,
    group=None,
    progress: Callable[[str], None] | None = None,
) -> ShardedAutotuneResult:
    """Find, prove and install a reduce-scatter per ``fully_shard`` group; every rank calls it
    before the first training step (see the module doc).

    Args:
        model: the user's model, sharded with ``fully_shard`` (each block, then the root).
        loss_fn: ``loss_fn(model, batch) -> loss``.
        batches: this rank's training batches: a list or any iterable (a DataLoader).
        optimizer: the training optimizer (the trial steps clones of it).
        build: ``build() -> model``: a fresh sharded model of the same architecture, for the
            accuracy trial's shadows (its weights are overwritten).  Needed for the trial.
        expected_steps, trial_share, tolerance, evaluate, held_out, metric, trial_s,
        trial_options: the accuracy trial, as in :func:`advisor.autotune`.
        candidates: configs a group may run (allowed: ``advisor.runtime.sharded.SHARDED_CONFIGS``).
        accuracy_trial: False decides on speed per step alone (the result says so).
        top, rounds, max_rounds, steps: how many searched plans are measured live, in how many
            interleaved rounds (up to ``max_rounds`` while unresolved) of how many steps.
        install_plan: install the advice on ``model``.

    Returns:
        A :class:`ShardedAutotuneResult` (``result.to_json()``, ``result.summary()``).

    Raises:
        ValueError: a bad argument (before any work), or a ``build`` that makes another model,
            on every rank.
        TypeError: FSDP1, or a model without ``fully_shard``.
    """
    labels = check_sharded_configs(candidates)
    for name, value, minimum in (("top", top, 1), ("rounds", rounds, 2), ("steps", steps, 1)):
        check_int(name, value, minimum)
    check_int("max_rounds", max_rounds, rounds)
    check_trial_budget(expected_steps, trial_share, tolerance)
    check_evaluate(evaluate)
    gated = accuracy_trial and optimizer is not None
    if gated and not callable(build):
        raise ValueError("the accuracy trial trains shadows of the sharded model, which FSDP cannot deep-copy: pass "
                         "build= (a function returning a fresh sharded model of the same architecture), or "
                         "accuracy_trial=False to decide on speed alone")
    sharded_groups(model)  # refuses FSDP1 and unsharded models before any work
    say = progress or (lambda msg: None)
    t_start = time.perf_counter()
    stream = BatchStream(batches)
    set_aside_on_every_rank(stream, 0 if evaluate is not None or held_out else None, group)
    draw_on_every_rank(stream, TIMING_BATCHES, group)
    timing = stream.head(TIMING_BATCHES)

    # 1. profile
    say("profiling the sharded groups")
    profile = profile_sharded(model, loss_fn, timing, optimizer, labels, group=group)
    t_profiled = time.perf_counter()

    # 2. the accuracy trial, and the budget it earns
    problem = ShardedProblem(profile, labels)
    sixteen = sixteen_bit_of(problem, optimizer)
    trial, verdicts = None, {}
    if gated:
        trial = AccuracyTrial(model, loss_fn, stream, optimizer, evaluate=evaluate, held_out=held_out, metric=metric,
                              tolerance=tolerance, **trial_budget(expected_steps, trial_share, trial_s),
                              arms_expected=2 + len(labels) + top, group=group, progress=say,
                              shadows=sharded_shadows(model, optimizer, build, group), **dict(trial_options or {}))
        say("accuracy trial: fp32 twice, in two batch orders")
        trial.start()
    problem.budget, budget_reason = _earn_budget(problem, trial, verdicts, sixteen)
    t_trialled = time.perf_counter()

    # 3. search, and the arms to measure: both fp32 paths, the 16-bit cast, the best plans
    arms = sharded_arms(problem, search_sharded(problem, top), sixteen)

    # 4. measure live, interleaved, on the model itself
    t_measuring = time.perf_counter()
    say(f"measuring {len(arms)} plans live, {rounds} interleaved rounds (up to {max_rounds} while unresolved)")

    def measurements(rounds_s: Mapping[str, list[float]]) -> list[LiveMeasurement]:
        return [LiveMeasurement(label, arms[label].kind, list(r),
                                None if math.isnan(arms[label].predicted_s) else arms[label].predicted_s,
                                arms[label].description) for label, r in rounds_s.items() if r]

    measure = sharded_measurer(model, loss_fn, timing, optimizer, group, say)
    rounds_s = measure(arms, {label: steps for label in arms}, rounds, max_rounds, lambda r: settled(measurements(r)))
    measured = measurements(rounds_s)
    t_measured = time.perf_counter()

    # 5. decide
    if trial is not None:
        def judge(decision):
            arm = arms[decision.chosen]
            return verdict_of(trial, verdicts, problem, decision.chosen, arm.plan, arm.kind, arm.description)
    elif accuracy_trial:
        judge = unprovable("no optimizer was given, so no accuracy trial could run; pass the training optimizer")
    else:
        judge = None
    retimings: list[Retiming] = []
    longer = lambda arm: RETIME_LONGER * steps  # noqa: E731
    retime = retimer(measure, arms, turn=longer, max_rounds=max_rounds, say=say, record=retimings)
    runoff = runoff_timer(measure, arms, turn=longer, max_rounds=max_rounds, say=say, record=retimings)
    decision, checked, _ = decide_time_to_accuracy(measured, judge, group=group,
                                                   retime=retime if judge is not None else None, runoff=runoff)
    t_decided = time.perf_counter()
    retime_s = sum(r.seconds for r in retimings)

    # 6. install
    keep_fsdp_unless_exact_is_faster(decision, measured)
    plan, description = arms[decision.chosen].plan, arms[decision.chosen].description
    plan = Plan.from_dict({**plan.to_dict(), "metadata": {**plan.metadata, "advisor": "autotune_sharded",
                                                          **({"accuracy": checked} if checked else {})}})
    # plan none without the exact all-to-all installs nothing: FSDP's own path runs
    installed = install_sharded(model, plan, group) if install_plan else []
    reason = decision.reason if accuracy_trial else decision.reason + "; accuracy_trial=False: decided on speed alone"
    return ShardedAutotuneResult(
        recommendation=decision.chosen, description=description, compress=decision.compress, reason=reason,
        plan=plan.to_dict(), profile=profile, measured=measured,
        evidence=plan_evidence(measured, decision, verdicts),
        predicted_s={label: a.predicted_s for label, a in arms.items() if not math.isnan(a.predicted_s)},
        budget=problem.budget, budget_reason=budget_reason,
        accuracy=trial.report() if trial is not None else None,
        memory=_memory(model, installed), retimed=retimings,
        seconds={"profile": t_profiled - t_start,
                 "accuracy": (t_trialled - t_profiled) + (t_decided - t_measured) - retime_s,
                 "measure": t_measured - t_measuring, "retime": retime_s, "total": time.perf_counter() - t_start})


def sharded_measurer(model, loss_fn, batches, optimizer, group=None, say=None):
    """``measure(arms, steps, rounds, max_rounds, settled)``: the arms given, interleaved on the model
    itself (:func:`advisor.tuning.live.measure_sharded_plans`); the race's, and the re-timing's
    (:func:`advisor.tuning.steps.retimer`)."""
    def measure(pair: Mapping[str, Arm], steps: Mapping[str, int], rounds: int, max_rounds: int, settled_when):
        return measure_sharded_plans(model, loss_fn, batches, optimizer, {k: a.plan for k, a in pair.items()},
                                     rounds=rounds, steps=dict(steps), max_rounds=max_rounds, settled=settled_when,
                                     group=group, progress=say)
    return measure


def sharded_arms(problem: ShardedProblem, found: Sequence[np.ndarray], sixteen: str | None) -> dict[str, Arm]:
    """The plans to measure live, by label: FSDP's own fp32 reduce-scatter, the exact fp32 all-to-all
    (gloo's own moves about twice the bytes: claims are against the better), the 16-bit cast, and
    the searched plans that are none of those."""
    none = problem.uniform("none")
    arms = {NATIVE: Arm(NATIVE, FP32, Plan.uniform("none", warmup_steps=0), none, "fp32 (FSDP's own reduce-scatter)",
                        float(problem.predict(none)[0])),
            EXACT: Arm(EXACT, FP32, Plan.uniform("none", warmup_steps=0, metadata={EXACT_FP32: "all-to-all"}), none,
                       "fp32 (exact all-to-all reduce-scatter)", float("nan"))}
    if sixteen is not None:
        cast = problem.uniform(sixteen)
        arms[sixteen] = Arm(sixteen, SIXTEEN_BIT, Plan.uniform(sixteen, warmup_steps=0), cast, f"{sixteen} everywhere",
                            float(problem.predict(cast)[0]))
    baselines = {problem.uniform(c).tobytes() for c in ("none", sixteen) if c is not None}
    for choices in found:
        if choices.tobytes() not in baselines:
            description = problem.describe(choices)
            arms[description] = Arm(description, CANDIDATE, problem.plan(choices, warmup_steps=0), choices,
                                    description, float(problem.predict(choices)[0]))
    return arms


def keep_fsdp_unless_exact_is_faster(decision, measured: Sequence[LiveMeasurement]) -> None:
    """Where the decision is the exact all-to-all, keep FSDP's own path unless the exact one was shown
    faster than it (95% bound): a tie keeps FSDP's code."""
    if decision.chosen != EXACT:
        return
    by_label = {m.label: m for m in measured}
    gain = step_speedup(by_label[NATIVE], by_label[EXACT])
    if not gain.lower() > 1:
        decision.reason += (f"; FSDP's own fp32 reduce-scatter stays: the exact all-to-all was not shown faster "
                            f"than it ({gain.describe()} per step, 95% bounds)")
        decision.chosen = NATIVE


def _memory(model: torch.nn.Module, installed) -> dict[str, int]:
    """This rank's sharded parameters' bytes, and what the installed comms' residuals will hold."""
    local = sum(p.to_local().numel() * p.element_size() if hasattr(p, "to_local") else p.numel() * p.element_size()
                for p in model.parameters())
    residual = sum(g.comm.expected_residual_bytes() for g in installed if hasattr(g.comm, "expected_residual_bytes"))
    return {"sharded_parameter_bytes": int(local), "residual_bytes": int(residual)}


def sixteen_bit_of(problem: ShardedProblem, optimizer) -> str | None:
    """The 16-bit cast to measure: the one predicted faster, the optimizer's preference on a tie (2%)."""
    casts = [c for c in ("fp16", "bf16") if c in problem.configs]
    if not casts:
        return None
    preferred = preferred_sixteen_bit(optimizer)
    return min(casts, key=lambda c: float(problem.predict(problem.uniform(c))[0]) * (1 + 0.02 * (c != preferred)))


def verdict_of(trial: AccuracyTrial, verdicts: dict, problem: ShardedProblem, label: str, plan: Plan, kind: str,
             description: str):
    """The trial's verdict on ``plan`` (remembered by label; the fp32 arms need none)."""
    if label not in verdicts:
        trial_kind = gate.SIXTEEN_BIT if kind == SIXTEEN_BIT else gate.CANDIDATE
        choices = _choices_of(problem, plan)
        verdicts[label] = trial.trial(label, plan, trial_kind, description,
                                      float(problem.fidelity_error(choices)[0]) if choices is not None else None)
    return verdicts[label]


def _choices_of(problem: ShardedProblem, plan: Plan) -> np.ndarray | None:
    try:
        return np.array([problem.configs.index(plan.config_for(g.parameters[0]).label)
                         for g in problem.profile.groups], dtype=int)
    except ValueError:
        return None


def _earn_budget(problem: ShardedProblem, trial: AccuracyTrial | None, verdicts: dict,
                 sixteen: str | None) -> tuple[float, str]:
    """The largest error of a uniform lossy plan that kept up with fp32 in the trial, else the 16-bit cast's.

    Without a trial, the 16-bit cast's error: nothing lossier can be proven.
    """
    floor = float(problem.fidelity_error(problem.uniform(sixteen or "none"))[0])
    if trial is None:
        return floor, f"no accuracy trial: the error of {sixteen or 'fp32'} everywhere"
    report = trial.report()
    lossy = sorted((c for c in problem.configs if c not in ("none", "fp16", "bf16")),
                   key=lambda c: float(problem.fidelity_error(problem.uniform(c))[0]))
    earned, proven = floor, None
    for config in lossy:
        label = f"{config} everywhere"
        arm = verdict_of(trial, verdicts, problem, label, Plan.uniform(config, warmup_steps=0), CANDIDATE, label)
        if not arm.accepted:
            break
        earned, proven = float(problem.fidelity_error(problem.uniform(config))[0]), config
    if proven is not None:
        return earned, (f"earned: the error of {proven} everywhere, the most distorting uniform plan that kept up "
                        f"with fp32 in a {report.steps}-step trial")
    return floor, (f"earned: no uniform lossy plan was proven in a {report.steps}-step trial"
                   + ("" if report.powered else " (not powered)") + f", so the budget is {sixteen or 'fp32'}'s error")

