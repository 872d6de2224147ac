"""Do no harm: recommend compression only when it beats the best baseline by more than noise.

The top candidates are measured live next to the baselines (fp32, 16-bit) in interleaved
rounds; each round gives one median step time per plan (slowest rank).  The spread of a
plan's round medians is its measured noise.  A compressed plan is recommended only when
its median beats the best baseline's by more than the sum of the two noises (each
estimate may be off by its own noise, in opposite directions) and ``min_gain``;
otherwise the best baseline is, with the reason.  The same rule decides between fp32 and
16-bit: 16-bit must beat fp32 by more than the noise.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

FP32 = "fp32"
SIXTEEN_BIT = "16-bit"
CANDIDATE = "candidate"
KINDS = (FP32, SIXTEEN_BIT, CANDIDATE)


@dataclass
class LiveMeasurement:
    """One plan's step times: the median of each interleaved round (slowest rank)."""

    label: str
    kind: str
    round_s: list[float]
    predicted_s: float | None = None
    description: str = ""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"measurement kind {self.kind!r}; allowed: {KINDS}")
        if not self.round_s or any(not (t > 0) for t in self.round_s):
            raise ValueError(f"{self.label}: round times must be positive seconds, got {self.round_s}")

    @property
    def median_s(self) -> float:
        return statistics.median(self.round_s)

    @property
    def noise(self) -> float:
        """Relative half-spread of the round medians (0 with one round)."""
        return (max(self.round_s) - min(self.round_s)) / 2 / self.median_s


@dataclass
class Decision:
    chosen: str
    kind: str
    compress: bool
    best_baseline: str
    best_candidate: str | None
    margin: float
    gain_vs_best_baseline: float
    reason: str
    ranking: list[str] = field(default_factory=list)


def decide(measurements: list[LiveMeasurement], min_gain: float = 0.0) -> Decision:
    """The recommendation from live measurements; see the module docstring."""
    if not 0 <= min_gain < 1:
        raise ValueError(f"min_gain={min_gain!r}; allowed: 0 <= min_gain < 1")
    fp32 = [m for m in measurements if m.kind == FP32]
    if not fp32:
        raise ValueError("do-no-harm needs the fp32 baseline among the measurements")
    base = min(fp32, key=lambda m: m.median_s)
    why_base = f"{base.label} is the baseline"
    for m in sorted((m for m in measurements if m.kind == SIXTEEN_BIT), key=lambda m: m.median_s):
        margin = max(base.noise + m.noise, min_gain)
        if m.median_s < base.median_s * (1 - margin):
            why_base = (f"{m.label} beats {base.label} by {1 - m.median_s / base.median_s:.1%} "
                        f"(noise {margin:.1%})")
            base = m
        break
    ranking = [m.label for m in sorted(measurements, key=lambda m: m.median_s)]
    candidates = [m for m in measurements if m.kind == CANDIDATE]
    if not candidates:
        return Decision(base.label, base.kind, False, base.label, None, 0.0, 1.0,
                        f"no compressed candidate was measured; {why_base}", ranking)
    best = min(candidates, key=lambda m: m.median_s)
    margin = max(base.noise + best.noise, min_gain)
    gain = base.median_s / best.median_s
    if best.median_s < base.median_s * (1 - margin):
        reason = (f"{best.description or best.label} measured {best.median_s * 1e3:.1f} ms/step vs "
                  f"{base.median_s * 1e3:.1f} ms for the best baseline ({base.label}): {gain:.2f}x, "
                  f"more than the measured noise ({margin:.1%})")
        return Decision(best.label, best.kind, True, base.label, best.label, margin, gain, reason, ranking)
    reason = (f"the best compressed plan ({best.description or best.label}, {best.median_s * 1e3:.1f} ms/step) "
              f"does not beat {base.label} ({base.median_s * 1e3:.1f} ms/step) by more than the measured "
              f"noise ({margin:.1%}); {why_base}")
    return Decision(base.label, base.kind, False, base.label, best.label, margin, gain, reason, ranking)
