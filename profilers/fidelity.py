"""How much each candidate compressor distorts the model's real gradients.

Gradients are captured for a few steps (communication off), bucket by bucket as DDP lays
them out.  Each rank replays its own gradient stream through each config with error
feedback, exactly as the runtime would (the same exchange code, world size 1), and
measures:

* ``relative_error = ||Σ_t applied_t - Σ_t g_t|| / ||Σ_t g_t||``: what error feedback
  has not yet delivered after the captured steps (the accuracy budget of the policies);
* ``compression_gain`` (GraVAC): the mean of ``||C(g_t)|| / ||g_t||``;
* ``update_error``, when the user's optimizer is given: the same distance between the
  parameter updates that optimizer makes (from its current state, on copies of the
  bucket's parameters) from the applied and from the true gradients.  Adam divides each
  coordinate by its second moment, so what error feedback has not delivered yet can be
  amplified there; momentum SGD smooths it.  Measured and kept; on the bundled tasks the
  gradient error predicted the accuracy trial's gaps as well or better (from a fresh Adam
  state, whose first steps are sign-like, tiny errors become whole updates), so the search
  budgets the gradient error unless asked for this one.

The ranks' numbers are then averaged.  Replaying each rank's own stream leaves out the
averaging across ranks, which can only reduce the error of linear compressors.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

from advisor.compressors import SegmentLayout, parse
from advisor.core.collectives import mean_over_ranks, world_size
from advisor.runtime.simulate import SimulatedRanks

from .compute import LossFn
from .profile import Bucket, FidelityEntry, FidelityProfile
from .training_state import StateGuard, optimizer_over


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
            captured.append([torch.cat([_flat_grad(by_name[n]) for n in b.parameters]) for b in buckets])
    return captured


def _flat_grad(param: torch.Tensor) -> torch.Tensor:
    """A parameter's gradient, flat in fp32; zeros where this step left it unused (what DDP
    all-reduces for it with ``find_unused_parameters``)."""
    if param.grad is None:
        return torch.zeros(param.numel(), dtype=torch.float32, device=param.device)
    return param.grad.detach().reshape(-1).float().clone()


def bucket_layout(bucket: Bucket, ddp: DistributedDataParallel) -> SegmentLayout:
    shapes = dict((n, tuple(p.shape)) for n, p in ddp.module.named_parameters())
    return SegmentLayout(tuple(bucket.parameters), tuple(shapes[n] for n in bucket.parameters))


class UpdateReplay:
    """The user's optimizer over copies of one bucket's parameters: the update a gradient stream makes.

    Every :meth:`run` starts from the parameters' current values and a deep copy of the
    optimizer's current state, so each config is replayed from the same point.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, parameters: Sequence[torch.nn.Parameter]) -> None:
        self.optimizer = optimizer
        self.parameters = list(parameters)

    def run(self, grads: Sequence[torch.Tensor], layout: SegmentLayout) -> torch.Tensor:
        """The flat change of the parameters after stepping once per gradient (float64)."""
        copies = [p.detach().clone().requires_grad_(True) for p in self.parameters]
        opt = optimizer_over(self.optimizer, {id(p): c for p, c in zip(self.parameters, copies)})
        for g in grads:
            for c, view in zip(copies, layout.views(g)):
                c.grad = view.detach().to(c.dtype).clone()  # an optimizer may change a gradient in place
            opt.step()
        return torch.cat([(c.detach().double() - p.detach().double()).reshape(-1)
                          for c, p in zip(copies, self.parameters)])


def _relative(approx: torch.Tensor, true: torch.Tensor) -> float:
    denom = float(true.norm())
    return float((approx - true).norm()) / denom if denom > 0 else 0.0


def replay(config: str, layout: SegmentLayout, grads: Sequence[torch.Tensor],
           update: UpdateReplay | None = None, true_update: torch.Tensor | None = None
           ) -> tuple[float, float, float | None]:
    """(relative_error, compression_gain, update_error) of one config on one bucket's gradient stream.

    ``update_error`` is None without ``update``; ``true_update`` (``update.run`` of the
    true stream) can be passed to share it between configs.
    """
    comp = parse(config).build()
    sim = SimulatedRanks(1)
    applied = []
    gains = []
    for g in grads:
        out = sim.exchange(comp, [g], layout)[0]
        applied.append(out)
        norm = float(g.norm())
        gains.append(float(out.norm()) / norm if norm > 0 else 1.0)
    applied_sum = torch.stack([a.double() for a in applied]).sum(0)
    true_sum = torch.stack([g.double() for g in grads]).sum(0)
    error = _relative(applied_sum, true_sum)
    update_error = None
    if update is not None:
        if true_update is None:
            true_update = update.run(grads, layout)
        update_error = _relative(update.run(applied, layout), true_update)
    return error, sum(gains) / len(gains), update_error


def profile_fidelity(
    ddp: DistributedDataParallel,
    loss_fn: LossFn,
    batches: Iterable[Any],
    buckets: Sequence[Bucket],
    configs: Sequence[str],
    steps: int = 6,
    group=None,
    optimizer: torch.optim.Optimizer | None = None,
) -> FidelityProfile:
    """Per bucket and config, the error and gain of compressing the job's real gradients.

    Call on every rank at the same point.

    Args:
        ddp: the DDP model; the replay steps run under ``no_sync``, its state restored after.
        loss_fn: ``loss_fn(model, batch) -> loss``.
        batches: the batches whose gradients are replayed.
        buckets: DDP's buckets (from the compute profile).
        configs: the compressor configs replayed, each with its own error feedback.
        steps: how many steps of gradients.
        optimizer: with it, the update error through a clone of it too (see the module docstring).

    Returns:
        A :class:`FidelityProfile`, averaged over ranks.

    Raises:
        ValueError: an unknown config, naming the allowed ones.
    """
    grads = capture_gradients(ddp, loss_fn, batches, buckets, steps)
    streams = [[step[b] for step in grads] for b in range(len(buckets))]
    layouts = [bucket_layout(bucket, ddp) for bucket in buckets]
    updates = None
    if optimizer is not None:
        by_name = dict(ddp.module.named_parameters())
        updates = [UpdateReplay(optimizer, [by_name[n] for n in b.parameters]) for b in buckets]
    return fidelity_of(streams, layouts, buckets, configs, steps, group, updates)


def fidelity_of(
    streams: Sequence[Sequence[torch.Tensor]],
    layouts: Sequence[SegmentLayout],
    buckets: Sequence[Bucket],
    configs: Sequence[str],
    steps: int,
    group=None,
    updates: Sequence[UpdateReplay] | None = None,
) -> FidelityProfile:
    """Replay each bucket's gradient stream through each config; average over ranks.

    A bucket with no captured gradients counts as undistorted (errors 0, gain 1).
    ``updates``: one :class:`UpdateReplay` per bucket, to measure update errors too.
    Call on every rank: one all-reduce carries every number.
    """
    labels = [parse(c).label for c in configs]
    values = []
    for b, (stream, layout) in enumerate(zip(streams, layouts)):
        update = updates[b] if updates is not None else None
        true_update = update.run(stream, layout) if update is not None and stream else None
        for label in labels:
            error, gain, update_error = replay(label, layout, stream, update, true_update) if stream else (0.0, 1.0, 0.0)
            values.extend((error, gain, update_error if update_error is not None else 0.0))
    world = world_size(group)
    t = mean_over_ranks(values, group)
    entries, k = [], 0
    for bucket in buckets:
        for label in labels:
            update_error = float(t[k + 2]) if updates is not None else None
            entries.append(FidelityEntry(bucket.index, label, float(t[k]), float(t[k + 1]), update_error))
            k += 3
    optimizer = type(updates[0].optimizer).__name__ if updates else None
    return FidelityProfile(steps=steps, world_size=world, entries=entries, optimizer=optimizer)
