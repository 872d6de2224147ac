"""Uniform quantisation: QSGD-style (all-gather) and summable integers (all-reduce).

Both scale values chunk by chunk (1024 values a chunk, as CGX does) by the chunk's largest
magnitude onto ``2**(bits-1) - 1`` levels either side of zero.  Without error feedback they
round stochastically (unbiased, as QSGD); with it (the default) they round to nearest,
which error feedback needs (see :func:`quantize_rows`).

The code keeps to a few in-place passes over reused buffers: on CPU, fresh allocations
and int64 detours cost more than the arithmetic.
"""

from __future__ import annotations

import math

import torch

from .base import Collective, Compressor, Exchange, ExchangeContext, Message, SegmentLayout, WireSpec, chunk_count, stable_hash
from .packing import lane_words, lanes_per_word, pack_bits, pack_lanes, packed_nbytes, unpack_bits, unpack_lanes

CHUNK = 1024


def levels(bits: int) -> int:
    return (1 << (bits - 1)) - 1


def as_rows(x: torch.Tensor, ctx: ExchangeContext, name: str) -> torch.Tensor:
    """``x`` as (chunks, CHUNK) rows: a view when aligned, else a zero-padded copy."""
    numel = x.numel()
    rows = chunk_count(numel, CHUNK)
    if rows * CHUNK == numel:
        return x.view(rows, CHUNK)
    buf = ctx.buffer(name, rows * CHUNK, torch.float32, x.device)
    buf[:numel].copy_(x)
    buf[numel:].zero_()
    return buf.view(rows, CHUNK)


def chunk_absmax(rows: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Largest magnitude of each row (NaN propagates).

    ``max(amax, -amin)``: two vectorised reductions and no temporary, about ten times
    faster on CPU than ``abs().amax()`` or ``vector_norm(ord=inf)`` on a 16M bucket.
    """
    high = torch.amax(rows, dim=1)
    low = torch.amin(rows, dim=1).neg_()
    return torch.maximum(high, low, out=out) if out is not None else torch.maximum(high, low)


def quantize_rows(rows: torch.Tensor, scale: torch.Tensor, bits: int, out: torch.Tensor, generator=None) -> torch.Tensor:
    """Signed codes in [-levels, levels] of ``rows/scale·levels``, as float, into ``out``.

    With a ``generator``: stochastic rounding, ``floor(v + u)`` with u ~ U[0,1), which is
    unbiased (QSGD).  Without: round to nearest.  The runtime rounds to nearest when error
    feedback is on, because error feedback needs a *contractive* compressor
    (||x - C(x)|| < ||x||) and stochastic rounding at few bits is not one: its variance
    can exceed ||x||², and the residual then grows without bound.  Error feedback removes
    the bias of nearest rounding instead.
    """
    s = levels(bits)
    inv = torch.where(scale > 0, s / scale, torch.zeros_like(scale)).unsqueeze(1)
    torch.mul(rows, inv, out=out)
    if generator is None:
        # |rows| <= scale, so rounding to nearest stays within [-s, s]: no clamp needed
        return out.round_()
    noise = torch.rand(out.shape, generator=generator, device=out.device)
    return out.add_(noise).floor_().clamp_(-s, s)


def rounding_generator(ctx: ExchangeContext, layout: SegmentLayout, device) -> torch.Generator | None:
    """Stochastic rounding only without error feedback (see :func:`quantize_rows`)."""
    if ctx.keep_residual:
        return None
    return ctx.local_generator(stable_hash(*layout.names), device)


def subtract_decoded(inp: torch.Tensor, rows: torch.Tensor, codes: torch.Tensor, step: torch.Tensor) -> None:
    """Error feedback: ``inp -= codes·step`` (chunk by chunk), in one pass when aligned."""
    if rows.data_ptr() == inp.data_ptr():
        rows.addcmul_(codes, step.unsqueeze(1), value=-1.0)
    else:
        inp.sub_(codes.mul(step.unsqueeze(1)).view(-1)[: inp.numel()])


def accumulate(out: torch.Tensor, codes: torch.Tensor, step: torch.Tensor, first: bool, ctx: ExchangeContext) -> None:
    """``out (+)= codes·step`` chunk by chunk; codes are (chunks, CHUNK) floats."""
    numel = out.numel()
    if codes.numel() == numel:
        target = out.view_as(codes)
        if first:
            torch.mul(codes, step.unsqueeze(1), out=target)
        else:
            target.addcmul_(codes, step.unsqueeze(1))
        return
    codes.mul_(step.unsqueeze(1))
    flat = codes.view(-1)[:numel]
    if first:
        out.copy_(flat)
    else:
        out.add_(flat)


class QSGD(Compressor):
    """Uniform ``bits``-bit quantisation, codes bit-packed, sent by all-gather.

    Payload per rank: one fp32 scale per 1024 values, then the codes (signed bytes at
    8 bits; offset and packed below that).
    """

    name = "qsgd"
    uses_all_gather = True
    detects_nonfinite = True

    def __init__(self, bits: int = 8, error_feedback: bool | None = None):
        super().__init__(error_feedback)
        self.bits = int(bits)

    @property
    def params(self):
        return {"bits": self.bits}

    def _sizes(self, numel: int) -> tuple[int, int]:
        return packed_nbytes(numel, self.bits), chunk_count(numel, CHUNK) * 4

    def wire(self, layout: SegmentLayout, world_size: int) -> list[WireSpec]:
        codes, scales = self._sizes(layout.numel)
        return [WireSpec(Collective.ALL_GATHER, codes + scales + 1)]

    def exchange(self, inp, out, layout, state, ctx) -> Exchange:
        numel = inp.numel()
        s = levels(self.bits)
        rows = as_rows(inp, ctx, "padded")
        code_bytes, scale_bytes = self._sizes(numel)
        payload = ctx.payload(scale_bytes + code_bytes, torch.uint8, inp.device)
        # scales first: a byte offset that is a multiple of 4 lets them be viewed as fp32
        scale = chunk_absmax(rows, out=payload[:scale_bytes].view(torch.float32))
        ctx.nonfinite = not bool(torch.isfinite(scale).all())
        codes = ctx.buffer("codes", rows.numel(), torch.float32, inp.device).view(rows.shape)
        quantize_rows(rows, scale, self.bits, codes, rounding_generator(ctx, layout, inp.device))
        if ctx.keep_residual:
            subtract_decoded(inp, rows, codes, scale / s)
        flat_codes = codes.view(-1)[:numel]
        if self.bits == 8:
            payload[scale_bytes:].view(torch.int8).copy_(flat_codes)
        else:
            unsigned = ctx.buffer("unsigned", numel, torch.uint8, inp.device)
            unsigned.copy_(flat_codes.add_(s))
            pack_bits(unsigned, self.bits, out=payload[scale_bytes:])

        gathered = yield Message(payload, Collective.ALL_GATHER, last=True)
        decoded = ctx.buffer("decoded", rows.numel(), torch.float32, inp.device)
        for r, row in enumerate(gathered):
            step = row[:scale_bytes].clone().view(torch.float32).div_(s * ctx.world_size)
            if self.bits == 8:
                decoded[:numel].copy_(row[scale_bytes : scale_bytes + numel].view(torch.int8))
            else:
                decoded[:numel].copy_(unpack_bits(row[scale_bytes:], self.bits, numel))
                decoded[:numel].sub_(s)
            decoded[numel:].zero_()
            accumulate(out, decoded.view(-1, CHUNK), step, r == 0, ctx)


def headroom_bits(world_size: int) -> int:
    return max(0, math.ceil(math.log2(world_size))) if world_size > 1 else 0


class IntQuant(Compressor):
    """Quantisation that stays all-reduce compatible (CGX/THC style).

    Round one all-reduces (max) each chunk's largest magnitude, so every rank quantises
    with the same scale.  Round two sums unsigned codes packed into int64 lanes of
    ``bits + ceil(log2 world_size)`` bits: the headroom keeps lanes from overflowing into
    each other, so the sum of words is the word of sums.
    """

    name = "intquant"
    detects_nonfinite = True

    def __init__(self, bits: int = 8, error_feedback: bool | None = None):
        super().__init__(error_feedback)
        self.bits = int(bits)

    @property
    def params(self):
        return {"bits": self.bits}

    def lane_bits(self, world_size: int) -> int:
        return self.bits + headroom_bits(world_size)

    def wire(self, layout: SegmentLayout, world_size: int) -> list[WireSpec]:
        chunks = chunk_count(layout.numel, CHUNK)
        words = lane_words(layout.numel, self.lane_bits(world_size))
        return [
            WireSpec(Collective.ALL_REDUCE_MAX, (chunks + 1) * 4),
            WireSpec(Collective.ALL_REDUCE_SUM, words * 8),
        ]

    def exchange(self, inp, out, layout, state, ctx) -> Exchange:
        numel = inp.numel()
        s = levels(self.bits)
        rows = as_rows(inp, ctx, "padded")
        scale = ctx.payload(rows.shape[0], torch.float32, inp.device)
        chunk_absmax(rows, out=scale)
        ctx.nonfinite = not bool(torch.isfinite(scale).all())
        shared = yield Message(scale, Collective.ALL_REDUCE_MAX, last=False)
        shared = shared.clone()

        codes = ctx.buffer("codes", rows.numel(), torch.float32, inp.device).view(rows.shape)
        quantize_rows(rows, shared, self.bits, codes, rounding_generator(ctx, layout, inp.device))
        if ctx.keep_residual:
            subtract_decoded(inp, rows, codes, shared / s)
        lane = self.lane_bits(ctx.world_size)
        n_words = lane_words(numel, lane)
        unsigned = ctx.buffer("lanes", n_words * lanes_per_word(lane), torch.int64, inp.device)
        unsigned[:numel].copy_(codes.view(-1)[:numel].add_(s))
        unsigned[numel:].zero_()
        words = ctx.buffer("words", n_words, torch.int64, inp.device)
        pack_lanes(unsigned, lane, out=words)
        summed = yield Message(words, Collective.ALL_REDUCE_SUM, last=True)

        decoded = ctx.buffer("decoded", rows.numel(), torch.float32, inp.device)
        decoded[:numel].copy_(unpack_lanes(summed, lane, numel, out=unsigned))
        # sum of signed codes = sum of unsigned codes - world_size * levels
        decoded[:numel].sub_(ctx.world_size * s)
        decoded[numel:].zero_()
        accumulate(out, decoded.view(-1, CHUNK), shared / (s * ctx.world_size), True, ctx)
