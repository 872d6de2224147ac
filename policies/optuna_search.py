"""The main policy: an Optuna study over one categorical choice per bucket.

Objective: the performance model's predicted iteration time.  The accuracy budget is an
Optuna constraint (``trial.set_constraint``: feasible when <= 0), so the sampler itself
steers towards plans within budget.  The study is seeded (``enqueue_trial``) with the
uncompressed and 16-bit baselines, the uniform reference and the greedy plan, so its
answer can never be worse than the greedy baseline's.  Trials are asked and told in
batches, and each batch is predicted in one vectorised call.

Where the whole space holds no more plans than ``n_trials`` (a few buckets, as under a
coarse bucket layout), every plan is scored instead, in one vectorised call: the sampler
would only draw the same plans again, and 1,000 trials of 49 plans cost most of a second.
A study in ``storage`` is always run as a study, so that it can be resumed.

The default sampler is NSGA-II (a genetic algorithm): with 50+ categorical parameters
and thousands of trials, TPE's per-trial cost grows with the history (its 2,000 trials
did not finish in 200 s here), while NSGA-II stays near Optuna's own ask/tell overhead.
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import time

import numpy as np
import optuna

from advisor.core.documents import check_int

from .base import Policy, PolicyResult, distinct_best
from .greedy import GreedyPolicy
from .problem import TuningProblem

#: each sampler by name, made from the seed
SAMPLERS = {
    "nsga2": lambda seed: optuna.samplers.NSGAIISampler(seed=seed, population_size=100),
    "tpe": lambda seed: optuna.samplers.TPESampler(seed=seed),
    "random": lambda seed: optuna.samplers.RandomSampler(seed=seed),
}


def _param(b: int) -> str:
    return f"bucket{b:03d}"


def problem_signature(problem: TuningProblem) -> str:
    """What a stored study's trials are only valid for: buckets, candidates, budget."""
    text = repr((problem.parameter_names, problem.configs, round(problem.budget, 12)))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


class OptunaPolicy(Policy):
    """Per-bucket categorical search with Optuna.

    ``n_trials`` new trials; ``sampler``: one of ``SAMPLERS`` or an Optuna sampler
    instance; ``seed`` makes the default samplers deterministic; ``storage`` (e.g.
    ``"sqlite:///study.db"``) with ``study_name`` lets a study resume; ``batch`` trials
    are asked before a vectorised prediction; ``seed_with_greedy`` enqueues the greedy
    plan.
    """

    name = "optuna"

    def __init__(
        self,
        n_trials: int = 2000,
        *,
        sampler="nsga2",
        seed: int | None = 0,
        storage: str | None = None,
        study_name: str | None = None,
        batch: int = 100,
        seed_with_greedy: bool = True,
        keep: int = 8,
    ) -> None:
        self.n_trials = n_trials
        self.sampler = sampler
        self.seed = seed
        self.storage = storage
        self.study_name = study_name
        self.batch = batch
        self.seed_with_greedy = seed_with_greedy
        self.keep = keep

    def _make_sampler(self):
        if isinstance(self.sampler, optuna.samplers.BaseSampler):
            return self.sampler
        return SAMPLERS[self.sampler](self.seed)

    def _validate(self) -> None:
        check_int("n_trials", self.n_trials)
        check_int("batch", self.batch)
        check_int("keep", self.keep)
        named = isinstance(self.sampler, str) and self.sampler in SAMPLERS
        if not (named or isinstance(self.sampler, optuna.samplers.BaseSampler)):
            raise ValueError(f"sampler={self.sampler!r}; allowed: {', '.join(SAMPLERS)} or an optuna sampler instance")
        if self.storage is not None and not isinstance(self.storage, str):
            raise ValueError(f"storage={self.storage!r}; allowed: an Optuna storage URL such as 'sqlite:///study.db'")

    def create_study(self, problem: TuningProblem) -> optuna.Study:
        """A new study, or the stored one when ``storage`` and ``study_name`` name one."""
        self._validate()
        optuna.logging.set_verbosity(optuna.logging.WARNING)
        study = optuna.create_study(
            storage=self.storage,
            study_name=self.study_name,
            sampler=self._make_sampler(),
            direction="minimize",
            load_if_exists=self.storage is not None,
        )
        signature = problem_signature(problem)
        stored = study.user_attrs.get("problem")
        if stored is None:
            study.set_user_attr("problem", signature)
            study.set_user_attr("configs", list(problem.configs))
        elif stored != signature:
            raise ValueError(
                f"study {study.study_name!r} in {self.storage} was made for another problem (signature "
                f"{stored}, this one {signature}: different model, candidates or budget); "
                "use a new study_name"
            )
        return study

    def search(self, problem: TuningProblem) -> PolicyResult:
        t0 = time.perf_counter()
        self._validate()
        if self.storage is None and len(problem.configs) ** problem.n_buckets <= self.n_trials:
            return self._score_every_plan(problem, t0)
        study = self.create_study(problem)
        seeds = [problem.uniform(c)[0] for c in problem.baselines()]
        if problem.reference is not None:
            seeds.append(problem.uniform(problem.reference)[0])
        greedy = None
        if self.seed_with_greedy:
            greedy = GreedyPolicy(keep=self.keep).search(problem)
            seeds.extend(greedy.top(3))
        for s in seeds:
            study.enqueue_trial({_param(b): problem.configs[int(c)] for b, c in enumerate(s)})

        choices_space = list(problem.configs)
        index = {c: i for i, c in enumerate(choices_space)}
        # declaring the space up front lets the sampler draw a trial's parameters in one call
        space = {_param(b): optuna.distributions.CategoricalDistribution(choices_space)
                 for b in range(problem.n_buckets)}
        done = 0
        while done < self.n_trials:
            n = min(self.batch, self.n_trials - done)
            trials = [study.ask(space) for _ in range(n)]
            plans = np.array([_row(t.params, problem.n_buckets, index) for t in trials], dtype=np.int64)
            seconds = problem.predict(plans)
            errors = problem.fidelity_error(plans)
            for t, s, e in zip(trials, seconds, errors):
                t.set_constraint("fidelity", float(e - problem.budget))
                study.tell(t, float(s))
            done += n

        plans, seconds = _completed(study, problem, index)
        if greedy is not None:
            plans = np.concatenate([plans, np.array(greedy.top(self.keep))])
            seconds = np.concatenate([seconds, problem.predict(np.array(greedy.top(self.keep)))])
        return self._answer(problem, distinct_best(problem, plans, seconds, self.keep),
                            len(plans) + (greedy.evaluations if greedy else 0), t0, f"{self.n_trials} trials")

    def _score_every_plan(self, problem: TuningProblem, t0: float) -> PolicyResult:
        """The exact answer where the space is no larger than the trials asked for."""
        plans = np.array(list(itertools.product(range(len(problem.configs)), repeat=problem.n_buckets)),
                         dtype=np.int64)
        ranked = distinct_best(problem, plans, problem.predict(plans), self.keep)
        return self._answer(problem, ranked, len(plans), t0, f"all {len(plans)} plans")

    def _answer(self, problem: TuningProblem, ranked: list[np.ndarray], evaluations: int, t0: float,
                how: str) -> PolicyResult:
        best = ranked[0]
        predicted_s = float(problem.predict(best[None, :])[0])
        logging.getLogger("advisor.policies").info("optuna: %s in %.3f s, best %.2f ms", how,
                                                   time.perf_counter() - t0, predicted_s * 1e3)
        return PolicyResult(
            policy=self.name,
            choices=best,
            predicted_s=predicted_s,
            fidelity_error=float(problem.fidelity_error(best[None, :])[0]),
            evaluations=evaluations,
            seconds=time.perf_counter() - t0,
            ranked=ranked,
        )


def _completed(study: optuna.Study, problem: TuningProblem, index: dict[str, int]):
    """Every finished trial as a plan matrix, re-predicted (a resumed study's values may be stale)."""
    rows = []
    for t in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,)):
        try:
            rows.append(_row(t.params, problem.n_buckets, index))
        except KeyError:
            continue
    plans = np.array(rows, dtype=np.int64).reshape(-1, problem.n_buckets)
    return plans, problem.predict(plans)


def _row(params: dict, n_buckets: int, index: dict[str, int]) -> list[int]:
    # Trial.params deep-copies on every access: read it once per trial
    return [index[params[_param(b)]] for b in range(n_buckets)]
