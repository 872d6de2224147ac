"""Jobs that launch their own ranks for a named model (``package.module:factory``).

The CLI's and the demo's path: locally over loopback, or on the emulated cluster at a
given link rate.  Inside a running job call :func:`profilers.cluster.profile_cluster` or
:func:`advisor.autotune` on every rank instead.
"""

from __future__ import annotations

from typing import Any

from torch.nn.parallel import DistributedDataParallel

from advisor.testbed.emulated import run_ranks
from advisor.testbed.workloads import build_workload, load_factory
from advisor.tuning.autotune import StageLog, autotune
from advisor.tuning.results import AutotuneResult
from profilers.cluster import profile_cluster
from profilers.profile import ClusterProfile


def _profile_rank(rank: int, world_size: int, spec: str, kwargs: dict) -> ClusterProfile | None:
    workload = build_workload(spec)
    ddp = DistributedDataParallel(workload.model)
    profile = profile_cluster(ddp, workload.loss_fn, workload.batches, workload.optimizer(), **kwargs)
    return profile if rank == 0 else None


def profile_model(spec: str, nproc: int = 2, *, rate: str | None = None, timeout: float = 600.0,
                  **kwargs: Any) -> ClusterProfile:
    """Launch ``nproc`` ranks for the workload ``spec`` and profile them.

    ``rate`` (e.g. ``"1gbit"``) runs them on an emulated cluster with links of that rate
    (needs root and iproute2); otherwise on local processes over loopback.  A rank that
    fails or hangs ends the job with an error naming it, after at most ``timeout`` s.
    """
    load_factory(spec)  # fail fast, in this process, on a factory that does not import

    def args(where: str):
        return (spec, {"note": where, **kwargs})

    return run_ranks(_profile_rank, nproc, args, rate=rate, timeout=timeout)[0]


def _autotune_rank(rank: int, world_size: int, spec: str, kwargs: dict):
    kwargs = dict(kwargs)
    if kwargs.pop("show_progress", False) and rank == 0:
        kwargs["progress"] = StageLog()
    workload = build_workload(spec)
    ddp = DistributedDataParallel(workload.model)
    kwargs = {"evaluate": workload.evaluator(), "metric": workload.metric, **kwargs}
    result = autotune(ddp, workload.loss_fn, workload.batches, workload.optimizer(), **kwargs)
    if result.hook is not None:
        result.hook.close()
    result.hook = None
    return result if rank == 0 else None


def autotune_model(spec: str, nproc: int = 2, *, rate: str | None = None, timeout: float = 900.0,
                   **kwargs: Any) -> AutotuneResult:
    """Launch ``nproc`` ranks for the workload ``spec`` and autotune it there (rank 0's result).

    ``rate`` (e.g. ``"1gbit"``) runs on an emulated cluster with links of that rate (root
    and iproute2); otherwise local processes over loopback.
    """
    load_factory(spec)  # fail fast on a factory that does not import

    def args(where: str):
        return (spec, {"where": where, **kwargs})

    return run_ranks(_autotune_rank, nproc, args, rate=rate, timeout=timeout)[0]
