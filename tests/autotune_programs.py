"""Programs the autotune tests run on every rank (module level, so spawn can import them)."""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

import advisor
from advisor.testbed.workloads import Workload, _cross_entropy, synthetic_batches


def medium_mlp() -> Workload:
    """2.1M parameters in 3 buckets of ~2.8 MB: communication-bound at 1 Gbit/s, quick to profile."""
    model = nn.Sequential(nn.Linear(512, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(),
                          nn.Linear(1024, 512), nn.ReLU(), nn.Linear(512, 10))
    return Workload(model, _cross_entropy, synthetic_batches((32, 512), 10), name="mlp-2.1M")


FAST = dict(trials=300, top=2, rounds=2, steps=3, warmup_steps=2)


def tune_and_train(rank: int, world_size: int, kwargs: dict):
    torch.manual_seed(0)
    workload = medium_mlp()
    ddp = DDP(workload.model, bucket_cap_mb=3)
    opt = workload.optimizer()
    before = {k: v.clone() for k, v in ddp.module.state_dict().items()}
    result = advisor.autotune(ddp, workload.loss_fn, workload.batches, opt, **{**FAST, **kwargs})
    unchanged = all(torch.equal(before[k], v) for k, v in ddp.module.state_dict().items())
    momentum_empty = len(opt.state) == 0
    # training goes on with whatever was installed, watched (every 2 steps after the plan's 2
    # warm-up steps) where a plan was
    watch = result.watch(ddp, opt, fidelity_window=2)
    losses = []
    for batch in list(workload.batches)[:6]:
        opt.zero_grad()
        loss = workload.loss_fn(ddp, batch)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    hook_steps = result.hook.step if result.hook is not None else None
    watched = [e.what for e in watch.events] if watch is not None else None
    if watch is not None:
        watch.close()
    if result.hook is not None:
        result.hook.close()
    result.hook = None
    return {"result": result, "unchanged": unchanged and momentum_empty, "losses": losses, "hook_steps": hook_steps,
            "watched": watched}


def switch_plans(rank: int, world_size: int):
    """Fixed weights and batch (same gradient g every step): 4 top-k steps, then plan none.

    Returns the sum of applied gradients after the switch step and 5·g.
    """
    from advisor.runtime import Plan, install

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4))
    ddp = DDP(model)
    hook = install(ddp, Plan.uniform("topk(ratio=0.05)", warmup_steps=0))
    x, y = torch.randn(16, 64), torch.randint(0, 4, (16,))
    applied = [torch.zeros_like(p) for p in model.parameters()]
    true = None
    for step in range(5):
        if step == 4:
            hook.set_plan(Plan.uniform("none", warmup_steps=0), reason="test")
        ddp.zero_grad()
        nn.functional.cross_entropy(ddp(x), y).backward()
        for a, p in zip(applied, model.parameters()):
            a += p.grad
    with ddp.no_sync():
        ddp.zero_grad()
        nn.functional.cross_entropy(ddp(x), y).backward()
        true = [5 * p.grad.clone() for p in model.parameters()]
    history = [reason for _, _, reason in hook.plan_history]
    hook.close()
    return applied, true, history


def online_loop(rank: int, world_size: int, steps: int, kwargs: dict):
    """The user's loop, unchanged, under advisor.wrap."""
    from advisor.runtime import Plan

    torch.manual_seed(0)
    workload = medium_mlp()
    ddp = DDP(workload.model, bucket_cap_mb=3)
    opt = workload.optimizer()
    if "plan" in kwargs:
        kwargs = {**kwargs, "plan": Plan.from_dict(kwargs["plan"])}
    tuner = advisor.wrap(ddp, opt, **kwargs)
    batches = list(workload.batches)
    losses = []
    for i in range(steps):
        x, y = batches[i % len(batches)]
        opt.zero_grad()
        loss = nn.functional.cross_entropy(ddp(x), y)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
        if i % 7 == 0:
            ddp.eval()
            with torch.no_grad():
                ddp(x)  # evaluation passes do not count as steps
            ddp.train()
    out = {"phase": tuner.phase, "events": [(e.step, e.what, e.detail) for e in tuner.events],
           "digest": tuner.plan.digest(), "plan": tuner.plan.to_dict(), "losses": losses, "steps": tuner.step}
    tuner.close()
    return out


def nan_on_rank_one(rank: int, world_size: int):
    """Plans measured live, one for smaller DDP buckets and one joining DDP's buckets: the caps of
    the shadows they ran on, and the layout of the plan each shadow's hook was installed with.
    Then rank 1's batches make the loss NaN: every rank must raise, none may hang."""
    from advisor.runtime import Plan
    from advisor.tuning import live
    from advisor.tuning.live import measure_plans

    torch.manual_seed(0)
    workload = medium_mlp()
    ddp = DDP(workload.model)
    opt = workload.optimizer()
    before = {k: v.clone() for k, v in ddp.module.state_dict().items()}
    batches = list(workload.batches)
    caps, installed, shadow_of, install = [], [], live.shadow_of, live.install

    def recording_shadow_of(*args):
        shadow, shadow_opt = shadow_of(*args)
        caps.append(shadow.bucket_bytes_cap)
        return shadow, shadow_opt

    def recording_install(model, plan, **kwargs):
        installed.append((plan.exchange_mb, plan.bucket_cap_mb))
        return install(model, plan, **kwargs)

    live.shadow_of, live.install = recording_shadow_of, recording_install
    try:
        measured = measure_plans(ddp, workload.loss_fn, batches, opt,
                                 {"fp16": Plan.uniform("fp16", warmup_steps=0),
                                  "fp16, 0.25 MiB buckets": Plan.uniform("fp16", warmup_steps=0, bucket_cap_mb=0.25),
                                  "fp16, 40 MiB exchanges": Plan.uniform("fp16", warmup_steps=0, exchange_mb=40),
                                  "bf16": Plan.uniform("bf16", warmup_steps=0)}, rounds=1, steps=1, warmup=1)
    finally:
        live.shadow_of, live.install = shadow_of, install
    smaller = {"caps": caps, "installed": installed, "labels": list(measured), "unchanged": all(
        torch.equal(before[k], v) for k, v in ddp.module.state_dict().items())}
    retimed = retime_a_plan(ddp, workload, batches, opt)
    if rank == 1:
        batches = [(torch.full_like(x, float("nan")), y) for x, y in batches]
    try:
        measure_plans(ddp, workload.loss_fn, batches, opt, {"fp16": Plan.uniform("fp16", warmup_steps=0)},
                      rounds=1, steps=2, warmup=1)
    except FloatingPointError as exc:
        restored = all(torch.equal(before[k], v) for k, v in ddp.module.state_dict().items())
        return {"error": str(exc), "restored": restored, "smaller": smaller, "retimed": retimed}
    return {"error": None, "smaller": smaller, "retimed": retimed}


def retime_a_plan(ddp, workload, batches, opt) -> dict:
    """autotune's re-timing of a proven plan: fp16 (as a compressed plan) alone beside native fp32."""
    from advisor.runtime import Plan
    from advisor.tuning.autotune import _measurer
    from advisor.tuning.steps import Arm, retimer
    from policies.do_no_harm import CANDIDATE, FP32, Decision
    from policies.evidence import Estimate

    class Proven:  # the accuracy trial's verdict: as efficient as fp32, within 1%
        def efficiency_estimate(self):
            return Estimate(1.0, 0.005, 20)

    arms = {"fp32": Arm("fp32", FP32, Plan.uniform("none", warmup_steps=0), None, "fp32", 0.01),
            "c": Arm("c", CANDIDATE, Plan.uniform("fp16", warmup_steps=0), None, "fp16 as a candidate", 0.01)}
    record, said = [], []
    retime = retimer(_measurer(ddp, workload.loss_fn, batches, opt, None, said.append), arms, turn=lambda arm: 2,
                     max_rounds=4, say=said.append, record=record)
    decision = Decision("c", CANDIDATE, True, "fp32", "c", 0.1, 3.0, "race", step=Estimate(3.0, 0.01, 2))
    estimate = retime(decision, Proven())
    return {"estimate": (estimate.value, estimate.lower(), estimate.upper(), estimate.dof), "record": record,
            "said": said}


def bad_wrap_arguments(rank: int, world_size: int):
    """Each bad argument raises ValueError naming it, and leaves the model without a hook."""
    from advisor.runtime import Plan

    ddp = DDP(medium_mlp().model)
    messages = []
    for kwargs in ({"observe_steps": 1}, {"backoff": 0}, {"candidates": ["zstd"]}, {"trial_steps": 0},
                   {"fidelity_sample": -1}, {"fidelity_window": 1}, {"fidelity_drift": 1.0}, {"retrial_share": 0}):
        try:
            advisor.wrap(ddp, **kwargs)
        except ValueError as exc:
            messages.append(str(exc))
    hook = advisor.install(ddp, Plan.uniform("fp16"))  # still possible: nothing was registered
    hook.close()
    return messages


def shadow_buckets(rank: int, world_size: int, ddp_kwargs: dict):
    """The bucket layouts of a DDP model and of the shadow copy plans are measured on."""
    from advisor.tuning.live import shadow_of
    from profilers.compute import ddp_buckets

    workload = medium_mlp()
    ddp = DDP(workload.model, **ddp_kwargs)
    shadow, _ = shadow_of(ddp, None)
    batch = list(workload.batches)[0]
    return [[b.parameters for b in ddp_buckets(m, workload.loss_fn, batch)] for m in (ddp, shadow)]


def loss_watched_loop(rank: int, world_size: int, steps: int, config: str, kwargs: dict, curve: str):
    """The digits loop under wrap with a given plan after fp32 steps that set the loss trend.

    It reports the real training loss (``curve="real"``) or a constructed one, so the detector is
    also tested on a known answer: ``"trend"`` follows 2 - 0.3·ln(step + 1) with noise
    throughout; ``"stall"`` follows it during the fp32 steps, then stays where it was."""
    from advisor.runtime import Plan
    from advisor.testbed.workloads import build_workload

    workload = build_workload("advisor.workloads:digits")
    ddp = DDP(workload.model)
    opt = workload.optimizer()
    tuner = advisor.wrap(ddp, opt, plan=Plan.uniform(config, warmup_steps=0), **kwargs)
    batches = list(workload.batches)
    for i in range(steps):
        opt.zero_grad()
        loss = workload.loss_fn(ddp, batches[(2 * i + rank) % len(batches)])
        loss.backward()
        opt.step()
        trend = 2.0 - 0.3 * math.log(i + 1) + 0.02 * math.sin(7.0 * i + rank)
        if curve == "stall" and i >= kwargs["trend_steps"]:
            trend = 2.0 - 0.3 * math.log(kwargs["trend_steps"]) + 0.02 * math.sin(7.0 * i + rank)
        tuner.record_loss(loss if curve == "real" else trend)
    out = {"events": [(e.step, e.what, e.detail) for e in tuner.events], "plan": tuner.plan.to_dict(),
           "digest": tuner.plan.digest()}
    tuner.close()
    return out


def gated_online_loop(rank: int, world_size: int, steps: int, kwargs: dict):
    """The digits loop under wrap with the accuracy gate (loss_fn and batches given)."""
    from advisor.testbed.workloads import build_workload

    workload = build_workload("advisor.workloads:digits")
    ddp = DDP(workload.model)
    opt = workload.optimizer()
    batches = list(workload.batches)
    tuner = advisor.wrap(ddp, opt, loss_fn=workload.loss_fn, batches=batches, evaluate=workload.evaluator(),
                         **kwargs)
    for i in range(steps):
        opt.zero_grad()
        loss = workload.loss_fn(ddp, batches[(2 * i + rank) % len(batches)])
        loss.backward()
        opt.step()
        tuner.record_loss(loss)
    report = tuner.accuracy
    out = {"events": [(e.step, e.what, e.detail) for e in tuner.events], "digest": tuner.plan.digest(),
           "plan": tuner.plan.to_dict(), "phase": tuner.phase,
           "arms": None if report is None else [(a.label, a.accepted, a.reason) for a in report.arms],
           "length": None if report is None else report.length_reason}
    tuner.close()
    return out


def bad_gate_arguments(rank: int, world_size: int):
    """Each incomplete accuracy-gate argument raises ValueError naming it; nothing is registered."""
    from advisor.runtime import Plan

    workload = medium_mlp()
    ddp = DDP(workload.model)
    opt = workload.optimizer()
    messages = []
    for args, kwargs in (((opt,), {"loss_fn": workload.loss_fn}),
                         ((), {"loss_fn": workload.loss_fn, "batches": workload.batches}),
                         ((opt,), {"loss_fn": workload.loss_fn, "batches": workload.batches, "trial_s": 0})):
        try:
            advisor.wrap(ddp, *args, **kwargs)
        except ValueError as exc:
            messages.append(str(exc))
    advisor.install(ddp, Plan.uniform("fp16")).close()  # still possible: nothing was registered
    return messages


def converging_step(model, teacher, opt, schedule, g) -> None:
    """One step of the converging regression: a fresh batch from ``g``, its loss scaled down so that
    the gradients fall below fp16's range as the student converges."""
    x = torch.randn(64, 64, generator=g)
    with torch.no_grad():
        y = teacher(x)
    opt.zero_grad()
    (nn.functional.mse_loss(model(x), y) * 1e-2).backward()
    opt.step()
    schedule.step()


def held_out_mse(student, teacher, x_test) -> float:
    with torch.no_grad():
        return float(nn.functional.mse_loss(student(x_test), teacher(x_test)))


def converging_regression(rank: int, world_size: int, steps: int, runs: list[tuple[str, int, bool]]):
    """A noiseless linear regression under AdamW whose gradients shrink by orders of magnitude as
    it converges: fp16 flushes them once they fall below its range, late, and stalls there.

    ``runs``: (plan label, fidelity_sample, installed) each trained from the same start on the
    same batches, under ``wrap(plan=...)``, or where ``installed`` under ``advisor.install``
    and then ``wrap(hook=...)`` (closed before the last 10 steps, which the hook runs alone);
    returns each run's held-out loss curve and events.
    """
    from advisor.runtime import Plan

    out = []
    x_test = torch.randn(512, 64, generator=torch.Generator().manual_seed(99))
    for label, sample, installed in runs:
        torch.manual_seed(0)
        teacher, student = nn.Linear(64, 16), nn.Linear(64, 16)
        ddp = DDP(student)
        opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2, weight_decay=0.0)
        schedule = torch.optim.lr_scheduler.CosineAnnealingLR(opt, steps)
        settings = dict(candidates=["none", "fp16", "bf16"], backoff=None, watch_every=10**6,
                        fidelity_sample=sample, fidelity_window=25)
        if installed:
            hook = advisor.install(ddp, Plan.uniform(label, warmup_steps=0))
            tuner = advisor.wrap(ddp, opt, hook=hook, **settings)
        else:
            tuner = advisor.wrap(ddp, opt, plan=Plan.uniform(label, warmup_steps=0), **settings)
        g = torch.Generator().manual_seed(1 + rank)
        curve, digest, final, events, readings = [], None, None, None, None
        for i in range(steps + 10 * installed):
            if i == steps:
                tuner.close()  # the installed hook goes on alone
            converging_step(ddp, teacher, opt, schedule, g)
            if (i + 1) % 50 == 0 and i < steps:
                curve.append(held_out_mse(student, teacher, x_test))
            if i == steps - 1:
                digest, final = tuner.plan.digest(), tuner.plan.config_for("weight").label
                events = [(e.step, e.what, e.detail) for e in tuner.events]
                readings = [(r.first_step, r.steps, r.error, r.step_error, r.zeroed) for r in tuner.fidelity]
        out.append({"plan": label, "sample": sample, "installed": installed, "curve": curve, "digest": digest,
                    "final": final, "events": events, "readings": readings,
                    "hook_steps": hook.step if installed else None})
        if not installed:
            tuner.close()
    return out


def wrong_hooks(rank: int, world_size: int):
    """wrap(hook=...) refuses what is not this model's CompressionHook, naming the fix."""
    from advisor.runtime import Plan

    ddp, other = DDP(nn.Linear(4, 2)), DDP(nn.Sequential(nn.Linear(4, 2)))
    hook = advisor.install(other, Plan.uniform("fp16"))
    messages = []
    for kwargs in ({"hook": hook}, {"hook": "fp16"}, {"hook": hook, "plan": Plan.uniform("fp16")}):
        try:
            advisor.wrap(ddp, **kwargs)
        except (TypeError, ValueError) as exc:
            messages.append(f"{type(exc).__name__}: {exc}")
    hook.close()
    return messages


def monitored_steps(rank: int, world_size: int, label: str, window: int):
    """A FidelityMonitor on a hook, driven by hand through two windows, with a step under ``no_sync``
    before each synchronised one; beside it, the first window's error computed by hand from
    every rank's whole gradients (the exact mean) and the whole delivered gradients."""
    import torch.distributed as dist

    from advisor.runtime import FidelityMonitor, Plan

    torch.manual_seed(0)
    workload = medium_mlp()
    ddp = DDP(workload.model)
    hook = advisor.install(ddp, Plan.uniform(label, warmup_steps=0))
    monitor = FidelityMonitor(hook, list(ddp.module.named_parameters()), sample=4096, window=window)
    monitor.start()
    batches = list(workload.batches)
    params = list(ddp.module.parameters())
    exact_sum = delivered_sum = 0
    readings = []
    for i in range(2 * window + 1):
        reading = monitor.step_ends()  # what wrap calls at the start of each step
        if reading is not None:
            readings.append(vars(reading))
        x, y = batches[(i + rank) % len(batches)]
        with ddp.no_sync():  # not synchronised: the monitor must not count it
            nn.functional.cross_entropy(ddp(x), y).backward()
        ddp.zero_grad()
        if i == 2 * window:
            break
        local = torch.autograd.grad(nn.functional.cross_entropy(ddp.module(x), y), params)
        exact = torch.cat([g.reshape(-1) for g in local])
        dist.all_reduce(exact)
        nn.functional.cross_entropy(ddp(x), y).backward()
        if i < window:
            exact_sum = exact_sum + exact / world_size
            delivered_sum = delivered_sum + torch.cat([p.grad.reshape(-1) for p in params])
        ddp.zero_grad()
    monitor.close()
    hook.close()
    return {"readings": readings, "whole_window_error": float((delivered_sum - exact_sum).norm() / exact_sum.norm())}


def retrialled_digits(rank: int, world_size: int, labels: list[str], steps: int):
    """The digits CNN under ``wrap(plan=...)`` with the accuracy gate's data and re-trials taking up to
    all of the training time (a trial of 100 steps an arm, so the first comes at step 300): each plan's
    re-trials, events and final plan."""
    from advisor.runtime import Plan
    from advisor.testbed.workloads import digits, shard

    out = {}
    for label in labels:
        torch.manual_seed(0)
        workload = digits()
        ddp = DDP(workload.model)
        opt = workload.optimizer()
        batches = list(shard(workload.batches, rank, world_size))
        tuner = advisor.wrap(ddp, opt, plan=Plan.uniform(label, warmup_steps=0), loss_fn=workload.loss_fn,
                             batches=batches, evaluate=workload.evaluate, expected_steps=6000, trial_share=0.05,
                             retrial_share=1.0, fidelity_sample=0, backoff=None, watch_every=10**6,
                             candidates=["none", "fp16", "bf16", "randomk(ratio=0.001, no-ef)"])
        for i in range(steps):
            opt.zero_grad()
            workload.loss_fn(ddp, batches[i % len(batches)]).backward()
            opt.step()
        out[label] = {"events": [(e.step, e.what, e.detail) for e in tuner.events], "final": tuner.plan.digest(),
                      "retrials": [(s, arm.gap, arm.status) for s, _, arm in tuner.retrials]}
        tuner.close()
    return out


def monitored_after_warmup(rank: int, world_size: int):
    """The first window of a plan with 3 warm-up steps starts after them: its error is the compressor's."""
    from advisor.runtime import FidelityMonitor, Plan

    torch.manual_seed(0)
    workload = medium_mlp()
    ddp = DDP(workload.model)
    hook = advisor.install(ddp, Plan.uniform("topk(ratio=0.05)", warmup_steps=3))
    monitor = FidelityMonitor(hook, list(ddp.module.named_parameters()), sample=1024, window=2)
    monitor.start()
    batches, readings = list(workload.batches), []
    for i in range(8):
        reading = monitor.step_ends()
        if reading is not None:
            readings.append((reading.first_step, reading.error))
        workload.loss_fn(ddp, batches[i % len(batches)]).backward()
        ddp.zero_grad()
    monitor.close()
    hook.close()
    return readings


def noisy_regression(teacher: nn.Module, rank: int):
    """The proving loops' data: ``batch(g)`` of the ``teacher`` regression (512 -> 256) with noise,
    ``loss_fn`` (MSE), this rank's endless stream of batches, and 4 held-out batches."""
    def batch(g):
        x = torch.randn(32, 512, generator=g)
        with torch.no_grad():
            return x, teacher(x) + 0.5 * torch.randn(32, 256, generator=g)

    def loss_fn(model, b):
        return nn.functional.mse_loss(model(b[0]), b[1])

    def stream():
        g = torch.Generator().manual_seed(100 + rank)
        while True:
            yield batch(g)

    return batch, loss_fn, stream(), [batch(torch.Generator().manual_seed(1000 + i)) for i in range(4)]


def proving_online_loop(rank: int, world_size: int, steps: int, kwargs: dict):
    """A noisy wide linear regression under wrap with the accuracy gate: learning is steady and two
    fp32 runs in different batch orders stay close, so a long enough trial is powered.

    Every batch is drawn from the same distribution; the gate gets this rank's stream of them
    and held-out batches of its own.
    """
    torch.manual_seed(0)
    teacher, student = nn.Linear(512, 256), nn.Linear(512, 256)
    ddp = DDP(student)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.02, momentum=0.9)
    batch, loss_fn, stream, held = noisy_regression(teacher, rank)
    tuner = advisor.wrap(ddp, opt, loss_fn=loss_fn, batches=stream, held_out=held, **kwargs)
    g = torch.Generator().manual_seed(rank)
    for _ in range(steps):
        opt.zero_grad()
        loss = loss_fn(ddp, batch(g))
        loss.backward()
        opt.step()
    out = {"events": [(e.step, e.what, e.detail) for e in tuner.events], "digest": tuner.plan.digest(),
           "plan": tuner.plan.to_dict(), "phase": tuner.phase,
           "history": [reason for _, _, reason in tuner.hook.plan_history],
           "retimed": [dataclasses.asdict(r) for r in tuner.retimed],
           "tta": None if tuner.decision is None or tuner.decision.tta is None else tuner.decision.tta.value,
           "step_speedup": None if tuner.decision is None else tuner.decision.step_speedup().value}
    tuner.close()
    return out


def proving_online_loops(rank: int, world_size: int, runs: list):
    """For each ``(kind, steps, kwargs)`` in turn, in one launch: :func:`proving_online_loop` where
    ``kind`` is ``"ddp"``, ``sharded_programs.sharded_proving_loop`` where it is ``"sharded"``."""
    from sharded_programs import sharded_proving_loop

    loops = {"ddp": proving_online_loop, "sharded": sharded_proving_loop}
    return [loops[kind](rank, world_size, steps, kwargs) for kind, steps, kwargs in runs]


#: the linear regression under wrap with the gate, two ways: a run of 4,000 steps, whose 2% is 80
#: trial steps over 4 arms, 20 an arm, under the 40 any proof needs; and a run of 40,000 steps,
#: whose first trial may take 800, enough to prove 8-bit quantisation at once
PROVING = {"observe_steps": 5, "trial_steps": 2, "trial_rounds": 2, "max_trial_rounds": 3, "top": 1, "trials": 200,
           "candidates": ["none", "qsgd(bits=8)"], "budget": 1.0, "fidelity_sample": 0}
TOO_SHORT = {**PROVING, "expected_steps": 4000, "retrial_share": 1.0}
LONG_ENOUGH = {**PROVING, "expected_steps": 40000, "retrial_share": None}
#: the same regression sharded (FSDP2) under wrap_sharded, long enough to prove 8-bit quantisation;
#: the race may take 6 rounds, as a 95% bound from 3 paired rounds (t = 4.3) can leave 8-bit's lead
#: unresolved, fp32 then kept and nothing proven or re-timed
SHARDED_LONG_ENOUGH = {"observe_steps": 3, "trial_steps": 2, "trial_rounds": 2, "max_trial_rounds": 6, "top": 1,
                       "repeats": 1, "candidates": ["none", "intquant(bits=8)"], "expected_steps": 40000,
                       "retrial_share": None}
#: ... and for a 4,000-step run, too short at first, as the DDP one
SHARDED_TOO_SHORT = {**SHARDED_LONG_ENOUGH, "expected_steps": 4000, "retrial_share": 1.0}
PROVING_RUNS = {"too short": ("ddp", 340, TOO_SHORT), "long enough": ("ddp", 110, LONG_ENOUGH),
                "sharded, long enough": ("sharded", 160, SHARDED_LONG_ENOUGH),
                "sharded, too short": ("sharded", 380, SHARDED_TOO_SHORT)}
