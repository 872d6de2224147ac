"""Cost of the hook itself: plan ``none`` vs DDP with no hook, and plan ``fp16`` vs PyTorch's fp16 hook.

Run:  .venv/bin/python benchmarks/hook_overhead.py [--steps 30] [--rounds 6]

All DDP models live in the same processes and the same process group, and take turns step
by step (A B C, B C A, ...), so drift on this shared machine hits them alike.  Each option
that changes the hook's path (``gradient_as_bucket_view``, ``static_graph``, bf16 weights)
gets its own plain and hooked pair in the same rotation.
The model is the seed study's 5.3M-parameter MLP (1024-2048-1024-1024-10, batch 64), one
thread a rank, over loopback.  A training step is zero_grad, forward, backward and an SGD
step with momentum; the ratio of forward+backward alone (the part the hook touches, timed
within the same steps) is printed too, as the stricter view.
A second plain DDP model in the same rotation gives the noise of the comparison itself, and
the plan ``fp16`` runs beside PyTorch's ``fp16_compress_hook``.
Target: median hooked training step / median plain training step <= 1.03, and the fp16 plan
no slower than PyTorch's fp16 hook beyond the noise.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

from advisor.runtime import Plan, install
from advisor.testbed import workloads
from advisor.testbed.launch import launch_local

#: the options that change the hook's path, each measured plain and hooked: (DDP kwargs, weight dtype)
OPTIONS = {
    "default": ({}, torch.float32),
    "gradient_as_bucket_view": ({"gradient_as_bucket_view": True}, torch.float32),
    "static_graph": ({"static_graph": True}, torch.float32),
    "bf16 weights": ({}, torch.bfloat16),
}


def mlp(dtype=torch.float32) -> nn.Module:
    torch.manual_seed(0)
    return workloads.mlp().model.to(dtype)


def _rank(rank: int, world_size: int, steps: int, rounds: int, plan_json: str, options: list[str]):
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook, fp16_compress_hook

    models, dtypes = {}, {}
    for option in options:
        kwargs, dtype = OPTIONS[option]
        models[(option, "plain")] = DDP(mlp(dtype), **kwargs)
        models[(option, "hooked")] = DDP(mlp(dtype), **kwargs)
        install(models[(option, "hooked")], Plan.from_json(plan_json))
        dtypes[option] = dtype
    models[("default", "torch")] = DDP(mlp())
    models[("default", "torch")].register_comm_hook(None, allreduce_hook)
    models[("default", "plain again")] = DDP(mlp())  # the noise: the same setting twice
    models[("default", "fp16 plan")] = DDP(mlp())
    install(models[("default", "fp16 plan")], Plan.uniform("fp16", warmup_steps=0))
    models[("default", "torch fp16")] = DDP(mlp())
    models[("default", "torch fp16")].register_comm_hook(None, fp16_compress_hook)
    x = torch.randn(64, 1024)
    y = torch.randint(0, 10, (64,))
    optimizers = {key: torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9) for key, m in models.items()}
    times = {key: [] for key in models}  # whole training steps
    backward = {key: [] for key in models}  # zero_grad, forward and backward of the same steps

    def step(key):
        model, optimizer = models[key], optimizers[key]
        t0 = time.perf_counter()
        model.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(model(x.to(dtypes[key[0]])).float(), y).backward()
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
        for key in keys[i % len(keys):] + keys[: i % len(keys)]:
            step(key)
    return {"step": {"/".join(k): v for k, v in times.items()}, "backward": {"/".join(k): v for k, v in backward.items()}}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40, help="steps a round")
    parser.add_argument("--rounds", type=int, default=5, help="rounds (steps x rounds timed steps a model)")
    parser.add_argument("--options", default=",".join(OPTIONS), help=f"subset of {', '.join(OPTIONS)}")
    args = parser.parse_args(argv)
    options = [o for o in args.options.split(",") if o]
    unknown = sorted(set(options) - set(OPTIONS))
    if unknown or "default" not in options:
        parser.error(f"--options {unknown or args.options}: allowed {', '.join(OPTIONS)}, 'default' included")
    plan = Plan.uniform("none", warmup_steps=0)
    results = launch_local(_rank, 2, (args.steps, args.rounds, plan.to_json(), options), timeout=1800)

    def median(part, key):
        return statistics.median(t for r in results for t in r[part][key])

    print(f"2 ranks, gloo, loopback, MLP 5.3M params, batch 64, {args.rounds * args.steps} interleaved steps each "
          f"of {len(results[0]['step'])} models, 1 thread a rank")
    print(f"{'ms (median)':46s} {'training step':>14s} {'forward+backward':>17s} {'hooked/plain':>13s}")
    for option in options:
        for kind, label in (("plain", "DDP, no hook"), ("plain again", "DDP, no hook (again: the noise)"),
                            ("hooked", "DDP + plan 'none'"), ("torch", "DDP + PyTorch's allreduce_hook"),
                            ("fp16 plan", "DDP + plan 'fp16'"), ("torch fp16", "DDP + PyTorch's fp16 hook")):
            key = f"{option}/{kind}"
            if key not in results[0]["step"]:
                continue
            ratio = median("step", key) / median("step", f"{option}/plain")
            print(f"{option + ', ' + label:46s} {median('step', key) * 1e3:14.2f} "
                  f"{median('backward', key) * 1e3:17.2f} {ratio:13.3f}")
    ratio = median("step", "default/hooked") / median("step", "default/plain")
    print(f"ratio hooked/plain, training step: {ratio:.3f} (target <= 1.03) {'PASS' if ratio <= 1.03 else 'FAIL'}; "
          f"forward+backward alone: {median('backward', 'default/hooked') / median('backward', 'default/plain'):.3f}")
    print(f"ratio PyTorch allreduce_hook/plain, training step: "
          f"{median('step', 'default/torch') / median('step', 'default/plain'):.3f}; forward+backward alone: "
          f"{median('backward', 'default/torch') / median('backward', 'default/plain'):.3f}")
    noise = median("step", "default/plain again") / median("step", "default/plain")
    print(f"noise: the same plain DDP twice, training step: {noise:.3f}; forward+backward alone: "
          f"{median('backward', 'default/plain again') / median('backward', 'default/plain'):.3f}")
    fp16 = median("step", "default/fp16 plan") / median("step", "default/torch fp16")
    print(f"ratio plan 'fp16'/PyTorch's fp16 hook, training step: {fp16:.3f} (noise {abs(noise - 1):.3f}: "
          f"{'inside it' if abs(fp16 - 1) <= abs(noise - 1) else 'beyond it'}); forward+backward alone: "
          f"{median('backward', 'default/fp16 plan') / median('backward', 'default/torch fp16'):.3f}")
    for option in options[1:]:
        print(f"ratio hooked/plain with {option}: "
              f"{median('step', f'{option}/hooked') / median('step', f'{option}/plain'):.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
