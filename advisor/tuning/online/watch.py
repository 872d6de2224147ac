"""Phase 4 of the online tuner: watch the plan in use, and back off where it loses."""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch.nn.parallel import DistributedDataParallel

from advisor.compressors import SegmentLayout, parse
from advisor.compressors.registry import CompressorConfig
from advisor.core.collectives import every_rank, fastest, mean_over_ranks, slowest, world_size
from advisor.core.documents import check_int
from advisor.runtime import CompressionHook, Plan
from advisor.runtime.monitor import FidelityMonitor, FidelityReading
from advisor.runtime.simulate import SimulatedRanks
from policies import accuracy_gate as gate
from policies.baselines import BASELINES
from policies.do_no_harm import Decision
from policies.evidence import Estimate, one_sided_z, time_to_accuracy

WATCH = "watch"
#: the smallest window error that counts as drift, whatever the reference: ratios of tiny errors
#: (a cast's rounding) say nothing, and fp16 under AdamW on digits drifted to a few percent
#: with no loss of accuracy (docs/benchmarks.md, "Checked during training")
FIDELITY_FLOOR = 0.10


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


#: how often a plan the first trial could not prove is trialled again online before the watch gives up on it
MAX_PROOF_ATTEMPTS = 3


@dataclass
class PendingProof:
    """A compressed plan that won the race on speed but that the first accuracy trial could not prove.

    ``decision``: the race's decision for it (its step speed-up over the best baseline, 95%
    bounds); ``arm_steps``: how many steps an arm the next online trial may train (it stops
    sooner once powered); ``attempts``: online trials run so far.
    """

    label: str
    plan: Plan
    description: str
    decision: Decision
    arm_steps: int
    attempts: int = 0

    @property
    def step_speedup(self) -> Estimate:
        """Its step speed-up over :attr:`baseline` in the race."""
        return self.decision.step_speedup()

    @property
    def baseline(self) -> str:
        return self.decision.best_baseline

    @classmethod
    def after(cls, label: str, plan: Plan, description: str, decision: Decision, report) -> PendingProof:
        """The proof of a plan the first trial (``report``) could not prove: as many steps an arm as that
        trial said it needs, at least twice the shortest proof, at most twice that trial (a short trial's
        estimate of the length it needs can be wild; later tries double it)."""
        shortest = 2 * gate.MIN_PROOF_STEPS
        steps = min(max(report.steps_needed, shortest), max(2 * report.steps, shortest))
        return cls(label, plan, description, dataclasses.replace(decision), steps)

    def announce(self, trial_steps: int, at: int | None, share: float | None) -> str:
        """The event saying it won the race unproven, and when (``at``) it is trialled online, if at all."""
        return (f"{self.description} won the race ({self.step_speedup.describe()} per step vs {self.baseline}) but "
                f"the {trial_steps}-step trial could not prove it; " + (
                    f"the trial goes on online: from the weights at step {at}, fp32 twice and the plan for up to "
                    f"{self.arm_steps} steps each (doubled at each try, {MAX_PROOF_ATTEMPTS} tries at most), as "
                    f"training pays for it at retrial_share={share:g} of its time" if at is not None else
                    "retrial_share=None, so it is not trialled again"))


#: what follows one online trial of a :class:`PendingProof` (:func:`settle_proof`)
AGAIN, GIVEN_UP, RETIME, INSTALL = "again", "given up", "re-time", "install"


def settle_proof(proof: PendingProof, arm, can_retime: bool) -> tuple[str, str]:
    """After an online trial of ``proof`` (counted in ``proof.attempts``) showed ``arm``: what follows and
    the event's text.

    :data:`AGAIN` (not proven yet: the next try trains twice the steps), :data:`GIVEN_UP`
    (rejected, or unproven after :data:`MAX_PROOF_ATTEMPTS` tries, or proven but not faster),
    :data:`RETIME` (proven within the tolerance, where the caller can time it again beside the
    baseline before judging), or :data:`INSTALL` (proven faster to accuracy than the baseline at
    the 95% bound on the race's step speed-up).
    """
    if arm.status == gate.NOT_PROVEN:
        # a short trial's estimate of the length it needs is itself noisy: each try doubles it instead
        proof.arm_steps *= 2
        if proof.attempts < MAX_PROOF_ATTEMPTS:
            return AGAIN, f"{arm.reason}; tried again with up to {proof.arm_steps} steps an arm"
        return GIVEN_UP, f"{arm.reason}; given up after {proof.attempts} online trials"
    if arm.status == gate.REJECTED:
        return GIVEN_UP, f"{arm.reason}; given up"
    efficiency = arm.efficiency_estimate()
    if efficiency is not None and can_retime:
        return RETIME, (f"{arm.reason}; proven within the tolerance online: it is timed again beside "
                        f"{proof.baseline} before its time to accuracy is judged")
    tta = time_to_accuracy(proof.step_speedup, efficiency) if efficiency is not None else None
    if tta is None or not tta.lower() > 1:
        faster = f"{tta.describe()} vs {proof.baseline} (95% bounds)" if tta else "unreadable (fp32's curve is flat)"
        return GIVEN_UP, f"{arm.reason}; but its time to accuracy {faster} is not shown faster: not installed"
    return INSTALL, (f"{arm.reason}; time to accuracy {tta.describe()} vs {proof.baseline} (step speed-up "
                     f"{proof.step_speedup.describe()} x step efficiency, 95% bounds): proven online, installed")


def settle_retimed_proof(proof: PendingProof, arm, step: Estimate, standing: str) -> tuple[Decision | None, str]:
    """A plan proven online and timed again (``step``: its re-timed step speed-up over the baseline):
    the decision to install it, where its time to accuracy beats the baseline at the 95% bound
    (else None: ``standing``, the decision in use, stays), and the event's text."""
    tta = time_to_accuracy(step, arm.efficiency_estimate())
    said = (f"time to accuracy {tta.describe()} vs {proof.baseline} (re-timed step speed-up {step.describe()} x "
            f"step efficiency, 95% bounds; the race's {proof.step_speedup.describe()})")
    if not tta.lower() > 1:
        return None, f"{said}: not shown faster, not installed; {standing} stands"
    return dataclasses.replace(proof.decision, retimed=step, tta=tta,
                               reason=f"{proof.description}: proven online within the tolerance; {said}"), \
        f"{said}: proven online, installed"


def check_retrial_share(retrial_share) -> None:
    """Refuse a share of the training time for re-trials that is not in (0, 1] or None."""
    if retrial_share is not None and not (isinstance(retrial_share, (int, float)) and 0 < retrial_share <= 1):
        raise ValueError(f"retrial_share={retrial_share!r}; allowed: 0 < retrial_share <= 1 (of the training time), "
                         "or None for no re-trials")


def first_retrial_in(gate_args: dict, trial_steps: int | None, share: float) -> int:
    """Steps until the first re-trial: once training has paid for one at ``share`` of its time (the gate's
    step budget over its arms, else three arms of the first trial's length or of twice the shortest proof)."""
    steps = gate_args.get("budget_steps") or 3 * (trial_steps or 2 * gate.MIN_PROOF_STEPS)
    return math.ceil(steps / share)


class RetrialClock:
    """When the next paired re-trial is due: at step ``at``, then once training has run long enough
    since the last one that its cost is ``share`` of the training time.  Every rank holds the same
    schedule (the cost and step time are agreed: the slowest rank's)."""

    def __init__(self, at: int, share: float, group=None) -> None:
        self.at, self.share, self.group = at, share, group
        self._clock: float | None = None
        self._trained_s, self._trained_steps = 0.0, 0

    def due(self, step: int) -> bool:
        """Call at the start of every step: counts the training time, and says whether one is due now."""
        now = time.perf_counter()
        if self._clock is not None:
            self._trained_s, self._trained_steps = self._trained_s + now - self._clock, self._trained_steps + 1
        self._clock = now
        return step >= self.at

    def ran(self, step: int, started: float) -> float:
        """One ran from ``started`` (a ``perf_counter`` time) at ``step``: schedule the next; its cost in seconds."""
        cost_s, step_s = slowest([time.perf_counter() - started, self._trained_s / max(1, self._trained_steps)],
                                 self.group)
        self.at = step + max(1, math.ceil(cost_s / (self.share * max(step_s, 1e-9))))
        self._trained_s, self._trained_steps, self._clock = 0.0, 0, time.perf_counter()
        return cost_s


def check_fidelity_settings(sample, window, drift) -> None:
    """Refuse a bad fidelity monitor setting, naming it and the allowed values."""
    check_int("fidelity_sample", sample, 0)
    check_int("fidelity_window", window, 2)
    if not (isinstance(drift, (int, float)) and drift > 1):
        raise ValueError(f"fidelity_drift={drift!r}; allowed: > 1 (times the plan's first window error)")


def harm_shown(arm, report) -> float | None:
    """The 95% lower bound of a re-trialled plan's gap behind fp32 where it lies beyond the tolerance, else None."""
    if arm.gap is None:
        return None
    if not math.isfinite(arm.gap):
        return math.inf
    low = arm.gap - one_sided_z() * report.se
    return low if low > report.tolerance else None


def is_lossy(plan: Plan) -> bool:
    """Whether the plan uses a config beyond the baselines: the loss watch follows those."""
    return any(c.label not in BASELINES for c in plan.configs())


class FidelityDrift:
    """When a plan's delivered gradient has drifted: its first window (a
    :class:`~advisor.runtime.monitor.FidelityReading`) is its reference, and two windows in a row
    whose error exceeds ``drift`` times the reference (and :data:`FIDELITY_FLOOR`), with some
    config beyond that bound, have drifted.  One per plan: a new plan needs a new reference."""

    def __init__(self, drift: float) -> None:
        self.drift = drift
        self.reference: FidelityReading | None = None
        self._strikes = 0

    def see(self, reading: FidelityReading) -> tuple[str, dict[str, float]]:
        """(what to note, "" for nothing; the drifted configs' errors, empty until two windows in a row drifted)."""
        reference = self.reference
        if reference is None:
            self.reference, self._strikes = reading, 0
            return "reference " + reading.describe(), {}
        bound = max(self.drift * reference.error, FIDELITY_FLOOR)
        drifted = {label: e for label, e in reading.by_config.items() if e > bound}
        self._strikes = self._strikes + 1 if reading.error > bound and drifted else 0
        if self._strikes < 2:
            return "", {}
        return (f"{reading.describe()}: above {bound:.2%} ({self.drift:g}x the reference {reference.error:.2%}, "
                f"at least {FIDELITY_FLOOR:.0%}) two windows in a row; drifted: "
                + ", ".join(f"{label} {e:.2%}" for label, e in drifted.items())), drifted


class LossWatch:
    """Whether the training loss under a lossy plan has fallen behind its uncompressed trend.

    ``losses`` is the tuner's list of ``(step, loss, under a lossy plan)``, which it goes on
    appending to.  The first :meth:`check` with at least 4 uncompressed losses (from step 1)
    fits the trend ``a + b·ln(step)`` to their mean over ranks; each check compares the mean loss
    (over ranks) of the lossy steps in the last ``every`` with the trend's prediction, and two
    checks in a row above it by more than ``loss_z`` standard errors say the plan fell behind.
    Every rank must check at the same steps (it all-reduces), whatever it recorded.
    """

    def __init__(self, losses: list[tuple[int, float, bool]], *, every: int, loss_z: float, group=None) -> None:
        self.losses, self.every, self.loss_z, self.group = losses, every, loss_z, group
        self._trend: tuple[float, float, float] | None = None
        self._strikes = 0

    def check(self, step: int, lossy: bool) -> str:
        """At ``step``, under a plan that is ``lossy`` or not: the event's text where the loss fell behind
        two checks in a row (counting starts afresh), else ""."""
        if not lossy:
            self._strikes = 0
            return ""
        window = [(s, v) for s, v, under in self.losses if under and s > step - self.every - 1]
        baseline = [(s, v) for s, v, under in self.losses if not under and s >= 1]
        n_base, n_window = (int(n) for n in fastest([len(baseline), len(window)], self.group))
        if n_base < 4 or n_window < 1:
            return ""
        if self._trend is None:
            mean = mean_over_ranks([v for _, v in baseline[-n_base:]], self.group)
            self._trend = loss_trend([s for s, _ in baseline[-n_base:]], mean)
        a, b, sigma = self._trend
        window = window[-n_window:]
        observed = mean_over_ranks([sum(v for _, v in window) / n_window], self.group)[0]
        expected = sum(a + b * math.log(s + 1) for s, _ in window) / n_window
        bound = expected + self.loss_z * sigma / math.sqrt(n_window)
        self._strikes = self._strikes + 1 if observed > bound else 0
        if self._strikes < 2:
            return ""
        self._strikes = 0
        return (f"training loss {observed:.4g} over the last {n_window} steps vs {expected:.4g} expected from the "
                f"uncompressed steps' trend (bound {bound:.4g}, {self.loss_z:g} standard errors), two windows in a row")


class Watch:
    """Three checks that back the plan off one level where it loses.

    **Fidelity** (``monitor``, a :class:`~advisor.runtime.monitor.FidelityMonitor`): each of
    its windows measures how far the delivered mean was from the exact mean on a sample of
    coordinates.  The first window under a plan is its reference; two windows in a row whose
    error exceeds ``drift`` times the reference (and :data:`FIDELITY_FLOOR`) back off the
    configs that drifted.  **Re-trial** (``retrial``, where the accuracy gate has data): at
    step ``retrial_at`` and then as often as ``retrial_share`` of the training time pays
    for, the paired trial runs again from the current weights on shadow copies (``retrial(plan)
    -> (ArmResult, AccuracyTrialReport)``); a plan shown behind fp32 beyond the tolerance (the
    gap's 95% lower bound) backs off one level everywhere.  **Proof** (``proof``, a
    :class:`PendingProof`): where the first trial could not prove the plan that won the race,
    those slots go to proving it instead (``prove(proof) -> (ArmResult, report)``, a trial of up
    to ``proof.arm_steps`` steps an arm, twice as long at each try); once proven within the
    tolerance, ``retime(proof, arm)`` takes over where given (the tuner times it again beside
    the baseline, ends this watch and decides on that figure); without it, a plan faster to
    accuracy than the baseline at the 95% bound (its race speed-up times its step efficiency)
    is installed.  Rejected, or still not proven after :data:`MAX_PROOF_ATTEMPTS` tries, it is
    given up.  The next two run every ``every`` steps.

    **Gain** (GraVAC-style): the compression gain ``||C(g)|| / ||g||`` of each parameter under
    a lossy config, measured on that step's gradients and averaged over ranks, against the
    gain measured on the first watched step; a parameter whose gain fell below ``backoff``
    times its reference moves to the candidate sending the fewest bytes among those
    sending more.  **Loss**: the window's mean training loss (over ranks) against the trend
    ``a + b·ln(step)`` fitted to the uncompressed steps' losses; two windows in a row above
    it by more than ``loss_z`` standard errors back every compressed parameter off.

    ``losses`` is the tuner's list of ``(step, loss, under a lossy plan)``; ``note(what,
    detail)`` records an event.  ``first_in`` steps until the reference gain is measured
    (DDP rebuilds its buckets in the first steps); ``pending`` is a plan to switch to at
    step ``pending_at``, after the fp32 steps that set the loss trend.
    """

    name = WATCH

    def __init__(self, ddp: DistributedDataParallel, hook: CompressionHook, candidates: Sequence[str], *,
                 every: int, backoff: float | None, loss_z: float, losses: list[tuple[int, float, bool]],
                 note: Callable[[str, str], None], first_in: int = 1, pending: Plan | None = None,
                 pending_at: int = 0, monitor: FidelityMonitor | None = None, drift: float = 3.0,
                 retrial: Callable | None = None, retrial_at: int = 0, retrial_share: float = 0.03,
                 proof: PendingProof | None = None, prove: Callable | None = None, retime: Callable | None = None,
                 group=None) -> None:
        self.ddp, self.hook, self.candidates, self.group = ddp, hook, list(candidates), group
        self.monitor, self.drift = monitor, drift
        #: every window the fidelity monitor read, in order
        self.readings: list[FidelityReading] = []
        self._drift = FidelityDrift(drift)
        #: configs each parameter has backed off from (never chosen again for it)
        self._left: dict[str, set[str]] = {}
        self.retrial, self.retrial_share = retrial, retrial_share
        self._retrial_clock = RetrialClock(retrial_at, retrial_share, group)
        #: (step, plan digest, ArmResult) of every re-trial and online proof
        self.retrials: list = []
        self.proof, self.prove = (proof, prove) if retrial is not None else (None, None)
        self.retime = retime
        self.every, self.backoff, self.loss_z = every, backoff, loss_z
        self.losses, self.note = losses, note
        self.world = world_size(group)
        self._countdown = first_in
        self._pending, self._pending_at = pending, pending_at
        #: each parameter's gain right after the plan was set, and on the step being watched
        self._reference_gain: dict[str, float] = {}
        self._gains: dict[str, float] = {}
        self._gain_observer = None
        self._watching = False
        self._loss = LossWatch(losses, every=every, loss_z=loss_z, group=group)
        self._closed = False
        if monitor is not None:
            monitor.start()

    @property
    def plan(self) -> Plan:
        return self.hook.plan

    @property
    def next_trial_at(self) -> int:
        """The step of the next re-trial or online proof (where the watch has the accuracy gate's data)."""
        return self._retrial_clock.at

    def step_starts(self, step: int) -> None:
        if self._pending is not None and step == self._pending_at:
            self.hook.set_plan(self._pending, reason="the given plan, after the fp32 steps of the loss trend",
                               verify=False)
            self._pending = None
        if self.monitor is not None:
            reading = self.monitor.step_ends()
            if reading is not None:
                self._check_fidelity(reading)
        if self.retrial is not None:
            self._maybe_retrial(step)
            if self._closed:  # a proof handed the steps over to its re-timing
                return
        if self._watching:
            self._compare_gains()
            self._check_loss(step)
        self._countdown -= 1
        if self._countdown <= 0:
            self._measure_gains_on_this_step()
            self._countdown = self.every

    def close(self) -> None:
        self._closed = True
        self._stop_measuring_gains()
        if self.monitor is not None:
            self.monitor.close()

    def _stop_measuring_gains(self) -> None:
        if self._gain_observer in self.hook.observers:
            self.hook.observers.remove(self._gain_observer)

    # --- the fidelity monitor -----------------------------------------------------------------
    def _check_fidelity(self, reading: FidelityReading) -> None:
        """The plan's first window is its reference; two drifted windows in a row back off."""
        self.readings.append(reading)
        said, drifted = self._drift.see(reading)
        if said:
            self.note("fidelity", said)
        if drifted:
            params = [n for n, _ in self.ddp.module.named_parameters()]
            moves = {n: (0.0, 1.0) for n in params if self.plan.config_for(n).label in drifted}
            self._back_off(moves, why="its delivered gradient drifted from the exact mean")

    # --- the paired re-trial ------------------------------------------------------------------
    def _maybe_retrial(self, step: int) -> None:
        """At the scheduled step (the same on every rank), prove the pending plan or re-trial the plan in use."""
        now = time.perf_counter()
        if not self._retrial_clock.due(step):
            return
        if self.proof is not None:
            what, detail, then = "proof", *self._prove(step)
        elif any(c.name != "none" for c in self.plan.configs()):
            what, detail, then = "re-trial", *self._retrial(step)
        else:
            return
        cost_s = self._retrial_clock.ran(step, now)
        handed_over = what == "proof" and self.proof is None and then is not None and self.retime is not None
        self.note(what, f"{detail} (from the weights at step {step}; {cost_s:.1f} s" + (
            ")" if handed_over else f", next at step {self._retrial_clock.at})"))
        if then is not None:
            then()

    def _retrial(self, step: int):
        """The plan in use, trialled again: (what it showed, the back-off where it showed harm)."""
        plan = self.plan
        arm, report = self.retrial(plan)
        self.retrials.append((step, plan.digest(), arm))
        low = harm_shown(arm, report)
        if low is None:
            return arm.reason, None
        params = [n for n, _ in self.ddp.module.named_parameters()]
        moves = {n: (0.0, 1.0) for n in params if plan.config_for(n).name != "none"}
        why = f"the re-trial showed it {arm.gap:+.2%} behind fp32, at least {low:+.2%}"
        return arm.reason, lambda: self._back_off(moves, why=why)

    def _prove(self, step: int):
        """The pending plan, trialled for as long as the last trial said it needs: (what it showed,
        the switch to it where it was proven faster to accuracy)."""
        proof = self.proof
        proof.attempts += 1
        arm, report = self.prove(proof)
        self.retrials.append((step, proof.plan.digest(), arm))
        follows, detail = settle_proof(proof, arm, can_retime=self.retime is not None)
        if follows != AGAIN:
            self.proof = None
        if follows == RETIME:
            return detail, lambda: self.retime(proof, arm)
        if follows == INSTALL:
            return detail, lambda: self._set(proof.plan, reason=f"proven online: {proof.description}")
        return detail, None

    # --- the compression gain -------------------------------------------------------------
    def _measure_gains_on_this_step(self) -> None:
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
        self._watching = True

    def _compare_gains(self) -> None:
        self._watching = False
        self._stop_measuring_gains()
        keys = sorted(self._gains)
        if len(set(every_rank(len(keys), self.group))) > 1:
            raise RuntimeError("ranks watched different segments; plans differ between ranks")
        gains = dict(zip(keys, mean_over_ranks([self._gains[k] for k in keys], self.group))) if keys else {}
        if not self._reference_gain:
            self._reference_gain = dict(gains)
            if gains:
                by_config: dict[str, list[float]] = {}
                for name, gain in gains.items():
                    by_config.setdefault(self.plan.config_for(name).label, []).append(gain)
                self.note("watch", "reference compression gain (median over parameters) " + ", ".join(
                    f"{c}: {statistics.median(v):.3f}" for c, v in by_config.items()))
            return
        backoffs = {}
        for name, gain in gains.items():
            ref = self._reference_gain.get(name)
            if self.backoff is not None and ref is not None and gain < self.backoff * ref:
                backoffs[name] = (gain, ref)
        if backoffs:
            self._back_off(backoffs)

    # --- the loss -----------------------------------------------------------------------
    def _check_loss(self, step: int) -> None:
        """Two watch windows in a row above the uncompressed steps' loss trend: back off one level."""
        said = self._loss.check(step, is_lossy(self.plan))
        if not said:
            return
        params = [n for n, _ in self.ddp.module.named_parameters()]
        moves = {n: (0.0, 1.0) for n in params if self.plan.config_for(n).label not in ("none",)}
        self.note("loss-watch", said)
        self._back_off(moves, why="the loss fell behind its trend")

    # --- backing off ----------------------------------------------------------------------
    def _back_off(self, backoffs: dict[str, tuple[float, float]], why: str = "") -> None:
        """``backoffs``: {parameter name: (gain, reference gain)}; one level less compression each."""
        params = dict(self.ddp.module.named_parameters())
        assignments = {n: self.plan.config_for(n).label for n in params}
        moves: dict[tuple[str, str], list[float]] = {}
        for name, (gain, ref) in backoffs.items():
            current = self.plan.config_for(name)
            self._left.setdefault(name, set()).add(current.label)
            softer = self._less_compression(current, SegmentLayout((name,), (tuple(params[name].shape),)),
                                            self._left[name])
            assignments[name] = softer.label
            moves.setdefault((current.label, softer.label), []).append(gain / ref)
        new_plan = Plan.from_assignments({n: c for n, c in assignments.items() if c != "none"}, warmup_steps=0,
                                         kernel_forms=self.plan.kernel_forms)
        self._set(new_plan, reason="online back-off")
        if why:
            self.note("back-off", "; ".join(f"{a} -> {b} on {len(r)} parameter(s) ({why})"
                                            for (a, b), r in moves.items()))
            return
        self.note("back-off", "; ".join(
            f"{a} -> {b} on {len(r)} parameter(s) (gain fell to {min(r):.2f}-{max(r):.2f} of its reference; "
            f"threshold {self.backoff:g})" for (a, b), r in moves.items()))

    def _set(self, plan: Plan, reason: str) -> None:
        """Change the plan; its gains and fidelity are measured anew under it."""
        self.hook.set_plan(plan, reason=reason, verify=False)
        self._reference_gain.clear()  # measured again under the new plan on the next watch
        self._drift = FidelityDrift(self.drift)

    def _less_compression(self, current: CompressorConfig, layout: SegmentLayout,
                          left: set[str] = frozenset()) -> CompressorConfig:
        """The candidate sending the fewest bytes among those sending more than ``current``.

        fp16 goes to bf16 first, where bf16 is a candidate not yet left: the same bytes, and
        fp16's fault late in training is its range, which bf16 has.
        """
        if current.label == "fp16" and "bf16" in self.candidates and "bf16" not in left:
            return parse("bf16")

        def wire(config: CompressorConfig) -> int:
            return sum(w.nbytes for w in config.build().wire(layout, self.world))

        mine = wire(current)
        more = [c for c in (parse(c) for c in self.candidates) if wire(c) > mine and c.label not in left]
        return min(more, key=wire) if more else parse("none")
