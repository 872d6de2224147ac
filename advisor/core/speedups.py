"""Speed-ups, computed one way everywhere: a baseline's time over the plan's."""

from __future__ import annotations

import math
from collections.abc import Mapping


def speedup(baseline_s: float | None, plan_s: float | None) -> float | None:
    """How many times faster the plan is than the baseline; None where either time is unknown."""
    if baseline_s is None or plan_s is None or not (plan_s > 0 and math.isfinite(plan_s)):
        return None
    return baseline_s / plan_s


def speedups(baselines_s: Mapping[str, float | None], plan_s: float | None, *,
             known_only: bool = False) -> dict[str, float | None]:
    """``{name: speedup(baseline, plan)}``; ``known_only`` leaves out those that are unknown."""
    out = {name: speedup(base, plan_s) for name, base in baselines_s.items()}
    return {k: v for k, v in out.items() if v is not None} if known_only else out
