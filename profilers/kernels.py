"""Encode/decode cost of each candidate compressor on this device, with a fitted size model.

Measured on the model's own bucket layouts (real parameter shapes) and on a ladder of
synthetic square-ish layouts spanning the sizes in between, then fitted per config with
scikit-learn (monotone, piecewise linear in log-log space: the cost per element changes where a
bucket stops fitting in cache), so the performance model can cost a bucket size nobody
measured.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch
from sklearn.isotonic import IsotonicRegression

from advisor.compressors import SegmentLayout, parse
from advisor.compressors.forms import CHOICES, choose_forms
from advisor.runtime.timing import CacheFlusher, measure, time_call

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


def fit_loglog(numels: Sequence[float], seconds: Sequence[float]) -> list[list[float]]:
    """Knots ``[[log n, log t], ...]`` of a monotone fit of time against size.

    scikit-learn's IsotonicRegression in log-log space: time never decreases with size,
    repeated and noisy sizes are pooled, and the result interpolates piecewise linearly
    (see :func:`profilers.profile.predict_loglog`).
    """
    x = np.log(np.maximum(np.asarray(numels, dtype=np.float64), 1.0))
    y = np.log(np.maximum(np.asarray(seconds, dtype=np.float64), 1e-9))
    model = IsotonicRegression(increasing=True, out_of_bounds="clip")
    model.fit(x, y)
    knots = sorted({(float(a), float(b)) for a, b in zip(model.X_thresholds_, model.y_thresholds_)})
    return [[a, b] for a, b in knots]


def time_forms(device: str | torch.device = "cpu", repeats: int = 7) -> dict[str, dict[str, float]]:
    """Median seconds of every form of every kernel choice on ``device`` (CPU caches flushed before each)."""
    device = torch.device(device)
    flush = CacheFlusher() if device.type == "cpu" else None
    return {name: {form: time_call(choice.probe(form, device), repeats=repeats, device=device, flush=flush)
                   for form in choice.forms}
            for name, choice in CHOICES.items()}


def profile_kernels(
    layouts: Sequence[SegmentLayout],
    configs: Sequence[str] = DEFAULT_CONFIGS,
    world_size: int = 2,
    device: str | torch.device = "cpu",
    ladder: Sequence[int] = (1 << 14, 1 << 16, 1 << 18, 1 << 20, 1 << 22),
    repeats: int = 5,
    forms: dict[str, str] | None = None,
    form_seconds: dict[str, dict[str, float]] | None = None,
) -> KernelProfile:
    """Choose the kernel forms on this device, then time every config's encode and decode with them.

    Args:
        layouts: the buckets' layouts (each is timed at its own size).
        configs: the compressor configs.
        world_size: the ranks a decode combines (it sets what an all-gather's decode sees).
        device: where the kernels run.
        ladder: more sizes (elements), so the fit covers buckets of other models.
        repeats: timings per size (the median counts).
        forms: kernel forms to use as they are (default: time every form here and keep the
            faster, :func:`time_forms`); ``form_seconds``: the timings they were chosen from.

    Returns:
        A :class:`KernelProfile` of this rank (:func:`profilers.cluster.slowest_kernels` merges ranks).

    Raises:
        ValueError: an unknown config, naming the allowed ones.
    """
    if forms is None:
        form_seconds = time_forms(device)
        forms = choose_forms(form_seconds)
    samples = list(layouts) + [square_layout(n) for n in ladder]
    costs = {}
    for spec in configs:
        config = parse(spec)
        points = []
        for layout in samples:
            t = measure(config.build(), layout, world_size=world_size, repeats=repeats, warmup=1, device=device,
                        forms=forms)
            points.append([float(layout.numel), t.encode_s, t.decode_s])
        numels = [p[0] for p in points]
        costs[config.label] = KernelCost(
            config=config.label,
            points=points,
            encode_knots=fit_loglog(numels, [p[1] for p in points]),
            decode_knots=fit_loglog(numels, [p[2] for p in points]),
            world_size=world_size,
        )
    return KernelProfile(device=str(torch.device(device)), costs=costs, forms=dict(forms),
                         form_seconds=dict(form_seconds or {}))
