"""Cost of the fidelity monitor: a 2-rank gloo training step under a plan, with and without it.

Run:  .venv/bin/python benchmarks/fidelity_monitor.py [--steps 20] [--rounds 5] [--sample 2048]

Two DDP models of the same task and plan live in the same processes; one has a
:class:`~advisor.runtime.monitor.FidelityMonitor` on its hook (sampling ``--sample``
coordinates, one all-reduce a window of 25 steps).  The same again sharded (``fully_shard`` as
the workload shards it, the plan's reduce-scatter on every group) with a
:class:`~advisor.runtime.sharded_monitor.ShardedFidelityMonitor`.  They take turns step by step (A B, B A,
...), so drift on this shared machine hits both alike.  The noise of the measurement is
printed beside the ratio: the same comparison between two models without a monitor.
Tasks: the seed study's 5.3M-parameter MLP (DDP only) and the bundled text LM (momentum SGD),
one thread a rank, over loopback.  Target: monitored / plain median step <= 1.01.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from advisor.runtime import FidelityMonitor, Plan, install
from advisor.runtime.sharded import install_sharded
from advisor.runtime.sharded_monitor import ShardedFidelityMonitor
from advisor.testbed import workloads
from advisor.testbed.launch import launch_local

TASKS = {"mlp 5.3M": workloads.mlp, "text LM": workloads.text_lm_sgd}
PLANS = ("fp16", "powersgd(rank=4)")


def _rank(rank: int, world_size: int, steps: int, rounds: int, sample: int):
    torch.set_num_threads(1)
    rows = []
    for task, factory, mode, label in [(t, f, m, p) for t, f in TASKS.items() for m in ("ddp", "sharded")
                                       for p in PLANS]:
        models, monitors, optimizers = {}, {}, {}
        for kind in ("plain", "monitored", "plain again"):
            torch.manual_seed(0)
            workload = factory()
            plan = Plan.uniform(label, warmup_steps=0)
            if mode == "sharded" and workload.shard is None:
                break  # the task does not train sharded
            if mode == "sharded":
                ddp = workload.model
                workload.shard(ddp)
                groups = install_sharded(ddp, plan)
                if kind == "monitored":
                    monitors[kind] = ShardedFidelityMonitor(groups, sample=sample)
            else:
                ddp = DDP(workload.model)
                hook = install(ddp, plan)
                if kind == "monitored":
                    monitors[kind] = FidelityMonitor(hook, list(ddp.module.named_parameters()), sample=sample)
            if kind == "monitored":
                monitors[kind].start()
            models[kind] = (ddp, workload)
            optimizers[kind] = torch.optim.SGD(ddp.parameters(), lr=1e-3, momentum=0.9)
        if not models:
            continue
        batches = list(workloads.shard(workload.batches, rank, world_size))
        times = {kind: [] for kind in models}
        order = list(models)
        readings = 0
        for r in range(rounds):
            for i in range(steps):
                for kind in order[r % 3:] + order[: r % 3]:
                    ddp, workload = models[kind]
                    t0 = time.perf_counter()  # the window's reading (an all-reduce every 25 steps) counts
                    if kind in monitors:
                        readings += monitors[kind].step_ends() is not None
                    optimizers[kind].zero_grad()
                    workload.loss_fn(ddp, batches[i % len(batches)]).backward()
                    optimizers[kind].step()
                    if i >= 2:  # the first steps of a round warm caches and DDP's buckets
                        times[kind].append(time.perf_counter() - t0)
        median = {k: statistics.median(v) for k, v in times.items()}
        mean = {k: statistics.fmean(v) for k, v in times.items()}
        rows.append({"task": task, "mode": mode, "plan": label, "median_ms": {k: 1e3 * v for k, v in median.items()},
                     "ratio": median["monitored"] / median["plain"],
                     # the mean carries the window's reading (one step in 25), which the median leaves out
                     "mean_ratio": mean["monitored"] / mean["plain"],
                     "noise": median["plain again"] / median["plain"], "readings": readings})
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--sample", type=int, default=2048)
    args = parser.parse_args(argv)
    rows = launch_local(_rank, 2, (args.steps, args.rounds, args.sample), timeout=3600)[0]
    print(f"fidelity monitor ({args.sample} sampled coordinates, window 25), 2 ranks, loopback; "
          f"{args.rounds} rounds x {args.steps} steps, alternating")
    print(f"{'task':10} {'mode':8} {'plan':18} {'plain ms':>9} {'monitored':>10} {'ratio':>7} {'mean':>7} "
          f"{'noise':>7} {'readings':>8}")
    worst = 0.0
    for row in rows:
        ms = row["median_ms"]
        print(f"{row['task']:10} {row['mode']:8} {row['plan']:18} {ms['plain']:9.1f} {ms['monitored']:10.1f} "
              f"{row['ratio']:7.3f} {row['mean_ratio']:7.3f} "
              f"{row['noise']:7.3f} {row['readings']:8d}")
        worst = max(worst, row["ratio"])
    print(f"worst ratio {worst:.3f} (target <= 1.01); 'mean': the ratio of mean steps, the windows' readings "
          "included; 'noise' is a second plain model against the first (medians)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
