"""Constructed cluster profiles for policy tests: many buckets, known costs and errors."""

from __future__ import annotations

import math

import numpy as np
from test_perfmodel import linear_knots, network

from advisor.compressors import parse
from profilers.profile import (
    Bucket,
    ClusterProfile,
    ComputeProfile,
    Environment,
    FidelityEntry,
    FidelityProfile,
    KernelCost,
    KernelProfile,
)

MS = 1e-3

#: (encode s/element, decode s/element, relative error) per config
CONFIGS = {
    "fp16": (1e-9, 1e-9, 1e-4),
    "bf16": (1e-9, 1e-9, 1e-3),
    "powersgd(rank=1)": (4e-9, 2e-9, 0.6),
    "powersgd(rank=4)": (8e-9, 4e-9, 0.3),
    "topk(ratio=0.01)": (6e-9, 1e-9, 0.4),
    "intquant(bits=8)": (3e-9, 2e-9, 0.02),
}


def tuning_profile(n_buckets: int = 50, numel: int = 512 * 512, backward_s: float = 60 * MS,
                   rate: float = 1e9, world: int = 2, seed: int = 0, configs=CONFIGS) -> ClusterProfile:
    """``n_buckets`` square buckets ready evenly through backward; errors vary by bucket."""
    rng = np.random.default_rng(seed)
    side = int(math.isqrt(numel))
    params, buckets, entries = [], [], []
    for i in range(n_buckets):
        ready = backward_s * (i + 1) / n_buckets
        params.append(_timing(f"l{i}.weight", side, ready))
        buckets.append(Bucket(i, [f"l{i}.weight"], side * side))
        for label, (_, _, err) in configs.items():
            entries.append(FidelityEntry(i, parse(label).label, float(err * rng.uniform(0.5, 1.5)), 1.0 - err))
    costs = {parse(label).label: KernelCost(parse(label).label, [], linear_knots(e), linear_knots(d), world)
             for label, (e, d, _) in configs.items()}
    return ClusterProfile(
        environment=Environment(world, "gloo", "cpu", "x", "x", ["h"] * world, 1, "now"),
        compute=ComputeProfile(10 * MS, backward_s, 2 * MS, 1, params, {}, buckets,
                               copy_s_per_byte=1e-11),
        network=network(0.0, rate, world),
        kernels=KernelProfile("cpu", costs),
        fidelity=FidelityProfile(6, world, entries),
    )


def _timing(name: str, side: int, ready: float):
    from profilers.profile import ParameterTiming

    return ParameterTiming(name, name.split(".")[0], side * side, [side, side], ready)
