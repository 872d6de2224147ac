"""What every policy returns, and the small interface policies share."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import numpy as np

from .problem import TuningProblem


@dataclass
class PolicyResult:
    """The chosen plan (``choices``: one config index per bucket) and how it was found.

    ``ranked`` holds the best distinct feasible plans found, best first (the chosen one
    included), for live validation of the top few.
    """

    policy: str
    choices: np.ndarray
    predicted_s: float
    fidelity_error: float
    evaluations: int
    seconds: float
    ranked: list[np.ndarray] = field(default_factory=list)

    def top(self, k: int) -> list[np.ndarray]:
        return (self.ranked or [self.choices])[:k]


class Policy(ABC):
    """Parameters go to ``__init__`` (stored, not checked); ``search`` validates and works."""

    name = "policy"

    @abstractmethod
    def search(self, problem: TuningProblem) -> PolicyResult:
        """The fastest predicted plan whose fidelity error stays within the budget."""


def distinct_best(problem: TuningProblem, plans: np.ndarray, seconds: np.ndarray, k: int) -> list[np.ndarray]:
    """The ``k`` fastest feasible distinct plans among ``plans`` (rows)."""
    feasible = problem.feasible(plans)
    order = np.argsort(np.where(feasible, seconds, np.inf), kind="stable")
    out, seen = [], set()
    for i in order:
        if not feasible[i]:
            break
        key = plans[i].tobytes()
        if key in seen:
            continue
        seen.add(key)
        out.append(plans[i].copy())
        if len(out) == k:
            break
    return out
