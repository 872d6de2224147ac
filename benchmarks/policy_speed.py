"""How fast are the policies?  Target (issue 5): 2,000 Optuna trials on a 50-bucket model <= 10 s.

Run:  .venv/bin/python benchmarks/policy_speed.py

A constructed 50-bucket profile (tests/constructed.py) with 7 candidates, at three link
rates: seconds for the greedy policy and for 2,000 Optuna trials (seeded with the greedy
plan), and the predicted iteration of each answer next to the best uniform plan.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

from constructed import tuning_profile  # noqa: E402

from policies.greedy import GreedyPolicy  # noqa: E402
from policies.optuna_search import OptunaPolicy  # noqa: E402
from policies.problem import TuningProblem  # noqa: E402


def main() -> int:
    print(f"{'rate':>8s} {'greedy s':>9s} {'optuna s':>9s} {'uniform best ms':>16s} {'greedy ms':>10s} "
          f"{'optuna ms':>10s}")
    worst = 0.0
    for rate in (1e8, 1e9, 1e10):
        problem = TuningProblem.from_profile(tuning_profile(n_buckets=50, rate=rate))
        uniform = min(float(problem.predict(problem.uniform(c))[0]) for c in problem.configs
                      if problem.feasible(problem.uniform(c))[0])
        greedy = GreedyPolicy().search(problem)
        optuna = OptunaPolicy(n_trials=2000).search(problem)
        worst = max(worst, optuna.seconds)
        print(f"{rate / 1e6:6.0f}M {greedy.seconds:9.2f} {optuna.seconds:9.2f} {uniform * 1e3:16.1f} "
              f"{greedy.predicted_s * 1e3:10.1f} {optuna.predicted_s * 1e3:10.1f}")
    print(f"\nslowest 2,000-trial search: {worst:.1f} s (target <= 10 s: {'PASS' if worst <= 10 else 'FAIL'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
