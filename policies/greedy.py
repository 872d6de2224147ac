"""A deterministic baseline policy: greedy descent over the replayed timeline.

Espresso-style: start from the fastest feasible uniform plan, then repeatedly make the
single-bucket change that shortens the predicted iteration most while the plan stays
within the fidelity budget; stop when no change helps.  Every round evaluates all
(bucket, config) changes at once through the vectorised performance model, so a
50-bucket model with a dozen candidates takes milliseconds a round.

When the budget binds, a pure single-change descent stalls; a second move type pairs a
change that gains time with one that frees error budget (swap), as a knapsack would.
"""

from __future__ import annotations

import time

import numpy as np

from advisor.core.documents import check_int

from .base import Policy, PolicyResult, distinct_best
from .problem import TuningProblem


class GreedyPolicy(Policy):
    """``max_rounds``: upper bound on improving moves (default: buckets x candidates)."""

    name = "greedy"

    def __init__(self, max_rounds: int | None = None, keep: int = 8) -> None:
        self.max_rounds = max_rounds
        self.keep = keep

    def search(self, problem: TuningProblem) -> PolicyResult:
        if self.max_rounds is not None:
            check_int("max_rounds", self.max_rounds)
        check_int("keep", self.keep)
        t0 = time.perf_counter()
        n_b, n_c = problem.n_buckets, len(problem.configs)
        uniforms = np.repeat(np.arange(n_c)[:, None], n_b, axis=1)
        seconds = problem.predict(uniforms)
        evaluations = n_c
        visited_plans, visited_s = [uniforms], [seconds]
        start = distinct_best(problem, uniforms, seconds, 1)
        if not start:  # 'none' has zero error, so this only happens with a negative budget
            raise ValueError(f"no uniform plan meets the fidelity budget {problem.budget:g}")
        current = start[0]
        current_s = float(problem.predict(current[None, :])[0])
        rounds = self.max_rounds or n_b * n_c
        for _ in range(rounds):
            # every single-bucket change: (n_b * n_c) plans
            neighbours = np.repeat(current[None, :], n_b * n_c, axis=0)
            neighbours[np.arange(n_b * n_c), np.repeat(np.arange(n_b), n_c)] = np.tile(np.arange(n_c), n_b)
            s = problem.predict(neighbours)
            evaluations += len(neighbours)
            visited_plans.append(neighbours)
            visited_s.append(s)
            best = distinct_best(problem, neighbours, s, 1)
            if best and problem.predict(best[0][None, :])[0] < current_s * (1 - 1e-9):
                current = best[0]
                current_s = float(problem.predict(current[None, :])[0])
                continue
            moved, n = self._swap(problem, current, current_s, s)
            evaluations += n
            if moved is None:
                break
            current = moved
            current_s = float(problem.predict(current[None, :])[0])
        all_plans = np.concatenate(visited_plans + [current[None, :]])
        all_s = np.concatenate(visited_s + [problem.predict(current[None, :])])
        ranked = distinct_best(problem, all_plans, all_s, self.keep)
        return PolicyResult(
            policy=self.name,
            choices=current,
            predicted_s=current_s,
            fidelity_error=float(problem.fidelity_error(current[None, :])[0]),
            evaluations=evaluations,
            seconds=time.perf_counter() - t0,
            ranked=ranked,
        )

    @staticmethod
    def _swap(problem: TuningProblem, current: np.ndarray, current_s: float, s: np.ndarray):
        """Best pair of changes: one that gains time but breaks the budget, one that repairs it.

        ``s``: predicted seconds of every single-bucket change of ``current``, in the
        round's (bucket, config) order.
        """
        n_b, n_c = problem.n_buckets, len(problem.configs)
        rows = np.arange(n_b)
        base_err = problem.errors[rows, current]
        delta_err = (problem.errors - base_err[:, None]) * problem.weights[:, None]  # (b, c)
        slack = problem.budget - float(problem.fidelity_error(current[None, :])[0])
        # single changes that gain time, ranked by predicted time
        gaining = [i for i in np.argsort(s) if s[i] < current_s * (1 - 1e-9)][:8]
        # changes that free budget (negative delta error), most freed first
        freeing = np.argsort(delta_err.reshape(-1))[:16]
        freeing = [i for i in freeing if delta_err.reshape(-1)[i] < 0]
        if not gaining or not freeing:
            return None, 0
        pairs = []
        for g in gaining:
            bg, cg = divmod(int(g), n_c)
            for f in freeing:
                bf, cf = divmod(int(f), n_c)
                if bf == bg:
                    continue
                if delta_err[bg, cg] + delta_err[bf, cf] <= slack + 1e-12:
                    plan = current.copy()
                    plan[bg], plan[bf] = cg, cf
                    pairs.append(plan)
        if not pairs:
            return None, 0
        pairs = np.array(pairs)
        ps = problem.predict(pairs)
        best = distinct_best(problem, pairs, ps, 1)
        if best and problem.predict(best[0][None, :])[0] < current_s * (1 - 1e-9):
            return best[0], len(pairs)
        return None, len(pairs)
