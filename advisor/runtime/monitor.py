"""Check, during training, how far what the plan delivers is from the exact mean gradient.

A plan proven at step 0 can hurt later: gradients shrink as training converges, and fp16's
range ends at 6.1e-5, so late in training most entries of a cast gradient lose their bits
or flush to zero.  A trial from the first steps cannot see that; this monitor can.

Each step, for a random sample of the compressed parameters' coordinates (the same on every
rank), the monitor keeps two numbers per coordinate: this rank's own gradient, shown to the
hook before compression, and the mean the plan delivered, shown after the exchange.  At the
end of a window of steps one all-reduce of the kept local values (``window × sample`` fp32
numbers: what crosses the wire) gives the exact mean for the sampled coordinates, and the
window's error is read from the sums over the window: error feedback carries what one step
leaves out into the next, so only the window's sum shows what the plan really lost.

Under an optimizer that scales each coordinate by its own running magnitude (Adam and kin),
a tiny coordinate's error becomes a full-sized error in the update; the error is then read
per coordinate, each divided by its own magnitude over the window.  Under SGD it is the
plain relative L2 error.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from advisor.compressors.base import SegmentLayout
from advisor.compressors.registry import CompressorConfig
from advisor.core.collectives import world_size
from advisor.core.documents import check_int

#: coordinates sampled by default: enough that the error's sampling spread is a few percent of
#: itself, few enough that the window's all-reduce is a small message
DEFAULT_SAMPLE = 2048
DEFAULT_WINDOW = 25


@dataclass(frozen=True)
class FidelityReading:
    """One window of the monitor: how far the plan's delivered mean was from the exact mean.

    ``error`` is the relative error of the window's summed gradient (error feedback
    included), ``step_error`` the mean of the steps' own relative errors, ``zeroed`` the
    share of sampled entries delivered as exactly zero where the exact mean was not (fp16
    flushing small gradients); ``by_config`` gives ``error`` per compressor label.
    """

    first_step: int
    steps: int
    coordinates: int
    error: float
    step_error: float
    zeroed: float
    per_coordinate: bool
    by_config: dict[str, float] = field(default_factory=dict)

    def describe(self) -> str:
        scale = "per-coordinate " if self.per_coordinate else ""
        return (f"{scale}error of the delivered mean over steps {self.first_step}-{self.first_step + self.steps - 1}: "
                f"{self.error:.2%} summed over the window, {self.step_error:.2%} per step, {self.zeroed:.1%} of "
                f"entries flushed to zero ({self.coordinates} sampled coordinates)")


class FidelityMonitor:
    """Samples what the plan delivers on one rank; every rank makes the same calls at the same steps.

    ``start()`` attaches it to the hook; ``step_ends()``, called between iterations on every
    rank, returns a :class:`FidelityReading` at the end of each window (one all-reduce on
    ``group``, from the training thread: the hook's own collectives run on a group of their
    own) and None otherwise.  A change of plan discards the window in progress; the next one
    samples the parameters the new plan compresses.  The plan's warm-up steps (uncompressed)
    are not read.  Parameters under plan ``none`` are not
    sampled: their mean is exact.
    """

    def __init__(self, hook, parameters: Sequence[tuple[str, torch.Tensor]], *, sample: int = DEFAULT_SAMPLE,
                 window: int = DEFAULT_WINDOW, per_coordinate: bool = False, group=None) -> None:
        check_int("sample", sample, 1)  # coordinates sampled per window
        check_int("window", window, 2)  # steps per reading
        self.hook, self.sample, self.window = hook, sample, window
        self.per_coordinate, self.group = per_coordinate, group
        self._numel = {name: p.numel() for name, p in parameters}
        self._windows = 0
        self._where: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}  # name -> (slots, flat indices)
        self._labels: list[str] = []  # the config label of each slot
        self._segments: dict[tuple[str, ...], tuple[torch.Tensor, torch.Tensor]] = {}
        self._local: torch.Tensor | None = None
        self._delivered: torch.Tensor | None = None
        self._row = 0
        self._first_step = 0
        self._plan = None  # the plan this window samples (a new plan is a new object: set_plan)
        self._hook_step = 0
        self._attached = False

    # --- attaching ----------------------------------------------------------------------------
    def start(self) -> None:
        if not self._attached:
            self.hook.observers.append(self._see_local)
            self.hook.deliveries.append(self._see_delivered)
            self._attached = True
        self._new_window()

    def close(self) -> None:
        if self._attached:
            self.hook.observers.remove(self._see_local)
            self.hook.deliveries.remove(self._see_delivered)
            self._attached = False

    # --- between steps --------------------------------------------------------------------------
    def step_ends(self) -> FidelityReading | None:
        """Close this step's row; at the window's end, the reading (collective: call on every rank)."""
        if self.hook.step < self.hook.plan.warmup_steps:
            # the plan's first steps cross uncompressed: a reference read there would be zero error
            self._plan, self._local = None, None
            return None
        if self.hook.plan is not self._plan:
            self._new_window()
            return None
        if self.hook.step == self._hook_step:
            return None  # no synchronised backward since the last call (no_sync, evaluation)
        self._hook_step = self.hook.step
        if self._local is None:
            return None
        self._row += 1
        if self._row < self.window:
            return None
        reading = self._read()
        self._new_window()
        return reading

    def _new_window(self) -> None:
        """Draw this window's coordinates among the parameters the plan compresses (same on every rank)."""
        plan = self.hook.plan
        self._plan, self._hook_step, self._row = plan, self.hook.step, 0
        self._first_step = self.hook.step
        names = sorted(n for n in self._numel if plan.config_for(n).name != "none")
        self._where, self._labels, self._segments = {}, [], {}
        if not names:
            self._local = self._delivered = None
            return
        drawn, parts = draw_sample([self._numel[n] for n in names], self.sample, plan.seed * 1_000_003 + self._windows)
        self._windows += 1
        self._labels = [""] * drawn
        for name, (slots, offsets) in zip(names, parts):
            if slots.numel():
                self._where[name] = (slots, offsets)
                label = plan.config_for(name).label
                for s in slots.tolist():
                    self._labels[s] = label
        self._local = torch.full((self.window, drawn), float("nan"))
        self._delivered = torch.full((self.window, drawn), float("nan"))

    # --- what the hook shows -----------------------------------------------------------------------
    def _take(self, layout: SegmentLayout, segment: torch.Tensor, into: torch.Tensor | None) -> None:
        if into is None or self._row >= self.window:
            return
        slots, index = self._in_segment(layout)
        if slots.numel():
            into[self._row, slots] = segment.detach()[index.to(segment.device)].float().cpu()

    def _in_segment(self, layout: SegmentLayout) -> tuple[torch.Tensor, torch.Tensor]:
        """The window's slots in this segment and their offsets in its flat buffer (cached per window)."""
        cached = self._segments.get(layout.names)
        if cached is None:
            slots, index, offset = [], [], 0
            for name, shape in zip(layout.names, layout.shapes):
                where = self._where.get(name)
                if where is not None:
                    slots.append(where[0])
                    index.append(where[1] + offset)
                offset += math.prod(shape)
            empty = torch.zeros(0, dtype=torch.int64)
            cached = self._segments[layout.names] = (torch.cat(slots) if slots else empty,
                                                     torch.cat(index) if index else empty)
        return cached

    def _see_local(self, layout: SegmentLayout, grad: torch.Tensor, config: CompressorConfig) -> None:
        self._take(layout, grad, self._local)

    def _see_delivered(self, layout: SegmentLayout, mean: torch.Tensor, config: CompressorConfig) -> None:
        self._take(layout, mean, self._delivered)

    # --- the window's reading ----------------------------------------------------------------------
    def _read(self) -> FidelityReading:
        local = self._local
        if world_size(self.group) > 1:
            local = all_reduced(local, self.group)
        return read_window(local / world_size(self.group), self._delivered, self._labels, self.per_coordinate,
                           self._first_step)


def draw_sample(sizes: Sequence[int], sample: int, seed: int) -> tuple[int, list[tuple[torch.Tensor, torch.Tensor]]]:
    """``sample`` positions drawn uniformly (repeats dropped) across parts of ``sizes`` laid end to end,
    from a generator seeded by ``seed`` (so every rank draws the same): how many were kept, and for
    each part its slots among them and their offsets in it."""
    sizes = torch.tensor(list(sizes), dtype=torch.int64)
    ends = torch.cumsum(sizes, 0)
    flat = torch.randint(int(ends[-1]), (sample,), generator=torch.Generator().manual_seed(seed)).unique()
    owner = torch.searchsorted(ends, flat, right=True)
    starts = ends - sizes
    parts = []
    for i in range(len(sizes)):
        slots = (owner == i).nonzero().flatten()
        parts.append((slots, flat[slots] - starts[i]))
    return flat.numel(), parts


def all_reduced(values: torch.Tensor, group) -> torch.Tensor:
    """The sum of ``values`` over the ranks of ``group``, on CPU, in a new tensor (``values`` is left as it
    was; moved to the GPU and back under NCCL)."""
    backend = dist.get_backend(group)
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    moved = values.to(device, copy=True)
    dist.all_reduce(moved, group=group)
    return moved.cpu()


def read_window(exact: torch.Tensor, delivered: torch.Tensor, labels: Sequence[str], per_coordinate: bool,
                first_step: int) -> FidelityReading:
    """A window's reading from the exact and delivered values of its sampled coordinates, ``(steps,
    coordinates)`` each, alike on every rank (``labels``: each coordinate's config).  A coordinate
    not seen on every step (NaN in either) is left out."""
    seen = torch.isfinite(exact).all(0) & torch.isfinite(delivered).all(0)
    exact, delivered = exact[:, seen], delivered[:, seen]
    labels = [label for label, keep in zip(labels, seen.tolist()) if keep]
    scale = exact.pow(2).mean(0).sqrt() if per_coordinate else torch.ones(exact.shape[1])
    live = scale > 0
    got, want = delivered.sum(0), exact.sum(0)
    error = _relative(got, want, scale, live)
    per_step = [_relative(delivered[t], exact[t], scale, live) for t in range(exact.shape[0])]
    zeroed = ((delivered == 0) & (exact != 0))[:, live]
    by_config = {}
    for label in sorted(set(labels)):
        mine = torch.tensor([lab == label for lab in labels], dtype=torch.bool) & live
        by_config[label] = _relative(got, want, scale, mine)
    return FidelityReading(
        first_step=first_step, steps=exact.shape[0], coordinates=int(live.sum()), error=error,
        step_error=sum(per_step) / len(per_step) if per_step else 0.0,
        zeroed=float(zeroed.float().mean()) if zeroed.numel() else 0.0, per_coordinate=per_coordinate,
        by_config=by_config)


def _relative(got: torch.Tensor, exact: torch.Tensor, scale: torch.Tensor, keep: torch.Tensor) -> float:
    """``||(got - exact) / scale|| / ||exact / scale||`` over the kept coordinates (0 where nothing is kept)."""
    if not bool(keep.any()):
        return 0.0
    s = scale[keep]
    norm = float((exact[keep] / s).norm())
    return float(((got[keep] - exact[keep]) / s).norm()) / norm if norm > 0 else 0.0
