"""How sure a paired accuracy trial can be: fp32 in several batch orders next to lossy plans.

Trains, on 2 local ranks from the same start, fp32 in four batch orders (A-D) and, in order
A, PowerSGD rank 8 and rank 1, bf16 and fp16, evaluating every few steps on held-out text.
Then, at growing trial lengths, prints:

* for every pair of fp32 runs, the smallest gap a trial with that pair as its noise arms could
  detect (:func:`policies.evidence.trial_noise`, 80% power at 5%), and how far apart the pair
  ends at the last checkpoint: the noise of the measurement itself;
* for every plan, its mean late gap behind fp32 A, its step efficiency read from A's curve,
  and the verdict a trial with the A-B pair would give (tolerance 1%).

Usage: python benchmarks/trial_noise.py [--task advisor.workloads:text_lm] [--optimizer adamw|sgd]
[--steps 400] [--every 5] [--out curves.json]
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import sys
import time

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from advisor.runtime import Plan, install
from advisor.testbed.launch import launch_local
from advisor.testbed.workloads import build_workload
from advisor.tuning.accuracy import evaluate_on_every_rank
from advisor.tuning.live import shadow_ddp
from policies import accuracy_gate as gate
from policies import evidence as ev
from profilers.training_state import clone_optimizer

ARMS = [("fp32 A", None, 0), ("fp32 B", None, 1), ("fp32 C", None, 2), ("fp32 D", None, 3),
        ("powersgd(rank=8)", "powersgd(rank=8)", 0), ("powersgd(rank=1)", "powersgd(rank=1)", 0),
        ("bf16", "bf16", 0), ("fp16", "fp16", 0)]
OPTIMIZERS = {"adamw": lambda p: torch.optim.AdamW(p, lr=2e-3, weight_decay=0.01),
              "sgd": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9)}


def curves(rank: int, world: int, task: str, optimizer: str, steps: int, every: int) -> dict:
    """Every arm's held-out curve (mean over ranks), each rank on its own shard of the batches."""
    torch.manual_seed(0)
    workload = build_workload(task)
    ddp = DDP(workload.model)
    opt = OPTIMIZERS[optimizer](ddp.module.parameters())
    batches = list(workload.batches)[rank::world]
    evaluate = workload.evaluator()
    out = {}
    for name, config, seed in ARMS:
        order = list(range(len(batches)))
        if seed:
            random.Random(seed).shuffle(order)
        model = shadow_ddp(ddp)
        arm_opt = clone_optimizer(opt, ddp.module, model.module)
        hook = install(model, Plan.uniform(config, warmup_steps=0)) if config else None
        t0 = time.perf_counter()
        values = [evaluate_on_every_rank(evaluate, [model.module], workload.metric)[0][workload.metric]]
        for step in range(steps):
            arm_opt.zero_grad(set_to_none=True)
            workload.loss_fn(model, batches[order[step % len(order)]]).backward()
            arm_opt.step()
            if (step + 1) % every == 0:
                values.append(evaluate_on_every_rank(evaluate, [model.module], workload.metric)[0][workload.metric])
        if hook is not None:
            hook.close()
        out[name] = values
        if rank == 0:
            print(f"  {name}: {values[0]:.4f} -> {values[-1]:.4f} in {time.perf_counter() - t0:.0f} s", flush=True)
    return out


def report(arms: dict[str, list[float]], every: int, tolerance: float = gate.DEFAULT_TOLERANCE) -> None:
    fp32 = [k for k in arms if k.startswith("fp32")]
    n = len(arms[fp32[0]])
    for upto in (8, 16, 24, 32, 48, 64, 80, 120, 160):
        if upto >= n:
            break
        steps = [i * every for i in range(upto + 1)]
        pairs = []
        for a, b in itertools.combinations(fp32, 2):
            noise = ev.trial_noise(steps, arms[a][: upto + 1], arms[b][: upto + 1], False)
            final = ev.signed_relative([arms[b][upto]], [arms[a][upto]], False)[0]
            pairs.append(f"{a[-1]}{b[-1]} {noise.detectable:.2%} (ends {final:+.2%})")
        print(f"{steps[-1]:5d} steps  detectable by pair: " + ", ".join(pairs))
        ref = arms["fp32 A"][: upto + 1]
        noise = ev.trial_noise(steps, ref, arms["fp32 B"][: upto + 1], False)
        kappa, kappa_se = ev.elasticity(steps, ref, False)
        powered = gate.powered(noise.detectable, tolerance, steps[-1], len(ev.late_window(steps))) and kappa > 0
        for plan in (k for k in arms if not k.startswith("fp32")):
            values = arms[plan][: upto + 1]
            gap = ev.mean_gap(steps, values, ref, False)
            efficiency = ev.step_efficiency(gap, noise.se, kappa, kappa_se)
            kind = gate.SIXTEEN_BIT if plan in ("bf16", "fp16") else gate.CANDIDATE
            verdict = gate.judge(plan, kind, gap, noise.se, tolerance, is_powered=powered)
            print(f"             {plan:18s} gap {gap:+.2%}, efficiency "
                  f"{efficiency.describe() if efficiency else '-'}: {verdict.status}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--task", default="advisor.workloads:text_lm")
    parser.add_argument("--optimizer", choices=sorted(OPTIMIZERS), default="adamw")
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--every", type=int, default=5)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    print(f"{args.task} with {args.optimizer}, {args.steps} steps, 2 ranks over loopback:")
    arms = launch_local(curves, 2, (args.task, args.optimizer, args.steps, args.every), timeout=7200)[0]
    if args.out:
        with open(args.out, "w") as fh:
            json.dump({"every": args.every, "arms": arms}, fh)
    report(arms, args.every)
    return 0


if __name__ == "__main__":
    sys.exit(main())
