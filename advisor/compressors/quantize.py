"""Uniform stochastic quantisation: QSGD-style (all-gather) and summable integers (all-reduce).

Both scale values chunk by chunk (1024 values a chunk, as CGX does) by the chunk's largest
magnitude onto ``2**(bits-1) - 1`` levels either side of zero.  Without error feedback they
round stochastically (unbiased, as QSGD); with it (the default) they round to nearest,
which error feedback needs (see :func:`quantize_codes`).
"""

from __future__ import annotations

import math

import torch

from .base import Collective, Compressor, Exchange, Message, SegmentLayout, WireSpec, chunk_count, stable_hash
from .packing import lane_words, pack_bits, pack_lanes, packed_nbytes, unpack_bits, unpack_lanes

CHUNK = 1024


def levels(bits: int) -> int:
    return (1 << (bits - 1)) - 1


def chunked(x: torch.Tensor, chunk: int = CHUNK) -> tuple[torch.Tensor, int]:
    """``x`` as (chunks, chunk) rows, zero-padded at the end if needed (a copy only then)."""
    numel = x.numel()
    rows = chunk_count(numel, chunk)
    if rows * chunk == numel:
        return x.view(rows, chunk), numel
    return torch.nn.functional.pad(x, (0, rows * chunk - numel)).view(rows, chunk), numel


def chunk_absmax(rows: torch.Tensor) -> torch.Tensor:
    return rows.abs().amax(dim=1)


def quantize_codes(rows: torch.Tensor, scale: torch.Tensor, bits: int, generator=None) -> torch.Tensor:
    """Unsigned codes in [0, 2·levels] of ``x/scale·levels``, as float.

    With a ``generator``: stochastic rounding, ``floor(v + u)`` with u ~ U[0,1), which is
    unbiased (QSGD).  Without: round to nearest.  The runtime rounds to nearest when error
    feedback is on, because error feedback needs a *contractive* compressor
    (||x - C(x)|| < ||x||) and stochastic rounding at few bits is not one: its variance
    can exceed ||x||², and the residual then grows without bound.  Error feedback removes
    the bias of nearest rounding instead.
    """
    s = levels(bits)
    inv = torch.where(scale > 0, s / scale, torch.zeros_like(scale)).unsqueeze(1)
    scaled = rows * inv
    if generator is None:
        scaled.round_()
    else:
        noise = torch.rand(rows.shape, generator=generator, device=rows.device)
        scaled.add_(noise).floor_()
    return scaled.clamp_(-s, s).add_(s)


def rounding_generator(ctx, layout, device):
    """Stochastic rounding only without error feedback (see :func:`quantize_codes`)."""
    if ctx.keep_residual:
        return None
    return ctx.local_generator(stable_hash(*layout.names), device)


def dequantize(codes: torch.Tensor, scale: torch.Tensor, bits: int) -> torch.Tensor:
    """Values of unsigned codes (rows x chunk, float) for per-row ``scale``."""
    s = levels(bits)
    return (codes - s).mul_((scale / s).unsqueeze(1))


class QSGD(Compressor):
    """Uniform ``bits``-bit quantisation, codes bit-packed, sent by all-gather.

    Payload per rank: packed codes then one fp32 scale per 1024 values.
    """

    name = "qsgd"
    uses_all_gather = True

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
        rows, numel = chunked(inp)
        scale = chunk_absmax(rows)
        codes = quantize_codes(rows, scale, self.bits, rounding_generator(ctx, layout, inp.device))
        code_bytes, scale_bytes = self._sizes(numel)
        payload = ctx.payload(code_bytes + scale_bytes, torch.uint8, inp.device)
        flat_codes = codes.view(-1)[:numel]
        # scales first: a byte offset that is a multiple of 4 lets them be viewed as fp32
        payload[:scale_bytes].view(torch.float32).copy_(scale)
        pack_bits(flat_codes.to(torch.uint8), self.bits, out=payload[scale_bytes:])
        if ctx.keep_residual:
            inp.sub_(dequantize(codes, scale, self.bits).view(-1)[:numel])
        del codes
        gathered = yield Message(payload, Collective.ALL_GATHER, last=True)
        out.zero_()
        for row in gathered:
            rank_scale = row[:scale_bytes].clone().view(torch.float32)
            rank_codes = unpack_bits(row[scale_bytes:], self.bits, numel).to(torch.float32)
            rank_rows, _ = chunked(rank_codes)
            out.add_(dequantize(rank_rows, rank_scale, self.bits).view(-1)[:numel])
        out.mul_(1.0 / ctx.world_size)


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
        rows, numel = chunked(inp)
        scale = ctx.payload(rows.shape[0], torch.float32, inp.device)
        torch.amax(rows.abs(), dim=1, out=scale)
        shared = yield Message(scale, Collective.ALL_REDUCE_MAX, last=False)
        shared = shared.clone()
        codes = quantize_codes(rows, shared, self.bits, rounding_generator(ctx, layout, inp.device))
        lane = self.lane_bits(ctx.world_size)
        words = torch.empty(lane_words(numel, lane), dtype=torch.int64, device=inp.device)
        pack_lanes(codes.view(-1)[:numel].to(torch.int64), lane, out=words)
        if ctx.keep_residual:
            inp.sub_(dequantize(codes, shared, self.bits).view(-1)[:numel])
        del codes
        summed = yield Message(words, Collective.ALL_REDUCE_SUM, last=True)
        total = unpack_lanes(summed, lane, numel).to(torch.float32)
        # sum of signed codes = sum of unsigned codes - world_size * levels
        s = levels(self.bits)
        total_rows, _ = chunked(total.sub_(ctx.world_size * s))
        total_rows.mul_((shared / (s * ctx.world_size)).unsqueeze(1))
        out.copy_(total_rows.view(-1)[:numel])
