"""Programs the profiler tests run on every rank (module level, so spawn can import them)."""

from __future__ import annotations

import os

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from advisor.testbed.workloads import Workload, mlp, small_cnn
from profilers.compute import profile_compute
from profilers.network import profile_network, time_reductions, time_step_rounds
from profilers.profile import CollectiveFit


def network_only(rank: int, world_size: int):
    return profile_network(collectives=("all_reduce",))


def loopback_all_reduce(rank: int, world_size: int):
    return profile_network(collectives=("all_reduce",), max_bytes=16 << 20, budget_s=8.0, reduction_dtypes=())


def summing_costs(rank: int, world_size: int):
    # 32 MiB: float16's extra summing (~0.5-0.9 ns a byte over loopback) stands well above
    # the milliseconds of scheduling jitter a busy machine adds to any one op
    return time_reductions(("float16", "int64"), 32 << 20)


def step_rounds_against(rank: int, world_size: int):
    """time_step_rounds against a fit that predicts nothing, and one that predicts a second."""
    def fit(latency_s: float) -> CollectiveFit:
        return CollectiveFit("all_reduce", world_size, latency_s, 0.0, 1e9, 1.0, [])

    return time_step_rounds(fit(0.0), rounds=10), time_step_rounds(fit(1.0), rounds=10)


def compute_of(rank: int, world_size: int, which: str):
    workload = {"mlp": mlp, "cnn": small_cnn}[which]()
    ddp = DDP(workload.model)
    opt = workload.optimizer()
    before = {k: v.clone() for k, v in workload.model.state_dict().items()}
    before_opt = {k: {kk: vv.clone() for kk, vv in v.items()} for k, v in opt.state_dict()["state"].items()}
    profile = profile_compute(ddp, workload.loss_fn, workload.batches, opt, steps=6, warmup=2)
    unchanged = all(torch.equal(before[k], v) for k, v in workload.model.state_dict().items())
    unchanged_opt = opt.state_dict()["state"] == before_opt
    grads_cleared = all(p.grad is None for p in workload.model.parameters())
    return {"profile": profile, "unchanged": unchanged and unchanged_opt, "grads_cleared": grads_cleared}


def failing_factory() -> Workload:
    """A workload whose construction fails on rank 1 (to test error reporting)."""
    if os.environ.get("RANK") == "1":
        raise RuntimeError("rank 1 cannot build its model")
    return mlp()


def rank_cores(rank: int, world_size: int):
    """The cores every thread of this rank may run on (gloo's included)."""
    import os

    return sorted(set().union(*(os.sched_getaffinity(int(t)) for t in os.listdir("/proc/self/task"))))


def network_reuse(rank: int, world_size: int):
    """A fresh profile, a reused one, then a reuse that rank 1 alone could make (so no rank does)."""
    import time

    from profilers import network

    kwargs = {"collectives": ("all_reduce",), "max_bytes": 1 << 20, "budget_s": 2.0, "reduction_dtypes": ()}
    first = profile_network(**kwargs)
    t0 = time.perf_counter()
    again = profile_network(**kwargs, reuse_within_s=600.0)
    reuse_s = time.perf_counter() - t0
    if rank == 0:
        network._MEASURED.clear()
    third = profile_network(**kwargs, reuse_within_s=600.0)
    return {"same": again.fits == first.fits and again is not first, "reuse_s": reuse_s,
            "third_measured": third.fits != first.fits or third.elapsed_s != first.elapsed_s}
