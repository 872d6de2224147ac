"""A training script for torchrun, with the advisor in one of two forms.

    torchrun --nproc_per_node 2 examples/train_torchrun.py --model cnn --mode autotune
    torchrun --nproc_per_node 2 examples/train_torchrun.py --model embedding_heavy --mode wrap

``--mode autotune``: one call before training profiles, searches, proves and installs a plan.
``--mode wrap``: the loop stays exactly as it is; the advisor tunes during the first steps
and keeps watching the compression gain, backing off when it drops.
``--plan PLAN.json``: install a plan made earlier (``advisor tune``).
"""

import argparse
import logging

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import advisor
from examples import models


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="cnn", choices=["cnn", "transformer_lm", "embedding_heavy"])
    parser.add_argument("--mode", default="autotune", choices=["autotune", "wrap", "none"])
    parser.add_argument("--plan", default=None)
    parser.add_argument("--steps", type=int, default=60)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")

    dist.init_process_group("gloo")  # "nccl" on GPUs
    torch.manual_seed(0)
    workload = getattr(models, args.model)()
    ddp = DDP(workload.model)
    optimizer = workload.optimizer()
    batches = list(workload.batches)

    tuner = None
    if args.plan:
        advisor.install(ddp, args.plan)
    elif args.mode == "autotune":
        result = advisor.autotune(ddp, workload.loss_fn, batches, optimizer)
        if dist.get_rank() == 0:
            result.render()
    elif args.mode == "wrap":
        tuner = advisor.wrap(ddp, optimizer)

    for step in range(args.steps):
        optimizer.zero_grad()
        loss = workload.loss_fn(ddp, batches[step % len(batches)])
        loss.backward()
        optimizer.step()
        if dist.get_rank() == 0 and step % 10 == 0:
            print(f"step {step}: loss {loss.item():.4f}")
    if tuner is not None and dist.get_rank() == 0:
        for event in tuner.events:
            print(f"advisor, step {event.step}: {event.what}: {event.detail}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
