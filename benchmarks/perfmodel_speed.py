"""How fast the performance model evaluates plans: 10,000 plans for a 200-bucket model.

Run:  .venv/bin/python benchmarks/perfmodel_speed.py [--plans 10000] [--buckets 200]

The profile is constructed (200 buckets of 64K-1M elements, ready through a 200 ms
backward, a 1 Gbit/s network, linear kernel costs for 6 configs); the model's own work
is what is timed: costing every (bucket, config) pair once, then predicting every plan.
Target: <= 2 s for 10,000 plans.
"""

from __future__ import annotations

import argparse
import math
import sys
import time

import numpy as np

sys.path.insert(0, "tests")
from test_perfmodel import profile  # noqa: E402  (the constructed-profile helper)

from advisor.perfmodel import PerformanceModel  # noqa: E402

CONFIGS = {"none": None, "fp16": (1e-9, 1e-9), "bf16": (1e-9, 1e-9), "powersgd(rank=4)": (4e-9, 1e-9),
           "topk(ratio=0.01)": (6e-9, 1e-9), "qsgd(bits=8)": (3e-9, 2e-9)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--plans", type=int, default=10_000)
    parser.add_argument("--buckets", type=int, default=200)
    args = parser.parse_args(argv)
    rng = np.random.default_rng(0)
    sizes = rng.integers(1 << 16, 1 << 20, size=args.buckets)
    ready = np.sort(rng.uniform(0, 0.2, size=args.buckets))
    kernels = {k: v for k, v in CONFIGS.items() if v is not None}
    prof = profile([(int(n), float(r)) for n, r in zip(sizes, ready)], backward=0.2,
                   kernel_s_per_element=kernels)
    model = PerformanceModel(prof)
    t0 = time.perf_counter()
    costs = model.candidate_costs(list(CONFIGS))
    t1 = time.perf_counter()
    choices = rng.integers(0, len(CONFIGS), size=(args.plans, args.buckets))
    times = model.predict_many(choices, costs)
    t2 = time.perf_counter()
    total = t2 - t0
    print(f"{args.plans} plans x {args.buckets} buckets x {len(CONFIGS)} configs")
    print(f"costing (bucket, config) pairs: {t1 - t0:.3f} s; predicting all plans: {t2 - t1:.3f} s")
    print(f"total {total:.3f} s (target <= 2 s) {'PASS' if total <= 2 else 'FAIL'}; "
          f"fastest plan {times.min() * 1e3:.1f} ms, slowest {times.max() * 1e3:.1f} ms")
    assert math.isfinite(times.sum())
    return 0


if __name__ == "__main__":
    sys.exit(main())
