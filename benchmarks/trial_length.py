"""How a lossy plan's verdict moves with the accuracy trial's length: one long trial, judged at every prefix.

On 2 local ranks, one :class:`~advisor.tuning.accuracy.AccuracyTrial` of a ``time_to_accuracy.py``
task trains its fp32 pair (two batch orders) and each plan for ``--steps`` steps, checkpointed as
a real trial checkpoints (its tolerance set out of reach so that power does not end it, and
plans trained even unpowered).  Then, for every prefix of those checkpoints, as if the trial had
stopped there: the smallest gap it could detect, whether it was powered, and per plan its mean
late gap, the slope of that gap in ln(step) (with its standard error), the gap carried to the
run's length (``--horizon``), and the verdict at the default 1% tolerance.  The rows at and past
:func:`policies.evidence.steps_to_extrapolate` are where a powered trial may now stop.

Usage: python benchmarks/trial_length.py [--task text] [--optimizer sgd] [--steps 300]
[--plans "powersgd(rank=16),fp16"] [--horizon 30000] [--out curves.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from advisor.runtime import Plan
from advisor.testbed.launch import launch_local
from policies import accuracy_gate as gate
from policies import evidence as ev


def trial_curves(rank: int, world: int, task: str, optimizer: str, steps: int, plans: list[str]) -> dict:
    """The trial's checkpoints and every arm's held-out curve (mean over ranks)."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import time_to_accuracy

    from advisor.testbed.workloads import shard
    from advisor.tuning.accuracy import AccuracyTrial

    torch.manual_seed(0)
    workload = getattr(time_to_accuracy, f"{task}_{optimizer}")()
    ddp = DDP(workload.model)
    trial = AccuracyTrial(ddp, workload.loss_fn, shard(workload.batches, rank, world), workload.optimizer(ddp.module),
                          held_out=workload.held_out, tolerance=1e-4, max_steps=steps, time_budget_s=None,
                          judge_unpowered=True, arms_expected=2 + len(plans))
    trial.start()
    for label in plans:
        trial.trial(label, Plan.uniform(label), gate.SIXTEEN_BIT if label in ("fp16", "bf16") else gate.CANDIDATE)
    report = trial.report()
    return {"checkpoints": report.checkpoints, "curves": {a.label: a.values for a in report.arms},
            "kinds": {a.label: a.kind for a in report.arms}}


def verdicts_by_length(data: dict, horizon: int, tolerance: float = gate.DEFAULT_TOLERANCE) -> list[dict]:
    """Per prefix of the checkpoints: the trial's noise and power, and every plan's gap, growth and verdict."""
    checkpoints, curves = data["checkpoints"], data["curves"]
    ref, other = curves["fp32"], curves["fp32 (other order)"]
    rows = []
    for k in range(4, len(checkpoints)):
        steps = checkpoints[: k + 1]
        noise = ev.trial_noise(steps, ref[: k + 1], other[: k + 1], False, 0.0005)
        powered = gate.powered(noise.detectable, tolerance, steps[-1], len(ev.late_window(steps)))
        row = {"steps": steps[-1], "detectable": noise.detectable, "powered": powered, "plans": {}}
        for label, curve in curves.items():
            if data["kinds"][label] in (gate.REFERENCE, gate.NOISE):
                continue
            gap = ev.mean_gap(steps, curve[: k + 1], ref[: k + 1], False)
            slope, slope_se = ev.gap_growth(steps, curve[: k + 1], ref[: k + 1], False)
            carried = ev.gap_at_horizon(gap, slope, slope_se, steps[-1], horizon)
            verdict = gate.judge(label, data["kinds"][label], gap, noise.se, tolerance, is_powered=powered,
                                 horizon_gap=carried, horizon=horizon)
            row["plans"][label] = {"gap": gap, "slope": slope, "slope_se": slope_se, "carried": carried,
                                   "status": verdict.status, "bound": verdict.bound}
        rows.append(row)
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--task", default="text")
    parser.add_argument("--optimizer", default="sgd")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--plans", default="powersgd(rank=16),fp16")
    parser.add_argument("--horizon", type=int, default=30_000)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    plans = [p.strip() for p in args.plans.split(",") if p.strip()]
    data = launch_local(trial_curves, 2, (args.task, args.optimizer, args.steps, plans), timeout=7200)[0]
    if args.out:
        with open(args.out, "w") as f:
            json.dump(data, f)
    rows = verdicts_by_length(data, args.horizon)
    print(f"{args.task}, {args.optimizer}: verdicts at 1% had the trial stopped at each checkpoint; growth carried to "
          f"step {args.horizon}; a powered trial now goes on to {ev.steps_to_extrapolate(args.horizon)} steps")
    print("| steps | detectable | powered | " + " | ".join(f"{p}: gap, slope/ln(step) (se), carried, verdict (bound)"
                                                     for p in rows[0]["plans"]) + " |")
    print("|---|---|---|" + "---|" * len(rows[0]["plans"]))
    for row in rows:
        cells = [f"{v['gap']:+.2%}, {v['slope'] * 100:+.3f}% ({v['slope_se'] * 100:.3f}), {v['carried']:+.2%}, "
                 f"{v['status']} ({v['bound']:+.2%})" for v in row["plans"].values()]
        print(f"| {row['steps']} | {row['detectable']:.2%} | {'yes' if row['powered'] else 'no'} | "
              + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
