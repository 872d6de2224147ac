"""Build DDP for an advice's bucket layout: DDP's own buckets made the size the plan exchanges.

A plan with ``exchange_mb`` holds DDP's buckets back and joins them into one exchange, which
costs a copy of each joined bucket.  DDP built with ``bucket_cap_mb=exchange_mb`` makes
buckets of about that size itself (it closes a bucket once it holds the cap, as the hook
closes a group), so the plan then runs without the join.  A plan with ``bucket_cap_mb`` was tuned for DDP
buckets smaller than DDP's default, which only DDP can make: DDP is built with that cap.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

from advisor.runtime import CompressionHook, Plan, install
from advisor.runtime.plan import as_plan


def ddp_for(module: torch.nn.Module, advice: Any, *, group=None,
            **ddp_kwargs: Any) -> tuple[DistributedDataParallel, CompressionHook | None]:
    """``module`` in DDP built for ``advice``'s bucket layout, with its plan installed; every rank calls it.

    Args:
        module: the model to wrap (as for ``DistributedDataParallel(module, ...)``).
        advice: an :class:`advisor.AutotuneResult`, a :class:`advisor.Plan`, a plan dict or
            the path of a plan file.
        group: the process group (DDP's ``process_group``).
        **ddp_kwargs: more DDP arguments (``device_ids``, ``find_unused_parameters``, ...).

    Returns:
        The DDP model and the installed hook (None where the advice is native fp32: no hook).

    Raises:
        ValueError: ``bucket_cap_mb`` given as well as a plan with a layout (they would
            disagree: drop one), or a plan invalid for ``module`` (on every rank).
    """
    plan = _plan_of(advice)
    bucket_cap_mb, built_plan = built_for(plan)
    if bucket_cap_mb is not None:
        field = "exchange_mb" if plan.exchange_mb is not None else "bucket_cap_mb"
        for taken in ("bucket_cap_mb", "bucket_cap_mb_list"):
            if taken in ddp_kwargs:
                raise ValueError(f"{taken}={ddp_kwargs[taken]!r} given, but the plan's layout sets DDP's buckets "
                                 f"({field}={bucket_cap_mb:g}); drop {taken}, or pass the plan without its "
                                 f"layout (dataclasses.replace(plan, {field}=None))")
        ddp_kwargs["bucket_cap_mb"] = bucket_cap_mb
    plan = built_plan
    ddp = DistributedDataParallel(module, process_group=group, **ddp_kwargs)
    if plan.metadata.get("native"):
        return ddp, None
    return ddp, install(ddp, plan, group=group)


def built_for(plan: Plan) -> tuple[float | None, Plan]:
    """``(bucket_cap_mb, plan)``: the cap to build DDP with for ``plan``'s layout (None: DDP's
    own buckets) and the plan to install on DDP built so.

    A join (``exchange_mb``) is dropped from the plan installed there, since DDP then makes the
    joined buckets itself and the hook need not copy them together.
    """
    if plan.exchange_mb is not None:
        return plan.exchange_mb, dataclasses.replace(plan, exchange_mb=None)
    return plan.bucket_cap_mb, plan


def _plan_of(advice: Any) -> Plan:
    if isinstance(advice, (Plan, Mapping, str, Path)):
        return as_plan(advice)
    plan_object = getattr(advice, "plan_object", None)
    if plan_object is None:
        raise TypeError(f"advice must be an AutotuneResult, a Plan, a plan dict or a plan file's path, "
                        f"got {type(advice).__name__}")
    return plan_object()
