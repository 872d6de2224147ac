"""The step time of a sharded (FSDP2) model under a per-group plan.

With gloo on CPU every collective runs on the training thread, and FSDP calls a custom
reduce-scatter synchronously (:mod:`advisor.runtime.sharded`), so a step is the time of
everything else (compute, all-gathers, the optimizer) plus each group's reduce-scatter in turn.
On a GPU FSDP issues reduce-scatters on a stream of their own, overlapping the backward of the
groups before them; that overlap is not modelled (no GPU has run it here), so there the
prediction is an upper bound, and the live measurement decides in both cases.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class ShardedModel:
    """``compute_s``: a step without its reduce-scatters; ``seconds[g, c]``: group g's
    reduce-scatter under config c."""

    compute_s: float
    seconds: np.ndarray

    def __post_init__(self) -> None:
        self.seconds = np.asarray(self.seconds, dtype=float)
        if self.seconds.ndim != 2 or not np.all(np.isfinite(self.seconds)) or np.any(self.seconds < 0):
            raise ValueError("seconds must be a (groups, configs) array of finite seconds >= 0")
        if not (np.isfinite(self.compute_s) and self.compute_s >= 0):
            raise ValueError(f"compute_s must be finite seconds >= 0, got {self.compute_s!r}")

    def predict(self, choices: np.ndarray) -> np.ndarray:
        """Predicted step seconds of each plan (``choices``: one config index per group, per row)."""
        choices = np.atleast_2d(np.asarray(choices, dtype=int))
        if choices.shape[1] != self.seconds.shape[0]:
            raise ValueError(f"a plan needs one choice per group ({self.seconds.shape[0]}), got {choices.shape[1]}")
        groups = np.arange(self.seconds.shape[0])[None, :]
        return self.compute_s + self.seconds[groups, choices].sum(axis=1)
