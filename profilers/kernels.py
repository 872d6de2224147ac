"""Encode/decode cost of each candidate compressor on this device, with a fitted size model.

Measured on the model's own bucket layouts (real parameter shapes) and on a ladder of
synthetic square-ish layouts spanning the sizes in between, then fitted per config with
scikit-learn (``time = a + b·numel``, Huber loss so one noisy point does not bend it), so
the performance model can cost a bucket size nobody measured.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch
from sklearn.linear_model import HuberRegressor

from advisor.compressors import SegmentLayout, parse
from advisor.compressors.timing import measure

from .profile import KernelCost, KernelProfile

DEFAULT_CONFIGS = (
    "fp16", "bf16", "powersgd(rank=1)", "powersgd(rank=4)", "topk(ratio=0.01)",
    "randomk(ratio=0.01)", "qsgd(bits=8)", "qsgd(bits=4)", "intquant(bits=8)", "intquant(bits=8, packed=0)",
    "signsgd",
)


def square_layout(numel: int, name: str = "synthetic") -> SegmentLayout:
    """A matrix of about ``numel`` values, as close to square as powers of two allow."""
    rows = 2 ** max(0, round(math.log2(max(1, numel)) / 2))
    cols = max(1, numel // rows)
    return SegmentLayout((name,), ((rows, cols),))


def fit_linear(numels: Sequence[float], seconds: Sequence[float]) -> list[float]:
    """[intercept, slope] of seconds against numel (robust, relative weights)."""
    x = np.asarray(numels, dtype=np.float64).reshape(-1, 1)
    y = np.asarray(seconds, dtype=np.float64)
    if len(set(x[:, 0])) < 2:
        return [0.0, float(y.mean() / max(1.0, x[0, 0]))]
    scale = x.max()
    weights = 1.0 / np.maximum(y, 1e-7)
    model = HuberRegressor(epsilon=1.5, alpha=0.0, max_iter=1000)
    model.fit(x / scale, y, sample_weight=weights / weights.mean())
    return [float(model.intercept_), float(model.coef_[0] / scale)]


def profile_kernels(
    layouts: Sequence[SegmentLayout],
    configs: Sequence[str] = DEFAULT_CONFIGS,
    world_size: int = 2,
    device: str | torch.device = "cpu",
    ladder: Sequence[int] = (1 << 14, 1 << 16, 1 << 18, 1 << 20, 1 << 22),
    repeats: int = 3,
) -> KernelProfile:
    """Measure every config on ``layouts`` and on the ``ladder`` sizes; fit a size model."""
    samples = list(layouts) + [square_layout(n) for n in ladder]
    costs = {}
    for spec in configs:
        config = parse(spec)
        points = []
        for layout in samples:
            t = measure(config.build(), layout, world_size=world_size, repeats=repeats, warmup=1, device=device)
            points.append([float(layout.numel), t.encode_s, t.decode_s])
        numels = [p[0] for p in points]
        costs[config.label] = KernelCost(
            config=config.label,
            points=points,
            encode_coef=fit_linear(numels, [p[1] for p in points]),
            decode_coef=fit_linear(numels, [p[2] for p in points]),
            world_size=world_size,
        )
    return KernelProfile(device=str(torch.device(device)), costs=costs)
