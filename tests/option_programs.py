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
    net = net.to(case.get("dtype", torch.float32))
    if case.get("compile"):
        # aot_eager traces with dynamo and AOTAutograd, where DDP's graph splitting at bucket
        # boundaries happens, without inductor's C++ build (20 s a model on this machine)
        return torch.compile(net, backend=case["compile"])
    return net


def _optimizer(case: dict, params: list) -> torch.optim.Optimizer:
    if case.get("groups"):
        return torch.optim.SGD([{"params": params[:2], "lr": 0.05}, {"params": params[2:], "lr": 0.1}], momentum=0.9)
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def _loop(case: dict, ddp: DDP, opt, steps: int, after_step=None) -> list[float]:
    """The case's training loop: ``steps`` steps (rank r makes r fewer for uneven inputs)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    # PyTorch's recommended order compiles the DDP model (dynamo then splits graphs at bucket boundaries)
    model = torch.compile(ddp, backend=case["compile_ddp"]) if case.get("compile_ddp") else ddp
    params = [p for p in ddp.parameters() if p.requires_grad]
    batches = _batches(rank, steps - (rank if case.get("uneven") else 0), case.get("dtype", torch.float32))
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
                    out = model(x, use_branch=i % 2 == 0) if case.get("sometimes") else model(x)
                    loss = nn.functional.cross_entropy(out.float(), y)
                loss.backward()
            if case.get("clip"):
                torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            if after_step is not None:
                after_step(loss)
            if case.get("log_loss"):
                logged = loss.detach().clone()
                dist.all_reduce(logged)  # the user's own collective between steps
                losses.append(float(logged) / world)
            else:
                losses.append(float(loss.detach()))
    return losses


def _ranks_agree(ddp: DDP) -> tuple[str, bool]:
    digests: list = [None] * dist.get_world_size()
    dist.all_gather_object(digests, _digest(ddp.module))
    return digests[dist.get_rank()], len(set(digests)) == 1


def _train(case: dict, plan: Plan | None, steps: int) -> dict:
    ddp = DDP(_net(case), **case.get("ddp", {}))
    hook = advisor.install(ddp, plan) if plan is not None else None
    losses = _loop(case, ddp, _optimizer(case, [p for p in ddp.parameters() if p.requires_grad]), steps)
    digest, agree = _ranks_agree(ddp)
    if hook is not None:
        hook.close()
    return {"digest": digest, "ranks_agree": agree, "losses": losses}


def wrap_matrix(rank: int, world: int, cases: dict, steps: int = 30) -> dict:
    """``advisor.wrap`` inside each case's own loop, twice: tuning (quick settings; it must decide)
    and watching the mixed plan (gains and loss every 5 steps; backing off switches plans)."""
    results = {}
    for name, case in cases.items():
        for mode, options, count in (
                ("tune", {"candidates": ["none", "fp16", "powersgd(rank=2)", "topk(ratio=0.1)"], "observe_steps": 3,
                          "trial_steps": 2, "top": 1, "trials": 60, "budget": 10.0}, steps),
                ("watch", {"plan": _mixed_plan(case), "trend_steps": 3, "watch_every": 5}, 16)):
            try:
                ddp = DDP(_net(case), **case.get("ddp", {}))
                opt = _optimizer(case, [p for p in ddp.parameters() if p.requires_grad])
                tuner = advisor.wrap(ddp, opt, **options)
                losses = _loop(case, ddp, opt, count, after_step=tuner.record_loss)
                digest, agree = _ranks_agree(ddp)
                tuner.close()
                results[f"{name}, {mode}"] = {"error": None, "ranks_agree": agree, "losses": losses,
                                              "plan": tuner.plan.digest(),
                                              "events": [f"{e.what}: {e.detail}" for e in tuner.events]}
            except Exception as exc:  # reported, so the test names the case and the message
                results[f"{name}, {mode}"] = {"error": f"{type(exc).__name__}: {exc}"}
    return results


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
    """``advisor.autotune`` (quick settings, no accuracy trial), then the case's own loop, per case."""
    import time

    results = {}
    for name, case in cases.items():
        t0 = time.perf_counter()
        try:
            ddp = DDP(_net(case), **case.get("ddp", {}))
            opt = _optimizer(case, [p for p in ddp.parameters() if p.requires_grad])
            batches = _batches(rank, 4, case.get("dtype", torch.float32))

            def loss_fn(model, batch):
                x, y = batch
                return nn.functional.cross_entropy(model(x).float(), y)

            result = advisor.autotune(ddp, loss_fn, batches, opt, candidates=["none", "fp16", "powersgd(rank=2)",
                                                                            "topk(ratio=0.1)"],
                                      budget=10.0, accuracy_trial=False, trials=60, top=1, rounds=1, steps=2,
                                      warmup_steps=0)
            losses = _loop(case, ddp, opt, steps)
            _, agree = _ranks_agree(ddp)
            if result.hook is not None:
                result.hook.close()
            results[name] = {"error": None, "advice": result.recommendation, "ranks_agree": agree,
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
