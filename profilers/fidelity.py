"""How much each candidate compressor distorts the model's real gradients.

Gradients are captured for a few steps (communication off), bucket by bucket as DDP lays
them out.  Each rank replays its own gradient stream through each config with error
feedback, exactly as the runtime would (the same exchange code, world size 1), and
measures:

* ``relative_error = ||Σ_t applied_t - Σ_t g_t|| / ||Σ_t g_t||``: what error feedback
  has not yet delivered after the captured steps (the accuracy budget of the policies);
* ``compression_gain`` (GraVAC): the mean of ``||C(g_t)|| / ||g_t||``.

The ranks' numbers are then averaged.  Replaying each rank's own stream leaves out the
averaging across ranks, which can only reduce the error of linear compressors.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from advisor.compressors import SegmentLayout, parse
from advisor.runtime.simulate import SimulatedRanks

from .compute import LossFn
from .profile import Bucket, FidelityEntry, FidelityProfile
from .training_state import StateGuard


def capture_gradients(
    ddp: DistributedDataParallel, loss_fn: LossFn, batches: Iterable[Any], buckets: Sequence[Bucket], steps: int
) -> list[list[torch.Tensor]]:
    """``[step][bucket]`` flat gradients (no communication); training state is restored."""
    by_name = dict(ddp.module.named_parameters())
    feed = itertools.cycle(list(itertools.islice(iter(batches), steps)))
    captured = []
    with StateGuard(ddp.module):
        for _ in range(steps):
            ddp.zero_grad(set_to_none=True)
            with ddp.no_sync():
                loss_fn(ddp, next(feed)).backward()
            captured.append(
                [
                    torch.cat([by_name[n].grad.detach().reshape(-1).float() for n in b.parameters]).clone()
                    for b in buckets
                ]
            )
    return captured


def bucket_layout(bucket: Bucket, ddp: DistributedDataParallel) -> SegmentLayout:
    shapes = dict((n, tuple(p.shape)) for n, p in ddp.module.named_parameters())
    return SegmentLayout(tuple(bucket.parameters), tuple(shapes[n] for n in bucket.parameters))


def replay(config: str, layout: SegmentLayout, grads: Sequence[torch.Tensor]) -> tuple[float, float]:
    """(relative_error, compression_gain) of one config on one bucket's gradient stream."""
    comp = parse(config).build()
    sim = SimulatedRanks(1)
    applied_sum = torch.zeros_like(grads[0], dtype=torch.float64)
    true_sum = torch.zeros_like(grads[0], dtype=torch.float64)
    gains = []
    for g in grads:
        out = sim.exchange(comp, [g], layout)[0]
        applied_sum += out.double()
        true_sum += g.double()
        norm = float(g.norm())
        gains.append(float(out.norm()) / norm if norm > 0 else 1.0)
    denom = float(true_sum.norm())
    error = float((applied_sum - true_sum).norm()) / denom if denom > 0 else 0.0
    return error, sum(gains) / len(gains)


def profile_fidelity(
    ddp: DistributedDataParallel,
    loss_fn: LossFn,
    batches: Iterable[Any],
    buckets: Sequence[Bucket],
    configs: Sequence[str],
    steps: int = 6,
    group=None,
) -> FidelityProfile:
    """Per bucket and config, error and gain on real gradients, averaged over ranks."""
    grads = capture_gradients(ddp, loss_fn, batches, buckets, steps)
    streams = [[step[b] for step in grads] for b in range(len(buckets))]
    layouts = [bucket_layout(bucket, ddp) for bucket in buckets]
    return fidelity_of(streams, layouts, buckets, configs, steps, group)


def fidelity_of(
    streams: Sequence[Sequence[torch.Tensor]],
    layouts: Sequence[SegmentLayout],
    buckets: Sequence[Bucket],
    configs: Sequence[str],
    steps: int,
    group=None,
) -> FidelityProfile:
    """Replay each bucket's gradient stream through each config; average over ranks.

    A bucket with no captured gradients counts as undistorted (error 0, gain 1).
    Call on every rank: one all-reduce carries every number.
    """
    labels = [parse(c).label for c in configs]
    values = []
    for stream, layout in zip(streams, layouts):
        for label in labels:
            values.extend(replay(label, layout, stream) if stream else (0.0, 1.0))
    world = dist.get_world_size(group) if dist.is_initialized() else 1
    t = torch.tensor(values, dtype=torch.float64)
    if world > 1:
        dist.all_reduce(t, group=group)
        t /= world
    entries, k = [], 0
    for bucket in buckets:
        for label in labels:
            entries.append(FidelityEntry(bucket.index, label, float(t[k]), float(t[k + 1])))
            k += 2
    return FidelityProfile(steps=steps, world_size=world, entries=entries)
