"""Measure a compressor's encode and decode cost on this device, with no network.

The exchange generator is driven with stand-in collective results of the right shape
(``world_size`` copies of this rank's payload), so decode does the work it does on a real
cluster of that size.  Time before the last message counts as encode (PowerSGD's middle
step included), time after it as decode.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from advisor.compressors.base import Collective, Compressor, ExchangeContext, Message, SegmentLayout
from advisor.runtime.segment import ResidualStore, guarded_exchange


@dataclass(frozen=True)
class CodecTiming:
    encode_s: float
    decode_s: float
    wire_bytes: int

    @property
    def total_s(self) -> float:
        return self.encode_s + self.decode_s


def _stand_in(message: Message, world_size: int) -> torch.Tensor:
    t = message.tensor
    if message.collective is Collective.ALL_GATHER:
        return t.unsqueeze(0).expand(world_size, -1).contiguous()
    return t.clone()


class CacheFlusher:
    """Evicts CPU caches by writing a buffer larger than them (untimed, between runs).

    Without it a bucket that fits in L2/L3 (1M fp32 values is 4 MiB) is timed from cache,
    and a "copy" reference stops measuring memory bandwidth.
    """

    def __init__(self, nbytes: int = 128 << 20) -> None:
        self._buf = torch.zeros(nbytes // 4)

    def __call__(self) -> None:
        self._buf.add_(1.0)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_once(
    compressor: Compressor,
    grad: torch.Tensor,
    layout: SegmentLayout,
    world_size: int,
    state: dict,
    residuals: ResidualStore | None,
    step: int = 0,
    workspace: dict | None = None,
    clock: Callable[[], float] = time.perf_counter,
    flush: Callable[[], None] | None = None,
    forms: Mapping[str, str] | None = None,
) -> CodecTiming:
    """One exchange on a copy of ``grad`` (kernel ``forms`` as a plan names them); its encode and decode time."""
    buf = grad.clone()
    ctx = ExchangeContext(world_size, step=step, workspace=workspace if workspace is not None else {},
                          forms=forms or {})
    exchange = guarded_exchange(compressor, buf, layout, state, residuals, ctx)
    device = grad.device
    if flush is not None:
        flush()
    _sync(device)
    wire = 0
    decode = 0.0
    t0 = clock()
    message = next(exchange)
    _sync(device)
    encode = clock() - t0
    while True:
        wire += message.nbytes
        result = _stand_in(message, world_size)  # not timed: it stands in for the network
        t0 = clock()
        try:
            message = exchange.send(result)
        except StopIteration:
            _sync(device)
            decode = clock() - t0
            break
        _sync(device)
        encode += clock() - t0
    return CodecTiming(encode, decode, wire)


def measure(
    compressor: Compressor,
    layout: SegmentLayout,
    *,
    world_size: int = 2,
    repeats: int = 5,
    warmup: int = 2,
    device: str | torch.device = "cpu",
    grad: torch.Tensor | None = None,
    flush: Callable[[], None] | None = None,
    forms: Mapping[str, str] | None = None,
) -> CodecTiming:
    """Median encode/decode time over ``repeats`` exchanges after ``warmup`` ones (kernel ``forms`` as a plan's)."""
    device = torch.device(device)
    if grad is None:
        grad = torch.randn(layout.numel, device=device)
    state: dict = {}
    workspace: dict = {}
    residuals = ResidualStore() if compressor.error_feedback else None
    runs = [
        run_once(compressor, grad, layout, world_size, state, residuals, step, workspace, flush=flush, forms=forms)
        for step in range(warmup + repeats)
    ][warmup:]
    return CodecTiming(
        statistics.median(r.encode_s for r in runs),
        statistics.median(r.decode_s for r in runs),
        runs[0].wire_bytes,
    )


def time_call(
    fn: Callable[[], object], repeats: int = 5, warmup: int = 2, device="cpu", flush: Callable[[], None] | None = None
) -> float:
    """Median wall time of ``fn()``."""
    device = torch.device(device)
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        if flush is not None:
            flush()
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)
