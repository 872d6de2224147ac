"""Tune a sharded (FSDP2) model online, inside the user's unchanged training loop.

::

    tuner = advisor.wrap_sharded(model, optimizer)          # before the first step
    for batch in loader:                                     # the loop, unchanged
        optimizer.zero_grad(); loss_fn(model, batch).backward(); optimizer.step()

Driven from the model's forward calls, which every rank makes at the same step:

1. **observe** (``observe_steps`` after one warm-up step): FSDP's own reduce-scatters, their
   rows captured (:class:`profilers.sharded.RowCapture`) and the steps timed;
2. **profile and search** (at the start of the next step, every rank): each config's
   reduce-scatter timed and judged on the captured rows, rank 0's profile is everyone's, the
   search (:func:`policies.sharded.search_sharded`);
3. **race**: FSDP's own fp32 reduce-scatter, the exact all-to-all, the 16-bit cast and the best
   plans take turns on the loop's steps in interleaved rounds (the DDP tuner's
   :class:`~advisor.tuning.online.trial.Race`, each plan switched in by
   :class:`advisor.runtime.sharded.ShardedSwitch`), paired and stopped once decided;
4. **decide** (:func:`advisor.tuning.steps.decide_time_to_accuracy`) and keep the plan; a
   compressed plan the trial proves first races the best baseline alone on the next steps, in
   longer turns (:class:`~advisor.tuning.online.trial.OnlineRetimes`), and its time to
   accuracy is built on that figure, not on the race's;
5. **re-trial** a compressed plan kept, where the gate has its data: the paired trial again from
   the current weights on fresh shadows, as often as ``retrial_share`` of the training time
   pays for (:class:`~advisor.tuning.online.watch.RetrialClock`, as :func:`advisor.wrap`
   schedules its own); one that has fallen behind fp32 beyond the tolerance backs off on every
   rank to the 16-bit cast that raced (else the optimizer's cast among the candidates, else
   FSDP's own reduce-scatter), and an event says so with the numbers.  Where the first trial
   could not prove the plan that won the race (too short to be powered), those slots prove it
   instead, as :func:`advisor.wrap` does (:func:`~advisor.tuning.online.watch.settle_proof`):
   fp32 twice and that plan from the current weights, as long as the last trial said it needs
   (doubled at each try, three at most); proven within the tolerance, it races the baseline
   alone as in 4 and is installed where that re-timed step speed-up times its step efficiency
   beats the baseline at the 95% bound.
6. **monitor** a plan that compresses any group, as :func:`advisor.wrap` does: each step a
   sample of positions in the compressed groups' reduce-scatter buffers
   (:class:`advisor.runtime.sharded_monitor.ShardedFidelityMonitor`, ``fidelity_sample``
   positions), read against the exact sum every ``fidelity_window`` steps; the plan's first
   window is its reference, and two windows in a row beyond ``fidelity_drift`` times it back the
   plan off on every rank, as a re-trial that shows harm does (fp16 to bf16, where fp16's range
   is what gave out).
7. **loss watch**, where the loop reports its loss (``tuner.record_loss(loss)``): every
   ``watch_every`` steps under a compressed plan, the window's mean loss (over ranks) against
   the trend of the uncompressed steps' losses (observe, the baselines' race turns, or
   ``trend_steps`` fp32 steps before a given plan;
   :class:`~advisor.tuning.online.watch.LossWatch`, :func:`advisor.wrap`'s own); two windows in
   a row above it by more than ``loss_z`` standard errors back the plan off as in 5.

Without ``loss_fn``, ``batches`` and ``build`` there is no accuracy evidence: only the baselines
race (the compressed plans are left out, and an event says so).  With them, the plan that wins
on speed must pass the paired accuracy trial on shadows from ``build()``
(:func:`advisor.tuning.sharded.sharded_shadows`), as in :func:`advisor.autotune_sharded`.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch

from advisor.core.documents import check_int
from advisor.runtime import Plan
from advisor.runtime.monitor import DEFAULT_SAMPLE, DEFAULT_WINDOW, FidelityReading
from advisor.runtime.plan import as_plan
from advisor.runtime.sharded import SHARDED_CONFIGS, ShardedSwitch
from advisor.runtime.sharded_monitor import ShardedFidelityMonitor
from advisor.tuning.accuracy import AccuracyTrial, check_evaluate
from advisor.tuning.online.trial import OnlineRetimes, Race, RetimeNeeded
from advisor.tuning.online.tuner import TunerEvent
from advisor.tuning.online.watch import (
    AGAIN,
    RETIME,
    FidelityDrift,
    LossWatch,
    PendingProof,
    RetrialClock,
    check_fidelity_settings,
    check_retrial_share,
    first_retrial_in,
    harm_shown,
    is_lossy,
    settle_proof,
    settle_retimed_proof,
)
from advisor.tuning.sharded import (
    NATIVE,
    keep_fsdp_unless_exact_is_faster,
    sharded_arms,
    sharded_shadows,
    sixteen_bit_of,
    verdict_of,
)
from advisor.tuning.steps import (
    DEFAULT_TRIAL_SHARE,
    check_trial_budget,
    decide_time_to_accuracy,
    trial_budget,
    unprovable,
)
from policies import accuracy_gate as gate
from policies.do_no_harm import CANDIDATE, SIXTEEN_BIT
from policies.sharded import ShardedProblem, search_sharded
from profilers.sharded import RowCapture, ShardedProfile, check_sharded_configs
from profilers.training_state import preferred_sixteen_bit, scales_per_coordinate

OBSERVE, RACE, DECIDED = "observe", "race", "decided"


class _SwitchAsHook:
    """The race sets each arm's plan on a hook; on a sharded model the switch is that hook."""

    def __init__(self, switch: ShardedSwitch) -> None:
        self.switch, self.plan = switch, None

    def set_plan(self, plan: Plan, reason: str = "", verify: bool = True) -> None:
        self.switch.set(plan)
        self.plan = plan


class ShardedOnlineTuner:
    """The online tuner of a sharded model on one rank; construct it through :func:`wrap_sharded`."""

    def __init__(self, model: torch.nn.Module, optimizer=None, *, candidates: Sequence[str] = SHARDED_CONFIGS,
                 observe_steps: int = 4, trial_steps: int = 3, trial_rounds: int = 3, max_trial_rounds: int = 8,
                 top: int = 2, repeats: int = 2, loss_fn=None, batches: Iterable[Any] | None = None,
                 build: Callable[[], torch.nn.Module] | None = None, evaluate=None, held_out=None,
                 metric: str = "loss", expected_steps: int | None = None, trial_share: float = DEFAULT_TRIAL_SHARE,
                 trial_s: float | None = None, tolerance: float = gate.DEFAULT_TOLERANCE,
                 retrial_share: float | None = 0.03, fidelity_sample: int = DEFAULT_SAMPLE,
                 fidelity_window: int = DEFAULT_WINDOW, fidelity_drift: float = 3.0, watch_every: int = 50,
                 loss_z: float = 3.0, trend_steps: int = 0, plan: Plan | Mapping[str, Any] | str | None = None,
                 group=None) -> None:
        self.labels = check_sharded_configs(candidates)
        check_retrial_share(retrial_share)
        check_fidelity_settings(fidelity_sample, fidelity_window, fidelity_drift)
        for name, value, minimum in (("observe_steps", observe_steps, 2), ("trial_steps", trial_steps, 1),
                                     ("trial_rounds", trial_rounds, 2), ("top", top, 1), ("repeats", repeats, 1),
                                     ("watch_every", watch_every, 1), ("trend_steps", trend_steps, 0)):
            check_int(name, value, minimum)
        if not (isinstance(loss_z, (int, float)) and loss_z > 0):
            raise ValueError(f"loss_z={loss_z!r}; allowed: > 0 standard errors")
        if trend_steps and plan is None:
            raise ValueError(f"trend_steps={trend_steps} runs fp32 steps before a given plan; pass plan= with it, or "
                             "leave it at 0 (the race's own uncompressed steps set the loss trend)")
        check_int("max_trial_rounds", max_trial_rounds, trial_rounds)
        check_trial_budget(expected_steps, trial_share, tolerance)
        check_evaluate(evaluate)
        gate_given = [x is not None for x in (loss_fn, batches, build)]
        if any(gate_given) and not all(gate_given):
            raise ValueError("the accuracy gate needs loss_fn, batches and build together (build: a fresh sharded "
                             "model of the same architecture, for the trial's shadows); pass all three, or none to "
                             "race the baselines only")
        if all(gate_given) and optimizer is None:
            raise ValueError("the accuracy gate trains shadows with a clone of the training optimizer; pass it")
        self.model, self.optimizer, self.group = model, optimizer, group
        self.switch = ShardedSwitch(model, group)  # refuses FSDP1 and unsharded models
        self.observe_steps, self.top, self.repeats = observe_steps, top, repeats
        self._race_settings = dict(steps=trial_steps, min_rounds=trial_rounds, max_rounds=max_trial_rounds)
        self._gate = None if loss_fn is None else dict(
            loss_fn=loss_fn, batches=batches, build=build, evaluate=evaluate, held_out=held_out, metric=metric,
            tolerance=tolerance, **trial_budget(expected_steps, trial_share, trial_s))
        self.phase = OBSERVE
        self.step = 0
        self.events: list[TunerEvent] = []
        #: the profile made from the observed steps, the race's measurements, its decision, the trial's report
        self.profile: ShardedProfile | None = None
        self.measured: list = []
        self.decision = None
        self.accuracy = None
        self.plan = Plan.uniform("none", warmup_steps=0)
        self._retrial_share = retrial_share
        self._retrials: RetrialClock | None = None
        self._fidelity_settings = dict(sample=fidelity_sample, window=fidelity_window,
                                       per_coordinate=scales_per_coordinate(optimizer))
        self._drift_factor = fidelity_drift
        #: ``(step, training loss, under a lossy plan)`` of every step the loop reported (:meth:`record_loss`)
        self.losses: list[tuple[int, float, bool]] = []
        self._loss_watch = LossWatch(self.losses, every=watch_every, loss_z=loss_z, group=group)
        self._watch_every = watch_every
        self._trend_steps = trend_steps
        self._given_at: int | None = None  # the step a given plan is installed at, after the trend's fp32 steps
        self._monitor: ShardedFidelityMonitor | None = None
        self._drift: FidelityDrift | None = None
        #: every window the fidelity monitor read, in order
        self.fidelity: list[FidelityReading] = []
        #: configs the plan backed off from (never chosen again)
        self._left: set[str] = set()
        #: (step, plan digest, ArmResult) of every re-trial of the plan in use
        self.retrials: list = []
        self._capture = RowCapture(model, keep=observe_steps)
        self._starts: list[tuple[float, float]] = []  # (each observed step's start, the capture's copy seconds by then)
        self._race: Race | None = None
        self._timing: Race | None = None  # the race being run: the race of every arm, or a re-timing after it
        self._retimes: OnlineRetimes | None = None
        self._after_timing: Callable[[], None] | None = None  # what a re-timing ends in (default: the decision)
        self._judge_fn = None  # kept across the decisions a re-timing interrupts
        #: the fastest compressed plan the first trial could not prove, and the one being proven online
        self._unproven: PendingProof | None = None
        self._proof: PendingProof | None = None
        self._hook = _SwitchAsHook(self.switch)  # whichever plan runs now, the race's arms included
        #: the re-timings of the plans the trial proved (:class:`policies.do_no_harm.Retiming`), in order
        self.retimed: list = []
        self._problem: ShardedProblem | None = None
        self._arms: dict = {}
        if plan is not None:
            self._keep_given(as_plan(plan))
        # before FSDP's own pre-forward (which FSDP prepends): a trial at a step's start copies the model's
        # state and runs shadows, which must find the root's parameters sharded, as between steps
        self._handle = model.register_forward_pre_hook(self._on_forward, prepend=True)

    def _keep_given(self, plan: Plan) -> None:
        """A plan the user chose: installed now, or after ``trend_steps`` fp32 steps that set the loss watch's
        trend (every rank must hold the same), then re-trialled and monitored."""
        self.plan, self.phase = plan, DECIDED
        if self._trend_steps:
            self._given_at = self._trend_steps
            self._note("given", f"the given plan ({plan.digest()}) is installed after {self._trend_steps} steps of "
                                "FSDP's own fp32 reduce-scatter, whose losses set the loss watch's trend")
            return
        self._install_given()

    def _install_given(self) -> None:
        self._given_at = None
        self._install(self.plan)
        watched = self._schedule_retrials(None)
        self._note("given", f"the given plan ({self.plan.digest()}) installed; "
                   + (f"re-trialled as training pays for it at retrial_share={self._retrial_share:g}" if watched else
                      "not re-trialled (it needs loss_fn, batches and build, a compressed plan and retrial_share)"))

    def _install(self, plan: Plan | None) -> None:
        """Run ``plan`` on every group (None: FSDP's own path everywhere), and monitor its fidelity
        where it compresses a group and the monitor is on."""
        self._stop_monitor()
        self._hook.plan = plan
        if plan is None:
            self.switch.restore()
            return
        groups = self.switch.set(plan)
        if not self._fidelity_settings["sample"]:
            return
        monitor = ShardedFidelityMonitor(groups, **self._fidelity_settings, seed=plan.seed,
                                         at_step=self.step, group=self.group)
        try:
            monitor.start()
        except ValueError as exc:  # a mesh it cannot read (HSDP): every rank alike, and training goes on
            self._note("fidelity", f"the plan is not monitored: {exc}")
            return
        if monitor.watching:
            self._monitor, self._drift = monitor, FidelityDrift(self._drift_factor)
        else:
            monitor.close()

    def _stop_monitor(self) -> None:
        if self._monitor is not None:
            self._monitor.close()
        self._monitor = self._drift = None

    def _schedule_retrials(self, trial_steps: int | None) -> bool:
        """Re-trial the plan in use from now on, where it compresses and the gate has its data (``trial_steps``:
        the first trial's length, which sets when the first re-trial is paid for); whether it will be."""
        if self._gate is None or self._retrial_share is None or not is_lossy(self.plan):
            return False
        self._retrials = RetrialClock(self.step + first_retrial_in(self._gate, trial_steps, self._retrial_share),
                                      self._retrial_share, self.group)
        return True

    def _trial(self, **settings) -> AccuracyTrial:
        """A paired accuracy trial from the current weights on shadows from ``build()``, on the gate's data and budget."""
        args = {**self._gate, **settings}
        loss_fn, batches, build = args.pop("loss_fn"), args.pop("batches"), args.pop("build")
        return AccuracyTrial(self.model, loss_fn, batches, self.optimizer, group=self.group,
                             shadows=sharded_shadows(self.model, self.optimizer, build, self.group), **args)

    def record_loss(self, loss) -> None:
        """Report this step's training loss (a float or a scalar tensor); feeds the loss watch.

        Call once per training step on every rank, after the forward pass.
        """
        value = float(loss.detach()) if isinstance(loss, torch.Tensor) else float(loss)
        self.losses.append((self.step - 1, value, self._running_lossy()))

    def _running_lossy(self) -> bool:
        """Whether the plan running now (a race's arm included; None: FSDP's own path) is lossy."""
        return self._hook.plan is not None and is_lossy(self._hook.plan)

    def update_starts(self) -> None:
        """Accepted as :class:`advisor.tuning.online.OnlineTuner` accepts it; steps are timed whole here."""

    def close(self) -> None:
        """Stop tuning (the plan in use stays installed, unwatched)."""
        self._handle.remove()
        if self._monitor is not None:
            self._monitor.close()
        if self.phase == OBSERVE:
            self._capture.stop()

    @torch.compiler.disable
    def _on_forward(self, module, args) -> None:
        if not (torch.is_grad_enabled() and module.training):
            return  # evaluation passes are not training steps
        now = time.perf_counter()
        if self.phase == OBSERVE:
            self._observe(now)
        elif self.phase == RACE and self._timing.step_starts(now):
            if self._timing is not self._race:
                self._note("re-timed", self._retimes.describe(self._retimes.finished(self._timing), self._timing))
            then, self._after_timing = self._after_timing or self._decide, None
            then()
        elif self.phase == DECIDED:
            if self._given_at is not None and self.step >= self._given_at:
                self._install_given()
            self._check_fidelity()
            if self._retrials is not None and self._retrials.due(self.step):
                if self._proof is not None:
                    self._prove_online(now)
                else:
                    self._retrial(now)
            if self.phase == DECIDED and self.step % self._watch_every == 0:
                self._check_loss()
        self.step += 1

    def _note(self, what: str, detail: str) -> None:
        self.events.append(TunerEvent(self.step, what, detail))

    def _observe(self, now: float) -> None:
        if self.step == 0:
            self._capture.start()
        self._starts.append((now, self._capture.spent_s))
        if len(self._starts) < self.observe_steps + 2:  # one warm-up step, then the observed ones
            return
        self._capture.stop()
        t0 = time.perf_counter()
        # each step as it runs without the capture: less the seconds the capture's copies took
        times = [(b - a) - (copied_b - copied_a)
                 for (a, copied_a), (b, copied_b) in zip(self._starts[1:], self._starts[2:])]
        # every number in it is agreed across ranks (slowest times, summed errors): every rank holds the same
        self.profile = self._capture.profile(self.labels, statistics.median(times), self.observe_steps, self.repeats,
                                             self.group)
        self._problem = ShardedProblem(self.profile, self.labels)
        sixteen = sixteen_bit_of(self._problem, self.optimizer)
        arms = sharded_arms(self._problem, search_sharded(self._problem, self.top), sixteen)
        left_out = [a for a in arms.values() if a.kind == CANDIDATE] if self._gate is None else []
        for arm in left_out:
            del arms[arm.label]
        self._arms = arms
        self._race = self._timing = Race(list(arms.values()), self._hook, group=self.group, **self._race_settings)
        self._retimes = OnlineRetimes(arms, self._hook, steps=self._race.steps,
                                      max_rounds=self._race.max_rounds, group=self.group)
        self.retimed = self._retimes.record
        self._note("profiled", f"profile and search took {time.perf_counter() - t0:.1f} s; racing {len(arms)} plans "
                               f"in rounds of {self._race.steps_per_round} steps")
        if left_out:
            self._note("unproven", f"{len(left_out)} compressed plan(s) left out of the race (the best predicted "
                                   f"{left_out[0].description}): without loss_fn, batches and build their accuracy "
                                   "cannot be proven; pass them to trial them")
        self.phase = RACE
        self._race.start(time.perf_counter())

    def _decide(self) -> None:
        self.measured = self._race.measurements()
        if self._judge_fn is None:
            self._judge_fn = self._judge() if self._gate is not None else unprovable(
                "wrap_sharded was given no loss_fn, batches and build")
        try:
            decision, checked, _ = decide_time_to_accuracy(self.measured, self._judge_fn, group=self.group,
                                                           retime=self._retimes.retime)
        except RetimeNeeded as need:
            self._retime(need, "the trial")
            return
        keep_fsdp_unless_exact_is_faster(decision, self.measured)
        self.decision = decision
        self.plan = self._arms[decision.chosen].plan
        self._install_decided()
        self._note("decided", f"{decision.reason} (race {self._race.ended})")
        proof = self._unproven if not decision.compress and self._retrial_share is not None else None
        if proof is not None:  # its fp32 pair and plan, paid for at retrial_share
            self._proof = proof
            self._retrials = RetrialClock(self.step + math.ceil(3 * proof.arm_steps / self._retrial_share),
                                          self._retrial_share, self.group)
        if self._unproven is not None and not decision.compress:
            self._note("unproven", self._unproven.announce(self.accuracy.steps, self._retrials.at if proof else None,
                                                           self._retrial_share))

    def _install_decided(self) -> None:
        """Run the decided plan (FSDP's own path where NATIVE was decided), and re-trial it where it compresses."""
        self._install(None if self.decision.chosen == NATIVE else self.plan)
        self.phase = DECIDED
        self._schedule_retrials(self.accuracy.steps if self.accuracy else None)

    def _retime(self, need: RetimeNeeded, proven_by: str, then: Callable[[], None] | None = None) -> None:
        """Race the plan ``proven_by`` proved beside its baseline alone on the next steps; ``then()`` (by
        default the decision) once it ends."""
        self._stop_monitor()  # the race switches plans under it
        self._timing, self._after_timing = self._retimes.race(need), then
        self.phase = RACE
        self._note("re-timing", self._retimes.announce(need, self._timing, proven_by))
        self._timing.start(time.perf_counter())

    def _prove_online(self, started: float) -> None:
        """The paired trial from the current weights of the plan the first trial could not prove: fp32 twice
        and the plan, each for up to ``arm_steps`` steps; proven, it is re-timed beside the baseline."""
        proof = self._proof
        proof.attempts += 1
        trial = self._trial(arms_expected=3, budget_steps=3 * proof.arm_steps, time_budget_s=None)
        trial.start()
        arm = trial.trial(proof.label, proof.plan, gate.CANDIDATE, proof.description)
        self.retrials.append((self.step, proof.plan.digest(), arm))
        follows, detail = settle_proof(proof, arm, can_retime=True)
        cost_s = self._retrials.ran(self.step, started)
        if follows != AGAIN:
            self._proof = None
            if not is_lossy(self.plan):
                self._retrials = None
        self._note("proof", f"{detail} (from the weights at step {self.step}; {cost_s:.1f} s"
                   + (f", next at step {self._retrials.at})" if follows == AGAIN else ")"))
        if follows == RETIME:
            self._retime(RetimeNeeded(proof.decision, arm), "the online trial",
                         then=lambda: self._proof_retimed(proof, arm))

    def _proof_retimed(self, proof: PendingProof, arm) -> None:
        """Install the plan proven online where its re-timed time to accuracy beats the baseline's at the
        95% bound; else go back to the decided baseline.  Either way, watch again."""
        installed, said = settle_retimed_proof(proof, arm, self._retimes.retime(proof.decision, arm),
                                               self.decision.chosen)
        self._note("proof", said)
        if installed is not None:
            self.decision, self.plan = installed, proof.plan
        self._install_decided()

    def _check_loss(self) -> None:
        """Every ``watch_every`` steps: two windows in a row of the loop's loss above the uncompressed steps'
        trend back the plan off on every rank."""
        said = self._loss_watch.check(self.step, self._running_lossy())
        if said:
            self._note("loss-watch", said)
            self._back_off("the loss fell behind its trend")

    def _retrial(self, started: float) -> None:
        """The paired trial again from the current weights: fp32 twice and the plan in use (judged even
        unpowered); where it shows the plan behind beyond the tolerance, back off on every rank."""
        trial = self._trial(arms_expected=3, judge_unpowered=True)
        trial.start()
        plan = self.plan
        arm = trial.trial("the plan in use", plan, gate.CANDIDATE, f"the plan in use ({plan.digest()})")
        report = trial.report()
        self.retrials.append((self.step, plan.digest(), arm))
        low = harm_shown(arm, report)
        cost_s = self._retrials.ran(self.step, started)
        self._note("re-trial", f"{arm.reason} (from the weights at step {self.step}; {cost_s:.1f} s, next at step "
                               f"{self._retrials.at})")
        if low is None:
            return
        self._back_off(f"the re-trial showed it {arm.gap:+.2%} behind fp32, at least {low:+.2%}")

    def _check_fidelity(self) -> None:
        """The monitor's window, where one ended: the plan's first is its reference; two drifted in a row
        back the plan off on every rank (every rank reads the same numbers)."""
        reading = self._monitor.step_ends() if self._monitor is not None else None
        if reading is None:
            return
        self.fidelity.append(reading)
        said, drifted = self._drift.see(reading)
        if said:
            self._note("fidelity", said)
        if drifted:
            self._back_off("its delivered gradient drifted from the exact sum")

    def _back_off(self, why: str) -> None:
        """Move every group to a less lossy plan, on every rank, and say so."""
        plan = self.plan
        self._left |= {c.label for c in plan.configs() if c.name != "none"}
        self.plan, softer = self._softer()
        native = self.plan.default.name == "none" and not self.plan.groups
        self._install(None if native else self.plan)  # FSDP's own path where nothing is compressed
        if not is_lossy(self.plan) and self._proof is None:
            self._retrials = None  # a baseline is not re-trialled
        self._note("back-off", f"{plan.digest()} -> {softer} on every group ({why})")

    def _softer(self) -> tuple[Plan, str]:
        """Where a plan backs off to: the 16-bit cast that raced, else the optimizer's among the
        candidates, else bf16 (fp16's fault late in training is its range, which bf16 has), else FSDP's
        own fp32 reduce-scatter; never a config the plan has backed off from."""
        options = [(a.plan, a.description) for a in self._arms.values() if a.kind == SIXTEEN_BIT]
        options += [(Plan.uniform(cast, warmup_steps=0), f"{cast} everywhere")
                    for cast in dict.fromkeys((preferred_sixteen_bit(self.optimizer), "bf16")) if cast in self.labels]
        for plan, description in options:
            if not {c.label for c in plan.configs() if c.name != "none"} & self._left:
                return plan, description
        return Plan.uniform("none", warmup_steps=0), "FSDP's own fp32 reduce-scatter"

    def _judge(self):
        """The paired trial from the current weights on shadows, started when a plan other than fp32 wins."""
        verdicts: dict = {}
        trial = None

        def judge(decision):
            nonlocal trial
            if trial is None:
                trial = self._trial(arms_expected=2 + len(self._arms))
                trial.start()
            arm = self._arms[decision.chosen]
            verdict = verdict_of(trial, verdicts, self._problem, decision.chosen, arm.plan, arm.kind, arm.description)
            self.accuracy = trial.report()
            if verdict.status == gate.NOT_PROVEN and verdict.kind == gate.CANDIDATE and self._unproven is None:
                # the fastest plan the trial could not prove: the trial goes on online
                self._unproven = PendingProof.after(decision.chosen, arm.plan, arm.description, decision,
                                                    self.accuracy)
            return verdict

        return judge


def wrap_sharded(model: torch.nn.Module, optimizer=None, **kwargs) -> ShardedOnlineTuner:
    """Tune ``model`` (sharded with ``fully_shard``) online in the first steps of the user's own loop;
    see the module doc.  Every rank calls it before the first step.

    Args:
        model: the sharded model.
        optimizer: the training optimizer (cloned by the accuracy trial).
        **kwargs: ``candidates``, ``observe_steps``, ``trial_steps``, ``trial_rounds``,
            ``max_trial_rounds``, ``top``, and for the accuracy gate ``loss_fn``, ``batches``,
            ``build``, ``evaluate``, ``held_out``, ``metric``, ``expected_steps``,
            ``trial_share``, ``trial_s``, ``tolerance``, ``retrial_share`` (the share of the
            training time re-trials of a compressed plan may take; None: none), for the fidelity
            monitor ``fidelity_sample`` (0 turns it off), ``fidelity_window``, ``fidelity_drift``, for the
            loss watch ``watch_every`` and ``loss_z``, and ``plan`` (a plan of your own: installed instead
            of the race, at once or after ``trend_steps`` fp32 steps, then re-trialled and watched).

    Returns:
        The :class:`ShardedOnlineTuner`: ``tuner.events``, ``tuner.plan`` (in use once
        ``tuner.phase == "decided"``), ``tuner.measured``, ``tuner.decision``, ``tuner.retrials``,
        ``tuner.fidelity``; ``tuner.record_loss(loss)`` feeds the loss watch.

    Raises:
        TypeError: FSDP1, or a model without ``fully_shard``.
        ValueError: a bad argument, before any step.
    """
    return ShardedOnlineTuner(model, optimizer, **kwargs)
