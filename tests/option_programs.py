"""The DDP option matrix: each training set-up users write, under plain DDP and under the hook.

One spawned job runs every case (process launches are the expensive part); each case
trains the same seeded model three times from the same weights on the same batches:
plain DDP, the hook with plan ``none`` (must be bitwise DDP) and the hook with a plan that
mixes every compressor family (every rank must end with identical parameters, and the loss
must stay finite and near DDP's).
"""

from __future__ import annotations

import contextlib
import hashlib

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

import advisor
from advisor.runtime import Plan

#: one config of every family, assigned to parameters in turn
FAMILIES = ["fp16", "powersgd(rank=2)", "topk(ratio=0.1)", "intquant(bits=8)", "qsgd(bits=4)", "signsgd",
            "randomk(ratio=0.25)", "bf16"]


class Net(nn.Module):
    """A 3-layer MLP with the pieces the options need: a branch used on some steps only, an
    unused head, BatchNorm."""

    def __init__(self, batchnorm: bool = False, unused: bool = False, sometimes: bool = False) -> None:
        super().__init__()
        self.l1, self.l2, self.l3 = nn.Linear(16, 32), nn.Linear(32, 32), nn.Linear(32, 4)
        self.bn = nn.BatchNorm1d(32) if batchnorm else None
        self.unused = nn.Linear(32, 4) if unused else None
        self.branch = nn.Linear(32, 32) if sometimes else None

    def forward(self, x: torch.Tensor, use_branch: bool = True) -> torch.Tensor:
        h = torch.relu(self.l1(x))
        if self.bn is not None:
            h = self.bn(h)
        if self.branch is not None and use_branch:
            h = h + torch.relu(self.branch(h))
        return self.l3(torch.relu(self.l2(h)))


def _batches(rank: int, n: int, dtype=torch.float32):
    g = torch.Generator().manual_seed(100 + rank)
    return [(torch.randn(8, 16, generator=g).to(dtype), torch.randint(0, 4, (8,), generator=g)) for _ in range(n)]


def _digest(module: nn.Module) -> str:
    h = hashlib.sha256()
    for p in module.parameters():
        h.update(p.detach().float().contiguous().numpy().tobytes())
    return h.hexdigest()


def _net(case: dict) -> Net:
    """The case's model, the same weights every time (seeded), frozen and cast as the case says."""
    torch.manual_seed(0)
    net = Net(case.get("batchnorm", False), case.get("unused", False), case.get("sometimes", False))
    if case.get("frozen"):
        net.l1.requires_grad_(False)
    return net.to(case.get("dtype", torch.float32))


def _train(case: dict, plan: Plan | None, steps: int) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    dtype = case.get("dtype", torch.float32)
    net = _net(case)
    ddp = DDP(net, **case.get("ddp", {}))
    hook = advisor.install(ddp, plan) if plan is not None else None
    params = [p for p in ddp.parameters() if p.requires_grad]
    if case.get("groups"):
        opt = torch.optim.SGD([{"params": params[:2], "lr": 0.05}, {"params": params[2:], "lr": 0.1}], momentum=0.9)
    else:
        opt = torch.optim.SGD(params, lr=0.1, momentum=0.9)
    batches = _batches(rank, steps - (1 if case.get("uneven") and rank == 1 else 0), dtype)
    accumulate = 2 if case.get("no_sync") else 1
    losses = []
    join = ddp.join() if case.get("uneven") else contextlib.nullcontext()
    with join:
        for i, (x, y) in enumerate(batches):
            opt.zero_grad()
            autocast = torch.autocast("cpu", dtype=torch.bfloat16) if case.get("autocast") else contextlib.nullcontext()
            for micro in range(accumulate):
                sync = ddp.no_sync() if micro < accumulate - 1 else contextlib.nullcontext()
                with sync, autocast:
                    out = ddp(x, use_branch=i % 2 == 0) if case.get("sometimes") else ddp(x)
                    loss = nn.functional.cross_entropy(out.float(), y)
                loss.backward()
            if case.get("clip"):
                torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            if case.get("log_loss"):
                logged = loss.detach().clone()
                dist.all_reduce(logged)  # the user's own collective between steps
                losses.append(float(logged) / world)
            else:
                losses.append(float(loss.detach()))
    digests: list = [None] * world
    dist.all_gather_object(digests, _digest(ddp.module))
    if hook is not None:
        hook.close()
    return {"digest": digests[rank], "ranks_agree": len(set(digests)) == 1, "losses": losses}


def _mixed_plan(case: dict) -> Plan:
    names = [n for n, p in _net(case).named_parameters() if p.requires_grad]
    return Plan.from_assignments({n: FAMILIES[i % len(FAMILIES)] for i, n in enumerate(names)}, warmup_steps=1)


def option_matrix(rank: int, world: int, cases: dict, steps: int = 6) -> dict:
    """Every case's three arms, or the error it raised (the same on every rank, or it would hang)."""
    results = {}
    for name, case in cases.items():
        try:
            ddp_run = _train(case, None, steps)
            none_run = _train(case, Plan.uniform("none", warmup_steps=0), steps)
            mixed_run = _train(case, _mixed_plan(case), steps)
            results[name] = {"none_bitwise": none_run["digest"] == ddp_run["digest"],
                             "ranks_agree": ddp_run["ranks_agree"] and none_run["ranks_agree"]
                             and mixed_run["ranks_agree"],
                             "ddp_losses": ddp_run["losses"], "mixed_losses": mixed_run["losses"], "error": None}
        except Exception as exc:  # reported, so the test names the case and the message
            results[name] = {"error": f"{type(exc).__name__}: {exc}"}
    return results


def autotune_matrix(rank: int, world: int, cases: dict, steps: int = 3) -> dict:
    """``advisor.autotune`` (quick settings, no accuracy trial) then a few training steps, per case."""
    import time

    results = {}
    for name, case in cases.items():
        t0 = time.perf_counter()
        try:
            ddp = DDP(_net(case), **case.get("ddp", {}))
            opt = torch.optim.SGD([p for p in ddp.parameters() if p.requires_grad], lr=0.1, momentum=0.9)
            batches = _batches(rank, 4, case.get("dtype", torch.float32))

            def loss_fn(model, batch):
                x, y = batch
                return nn.functional.cross_entropy(model(x).float(), y)

            result = advisor.autotune(ddp, loss_fn, batches, opt, candidates=["none", "fp16", "powersgd(rank=2)",
                                                                            "topk(ratio=0.1)"],
                                      budget=10.0, accuracy_trial=False, trials=60, top=1, rounds=1, steps=2,
                                      warmup_steps=0)
            losses = []
            for x, y in batches[:steps]:
                opt.zero_grad()
                loss = loss_fn(ddp, (x, y))
                loss.backward()
                opt.step()
                losses.append(float(loss.detach()))
            digests: list = [None] * world
            dist.all_gather_object(digests, _digest(ddp.module))
            if result.hook is not None:
                result.hook.close()
            results[name] = {"error": None, "advice": result.recommendation, "ranks_agree": len(set(digests)) == 1,
                             "losses": losses, "seconds": time.perf_counter() - t0}
        except Exception as exc:
            import traceback

            results[name] = {"error": f"{type(exc).__name__}: {exc}", "seconds": time.perf_counter() - t0,
                             "where": traceback.format_exc()[-1500:]}
    return results


def sparse_refusal(rank: int, world: int) -> str:
    """install on a model with a sparse embedding: the error each rank raised (before any step)."""
    model = nn.Sequential(nn.Embedding(10, 4, sparse=True), nn.Linear(4, 2))
    ddp = DDP(model)
    try:
        advisor.install(ddp, Plan.uniform("fp16"))
    except ValueError as exc:
        nn.functional.cross_entropy(ddp(torch.tensor([[1, 2]])).sum(1), torch.tensor([0])).backward()
        return str(exc)  # and plain DDP still trains it: nothing was registered
    return ""
