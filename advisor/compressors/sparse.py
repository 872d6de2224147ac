"""Sparsifiers: top-k (all-gather) and random-k with shared indices (all-reduce)."""

from __future__ import annotations

import math

import torch

from advisor.compressors.base import Collective, Compressor, Exchange, Message, SegmentLayout, WireSpec, stable_hash

# Below this size, or when k is a large fraction, torch.topk alone is the fastest route.
_SAMPLED_SELECTION_MIN_NUMEL = 1 << 16
_SAMPLE_SIZE = 1 << 14


def kept_count(numel: int, ratio: float) -> int:
    return max(1, min(numel, int(round(numel * ratio))))


def topk_abs_indices(x: torch.Tensor, k: int, magnitudes: torch.Tensor | None = None,
                     mask: torch.Tensor | None = None) -> torch.Tensor:
    """Indices of the ``k`` largest ``|x|``, exactly, faster than ``torch.topk`` on big x.

    Estimates a threshold that keeps a little more than k values from a strided sample,
    keeps the candidates above it (one pass), and runs ``torch.topk`` on those alone.  If
    the estimate keeps fewer than k candidates it falls back to a full ``torch.topk``, so
    the result is always the exact top-k set (written here because torch has no
    approximate-then-exact selection).  ``magnitudes`` and ``mask`` are optional scratch
    buffers of x's size.
    """
    numel = x.numel()
    magnitudes = torch.abs(x, out=magnitudes) if magnitudes is not None else x.abs()
    if numel < _SAMPLED_SELECTION_MIN_NUMEL or k * 16 > numel:
        return torch.topk(magnitudes, k, sorted=False).indices
    stride = max(1, numel // _SAMPLE_SIZE)
    sample = magnitudes[::stride]
    # Keep ~1.3x the expected share (plus slack for small k) so the sample rarely undershoots.
    keep_fraction = min(1.0, (1.3 * k + 64 * math.sqrt(k)) / numel)
    rank_in_sample = max(1, int(sample.numel() * (1.0 - keep_fraction)))
    threshold = torch.kthvalue(sample, rank_in_sample).values
    above = torch.ge(magnitudes, threshold, out=mask) if mask is not None else magnitudes >= threshold
    candidates = torch.nonzero(above).squeeze(1)
    if candidates.numel() < k:
        return torch.topk(magnitudes, k, sorted=False).indices
    chosen = torch.topk(magnitudes[candidates], k, sorted=False).indices
    return candidates[chosen]


class _Sparsifier(Compressor):
    """Keeps ``k = ratio·n`` coordinates of a segment."""

    def __init__(self, ratio: float = 0.01, error_feedback: bool | None = None):
        super().__init__(error_feedback)
        self.ratio = float(ratio)

    @property
    def params(self):
        return {"ratio": self.ratio}


class TopK(_Sparsifier):
    """Keep the k = ratio·n largest magnitudes; send (value, index) pairs by all-gather.

    Index sets differ between ranks, so the payload cannot be summed in flight: its cost
    grows with the number of workers (the seed paper's main finding against top-k).
    """

    name = "topk"
    uses_all_gather = True

    def wire(self, layout: SegmentLayout, world_size: int) -> list[WireSpec]:
        k = kept_count(layout.numel, self.ratio)
        return [WireSpec(Collective.ALL_GATHER, (2 * k + 1) * 4)]

    def exchange(self, inp, out, layout, state, ctx) -> Exchange:
        k = kept_count(inp.numel(), self.ratio)
        idx = topk_abs_indices(
            inp,
            k,
            magnitudes=ctx.buffer("magnitudes", inp.numel(), torch.float32, inp.device),
            mask=ctx.buffer("mask", inp.numel(), torch.bool, inp.device),
        )
        payload = ctx.payload(2 * k, torch.int32, inp.device)
        torch.index_select(inp, 0, idx, out=payload[:k].view(torch.float32))
        payload[k:].copy_(idx)
        if ctx.keep_residual:
            inp.index_fill_(0, idx, 0.0)
        gathered = yield Message(payload, Collective.ALL_GATHER, last=True)
        values = gathered[:, :k].contiguous().view(torch.float32).reshape(-1)
        indices = gathered[:, k : 2 * k].reshape(-1).to(torch.int64)
        out.zero_()
        out.index_add_(0, indices, values)
        out.mul_(1.0 / ctx.world_size)


def stratified_indices(numel: int, k: int, generator: torch.Generator, device) -> torch.Tensor:
    """k distinct indices, one uniformly at random in each of k near-equal strata.

    Every element is chosen with probability ~k/n, and it costs O(k) random numbers
    rather than the O(n) of ``randperm``.
    """
    bounds = torch.div(torch.arange(k + 1, device=device, dtype=torch.int64) * numel, k, rounding_mode="floor")
    sizes = bounds[1:] - bounds[:-1]
    u = torch.rand(k, generator=generator, device=device)
    return bounds[:-1] + (u * sizes).to(torch.int64).clamp_max_(sizes - 1)


class RandomK(_Sparsifier):
    """Keep k = ratio·n coordinates chosen by a generator seeded identically on all ranks.

    Every rank picks the same indices, so only values go on the wire and they are summed
    by all-reduce.
    """

    name = "randomk"

    def wire(self, layout: SegmentLayout, world_size: int) -> list[WireSpec]:
        k = kept_count(layout.numel, self.ratio)
        return [WireSpec(Collective.ALL_REDUCE_SUM, (k + 1) * 4)]

    def exchange(self, inp, out, layout, state, ctx) -> Exchange:
        numel = inp.numel()
        k = kept_count(numel, self.ratio)
        salt = stable_hash(*layout.names)
        idx = stratified_indices(numel, k, ctx.generator(salt, inp.device), inp.device)
        payload = ctx.payload(k, torch.float32, inp.device)
        torch.index_select(inp, 0, idx, out=payload)
        if ctx.keep_residual:
            inp.index_fill_(0, idx, 0.0)
        summed = yield Message(payload, Collective.ALL_REDUCE_SUM, last=True)
        out.zero_()
        out.index_copy_(0, idx, summed.mul_(1.0 / ctx.world_size))
