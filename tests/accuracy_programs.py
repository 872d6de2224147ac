"""Programs the accuracy tests run on every rank (module level, so spawn can import them)."""

from __future__ import annotations

import math

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from advisor.runtime import Plan
from advisor.testbed.workloads import build_workload
from advisor.tuning.accuracy import AccuracyTrial

DIGITS = "advisor.workloads:digits"


def _state(model, opt):
    return ({k: v.clone() for k, v in model.state_dict().items()},
            {id(p): {k: v.clone() if torch.is_tensor(v) else v for k, v in s.items()} for p, s in opt.state.items()})


def _same(a, b) -> bool:
    (ma, oa), (mb, ob) = a, b
    if ma.keys() != mb.keys() or oa.keys() != ob.keys():
        return False
    if not all(torch.equal(ma[k], mb[k]) for k in ma):
        return False
    return all(torch.equal(v, ob[p][k]) if torch.is_tensor(v) else v == ob[p][k]
               for p, s in oa.items() for k, v in s.items())


def _digits_with_history(steps: int = 3):
    return _with_history(DIGITS, steps)


def _with_history(spec: str, steps: int = 3):
    """The workload, its DDP and an optimizer that has already stepped (momentum state to copy)."""
    workload = build_workload(spec)
    ddp = DDP(workload.model)
    opt = workload.optimizer()
    for batch in workload.batches[:steps]:
        opt.zero_grad()
        workload.loss_fn(ddp, batch).backward()
        opt.step()
    return workload, ddp, opt


def trial_plans(rank: int, world: int, plans: dict, options: dict, spec: str = DIGITS):
    """Trial each plan (``{label: (config, kind)}``) against fp32 on ``spec``; the report, and whether
    the user's model and optimizer kept their state."""
    from advisor.testbed.workloads import shard

    workload, ddp, opt = _with_history(spec)
    before = _state(ddp.module, opt)
    trial = AccuracyTrial(ddp, workload.loss_fn, shard(workload.batches, rank, world), opt,
                          evaluate=workload.evaluator(), **options)
    trial.start()
    for label, (config, kind) in plans.items():
        trial.trial(label, Plan.uniform(config, warmup_steps=0), kind)
    return {"report": trial.report(), "unchanged": _same(before, _state(ddp.module, opt))}


def failing_evaluate(rank: int, world: int, how: str):
    """An evaluate that raises (on rank 1 only) or returns NaN (on every rank); the error and the state after."""
    workload, ddp, opt = _digits_with_history()
    before = _state(ddp.module, opt)
    real = workload.evaluator()

    def evaluate(model):
        if how == "raises" and rank == 1:
            raise RuntimeError("held-out loader is gone")
        if how == "nan":
            return {"loss": math.nan}
        if how == "no-loss":
            return {"accuracy": real(model)["accuracy"]}
        return real(model)

    trial = AccuracyTrial(ddp, workload.loss_fn, workload.batches, opt, evaluate=evaluate)
    try:
        trial.start()
        error = None
    except ValueError as exc:
        error = str(exc)
    return {"error": error, "unchanged": _same(before, _state(ddp.module, opt))}


def autotune_digits(rank: int, world: int, kwargs: dict):
    """autotune on digits with its held-out evaluation; the result, and the state of the user's model after."""
    import advisor

    workload, ddp, opt = _digits_with_history()
    before = _state(ddp.module, opt)
    result = advisor.autotune(ddp, workload.loss_fn, workload.batches, opt, evaluate=workload.evaluator(),
                              install_plan=False, **kwargs)
    return {"result": result, "unchanged": _same(before, _state(ddp.module, opt))}


def checkpoints_twice(rank: int, world: int, spec: str, first_evaluation_s: float):
    """The fp32 pair's checkpoints in trials of the same data from the same weights: twice judged by the
    held-out loss (counted in steps), then once by the workload's evaluate whose first call alone takes
    ``first_evaluation_s`` longer (a cold cache, a lazy import).  Each as (checkpoints, the cost of an
    evaluation in steps, how that cost was found)."""
    import time

    from advisor.testbed.workloads import shard

    workload, ddp, opt = _with_history(spec)
    real, calls = workload.evaluator(), []

    def slow_at_first(model):
        calls.append(1)
        if len(calls) == 1:
            time.sleep(first_evaluation_s)
        return real(model)

    out = []
    for kwargs in ({"held_out": workload.held_out}, {"held_out": workload.held_out}, {"evaluate": slow_at_first}):
        trial = AccuracyTrial(ddp, workload.loss_fn, shard(workload.batches, rank, world), opt, max_steps=24,
                              time_budget_s=None, **kwargs)
        report = trial.start()
        out.append((report.checkpoints, report.evaluation_steps, report.evaluation_cost))
    return out


def _digits_with_batchnorm():
    """The digits workload with a BatchNorm layer: running statistics DDP broadcasts from rank 0."""
    import torch.nn as nn

    workload = build_workload(DIGITS)
    torch.manual_seed(0)
    workload.model = nn.Sequential(nn.Flatten(), nn.Linear(64, 128), nn.BatchNorm1d(128), nn.ReLU(), nn.Linear(128, 10))
    return workload


def exchange_free_beside_ddp(rank: int, world: int, batchnorm: bool, steps: int):
    """The same trial twice, its arms on DDP shadows and then exchange-free; each report's curves.

    The exchange-free trial also trains a lossy plan (on a real DDP shadow, beside the others)."""
    from advisor.testbed.workloads import shard
    from policies import accuracy_gate as gate

    workload = _digits_with_batchnorm() if batchnorm else build_workload(DIGITS)
    ddp = DDP(workload.model)
    opt = workload.make_optimizer(ddp.module.parameters())
    for batch in shard(workload.batches, rank, world)[:2]:
        opt.zero_grad()
        workload.loss_fn(ddp, batch).backward()
        opt.step()
    before = _state(ddp.module, opt)
    out = {}
    for free in (False, True):
        trial = AccuracyTrial(ddp, workload.loss_fn, shard(workload.batches, rank, world), opt,
                              held_out=workload.held_out, max_steps=steps, time_budget_s=None, judge_unpowered=True,
                              exchange_free=free)
        report = trial.start()
        trial.trial("fp16", Plan.uniform("fp16", warmup_steps=0), gate.SIXTEEN_BIT)
        if free:
            trial.trial("powersgd", Plan.uniform("powersgd(rank=1)", warmup_steps=0), gate.CANDIDATE)
        out[free] = report
    return {"real": out[False], "free": out[True], "unchanged": _same(before, _state(ddp.module, opt))}


def _regression():
    """A noisy linear regression in large batches that two batch orders learn alike: a trial of it is
    powered in a few dozen steps and fp32 still improves for hundreds."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(16, 1, generator=g)
    xs = torch.randn(1024 * 256, 16, generator=g)
    ys = xs @ w + 3.0 * torch.randn(len(xs), 1, generator=g)
    batches = list(zip(xs.split(256), ys.split(256), strict=True))
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 1)
    return model, batches[:-4], batches[-4:]


def _regression_trial(rank: int, world: int, options: dict):
    """The fp32 pair of a trial on the regression, started with ``options``: its report."""
    from advisor.testbed.workloads import shard

    model, train, held = _regression()
    ddp = DDP(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.001, momentum=0.9)

    def loss_fn(m, batch):
        return torch.nn.functional.mse_loss(m(batch[0]), batch[1])

    trial = AccuracyTrial(ddp, loss_fn, shard(train, rank, world), opt, held_out=held, time_budget_s=None, **options)
    return trial.start()


def trial_lengths(rank: int, world: int, runs: list[dict]):
    """The fp32 pair's length and why, for each set of AccuracyTrial options, on the regression."""
    out = []
    for options in runs:
        report = _regression_trial(rank, world, options)
        out.append({"steps": report.steps, "powered": report.powered, "why": report.length_reason,
                    "needed": report.steps_needed, "checkpoints": report.checkpoints,
                    "detectable": report.detectable})
    return out


def powered_at_the_last_checkpoint_only(rank: int, world: int):
    """A trial long enough to be powered twice in a row, then the same trial with a step budget that
    ends it at the checkpoint where it was first powered: the second one's report."""
    import re

    options = {"max_steps": 400, "horizon": 22_500, "arms_expected": 6}
    long = _regression_trial(rank, world, options)
    twice = int(re.search(r"first powered at step (\d+)", long.length_reason).group(1))
    once = long.checkpoints[long.checkpoints.index(twice) - 1]
    short = _regression_trial(rank, world, {**options, "budget_steps": once * 6})
    return {"once": once, "steps": short.steps, "powered": short.powered, "why": short.length_reason,
            "powered_once": short.powered_once, "would_prove": short.what_would_prove()}
