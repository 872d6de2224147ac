"""Jobs that launch their own ranks for a named model (``package.module:factory``).

The CLI's and the demo's path: locally over loopback, or on the emulated cluster at a
given link rate.  Inside a running job call :func:`profilers.cluster.profile_cluster` or
:func:`advisor.autotune` on every rank instead.
"""

from __future__ import annotations

from typing import Any

from torch.nn.parallel import DistributedDataParallel

from advisor.testbed.emulated import run_ranks
from advisor.testbed.workloads import build_workload, load_factory, shard
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

    Args:
        spec: ``package.module:factory`` returning a :class:`~advisor.testbed.workloads.Workload`.
        nproc: how many ranks.
        rate: e.g. ``"1gbit"``: an emulated cluster with links of that rate (root and
            iproute2); None: local processes over loopback.
        timeout: seconds before a hanging rank ends the job.
        **kwargs: more arguments of :func:`profilers.cluster.profile_cluster`.

    Returns:
        Rank 0's :class:`~profilers.profile.ClusterProfile`.

    Raises:
        ValueError: the factory does not import or is not callable (before any launch).
        advisor.testbed.launch.RankFailed: a rank failed or hung; the error names it.
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
    kwargs = {**workload.judged_by(), "metric": workload.metric, **kwargs}
    tuned = autotune(ddp, workload.loss_fn, shard(workload.batches, rank, world_size), workload.optimizer(), **kwargs)
    if tuned.hook is not None:
        tuned.hook.close()
    return tuned.document() if rank == 0 else None


def autotune_model(spec: str, nproc: int = 2, *, rate: str | None = None, timeout: float = 900.0,
                   **kwargs: Any) -> AutotuneResult:
    """Launch ``nproc`` ranks for the workload ``spec`` and autotune it there.

    Args:
        spec, nproc, rate, timeout: as for :func:`profile_model`.
        **kwargs: more arguments of :func:`advisor.autotune`.

    Returns:
        Rank 0's :class:`~advisor.tuning.results.AutotuneResult` (without a hook: the ranks have ended).

    Raises:
        ValueError: the factory does not import or is not callable (before any launch).
        advisor.testbed.launch.RankFailed: a rank failed or hung; the error names it.
    """
    load_factory(spec)  # fail fast on a factory that does not import

    def args(where: str):
        return (spec, {"where": where, **kwargs})

    return run_ranks(_autotune_rank, nproc, args, rate=rate, timeout=timeout)[0]
