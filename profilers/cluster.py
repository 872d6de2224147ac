"""Profile a cluster from inside a running job.

``profile_cluster`` runs on every rank of an initialised process group (``torchrun`` or
the advisor's own launcher) and returns the same :class:`ClusterProfile` on every rank.
(:func:`advisor.testbed.jobs.profile_model` launches the ranks for a named model first.)
"""

from __future__ import annotations

import datetime
import socket
from collections.abc import Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from advisor.compressors import SegmentLayout
from advisor.compressors.forms import choose_forms
from advisor.core.collectives import every_rank, slowest
from advisor.core.version import __version__

from .compute import LossFn, profile_compute
from .fidelity import bucket_layout, profile_fidelity
from .kernels import DEFAULT_CONFIGS, fit_loglog, profile_kernels, time_forms
from .network import profile_network, reduction_dtypes_of
from .profile import ClusterProfile, Environment, KernelCost, KernelProfile


def environment_of(ddp: DistributedDataParallel, group, note: str) -> Environment:
    world = dist.get_world_size(group)
    hosts = every_rank(socket.gethostname(), group)
    device = next(ddp.module.parameters()).device
    return Environment(
        world_size=world,
        backend=str(dist.get_backend(group)),
        device=str(device),
        torch_version=torch.__version__,
        advisor_version=__version__,
        hosts=[str(h) for h in hosts],
        threads=torch.get_num_threads(),
        created=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        note=note,
    )


def slowest_kernels(local: KernelProfile, group) -> KernelProfile:
    """Every rank measured its own kernels at the same time; keep the slowest, refit."""
    costs = {}
    for label, cost in local.costs.items():
        width = len(cost.points[0]) if cost.points else 0
        flat = slowest([v for row in cost.points for v in row], group)
        rows = [flat[i : i + width] for i in range(0, len(flat), width)]
        numels = [r[0] for r in rows]
        costs[label] = KernelCost(
            config=label,
            points=rows,
            encode_knots=fit_loglog(numels, [r[1] for r in rows]),
            decode_knots=fit_loglog(numels, [r[2] for r in rows]),
            world_size=cost.world_size,
        )
    # every rank runs the same forms (they round differently): its callers chose them with shared_forms
    return KernelProfile(device=local.device, costs=costs, forms=local.forms, form_seconds=local.form_seconds)


def shared_forms(device, group=None) -> tuple[dict[str, str], dict[str, dict[str, float]]]:
    """The kernel forms every rank will run: each form's slowest time over the ranks, the faster form
    by that (the same numbers on every rank, so the same choice), and those times."""
    local = time_forms(device)
    keys = [(choice, form) for choice in sorted(local) for form in sorted(local[choice])]
    worst = slowest([local[c][f] for c, f in keys], group)
    seconds: dict[str, dict[str, float]] = {}
    for (choice, form), t in zip(keys, worst):
        seconds.setdefault(choice, {})[form] = t
    return choose_forms(seconds), seconds


def profile_cluster(
    ddp: DistributedDataParallel,
    loss_fn: LossFn,
    batches: Iterable[Any],
    optimizer: torch.optim.Optimizer | None = None,
    configs: Sequence[str] = DEFAULT_CONFIGS,
    *,
    steps: int = 8,
    warmup: int = 3,
    network: bool = True,
    kernels: bool = True,
    fidelity: bool = True,
    fidelity_steps: int = 6,
    network_budget_s: float = 25.0,
    network_reuse_s: float = 0.0,
    group=None,
    note: str = "",
    progress=None,
) -> ClusterProfile:
    """Profile compute, network, kernels and fidelity; call on every rank at the same point.

    Args:
        ddp: the job's DDP model; its weights, gradients and optimizer state end as they began.
        loss_fn: ``loss_fn(model, batch) -> loss``.
        batches: training batches (cycled where fewer than the steps).
        optimizer: the training optimizer (its step is timed; fidelity replays its update).
        configs: the compressor configs to time and replay.
        steps, warmup: timed compute steps, after untimed ones.
        network, kernels, fidelity: which parts to measure (a part left out is None).
        fidelity_steps: steps of gradients replayed through every config.
        network_budget_s: the most seconds the network profile may take.
        network_reuse_s: reuse a network profile this process measured within that many seconds.
        note: where this runs, kept in the profile's environment.
        progress: ``progress(message)`` hears each stage as it starts.

    Returns:
        The same :class:`ClusterProfile` on every rank (each time is the slowest rank's).

    Raises:
        RuntimeError: no initialised process group.
        TypeError, ValueError: a bad argument, naming it.
    """
    if not dist.is_initialized():
        raise RuntimeError("profile_cluster needs an initialised process group (torchrun, or advisor.testbed.launch)")
    say = progress or (lambda message: None)
    batches = list(batches) if not isinstance(batches, list) else batches
    environment = environment_of(ddp, group, note)
    say(f"profiling compute: {warmup + steps} steps without communication")
    compute = profile_compute(ddp, loss_fn, batches, optimizer, steps=steps, warmup=warmup, group=group)
    if network:
        say(f"profiling the network: collectives of growing size (up to {network_budget_s:g} s)")
    net = (
        profile_network(group=group, budget_s=network_budget_s, reuse_within_s=network_reuse_s,
                        reduction_dtypes=reduction_dtypes_of(configs, environment.world_size))
        if network else None
    )
    layouts: list[SegmentLayout] = [bucket_layout(b, ddp) for b in compute.buckets]
    kern = None
    if kernels:
        say(f"timing {len(configs)} compressors' encode and decode on this device")
        device = next(ddp.module.parameters()).device
        forms, form_seconds = shared_forms(device, group)
        local = profile_kernels(layouts, configs, world_size=environment.world_size, device=device, forms=forms,
                                form_seconds=form_seconds)
        kern = slowest_kernels(local, group)
    if fidelity:
        say(f"replaying {fidelity_steps} steps of gradients through every compressor (fidelity)")
    fid = (
        profile_fidelity(ddp, loss_fn, batches, compute.buckets, configs, steps=fidelity_steps, group=group,
                         optimizer=optimizer)
        if fidelity
        else None
    )
    return ClusterProfile(environment=environment, compute=compute, network=net, kernels=kern, fidelity=fid)
