"""Check, during sharded training, how far each group's compressed reduce-scatter is from the exact sum.

The sharded twin of :class:`advisor.runtime.monitor.FidelityMonitor`.  A group's reduce-scatter
takes every rank's whole ``(world, width)`` buffer in and leaves one row, the rank's own reduced
shard, out.  So each step, for a random sample of ``(row, column)`` positions across the
compressed groups' buffers (the same on every rank), the monitor keeps two numbers per
position: this rank's input value there (before compression), and, where the row is this
rank's own, the value its reduce-scatter delivered.  At the end of a window one all-reduce of
both (``2 × window × sample`` fp32 numbers: what crosses the wire, whatever the world size)
gives every rank the exact sum at each position and what every owner received there; the
window's error is read from the sums over the window, as under DDP, and is the same on every
rank.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from advisor.core.collectives import world_size
from advisor.core.documents import check_int
from advisor.runtime.monitor import (
    DEFAULT_SAMPLE,
    DEFAULT_WINDOW,
    FidelityReading,
    all_reduced,
    draw_sample,
    read_window,
)
from advisor.runtime.sharded import ShardedGroup, row_width


class ShardedFidelityMonitor:
    """Samples what each compressed group's reduce-scatter delivers on one rank; every rank makes the
    same calls at the same steps.

    ``groups`` are what :func:`advisor.runtime.sharded.install_sharded` (or
    :meth:`~advisor.runtime.sharded.ShardedSwitch.set`) returned: the monitor
    watches their comms, so a new plan needs a new monitor.  Groups under ``none`` (FSDP's own
    reduce-scatter, or the exact all-to-all) are exact and not sampled.  ``start()`` attaches it;
    ``step_ends()``, called between steps on every rank, returns a :class:`FidelityReading` at the
    end of each window (one all-reduce on ``group``, from the training thread) and None
    otherwise; ``close()`` detaches it.  ``at_step``: the training step it starts at, so that
    readings name training steps.  A step in which no watched reduce-scatter ran (gradient
    accumulation without sync, evaluation) does not count.
    """

    def __init__(self, groups: Sequence[ShardedGroup], *, sample: int = DEFAULT_SAMPLE,
                 window: int = DEFAULT_WINDOW, per_coordinate: bool = False, seed: int = 0, at_step: int = 0,
                 group=None) -> None:
        check_int("sample", sample, 1)  # positions sampled per window
        check_int("window", window, 2)  # steps per reading
        self.groups = list(groups)
        self.sample, self.window, self.per_coordinate, self.seed, self.group = sample, window, per_coordinate, seed, group
        self._watched: list[tuple[ShardedGroup, int]] = []  # (group, its row width)
        self._where: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}  # id(comm) -> slots, rows, cols
        self._labels: list[str] = []
        self._local: torch.Tensor | None = None
        self._delivered: torch.Tensor | None = None
        self._row = 0
        self._calls = 0  # watched reduce-scatters since the last step_ends
        self._steps = at_step  # the training step now (counted steps since the start, from at_step)
        self._first_step = 0
        self._windows = 0
        self._world, self._me = 1, 0  # the shard mesh: how many rows a buffer has, and which is this rank's
        self._attached = False

    @property
    def watching(self) -> bool:
        """Whether any group of the plan compresses (else there is nothing to sample)."""
        return bool(self._watched)

    # --- attaching ------------------------------------------------------------------------------
    def start(self) -> None:
        if self._attached:
            return
        # the modules as the plan was set on them: their parameters may be unsharded between steps
        # (the root's, after a forward without backward), where the model's names would not find them
        self._watched = [(g, row_width(g.fsdp_module)) for g in self.groups
                         if g.comm is not None and g.config.name != "none"]
        if self._watched:
            mesh = self._watched[0][0].fsdp_module._get_fsdp_state()._fsdp_param_groups[0].mesh_info
            self._world, self._me = mesh.shard_mesh_size, mesh.shard_mesh_rank
            if self._world != world_size(self.group):
                # under HSDP a group's reduce-scatter spans one replica's ranks only
                raise ValueError(f"the fidelity monitor reads a 1-D shard mesh over every rank of its group; this "
                                 f"model shards over {self._world} of {world_size(self.group)} ranks (HSDP): pass "
                                 "fidelity_sample=0 to train it without the monitor")
        for g, _ in self._watched:
            g.comm.watchers.append(self)
        self._attached = True
        self._new_window()

    def close(self) -> None:
        if self._attached:
            for g, _ in self._watched:
                if self in g.comm.watchers:
                    g.comm.watchers.remove(self)
            self._attached = False

    # --- between steps ----------------------------------------------------------------------------
    def step_ends(self) -> FidelityReading | None:
        """Close this step's row; at the window's end, the reading (collective: call on every rank)."""
        if self._local is None or self._calls == 0:
            return None
        self._calls = 0
        self._steps += 1
        self._row += 1
        if self._row < self.window:
            return None
        both = torch.stack([self._local, self._delivered])
        if world_size(self.group) > 1:
            both = all_reduced(both, self.group)
        reading = read_window(both[0], both[1], self._labels, self.per_coordinate, self._first_step)
        self._new_window()
        return reading

    def _new_window(self) -> None:
        """Draw this window's positions among the compressed groups' buffers (the same on every rank)."""
        self._row, self._first_step, self._where, self._labels = 0, self._steps, {}, []
        if not self._watched:
            self._local = self._delivered = None
            return
        drawn, parts = draw_sample([self._world * width for _, width in self._watched], self.sample,
                                   self.seed * 1_000_003 + self._windows)
        self._windows += 1
        self._labels = [""] * drawn
        own = []
        for (g, width), (slots, at) in zip(self._watched, parts):
            if not slots.numel():
                continue
            rows, cols = at // width, at % width
            self._where[id(g.comm)] = (slots, rows, cols)
            own.append(slots[rows == self._me])
            for s in slots.tolist():
                self._labels[s] = g.config.label
        self._local = torch.full((self.window, drawn), float("nan"))
        # each position's delivered value comes from the rank that owns its row: zero elsewhere, so the
        # window's all-reduce hands every rank every owner's value (NaN where the owner saw nothing)
        self._delivered = torch.zeros(self.window, drawn)
        if own:
            self._delivered[:, torch.cat(own)] = float("nan")

    # --- what the reduce-scatters show --------------------------------------------------------------
    def local(self, comm, rows: torch.Tensor) -> None:
        where = self._where.get(id(comm))
        if where is None or self._local is None:
            return
        self._calls += 1
        slots, r, c = where
        self._local[self._row, slots] = rows.detach()[r.to(rows.device), c.to(rows.device)].float().cpu()

    def delivered(self, comm, output: torch.Tensor, avg: bool) -> None:
        where = self._where.get(id(comm))
        if where is None or self._delivered is None:
            return
        slots, r, c = where
        mine = r == self._me
        values = output.detach().reshape(-1)[c[mine].to(output.device)].float().cpu()
        # compared with the exact *sum*: a comm asked to average divided it by the world size
        self._delivered[self._row, slots[mine]] = values * self._world if avg else values
