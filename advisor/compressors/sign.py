"""EF-signSGD (Karimireddy et al., 2019): one bit a value plus one scale a parameter."""

from __future__ import annotations

import torch

from .base import Collective, Compressor, Exchange, Message, SegmentLayout, WireSpec
from .packing import pack_bits, packed_nbytes, unpack_bits


class SignSGD(Compressor):
    """Send ``sign(x)`` packed 8 to a byte and ``mean|x|`` for each parameter.

    Signs cannot be summed in one bit, so the payload goes by all-gather.  Scaling by the
    mean magnitude makes ``scale·sign(x)`` the best 1-bit approximation in L2 for a
    constant scale; error feedback carries the rest (it is what makes signSGD converge).
    """

    name = "signsgd"
    uses_all_gather = True

    def _sizes(self, layout: SegmentLayout) -> tuple[int, int]:
        return packed_nbytes(layout.numel, 1), len(layout.names) * 4

    def wire(self, layout: SegmentLayout, world_size: int) -> list[WireSpec]:
        signs, scales = self._sizes(layout)
        return [WireSpec(Collective.ALL_GATHER, signs + scales + 1)]

    def exchange(self, inp, out, layout, state, ctx) -> Exchange:
        numel = inp.numel()
        sign_bytes, scale_bytes = self._sizes(layout)
        numels = torch.tensor(layout.numels, device=inp.device)
        scales = torch.stack([v.abs().mean() for v in layout.views(inp)]).to(torch.float32)
        positive = inp >= 0
        payload = ctx.payload(sign_bytes + scale_bytes, torch.uint8, inp.device)
        payload[:scale_bytes].view(torch.float32).copy_(scales)
        pack_bits(positive, 1, out=payload[scale_bytes:])
        if ctx.keep_residual:
            local = torch.repeat_interleave(scales, numels)
            inp.sub_(torch.where(positive, local, -local))
        del positive
        gathered = yield Message(payload, Collective.ALL_GATHER, last=True)
        out.zero_()
        for row in gathered:
            rank_scales = row[:scale_bytes].clone().view(torch.float32)
            bits = unpack_bits(row[scale_bytes:], 1, numel)
            magnitude = torch.repeat_interleave(rank_scales, numels)
            out.add_(torch.where(bits.bool(), magnitude, -magnitude))
        out.mul_(1.0 / ctx.world_size)
