"""Cost of the hook itself: a 2-rank gloo training step with plan ``none`` vs DDP with no hook.

Run:  .venv/bin/python benchmarks/hook_overhead.py [--steps 30] [--rounds 6]

All DDP models live in the same processes and the same process group, and take turns step
by step (A B C, B C A, ...), so drift on this shared machine hits them alike.
The model is BACKGROUND.md's 5.3M-parameter MLP (1024-2048-1024-1024-10, batch 64), one
thread a rank, over loopback.  Target: median hooked step / median plain step <= 1.03.
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
    times = {"plain": [], "hooked": [], "torch": []}
    models = {"plain": plain, "hooked": hooked, "torch": torch_hook}

    def block(model, key, n):
        for _ in range(n):
            t0 = time.perf_counter()
            model.zero_grad(set_to_none=True)
            nn.functional.cross_entropy(model(x), y).backward()
            times[key].append(time.perf_counter() - t0)

    for model in models.values():  # warm-up, including DDP's bucket rebuild
        for _ in range(5):
            model.zero_grad(set_to_none=True)
            nn.functional.cross_entropy(model(x), y).backward()
    keys = list(models)
    for i in range(rounds * steps):
        # one step of each model in turn, the order rotating: drift hits all alike
        for key in keys[i % 3 :] + keys[: i % 3]:
            block(models[key], key, 1)
    return times


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40, help="steps a round")
    parser.add_argument("--rounds", type=int, default=5, help="rounds (steps x rounds timed steps a model)")
    args = parser.parse_args(argv)
    plan = Plan.uniform("none", warmup_steps=0)
    results = launch_local(_rank, 2, (args.steps, args.rounds, plan.to_json()), timeout=900)
    plain = statistics.median(t for r in results for t in r["plain"])
    hooked = statistics.median(t for r in results for t in r["hooked"])
    torch_hooked = statistics.median(t for r in results for t in r["torch"])
    ratio = hooked / plain
    print(f"2 ranks, gloo, loopback, MLP 5.3M params, batch 64, {args.rounds * args.steps} interleaved steps each, 1 thread a rank")
    print(f"DDP, no hook       : {plain * 1e3:7.2f} ms/step (median)")
    print(f"DDP + plan 'none'  : {hooked * 1e3:7.2f} ms/step (median)")
    print(f"DDP + PyTorch's allreduce_hook (reference): {torch_hooked * 1e3:7.2f} ms/step (median)")
    print(f"ratio hooked/plain : {ratio:.3f} (target <= 1.03) {'PASS' if ratio <= 1.03 else 'FAIL'}")
    print(f"ratio PyTorch allreduce_hook/plain: {torch_hooked / plain:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
