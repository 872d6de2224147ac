"""Programs the distributed tests run on every rank (module level, so spawn can import them)."""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

from advisor.runtime import Plan, install

# A tiny bucket cap so the model below gets one bucket per weight matrix (>= 8 buckets).
BUCKET_CAP_MB = 0.005


class ManyBucketNet(nn.Module):
    """Conv + 1-D params + Linear layers of different shapes: 10 buckets at the cap above."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 8, 3, padding=1)
        self.norm = nn.LayerNorm(8 * 8 * 8)
        self.fc1 = nn.Linear(512, 64)
        self.fc2 = nn.Linear(64, 96)
        self.fc3 = nn.Linear(96, 64)
        self.fc4 = nn.Linear(64, 80)
        self.fc5 = nn.Linear(80, 64)
        self.fc6 = nn.Linear(64, 72)
        self.fc7 = nn.Linear(72, 64)
        self.head = nn.Linear(64, 10)

    def forward(self, x):
        x = torch.relu(self.conv(x)).flatten(1)
        x = self.norm(x)
        for layer in (self.fc1, self.fc2, self.fc3, self.fc4, self.fc5, self.fc6, self.fc7):
            x = torch.relu(layer(x))
        return self.head(x)


MIXED = {
    "conv.weight": "qsgd(bits=4)",
    "fc1.weight": "powersgd(rank=2)",
    "fc2.weight": "topk(ratio=0.05)",
    "fc3.weight": "intquant(bits=4)",
    "fc4.weight": "signsgd",
    "fc5.weight": "randomk(ratio=0.1)",
    "fc6.weight": "fp16",
    "fc7.weight": "bf16",
    "head.weight": "powersgd(rank=1)",
    "fc7.bias": "intquant(bits=8)",
    "fc6.bias": "intquant(bits=8, packed=0)",  # float16 carrier: gloo has no int16
    "fc5.bias": "intquant(bits=4, packed=0)",  # int8 carrier
}


def mixed_plan(warmup_steps: int = 0) -> Plan:
    return Plan.from_assignments(MIXED, warmup_steps=warmup_steps)


def make_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return ManyBucketNet()


def batch(rank: int, step: int, size: int = 16):
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(size, 1, 8, 8, generator=g)
    y = torch.randint(0, 10, (size,), generator=g)
    return x, y


def _ddp(model):
    return DDP(model, bucket_cap_mb=BUCKET_CAP_MB)


def _params(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def train(ddp, opt, rank, start, steps):
    losses = []
    for step in range(start, start + steps):
        x, y = batch(rank, step)
        opt.zero_grad(set_to_none=True)
        loss = nn.functional.cross_entropy(ddp(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def train_with_plan(rank: int, world_size: int, plan_dict, steps: int):
    """Train with a plan; return params, losses, bucket count, residual norms over time."""
    model = make_model()
    ddp = _ddp(model)
    hook = install(ddp, Plan.from_dict(plan_dict)) if plan_dict is not None else None
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    losses, residual_norms = [], []
    for step in range(steps):
        losses += train(ddp, opt, rank, step, 1)
        if hook is not None:
            residual_norms.append(hook.residual_norm())
    buckets = len(ddp._get_ddp_logging_data().get("rebuilt_bucket_sizes", "").split(", "))
    return {
        "params": _params(model),
        "losses": losses,
        "buckets": buckets,
        "residual_norms": residual_norms,
        "hook_step": hook.step if hook else None,
    }


def grads_after_one_step(rank: int, world_size: int, plan_dict):
    """Gradients DDP leaves after two backward passes (the second uses rebuilt buckets)."""
    model = make_model()
    ddp = _ddp(model)
    if plan_dict is not None:
        install(ddp, Plan.from_dict(plan_dict))
    for step in range(2):
        ddp.zero_grad(set_to_none=True)
        x, y = batch(rank, step)
        nn.functional.cross_entropy(ddp(x), y).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def checkpoint_resume(rank: int, world_size: int, plan_dict, first: int, second: int):
    """Train ``first`` steps, checkpoint everything, rebuild, train ``second`` more."""
    model = make_model()
    ddp = _ddp(model)
    hook = install(ddp, Plan.from_dict(plan_dict))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    train(ddp, opt, rank, 0, first)
    saved = {
        "model": {k: v.clone() for k, v in model.state_dict().items()},
        "opt": opt.state_dict(),
        "hook": hook.state_dict(),
    }
    hook.close()
    # a fresh process would start here: new model, new DDP, new hook
    model2 = make_model(seed=123)
    model2.load_state_dict(saved["model"])
    ddp2 = _ddp(model2)
    hook2 = install(ddp2, Plan.from_dict(plan_dict))
    hook2.load_state_dict(saved["hook"])
    opt2 = torch.optim.SGD(model2.parameters(), lr=0.05, momentum=0.9)
    opt2.load_state_dict(saved["opt"])
    train(ddp2, opt2, rank, first, second)
    return _params(model2)


def uninterrupted(rank: int, world_size: int, plan_dict, steps: int):
    model = make_model()
    ddp = _ddp(model)
    install(ddp, Plan.from_dict(plan_dict))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    train(ddp, opt, rank, 0, steps)
    return _params(model)


def install_expecting_error(rank: int, world_size: int, plan_dicts_by_rank):
    """Install the plan given for this rank; report the error raised, if any."""
    model = make_model()
    ddp = _ddp(model)
    try:
        install(ddp, plan_dicts_by_rank[rank])
    except ValueError as exc:
        # the ranks must still be able to talk after a refused plan
        t = torch.ones(1)
        dist.all_reduce(t)
        return {"error": str(exc), "alive": float(t)}
    return {"error": None}


class _Capture(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record) -> None:
        self.messages.append(record.getMessage())


def nonfinite_step(rank: int, world_size: int, plan_dict, bad_rank: int, bad_step: int, steps: int):
    """Put a NaN into fc1.weight's gradient on one rank at one step; keep training.

    Like a loss scaler would, a step whose gradients are not finite is skipped.
    """
    capture = _Capture()
    logging.getLogger("advisor.runtime").addHandler(capture)
    model = make_model()
    ddp = _ddp(model)
    hook = install(ddp, Plan.from_dict(plan_dict))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    current = {"step": -1}

    def poison(grad):
        if rank == bad_rank and current["step"] == bad_step:
            grad = grad.clone()
            grad[0, 0] = float("nan")
        return grad

    model.fc1.weight.register_hook(poison)
    finite_steps, report = [], {}
    for step in range(steps):
        current["step"] = step
        x, y = batch(rank, step)
        opt.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(ddp(x), y).backward()
        grads_finite = {n: bool(torch.isfinite(p.grad).all()) for n, p in model.named_parameters()}
        if step == bad_step:
            report["grads_finite_at_bad_step"] = grads_finite
            report["residuals_at_bad_step"] = hook.state_dict()["residuals"]
        if all(grads_finite.values()):
            opt.step()
            finite_steps.append(step)
    report.update(
        finite_steps=finite_steps,
        warnings=capture.messages,
        events=hook.nonfinite_events,
        params_finite=all(bool(torch.isfinite(p).all()) for p in model.parameters()),
        params=_params(model),
        residuals_end=hook.state_dict()["residuals"],
    )
    return report


def count_collectives(rank: int, world_size: int, plan_dict, steps: int):
    model = make_model()
    ddp = _ddp(model)
    hook = install(ddp, Plan.from_dict(plan_dict))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    train(ddp, opt, rank, 0, steps)
    return {"channel": type(hook.channel).__name__, "params": _params(model), "step": hook.step}


def fail_on_rank(rank: int, world_size: int, bad_rank: int):
    """One rank raises while the other waits in a collective: the launcher must not hang."""
    if rank == bad_rank:
        raise RuntimeError("boom")
    t = torch.ones(1)
    dist.all_reduce(t)
    return float(t)


def hang_on_rank(rank: int, world_size: int, bad_rank: int):
    """One rank never reaches the collective its peer waits in."""
    import time

    if rank == bad_rank:
        time.sleep(3600)
    t = torch.ones(1)
    dist.all_reduce(t)
    return float(t)


def hook_lifetime(rank: int, world_size: int):
    """The channel's worker ends with a ``with`` block, and when the DDP model holding the hook is collected."""
    import gc
    import pickle
    import threading

    from advisor.tuning.results import TunedResult

    def workers() -> int:
        return sum(t.name == "advisor-comm" and t.is_alive() for t in threading.enumerate())

    def one_step(ddp) -> None:
        x, y = batch(rank, 0)
        nn.functional.cross_entropy(ddp(x), y).backward()

    out = {"before": workers()}
    scoped = _ddp(make_model())
    with install(scoped, mixed_plan()):
        one_step(scoped)
        out["inside_with"] = workers()
    out["after_with"] = workers()
    ddp = _ddp(make_model())
    hook = install(ddp, mixed_plan())
    one_step(ddp)
    out["running"] = workers()
    result = TunedResult.__new__(TunedResult)  # what autotune returns
    result.__dict__.update({"hook": hook, "reason": "r"})
    out["pickled_hook"] = pickle.loads(pickle.dumps(result)).hook
    del ddp, hook, result
    gc.collect()
    out["after_collect"] = workers()
    return out


def train_counting_messages(rank: int, world_size: int, plan_dict, steps: int):
    """Train with a plan (None: DDP without a hook); params, losses and the messages the hook sent a step."""
    model = make_model()
    ddp = _ddp(model)
    hook = install(ddp, Plan.from_dict(plan_dict)) if plan_dict is not None else None
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    losses = train(ddp, opt, rank, 0, 2)  # the second step runs DDP's rebuilt buckets
    sent = hook.channel.messages_sent if hook is not None else 0
    losses += train(ddp, opt, rank, 2, steps - 2)
    per_step = (hook.channel.messages_sent - sent) / (steps - 2) if hook is not None else None
    return {"params": _params(model), "losses": losses, "messages_per_step": per_step,
            "hook_step": hook.step if hook is not None else None}


def built_for_layout(rank: int, world_size: int, plan_dict, steps: int, finer_mb: float):
    """``advisor.ddp_for`` with a plan that exchanges buckets together: DDP's cap, the plan installed, params;
    then with a plan for smaller buckets (``finer_mb``): DDP's cap, its rebuilt buckets against the
    performance model's for that cap, and the warnings of installing that plan on DDP built otherwise."""
    import warnings

    import advisor
    from advisor.perfmodel.buckets import buckets_for_cap
    from profilers.compute import profile_compute

    model = make_model()
    ddp, hook = advisor.ddp_for(model, Plan.from_dict(plan_dict))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    losses = train(ddp, opt, rank, 0, steps)
    refused = ""
    try:
        advisor.ddp_for(make_model(), Plan.from_dict(plan_dict), bucket_cap_mb=25)
    except ValueError as exc:
        refused = str(exc)
    out = {"params": _params(model), "losses": losses, "bucket_bytes_cap": ddp.bucket_bytes_cap,
           "installed_exchange_mb": hook.plan.exchange_mb, "refused": refused}

    finer = Plan.uniform("fp16", warmup_steps=0, bucket_cap_mb=finer_mb)
    with warnings.catch_warnings(record=True) as built_warnings:
        warnings.simplefilter("always")
        small, _ = advisor.ddp_for(make_model(), finer)
    profile = profile_compute(small, lambda m, b: nn.functional.cross_entropy(m(b[0]), b[1]),
                              [batch(rank, s) for s in range(4)], steps=2, warmup=1)
    with warnings.catch_warnings(record=True) as other_warnings:
        warnings.simplefilter("always")
        advisor.install(DDP(make_model()), finer)
    return {**out, "finer_cap": small.bucket_bytes_cap,
            "finer_buckets": [b.parameters for b in profile.buckets],
            "modelled_buckets": [b.parameters for b in buckets_for_cap(profile.parameters, finer_mb)],
            "finer_warnings": [str(w.message) for w in built_warnings],
            "other_warnings": [str(w.message) for w in other_warnings]}
