"""The few small collectives every part of the advisor needs, in one place.

Every decision the ranks take must be taken from the same numbers, or they would leave
each other waiting in different collectives: these helpers give every rank the slowest
rank's values, the mean over ranks, or rank 0's object.  Each is the identity where no
process group is initialised or it has one rank.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist


def world_size(group=None) -> int:
    return dist.get_world_size(group) if dist.is_initialized() else 1


def rank(group=None) -> int:
    return dist.get_rank(group) if dist.is_initialized() else 0


def slowest(values: Sequence[float], group=None) -> list[float]:
    """Each value's maximum over the ranks (the slowest rank sets the pace); one collective."""
    return _reduced(values, dist.ReduceOp.MAX, group)


def fastest(values: Sequence[float], group=None) -> list[float]:
    """Each value's minimum over the ranks; one collective."""
    return _reduced(values, dist.ReduceOp.MIN, group)


def mean_over_ranks(values: Sequence[float], group=None) -> list[float]:
    """Each value's mean over the ranks; one collective."""
    n = world_size(group)
    return [v / n for v in _reduced(values, dist.ReduceOp.SUM, group)]


def every_rank(obj: Any, group=None) -> list[Any]:
    """Every rank's ``obj`` (picklable), in rank order; one collective."""
    if world_size(group) == 1:
        return [obj]
    out: list[Any] = [None] * world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def from_rank_zero(obj: Any, group=None) -> Any:
    """Rank 0's ``obj`` (of ``group``) on every rank."""
    if world_size(group) == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0) if group is not None else 0, group=group)
    return box[0]


def _reduced(values: Sequence[float], op, group) -> list[float]:
    values = [float(v) for v in values]
    if world_size(group) == 1:
        return values
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t, op=op, group=group)
    return t.tolist()
