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
3. **race**: each baseline (fp32 through the hook, 16-bit) and each top plan take turns
   on the loop's steps in interleaved rounds (``trial_steps`` timed steps an arm a round,
   after one that settles the new plan), measured as :func:`advisor.autotune` measures: each
   round's median (slowest rank), paired by round, so drift between rounds cancels.  After
   ``trial_rounds`` rounds more follow while the comparisons that decide are unresolved, up
   to ``max_trial_rounds``; the rounds decide under the do-no-harm rule, and the event says
   how far the margin was from the noise.  Where ``loss_fn`` and ``batches`` are given
   (and the optimizer), the plan that wins on speed must also pass the accuracy gate, the
   same paired trial as :func:`advisor.autotune`'s (:mod:`advisor.tuning.accuracy`): shadow copies
   from the current weights, with a clone of the optimizer, next to fp32 on those batches;
   a rejected plan leaves the race and the next one is judged, down to fp32.  A compressed
   plan the trial proves then races the best baseline alone on the next steps, in turns
   three times as long, until its time to accuracy is resolved or ``max_trial_rounds``
   (:class:`~advisor.tuning.online.trial.OnlineRetimes`): the race's winner is the fastest of
   several arms, so its race time errs in its favour, and the claim is built on the second
   figure (``tuner.retimed``).
4. **fidelity watch**: every step, the hook shows a random sample of the compressed
   coordinates (``fidelity_sample``, the same on every rank) to a
   :class:`~advisor.runtime.monitor.FidelityMonitor` before and after the exchange; each
   window of ``fidelity_window`` steps ends with one all-reduce of the local values, which
   gives the exact mean, and the window's error (summed over the window, so error feedback
   counts; per coordinate under Adam-like optimizers) is compared with the plan's first
   window.  Two windows in a row above ``fidelity_drift`` times that reference (and 10%)
   back the drifted configs off one level: fp16 to bf16 (the same bytes, fp32's range),
   others to the next config sending more bytes.  This is what catches a plan that passed
   its trial at the start and hurts later, as fp16's range does once gradients shrink.
5. **re-trial**: where ``loss_fn`` and ``batches`` are given, the paired accuracy trial runs
   again from the current weights on shadow copies (fp32 twice and the plan in use), first
   once training has run long enough to pay for one at ``retrial_share`` (3%) of its time,
   then as often as that share pays for; a plan shown behind fp32 beyond the tolerance (the
   gap's 95% lower bound) backs off one level everywhere.  Where the first trial could not
   prove the plan that won the race (too short to be powered), the trial goes on online
   instead: in those slots, from the current weights, fp32 twice and that plan, as long as
   the last trial said it needs; proven within the tolerance, it races the baseline alone on
   the next steps as in 3, and is installed where that re-timed step speed-up times its step
   efficiency beats the baseline at the 95% bound (``tuner.decision`` then says so).
6. **gain watch** (GraVAC-style): every ``watch_every`` steps the compression gain
   ``||C(g)|| / ||g||`` of each compressed segment is measured on that step's gradients,
   averaged over ranks and compared with the gain measured right after the decision; a
   segment whose gain fell below ``backoff`` times that reference moves to the next less
   compressing config (more bytes on the wire), down to fp16 and fp32.
7. **loss watch**: where the loop reports its loss (``tuner.record_loss(loss)``, one line),
   the losses of the uncompressed steps (observe, the baseline trials, or ``trend_steps``
   fp32 steps before a given plan) fit a trend ``a + b·ln(step)``; every ``watch_every``
   steps under compression, the window's mean loss (over ranks) is compared with the
   trend's prediction, and two windows in a row above it by more than ``loss_z`` standard
   errors back every compressed parameter off one level.  Every change is logged and kept
   in :attr:`OnlineTuner.events`.

All decisions are made from all-reduced numbers and rank 0's choices are broadcast, so
every rank changes plans at the same step.  ``wrap(..., plan=...)`` skips 1-3 and only
watches the given plan: the way to keep checking a plan chosen offline.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
from torch.nn.parallel import DistributedDataParallel

from advisor.core.documents import check_int
from advisor.runtime import CompressionHook, Plan, install
from advisor.runtime.monitor import DEFAULT_SAMPLE, DEFAULT_WINDOW, FidelityMonitor, FidelityReading
from advisor.tuning.accuracy import AccuracyTrial, check_evaluate
from advisor.tuning.online.observe import Observation
from advisor.tuning.online.trial import OnlineRetimes, Race, RetimeNeeded
from advisor.tuning.online.watch import (
    PendingProof,
    Watch,
    check_fidelity_settings,
    check_retrial_share,
    first_retrial_in,
    is_lossy,
    settle_retimed_proof,
)
from advisor.tuning.steps import (
    DEFAULT_CANDIDATES,
    DEFAULT_TRIAL_SHARE,
    LazyTrial,
    baseline_arms,
    candidate_labels,
    check_trial_budget,
    close_layouts_to_race,
    decide_time_to_accuracy,
    not_ddp,
    search,
    search_layouts,
    shared_profile,
    short_list,
    sixteen_bit_baseline,
    trial_budget,
    unprovable,
)
from policies import accuracy_gate as gate
from policies.do_no_harm import FP32
from policies.optuna_search import OptunaPolicy
from policies.problem import TuningProblem
from profilers.training_state import scales_per_coordinate

log = logging.getLogger("advisor.tuning.online")


@dataclass
class TunerEvent:
    step: int
    what: str
    detail: str


class OnlineTuner:
    """The online autotuner on one rank: drives its phases from the model's forward calls.

    Construct through :func:`wrap`.  The tuner owns the hook, the step count, the events and
    the reported losses; each phase (:class:`Observation`, :class:`Race`, :class:`Watch`)
    owns its own measurements.  Between them it takes the steps it shares with
    :func:`advisor.autotune` (:mod:`advisor.tuning.steps`): profile, search, short-list,
    then decide.
    """

    def __init__(self, ddp: DistributedDataParallel, optimizer=None, *, candidates: Sequence[str] | None = None,
                 observe_steps: int = 8, trial_steps: int = 3, top: int = 2, trials: int = 500,
                 watch_every: int = 50, backoff: float = 0.8, budget: float | None = None,
                 plan: Plan | None = None, trial_rounds: int = 3, max_trial_rounds: int = 8,
                 loss_z: float = 3.0, trend_steps: int = 0, loss_fn=None, batches: Iterable | None = None,
                 evaluate=None, held_out: Sequence | None = None, metric: str = "loss", trial_s: float | None = None,
                 expected_steps: int | None = None, trial_share: float = DEFAULT_TRIAL_SHARE,
                 tolerance: float = gate.DEFAULT_TOLERANCE, trial_options: dict | None = None,
                 fidelity_sample: int = DEFAULT_SAMPLE, fidelity_window: int = DEFAULT_WINDOW,
                 fidelity_drift: float = 3.0, retrial_share: float | None = 0.03, hook: CompressionHook | None = None,
                 group=None) -> None:
        _check_arguments(ddp, optimizer, observe_steps, trial_steps, top, trials, watch_every, backoff,
                         trial_rounds, max_trial_rounds, trend_steps, loss_z, loss_fn, batches, trial_s, evaluate,
                         expected_steps, trial_share, tolerance, fidelity_sample, fidelity_window, fidelity_drift,
                         retrial_share)
        self._gate_args = None if batches is None else dict(
            loss_fn=loss_fn, batches=batches, evaluate=evaluate, held_out=held_out, metric=metric,
            tolerance=tolerance, **trial_budget(expected_steps, trial_share, trial_s), **dict(trial_options or {}))
        #: the accuracy trial's report, where the gate ran (``loss_fn`` and ``batches`` given)
        self.accuracy = None
        #: the race's measurements: every arm's round medians (slowest rank), paired by round; [] before it ends
        self.measured: list = []
        #: the race's decision (:class:`policies.do_no_harm.Decision`), once it ended
        self.decision = None
        #: the re-timings of the plans the trial proved (:class:`policies.do_no_harm.Retiming`), in order
        self.retimed: list = []
        self.candidates = candidate_labels(candidates or DEFAULT_CANDIDATES, budget)
        self.ddp, self.optimizer, self.group = ddp, optimizer, group
        self.observe_steps, self.top, self.trials, self.budget = observe_steps, top, trials, budget
        self._race_settings = dict(steps=trial_steps, min_rounds=trial_rounds, max_rounds=max_trial_rounds)
        self._watch_settings = dict(every=watch_every, backoff=backoff, loss_z=loss_z, drift=fidelity_drift)
        self._retrial_share = retrial_share
        self._fidelity_settings = dict(sample=fidelity_sample, window=fidelity_window,
                                       per_coordinate=scales_per_coordinate(optimizer))
        self.step = 0
        self.events: list[TunerEvent] = []
        #: (step, loss, under a lossy plan) of every loss the loop reported
        self.losses: list[tuple[int, float, bool]] = []
        self._update = UpdateClock()
        self._problem: TuningProblem | None = None  # the search's problem, for the accuracy gate
        self._unproven: PendingProof | None = None  # the fastest raced plan the gate could not prove
        self._verdicts: list[str] = []  # the gate's verdict on each plan it judged
        self._race: Race | None = None  # the race of every arm (a re-timing races two of them after it)
        self._judge = None  # the accuracy judge, kept across the decisions a re-timing interrupts
        self._retimes: OnlineRetimes | None = None
        self._after_retiming = self._decide  # what follows a re-timing: the decision, or an online proof's end

        #: whether close() stops the hook: not one the user installed and only lent to the watch
        self._owns_hook = hook is None
        if hook is not None:
            _check_installed(ddp, hook, plan, trend_steps)
            self.hook = hook
            self._phase = self._watch(first_in=3)
            self._note("watch", f"watching the installed plan {hook.plan.digest()} from hook step {hook.step}")
        else:
            self._start(plan, trend_steps)
        self._handles = [ddp.register_forward_pre_hook(self._on_forward_start),
                         ddp.register_forward_hook(self._on_forward_end)]
        if optimizer is not None:
            self._handles.append(optimizer.register_step_pre_hook(self._optimizer_start))
            self._handles.append(optimizer.register_step_post_hook(self._optimizer_end))

    def _start(self, plan: Plan | None, trend_steps: int) -> None:
        """Install the hook: plan none to observe, or the given plan (after the trend's fp32 steps)."""
        first = plan if plan is not None and trend_steps == 0 else Plan.uniform("none", warmup_steps=0)
        self.hook = install(self.ddp, first, group=self.group)
        if plan is None:
            self._phase = Observation(self.ddp, self.hook)
            self._phase.start()
        else:
            # the reference gain after DDP's bucket rebuild, and after the trend's fp32 steps
            self._phase = self._watch(first_in=3 + trend_steps, pending=plan if trend_steps else None,
                                      pending_at=trend_steps)
            self._note("watch", f"watching the given plan {plan.digest()}" + (
                f" after {trend_steps} fp32 steps that set the loss trend" if trend_steps else
                " (no fp32 steps before it: the loss watch has no trend; pass trend_steps=N)"))

    @property
    def phase(self) -> str:
        """``"observe"``, ``"trial"`` or ``"watch"``."""
        return self._phase.name

    @property
    def plan(self) -> Plan:
        return self.hook.plan

    @property
    def fidelity(self) -> list[FidelityReading]:
        """The fidelity monitor's windows since the watch began (empty before it, or with ``fidelity_sample=0``)."""
        return list(self._phase.readings) if isinstance(self._phase, Watch) else []

    @property
    def retrials(self) -> list:
        """The paired trials run from the current weights since the watch began, in order: ``(step, plan
        digest, arm)`` for each re-trial of the plan in use and each online proof of a pending plan, the
        arm (:class:`advisor.tuning.accuracy.ArmResult`) saying how far behind fp32 it was and its verdict."""
        return list(self._phase.retrials) if isinstance(self._phase, Watch) else []

    def record_loss(self, loss) -> None:
        """Report this step's training loss (a float or a scalar tensor); feeds the loss watch.

        Call once per training step on every rank, after the forward pass.
        """
        value = float(loss.detach()) if isinstance(loss, torch.Tensor) else float(loss)
        self.losses.append((self.step - 1, value, is_lossy(self.hook.plan)))

    def update_starts(self) -> None:
        """Mark the start of the optimizer's update, for loops that call ``optimizer.step(closure)``.

        Lightning (automatic optimization) runs the forward and backward inside the closure, so
        the step's pre-hook fires before them; call this right before the update (the Lightning
        callback does, from ``on_before_optimizer_step``) so the update is timed alone.  Without
        it such steps leave the update's time out of the profile.
        """
        self._update.mark()

    def close(self) -> None:
        """Stop tuning and remove the hook's worker; the model must not train under it again.

        A hook passed as ``hook=`` stays as it was (its plan, backed off or not, goes on).
        """
        for h in self._handles:
            h.remove()
        self._phase.close()
        if self._owns_hook:
            self.hook.close()

    # --- what the loop does: optimizer steps and forwards -----------------------------------
    def _note(self, what: str, detail: str) -> None:
        self.events.append(TunerEvent(self.step, what, detail))
        log.info("step %d: %s: %s", self.step, what, detail)

    def _optimizer_start(self, *args) -> None:
        self._update.step_starts()

    def _optimizer_end(self, *args) -> None:
        seconds = self._update.step_ends()
        if isinstance(self._phase, Observation) and seconds is not None:
            self._phase.optimizer_ran(seconds)

    # The model's forward may be compiled (torch.compile(ddp)): dynamo must call these hooks, not
    # trace them, since they time, profile and run collectives.
    @torch.compiler.disable
    def _on_forward_end(self, module, args, output) -> None:
        if torch.is_grad_enabled() and module.training and isinstance(self._phase, Observation):
            self._phase.forward_ends(time.perf_counter())

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
        self._update.forward_runs()
        # the forward may run under the loop's autocast; the tuner's own work (profiling, fidelity
        # replay, gains) is measured in the gradients' dtype, as the hook exchanges them
        with _no_autocast():
            if isinstance(self._phase, Observation):
                if self._phase.step_starts(now) == self.observe_steps:
                    self._profile_and_search()
            elif isinstance(self._phase, Race):
                if self._phase.step_starts(now, say=lambda msg: log.info("step %d: %s", self.step, msg)):
                    if self._phase is self._race:
                        self._decide()
                    else:
                        self._retimed(self._phase)
                        self._after_retiming()
            else:
                self._phase.step_starts(self.step)
        self.step += 1

    # --- between the phases: the steps shared with autotune -----------------------------------
    def _profile_and_search(self) -> None:
        """Observation -> race: profile, search, short-list (every rank, at the same step)."""
        t0 = time.perf_counter()
        observation = self._phase
        observation.stop()
        profile = shared_profile(observation.profile(self.candidates, self.group), self.group)
        problem = TuningProblem.from_profile(profile, self.candidates, budget=self.budget)
        policy = OptunaPolicy(n_trials=self.trials)
        found = search(policy, problem, self.group)
        # and under coarser bucket layouts; where one wins, DDP's own buckets' best races beside it,
        # and the nearest join the model cannot tell from the chosen layout races too (as in autotune)
        layout_problem, layout_found, _, close = search_layouts(policy, problem, found, self.group, rebuild_ddp=False)
        arms = baseline_arms(problem, sixteen_bit_baseline(problem, self.optimizer))
        candidates = short_list(layout_problem, layout_found, self.top)
        if layout_problem is not problem:
            candidates += short_list(problem, found, 1)
        for other, other_found in close_layouts_to_race(close):
            candidates += short_list(other, other_found, 1)
        # without accuracy evidence, racing a compressed plan on the user's own steps would cost
        # accuracy for a plan that could never be installed
        left_out = candidates if self._gate_args is None else []
        self._problem = problem
        self._phase = self._race = Race(arms + [c for c in candidates if c not in left_out], self.hook,
                                        group=self.group, **self._race_settings)
        race = self._phase
        self._retimes = OnlineRetimes(race.arms, self.hook, steps=race.steps, max_rounds=race.max_rounds,
                                      group=self.group)
        self.retimed = self._retimes.record
        self._note("profiled", f"profile and search took {time.perf_counter() - t0:.1f} s; racing {len(race.arms)} "
                               f"plans in rounds of {race.steps_per_round} steps ({race.steps} timed an arm), "
                               f"{race.min_rounds} to {race.max_rounds} rounds until decided")
        if left_out:
            self._note("unproven", f"{len(left_out)} compressed plan(s) left out of the race (the best predicted "
                                   f"{left_out[0].description}, {arms[0].predicted_s / left_out[0].predicted_s:.2f}x "
                                   "fp32 per step): wrap was given no loss_fn and batches, so their accuracy cannot "
                                   "be proven; pass loss_fn= and batches= (a DataLoader will do) to trial them")
        self._phase.start(time.perf_counter())

    def _decide(self) -> None:
        """Race -> watch: do no harm on the race's medians, then the accuracy gate; a plan the gate
        proves is re-timed beside the best baseline on the next steps before it is decided on."""
        race = self._race
        self.measured = race.measurements()
        if self._judge is None:
            self._judge = self._accuracy_judge(race)
        try:
            decision, checked, rejected = decide_time_to_accuracy(self.measured, self._judge, group=self.group,
                                                                  retime=self._retimes.retime)
        except RetimeNeeded as need:
            self._retime(need, "the trial", then=self._decide)
            return
        self.decision = decision
        if checked and self.accuracy is not None:
            self._note("accuracy", f"{decision.chosen} passed the {self.accuracy.steps}-step paired trial: {checked}")
        elif self.accuracy is not None and decision.kind == FP32:
            self._note("accuracy", "no plan faster than fp32 passed the paired trial; fp32 stands")
        self.hook.set_plan(race.arms[decision.chosen].plan, reason=f"online decision: {decision.chosen}")
        proof = self._unproven if not decision.compress and self._retrial_share is not None else None
        self._phase = self._watch(first_in=1, proof=proof)  # the reference gain on the next step
        gain = 1 - 1 / decision.gain_vs_best_baseline if decision.gain_vs_best_baseline else 0.0
        noise = decision.margin
        if decision.retimed is not None:  # the figure the claim rests on
            gain, noise = 1 - 1 / decision.retimed.value, decision.retimed.noise
        if rejected and not decision.compress:
            said = {gate.REJECTED: "fell behind fp32 in the paired trial", gate.NOT_PROVEN: "could not be proven by it",
                    gate.ACCEPTED: "were proven but not faster to accuracy"}
            sure = "sure on accuracy: " + ", ".join(f"{self._verdicts.count(status)} faster plan(s) {text}"
                                                    for status, text in said.items() if status in self._verdicts)
        elif decision.compress:
            sure = f"sure: {gain:.1%} faster, {gain / max(noise, 1e-9):.1f}x the noise ({noise:.1%})"
        elif gain <= 0:
            sure = f"sure: the best compressed plan is {-gain:.1%} slower"
        else:
            sure = (f"not sure: the best compressed plan is {gain:.1%} faster, within the noise ({noise:.1%}), "
                    "so the baseline stands")
        self._note("decided", f"{decision.reason} ({sure}; race {race.ended}, {race.steps} timed steps an arm a "
                              "round)")
        if self._unproven is not None and not decision.compress:
            self._note("unproven", self._unproven.announce(
                self.accuracy.steps, self._phase.next_trial_at if proof is not None else None, self._retrial_share))

    def _accuracy_judge(self, race: Race):
        """``judge(decision) -> ArmResult`` of the paired trial from the current weights, or None (no gate).

        The trial starts (its two fp32 arms) only when a plan other than fp32 wins on speed.
        """
        if self._gate_args is None:
            return unprovable("wrap was given no loss_fn and batches", race.arms)
        trial = LazyTrial(self._trial(arms_expected=2 + len(race.arms) - 1), self._problem,
                          lambda msg: log.info("step %d: %s", self.step, msg))
        statuses = self._verdicts
        judged: dict = {}  # by label: a decision interrupted by a re-timing asks again

        def judge(decision):
            if decision.chosen in judged:
                return judged[decision.chosen]
            raced = race.arms[decision.chosen]
            arm = trial.judge_arm(raced)
            self.accuracy = trial.trial.report()
            if arm.kind == gate.CANDIDATE:  # a cast is a baseline, not a faster plan left out
                statuses.append(arm.status)
            if arm.status == gate.NOT_PROVEN and arm.kind == gate.CANDIDATE and self._unproven is None:
                # the fastest plan the trial could not prove: the watch goes on trialling it
                self._unproven = PendingProof.after(raced.label, raced.plan, raced.description, decision,
                                                    self.accuracy)
            if not arm.accepted:
                said = "rejected" if arm.status == gate.REJECTED else "not proven"
                self._note("accuracy", f"{decision.chosen} {said}: {arm.reason}")
            judged[decision.chosen] = arm
            return arm

        return judge

    def _retime(self, need: RetimeNeeded, proven_by: str, then) -> None:
        """Race the proven plan beside its baseline alone on the next steps; ``then()`` once it ends."""
        self._phase = timing = self._retimes.race(need)
        self._after_retiming = then
        self._note("re-timing", self._retimes.announce(need, timing, proven_by))
        timing.start(time.perf_counter())

    def _retime_proof(self, proof: PendingProof, arm) -> None:
        """The watch proved ``proof`` online: leave the watch and time the plan again beside its baseline."""
        self._phase.close()
        self._retime(RetimeNeeded(proof.decision, arm), "the online trial",
                     then=lambda: self._proof_retimed(proof, arm))

    def _proof_retimed(self, proof: PendingProof, arm) -> None:
        """Install the plan proven online where its re-timed time to accuracy beats the baseline's at
        the 95% bound; else go back to the baseline.  Either way, watch again."""
        installed, said = settle_retimed_proof(proof, arm, self._retimes.retime(proof.decision, arm),
                                               self.decision.chosen)
        self._note("proof", said)
        if installed is not None:
            self.decision = installed
            self.hook.set_plan(proof.plan, reason=f"proven online: {proof.description}")
        else:
            self.hook.set_plan(self._race.arms[self.decision.chosen].plan,
                               reason=f"online decision: {self.decision.chosen}")
        self._phase = self._watch(first_in=1)

    def _retimed(self, race: Race) -> None:
        self._note("re-timed", self._retimes.describe(self._retimes.finished(race), race))

    def _watch(self, proof: PendingProof | None = None, **where) -> Watch:
        monitor = None
        if self._fidelity_settings["sample"]:
            parameters = [(n, p) for n, p in self.ddp.module.named_parameters() if p.requires_grad]
            monitor = FidelityMonitor(self.hook, parameters, group=self.group, **self._fidelity_settings)
        retrial = {}
        if self._gate_args is not None and self._retrial_share is not None:
            at = self.step + first_retrial_in(self._gate_args, self.accuracy.steps if self.accuracy else None,
                                              self._retrial_share)
            if proof is not None:  # a proof's fp32 pair and plan
                at = self.step + math.ceil(3 * proof.arm_steps / self._retrial_share)
            retrial = dict(retrial=self._retrial, retrial_share=self._retrial_share, retrial_at=at, proof=proof,
                           prove=self._prove, retime=self._retime_proof)
        return Watch(self.ddp, self.hook, self.candidates, losses=self.losses, note=self._note, group=self.group,
                     monitor=monitor, **retrial, **self._watch_settings, **where)

    def _trial(self, **settings) -> AccuracyTrial:
        """A paired accuracy trial from the current weights, on the gate's data and budget."""
        args = {**self._gate_args, **settings}
        loss_fn, batches = args.pop("loss_fn"), args.pop("batches")
        return AccuracyTrial(self.ddp, loss_fn, batches, self.optimizer, group=self.group, **args)

    def _retrial(self, plan: Plan):
        """The paired trial again, from the current weights: fp32 twice and ``plan`` (judged even unpowered)."""
        trial = self._trial(arms_expected=3, judge_unpowered=True)
        trial.start()
        kind = gate.CANDIDATE if is_lossy(plan) else gate.SIXTEEN_BIT
        arm = trial.trial("the plan in use", plan, kind, f"the plan in use ({plan.digest()})")
        return arm, trial.report()

    def _prove(self, proof: PendingProof):
        """The paired trial from the current weights of a plan the first trial could not prove: fp32
        twice and the plan, each for up to ``proof.arm_steps`` steps."""
        trial = self._trial(arms_expected=3, budget_steps=3 * proof.arm_steps, time_budget_s=None)
        trial.start()
        arm = trial.trial(proof.label, proof.plan, gate.CANDIDATE, proof.description)
        return arm, trial.report()


class UpdateClock:
    """Times the optimizer's update alone, also when the forward runs inside ``optimizer.step(closure)``.

    The step's pre-hook starts the clock.  When a forward runs before the post-hook, the
    step took a closure and the clock also timed forward and backward; only an explicit
    :meth:`mark` right before the update (:meth:`OnlineTuner.update_starts`) restarts it.
    """

    def __init__(self) -> None:
        self._t0 = 0.0
        self._in_step = False  # between the optimizer's step pre- and post-hook
        self._closure = False  # this step's forward ran inside optimizer.step(closure)
        self._marked = False

    def step_starts(self) -> None:
        self._t0, self._in_step, self._closure, self._marked = time.perf_counter(), True, False, False

    def forward_runs(self) -> None:
        if self._in_step:
            self._closure = True

    def mark(self) -> None:
        if self._in_step:
            self._t0, self._marked = time.perf_counter(), True

    def step_ends(self) -> float | None:
        """The update's seconds, or None where they cannot be told apart from the closure's."""
        self._in_step = False
        return time.perf_counter() - self._t0 if not self._closure or self._marked else None


def _check_arguments(ddp, optimizer, observe_steps, trial_steps, top, trials, watch_every, backoff, trial_rounds,
                     max_trial_rounds, trend_steps, loss_z, loss_fn, batches, trial_s, evaluate, expected_steps,
                     trial_share, tolerance, fidelity_sample, fidelity_window, fidelity_drift, retrial_share) -> None:
    """Refuse a bad argument before anything is installed, naming it and the allowed values."""
    if not isinstance(ddp, DistributedDataParallel):
        raise not_ddp("wrap", ddp)
    for name, value, minimum in (("observe_steps", observe_steps, 3), ("trial_steps", trial_steps, 1),
                                 ("trial_rounds", trial_rounds, 2), ("top", top, 1), ("trials", trials, 1),
                                 ("watch_every", watch_every, 1)):
        check_int(name, value, minimum)
    if backoff is not None and not 0 < backoff <= 10:
        raise ValueError(f"backoff={backoff!r}; allowed: 0 < backoff <= 10 (a fraction of the reference gain), "
                         "or None to watch the loss only")
    check_int("max_trial_rounds", max_trial_rounds, trial_rounds)
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
    if trial_s is not None and not (isinstance(trial_s, (int, float)) and trial_s > 0):
        raise ValueError(f"trial_s={trial_s!r}; allowed: > 0 seconds, or None")
    check_evaluate(evaluate)
    check_trial_budget(expected_steps, trial_share, tolerance)
    check_fidelity_settings(fidelity_sample, fidelity_window, fidelity_drift)
    check_retrial_share(retrial_share)


def _check_installed(ddp, hook, plan, trend_steps) -> None:
    """A hook to watch must be a CompressionHook over this model's parameters, and alone."""
    if not isinstance(hook, CompressionHook):
        raise TypeError(f"hook= takes the CompressionHook that advisor.install or advisor.autotune returned "
                        f"(result.hook), got {type(hook).__name__}")
    if plan is not None or trend_steps:
        raise ValueError("hook= watches the plan the hook already runs; pass plan= or trend_steps= only without it")
    names = {n for n, p in ddp.module.named_parameters() if p.requires_grad}
    if set(hook._names.values()) != names:
        raise ValueError("hook= was installed on another model (its parameter names differ from this model's); "
                         "pass the hook installed on this DDP model")


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
        **kwargs: see :class:`OnlineTuner`: ``observe_steps``, ``trial_steps``, ``trial_rounds``,
            ``max_trial_rounds``, ``top``,
            ``watch_every``, ``backoff``, ``candidates``, ``budget``, ``plan`` (only watch a
            given plan), ``hook`` (only watch the plan of a hook already installed, such as
            ``advisor.autotune``'s ``result.hook``), and for the accuracy gate ``loss_fn``, ``batches``, ``evaluate``,
            ``held_out``, ``metric``, ``trial_s``, and for the fidelity watch ``fidelity_sample``
            (0 turns it off), ``fidelity_window``, ``fidelity_drift``, and ``retrial_share``
            (None: no re-trials).

    Returns:
        The :class:`OnlineTuner`: ``tuner.events`` say what it did and why, ``tuner.plan`` is
        the plan in use, ``tuner.fidelity`` the fidelity watch's readings, ``tuner.retrials`` the
        paired re-trials from the current weights, ``tuner.record_loss(loss)`` feeds the loss watch.

    Raises:
        TypeError, ValueError: a bad argument, naming it and the allowed values (before any step).
        RuntimeError: at the first forward under ``ddp.join()``, on every rank.
    """
    return OnlineTuner(ddp_model, optimizer, **kwargs)
