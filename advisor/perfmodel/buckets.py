"""DDP's buckets for another ``bucket_cap_mb``, from the profiled parameters alone.

After its first iteration DDP rebuilds its buckets from the order in which gradients became
ready, filling each up to its cap (the first one up to a smaller cap only when the cap is
DDP's default).  The performance model needs the buckets a DDP built with another cap would
have, to price a layout before anyone builds it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

_MIB = 1 << 20


@dataclass(frozen=True)
class BuiltBucket:
    """A bucket DDP would build: its index in hand-over order, its parameters, their elements."""

    index: int
    parameters: list[str]
    numel: int


def buckets_for_cap(parameters: Sequence[Any], bucket_cap_mb: float) -> list[BuiltBucket]:
    """The buckets, in the order DDP hands them over, of DDP built with ``bucket_cap_mb``.

    ``parameters``: the profiled ones (:class:`profilers.profile.ParameterTiming`: ``name``,
    ``numel``, ``ready_s``).  They are taken in the order their gradients become ready
    (later-defined first on a tie, as autograd reaches them); an explicit cap applies to the
    first bucket too.
    """
    if not parameters:
        raise ValueError("no parameters to put in buckets")
    cap = max(1, int(bucket_cap_mb * _MIB))
    order = sorted(range(len(parameters)), key=lambda i: (parameters[i].ready_s, -i))
    # DDP's own assignment function, so that the model's buckets are DDP's by construction; it
    # reads only each tensor's size and type, which meta tensors give without memory
    tensors = [torch.empty(parameters[i].numel, device="meta") for i in order]
    groups, _ = dist._compute_bucket_assignment_by_size(tensors, [cap], [False] * len(tensors),
                                                         list(range(len(tensors))))
    # DDP keeps buckets in the order their first gradient is ready
    groups = sorted(groups, key=min)
    return [BuiltBucket(index=b, parameters=[parameters[order[i]].name for i in group],
                   numel=sum(parameters[order[i]].numel for i in group)) for b, group in enumerate(groups)]
