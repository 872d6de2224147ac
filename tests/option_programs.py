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


AUTOCAST = {"bf16": torch.bfloat16, "fp16": torch.float16}


def _batches(rank: int, n: int, dtype=torch.float32, device="cpu"):
    g = torch.Generator().manual_seed(100 + rank)
    return [(torch.randn(8, 16, generator=g).to(device, dtype), torch.randint(0, 4, (8,), generator=g).to(device))
            for _ in range(n)]


def _digest(module: nn.Module) -> str:
    h = hashlib.sha256()
    for p in module.parameters():
        h.update(p.detach().float().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def _net(case: dict) -> Net:
    """The case's model, the same weights every time (seeded), frozen and cast as the case says."""
    torch.manual_seed(0)
    net = Net(case.get("batchnorm", False), case.get("unused", False), case.get("sometimes", False))
    if case.get("frozen"):
        net.l1.requires_grad_(False)
    if case.get("sync_batchnorm"):
        net = nn.SyncBatchNorm.convert_sync_batchnorm(net)
    net = net.to(case.get("device", "cpu"), case.get("dtype", torch.float32))
    if case.get("compile"):
        # aot_eager traces with dynamo and AOTAutograd, where DDP's graph splitting at bucket
        # boundaries happens, without inductor's C++ build (20 s a model on this machine)
        return torch.compile(net, backend=case["compile"])
    return net


def _optimizer(case: dict, params: list) -> torch.optim.Optimizer:
    if case.get("groups"):
        return torch.optim.SGD([{"params": params[:2], "lr": 0.05}, {"params": params[2:], "lr": 0.1}], momentum=0.9)
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def _loop(case: dict, ddp: DDP, opt, steps: int, after_step=None) -> tuple[list[float], int]:
    """The case's training loop: ``steps`` steps (rank r makes r fewer for uneven inputs).

    Returns the losses and how many steps the GradScaler skipped."""
    rank, world = dist.get_rank(), dist.get_world_size()
    # PyTorch's recommended order compiles the DDP model (dynamo then splits graphs at bucket boundaries)
    model = torch.compile(ddp, backend=case["compile_ddp"]) if case.get("compile_ddp") else ddp
    params = [p for p in ddp.parameters() if p.requires_grad]
    device = case.get("device", "cpu")
    batches = _batches(rank, steps - (rank if case.get("uneven") else 0), case.get("dtype", torch.float32), device)
    accumulate = 2 if case.get("no_sync") else 1
    # fp16 autocast goes with a GradScaler whose first scales overflow: the skipped steps must
    # leave the hook's residuals and the ranks' weights intact
    scaler = torch.amp.GradScaler(torch.device(device).type, init_scale=case["scaler"]) if case.get("scaler") else None
    losses, skipped = [], 0
    join = ddp.join() if case.get("uneven") else contextlib.nullcontext()
    with join:
        for i, (x, y) in enumerate(batches):
            opt.zero_grad()
            autocast = (torch.autocast(torch.device(device).type, dtype=AUTOCAST[case["autocast"]])
                        if case.get("autocast") else contextlib.nullcontext())
            for micro in range(accumulate):
                sync = ddp.no_sync() if micro < accumulate - 1 else contextlib.nullcontext()
                with sync, autocast:
                    out = model(x, use_branch=i % 2 == 0) if case.get("sometimes") else model(x)
                    loss = nn.functional.cross_entropy(out.float(), y)
                (scaler.scale(loss) if scaler else loss).backward()
            if case.get("clip"):
                if scaler:
                    scaler.unscale_(opt)
                torch.nn.utils.clip_grad_norm_(params, 1.0)
            if scaler:
                scale = scaler.get_scale()
                scaler.step(opt)
                scaler.update()
                skipped += scaler.get_scale() < scale  # the scaler halves its scale on a skipped step
            else:
                opt.step()
            if after_step is not None:
                after_step(loss)
            if case.get("log_loss"):
                logged = loss.detach().clone()
                dist.all_reduce(logged)  # the user's own collective between steps
                losses.append(float(logged) / world)
            else:
                losses.append(float(loss.detach()))
    return losses, skipped


def _ranks_agree(ddp: DDP) -> tuple[str, bool]:
    digests: list = [None] * dist.get_world_size()
    dist.all_gather_object(digests, _digest(ddp.module))
    return digests[dist.get_rank()], len(set(digests)) == 1


def _train(case: dict, plan: Plan | None, steps: int) -> dict:
    ddp = DDP(_net(case), **case.get("ddp", {}))
    hook = advisor.install(ddp, plan) if plan is not None else None
    losses, skipped = _loop(case, ddp, _optimizer(case, [p for p in ddp.parameters() if p.requires_grad]), steps)
    digest, agree = _ranks_agree(ddp)
    residual = hook.residual_norm() if hook is not None else 0.0
    if hook is not None:
        hook.close()
    return {"digest": digest, "ranks_agree": agree, "losses": losses, "skipped": skipped, "residual": residual}


def wrap_matrix(rank: int, world: int, cases: dict, steps: int = 30) -> dict:
    """``advisor.wrap`` inside each case's own loop, twice: tuning (quick settings; it must decide)
    and watching the mixed plan (gains and loss every 5 steps, fidelity every 4; backing off switches plans)."""
    results = {}
    for name, case in cases.items():
        for mode, options, count in (
                ("tune", {"candidates": ["none", "fp16", "powersgd(rank=2)", "topk(ratio=0.1)"], "observe_steps": 3,
                          "trial_steps": 2, "trial_rounds": 2, "max_trial_rounds": 3, "top": 1, "trials": 60,
                          "budget": 10.0}, steps),
                ("watch", {"plan": _mixed_plan(case), "trend_steps": 3, "watch_every": 5, "fidelity_window": 4}, 16)):
            try:
                ddp = DDP(_net(case), **case.get("ddp", {}))
                opt = _optimizer(case, [p for p in ddp.parameters() if p.requires_grad])
                tuner = advisor.wrap(ddp, opt, **options)
                losses, _ = _loop(case, ddp, opt, count, after_step=tuner.record_loss)
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
                             "ddp_losses": ddp_run["losses"], "mixed_losses": mixed_run["losses"],
                             "skipped": [ddp_run["skipped"], none_run["skipped"], mixed_run["skipped"]],
                             "mixed_residual": mixed_run["residual"], "error": None}
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
            batches = _batches(rank, 4, case.get("dtype", torch.float32), case.get("device", "cpu"))

            def loss_fn(model, batch):
                x, y = batch
                return nn.functional.cross_entropy(model(x).float(), y)

            result = advisor.autotune(ddp, loss_fn, batches, opt, candidates=["none", "fp16", "powersgd(rank=2)",
                                                                            "topk(ratio=0.1)"],
                                      budget=10.0, accuracy_trial=False, trials=60, top=1, rounds=1, steps=2,
                                      warmup_steps=0)
            losses, _ = _loop(case, ddp, opt, steps)
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


class SparseNet(nn.Module):
    """An embedding with sparse gradients (a bucket of its own in DDP) and a dense head."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(50, 8, sparse=True)
        self.head = nn.Linear(8, 4)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.emb(tokens).mean(1))


def sparse_matrix(rank: int, world: int, steps: int = 6) -> dict:
    """Plain DDP, plan ``none`` and a lossy plan on a model with a sparse embedding gradient."""
    g = torch.Generator().manual_seed(200 + rank)
    batches = [(torch.randint(0, 50, (8, 5), generator=g), torch.randint(0, 4, (8,), generator=g))
               for _ in range(steps)]
    runs = {}
    for name, plan in (("ddp", None), ("none", Plan.uniform("none", warmup_steps=0)),
                       ("lossy", Plan.uniform("powersgd(rank=2)", warmup_steps=1))):
        torch.manual_seed(0)
        ddp = DDP(SparseNet())
        hook = advisor.install(ddp, plan) if plan is not None else None
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        losses = []
        for x, y in batches:
            opt.zero_grad()
            loss = nn.functional.cross_entropy(ddp(x), y)
            loss.backward()
            opt.step()
            losses.append(float(loss.detach()))
        digest, agree = _ranks_agree(ddp)
        runs[name] = {"digest": digest, "ranks_agree": agree, "losses": losses,
                      "wire_bytes": hook._executor.channel.bytes_sent if hook is not None else 0}
        if hook is not None:
            hook.close()
    # autotune and wrap leave the sparse embedding out of the search and tune the dense rest
    loss_fn = lambda model, batch: nn.functional.cross_entropy(model(batch[0]), batch[1])  # noqa: E731
    torch.manual_seed(0)
    ddp = DDP(SparseNet())
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    result = advisor.autotune(ddp, loss_fn, batches, opt, candidates=["none", "fp16", "topk(ratio=0.1)"],
                              budget=10.0, accuracy_trial=False, trials=50, top=1, rounds=1, steps=2)
    runs["autotune"] = {"advice": result.recommendation,
                        "searched_numel": sum(b.numel for b in result.buckets)}
    torch.manual_seed(0)
    ddp = DDP(SparseNet())
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    tuner = advisor.wrap(ddp, opt, candidates=["none", "fp16"], observe_steps=3, trial_steps=2, trial_rounds=2,
                         max_trial_rounds=3, top=1, trials=50, budget=10.0)
    for i in range(24):
        opt.zero_grad()
        loss_fn(ddp, batches[i % len(batches)]).backward()
        opt.step()
    runs["wrap"] = {"events": [e.what for e in tuner.events], "ranks_agree": _ranks_agree(ddp)[1]}
    tuner.close()
    return runs
