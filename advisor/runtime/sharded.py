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
* ``intquant(bits=8)`` / ``intquant(bits=4)``: each block of :data:`BLOCK` values as 8- or 4-bit
  integer codes with stochastic rounding (unbiased, so no residual is kept: error feedback on a
  sharded model would cost the memory sharding saves) and one fp32 scale, dequantised and
  summed in fp32 (4-bit codes two to a byte, as DeepSpeed's qgZ sends them).
* ``powersgd(rank=r)``: see :class:`PowerSGDReduceScatter`.

Plan ``none`` on a group installs nothing there: FSDP's own path runs untouched, unless the
plan's metadata asks for the exact all-to-all instead (``{EXACT_FP32: "all-to-all"}``: where it
measured faster than gloo's own, autotune advises it so).  Non-finite
gradient values are zeroed before encoding (a quantiser's block scale would carry them to every
value of the block), counted, and logged; training state is never lost.  On an accelerator the
zeroing reads no flag on the host (that would stall the device every group and step): the count
stays on the device until ``nonfinite_events`` is read.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from advisor.compressors.base import is_finite, stable_hash
from advisor.compressors.powersgd import orthogonalize_
from advisor.compressors.registry import CompressorConfig
from advisor.core.collectives import every_rank
from advisor.runtime.plan import Plan, as_plan

log = logging.getLogger("advisor.runtime")

#: values sharing one int8 scale
BLOCK = 256
#: the configs a sharded group can run by default (autotune_sharded's candidates); PowerSGD runs at any rank
SHARDED_CONFIGS = ("none", "fp16", "bf16", "intquant(bits=8)", "powersgd(rank=4)", "powersgd(rank=16)")
#: what a sharded group can run, in words (errors name it)
SHARDED_ALLOWED = "none, fp16, bf16, intquant(bits=8), intquant(bits=4), powersgd(rank=r)"
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
        self._host_events, self._reported = 0, 0
        self._device_events: torch.Tensor | None = None
        #: what watches the exchange (:class:`advisor.runtime.sharded_monitor.ShardedFidelityMonitor`):
        #: ``local(comm, rows)`` before it, ``delivered(comm, output, avg)`` after
        self.watchers: list = []

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group, op, async_op: bool = False):
        world = dist.get_world_size(group)
        rows = input_tensor.view(world, -1)
        self._zero_nonfinite(rows)
        self._show_local(rows)
        received = self._exchange(rows, group)
        summed = received.sum(dim=0, dtype=torch.float32)
        if _is_avg(op):
            summed.div_(world)
        output_tensor.copy_(summed)
        self._show_delivered(output_tensor, op)
        return None

    def _show_local(self, rows: torch.Tensor) -> None:
        for watcher in self.watchers:
            watcher.local(self, rows)

    def _show_delivered(self, output: torch.Tensor, op) -> None:
        for watcher in self.watchers:
            watcher.delivered(self, output, _is_avg(op))

    # --- what crosses the wire --------------------------------------------------------
    def _exchange(self, rows: torch.Tensor, group) -> torch.Tensor:
        """Every rank's row for this rank, decoded: (world, shard) in fp32 or the wire dtype."""
        send = rows.to(self.wire_dtype) if rows.dtype != self.wire_dtype else rows.contiguous()
        received = torch.empty_like(send)
        dist.all_to_all_single(received, send, group=group)
        return received

    @property
    def nonfinite_events(self) -> int:
        """Steps whose rows held a non-finite value on this rank (zeroed before the exchange).

        On an accelerator the count is kept on the device and read here, so reading it waits
        for the device; a rise since the last read is logged then."""
        if self._device_events is not None:
            seen = self._host_events + int(self._device_events.item())
            if seen > self._reported:
                log.warning("non-finite gradient values in sharded group %s on %d more step(s): zeroed "
                            "before the exchange", self.name or "?", seen - self._reported)
            self._reported = seen
            return seen
        return self._host_events

    def _zero_nonfinite(self, rows: torch.Tensor) -> None:
        if rows.device.type != "cpu":
            self._zero_nonfinite_on_device(rows)
            return
        # on a CPU the flag costs nothing to read: zero only where needed, and say so at once
        if not is_finite(rows):
            self._host_events += 1
            self._reported += 1
            log.warning("non-finite gradient values in sharded group %s: zeroed before the exchange",
                        self.name or "?")
            torch.nan_to_num_(rows, nan=0.0, posinf=0.0, neginf=0.0)

    def _zero_nonfinite_on_device(self, rows: torch.Tensor) -> None:
        """Zero without reading a flag on the host: a read would make the host wait for the device
        at every group and step, so the device never runs ahead of backward's launches.  The
        zeroing pass runs every step instead, and the count stays on the device until asked."""
        bad = torch.isfinite(rows).logical_not_().any()
        if self._device_events is None:
            self._device_events = bad.to(torch.int64)
        else:
            self._device_events.add_(bad)
        torch.nan_to_num_(rows, nan=0.0, posinf=0.0, neginf=0.0)


class IntReduceScatter(ExactReduceScatter):
    """Block-quantised rows: ``bits``-bit integer codes (stochastic rounding) and one fp32 scale per
    :data:`BLOCK` values, in two all-to-alls (codes, then scales), dequantised and summed in fp32.
    8-bit codes travel as int8; 4-bit codes (qgZ's width) two to a byte.

    Stochastic rounding makes each rank's decoded row an unbiased estimate of its row, so the sum
    is unbiased without a residual.  Its noise is seeded from ``seed``, the step and the rank, so
    it is reproducible and never draws from torch's global generator.
    """

    def __init__(self, name: str = "", seed: int = 0, bits: int = 8) -> None:
        super().__init__(torch.float32, name)
        if bits not in (4, 8):
            raise ValueError(f"bits={bits!r}; allowed on a sharded group: 4 or 8")
        self.seed, self.bits = seed, bits
        self.step = 0

    def _exchange(self, rows: torch.Tensor, group) -> torch.Tensor:
        world, shard = rows.shape
        levels = (1 << (self.bits - 1)) - 1  # codes in [-levels, levels]: 127 or 7
        blocks = -(-shard // BLOCK)
        padded = rows.new_zeros(world, blocks * BLOCK, dtype=torch.float32)
        padded[:, :shard] = rows
        padded = padded.view(world, blocks, BLOCK)
        scales = padded.abs().amax(dim=2).div_(float(levels)).clamp_(min=torch.finfo(torch.float32).tiny)
        gen = torch.Generator(device=rows.device)
        gen.manual_seed((self.seed * 1_000_003 + self.step * 7_919 + dist.get_rank(group) * 104_729) % (2**63 - 1))
        noise = torch.rand(padded.shape, generator=gen, device=rows.device)
        codes = padded.div_(scales.unsqueeze(2)).add_(noise).floor_().clamp_(-levels, levels).to(torch.int8)
        self.step += 1
        if self.bits == 4:  # two codes a byte, offset to 0..14
            nibbles = (codes + levels).to(torch.uint8).view(world, blocks, BLOCK // 2, 2)
            codes = nibbles[..., 0] | (nibbles[..., 1] << 4)
        got_codes = torch.empty_like(codes)
        got_scales = torch.empty_like(scales)
        dist.all_to_all_single(got_codes, codes, group=group)
        dist.all_to_all_single(got_scales, scales, group=group)
        if self.bits == 4:
            got_codes = torch.stack([got_codes & 0x0F, got_codes >> 4], dim=-1).view(world, blocks, BLOCK)
            got_codes = got_codes.to(torch.int8) - levels
        decoded = got_codes.to(torch.float32).mul_(got_scales.unsqueeze(2))
        return decoded.view(world, blocks * BLOCK)[:, :shard]


@dataclass(frozen=True)
class ShardSegment:
    """One parameter's place in a group's reduce-scatter rows: row r holds its dim-0 chunk r
    (``chunk`` rows of ``width`` values, zero-padded) at ``offset``; ``rows`` is its unsharded
    dim 0.  ``matrix``: whether PowerSGD compresses it (2-D or more, sharded on dim 0)."""

    name: str
    offset: int
    chunk: int
    width: int
    rows: int
    matrix: bool

    @property
    def numel(self) -> int:
        return self.chunk * self.width


def group_layout(module, prefix: str = "") -> list[ShardSegment]:
    """The segments of a ``fully_shard`` module's reduce-scatter rows, in FSDP's order
    (``chunk_cat`` of each gradient's dim-0 chunks, see ``foreach_reduce``), named as in the
    model (``prefix``: the module's name in it)."""
    state = module._get_fsdp_state()
    holders = {id(m): n for n, m in module.named_modules()}
    segments, offset = [], 0
    for g in state._fsdp_param_groups:
        for fp in g.fsdp_params:
            padded = fp.padded_sharded_param_size
            chunk, width = padded[0] if len(padded) else 1, max(1, math.prod(padded[1:]))
            dim0 = getattr(fp, "fsdp_placement", None)
            rows = fp._orig_size[0] if len(fp._orig_size) else 1
            # PowerSGD pays where (rows + width) x rank < rows x width, checked per rank by the comm
            matrix = len(fp._orig_size) >= 2 and (dim0 is None or dim0.dim == 0)
            name = _param_name(fp, holders, prefix) or f"{prefix}[{len(segments)}]"
            segments.append(ShardSegment(name, offset, chunk, width, rows, matrix))
            offset += chunk * width
    return segments


class PowerSGDReduceScatter(ExactReduceScatter):
    """PowerSGD (rank ``rank``) on every matrix of a group, inside its reduce-scatter.

    Each rank rebuilds its own unsharded gradient of every matrix from its rows (FSDP hands
    each rank the local gradients of the whole group, laid out by destination), then one power
    iteration with warm start: ``P = M Q`` for every matrix in one all-reduce, ``P`` orthonormalised,
    ``Q = Mᵀ P`` in a second all-reduce; each rank keeps only its own rows of ``P Qᵀ``, the
    approximate sum.  The other parameters (1-D, or sharded on another dim) cross exactly, in
    one fp32 all-to-all.  So what crosses the wire is ``(n + m) x rank`` values a matrix, in
    all-reduces, instead of ``n x m`` in the reduce-scatter.

    Error feedback (on by default) keeps each rank's residual ``M - P̂ P̂ᵀ M`` of every matrix:
    the *unsharded* size of the group's matrices on every rank, the memory sharding saves
    (:attr:`residual_bytes` says how much).  The initial Q of each matrix is seeded by its name,
    so every rank starts alike.
    """

    def __init__(self, layout: list[ShardSegment], rank: int, name: str = "", error_feedback: bool = True,
                 seed: int = 0) -> None:
        super().__init__(torch.float32, name)
        self.layout, self.rank, self.error_feedback, self.seed = layout, rank, error_feedback, seed
        self.q: dict[str, torch.Tensor] = {}
        self.residuals: dict[str, torch.Tensor] = {}

    @property
    def residual_bytes(self) -> int:
        """The residuals' memory on this rank now (they are made at the first step)."""
        return sum(r.numel() * r.element_size() for r in self.residuals.values())

    def expected_residual_bytes(self) -> int:
        """What the residuals will hold once training runs: every compressed matrix, unsharded, in fp32."""
        return 4 * sum(s.rows * s.width for s in self.matrices()) if self.error_feedback else 0

    def matrices(self) -> list[ShardSegment]:
        """The segments PowerSGD compresses: matrices sharded on dim 0 where ``(rows + width) x rank``
        is less than ``rows x width``."""
        return [s for s in self.layout if s.matrix and (s.rows + s.width) * self.rank < s.rows * s.width]

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group, op, async_op: bool = False):
        world = dist.get_world_size(group)
        me = dist.get_rank(group)
        rows = input_tensor.view(world, -1)
        self._zero_nonfinite(rows)
        self._show_local(rows)
        matrices = self.matrices()
        exact = [s for s in self.layout if s not in matrices]
        out = output_tensor.view(-1)
        if exact:  # the parameters PowerSGD leaves alone: an exact fp32 reduce-scatter of their segments
            send = torch.cat([rows[:, s.offset:s.offset + s.numel] for s in exact], dim=1).float().contiguous()
            got = torch.empty_like(send)
            dist.all_to_all_single(got, send, group=group)
            summed, at = got.sum(dim=0), 0
            for s in exact:
                out[s.offset:s.offset + s.numel].copy_(summed[at:at + s.numel])
                at += s.numel
        if matrices:
            ms = [self._matrix(rows, s, world) for s in matrices]
            qs = [self._q(s, m) for s, m in zip(matrices, ms)]
            ps = torch.cat([(m @ q).reshape(-1) for m, q in zip(ms, qs)])
            dist.all_reduce(ps, group=group)
            p_hats, at = [], 0
            for s in matrices:
                p_hats.append(orthogonalize_(ps[at:at + s.rows * self.rank].view(s.rows, self.rank)))
                at += s.rows * self.rank
            local_q = [m.t() @ p for m, p in zip(ms, p_hats)]
            summed_q = torch.cat([q.reshape(-1) for q in local_q])
            dist.all_reduce(summed_q, group=group)
            at = 0
            for s, m, p, q_local in zip(matrices, ms, p_hats, local_q):
                q = summed_q[at:at + s.width * self.rank].view(s.width, self.rank)
                at += s.width * self.rank
                self.q[s.name] = q.clone()  # warm start: identical on every rank (it came out of an all-reduce)
                if self.error_feedback:
                    self.residuals[s.name] = m - p @ q_local.t()
                mine = torch.zeros(s.chunk, s.width)
                lo, hi = me * s.chunk, min((me + 1) * s.chunk, s.rows)
                if hi > lo:
                    mine[: hi - lo] = p[lo:hi] @ q.t()
                out[s.offset:s.offset + s.numel].copy_(mine.view(-1))
        if _is_avg(op):
            out.div_(world)
        self._show_delivered(output_tensor, op)
        return None

    def _matrix(self, rows: torch.Tensor, s: ShardSegment, world: int) -> torch.Tensor:
        """This rank's unsharded gradient of ``s`` (rows x width, fp32), its residual added."""
        chunks = rows[:, s.offset:s.offset + s.numel].reshape(world * s.chunk, s.width)[: s.rows].float()
        residual = self.residuals.get(s.name)
        return chunks + residual if residual is not None else chunks.clone()

    def _q(self, s: ShardSegment, m: torch.Tensor) -> torch.Tensor:
        q = self.q.get(s.name)
        if q is None:
            gen = torch.Generator().manual_seed(stable_hash(s.name) + self.seed)
            q = torch.randn(s.width, self.rank, generator=gen)
        return q

    def state_dict(self) -> dict[str, torch.Tensor]:
        """This rank's residuals and warm-start Qs, for every compressed matrix from the start (a
        residual not made yet is zeros, a Q not warmed yet its seeded start): a checkpoint has the
        same entries whenever it is taken, so one can be loaded into a fresh comm."""
        state = {}
        for s in self.matrices():
            if self.error_feedback:
                state[f"residual/{s.name}"] = self.residuals.get(s.name, torch.zeros(s.rows, s.width))
            state[f"q/{s.name}"] = self._q(s, None)
        return state

    def load_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        self.residuals = {k[len("residual/"):]: v.clone() for k, v in state.items() if k.startswith("residual/")}
        self.q = {k[len("q/"):]: v.clone() for k, v in state.items() if k.startswith("q/")}


def _stateful_comms(model: torch.nn.Module):
    """(state key prefix, the group's FSDP param group, its comm) of every group whose comm keeps state."""
    for prefix, module, _ in sharded_groups(model):
        group = module._get_fsdp_state()._fsdp_param_groups[0]
        if isinstance(group._reduce_scatter_comm, PowerSGDReduceScatter):
            yield f"{prefix or '(root)'}/", group, group._reduce_scatter_comm


def compression_state_dict(model: torch.nn.Module) -> dict[str, Any]:
    """The state every group's comm keeps between steps (PowerSGD's residuals and warm starts), for a
    distributed checkpoint (``torch.distributed.checkpoint``) beside the model's and optimizer's.

    Residuals differ between ranks, so each tensor goes in as a DTensor over the group's mesh with
    one row a rank (``Shard(0)``): DCP then saves and loads every rank's own.  Every rank calls it.
    """
    from torch.distributed.tensor import DTensor, Shard

    return {head + key: DTensor.from_local(tensor.unsqueeze(0).contiguous(), group.mesh_info.mesh, [Shard(0)],
                                           run_check=False)
            for head, group, comm in _stateful_comms(model) for key, tensor in comm.state_dict().items()}


def gathered_compression_state(model: torch.nn.Module, plan: Plan, group=None) -> dict[str, Any]:
    """The plan and every rank's comm state, gathered (collective: every rank calls it): for
    checkpoints that keep rank 0's objects only (Lightning's callback state)."""
    local = {head + key: tensor.clone() for head, _, comm in _stateful_comms(model)
             for key, tensor in comm.state_dict().items()}
    return {"sharded": True, "plan": plan.to_dict(), "ranks": every_rank(local, group) if dist.is_initialized()
            else [local]}


def load_gathered_compression_state(model: torch.nn.Module, gathered: Mapping[str, Any], group=None) -> bool:
    """This rank's part of :func:`gathered_compression_state` into the installed comms; False (nothing
    loaded, the residuals start from zero) where the world size changed since it was saved."""
    states = gathered["ranks"]
    world = dist.get_world_size(group) if dist.is_initialized() else 1
    if len(states) != world:
        return False
    load_compression_state_dict(model, states[dist.get_rank(group) if dist.is_initialized() else 0])
    return True


def load_compression_state_dict(model: torch.nn.Module, state: Mapping[str, Any]) -> None:
    """Give every group's comm the state :func:`compression_state_dict` took (after the same plan
    was installed); a group whose comm keeps state but finds none in ``state`` is an error."""
    for head, _, comm in _stateful_comms(model):
        mine = {k[len(head):]: v.to_local()[0] if hasattr(v, "to_local") else v
                for k, v in state.items() if k.startswith(head)}
        missing = sorted(set(comm.state_dict()) - set(mine))
        if missing:
            raise ValueError(f"the checkpoint has no compression state for group {head[:-1]!r} ({missing[:2]}...): "
                             "it was saved under another plan; install the plan it was saved with, or start that "
                             "group's state afresh")
        comm.load_state_dict(mine)


@dataclass
class ShardedGroup:
    """One ``fully_shard`` group: its module's name, its parameters' names, the config it runs, the
    reduce-scatter that runs it (None: FSDP's own) and the FSDP module itself."""

    module: str
    parameters: tuple[str, ...]
    config: CompressorConfig
    comm: Any = None
    fsdp_module: Any = None


def sharded_config_allowed(config: CompressorConfig) -> bool:
    """Whether a sharded group can run ``config`` (:data:`SHARDED_ALLOWED`)."""
    return (config.label in ("none", "fp16", "bf16") or config.name == "powersgd"
            or (config.name == "intquant" and config.params.get("bits") in (4, 8)))


def comm_for(config: CompressorConfig, name: str, seed: int = 0, layout: list[ShardSegment] | None = None):
    """The reduce-scatter that runs ``config`` (None for ``none``: FSDP's own path); PowerSGD
    needs the group's ``layout`` (:func:`group_layout`)."""
    label = config.label
    if not sharded_config_allowed(config):
        raise ValueError(f"compressor {label!r} cannot run on a sharded (fully_shard) group yet; allowed there: "
                         f"{SHARDED_ALLOWED}")
    if label == "none":
        return None
    if label in ("fp16", "bf16"):
        return ExactReduceScatter(torch.float16 if label == "fp16" else torch.bfloat16, name)
    if config.name == "powersgd":
        if layout is None:
            raise ValueError(f"PowerSGD on sharded group {name!r} needs the group's layout (group_layout(module))")
        return PowerSGDReduceScatter(layout, config.params["rank"], name, config.error_feedback is not False, seed)
    return IntReduceScatter(name, seed, config.params["bits"])


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
    holders = {id(m): n for n, m in model.named_modules()}
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
        params = tuple(name for name in (_param_name(fp, holders) for g in groups for fp in g.fsdp_params) if name)
        if params:
            found.append((prefix, module, params))
    if not found:
        raise ValueError("no fully_shard module in the model: shard it with torch.distributed.fsdp.fully_shard "
                         "first (each block, then the root)")
    return found


def _param_name(fsdp_param, holders: Mapping[int, str], prefix: str = "") -> str | None:
    """An FSDP parameter's name as ``named_parameters`` gives it (under ``prefix``), found through
    the module that holds it (``holders``: id -> name): the parameter object itself is another one
    while it is unsharded (the root's stays so after a forward without backward)."""
    info = fsdp_param._module_info
    holder = holders.get(id(info.module))
    if holder is None:
        return None
    name = f"{holder}.{info.param_name}" if holder else info.param_name
    return f"{prefix}.{name}" if prefix else name


def group_numel(module) -> int:
    """How many values a ``fully_shard`` module's reduce-scatter takes in: every rank's row of
    every parameter's (padded) shard."""
    state = module._get_fsdp_state()
    world = state._fsdp_param_groups[0].mesh_info.shard_mesh_size if state._fsdp_param_groups else 1
    return world * row_width(module)


def row_width(module) -> int:
    """How many values one row of a ``fully_shard`` module's reduce-scatter holds: one rank's (padded)
    shard of every parameter, and so the reduced shard the rank receives."""
    state = module._get_fsdp_state()
    return sum(fp.padded_sharded_param_size.numel() for g in state._fsdp_param_groups for fp in g.fsdp_params)


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
    for prefix, module, params in found:
        configs = {plan.config_for(n).label: plan.config_for(n) for n in params}
        if len(configs) > 1:
            raise ValueError(f"plan gives fully_shard group {prefix or '(root)'!r} several configs "
                             f"({', '.join(sorted(configs))}); a group's gradients cross in one reduce-scatter: "
                             "give all its parameters one config")
        config = next(iter(configs.values()))
        comm = comm_for(config, prefix or "(root)", plan.seed,
                        group_layout(module, prefix) if config.name == "powersgd" else None)
        if comm is None and exact:
            comm = ExactReduceScatter(torch.float32, prefix or "(root)")
        groups.append(ShardedGroup(prefix, params, config, comm, module))
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
