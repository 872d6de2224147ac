"""Compressed reduce-scatters for sharded training (FSDP2, ``fully_shard``): one per parameter group.

Under FSDP2 a group's gradients leave backward as one reduce-scatter of a flat buffer viewed as
``(world_size, -1)``: row r holds rank r's shard of every parameter (each padded).  FSDP calls a
custom :class:`ReduceScatter` synchronously and reads the reduced shard from ``output_tensor``
when the call returns (``foreach_reduce`` in torch's ``_fsdp_collectives.py``).  The group is the
unit a plan chooses for, as a bucket is under DDP.

What crosses the wire, per rank and group, in one ``all_to_all_single`` (a reduce-scatter built
from an all-to-all, as DeepSpeed's qgZ does: each rank sends row r to rank r and sums what it
receives, so every value crosses the wire once):

* ``none`` with :class:`ExactReduceScatter`: the rows in fp32, summed in fp32.  The fair
  baseline on gloo, whose own reduce-scatter all-reduces the whole buffer (about twice the bytes).
* ``fp16`` / ``bf16``: the rows cast to 16 bits, summed in fp32 on arrival.
* ``intquant(bits=8)``: each block of :data:`BLOCK` values as int8 codes with stochastic rounding
  (unbiased, so no residual is kept: error feedback on a sharded model would cost the memory
  sharding saves) and one fp32 scale, dequantised and summed in fp32.

Plan ``none`` on a group installs nothing there: FSDP's own path runs untouched, unless the
plan's metadata asks for the exact all-to-all instead (``{EXACT_FP32: "all-to-all"}``: where it
measured faster than gloo's own, autotune advises it so).  Non-finite
gradient values are zeroed before encoding (a quantiser's block scale would carry them to every
value of the block), counted, and logged; training state is never lost.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from advisor.compressors.base import is_finite
from advisor.compressors.registry import CompressorConfig
from advisor.core.collectives import every_rank
from advisor.runtime.plan import Plan, as_plan

log = logging.getLogger("advisor.runtime")

#: values sharing one int8 scale
BLOCK = 256
#: the configs a sharded group can run, as the registry labels them
SHARDED_CONFIGS = ("none", "fp16", "bf16", "intquant(bits=8)")
#: plan metadata key: ``"all-to-all"`` runs the groups whose config is ``none`` through
#: :class:`ExactReduceScatter` (fp32, exact) instead of FSDP's own reduce-scatter
EXACT_FP32 = "sharded_fp32"


def _fsdp():
    """torch's FSDP2 pieces; the ``ReduceScatter`` interface lives in a private module (checked on 2.13)."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import (
        DefaultReduceScatter,
        ProcessGroupAllocReduceScatter,
    )

    return FSDPModule, ReduceScatter, (DefaultReduceScatter, ProcessGroupAllocReduceScatter)


def _reduce_scatter_base():
    return _fsdp()[1]


class ExactReduceScatter(_reduce_scatter_base()):
    """A reduce-scatter from ``all_to_all_single``: each rank receives every rank's row for it, in
    ``wire_dtype``, and sums them in fp32.  ``wire_dtype=float32`` is exact up to fp32 rounding;
    ``bfloat16``/``float16`` are the 16-bit casts.

    FSDP passes ``op``: SUM leaves the sum; AVG divides it by the world size afterwards.
    """

    def __init__(self, wire_dtype: torch.dtype = torch.float32, name: str = "") -> None:
        self.wire_dtype = wire_dtype
        self.name = name
        self.nonfinite_events = 0

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group, op, async_op: bool = False):
        world = dist.get_world_size(group)
        rows = input_tensor.view(world, -1)
        self._zero_nonfinite(rows)
        received = self._exchange(rows, group)
        summed = received.sum(dim=0, dtype=torch.float32)
        if _is_avg(op):
            summed.div_(world)
        output_tensor.copy_(summed)
        return None

    # --- what crosses the wire --------------------------------------------------------
    def _exchange(self, rows: torch.Tensor, group) -> torch.Tensor:
        """Every rank's row for this rank, decoded: (world, shard) in fp32 or the wire dtype."""
        send = rows.to(self.wire_dtype) if rows.dtype != self.wire_dtype else rows.contiguous()
        received = torch.empty_like(send)
        dist.all_to_all_single(received, send, group=group)
        return received

    def _zero_nonfinite(self, rows: torch.Tensor) -> None:
        if not is_finite(rows):
            self.nonfinite_events += 1
            log.warning("non-finite gradient values in sharded group %s: zeroed before the exchange",
                        self.name or "?")
            torch.nan_to_num_(rows, nan=0.0, posinf=0.0, neginf=0.0)


class Int8ReduceScatter(ExactReduceScatter):
    """Block-quantised rows: int8 codes (stochastic rounding) and one fp32 scale per :data:`BLOCK`
    values, in two all-to-alls (codes, then scales), dequantised and summed in fp32.

    Stochastic rounding makes each rank's decoded row an unbiased estimate of its row, so the sum
    is unbiased without a residual.  Its noise is seeded from ``seed``, the step and the rank, so
    it is reproducible and never draws from torch's global generator.
    """

    def __init__(self, name: str = "", seed: int = 0) -> None:
        super().__init__(torch.float32, name)
        self.seed = seed
        self.step = 0

    def _exchange(self, rows: torch.Tensor, group) -> torch.Tensor:
        world, shard = rows.shape
        blocks = -(-shard // BLOCK)
        padded = rows.new_zeros(world, blocks * BLOCK, dtype=torch.float32)
        padded[:, :shard] = rows
        padded = padded.view(world, blocks, BLOCK)
        scales = padded.abs().amax(dim=2).div_(127.0).clamp_(min=torch.finfo(torch.float32).tiny)
        gen = torch.Generator(device=rows.device)
        gen.manual_seed((self.seed * 1_000_003 + self.step * 7_919 + dist.get_rank(group) * 104_729) % (2**63 - 1))
        noise = torch.rand(padded.shape, generator=gen, device=rows.device)
        codes = padded.div_(scales.unsqueeze(2)).add_(noise).floor_().clamp_(-127, 127).to(torch.int8)
        self.step += 1
        got_codes = torch.empty_like(codes)
        got_scales = torch.empty_like(scales)
        dist.all_to_all_single(got_codes, codes, group=group)
        dist.all_to_all_single(got_scales, scales, group=group)
        decoded = got_codes.to(torch.float32).mul_(got_scales.unsqueeze(2))
        return decoded.view(world, blocks * BLOCK)[:, :shard]


@dataclass
class ShardedGroup:
    """One ``fully_shard`` group: its module's name, its parameters' names and the config it runs."""

    module: str
    parameters: tuple[str, ...]
    config: CompressorConfig
    comm: Any = None


def comm_for(config: CompressorConfig, name: str, seed: int = 0):
    """The reduce-scatter that runs ``config`` (None for ``none``: FSDP's own path)."""
    label = config.label
    if label == "none":
        return None
    if label in ("fp16", "bf16"):
        return ExactReduceScatter(torch.float16 if label == "fp16" else torch.bfloat16, name)
    if config.name == "intquant" and config.params.get("bits") == 8:
        return Int8ReduceScatter(name, seed)
    raise ValueError(f"compressor {label!r} cannot run on a sharded (fully_shard) group yet; allowed there: "
                     f"{', '.join(SHARDED_CONFIGS)}")


def sharded_groups(model: torch.nn.Module) -> list[tuple[str, Any, tuple[str, ...]]]:
    """(module name, FSDP module, its parameters' names) for each ``fully_shard`` group in ``model``.

    Raises:
        TypeError: FSDP1 (``FullyShardedDataParallel``), which has no per-group hook.
        ValueError: no ``fully_shard`` module, or one with per-parameter meshes (several groups).
    """
    from torch.distributed.fsdp import FullyShardedDataParallel

    fsdp_module, _, _ = _fsdp()
    if any(isinstance(m, FullyShardedDataParallel) for m in model.modules()):
        raise TypeError("the model uses FSDP1 (FullyShardedDataParallel), which has no reduce-scatter hook; "
                        "shard it with torch.distributed.fsdp.fully_shard (FSDP2) instead")
    names = {id(p): n for n, p in model.named_parameters()}
    found = []
    for prefix, module in model.named_modules():
        if not isinstance(module, fsdp_module):
            continue
        state = module._get_fsdp_state()
        groups = state._fsdp_param_groups
        if len(groups) > 1:
            raise ValueError(f"fully_shard module {prefix or '(root)'!r} has {len(groups)} parameter groups "
                             "(per-parameter meshes from shard_placement_fn); a custom reduce-scatter needs one "
                             "group a module: shard those parameters with fully_shard calls of their own")
        params = tuple(names[id(fp.sharded_param)] for g in groups for fp in g.fsdp_params
                       if id(fp.sharded_param) in names)
        if params:
            found.append((prefix, module, params))
    if not found:
        raise ValueError("no fully_shard module in the model: shard it with torch.distributed.fsdp.fully_shard "
                         "first (each block, then the root)")
    return found


def group_numel(module) -> int:
    """How many values a ``fully_shard`` module's reduce-scatter takes in: every rank's row of
    every parameter's (padded) shard."""
    state = module._get_fsdp_state()
    fsdp_params = [fp for g in state._fsdp_param_groups for fp in g.fsdp_params]
    world = state._fsdp_param_groups[0].mesh_info.shard_mesh_size if state._fsdp_param_groups else 1
    return world * sum(fp.padded_sharded_param_size.numel() for fp in fsdp_params)


def _group_plan(plan: Plan, found) -> list[ShardedGroup]:
    """One :class:`ShardedGroup` per found group with the config ``plan`` gives it (and its comm).

    Raises:
        ValueError: a plan naming parameters the model lacks, splitting a group between configs,
            or giving a group a config that cannot run sharded.
    """
    plan.check_against(n for _, _, params in found for n in params)
    exact = plan.metadata.get(EXACT_FP32)
    if exact not in (None, "all-to-all"):
        raise ValueError(f"plan metadata {EXACT_FP32}={exact!r}; allowed: 'all-to-all' (the exact fp32 "
                         "reduce-scatter where the config is none), or leave it out (FSDP's own)")
    groups = []
    for prefix, _, params in found:
        configs = {plan.config_for(n).label: plan.config_for(n) for n in params}
        if len(configs) > 1:
            raise ValueError(f"plan gives fully_shard group {prefix or '(root)'!r} several configs "
                             f"({', '.join(sorted(configs))}); a group's gradients cross in one reduce-scatter: "
                             "give all its parameters one config")
        config = next(iter(configs.values()))
        comm = comm_for(config, prefix or "(root)", plan.seed)
        if comm is None and exact:
            comm = ExactReduceScatter(torch.float32, prefix or "(root)")
        groups.append(ShardedGroup(prefix, params, config, comm))
    return groups


def _agree(error: str | None, digest: str | None, group, what: str) -> None:
    """Every rank's error (or plan digest) seen by every rank: raise the same error on all of them."""
    everyone = every_rank({"error": error, "digest": digest}, group) if dist.is_initialized() else [
        {"error": error, "digest": digest}]
    errors = [f"rank {r}: {e['error']}" for r, e in enumerate(everyone) if e["error"]]
    if errors:
        raise ValueError(f"cannot {what}: " + "; ".join(errors))
    if len({e["digest"] for e in everyone}) > 1:
        raise ValueError(f"ranks hold different plans (digests by rank: {[e['digest'] for e in everyone]}); "
                         "give every rank the same plan file")


def install_sharded(model: torch.nn.Module, plan: Plan | Mapping[str, Any] | str | Path,
                    group=None) -> list[ShardedGroup]:
    """Set each ``fully_shard`` group's reduce-scatter to what ``plan`` says; every rank calls it.

    A group runs one config: every parameter of it must have the same one in the plan.  Call it
    before the first backward.

    Returns:
        One :class:`ShardedGroup` per ``fully_shard`` group (``comm``: its reduce-scatter, None
        where FSDP's own runs).

    Raises:
        TypeError: FSDP1.
        ValueError: on every rank, naming the group and the fix: ranks holding different plans,
            a plan naming parameters the model lacks, a group whose parameters the plan splits,
            a config a sharded group cannot run, per-parameter meshes, or a reduce-scatter that
            something else already replaced.
    """
    error, groups, digest = None, [], None
    try:
        plan = as_plan(plan)
        found = sharded_groups(model)
        groups = _group_plan(plan, found)
        _, _, defaults = _fsdp()
        for (prefix, module, _), sharded in zip(found, groups):
            current = module._get_fsdp_state()._fsdp_param_groups[0]._reduce_scatter_comm
            if sharded.comm is not None and not isinstance(current, defaults):
                raise ValueError(f"fully_shard group {prefix or '(root)'!r} already has a custom reduce-scatter "
                                 f"({type(current).__name__}); the advisor sets its own: build the model without it")
        digest = plan.digest()
    except (ValueError, TypeError) as exc:
        error = f"{type(exc).__name__}: {exc}"
    _agree(error, digest, group, "install the plan on the sharded model")
    for (_, module, _), sharded in zip(found, groups):
        if sharded.comm is not None:
            module.set_custom_reduce_scatter(sharded.comm)
            # the comm sums what it receives and divides for AVG itself; SUM keeps FSDP from asking
            # for PREMUL_SUM (gloo refuses it) under a custom divide factor
            module.set_force_sum_reduction_for_comms(True)
    return groups


class ShardedSwitch:
    """Switches a sharded model's groups between plans while it trains, and back (the live measurement).

    :meth:`set` gives each group its plan's reduce-scatter, or FSDP's own where the config is
    ``none``; :meth:`restore` puts back what every group had when the switch was made.  Every
    rank calls each method with the same plan (checked, on every rank).
    """

    def __init__(self, model: torch.nn.Module, group=None) -> None:
        self.found = sharded_groups(model)
        self.group = group
        self._saved = [(pg, pg._reduce_scatter_comm, pg.force_sum_reduction_for_comms)
                       for _, module, _ in self.found for pg in module._get_fsdp_state()._fsdp_param_groups]

    def set(self, plan: Plan) -> list[ShardedGroup]:
        error, groups, digest = None, [], None
        try:
            groups = _group_plan(plan, self.found)
            digest = plan.digest()
        except (ValueError, TypeError) as exc:
            error = f"{type(exc).__name__}: {exc}"
        _agree(error, digest, self.group, "switch the sharded model's plan")
        self.restore()
        for (_, module, _), sharded in zip(self.found, groups):
            if sharded.comm is not None:
                module.set_custom_reduce_scatter(sharded.comm)
                module.set_force_sum_reduction_for_comms(True)
        return groups

    def restore(self) -> None:
        for pg, comm, force_sum in self._saved:
            pg._reduce_scatter_comm, pg.force_sum_reduction_for_comms = comm, force_sum


def _is_avg(op) -> bool:
    return op == dist.ReduceOp.AVG
