"""Autotune online, inside the user's unchanged training loop, then keep watching.

::

    tuner = advisor.wrap(ddp_model, optimizer)      # before the first step
    for x, y in loader:                             # the user's loop, unchanged
        optimizer.zero_grad(); loss_fn(ddp_model(x), y).backward(); optimizer.step()

The wrapper installs the compression hook (plan ``none`` at first) and drives itself from
the model's forward calls, which every rank makes at the same step:

1. **observe** (``observe_steps``): real training steps with fp32 all-reduce; gradient
   ready times (post-accumulate hooks), forward/backward/step times and each bucket's
   local gradients are recorded.
2. **profile and search** (at the start of the next step, on every rank): the compute
   profile comes from those observations, the network and compressor kernels are
   measured briefly, fidelity is replayed on the captured gradients; rank 0 searches and
   broadcasts the top plans.
3. **trial**: each baseline (fp32 through the hook, 16-bit) and each top plan trains until
   the median of its step times is known to ``trial_precision`` (its standard error, from
   the median absolute deviation; at least ``trial_steps`` and at most ``max_trial_steps``
   timed steps, after ``TRIAL_SETTLE`` warm-up steps and without outliers beyond five
   deviations); the medians (slowest rank) decide under the do-no-harm rule, and the event
   says how far the margin was from the noise.  Where ``loss_fn`` and ``batches`` are given
   (and the optimizer), the plan that wins on speed must also pass the accuracy gate, the
   same paired trial as :func:`advisor.autotune`'s (:mod:`advisor.tuning.accuracy`): shadow copies
   from the current weights, with a clone of the optimizer, next to fp32 on those batches;
   a rejected plan leaves the race and the next one is judged, down to fp32.
4. **watch** (GraVAC-style): every ``watch_every`` steps the compression gain
   ``||C(g)|| / ||g||`` of each compressed segment is measured on that step's gradients,
   averaged over ranks and compared with the gain measured right after the decision; a
   segment whose gain fell below ``backoff`` times that reference moves to the next less
   compressing config (more bytes on the wire), down to fp16 and fp32.
5. **loss watch**: where the loop reports its loss (``tuner.record_loss(loss)``, one line),
   the losses of the uncompressed steps (observe, the baseline trials, or ``trend_steps``
   fp32 steps before a given plan) fit a trend ``a + b·ln(step)``; every ``watch_every``
   steps under compression, the window's mean loss (over ranks) is compared with the
   trend's prediction, and two windows in a row above it by more than ``loss_z`` standard
   errors back every compressed parameter off one level.  Every change is logged and kept
   in :attr:`OnlineTuner.events`.

All decisions are made from all-reduced numbers and rank 0's choices are broadcast, so
every rank changes plans at the same step.  ``wrap(..., plan=...)`` skips 1-3 and only
watches the given plan.
"""

from __future__ import annotations

import contextlib
import logging
import math
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from advisor.compressors import SegmentLayout, parse
from advisor.compressors.registry import CompressorConfig
from advisor.core.collectives import from_rank_zero, rank, slowest
from advisor.core.documents import check_int
from advisor.runtime import Plan, install
from advisor.runtime.simulate import SimulatedRanks
from advisor.tuning.accuracy import AccuracyTrial, check_evaluate
from advisor.tuning.autotune import DEFAULT_CANDIDATES, LazyTrial, decide_for_accuracy
from policies import accuracy_gate as gate
from policies.do_no_harm import LiveMeasurement
from policies.optuna_search import OptunaPolicy
from policies.problem import BASELINES, DEFAULT_REFERENCE, SIXTEEN_BIT, TuningProblem
from profilers.cluster import _environment, _slowest_kernels
from profilers.compute import copy_rate, ddp_buckets, layer_costs, layer_of
from profilers.fidelity import fidelity_of
from profilers.kernels import profile_kernels
from profilers.network import NETWORK_REUSE_S, profile_network, reduction_dtypes_of
from profilers.profile import Bucket, ClusterProfile, ComputeProfile, ParameterTiming
from profilers.training_state import preferred_sixteen_bit

log = logging.getLogger("advisor.tuning.online")

OBSERVE, TRIAL, WATCH = "observe", "trial", "watch"
#: steps under a new plan left out of its timing (the first ones pay for buffers and caches)
TRIAL_SETTLE = 2


def robust_median(times: Sequence[float]) -> tuple[float, float]:
    """(median, relative standard error of the median) of step times, outliers beyond 5 MADs dropped.

    The standard error of a median is about 1.25 * 1.4826 * MAD / sqrt(n) for normal noise.
    """
    med = statistics.median(times)
    mad = statistics.median(abs(t - med) for t in times)
    kept = [t for t in times if abs(t - med) <= 5 * mad] if mad > 0 else list(times)
    med = statistics.median(kept)
    mad = statistics.median(abs(t - med) for t in kept)
    return med, 1.25 * 1.4826 * mad / math.sqrt(len(kept)) / med if med > 0 else 0.0


def loss_trend(steps: Sequence[float], losses: Sequence[float]) -> tuple[float, float, float]:
    """Least-squares ``loss = a + b·ln(step + 1)`` and the residuals' standard deviation: (a, b, sigma)."""
    x = [math.log(s + 1) for s in steps]
    n = len(x)
    mx, my = sum(x) / n, sum(losses) / n
    sxx = sum((xi - mx) ** 2 for xi in x)
    b = sum((xi - mx) * (yi - my) for xi, yi in zip(x, losses)) / sxx if sxx > 0 else 0.0
    b = min(b, 0.0)  # a trend that rises is no promise: hold the level instead
    a = my - b * mx
    resid = [yi - (a + b * xi) for xi, yi in zip(x, losses)]
    sigma = math.sqrt(sum(r * r for r in resid) / max(1, n - 2))
    return a, b, sigma


@dataclass
class TunerEvent:
    step: int
    what: str
    detail: str


class OnlineTuner:
    """State of the online autotuner on one rank; construct through :func:`wrap`."""

    def __init__(self, ddp: DistributedDataParallel, optimizer=None, *, candidates: Sequence[str] | None = None,
                 observe_steps: int = 8, trial_steps: int = 4, top: int = 2, trials: int = 500,
                 watch_every: int = 50, backoff: float = 0.8, budget: float | None = None,
                 plan: Plan | None = None, trial_precision: float = 0.02, max_trial_steps: int | None = None,
                 loss_z: float = 3.0, trend_steps: int = 0, loss_fn=None, batches: Sequence | None = None,
                 evaluate=None, held_out: Sequence | None = None, metric: str = "loss", trial_s: float = 40.0,
                 trial_options: dict | None = None, group=None) -> None:

        if not isinstance(ddp, DistributedDataParallel):
            raise TypeError(f"wrap needs a DistributedDataParallel model, got {type(ddp).__name__}")
        for name, value, minimum in (("observe_steps", observe_steps, 3), ("trial_steps", trial_steps, 2),
                                     ("top", top, 1), ("trials", trials, 1), ("watch_every", watch_every, 1)):
            check_int(name, value, minimum)
        if backoff is not None and not 0 < backoff <= 10:
            raise ValueError(f"backoff={backoff!r}; allowed: 0 < backoff <= 10 (a fraction of the reference gain), "
                             "or None to watch the loss only")
        if not 0 < trial_precision < 1:
            raise ValueError(f"trial_precision={trial_precision!r}; allowed: 0 < trial_precision < 1 (relative)")
        max_trial_steps = max_trial_steps if max_trial_steps is not None else 2 * trial_steps
        check_int("max_trial_steps", max_trial_steps, trial_steps)
        check_int("trend_steps", trend_steps, 0)
        if not loss_z > 0:
            raise ValueError(f"loss_z={loss_z!r}; allowed: > 0 standard errors")
        if (loss_fn is None) != (batches is None):
            raise ValueError("the accuracy gate needs both loss_fn and batches (loss_fn(model, batch) -> loss, and "
                             "batches of real training data to train the trial's shadow copies on); pass both, "
                             "or neither to decide on speed alone")
        if batches is not None and optimizer is None:
            raise ValueError("the accuracy gate trains copies of the model with a clone of the training optimizer; "
                             "pass it: wrap(ddp_model, optimizer, loss_fn=..., batches=...)")
        if batches is not None and not list(batches):
            raise ValueError("batches is empty; the accuracy gate needs at least one batch of real training data")
        if not (isinstance(trial_s, (int, float)) and trial_s > 0):
            raise ValueError(f"trial_s={trial_s!r}; allowed: > 0 seconds")
        check_evaluate(evaluate)
        self._gate_args = None if batches is None else dict(
            loss_fn=loss_fn, batches=list(batches), evaluate=evaluate, held_out=held_out, metric=metric,
            time_budget_s=float(trial_s), **dict(trial_options or {}))
        #: the accuracy trial's report, where the gate ran (``loss_fn`` and ``batches`` given)
        self.accuracy = None
        self.candidates = list(dict.fromkeys(parse(c).label for c in (candidates or DEFAULT_CANDIDATES)))
        if budget is None and parse(DEFAULT_REFERENCE).label not in self.candidates:
            # without a budget the reference's error sets it, as in autotune: it must be measured too
            self.candidates.append(parse(DEFAULT_REFERENCE).label)
        self.ddp, self.optimizer, self.group = ddp, optimizer, group
        self.observe_steps, self.trial_steps, self.top, self.trials = observe_steps, trial_steps, top, trials
        self.watch_every, self.backoff, self.budget = watch_every, backoff, budget
        self.trial_precision, self.max_trial_steps, self.loss_z = trial_precision, max_trial_steps, loss_z
        #: (step, loss, under a lossy plan) of every loss the loop reported
        self.losses: list[tuple[int, float, bool]] = []
        self._trend: tuple[float, float, float] | None = None
        self._strikes = 0
        self._pending_plan: Plan | None = plan if trend_steps > 0 else None
        self._trend_steps = trend_steps
        self.world = dist.get_world_size(group) if dist.is_initialized() else 1
        self.step = 0
        self.events: list[TunerEvent] = []
        self.phase = WATCH if plan is not None else OBSERVE
        first = plan if plan is not None and trend_steps == 0 else Plan.uniform("none", warmup_steps=0)
        self.hook = install(ddp, first, group=group)
        self._handles = [ddp.register_forward_pre_hook(self._on_forward_start),
                         ddp.register_forward_hook(self._on_forward_end)]
        self._starts: list[float] = []
        self._forward: list[float] = []
        self._forward_end = 0.0
        self._ready_runs: list[dict[str, float]] = []
        self._ready: dict[str, float] = {}
        self._grads: dict[tuple[str, ...], list[torch.Tensor]] = {}
        self._trial_queue: list[tuple[str, Plan, str]] = []
        self._problem = None
        self._trial_choices: dict = {}
        self._trial_times: dict[str, list[float]] = {}
        self._trial_kind: dict[str, str] = {}
        self._trial_plans: dict[str, Plan] = {}
        self._current_trial: str | None = None
        self._trial_count = 0
        self._last_start = 0.0
        self._reference_gain: dict[str, float] = {}
        self._gains: dict[str, float] = {}
        self._gain_observer = None
        self._watch_next = False
        self._watch_countdown = watch_every
        self._observer = None
        self._grad_handles: list = []
        self._optimizer_times: list[float] = []
        self._opt_t0 = 0.0
        self._in_step = False      # between the optimizer's step pre- and post-hook
        self._closure_step = False  # this step's forward ran inside optimizer.step(closure)
        self._update_marked = False
        if self.phase == OBSERVE:
            self._start_observing()
        else:
            self._watch_countdown = 3 + trend_steps  # reference gain after DDP's bucket rebuild
            self._note("watch", f"watching the given plan {plan.digest()}" + (
                f" after {trend_steps} fp32 steps that set the loss trend" if trend_steps else
                " (no fp32 steps before it: the loss watch has no trend; pass trend_steps=N)"))
        if optimizer is not None:
            self._handles.append(optimizer.register_step_pre_hook(self._optimizer_start))
            self._handles.append(optimizer.register_step_post_hook(self._optimizer_end))

    # --- bookkeeping -----------------------------------------------------------------
    def _note(self, what: str, detail: str) -> None:
        self.events.append(TunerEvent(self.step, what, detail))
        log.info("step %d: %s: %s", self.step, what, detail)

    def _optimizer_start(self, *args) -> None:
        self._opt_t0 = time.perf_counter()
        self._in_step, self._closure_step, self._update_marked = True, False, False

    def _optimizer_end(self, *args) -> None:
        self._in_step = False
        # a closure step's pre-hook fired before its forward: only a marked update start times the update alone
        if self.phase == OBSERVE and (not self._closure_step or self._update_marked):
            self._optimizer_times.append(time.perf_counter() - self._opt_t0)

    def update_starts(self) -> None:
        """Mark the start of the optimizer's update, for loops that call ``optimizer.step(closure)``.

        Lightning (automatic optimization) runs the forward and backward inside the closure, so
        the step's pre-hook fires before them; call this right before the update (the Lightning
        callback does, from ``on_before_optimizer_step``) so the update is timed alone.  Without
        it such steps leave the update's time out of the profile.
        """
        if self._in_step:
            self._opt_t0, self._update_marked = time.perf_counter(), True

    @property
    def plan(self) -> Plan:
        return self.hook.plan

    def record_loss(self, loss) -> None:
        """Report this step's training loss (a float or a scalar tensor); feeds the loss watch.

        Call once per training step on every rank, after the forward pass.
        """
        value = float(loss.detach()) if isinstance(loss, torch.Tensor) else float(loss)
        self.losses.append((self.step - 1, value, self._lossy()))

    def _lossy(self) -> bool:
        """Whether the plan uses a config beyond the baselines: the loss watch follows those."""
        plan = self.hook.plan
        return any(c.label not in BASELINES for c in plan.configs())

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._stop_observing()
        self.hook.close()

    # --- phase 1: observe ------------------------------------------------------------
    def _start_observing(self) -> None:
        named = [(n, p) for n, p in self.ddp.module.named_parameters() if p.requires_grad]

        def stamp(name):
            def record(_param):
                self._ready[name] = time.perf_counter() - self._forward_end
            return record

        self._grad_handles = [p.register_post_accumulate_grad_hook(stamp(n)) for n, p in named]

        def capture(layout: SegmentLayout, grad: torch.Tensor, config) -> None:
            if self.step >= 2:  # after DDP's bucket rebuild
                self._grads.setdefault(layout.names, []).append(grad.detach().clone())

        self._observer = capture
        self.hook.observers.append(capture)

    def _stop_observing(self) -> None:
        for h in self._grad_handles:
            h.remove()
        self._grad_handles = []
        if self._observer is not None and self._observer in self.hook.observers:
            self.hook.observers.remove(self._observer)
        self._observer = None

    # The model's forward may be compiled (torch.compile(ddp)): dynamo must call these hooks, not
    # trace them, since they time, profile and run collectives.
    @torch.compiler.disable
    def _on_forward_end(self, module, args, output) -> None:
        if torch.is_grad_enabled() and module.training:
            self._forward_end = time.perf_counter()
            if self.phase == OBSERVE and self._starts:
                self._forward.append(self._forward_end - self._starts[-1])

    # --- the driver: every training forward ----------------------------------------------
    @torch.compiler.disable
    def _on_forward_start(self, module, args) -> None:
        if not (torch.is_grad_enabled() and module.training):
            return  # evaluation passes are not training steps
        if self.ddp._join_config.enable:  # set by ddp.join(), DDP's Joinable protocol
            raise RuntimeError(
                "wrap cannot tune under ddp.join() (uneven inputs): its decisions are collectives that every rank "
                "must reach at the same step, and a rank that joined early makes no more steps. Tune before the "
                "loop with advisor.autotune, or install a plan (advisor.install): both work under join")
        now = time.perf_counter()
        if self._in_step:
            self._closure_step = True
        if self._ready:
            self._ready_runs.append(dict(self._ready))
            self._ready.clear()
        # the forward may run under the loop's autocast; the tuner's own work (profiling, fidelity
        # replay, gains) is measured in the gradients' dtype, as the hook exchanges them
        with _no_autocast():
            if self.phase == OBSERVE:
                self._starts.append(now)
                if self.step == self.observe_steps:
                    self._tune()
            elif self.phase == TRIAL:
                self._trial_step(now)
            elif self.phase == WATCH:
                self._watch_step()
        self.step += 1

    # --- phase 2: profile and search -----------------------------------------------------
    def _profile(self):

        named = [(n, p) for n, p in self.ddp.module.named_parameters() if p.requires_grad]
        names = [n for n, _ in named]
        runs = self._ready_runs[1:] or self._ready_runs  # the first step includes DDP's set-up
        forward = statistics.median(self._forward[1:] or self._forward)
        backward = statistics.median(max(r.values()) for r in runs)
        optimizer = statistics.median(self._optimizer_times[1:]) if len(self._optimizer_times) > 1 else 0.0
        local = [forward, backward, optimizer, copy_rate(named)]
        local += [statistics.median(r.get(n, backward) for r in runs) for n in names]
        merged = slowest(local, self.group)
        ready = dict(zip(names, merged[4:]))
        buckets = ddp_buckets(self.ddp, None, None) if self._rebuilt() else self._segments_as_buckets()
        shapes = dict((n, p.shape) for n, p in named)
        compute = ComputeProfile(
            forward_s=merged[0], backward_s=merged[1], optimizer_s=merged[2], steps=len(runs),
            parameters=[ParameterTiming(n, layer_of(n), shapes[n].numel(), list(shapes[n]), ready[n]) for n in names],
            layer_backward_s=layer_costs(ready, names), buckets=buckets, copy_s_per_byte=merged[3],
        )
        network = profile_network(group=self.group, budget_s=8.0, max_op_s=0.3, repeats=2,
                                  reuse_within_s=NETWORK_REUSE_S,
                                  reduction_dtypes=reduction_dtypes_of(self.candidates, self.world))
        layouts = [SegmentLayout(tuple(b.parameters), tuple(tuple(shapes[n]) for n in b.parameters)) for b in buckets]
        configs = [c for c in self.candidates if c != "none"]
        kernels = _slowest_kernels(profile_kernels(layouts, configs, world_size=self.world,
                                                   ladder=(1 << 14, 1 << 17, 1 << 20), repeats=3), self.group)
        streams = [self._grads.get(layout.names) or [] for layout in layouts]
        fidelity = fidelity_of(streams, layouts, buckets, configs,
                               steps=len(next(iter(self._grads.values()), [])), group=self.group)
        environment = _environment(self.ddp, self.group, "online, inside the training loop")
        return ClusterProfile(environment=environment, compute=compute, network=network, kernels=kernels,
                              fidelity=fidelity)

    def _rebuilt(self) -> bool:
        return bool(self.ddp._get_ddp_logging_data().get("rebuilt_per_bucket_param_indices"))

    def _segments_as_buckets(self):

        shapes = dict((n, p) for n, p in self.ddp.module.named_parameters())
        return [Bucket(i, list(names), sum(shapes[n].numel() for n in names)) for i, names in enumerate(self._grads)]

    def _tune(self) -> None:

        t0 = time.perf_counter()
        self._stop_observing()
        profile = self._profile()
        profile = ClusterProfile.from_dict(from_rank_zero(profile.to_dict(), self.group))
        problem = TuningProblem.from_profile(profile, self.candidates, budget=self.budget)
        found = None
        if rank(self.group) == 0:
            found = OptunaPolicy(n_trials=self.trials).search(problem)
        found = from_rank_zero(found, self.group)
        queue = [("fp32", Plan.uniform("none", warmup_steps=0), "fp32")]
        # one 16-bit cast: both send the same bytes, and the optimizer decides which keeps more
        # (bf16's range for Adam-like optimizers, fp16's mantissa for SGD)
        casts = [c for c in SIXTEEN_BIT if c in problem.configs]
        preferred = preferred_sixteen_bit(self.optimizer)
        casts = [preferred] if preferred in casts else casts[:1]
        queue += [(c, Plan.uniform(c, warmup_steps=0), "16-bit") for c in casts]
        self._problem = problem
        self._trial_choices = {c: problem.uniform(c)[0] for c, _, kind in queue if kind == "16-bit"}
        seen = {problem.uniform(c)[0].tobytes() for c in problem.baselines()}
        for choices in found.top(self.top):
            if choices.tobytes() in seen:
                continue
            seen.add(choices.tobytes())
            label = problem.describe(choices)
            self._trial_choices[label] = choices
            queue.append((label, problem.plan(choices, warmup_steps=0), "candidate"))
        self._trial_queue = queue
        self._trial_times = {}
        self.phase = TRIAL
        self._grads.clear()
        self._note("profiled", f"profile and search took {time.perf_counter() - t0:.1f} s; trying "
                               f"{len(queue)} plans for {self.trial_steps} steps each")
        self._next_trial(time.perf_counter())

    # --- phase 3: trial ------------------------------------------------------------------
    def _next_trial(self, now: float) -> None:
        label, plan, kind = self._trial_queue.pop(0)
        self._current_trial = label
        self._trial_kind[label] = kind
        self._trial_times[label] = []
        self._trial_plans[label] = plan
        self.hook.set_plan(plan, reason=f"online trial: {label}", verify=False)
        self._last_start = now
        self._trial_count = 0

    def _trial_step(self, now: float) -> None:
        self._trial_count += 1
        times = self._trial_times[self._current_trial]
        if self._trial_count > TRIAL_SETTLE:  # the first steps under a new plan warm it up
            times.append(now - self._last_start)
        self._last_start = now
        if len(times) < self.trial_steps:
            return
        if len(times) < self.max_trial_steps:
            # every rank must agree to go on: the least precise rank decides
            precision = robust_median(times)[1]
            if self.world > 1:
                t = torch.tensor([precision], dtype=torch.float64)
                dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
                precision = float(t)
            if precision > self.trial_precision:
                return
        if self._trial_queue:
            self._next_trial(now)
            return
        self._decide()

    def _decide(self) -> None:

        labels = list(self._trial_times)
        stats = [robust_median(self._trial_times[label]) for label in labels]
        # medians and their standard errors share one collective; the slowest rank sets the pace
        merged = slowest([m for m, _ in stats] + [e for _, e in stats], self.group)
        medians, errors = merged[: len(labels)], merged[len(labels):]
        measured = [LiveMeasurement(label, self._trial_kind[label],
                                    [m * (1 - min(2 * e, 0.99)), m, m * (1 + 2 * e)])
                    for label, m, e in zip(labels, medians, errors)]
        decision, checked, rejected = decide_for_accuracy(measured, self._accuracy_judge(), group=self.group)
        if checked:
            self._note("accuracy", f"{decision.chosen} passed the {self.accuracy.steps}-step paired trial: {checked}")
        elif self.accuracy is not None and decision.kind == "fp32":
            self._note("accuracy", "no plan faster than fp32 passed the paired trial; fp32 stands")
        self.hook.set_plan(self._trial_plans[decision.chosen], reason=f"online decision: {decision.chosen}")
        self.phase = WATCH
        self._reference_gain.clear()
        self._watch_countdown = 1  # measure the reference gain on the next step
        gain = 1 - 1 / decision.gain_vs_best_baseline if decision.gain_vs_best_baseline else 0.0
        noise = decision.margin
        if rejected and not decision.compress:
            sure = f"sure on accuracy: {len(rejected)} faster plan(s) fell behind fp32 in the paired trial"
        elif decision.compress:
            sure = f"sure: {gain:.1%} faster, {gain / max(noise, 1e-9):.1f}x the noise ({noise:.1%})"
        elif gain <= 0:
            sure = f"sure: the best compressed plan is {-gain:.1%} slower"
        else:
            sure = (f"not sure: the best compressed plan is {gain:.1%} faster, within the noise ({noise:.1%}), "
                    "so the baseline stands")
        steps = {label: len(self._trial_times[label]) for label in labels}
        self._note("decided", f"{decision.reason} ({sure}; timed steps per plan: "
                              + ", ".join(f"{k} {v}" for k, v in steps.items()) + ")")

    def _accuracy_judge(self):
        """``judge(decision) -> ArmResult`` of the paired trial from the current weights, or None (no gate).

        The trial starts (its two fp32 arms) only when a plan other than fp32 wins on speed.
        """
        if self._gate_args is None:
            return None

        args = dict(self._gate_args)
        loss_fn, batches = args.pop("loss_fn"), args.pop("batches")
        trial = LazyTrial(AccuracyTrial(self.ddp, loss_fn, batches, self.optimizer, group=self.group,
                                        arms_expected=2 + len(self._trial_plans) - 1, **args),
                          self._problem, lambda msg: log.info("step %d: %s", self.step, msg))

        def judge(decision):
            kind = gate.SIXTEEN_BIT if self._trial_kind[decision.chosen] == "16-bit" else gate.CANDIDATE
            arm = trial.judge(decision.chosen, self._trial_plans[decision.chosen],
                              self._trial_choices[decision.chosen], kind, decision.chosen)
            self.accuracy = trial.trial.report()
            if not arm.accepted:
                self._note("accuracy", f"{decision.chosen} rejected: {arm.reason}")
            return arm

        return judge

    # --- phase 4: watch -----------------------------------------------------------------
    def _watch_step(self) -> None:
        if self._pending_plan is not None and self.step == self._trend_steps:
            self.hook.set_plan(self._pending_plan, reason="the given plan, after the fp32 steps of the loss trend",
                               verify=False)
            self._pending_plan = None
        if self._watch_next:
            self._finish_watch()
            self._check_loss()
        self._watch_countdown -= 1
        if self._watch_countdown <= 0:
            self._begin_watch()
            self._watch_countdown = self.watch_every

    def _begin_watch(self) -> None:
        sim = SimulatedRanks(1)

        def measure_gain(layout: SegmentLayout, grad: torch.Tensor, config: CompressorConfig) -> None:
            if not config.build().lossy:
                return
            plain = CompressorConfig(config.name, dict(config.params), error_feedback=False).build()
            g = grad.detach().clone()
            out = sim.exchange(plain, [g.clone()], layout)[0]
            # per parameter, so the gains survive DDP regrouping parameters into buckets
            for name, before, after in zip(layout.names, layout.views(g), layout.views(out)):
                norm = float(before.norm())
                self._gains[name] = float(after.norm()) / norm if norm > 0 else 1.0

        self._gains = {}
        self._gain_observer = measure_gain
        self.hook.observers.append(measure_gain)
        self._watch_next = True

    def _finish_watch(self) -> None:
        self._watch_next = False
        if self._gain_observer in self.hook.observers:
            self.hook.observers.remove(self._gain_observer)
        keys = sorted(self._gains)
        local = [self._gains[k] for k in keys]
        if self.world > 1:
            # every rank has the same segments; average their gains
            t = torch.tensor(local + [len(keys)], dtype=torch.float64)
            sizes = [torch.zeros(1, dtype=torch.float64) for _ in range(self.world)]
            dist.all_gather(sizes, torch.tensor([float(len(keys))], dtype=torch.float64), group=self.group)
            if len({float(s) for s in sizes}) > 1:
                raise RuntimeError("ranks watched different segments; plans differ between ranks")
            dist.all_reduce(t, group=self.group)
            local = (t[:-1] / self.world).tolist()
        gains = dict(zip(keys, local))
        if not self._reference_gain:
            self._reference_gain = dict(gains)
            if gains:
                by_config: dict[str, list[float]] = {}
                for name, gain in gains.items():
                    by_config.setdefault(self.plan.config_for(name).label, []).append(gain)
                self._note("watch", "reference compression gain (median over parameters) " + ", ".join(
                    f"{c}: {statistics.median(v):.3f}" for c, v in by_config.items()))
            return
        backoffs = {}
        for names, gain in gains.items():
            ref = self._reference_gain.get(names)
            if self.backoff is not None and ref is not None and gain < self.backoff * ref:
                backoffs[names] = (gain, ref)
        if backoffs:
            self._back_off(backoffs)

    def _check_loss(self) -> None:
        """Two watch windows in a row above the uncompressed steps' loss trend: back off one level."""
        if not self._lossy():
            self._strikes = 0
            return
        lossy = [(step, loss) for step, loss, under in self.losses if under]
        window = [(s, v) for s, v in lossy if s > self.step - self.watch_every - 1]
        baseline = [(s, v) for s, v, under in self.losses if not under and s >= 1]
        # every rank takes part in the same collectives, whatever it recorded
        counts = torch.tensor([len(baseline), len(window)], dtype=torch.float64)
        if self.world > 1:
            dist.all_reduce(counts, op=dist.ReduceOp.MIN, group=self.group)
        n_base, n_window = int(counts[0]), int(counts[1])
        if n_base < 4 or n_window < 1:
            return
        if self._trend is None:
            mean = torch.tensor([v for _, v in baseline[-n_base:]], dtype=torch.float64)
            if self.world > 1:
                dist.all_reduce(mean, group=self.group)
                mean /= self.world
            self._trend = loss_trend([s for s, _ in baseline[-n_base:]], mean.tolist())
        a, b, sigma = self._trend
        window = window[-n_window:]
        t = torch.tensor([sum(v for _, v in window) / n_window], dtype=torch.float64)
        if self.world > 1:
            dist.all_reduce(t, group=self.group)
            t /= self.world
        observed = float(t)
        expected = sum(a + b * math.log(s + 1) for s, _ in window) / n_window
        bound = expected + self.loss_z * sigma / math.sqrt(n_window)
        self._strikes = self._strikes + 1 if observed > bound else 0
        if self._strikes < 2:
            return
        self._strikes = 0
        params = [n for n, _ in self.ddp.module.named_parameters()]
        moves = {n: (0.0, 1.0) for n in params if self.plan.config_for(n).label not in ("none",)}
        detail = (f"training loss {observed:.4g} over the last {n_window} steps vs {expected:.4g} expected from the "
                  f"uncompressed steps' trend (bound {bound:.4g}, {self.loss_z:g} standard errors), two windows in "
                  "a row")
        self._note("loss-watch", detail)
        self._back_off(moves, why="the loss fell behind its trend")

    def _back_off(self, backoffs, why: str = "") -> None:
        """``backoffs``: {parameter name: (gain, reference gain)}; one level less compression each."""
        params = dict(self.ddp.module.named_parameters())
        assignments = {n: self.plan.config_for(n).label for n in params}
        moves: dict[tuple[str, str], list[float]] = {}
        for name, (gain, ref) in backoffs.items():
            current = self.plan.config_for(name)
            softer = self._less_compression(current, SegmentLayout((name,), (tuple(params[name].shape),)))
            assignments[name] = softer.label
            moves.setdefault((current.label, softer.label), []).append(gain / ref)
        new_plan = Plan.from_assignments({n: c for n, c in assignments.items() if c != "none"}, warmup_steps=0)
        self.hook.set_plan(new_plan, reason="online back-off", verify=False)
        self._reference_gain.clear()  # measured again under the new plan on the next watch
        if why:
            self._note("back-off", "; ".join(f"{a} -> {b} on {len(r)} parameter(s) ({why})"
                                             for (a, b), r in moves.items()))
            return
        self._note("back-off", "; ".join(
            f"{a} -> {b} on {len(r)} parameter(s) (gain fell to {min(r):.2f}-{max(r):.2f} of its reference; "
            f"threshold {self.backoff:g})" for (a, b), r in moves.items()))

    def _less_compression(self, current: CompressorConfig, layout: SegmentLayout) -> CompressorConfig:
        """The candidate sending the fewest bytes among those sending more than ``current``."""
        def wire(config: CompressorConfig) -> int:
            return sum(w.nbytes for w in config.build().wire(layout, self.world))

        mine = wire(current)
        options = [parse(c) for c in self.candidates]
        more = [c for c in options if wire(c) > mine]
        return min(more, key=wire) if more else parse("none")


def _no_autocast():
    """Autocast off on every device type that has it on (the tuner runs inside the user's forward)."""
    stack = contextlib.ExitStack()
    for device in ("cpu", "cuda"):
        if torch.is_autocast_enabled(device):
            stack.enter_context(torch.autocast(device, enabled=False))
    return stack


def wrap(ddp_model: DistributedDataParallel, optimizer=None, **kwargs) -> OnlineTuner:
    """Autotune ``ddp_model`` online during the first steps of the user's own loop; see the module doc.

    Args:
        ddp_model: the user's DDP model; call on every rank before the first training step.
        optimizer: the training optimizer (timed; cloned by the accuracy gate).
        **kwargs: see :class:`OnlineTuner`: ``observe_steps``, ``trial_steps``, ``top``,
            ``watch_every``, ``backoff``, ``candidates``, ``budget``, ``plan`` (only watch a
            given plan), and for the accuracy gate ``loss_fn``, ``batches``, ``evaluate``,
            ``held_out``, ``metric``, ``trial_s``.

    Returns:
        The :class:`OnlineTuner`: ``tuner.events`` say what it did and why, ``tuner.plan`` is
        the plan in use, ``tuner.record_loss(loss)`` feeds the loss watch.

    Raises:
        TypeError, ValueError: a bad argument, naming it and the allowed values (before any step).
        RuntimeError: at the first forward under ``ddp.join()``, on every rank.
    """
    return OnlineTuner(ddp_model, optimizer, **kwargs)
