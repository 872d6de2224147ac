"""The tuning problem of a sharded (FSDP2) model: one config per ``fully_shard`` group.

A group's gradients cross in one reduce-scatter, so the group is the unit a plan chooses for,
as a bucket is under DDP.  The problem holds the profiled cost of each group's reduce-scatter
under each config (:class:`advisor.perfmodel.sharded.ShardedModel`) and its measured error; a
plan is feasible when its size-weighted mean error is within the budget.  The search is
exhaustive where the plans are few (a handful of groups and configs: every plan is scored in
one array operation), else greedy: start from the fastest feasible uniform plan and take, one
group at a time, the change that saves the most time per unit of error it adds.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import numpy as np

from advisor.perfmodel.sharded import ShardedModel
from advisor.runtime.plan import Plan
from profilers.sharded import ShardedProfile

#: plans scored at once by the exhaustive search, at most
EXHAUSTIVE_LIMIT = 200_000
_TOLERANCE = 1e-12


@dataclass
class ShardedProblem:
    """Per group and config: predicted seconds and error; ``budget``: the largest size-weighted
    mean error a plan may have (None: no limit)."""

    profile: ShardedProfile
    configs: list[str]
    budget: float | None = None
    model: ShardedModel = field(init=False, repr=False)
    errors: np.ndarray = field(init=False, repr=False)
    weights: np.ndarray = field(init=False, repr=False)

    def __post_init__(self) -> None:
        missing = [c for c in self.configs if c not in self.profile.configs]
        if missing:
            raise ValueError(f"config(s) {missing} were not profiled; profiled: {self.profile.configs}")
        if "none" not in self.configs:
            raise ValueError("the configs must include 'none' (FSDP's own reduce-scatter)")
        groups = self.profile.groups
        self.model = ShardedModel(self.profile.compute_s,
                                  np.array([[g.seconds[c] for c in self.configs] for g in groups]))
        self.errors = np.array([[g.error[c] for c in self.configs] for g in groups])
        sizes = np.array([g.numel for g in groups], dtype=float)
        self.weights = sizes / sizes.sum()

    @property
    def n_groups(self) -> int:
        return len(self.profile.groups)

    def uniform(self, config: str) -> np.ndarray:
        return np.full(self.n_groups, self.configs.index(config), dtype=int)

    def predict(self, choices: np.ndarray) -> np.ndarray:
        return self.model.predict(choices)

    def fidelity_error(self, choices: np.ndarray) -> np.ndarray:
        """Size-weighted mean relative error per plan."""
        choices = np.atleast_2d(np.asarray(choices, dtype=int))
        rows = np.arange(self.n_groups)[None, :]
        return (self.errors[rows, choices] * self.weights[None, :]).sum(axis=1)

    def feasible(self, choices: np.ndarray) -> np.ndarray:
        if self.budget is None:
            return np.ones(np.atleast_2d(choices).shape[0], dtype=bool)
        return self.fidelity_error(choices) <= self.budget + _TOLERANCE

    def plan(self, choices: np.ndarray, **kwargs) -> Plan:
        """The runtime plan: each group's parameters get that group's config."""
        choices = np.asarray(choices, dtype=int).reshape(-1)
        if choices.shape[0] != self.n_groups:
            raise ValueError(f"a plan needs one choice per group ({self.n_groups}), got {choices.shape[0]}")
        assignments = {n: self.configs[c] for g, c in zip(self.profile.groups, choices) for n in g.parameters
                       if self.configs[c] != "none"}
        return Plan.from_assignments(assignments, **kwargs)

    def describe(self, choices: np.ndarray) -> str:
        """``bf16 x3, intquant(bits=8) x2`` style summary of one plan."""
        labels = [self.configs[int(c)] for c in np.asarray(choices).reshape(-1)]
        counts: dict[str, int] = {}
        for label in labels:
            counts[label] = counts.get(label, 0) + 1
        if len(counts) == 1:
            return f"{labels[0]} everywhere"
        return ", ".join(f"{k} x{v}" for k, v in sorted(counts.items(), key=lambda kv: -kv[1]))


def search_sharded(problem: ShardedProblem, top: int = 3) -> list[np.ndarray]:
    """The ``top`` fastest feasible distinct plans, fastest first (see the module doc)."""
    n_configs = len(problem.configs)
    if n_configs ** problem.n_groups <= EXHAUSTIVE_LIMIT:
        every = np.array(list(itertools.product(range(n_configs), repeat=problem.n_groups)), dtype=int)
        every = every[problem.feasible(every)]
        order = np.argsort(problem.predict(every), kind="stable")
        return [every[i] for i in order[:top]]
    return _greedy(problem)[:top]


def _greedy(problem: ShardedProblem) -> list[np.ndarray]:
    """Plans visited by the greedy walk, fastest first."""
    uniform = [problem.uniform(c) for c in problem.configs]
    feasible = [u for u in uniform if problem.feasible(u)[0]]
    current = min(feasible, key=lambda u: float(problem.predict(u)[0]))
    visited = [current.copy()]
    while True:
        base_t, base_e = float(problem.predict(current)[0]), float(problem.fidelity_error(current)[0])
        best, best_score = None, 0.0
        for g, c in itertools.product(range(problem.n_groups), range(len(problem.configs))):
            if c == current[g]:
                continue
            trial = current.copy()
            trial[g] = c
            if not problem.feasible(trial)[0]:
                continue
            saved = base_t - float(problem.predict(trial)[0])
            if saved <= 0:
                continue
            score = saved / max(float(problem.fidelity_error(trial)[0]) - base_e, 1e-12)
            if score > best_score:
                best, best_score = trial, score
        if best is None:
            break
        current = best
        visited.append(current.copy())
    return sorted(visited, key=lambda u: float(problem.predict(u)[0]))
