"""Profile a sharded (FSDP2, ``fully_shard``) model on the live cluster, one parameter group at a time.

Under FSDP2 each group's gradients leave backward in one reduce-scatter, and a custom one is called
synchronously (:mod:`advisor.runtime.sharded`), so on a CPU cluster with gloo a step is its compute
and all-gathers plus every group's reduce-scatter, one after another.  The profile measures what
the performance model needs for that:

* a training step under FSDP's own reduce-scatters (``step_s``, median, slowest rank);
* per group, its reduce-scatter's input size, and for each config the seconds its reduce-scatter
  takes on this cluster, encode and decode included (FSDP's own for ``none``), timed on the
  group's *real* gradient rows, captured from training steps;
* per group and config, how far the reduced shard lands from the exact fp32 sum on those same
  rows: ``||decoded - exact|| / ||exact||`` over the captured steps and ranks, the comm's state
  (PowerSGD's warm start, residuals) carried from step to step as in training.

Every rank profiles; every number is agreed across ranks (slowest for times, summed for errors),
so every rank holds the same profile.  The model's weights and optimizer end as they began.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from advisor.compressors.registry import parse
from advisor.core.collectives import mean_over_ranks, slowest, world_size
from advisor.core.documents import VersionedDocument, check_int
from advisor.runtime.sharded import (
    SHARDED_ALLOWED,
    SHARDED_CONFIGS,
    ExactReduceScatter,
    comm_for,
    group_layout,
    group_numel,
    sharded_config_allowed,
    sharded_groups,
)
from profilers.training_state import StateGuard

SHARDED_PROFILE_KIND = "compression-advisor/sharded-profile"


@dataclass
class ShardedGroupProfile:
    """One ``fully_shard`` group: its name, parameters, reduce-scatter input size, and per config
    the seconds its reduce-scatter takes and its error against the exact sum."""

    name: str
    parameters: list[str]
    numel: int
    seconds: dict[str, float]
    error: dict[str, float]

    def __post_init__(self) -> None:
        check_int("numel", self.numel, 1)
        for label, value in [*self.seconds.items(), *self.error.items()]:
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                raise ValueError(f"group {self.name!r}: {label} must be a finite number >= 0, got {value!r}")
        if "none" not in self.seconds:
            raise ValueError(f"group {self.name!r}: the seconds of FSDP's own reduce-scatter ('none') are missing")


@dataclass
class ShardedProfile(VersionedDocument):
    """A sharded model's groups on this cluster (see the module doc)."""

    what = "sharded profile"
    KIND = SHARDED_PROFILE_KIND
    VERSION = 1
    REDO = "profile the sharded model again with this version"

    world_size: int
    step_s: float
    groups: list[ShardedGroupProfile]
    configs: list[str]
    device: str = "cpu"
    steps: int = 0
    kind: str = SHARDED_PROFILE_KIND
    version: int = 1

    def __post_init__(self) -> None:
        check_int("world_size", self.world_size, 1)
        if not (math.isfinite(self.step_s) and self.step_s > 0):
            raise ValueError(f"step_s must be a positive number of seconds, got {self.step_s!r}")
        if not self.groups:
            raise ValueError("a sharded profile needs at least one group")
        for g in self.groups:
            missing = [c for c in self.configs if c not in g.seconds or c not in g.error]
            if missing:
                raise ValueError(f"group {g.name!r} has no measurement of {missing}")

    @property
    def compute_s(self) -> float:
        """The step without its reduce-scatters: compute, all-gathers, the optimizer (at least 0)."""
        return max(0.0, self.step_s - sum(g.seconds["none"] for g in self.groups))


class _RowRing:
    """The last ``keep`` copies of a group's rows, in order.

    Why buffers made once and reused: a fresh copy every step, all kept, slowed the whole step
    as the kept memory grew (docs/benchmarks.md, "Sharded training").  The buffers are made and
    touched at the first call, in the step a capture leaves untimed; later copies land in warm memory.
    """

    def __init__(self, keep: int) -> None:
        self.keep, self.buffers, self.count = keep, [], 0

    def add(self, rows: torch.Tensor) -> None:
        if not self.buffers or self.buffers[0].shape != rows.shape or self.buffers[0].dtype != rows.dtype:
            self.buffers, self.count = [torch.zeros_like(rows) for _ in range(self.keep)], 0
        with torch.no_grad():
            self.buffers[self.count % self.keep].copy_(rows)
        self.count += 1

    def last(self) -> list[torch.Tensor]:
        """The copies kept, oldest first."""
        n = min(self.count, self.keep)
        return [self.buffers[(self.count - n + i) % self.keep] for i in range(n)]


class _Recorder:
    """Stands in for a group's reduce-scatter: keeps a copy of the rows it is given, then runs the
    comm that was there, so training goes on exactly as before."""

    def __init__(self, inner, ring: _RowRing, capture: RowCapture) -> None:
        self.inner, self.ring, self.capture = inner, ring, capture

    def allocate(self, size, *, dtype, device):
        return self.inner.allocate(size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op, async_op: bool = False):
        t0 = time.perf_counter()
        self.ring.add(input_tensor)
        self.capture.spent_s += time.perf_counter() - t0
        return self.inner(output_tensor=output_tensor, input_tensor=input_tensor, group=group, op=op)


def check_sharded_configs(configs: Sequence[str]) -> list[str]:
    """The configs as registry labels, ``none`` first; a config a sharded group cannot run is refused."""
    labels = list(dict.fromkeys(parse(c).label for c in ["none", *configs]))
    bad = [c for c in labels if not sharded_config_allowed(parse(c))]
    if bad:
        raise ValueError(f"config(s) {bad} cannot run on a sharded (fully_shard) group; allowed: {SHARDED_ALLOWED}")
    return labels


def profile_sharded(model: torch.nn.Module, loss_fn: Callable[[torch.nn.Module, Any], torch.Tensor],
                    batches: Sequence[Any], optimizer: torch.optim.Optimizer | None,
                    configs: Sequence[str] = SHARDED_CONFIGS, *, steps: int = 3, repeats: int = 3,
                    group=None) -> ShardedProfile:
    """Profile ``model``'s ``fully_shard`` groups; every rank calls it (see the module doc).

    ``steps`` training steps are timed under FSDP's own path (after one that warms it up), and
    their gradient rows captured; each config's reduce-scatter then runs ``repeats`` times on each
    captured step's rows.  ``batches``: this rank's training batches, cycled.

    Raises:
        ValueError: a config a sharded group cannot run, no batches, or a bad count.
    """
    labels = check_sharded_configs(configs)
    check_int("steps", steps, 1)
    check_int("repeats", repeats, 1)
    batches = list(batches)
    if not batches:
        raise ValueError("profiling the sharded model needs at least one batch")
    capture = RowCapture(model, keep=steps)
    times = []
    with StateGuard(model, optimizer):
        capture.start()
        try:
            for i in range(steps + 1):
                t0, copied = time.perf_counter(), capture.spent_s
                model.zero_grad(set_to_none=True)
                loss_fn(model, batches[i % len(batches)]).backward()
                if optimizer is not None:
                    optimizer.step()
                if i:  # the first step allocates and warms up
                    times.append(time.perf_counter() - t0 - (capture.spent_s - copied))
        finally:
            capture.stop()
    return capture.profile(labels, statistics.median(times), steps, repeats, group)


class RowCapture:
    """Captures the rows FSDP hands each group's reduce-scatter during training steps (:meth:`start`
    to :meth:`stop`; training runs exactly as without it), then profiles every config on them.

    It keeps the last ``keep`` steps' rows of each group.  Its copies cost time a step without the
    capture does not spend: ``spent_s`` adds up the seconds they took, so a step timed under the
    capture is read as ``its time - the spent_s it added``.
    """

    def __init__(self, model: torch.nn.Module, keep: int) -> None:
        check_int("keep", keep, 1)
        self.found = sharded_groups(model)
        self._rings = [_RowRing(keep) for _ in self.found]
        self._states = [module._get_fsdp_state()._fsdp_param_groups for _, module, _ in self.found]
        self._saved: list[list[Any]] = []
        #: seconds the copies of the rows took, since the capture was made
        self.spent_s = 0.0

    def start(self) -> None:
        self._saved = [[g._reduce_scatter_comm for g in groups] for groups in self._states]
        for groups, ring in zip(self._states, self._rings):
            for g in groups:
                g._reduce_scatter_comm = _Recorder(g._reduce_scatter_comm, ring, self)

    def stop(self) -> None:
        for groups, comms in zip(self._states, self._saved):
            for g, comm in zip(groups, comms):
                g._reduce_scatter_comm = comm

    @property
    def rows(self) -> list[list[torch.Tensor]]:
        """Per group, the rows of the last ``keep`` reduce-scatters captured, oldest first."""
        return [ring.last() for ring in self._rings]

    def profile(self, labels: Sequence[str], step_s: float, steps: int, repeats: int, group=None) -> ShardedProfile:
        """Each config's reduce-scatter on the last ``steps`` captured steps' rows (``step_s``: this
        rank's median step under FSDP's own path); every rank calls it."""
        pg = group if group is not None else dist.group.WORLD
        if any(not rows for rows in self.rows):
            empty = [name or "(root)" for (name, _, _), rows in zip(self.found, self.rows) if not rows]
            raise ValueError(f"group(s) {empty} reduced no gradients in the captured steps: do their parameters "
                             "take part in the loss?")
        profiles, captured = [], self.rows
        for (name, module, params), rows, comms in zip(self.found, captured, self._saved):
            seconds, error = _measure_group(rows[-steps:], comms[0], labels, repeats, pg, name or "(root)",
                                            group_layout(module, name))
            profiles.append(ShardedGroupProfile(name or "(root)", list(params), group_numel(module), seconds, error))
        return ShardedProfile(world_size(group), slowest([step_s], group)[0], profiles, list(labels),
                              device=str(captured[0][0].device), steps=steps)


def _measure_group(rows: list[torch.Tensor], native, labels: Sequence[str], repeats: int, pg, name: str,
                   layout) -> tuple[dict[str, float], dict[str, float]]:
    """Each config's reduce-scatter on the captured rows: (median seconds, slowest rank; error vs exact)."""
    world = dist.get_world_size(pg)
    exact_comm = ExactReduceScatter(torch.float32, name)
    shard = rows[0].numel() // world
    exact = [torch.empty(shard, dtype=torch.float32) for _ in rows]
    for r, out in zip(rows, exact):
        exact_comm(out, r.float().clone(), pg, dist.ReduceOp.SUM)
    local_s, sq_err = [], []
    for label in labels:
        # the error: one comm over the captured steps in order, as in training (PowerSGD's warm start
        # and every residual carry over); the time: a second one, each step's rows ``repeats`` times
        judged, timed = ((native, native) if label == "none" else
                         (comm_for(parse(label), name, layout=layout), comm_for(parse(label), name, layout=layout)))
        runs, err = [], 0.0
        for r, ref in zip(rows, exact):
            out = torch.empty(shard, dtype=r.dtype)
            judged(output_tensor=out, input_tensor=r.clone(), group=pg, op=dist.ReduceOp.SUM)
            err += float((out.float() - ref).pow(2).sum())
            for _ in range(repeats):
                data = r.clone()  # a comm may zero non-finite values in place
                t0 = time.perf_counter()
                timed(output_tensor=out, input_tensor=data, group=pg, op=dist.ReduceOp.SUM)
                runs.append(time.perf_counter() - t0)
        local_s.append(statistics.median(runs))
        sq_err.append(err)
    norms = [float(ref.pow(2).sum()) for ref in exact]
    seconds = slowest(local_s, pg)
    totals = mean_over_ranks(sq_err + [sum(norms)], pg)  # a ratio of sums over ranks: the mean serves
    scale = totals[-1]
    errors = [math.sqrt(e / scale) if scale > 0 else 0.0 for e in totals[:-1]]
    return dict(zip(labels, seconds)), dict(zip(labels, errors))

