"""Cost of the hook itself: a 2-rank gloo training step with plan ``none`` vs DDP with no hook.

Run:  .venv/bin/python benchmarks/hook_overhead.py [--steps 30] [--rounds 6]

All DDP models live in the same processes and the same process group, and take turns step
by step (A B C, B C A, ...), so drift on this shared machine hits them alike.
The model is BACKGROUND.md's 5.3M-parameter MLP (1024-2048-1024-1024-10, batch 64), one
thread a rank, over loopback.  A training step is zero_grad, forward, backward and an SGD
step with momentum; the ratio of forward+backward alone (the part the hook touches, timed
within the same steps) is printed too, as the stricter view.
Target: median hooked training step / median plain training step <= 1.03.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

from advisor import workloads
from advisor.launch import launch_local
from advisor.runtime import Plan, install


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return workloads.mlp().model


def _rank(rank: int, world_size: int, steps: int, rounds: int, plan_json: str):
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    plain = DDP(mlp())
    hooked = DDP(mlp())
    install(hooked, Plan.from_json(plan_json))
    torch_hook = DDP(mlp())
    torch_hook.register_comm_hook(None, allreduce_hook)
    x = torch.randn(64, 1024)
    y = torch.randint(0, 10, (64,))
    models = {"plain": plain, "hooked": hooked, "torch": torch_hook}
    optimizers = {key: torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9) for key, m in models.items()}
    times = {key: [] for key in models}  # whole training steps
    backward = {key: [] for key in models}  # zero_grad, forward and backward of the same steps

    def step(key):
        model, optimizer = models[key], optimizers[key]
        t0 = time.perf_counter()
        model.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(model(x), y).backward()
        t1 = time.perf_counter()
        optimizer.step()
        t2 = time.perf_counter()
        backward[key].append(t1 - t0)
        times[key].append(t2 - t0)

    for key in models:  # warm-up, including DDP's bucket rebuild
        for _ in range(5):
            step(key)
    for key in models:
        times[key].clear()
        backward[key].clear()
    keys = list(models)
    for i in range(rounds * steps):
        # one step of each model in turn, the order rotating: drift hits all alike
        for key in keys[i % 3 :] + keys[: i % 3]:
            step(key)
    return {"step": times, "backward": backward}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40, help="steps a round")
    parser.add_argument("--rounds", type=int, default=5, help="rounds (steps x rounds timed steps a model)")
    args = parser.parse_args(argv)
    plan = Plan.uniform("none", warmup_steps=0)
    results = launch_local(_rank, 2, (args.steps, args.rounds, plan.to_json()), timeout=900)
    def median(part, key):
        return statistics.median(t for r in results for t in r[part][key])

    print(f"2 ranks, gloo, loopback, MLP 5.3M params, batch 64, {args.rounds * args.steps} interleaved steps each, 1 thread a rank")
    print(f"{'ms (median)':24s} {'training step':>14s} {'forward+backward':>17s}")
    for key, label in (("plain", "DDP, no hook"), ("hooked", "DDP + plan 'none'"),
                       ("torch", "DDP + PyTorch's allreduce_hook")):
        print(f"{label:24s} {median('step', key) * 1e3:14.2f} {median('backward', key) * 1e3:17.2f}")
    ratio = median("step", "hooked") / median("step", "plain")
    print(f"ratio hooked/plain, training step: {ratio:.3f} (target <= 1.03) {'PASS' if ratio <= 1.03 else 'FAIL'}; "
          f"forward+backward alone: {median('backward', 'hooked') / median('backward', 'plain'):.3f}")
    print(f"ratio PyTorch allreduce_hook/plain, training step: {median('step', 'torch') / median('step', 'plain'):.3f}; "
          f"forward+backward alone: {median('backward', 'torch') / median('backward', 'plain'):.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
