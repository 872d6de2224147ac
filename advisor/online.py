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
3. **trial**: each baseline (fp32 through the hook, 16-bit) and each top plan trains for
   ``trial_steps`` steps; their step times (slowest rank) decide, under the do-no-harm rule.
4. **watch** (GraVAC-style): every ``watch_every`` steps the compression gain
   ``||C(g)|| / ||g||`` of each compressed segment is measured on that step's gradients,
   averaged over ranks and compared with the gain measured right after the decision; a
   segment whose gain fell below ``backoff`` times that reference moves to the next less
   compressing config (more bytes on the wire), down to fp16 and fp32.  Every change is
   logged and kept in :attr:`OnlineTuner.events`.

All decisions are made from all-reduced numbers and rank 0's choices are broadcast, so
every rank changes plans at the same step.  ``wrap(..., plan=...)`` skips 1-3 and only
watches the given plan.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from .compressors import SegmentLayout, parse
from .compressors.registry import CompressorConfig
from .runtime import Plan, install
from .runtime.simulate import SimulatedRanks
from .schema import check_int

log = logging.getLogger("advisor.online")

OBSERVE, TRIAL, WATCH = "observe", "trial", "watch"


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
                 plan: Plan | None = None, group=None) -> None:
        from .autotuning import DEFAULT_CANDIDATES

        if not isinstance(ddp, DistributedDataParallel):
            raise TypeError(f"wrap needs a DistributedDataParallel model, got {type(ddp).__name__}")
        for name, value, minimum in (("observe_steps", observe_steps, 3), ("trial_steps", trial_steps, 2),
                                     ("top", top, 1), ("trials", trials, 1), ("watch_every", watch_every, 1)):
            check_int(name, value, minimum)
        if not 0 < backoff <= 10:
            raise ValueError(f"backoff={backoff!r}; allowed: 0 < backoff <= 10 (a fraction of the reference gain)")
        self.candidates = [parse(c).label for c in (candidates or DEFAULT_CANDIDATES)]
        self.ddp, self.optimizer, self.group = ddp, optimizer, group
        self.observe_steps, self.trial_steps, self.top, self.trials = observe_steps, trial_steps, top, trials
        self.watch_every, self.backoff, self.budget = watch_every, backoff, budget
        self.world = dist.get_world_size(group) if dist.is_initialized() else 1
        self.step = 0
        self.events: list[TunerEvent] = []
        self.phase = WATCH if plan is not None else OBSERVE
        self.hook = install(ddp, plan if plan is not None else Plan.uniform("none", warmup_steps=0), group=group)
        self._handles = [ddp.register_forward_pre_hook(self._on_forward_start),
                         ddp.register_forward_hook(self._on_forward_end)]
        self._starts: list[float] = []
        self._forward: list[float] = []
        self._forward_end = 0.0
        self._ready_runs: list[dict[str, float]] = []
        self._ready: dict[str, float] = {}
        self._grads: dict[tuple[str, ...], list[torch.Tensor]] = {}
        self._trial_queue: list[tuple[str, Plan, str]] = []
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
        if self.phase == OBSERVE:
            self._start_observing()
        else:
            self._watch_countdown = 3  # reference gain on step 2, after DDP's bucket rebuild
            self._note("watch", f"watching the given plan {plan.digest()}")
        if optimizer is not None:
            self._handles.append(optimizer.register_step_pre_hook(self._optimizer_start))
            self._handles.append(optimizer.register_step_post_hook(self._optimizer_end))

    # --- bookkeeping -----------------------------------------------------------------
    def _note(self, what: str, detail: str) -> None:
        self.events.append(TunerEvent(self.step, what, detail))
        log.info("step %d: %s: %s", self.step, what, detail)

    def _optimizer_start(self, *args) -> None:
        self._opt_t0 = time.perf_counter()

    def _optimizer_end(self, *args) -> None:
        if self.phase == OBSERVE:
            self._optimizer_times.append(time.perf_counter() - self._opt_t0)

    @property
    def plan(self) -> Plan:
        return self.hook.plan

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

    def _on_forward_end(self, module, args, output) -> None:
        if torch.is_grad_enabled() and module.training:
            self._forward_end = time.perf_counter()
            if self.phase == OBSERVE and self._starts:
                self._forward.append(self._forward_end - self._starts[-1])

    # --- the driver: every training forward ----------------------------------------------
    def _on_forward_start(self, module, args) -> None:
        if not (torch.is_grad_enabled() and module.training):
            return  # evaluation passes are not training steps
        now = time.perf_counter()
        if self._ready:
            self._ready_runs.append(dict(self._ready))
            self._ready.clear()
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
        from profilers.cluster import _environment, _slowest_kernels
        from profilers.compute import copy_rate, ddp_buckets, layer_costs, layer_of, slowest
        from profilers.fidelity import fidelity_of
        from profilers.kernels import profile_kernels
        from profilers.network import profile_network, reduction_dtypes_of
        from profilers.profile import ClusterProfile, ComputeProfile, ParameterTiming

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
        from profilers.profile import Bucket

        shapes = dict((n, p) for n, p in self.ddp.module.named_parameters())
        return [Bucket(i, list(names), sum(shapes[n].numel() for n in names)) for i, names in enumerate(self._grads)]

    def _tune(self) -> None:
        from policies.optuna_search import OptunaPolicy
        from policies.problem import TuningProblem
        from profilers.profile import ClusterProfile

        from .autotuning import _broadcast, _rank

        t0 = time.perf_counter()
        self._stop_observing()
        profile = self._profile()
        profile = ClusterProfile.from_dict(_broadcast(profile.to_dict(), self.group))
        problem = TuningProblem.from_profile(profile, self.candidates, budget=self.budget)
        found = None
        if _rank(self.group) == 0:
            found = OptunaPolicy(n_trials=self.trials).search(problem)
        found = _broadcast(found, self.group)
        queue = [("fp32", Plan.uniform("none", warmup_steps=0), "fp32")]
        queue += [(c, Plan.uniform(c, warmup_steps=0), "16-bit") for c in ("fp16", "bf16") if c in problem.configs]
        seen = {problem.uniform(c)[0].tobytes() for c in problem.baselines()}
        for choices in found.top(self.top):
            if choices.tobytes() in seen:
                continue
            seen.add(choices.tobytes())
            label = problem.describe(choices)
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
        if self._trial_count > 1:  # the first step under a new plan warms it up
            self._trial_times[self._current_trial].append(now - self._last_start)
        self._last_start = now
        if self._trial_count <= self.trial_steps:
            return
        if self._trial_queue:
            self._next_trial(now)
            return
        self._decide()

    def _decide(self) -> None:
        from policies.do_no_harm import LiveMeasurement, decide

        from .autotuning import _broadcast
        from profilers.compute import slowest

        labels = list(self._trial_times)
        # each trial is one round here: its per-step spread stands in for the noise;
        # medians and spreads share one collective
        merged = slowest([statistics.median(self._trial_times[label]) for label in labels]
                         + [statistics.pstdev(self._trial_times[label]) for label in labels], self.group)
        medians, spread = merged[: len(labels)], merged[len(labels):]
        measured = [LiveMeasurement(label, self._trial_kind[label], [max(1e-9, m - s), m, m + s])
                    for label, m, s in zip(labels, medians, spread)]
        decision = _broadcast(decide(measured), self.group)
        self.hook.set_plan(self._trial_plans[decision.chosen], reason=f"online decision: {decision.chosen}")
        self.phase = WATCH
        self._reference_gain.clear()
        self._watch_countdown = 1  # measure the reference gain on the next step
        self._note("decided", decision.reason)

    # --- phase 4: watch -----------------------------------------------------------------
    def _watch_step(self) -> None:
        if self._watch_next:
            self._finish_watch()
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
            if ref is not None and gain < self.backoff * ref:
                backoffs[names] = (gain, ref)
        if backoffs:
            self._back_off(backoffs)

    def _back_off(self, backoffs) -> None:
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


def wrap(ddp_model: DistributedDataParallel, optimizer=None, **kwargs) -> OnlineTuner:
    """Autotune ``ddp_model`` online during the first steps of the user's own loop; see the module doc.

    Call on every rank before the first training step.  Keyword arguments: see
    :class:`OnlineTuner` (``observe_steps``, ``trial_steps``, ``top``, ``watch_every``,
    ``backoff``, ``candidates``, ``budget``, ``plan`` to only watch a given plan).
    """
    return OnlineTuner(ddp_model, optimizer, **kwargs)
