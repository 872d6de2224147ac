"""One segment's exchange as the runtime runs it: error feedback and the non-finite guard.

:func:`guarded_exchange` wraps a compressor's own exchange.  It adds the residual before
encoding, and it carries one extra element in the first message that tells every rank
whether *any* rank saw NaN/Inf in this segment.  If one did, all ranks drop the compressed
result, reset the segment's residual, and send the raw gradient with a plain fp32
all-reduce instead, so the outcome is what DDP without compression would give and no
residual or warm-start memory is poisoned.  The flag costs no extra collective.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from advisor.compressors.base import Collective, Compressor, Exchange, ExchangeContext, Message, SegmentLayout, is_finite
from advisor.compressors.casts import NoCompression

log = logging.getLogger("advisor.runtime")


class ResidualStore:
    """Error-feedback residuals, one flat buffer a segment, addressable by parameter name.

    Segments change when DDP rebuilds its buckets after iteration 0 (and may differ from a
    checkpoint's), so each parameter's residual is a view that moves into the new
    segment's buffer the first time that segment is seen.
    """

    def __init__(self) -> None:
        self._flats: dict[tuple[str, ...], torch.Tensor] = {}
        self._by_name: dict[str, torch.Tensor] = {}

    def flat(self, layout: SegmentLayout, device: torch.device) -> torch.Tensor:
        buf = self._flats.get(layout.names)
        if buf is not None:
            return buf
        buf = torch.zeros(layout.numel, dtype=torch.float32, device=device)
        for name, view in zip(layout.names, layout.views(buf)):
            old = self._by_name.get(name)
            if old is not None:
                view.copy_(old.view_as(view))
            self._by_name[name] = view
        stale = [k for k in self._flats if set(k) & set(layout.names)]
        for key in stale:
            del self._flats[key]
        self._flats[layout.names] = buf
        return buf

    def reset(self, layout: SegmentLayout) -> None:
        buf = self._flats.get(layout.names)
        if buf is not None:
            buf.zero_()

    def drop(self, names) -> None:
        """Forget these parameters' residuals (and every flat buffer holding one)."""
        names = set(names)
        for key in [k for k in self._flats if set(k) & names]:
            kept = [n for n in key if n not in names]
            for n in kept:  # the other parameters of that buffer keep their values
                self._by_name[n] = self._by_name[n].clone()
            del self._flats[key]
        for n in names:
            self._by_name.pop(n, None)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {name: t.detach().clone() for name, t in self._by_name.items()}

    def load_state_dict(self, tensors: dict[str, torch.Tensor]) -> None:
        self._flats.clear()
        self._by_name = {name: t.detach().clone().to(torch.float32) for name, t in tensors.items()}

    def norm(self) -> float:
        if not self._by_name:
            return 0.0
        return float(torch.sqrt(sum((t.double() ** 2).sum() for t in self._by_name.values())))


def _with_flag(message: Message, ctx: ExchangeContext, flag: bool) -> torch.Tensor:
    body = message.tensor
    full = ctx.first_payload
    if full is None or full.numel() != body.numel() + 1 or full.data_ptr() != body.data_ptr():
        full = torch.cat([body.reshape(-1), body.new_zeros(1)])
    full[-1] = 1 if flag else 0
    return full


def guarded_exchange(
    compressor: Compressor,
    grad: torch.Tensor,
    layout: SegmentLayout,
    compressor_state: dict[str, Any],
    residuals: ResidualStore | None,
    ctx: ExchangeContext,
    on_nonfinite=None,
) -> Exchange:
    """Run ``compressor`` on ``grad`` (a bucket slice) and leave the mean in ``grad``."""
    if isinstance(compressor, NoCompression) and residuals is None:
        # fp32 all-reduce: NaN/Inf propagate exactly as in DDP, nothing to protect.
        yield from compressor.exchange(grad, grad, layout, compressor_state, ctx)
        return
    if grad.dtype != torch.float32:
        # bf16/fp16 weights: compressors, residuals and the guard work in fp32 (a residual in
        # 16 bits would lose the small errors it exists to keep); the mean goes back in the
        # model's dtype
        work = ctx.buffer("float32-gradient", grad.numel(), torch.float32, grad.device)
        work.copy_(grad)
        yield from guarded_exchange(compressor, work, layout, compressor_state, residuals, ctx, on_nonfinite)
        grad.copy_(work)
        return

    if compressor.checks_combined and residuals is None:
        # the compressor judges the combined sum, which every rank sees alike: no flag, no scan first
        ctx.check_combined, ctx.nonfinite, ctx.keep_residual, ctx.first_payload = True, None, False, None
        yield from compressor.exchange(grad, grad, layout, compressor_state, ctx)
        if ctx.nonfinite:
            yield from _uncompressed_instead(compressor, grad, layout, None, ctx, None, on_nonfinite)
        return

    scanned_finite, inp = _compressor_input(compressor, grad, layout, residuals, ctx)
    inner = compressor.exchange(inp, grad, layout, compressor_state, ctx)
    message = next(inner)
    if compressor.detects_nonfinite and ctx.nonfinite is None:
        raise RuntimeError(f"compressor {compressor.name} declares detects_nonfinite but did not set ctx.nonfinite")
    ctx.pending_add = None
    # the first message carries one more value: this rank's flag for a non-finite input
    locally_bad = scanned_finite is False or bool(ctx.nonfinite)
    flagged = Message(_with_flag(message, ctx, locally_bad), message.collective, message.last, ctx.workspace)
    combined = yield flagged
    if message.collective is Collective.ALL_GATHER:
        any_nonfinite = bool((combined[:, -1] != 0).any())
        combined = combined[:, :-1]
    else:
        any_nonfinite = bool(combined[-1] != 0)
        combined = combined[:-1]

    if any_nonfinite:
        inner.close()
        yield from _uncompressed_instead(compressor, grad, layout, residuals, ctx, locally_bad, on_nonfinite)
        return
    try:
        while True:
            message = inner.send(combined)
            if message.workspace is None:
                message.workspace = ctx.workspace
            combined = yield message
    except StopIteration:
        pass
    if not is_finite(grad):
        _skip_nonfinite_mean(compressor, grad, layout, residuals, ctx, on_nonfinite)


def _compressor_input(compressor: Compressor, grad: torch.Tensor, layout: SegmentLayout,
                      residuals: ResidualStore | None, ctx: ExchangeContext) -> tuple[bool | None, torch.Tensor]:
    """(whether the scan found ``grad`` finite, or None where the compressor detects it; its input).

    The input is the gradient plus the residual (error feedback), or zeros where the gradient
    is not finite: nothing non-finite may reach a compressor or a residual.
    """
    # Compressors that reduce the input anyway (scales, P = MQ) report non-finite values
    # themselves; for the others one fast scan decides before anything is touched.
    scanned_finite = None if compressor.detects_nonfinite else is_finite(grad)
    if scanned_finite is False:
        inp = ctx.buffer("harmless-input", grad.numel(), torch.float32, grad.device).zero_()
    elif residuals is not None:
        inp = residuals.flat(layout, grad.device)
        if compressor.fuses_residual_add:
            ctx.pending_add = grad
        else:
            inp.add_(grad)  # a NaN here is harmless: the residual is reset below
    else:
        inp = grad
    ctx.keep_residual = residuals is not None and scanned_finite is not False
    ctx.nonfinite = None
    ctx.first_payload = None
    return scanned_finite, inp


def _uncompressed_instead(compressor: Compressor, grad: torch.Tensor, layout: SegmentLayout,
                          residuals: ResidualStore | None, ctx: ExchangeContext, locally_bad: bool | None,
                          on_nonfinite):
    """Some rank's input was not finite: every rank sends its gradient uncompressed this step.

    The mean then carries the NaN/Inf as DDP's own all-reduce would (a loss scaler sees it and
    skips the step); the residual starts over.
    """
    if residuals is not None:
        residuals.reset(layout)
    log.warning(
        "non-finite gradient (or beyond the range of %s) in %s at step %d, on %s: "
        "sent uncompressed this step, residual reset",
        compressor.name,
        _describe(layout),
        ctx.step,
        {True: "this rank", False: "another rank", None: "some rank (their sum was not finite)"}[locally_bad],
    )
    if on_nonfinite is not None:
        on_nonfinite(layout, ctx.step)
    if ctx.world_size > 1:
        grad.mul_(1.0 / ctx.world_size)
    summed = yield Message(grad, Collective.ALL_REDUCE_SUM, last=True)
    if summed.data_ptr() != grad.data_ptr():
        grad.copy_(summed)


def _skip_nonfinite_mean(compressor: Compressor, grad: torch.Tensor, layout: SegmentLayout,
                         residuals: ResidualStore | None, ctx: ExchangeContext, on_nonfinite) -> None:
    """Finite inputs decoded to Inf/NaN (a scale that underflowed, a sum beyond the wire dtype's range).

    Every rank decodes the same combined data, so every rank reaches this verdict without a
    message: the segment skips this step's update everywhere (as a loss scaler skips a step),
    its residual starts over, and the optimizer sees zeros.
    """
    grad.zero_()
    if residuals is not None:
        residuals.reset(layout)
    log.warning("%s decoded a non-finite mean for %s at step %d from finite inputs: this segment's update "
                "is skipped this step on every rank, residual reset", compressor.name, _describe(layout), ctx.step)
    if on_nonfinite is not None:
        on_nonfinite(layout, ctx.step)


def _describe(layout: SegmentLayout) -> str:
    names = layout.names
    return names[0] if len(names) == 1 else f"{names[0]} .. {names[-1]} ({len(names)} parameters)"
