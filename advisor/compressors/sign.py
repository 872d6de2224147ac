"""EF-signSGD (Karimireddy et al., 2019): one bit a value plus one scale a parameter."""

from __future__ import annotations

import torch

from advisor.compressors.base import Collective, Compressor, Exchange, Message, SegmentLayout, WireSpec
from advisor.compressors.packing import pack_bits, packed_nbytes, unpack_bits


class SignSGD(Compressor):
    """Send ``x >= 0`` packed 8 to a byte and ``mean|x|`` for each parameter.

    Signs cannot be summed in one bit, so the payload goes by all-gather.  Scaling by the
    mean magnitude makes ``scale·sign(x)`` the best 1-bit approximation in L2 for a
    constant scale; error feedback carries the rest (it is what makes signSGD converge).
    """

    name = "signsgd"
    uses_all_gather = True
    detects_nonfinite = True

    def _sizes(self, layout: SegmentLayout) -> tuple[int, int]:
        return packed_nbytes(layout.numel, 1), len(layout.names) * 4

    def wire(self, layout: SegmentLayout, world_size: int) -> list[WireSpec]:
        signs, scales = self._sizes(layout)
        return [WireSpec(Collective.ALL_GATHER, signs + scales + 1)]

    def exchange(self, inp, out, layout, state, ctx) -> Exchange:
        numel = inp.numel()
        sign_bytes, scale_bytes = self._sizes(layout)
        views = layout.views(inp)
        payload = ctx.payload(scale_bytes + sign_bytes, torch.uint8, inp.device)
        scales = payload[:scale_bytes].view(torch.float32)  # first: 4-byte aligned
        for i, v in enumerate(views):
            torch.linalg.vector_norm(v, ord=1, out=scales[i]).div_(v.numel())
        ctx.nonfinite = not bool(torch.isfinite(scales).all())
        positive = ctx.buffer("positive", numel, torch.bool, inp.device)
        torch.ge(inp, 0, out=positive)
        pack_bits(positive.view(torch.uint8), 1, out=payload[scale_bytes:])
        signs = ctx.buffer("signs", numel, torch.float32, inp.device)
        if ctx.keep_residual:
            signs.copy_(positive).mul_(2).sub_(1)  # ±1
            for v, sv, scale in zip(views, layout.views(signs), scales.tolist()):
                v.sub_(sv, alpha=scale)

        gathered = yield Message(payload, Collective.ALL_GATHER, last=True)
        out_views = layout.views(out)
        sign_views = layout.views(signs)
        totals = torch.zeros(len(views), dtype=torch.float64)
        for r, row in enumerate(gathered):
            rank_scales = row[:scale_bytes].clone().view(torch.float32).double() / ctx.world_size
            totals += rank_scales
            signs.copy_(unpack_bits(row[scale_bytes:], 1, numel))  # 0/1
            # value = (2·bit - 1)·scale: add 2·scale·bit now, subtract the scales at the end
            for ov, sv, scale in zip(out_views, sign_views, (2 * rank_scales).tolist()):
                if r == 0:
                    torch.mul(sv, scale, out=ov)
                else:
                    ov.add_(sv, alpha=scale)
        for ov, total in zip(out_views, totals.tolist()):
            ov.sub_(total)
