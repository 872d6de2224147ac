"""Programs the sharded (FSDP2) tests run on every rank (module level, so spawn can import them)."""

from __future__ import annotations

import torch
import torch.nn as nn


class Blocks(nn.Module):
    """Three blocks and a head: one fully_shard group each, and the root's."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(32, 48), nn.ReLU(), nn.Linear(48, 32)) for _ in range(3))
        self.head = nn.Linear(32, 10)

    def forward(self, x):
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)


def _sharded(seed: int = 0):
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    model = Blocks()
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    return model


def _batch(rank: int, step: int):
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(16, 32, generator=g), torch.randint(0, 10, (16,), generator=g)


def _local(tensor) -> torch.Tensor:
    return tensor.to_local().detach().clone() if hasattr(tensor, "to_local") else tensor.detach().clone()


def train_sharded(rank: int, world_size: int, plan_dict, steps: int, comm: str | None = None,
                  poison_step: int | None = None):
    """FSDP2 training under a plan (None: FSDP's own path; ``comm="exact"``: the all-to-all fp32
    reduce-scatter on every group); this rank's gradient shards after the first step, and its
    parameter shards and losses at the end.  ``poison_step``: at that step rank 1's batch holds a
    NaN, so every gradient it computes is NaN; ``nonfinite`` then counts the events per group."""
    from advisor.runtime import Plan
    from advisor.runtime.sharded import ExactReduceScatter, install_sharded, sharded_groups

    model = _sharded()
    groups = install_sharded(model, Plan.from_dict(plan_dict)) if plan_dict is not None else []
    if comm == "exact":
        for _, module, _ in sharded_groups(model):
            module.set_custom_reduce_scatter(ExactReduceScatter())
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    losses, first_grads = [], None
    for step in range(steps):
        x, y = _batch(rank, step)
        if step == poison_step and rank == 1:
            x[0, 0] = float("nan")
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        if first_grads is None:
            first_grads = {n: _local(p.grad) for n, p in model.named_parameters()}
        opt.step()
        losses.append(loss.item())
    full = {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}  # all-gathered on every rank
    return {"grads": first_grads, "params": {n: _local(p) for n, p in model.named_parameters()}, "losses": losses,
            "full": full, "nonfinite": {g.module: g.comm.nonfinite_events for g in groups if g.comm is not None}}


def full_batch_reference(rank: int, world_size: int, ranks: int):
    """One process, no sharding: the mean gradient over ``ranks`` ranks' batches (what data parallelism computes)."""
    torch.manual_seed(0)
    model = Blocks()
    model.zero_grad()
    losses = [nn.functional.cross_entropy(model(x), y) for x, y in (_batch(r, 0) for r in range(ranks))]
    (sum(losses) / ranks).backward()
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def install_expecting_errors(rank: int, world_size: int, cases: list[str]):
    """What install_sharded says to each bad set-up, on this rank (one launch for them all)."""
    return {case: install_expecting_error(rank, world_size, case) for case in cases}


def install_expecting_error(rank: int, world_size: int, case: str):
    """What install_sharded says to a bad set-up, on this rank."""
    from torch.distributed.fsdp import fully_shard

    from advisor.runtime import Plan
    from advisor.runtime.sharded import ExactReduceScatter, install_sharded

    model = _sharded()
    plan = Plan.uniform("bf16", warmup_steps=0)
    if case == "split group":
        plan = Plan.from_assignments({"blocks.0.0.weight": "bf16"}, default="fp16")
    elif case == "unsupported":
        plan = Plan.uniform("topk(ratio=0.01)")
    elif case == "comm already set":
        model.blocks[1].set_custom_reduce_scatter(ExactReduceScatter())
    elif case == "different plans":
        plan = Plan.uniform("bf16" if rank == 0 else "fp16")
    elif case == "not sharded":
        torch.manual_seed(0)
        from sharded_programs import Blocks as Plain
        model = Plain()
    elif case == "missing parameter":
        plan = Plan.from_assignments({"blocks.9.weight": "bf16"})
    del fully_shard
    try:
        install_sharded(model, plan)
    except (ValueError, TypeError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return "installed"


class WideBlocks(nn.Module):
    """Blocks wide enough that their reduce-scatters cost something: a student of a fixed teacher."""

    def __init__(self, dim: int = 64, hidden: int = 256) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(dim, hidden), nn.ReLU(), nn.Linear(hidden, dim))
                                    for _ in range(3))
        self.head = nn.Linear(dim, 10)

    def forward(self, x):
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)


def _wide_sharded(seed: int = 0):
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    model = WideBlocks()
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    return model


def _teacher_batches(rank: int, count: int, seed: int = 0):
    """Learnable batches: labels from a fixed random teacher."""
    teacher = nn.Sequential(nn.Linear(64, 32), nn.Tanh(), nn.Linear(32, 10))
    torch.manual_seed(1234)
    for p in teacher.parameters():
        nn.init.normal_(p, std=0.5)
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    out = []
    for _ in range(count):
        x = torch.randn(32, 64, generator=g)
        with torch.no_grad():
            out.append((x, teacher(x).argmax(dim=1)))
    return out


def _cross_entropy(model, batch):
    return nn.functional.cross_entropy(model(batch[0]), batch[1])


def autotune_wide(rank: int, world_size: int, kwargs: dict, build: str = "same"):
    """autotune_sharded on the wide blocks: the result, whether the model and optimizer ended as they
    began, the comms installed, and the parameters after training on under the advice."""
    from advisor.runtime.sharded import sharded_groups
    from advisor.tuning.sharded import ShardedAutotuneResult, autotune_sharded

    model = _wide_sharded()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    batches = _teacher_batches(rank, 48)
    first = batches[0]
    opt.zero_grad()
    _cross_entropy(model, first).backward()
    opt.step()  # momentum state to keep
    before = {n: _local(p) for n, p in model.named_parameters()}
    state = {n: _local(opt.state[p]["momentum_buffer"]) for n, p in model.named_parameters()}
    makers = {"same": _wide_sharded, "other": _sharded, "none": None}
    try:
        result = autotune_sharded(model, _cross_entropy, batches, opt, build=makers[build], **kwargs)
    except (ValueError, TypeError) as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}
    kept = all(torch.equal(before[n], _local(p)) for n, p in model.named_parameters()) and all(
        torch.equal(state[n], _local(opt.state[p]["momentum_buffer"])) for n, p in model.named_parameters())
    comms = {name: type(module._get_fsdp_state()._fsdp_param_groups[0]._reduce_scatter_comm).__name__
             for name, module, _ in sharded_groups(model)}
    for b in batches[:3]:
        opt.zero_grad()
        _cross_entropy(model, b).backward()
        opt.step()
    full = {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}
    again = ShardedAutotuneResult.from_json(result.to_json())
    return {"error": None, "result": result.to_dict(), "round_trip": again.to_dict() == result.to_dict(),
            "kept": kept, "comms": comms, "full": full, "summary": result.summary(),
            "retimed": _retime_bf16(model, opt, batches)}


def _retime_bf16(model, opt, batches) -> dict:
    """autotune_sharded's re-timing of a proven plan (bf16 as one) beside FSDP's own path, on the model itself."""
    from advisor.runtime import Plan
    from advisor.tuning.sharded import NATIVE, sharded_measurer
    from advisor.tuning.steps import Arm, retimer
    from policies.do_no_harm import CANDIDATE, FP32, Decision
    from policies.evidence import Estimate

    class Proven:
        def efficiency_estimate(self):
            return Estimate(1.0, 0.005, 20)

    arms = {NATIVE: Arm(NATIVE, FP32, Plan.uniform("none", warmup_steps=0), None, "fp32", float("nan")),
            "c": Arm("c", CANDIDATE, Plan.uniform("bf16", warmup_steps=0), None, "bf16 as a candidate", float("nan"))}
    record, said = [], []
    before = {n: _local(p) for n, p in model.named_parameters()}
    retime = retimer(sharded_measurer(model, _cross_entropy, batches[:4], opt, None, said.append), arms,
                     turn=lambda arm: 1, max_rounds=3, say=said.append, record=record)
    retime(Decision("c", CANDIDATE, True, NATIVE, "c", 0.1, 2.0, "race", step=Estimate(2.0, 0.01, 2)), Proven())
    kept = all(torch.equal(before[n], _local(p)) for n, p in model.named_parameters())
    return {"record": [(r.label, r.baseline, r.steps, len(r.plan_s), r.race_speedup) for r in record],
            "said": said, "kept": kept}


def powersgd_sharded(rank: int, world_size: int, batch: int, steps: int, error_feedback: bool = True):
    """FSDP2 training with PowerSGD rank 2 on every group (and, beside it, FSDP's own path): the
    first step's gradient shards of both, the comms' residual memory, and each model's parameters
    at the end, all-gathered."""
    from advisor.runtime import Plan
    from advisor.runtime.sharded import install_sharded

    config = "powersgd(rank=2)" if error_feedback else "powersgd(rank=2, no-ef)"
    out = {}
    for name, plan in (("fsdp", None), ("powersgd", Plan.uniform(config, warmup_steps=0))):
        model = _sharded()
        groups = install_sharded(model, plan) if plan is not None else []
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        losses, first = [], None
        for step in range(steps):
            x, y = _batch(rank, step)
            opt.zero_grad()
            loss = nn.functional.cross_entropy(model(x[:batch]), y[:batch])
            loss.backward()
            if first is None:
                first = {n: _local(p.grad) for n, p in model.named_parameters()}
            opt.step()
            losses.append(loss.item())
        out[name] = {"grads": first, "losses": losses,
                     "full": {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()},
                     "residual_bytes": sum(g.comm.residual_bytes for g in groups if g.comm is not None)}
    return out


def resume_powersgd(rank: int, world_size: int, directory: str):
    """Train 3 steps under PowerSGD with error feedback, checkpoint model and compression state with
    DCP, train 3 more; then, from the checkpoint, a fresh model with and without the compression
    state trains the same 3 steps.  Every run's parameters at the end, all-gathered."""
    import torch.distributed.checkpoint as dcp

    from advisor.runtime import Plan
    from advisor.runtime.sharded import compression_state_dict, install_sharded, load_compression_state_dict

    plan = Plan.uniform("powersgd(rank=2)", warmup_steps=0)

    def steps(model, first, count):
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        for step in range(first, first + count):
            x, y = _batch(rank, step)
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()

    def full(model):
        return {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}

    model = _sharded()
    install_sharded(model, plan)
    steps(model, 0, 3)
    dcp.save({"model": model.state_dict(), "compression": compression_state_dict(model)}, checkpoint_id=directory)
    steps(model, 3, 3)
    out = {"straight": full(model)}
    for name, with_state in (("resumed", True), ("resumed without residuals", False)):
        fresh = _sharded(seed=7)  # other weights: the checkpoint must bring them
        install_sharded(fresh, plan)
        state = {"model": fresh.state_dict(), "compression": compression_state_dict(fresh)}
        dcp.load(state, checkpoint_id=directory)
        fresh.load_state_dict(state["model"])
        if with_state:
            load_compression_state_dict(fresh, state["compression"])
        steps(fresh, 3, 3)
        out[name] = full(fresh)
    return out


def ddp_tuners_on_a_sharded_model(rank: int, world_size: int):
    """What autotune and wrap say to a sharded model, on this rank."""
    import advisor

    model = _sharded()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    said = []
    for call in (lambda: advisor.autotune(model, _cross_entropy, [_batch(rank, 0)], opt),
                 lambda: advisor.wrap(model, opt)):
        try:
            call()
        except TypeError as exc:
            said.append(str(exc))
    return said


def wrap_sharded_loop(rank: int, world_size: int, steps: int, kwargs: dict, gated: bool):
    """The user's loop over the wide blocks under wrap_sharded; what it did, on this rank."""
    import advisor

    model = _wide_sharded()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    batches = _teacher_batches(rank, 64)
    gate = {"loss_fn": _cross_entropy, "batches": batches[32:], "build": _wide_sharded} if gated else {}
    refused = None
    if gated:  # half a gate is refused before anything is installed
        try:
            advisor.wrap_sharded(model, opt, loss_fn=_cross_entropy)
        except ValueError as exc:
            refused = str(exc)
    try:
        tuner = advisor.wrap_sharded(model, opt, **gate, **kwargs)
    except (ValueError, TypeError) as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}
    for i in range(steps):
        opt.zero_grad()
        _cross_entropy(model, batches[i % 32]).backward()
        opt.step()
        if i % 10 == 0:
            model.eval()
            with torch.no_grad():
                model(batches[0][0])  # evaluation passes are not steps
            model.train()
    comms = {name or "(root)": type(m._get_fsdp_state()._fsdp_param_groups[0]._reduce_scatter_comm).__name__
             for name, m, _ in __import__("advisor.runtime.sharded", fromlist=["x"]).sharded_groups(model)}
    tuner.close()
    return {"error": None, "refused": refused, "phase": tuner.phase, "steps": tuner.step, "plan": tuner.plan.to_dict(),
            "events": [(e.step, e.what, e.detail) for e in tuner.events], "comms": comms,
            "measured": [m.label for m in tuner.measured], "accuracy": tuner.accuracy is not None,
            "full": {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}}


def _comm_kinds(model) -> list[str]:
    """The kinds of reduce-scatter comm the model's groups run."""
    from advisor.runtime.sharded import sharded_groups

    return sorted({type(m._get_fsdp_state()._fsdp_param_groups[0]._reduce_scatter_comm).__name__
                   for _, m, _ in sharded_groups(model)})


def loss_watched_sharded(rank: int, world_size: int, runs: list[tuple[str, str, int, dict]]):
    """For each ``(curve, config, steps, kwargs)``: wrap_sharded given ``config`` after the fp32 steps that
    set the loss trend, the loop reporting its real loss (``curve="real"``) or a constructed one, so
    the detector is also tested on a known answer: ``"trend"`` follows 2 - 0.3·ln(step + 1) with
    noise throughout; ``"stall"`` follows it during the fp32 steps, then stays where it was.
    Its events and the plan it ends with, per run."""
    import math

    import advisor
    from advisor.runtime import Plan

    out = []
    for curve, config, steps, kwargs in runs:
        model = _wide_sharded()
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        batches = _teacher_batches(rank, 64)
        tuner = advisor.wrap_sharded(model, opt, plan=Plan.uniform(config, warmup_steps=0), **kwargs)
        for i in range(steps):
            opt.zero_grad()
            loss = _cross_entropy(model, batches[(2 * i + rank) % len(batches)])
            loss.backward()
            opt.step()
            flat = kwargs["trend_steps"] if curve == "stall" and i >= kwargs["trend_steps"] else i + 1
            tuner.record_loss(loss if curve == "real" else 2.0 - 0.3 * math.log(flat) + 0.02 * math.sin(7.0 * i + rank))
        tuner.close()
        out.append({"events": [(e.step, e.what, e.detail) for e in tuner.events], "plan": tuner.plan.to_dict(),
                    "losses": len(tuner.losses)})
    return out


def powersgd_runs(rank: int, world_size: int, directory: str):
    """Every PowerSGD program the tests read, in one launch."""
    return {"one sample": powersgd_sharded(rank, world_size, 1, 6),
            "full batches, no error feedback": powersgd_sharded(rank, world_size, 16, 8, False),
            "resume": resume_powersgd(rank, world_size, directory)}


def retrialled_sharded(rank: int, world_size: int, labels: list[str], steps: int, lr: float = 0.1):
    """wrap_sharded given each plan in turn, re-trialled once training pays for it (retrial_share=1, the
    gate's budget 6% of a 2,000-step run): its events, re-trials, the plan it ends with and the comms."""
    import advisor
    from advisor.runtime import Plan

    out = {}
    for label in labels:
        model = _wide_sharded()
        opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
        batches = _teacher_batches(rank, 64)
        tuner = advisor.wrap_sharded(model, opt, plan=Plan.uniform(label, warmup_steps=0), loss_fn=_cross_entropy,
                                     batches=batches[32:], held_out=_teacher_batches(rank, 32, seed=7),
                                     build=_wide_sharded, retrial_share=1.0, expected_steps=2000, trial_share=0.06)
        for i in range(steps):
            opt.zero_grad()
            _cross_entropy(model, batches[i % 32]).backward()
            opt.step()
        tuner.close()
        out[label] = {"events": [(e.step, e.what, e.detail) for e in tuner.events],
                      "retrials": [(step, arm.gap, arm.status) for step, _, arm in tuner.retrials],
                      "plan": tuner.plan.to_dict(),
                      "comms": _comm_kinds(model)}
    return out


class _Regression(nn.Module):
    """A wide linear regression: one fully_shard group, the root's."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(512, 256)

    def forward(self, x):
        return self.linear(x)


def _regression_sharded(seed: int = 0):
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    model = _Regression()
    fully_shard(model)
    return model


def sharded_proving_loop(rank: int, world_size: int, steps: int, kwargs: dict):
    """A noisy wide linear regression, sharded, under wrap_sharded with the accuracy gate (as the DDP
    tests' ``proving_online_loop``): learning is steady, so a trial of a few hundred steps is powered.

    The gate gets this rank's endless stream of batches and held-out batches of its own.
    """
    import dataclasses

    from autotune_programs import noisy_regression

    import advisor

    model = _regression_sharded()
    opt = torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9)
    torch.manual_seed(1)
    batch, loss_fn, stream, held = noisy_regression(nn.Linear(512, 256), rank)
    tuner = advisor.wrap_sharded(model, opt, loss_fn=loss_fn, batches=stream, held_out=held,
                                 build=_regression_sharded, **kwargs)
    g = torch.Generator().manual_seed(rank)
    for _ in range(steps):
        opt.zero_grad()
        loss_fn(model, batch(g)).backward()
        opt.step()
    tuner.close()
    decision = tuner.decision
    return {"events": [(e.step, e.what, e.detail) for e in tuner.events], "phase": tuner.phase,
            "comms": _comm_kinds(model),
            "plan": tuner.plan.to_dict(), "retimed": [dataclasses.asdict(r) for r in tuner.retimed],
            "tta": None if decision is None or decision.tta is None else decision.tta.value,
            "step_speedup": None if decision is None else decision.step_speedup().value,
            "full": {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}}


class _WindowRecorder:
    """Watches the comms as the fidelity monitor does, but keeps every value: the whole window's error."""

    def __init__(self) -> None:
        self.inputs: dict[int, list[torch.Tensor]] = {}
        self.outputs: dict[int, list[torch.Tensor]] = {}

    def local(self, comm, rows):
        self.inputs.setdefault(id(comm), []).append(rows.detach().float().clone())

    def delivered(self, comm, output, avg):
        import torch.distributed as dist

        self.outputs.setdefault(id(comm), []).append(output.detach().float().clone() * (
            dist.get_world_size() if avg else 1))

    def window_error(self, comms, first: int, steps: int) -> float:
        """``||delivered - exact|| / ||exact||`` of the window's summed reduce-scatters, over every group's
        whole buffer (every rank's delivered row gathered)."""
        import torch.distributed as dist

        errors, norms = 0.0, 0.0
        for comm in comms:
            exact = torch.stack(self.inputs[id(comm)][first:first + steps]).sum(0)
            dist.all_reduce(exact)
            mine = torch.stack(self.outputs[id(comm)][first:first + steps]).sum(0).reshape(-1)
            rows = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
            dist.all_gather(rows, mine)
            got = torch.stack(rows)
            errors += float((got - exact).pow(2).sum())
            norms += float(exact.pow(2).sum())
        return (errors / norms) ** 0.5


def monitored_sharded(rank: int, world_size: int, window: int, windows: int):
    """The wide blocks under a mixed plan (8-bit, PowerSGD rank 2, fp16, the root's group FSDP's own),
    watched by the sharded fidelity monitor and by a recorder that keeps every value; a step
    without gradient sync after every other one.  Each reading beside the whole window's error."""
    import advisor.runtime.sharded as rs
    from advisor.runtime import Plan
    from advisor.runtime.sharded_monitor import ShardedFidelityMonitor

    model = _wide_sharded()
    configs = {"blocks.0": "intquant(bits=8)", "blocks.1": "powersgd(rank=2)", "blocks.2": "fp16"}
    plan = Plan.from_assignments({n: configs[n[:8]] for n, _ in model.named_parameters() if n[:8] in configs},
                                 warmup_steps=0)
    groups = rs.install_sharded(model, plan)
    monitor = ShardedFidelityMonitor(groups, sample=4096, window=window)
    recorder = _WindowRecorder()
    watched = [g.comm for g in groups if g.comm is not None]
    for comm in watched:
        comm.watchers.append(recorder)
    monitor.start()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    batches = _teacher_batches(rank, 8)
    readings, synced = [], 0
    for i in range(2 * window * windows):
        unsynced = i % 2 == 1
        model.set_requires_gradient_sync(not unsynced)
        _cross_entropy(model, batches[i % 8]).backward()
        if not unsynced:
            opt.step()
            opt.zero_grad()
            synced += 1
        reading = monitor.step_ends()
        if reading is not None:
            readings.append({**reading.__dict__, "whole": recorder.window_error(watched, synced - window, window)})
    monitor.close()
    return {"readings": readings, "watchers": [len(c.watchers) for c in watched],
            "labels": sorted({g.config.label for g in groups})}


def converging_sharded(rank: int, world_size: int, steps: int, runs: list[tuple[str, int]]):
    """The DDP tests' noiseless regression under AdamW (``autotune_programs.converging_regression``),
    sharded: its gradients shrink by orders of magnitude, and fp16 flushes them late.

    ``runs``: (plan label, fidelity_sample), each trained from the same start on the same batches
    under ``wrap_sharded(plan=...)``; each run's held-out loss every 50 steps, events, readings and
    the plan it ended with."""
    from autotune_programs import converging_step, held_out_mse
    from torch.distributed.fsdp import fully_shard

    import advisor
    from advisor.runtime import Plan

    out = []
    x_test = torch.randn(512, 64, generator=torch.Generator().manual_seed(99))
    for label, sample in runs:
        torch.manual_seed(0)
        teacher, student = nn.Linear(64, 16), nn.Linear(64, 16)
        fully_shard(student)
        opt = torch.optim.AdamW(student.parameters(), lr=1e-2, weight_decay=0.0)
        schedule = torch.optim.lr_scheduler.CosineAnnealingLR(opt, steps)
        tuner = advisor.wrap_sharded(student, opt, plan=Plan.uniform(label, warmup_steps=0),
                                     fidelity_sample=sample, fidelity_window=25)
        g = torch.Generator().manual_seed(1 + rank)
        curve = []
        for i in range(steps):
            converging_step(student, teacher, opt, schedule, g)
            if (i + 1) % 50 == 0:
                curve.append(held_out_mse(student, teacher, x_test))
        tuner.close()
        out.append({"plan": label, "sample": sample, "curve": curve, "final": tuner.plan.default.label,
                    "events": [(e.step, e.what, e.detail) for e in tuner.events],
                    "readings": [(r.first_step, r.steps, r.error, r.zeroed) for r in tuner.fidelity]})
    return out


def sharded_monitor_runs(rank: int, world_size: int):
    """Every program the sharded monitor's tests read, in one launch."""
    return {"windows": monitored_sharded(rank, world_size, 4, 2),
            "converging": converging_sharded(rank, world_size, 400, [("none", 2048), ("bf16", 2048),
                                                                      ("fp16", 0), ("fp16", 2048)])}
