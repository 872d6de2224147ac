"""The one interface every gradient compressor implements.

A compressor turns a flat fp32 *segment* of a DDP bucket (one or more parameters laid out
back to back) into one or more wire messages, each with the collective that combines it
across ranks, and turns the combined messages back into the averaged dense gradient.

The exchange is written as a generator (:meth:`Compressor.exchange`): it ``yield``s a
:class:`Message`, receives the combined result, and finally ``return``s nothing after it
wrote the averaged gradient into ``out``.  Multi-round protocols (PowerSGD sends P then Q,
``intquant`` first agrees on a scale) read naturally this way, and the runtime decides
*where* the collectives run, so every rank issues them in the same order.

Error feedback: when enabled, the runtime hands the compressor its input already
corrected by the residual (``inp = grad + residual``) and expects it to leave the new
residual ``inp - local_estimate`` in ``inp`` (where ``local_estimate`` is what this rank's
own contribution decodes to).  Summed over ranks, ``applied + residual`` then equals the
true gradient sum exactly, which is the invariant the tests check.
"""

from __future__ import annotations

import enum
import math
import zlib
from abc import ABC, abstractmethod
from collections.abc import Generator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from advisor.compressors.forms import form_of


class Collective(str, enum.Enum):
    """How a message is combined across ranks."""

    ALL_REDUCE_SUM = "all_reduce_sum"
    ALL_REDUCE_MAX = "all_reduce_max"
    ALL_GATHER = "all_gather"

    @property
    def is_all_reduce(self) -> bool:
        return self is not Collective.ALL_GATHER


@dataclass
class Message:
    """One payload on the wire.

    ``tensor`` is flat and contiguous.  For all-reduce the combined result is a tensor of
    the same shape; for all-gather it is a ``(world_size, numel)`` tensor, one row a rank.
    ``last`` marks the final message of an exchange: nothing after it issues collectives,
    so the runtime may start the next bucket before this one's result arrives.
    """

    tensor: torch.Tensor
    collective: Collective
    last: bool = True
    #: where the runtime may keep the all-gather output between steps (fresh pages cost
    #: more than the copy itself on CPU)
    workspace: dict | None = field(default=None, repr=False)

    @property
    def nbytes(self) -> int:
        t = self.tensor
        if t.is_sparse:  # what gloo sends: the indices and the values
            return t._indices().numel() * t._indices().element_size() + t._values().numel() * t.element_size()
        return t.numel() * t.element_size()


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float16`` -> ``"float16"``."""
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class WireSpec:
    """Static description of one message, for byte accounting and the performance model.

    ``dtype`` is the element type a reduction adds up (a torch dtype's name): summing
    float16 costs gloo several times what float32 does per byte, which the model needs.
    """

    collective: Collective
    nbytes: int
    dtype: str = "float32"


@dataclass(frozen=True)
class SegmentLayout:
    """Parameters laid back to back in a flat fp32 segment of a bucket."""

    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]

    @property
    def numels(self) -> tuple[int, ...]:
        return tuple(math.prod(s) for s in self.shapes)

    @property
    def offsets(self) -> tuple[int, ...]:
        offsets, total = [], 0
        for n in self.numels:
            offsets.append(total)
            total += n
        return tuple(offsets)

    @property
    def numel(self) -> int:
        return sum(self.numels)

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Per-parameter views of ``flat`` with their original shapes."""
        return [
            flat[o : o + n].view(s)
            for o, n, s in zip(self.offsets, self.numels, self.shapes)
        ]

    @classmethod
    def single(cls, shape: Sequence[int], name: str = "tensor") -> SegmentLayout:
        return cls(names=(name,), shapes=(tuple(int(d) for d in shape),))


@dataclass
class ExchangeContext:
    """What a compressor may know about the exchange it is part of.

    ``step`` and ``seed`` are identical on every rank, so compressors that need shared
    randomness (random-k indices, PowerSGD's initial Q) derive it from them.
    ``keep_residual`` is True when error feedback is on: the compressor must then leave
    ``inp - local_estimate`` in ``inp``.
    """

    world_size: int
    step: int = 0
    seed: int = 0
    rank: int = 0
    keep_residual: bool = False
    #: set by compressors with ``detects_nonfinite`` before their first message
    nonfinite: bool | None = None
    #: for compressors with ``fuses_residual_add``: a tensor to add to ``inp`` first
    pending_add: torch.Tensor | None = field(default=None, repr=False)
    #: buffers kept for this segment from step to step (see :meth:`buffer`)
    workspace: dict = field(default_factory=dict, repr=False)
    #: the kernel form of each choice (:mod:`advisor.compressors.forms`); absent: the default
    forms: Mapping[str, str] = field(default_factory=dict)
    first_payload: torch.Tensor | None = field(default=None, repr=False)
    #: set by the runtime for compressors with ``checks_combined``: judge the combined result
    #: instead of the input (see :attr:`Compressor.checks_combined`)
    check_combined: bool = False

    def form(self, choice: str) -> str:
        """The kernel form to run for ``choice`` (the plan's, else the choice's default)."""
        return form_of(self.forms, choice)

    def buffer(self, name: str, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A flat scratch tensor that is reused at the next step of the same segment.

        Big temporaries are worth keeping: on CPU a fresh allocation of that size is
        served by new pages from the OS, and faulting them in costs more than the
        arithmetic.  Contents are undefined on return.
        """
        return cached_buffer(self.workspace, name, numel, dtype, device)

    def payload(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A buffer for the first message of an exchange.

        It reserves one trailing element the runtime uses to tell every rank whether any
        rank saw a non-finite gradient, without an extra collective.  Compressors that
        build their first message here avoid a copy; others are appended to.
        """
        full = self.buffer("payload", numel + 1, dtype, device)
        self.first_payload = full
        return full[:numel]

    def generator(self, salt: int, device: torch.device) -> torch.Generator:
        """A random generator seeded identically on every rank for this step."""
        gen = torch.Generator(device=device)
        gen.manual_seed((self.seed * 1_000_003 + self.step * 7_919 + salt) % (2**63 - 1))
        return gen

    def local_generator(self, salt: int, device: torch.device) -> torch.Generator:
        """A generator of this rank's own for this step (stochastic rounding noise).

        Independent across ranks, reproducible across runs and checkpoints, and separate
        from torch's global generator so compression never shifts the user's random stream.
        """
        return self.generator(salt * 65_537 + 104_729 * (self.rank + 1), device)


def cached_buffer(workspace: dict, name: str, numel: int, dtype: torch.dtype, device) -> torch.Tensor:
    """``workspace[name]`` as a flat tensor of ``numel`` values, made anew only on a change."""
    key = (name, dtype, torch.device(device))
    buf = workspace.get(key)
    if buf is None or buf.numel() != numel:
        buf = workspace[key] = torch.empty(numel, dtype=dtype, device=device)
    return buf


Exchange = Generator[Message, torch.Tensor, None]


class Compressor(ABC):
    """Base class of all compressors; subclasses set ``name`` and implement ``exchange``.

    Instances hold only configuration; per-segment memory (residuals, PowerSGD's Q) lives
    in a state dict the runtime owns and passes in, keyed by parameter name, so it can be
    checkpointed and survives DDP's bucket rebuild.
    """

    name: str = ""
    #: Whether decoding loses information (error feedback then defaults to on).
    lossy: bool = True
    #: Whether any message goes through all-gather (cost grows with world size).
    uses_all_gather: bool = False
    #: Whether :meth:`exchange` sets ``ctx.nonfinite`` itself (from a reduction it needs
    #: anyway, e.g. its scales) before its first message; otherwise the runtime scans
    #: the input first.
    detects_nonfinite: bool = False
    #: Whether :meth:`exchange` adds ``ctx.pending_add`` (the gradient, under error
    #: feedback) to ``inp`` itself, block by block while the data is in cache, instead of
    #: the runtime doing it in one extra pass beforehand.  Only with ``detects_nonfinite``.
    fuses_residual_add: bool = False
    #: Whether :meth:`exchange`, given ``ctx.check_combined`` (no error feedback), judges its one
    #: message's combined result instead of the input: that sum is non-finite exactly when some
    #: rank's input was (or the sum left the wire type's range), every rank sees the same, and the
    #: compressor then sets ``ctx.nonfinite`` and leaves ``out`` as it was.  The runtime then
    #: needs neither a scan of the input nor the flag element.
    checks_combined: bool = False
    #: Whether each element of the mean depends only on the same element of every rank's input
    #: (fp32, 16-bit casts): such an exchange can be replayed one parameter at a time, whatever
    #: the bucket layout (the accuracy trial's exchange-free arms do).
    elementwise: bool = False

    def __init__(self, error_feedback: bool | None = None) -> None:
        self.error_feedback = self.lossy if error_feedback is None else bool(error_feedback)

    # --- the protocol -------------------------------------------------------------
    @abstractmethod
    def exchange(
        self,
        inp: torch.Tensor,
        out: torch.Tensor,
        layout: SegmentLayout,
        state: dict[str, Any],
        ctx: ExchangeContext,
    ) -> Exchange:
        """Yield messages, receive their combined results, write the mean into ``out``."""

    @abstractmethod
    def wire(self, layout: SegmentLayout, world_size: int) -> list[WireSpec]:
        """The messages :meth:`exchange` sends for ``layout``, without running it."""

    # --- derived helpers ----------------------------------------------------------
    @property
    def params(self) -> dict[str, Any]:
        return {}

    def wire_bytes(self, layout: SegmentLayout, world_size: int) -> int:
        return sum(w.nbytes for w in self.wire(layout, world_size))

    def compression_ratio(self, layout: SegmentLayout, world_size: int) -> float:
        """Dense fp32 bytes over bytes this rank puts on the wire."""
        return layout.numel * 4 / max(1, self.wire_bytes(layout, world_size))

    def state_keys(self) -> tuple[str, ...]:
        """Per-parameter state this compressor keeps besides the residual."""
        return ()

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v}" for k, v in self.params.items())
        return f"{self.name}({args})"


def chunk_count(numel: int, chunk: int) -> int:
    return (numel + chunk - 1) // chunk


def stable_hash(*names: str) -> int:
    """A hash equal in every process (Python's ``hash`` of a str is salted per process)."""
    return zlib.crc32("\0".join(names).encode())


def is_finite(x: torch.Tensor) -> bool:
    """True if every value is finite.  A sum is one fast pass with no allocation; only if
    it is not finite (NaN/Inf present, or a rare overflow of huge values) is the exact,
    slower check run."""
    return bool(torch.isfinite(x.sum())) or bool(torch.isfinite(x).all())
