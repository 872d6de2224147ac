"""Which fidelity measure predicts the accuracy trial: the gradient error or the update error.

On 2 local ranks, a bundled task (by default the text LM with AdamW, where the two measures
differ most) is profiled once for every config's size-weighted gradient error and update
error through the user's optimizer (:func:`profilers.fidelity.profile_fidelity`), then each
config trains from the same start in a paired accuracy trial against fp32.  Printed: each
config's two errors and its trial gap, and the Spearman rank correlation of each measure with
the gaps.  The search budgets the measure that ranks the gaps better (the gradient error by
default: ``policies.problem``).

Usage: python benchmarks/fidelity_measures.py [--task advisor.workloads:text_lm] [--max-steps 32]
"""

from __future__ import annotations

import argparse
import math
import time

from scipy.stats import spearmanr
from torch.nn.parallel import DistributedDataParallel as DDP

from advisor.runtime import Plan
from advisor.testbed.launch import launch_local
from advisor.testbed.workloads import build_workload
from advisor.tuning.accuracy import AccuracyTrial
from profilers.compute import ddp_buckets
from profilers.fidelity import profile_fidelity

CONFIGS = ["intquant(bits=8, packed=0)", "powersgd(rank=16)", "powersgd(rank=4)", "powersgd(rank=1)",
           "topk(ratio=0.01)", "randomk(ratio=0.1)"]


def fidelity_against_trial(rank: int, world: int, spec: str, configs: list, options: dict) -> dict:
    """Per config: the size-weighted gradient and update errors of the fidelity profile, and the
    trial's gap behind fp32 for that config everywhere (from the same fresh start)."""
    workload = build_workload(spec)
    ddp = DDP(workload.model)
    opt = workload.optimizer()
    buckets = ddp_buckets(ddp, workload.loss_fn, workload.batches[0])
    fidelity = profile_fidelity(ddp, workload.loss_fn, workload.batches, buckets, configs, optimizer=opt)
    sizes = {b.index: b.numel for b in buckets}
    total = sum(sizes.values())
    errors = {}
    for c in configs:
        entries = [e for e in fidelity.entries if e.config == c]
        errors[c] = (sum(e.relative_error * sizes[e.bucket] for e in entries) / total,
                     sum(e.update_error * sizes[e.bucket] for e in entries) / total)
    trial = AccuracyTrial(ddp, workload.loss_fn, workload.batches, opt, evaluate=workload.evaluator(), **options)
    trial.start()
    gaps = {}
    for c in configs:
        arm = trial.trial(c, Plan.uniform(c, warmup_steps=0))
        gaps[c] = arm.gap if arm.gap is not None else math.inf
    return {"errors": errors, "gaps": gaps, "optimizer": fidelity.optimizer, "steps": trial.report().steps}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--task", default="advisor.workloads:text_lm")
    parser.add_argument("--max-steps", type=int, default=32, help="the trial's steps an arm (at most)")
    args = parser.parse_args()
    t0 = time.perf_counter()
    options = {"time_budget_s": None, "max_steps": args.max_steps, "judge_unpowered": True}
    out = launch_local(fidelity_against_trial, 2, (args.task, CONFIGS, options), timeout=3600)[0]
    print(f"{args.task}, {out['optimizer']}, 2 ranks, trial of {out['steps']} steps an arm")
    print(f"{'config':28} {'gradient error':>15} {'update error':>13} {'trial gap':>10}")
    for c in CONFIGS:
        gradient, update = out["errors"][c]
        print(f"{c:28} {gradient:15.4g} {update:13.4g} {out['gaps'][c]:+10.2%}")
    gaps = [out["gaps"][c] for c in CONFIGS]
    for i, name in enumerate(("gradient error", "update error")):
        rho = float(spearmanr([out["errors"][c][i] for c in CONFIGS], gaps).statistic)
        print(f"Spearman with the trial gap, {name}: {rho:.2f}")
    print(f"({time.perf_counter() - t0:.0f} s; one adjacent swap of {len(CONFIGS)} configs moves Spearman by "
          f"{12 / (len(CONFIGS) * (len(CONFIGS) ** 2 - 1)):.2f})")


if __name__ == "__main__":
    main()
