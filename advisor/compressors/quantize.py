"""Uniform quantisation: QSGD-style (all-gather) and summable integers (all-reduce).

Both scale values chunk by chunk (1024 values a chunk, as CGX does) by the chunk's largest
magnitude onto ``2**(bits-1) - 1`` levels either side of zero.  Without error feedback they
round stochastically (unbiased, as QSGD); with it (the default) they round to nearest,
which error feedback needs (see :func:`quantize_rows`).

Performance on CPU: eager PyTorch makes one memory pass per operation, and quantisation
takes about eight.  Work therefore goes in blocks of rows small enough to stay in cache
(``BLOCK_ROWS`` x 1024 values, 4 MiB of fp32), so only the first read and the last write
of each value touch DRAM (benchmarks/compressors.py times the result).  Buffers
are reused from step to step (fresh pages cost more than the arithmetic).
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch

from advisor.compressors.base import (
    Collective,
    Compressor,
    Exchange,
    ExchangeContext,
    Message,
    SegmentLayout,
    WireSpec,
    chunk_count,
    dtype_name,
    stable_hash,
)
from advisor.compressors.packing import (
    lane_words,
    lanes_per_word,
    pack_bits,
    pack_lanes,
    packed_nbytes,
    unpack_bits,
    unpack_lanes,
)

CHUNK = 1024
BLOCK_ROWS = 1024


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


def blocks(n_rows: int, block_rows: int = BLOCK_ROWS) -> Iterator[tuple[int, int]]:
    """(first row, end row) of consecutive blocks."""
    for start in range(0, n_rows, block_rows):
        yield start, min(n_rows, start + block_rows)


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
    # a chunk whose scale is below levels / FLT_MAX (an error-feedback residual left alone
    # for a dozen steps: an embedding row no batch touches) would scale by inf, and 0·inf is
    # NaN; its codes are 0 instead, and its residual keeps the value
    inv = s / scale
    inv = torch.where(torch.isfinite(inv) & (scale > 0), inv, torch.zeros_like(inv)).unsqueeze(1)
    torch.mul(rows, inv, out=out)
    if generator is None:
        # |rows| <= scale, so rounding to nearest stays within [-s, s]: no clamp needed
        return out.round_()
    noise = torch.rand(out.shape, generator=generator, device=out.device)
    return out.add_(noise).floor_().clamp_(-s, s)


def quantize_block(
    rows: torch.Tensor, scale: torch.Tensor, bits: int, work: torch.Tensor, generator, keep_residual: bool
) -> torch.Tensor:
    """Codes of one block of rows (see :func:`quantize_rows`); under error feedback the
    rows are left holding their residual, ``rows - codes·scale/levels``."""
    codes = work[: rows.numel()].view(rows.shape)
    quantize_rows(rows, scale, bits, codes, generator)
    if keep_residual:
        rows.addcmul_(codes, (scale / levels(bits)).unsqueeze(1), value=-1.0)
    return codes


def rounding_generator(ctx: ExchangeContext, layout: SegmentLayout, device) -> torch.Generator | None:
    """Stochastic rounding only without error feedback (see :func:`quantize_rows`)."""
    if ctx.keep_residual:
        return None
    return ctx.local_generator(stable_hash(*layout.names), device)


def add_pending(rows: torch.Tensor, a: int, b: int, ctx: ExchangeContext) -> None:
    """Add this block's share of ``ctx.pending_add`` (error feedback: the new gradient)."""
    if ctx.pending_add is None:
        return
    first, end = a * CHUNK, min(ctx.pending_add.numel(), b * CHUNK)
    rows.view(-1)[first:end].add_(ctx.pending_add[first:end])


def write_back_padded(inp: torch.Tensor, rows: torch.Tensor) -> None:
    """Copy residuals computed in a padded copy back to the unpadded input."""
    if rows.data_ptr() != inp.data_ptr():
        inp.copy_(rows.view(-1)[: inp.numel()])


def accumulate_block(
    out_flat: torch.Tensor, codes: torch.Tensor, step: torch.Tensor, first: bool
) -> None:
    """``out (+)= codes·step`` for one block; ``codes`` are (rows, CHUNK) floats.

    ``out_flat`` is the block's slice of the output; it is shorter than ``codes`` only in
    the last block of an unaligned segment.
    """
    valid = out_flat.numel()
    if valid == codes.numel():
        target = out_flat.view_as(codes)
        if first:
            torch.mul(codes, step.unsqueeze(1), out=target)
        else:
            target.addcmul_(codes, step.unsqueeze(1))
        return
    codes.mul_(step.unsqueeze(1))
    if first:
        out_flat.copy_(codes.view(-1)[:valid])
    else:
        out_flat.add_(codes.view(-1)[:valid])


class QSGD(Compressor):
    """Uniform ``bits``-bit quantisation, codes bit-packed, sent by all-gather.

    Payload per rank: one fp32 scale per 1024 values, then the codes (signed bytes at
    8 bits; offset and packed below that).
    """

    name = "qsgd"
    uses_all_gather = True
    detects_nonfinite = True
    fuses_residual_add = True

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

    def _store_codes(self, codes: torch.Tensor, n: int, dest: torch.Tensor, ctx: ExchangeContext) -> None:
        """Write the first ``n`` signed float codes of a block into its payload slice."""
        valid = codes.view(-1)[:n]
        if self.bits == 8:
            dest.view(torch.int8).copy_(valid)
            return
        unsigned = ctx.buffer("unsigned", BLOCK_ROWS * CHUNK, torch.uint8, codes.device)[:n]
        unsigned.copy_(valid.add_(levels(self.bits)))
        pack_bits(unsigned, self.bits, out=dest)

    def _load_codes(self, src: torch.Tensor, dest: torch.Tensor, valid: int) -> None:
        """Signed float codes of one block (zero past ``valid``) from its payload slice."""
        if self.bits == 8:
            dest[:valid].copy_(src.view(torch.int8))
        else:
            dest[:valid].copy_(unpack_bits(src, self.bits, valid))
            dest[:valid].sub_(levels(self.bits))
        dest[valid:].zero_()

    def exchange(self, inp, out, layout, state, ctx) -> Exchange:
        numel = inp.numel()
        s = levels(self.bits)
        rows = as_rows(inp, ctx, "padded")
        code_bytes, scale_bytes = self._sizes(numel)
        payload = ctx.payload(scale_bytes + code_bytes, torch.uint8, inp.device)
        # scales first: a byte offset that is a multiple of 4 lets them be viewed as fp32
        scale = payload[:scale_bytes].view(torch.float32)
        codes_area = payload[scale_bytes:]
        work = ctx.buffer("block", BLOCK_ROWS * CHUNK, torch.float32, inp.device)
        generator = rounding_generator(ctx, layout, inp.device)
        for a, b in blocks(rows.shape[0]):
            add_pending(rows, a, b, ctx)
            r = rows[a:b]
            sc = chunk_absmax(r, out=scale[a:b])
            codes = quantize_block(r, sc, self.bits, work, generator, ctx.keep_residual)
            first, end = a * CHUNK, min(numel, b * CHUNK)
            dest = codes_area[packed_nbytes(first, self.bits) : packed_nbytes(end, self.bits)]
            self._store_codes(codes, end - first, dest, ctx)
        ctx.nonfinite = not bool(torch.isfinite(scale).all())
        if ctx.keep_residual:
            write_back_padded(inp, rows)

        gathered = yield Message(payload, Collective.ALL_GATHER, last=True)
        steps = [row[:scale_bytes].clone().view(torch.float32).div_(s * ctx.world_size) for row in gathered]
        for a, b in blocks(rows.shape[0]):
            first, end = a * CHUNK, min(numel, b * CHUNK)
            codes = work[: (b - a) * CHUNK].view(b - a, CHUNK)
            lo, hi = scale_bytes + packed_nbytes(first, self.bits), scale_bytes + packed_nbytes(end, self.bits)
            for r, row in enumerate(gathered):  # ranks inside the block: out stays in cache
                self._load_codes(row[lo:hi], codes.view(-1), end - first)
                accumulate_block(out[first:end], codes, steps[r][a:b], first=r == 0)


def headroom_bits(world_size: int) -> int:
    return max(0, math.ceil(math.log2(world_size))) if world_size > 1 else 0


#: fp16 represents every integer of magnitude <= 2048 exactly, so sums of codes needing
#: up to 12 bits (sign included) add exactly in it
_FP16_EXACT_BITS = 12


def summing_dtype(bits: int) -> torch.dtype:
    """The narrowest type in which sums needing ``bits`` bits (sign included) add exactly.

    Neither gloo nor NCCL can all-reduce int16 ("Invalid scalar type"), so between int8
    and int32 the carrier is float16, exact for integers up to 2048 in magnitude.
    """
    if bits <= 8:
        return torch.int8
    if bits <= _FP16_EXACT_BITS:
        return torch.float16
    if bits <= 32:
        return torch.int32
    return torch.int64


def _dtype_bits(dtype: torch.dtype) -> int:
    return torch.finfo(dtype).bits if dtype.is_floating_point else torch.iinfo(dtype).bits


class IntQuant(Compressor):
    """Quantisation that stays all-reduce compatible (CGX/THC style).

    Round one all-reduces (max) each chunk's largest magnitude, so every rank quantises
    with the same scale.  Round two sums the integer codes with enough headroom bits
    (``bits + ceil(log2 world_size)``, sign included) that the sum cannot overflow:

    * ``packed=1`` (default): unsigned codes in int64 lanes of that width, several lanes a
      word; the sum of words is the word of sums.  Most compression (9.1 bits a value at
      8 bits on 2 ranks), most encode work.
    * ``packed=0``: one signed code per element of the narrowest integer type that holds
      the sum exactly (int8; float16, exact for integers up to 2048; int32).  Less compression (16 bits a value at 8 bits on 2
      ranks, 8 bits at 4 bits on up to 16), about three times cheaper to encode.
    """

    name = "intquant"
    detects_nonfinite = True
    fuses_residual_add = True

    def __init__(self, bits: int = 8, packed: int = 1, error_feedback: bool | None = None):
        super().__init__(error_feedback)
        self.bits = int(bits)
        self.packed = int(packed)

    @property
    def params(self):
        return {"bits": self.bits, "packed": self.packed}

    def lane_bits(self, world_size: int) -> int:
        return self.bits + headroom_bits(world_size)

    def wire(self, layout: SegmentLayout, world_size: int) -> list[WireSpec]:
        chunks = chunk_count(layout.numel, CHUNK)
        if self.packed:
            dtype = torch.int64
            second = lane_words(layout.numel, self.lane_bits(world_size)) * 8
        else:
            dtype = summing_dtype(self.lane_bits(world_size))
            second = layout.numel * _dtype_bits(dtype) // 8
        return [
            WireSpec(Collective.ALL_REDUCE_MAX, (chunks + 1) * 4),
            WireSpec(Collective.ALL_REDUCE_SUM, second, dtype_name(dtype)),
        ]

    def _exchange_unpacked(self, inp, out, rows, shared, layout, ctx) -> Exchange:
        numel = inp.numel()
        s = levels(self.bits)
        dtype = summing_dtype(self.lane_bits(ctx.world_size))
        wire = ctx.buffer("wire", numel, dtype, inp.device)
        work = ctx.buffer("block", BLOCK_ROWS * CHUNK, torch.float32, inp.device)
        generator = rounding_generator(ctx, layout, inp.device)
        for a, b in blocks(rows.shape[0]):
            codes = quantize_block(rows[a:b], shared[a:b], self.bits, work, generator, ctx.keep_residual)
            first, end = a * CHUNK, min(numel, b * CHUNK)
            wire[first:end].copy_(codes.view(-1)[: end - first])
        if ctx.keep_residual:
            write_back_padded(inp, rows)
        summed = yield Message(wire, Collective.ALL_REDUCE_SUM, last=True)

        step = shared / (s * ctx.world_size)
        for a, b in blocks(rows.shape[0]):
            first, end = a * CHUNK, min(numel, b * CHUNK)
            codes = work[: (b - a) * CHUNK]
            codes[: end - first].copy_(summed[first:end])
            codes[end - first :].zero_()
            accumulate_block(out[first:end], codes.view(b - a, CHUNK), step[a:b], first=True)

    def exchange(self, inp, out, layout, state, ctx) -> Exchange:
        numel = inp.numel()
        s = levels(self.bits)
        rows = as_rows(inp, ctx, "padded")
        scale = ctx.payload(rows.shape[0], torch.float32, inp.device)
        for a, b in blocks(rows.shape[0]):
            add_pending(rows, a, b, ctx)
            chunk_absmax(rows[a:b], out=scale[a:b])
        ctx.nonfinite = not bool(torch.isfinite(scale).all())
        shared = yield Message(scale, Collective.ALL_REDUCE_MAX, last=False)
        shared = shared.clone()
        if not self.packed:
            yield from self._exchange_unpacked(inp, out, rows, shared, layout, ctx)
            return

        lane = self.lane_bits(ctx.world_size)
        lanes = lanes_per_word(lane)
        # blocks hold whole words of lanes, so each block packs into its own words
        block_rows = max(1, BLOCK_ROWS // lanes) * lanes
        words = ctx.buffer("words", lane_words(numel, lane), torch.int64, inp.device)
        work = ctx.buffer("block", block_rows * CHUNK, torch.float32, inp.device)
        unsigned = ctx.buffer("lanes", block_rows * CHUNK, torch.int64, inp.device)
        # float <-> int64 directly, or through int32 where the kernel profiler found that faster on
        # this device (advisor.compressors.forms); lanes of 32 bits and more (beyond 2**23 ranks
        # at 8 bits) always convert directly
        via_int32 = ctx.form("intquant-conversion") == "via-int32" and lane < 32
        narrow = ctx.buffer("lanes-narrow", block_rows * CHUNK, torch.int32, inp.device) if via_int32 else None
        generator = rounding_generator(ctx, layout, inp.device)
        for a, b in blocks(rows.shape[0], block_rows):
            codes = quantize_block(rows[a:b], shared[a:b], self.bits, work, generator, ctx.keep_residual)
            first, end = a * CHUNK, min(numel, b * CHUNK)
            n_words = lane_words(end - first, lane)
            block_lanes = unsigned[: n_words * lanes]
            shifted = codes.view(-1)[: end - first].add_(s)
            if via_int32:
                block_lanes[: end - first].copy_(narrow[: end - first].copy_(shifted))
            else:
                block_lanes[: end - first].copy_(shifted)
            block_lanes[end - first :].zero_()
            w0 = first // lanes
            pack_lanes(block_lanes, lane, out=words[w0 : w0 + n_words])
        if ctx.keep_residual:
            write_back_padded(inp, rows)
        summed = yield Message(words, Collective.ALL_REDUCE_SUM, last=True)

        step = shared / (s * ctx.world_size)
        offset = ctx.world_size * s  # sum of signed codes = sum of unsigned - world_size·levels
        for a, b in blocks(rows.shape[0], block_rows):
            first, end = a * CHUNK, min(numel, b * CHUNK)
            n_words = lane_words(end - first, lane)
            w0 = first // lanes
            codes = work[: (b - a) * CHUNK]
            lanes_out = unsigned[: n_words * lanes]
            unpacked = unpack_lanes(summed[w0 : w0 + n_words], lane, end - first, out=lanes_out)
            codes[: end - first].copy_(narrow[: end - first].copy_(unpacked) if via_int32 else unpacked)
            codes[: end - first].sub_(offset)
            codes[end - first :].zero_()
            accumulate_block(out[first:end], codes.view(b - a, CHUNK), step[a:b], first=True)
