"""What exchange-free arms save the accuracy trial, and whether they train what DDP trains.

Per row (task, link rate, ranks), one job on the emulated cluster runs the same accuracy
trial twice from the same weights and batches: its fp32 pair and its fp16 arm first on DDP
shadows (every gradient over the link), then exchange-free (every rank computes every
rank's gradients from the gathered batches; :mod:`advisor.tuning.exchange_free`).  It
prints, side by side, each arm's seconds per step both ways and their ratio, the largest
difference between the two ways' held-out curves (on two ranks the arithmetic is DDP's, so
it should be zero), and what :func:`advisor.tuning.exchange_free.exchange_free_pays`
would have chosen from a profile of the same job.

Usage: python benchmarks/exchange_free_trial.py [--tasks tlm,rnn,text] [--rates 100mbit,1gbit]
[--ranks 2] [--steps 40] [--out results.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from torch.nn.parallel import DistributedDataParallel as DDP

from advisor.perfmodel import PerformanceModel
from advisor.runtime import Plan
from advisor.testbed.emulated import run_ranks, unavailable_reason
from advisor.testbed.workloads import build_workload, shard
from advisor.tuning.accuracy import AccuracyTrial
from advisor.tuning.exchange_free import batch_bytes, exchange_free_pays
from policies import accuracy_gate as gate
from profilers.cluster import profile_cluster

TASKS = {"tlm": "benchmarks.time_to_accuracy:tlm_sgd", "rnn": "benchmarks.time_to_accuracy:rnn_sgd",
         "text": "advisor.workloads:text_lm_sgd", "conv": "benchmarks.time_to_accuracy:conv_sgd"}
ARMS = ("fp32", "fp32 (other order)", "fp16")


def _rank(rank: int, world: int, spec: str, steps: int, where: str) -> dict:
    workload = build_workload(spec)
    ddp = DDP(workload.model)
    opt = workload.optimizer()
    batches = shard(workload.batches, rank, world)
    profile = profile_cluster(ddp, workload.loss_fn, list(batches)[:4], opt, configs=["fp16"], note=where,
                              network_budget_s=15.0)
    pays, why = exchange_free_pays(PerformanceModel(profile), batch_bytes(list(batches)[0]))
    out = {"predicted_pays": pays, "why": why, "where": where}
    for free in (False, True):
        # a fixed length: a tolerance no trial this short can see keeps both trials from stopping early
        # judged by the held-out loss where the task has held-out batches: its cost is counted, not
        # timed, so both trials checkpoint at the same steps and their curves compare point by point
        judge = workload.judged_by()
        trial = AccuracyTrial(ddp, workload.loss_fn, batches, opt, max_steps=steps, min_steps=steps,
                              time_budget_s=None, tolerance=1e-6, exchange_free=free, **judge)
        t0 = time.perf_counter()
        report = trial.start()
        trial.trial("fp16", Plan.uniform("fp16", warmup_steps=0), gate.SIXTEEN_BIT)
        out["free" if free else "real"] = {
            "seconds": time.perf_counter() - t0, "steps": report.steps, "checkpoints": report.checkpoints,
            "arms": {a.label: {"values": a.values, "seconds": a.seconds} for a in report.arms}}
    return out if rank == 0 else {}


def row(task: str, rate: str, ranks: int, steps: int) -> dict:
    t0 = time.perf_counter()
    out = run_ranks(_rank, ranks, lambda where: (TASKS[task], steps, where), rate=rate, timeout=3600)[0]
    real, free = out["real"], out["free"]
    arms = {}
    same_checkpoints = real["checkpoints"] == free["checkpoints"]
    for label in ARMS:
        r, f = real["arms"][label], free["arms"][label]
        worst = (max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(f["values"], r["values"]))
                 if same_checkpoints else None)  # values at different steps do not compare
        arms[label] = {"real_s_per_step": r["seconds"] / real["steps"], "free_s_per_step": f["seconds"] / free["steps"],
                       "largest_difference": worst}
    return {"task": task, "rate": rate, "ranks": ranks, "steps": real["steps"], "arms": arms,
            "trial_s": {"real": real["seconds"], "free": free["seconds"]}, "predicted_pays": out["predicted_pays"],
            "why": out["why"], "wall_s": time.perf_counter() - t0}


def show(r: dict) -> None:
    print(f"{r['task']:5} {r['rate']:8} x{r['ranks']}  {r['steps']} steps an arm; trial (fp32 pair + fp16) "
          f"{r['trial_s']['real']:.0f} s over the link, {r['trial_s']['free']:.0f} s exchange-free "
          f"({r['trial_s']['real'] / r['trial_s']['free']:.2f}x); exchange_free_pays: {r['predicted_pays']} ({r['why']})")
    for label, a in r["arms"].items():
        print(f"    {label:20} s/step (evaluation included): {a['real_s_per_step']:.3f} over the link, "
              f"{a['free_s_per_step']:.3f} exchange-free ({a['real_s_per_step'] / a['free_s_per_step']:.2f}x); "
              + (f"curves differ by at most {a['largest_difference']:.2e} (relative)"
                 if a["largest_difference"] is not None else "the two trials checkpointed at different steps"))
    sys.stdout.flush()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", default="tlm,rnn,text")
    parser.add_argument("--rates", default="100mbit,1gbit")
    parser.add_argument("--ranks", default="2")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    reason = unavailable_reason()
    if reason:
        print(f"skipped: the emulated cluster is unavailable ({reason})")
        return 0
    rows = []
    for ranks in (int(n) for n in args.ranks.split(",")):
        for rate in args.rates.split(","):
            for task in args.tasks.split(","):
                rows.append(row(task, rate, ranks, args.steps))
                show(rows[-1])
                if args.out:
                    with open(args.out, "w") as f:
                        json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
