"""Dense compressors: fp32 all-reduce (the baseline) and 16-bit casts."""

from __future__ import annotations

import torch

from advisor.compressors.base import Collective, Compressor, Exchange, Message, SegmentLayout, WireSpec, dtype_name, is_finite


class NoCompression(Compressor):
    """fp32 all-reduce of the gradient divided by world size, as DDP does without a hook.

    Multiplying by ``1/world_size`` before the sum (not dividing after) matches DDP's own
    reducer bit for bit, which the exactness test relies on.
    """

    name = "none"
    lossy = False
    elementwise = True

    def exchange(self, inp, out, layout, state, ctx) -> Exchange:
        if inp.data_ptr() != out.data_ptr():
            out.copy_(inp)
            if ctx.keep_residual:
                inp.zero_()
        if ctx.world_size > 1:
            out.mul_(1.0 / ctx.world_size)
        summed = yield Message(out, Collective.ALL_REDUCE_SUM, last=True)
        if summed.data_ptr() != out.data_ptr():  # a real all-reduce works in place
            out.copy_(summed)

    def wire(self, layout: SegmentLayout, world_size: int) -> list[WireSpec]:
        return [WireSpec(Collective.ALL_REDUCE_SUM, layout.numel * 4)]


class _Cast(Compressor):
    """Cast to a 16-bit float type, all-reduce, cast back.

    Divided by ``world_size`` after the cast, in 16 bits, as PyTorch's fp16 hook does
    (half the bytes of doing it in fp32 first).  The non-finite check runs on 16 bits, so
    it also catches values beyond the 16-bit range (Inf after the cast): that step goes
    uncompressed instead of turning into Inf.  Without error feedback it runs on the summed
    payload, after the all-reduce (one scan, off the backward thread, and no flag element:
    as lean as PyTorch's hook); with it, on this rank's payload before.  Near-lossless, so
    error feedback is off by default; turn it on to carry the rounding error forward.
    """

    lossy = False
    elementwise = True
    detects_nonfinite = True
    checks_combined = True
    dtype: torch.dtype = torch.float16

    def exchange(self, inp, out, layout, state, ctx) -> Exchange:
        if ctx.check_combined:  # judged after the sum: no flag slot, no scan of this rank's payload
            wire = ctx.buffer("wire", inp.numel(), self.dtype, inp.device).copy_(inp)
        else:
            wire = ctx.payload(inp.numel(), self.dtype, inp.device)
            wire.copy_(inp)
            ctx.nonfinite = not is_finite(wire)
        if ctx.world_size > 1:
            wire.mul_(1.0 / ctx.world_size)
        if ctx.keep_residual:
            # residual = inp - what this rank contributed once decoded
            decoded = ctx.buffer("decoded", inp.numel(), torch.float32, inp.device).copy_(wire)
            inp.sub_(decoded.mul_(ctx.world_size))
        summed = yield Message(wire, Collective.ALL_REDUCE_SUM, last=True)
        if ctx.check_combined and not is_finite(summed):
            ctx.nonfinite = True  # out is left as it was: the runtime sends it uncompressed instead
            return
        out.copy_(summed)

    def wire(self, layout: SegmentLayout, world_size: int) -> list[WireSpec]:
        flag = 1 if self.error_feedback else 0  # the runtime's flag element rides only where the input is judged
        return [WireSpec(Collective.ALL_REDUCE_SUM, (layout.numel + flag) * 2, dtype_name(self.dtype))]


class Fp16(_Cast):
    name = "fp16"
    dtype = torch.float16


class Bf16(_Cast):
    name = "bf16"
    dtype = torch.bfloat16
