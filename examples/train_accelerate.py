"""Hugging Face Accelerate on 2 CPU processes with the compression advisor after prepare.

    accelerate launch --multi_gpu --num_processes 2 examples/train_accelerate.py             # autotune
    accelerate launch --multi_gpu --num_processes 2 examples/train_accelerate.py --mode wrap
    accelerate launch --multi_gpu --num_processes 2 examples/train_accelerate.py --plan plan.json

``--multi_gpu`` with ``Accelerator(cpu=True)`` gives N CPU processes on gloo (drop ``cpu=True``
on GPUs).
"""

import argparse

import torch
from accelerate import Accelerator

from advisor.integrations import accelerate as compression
from examples import models


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", default="autotune", choices=["autotune", "wrap"])
    parser.add_argument("--plan", default=None)
    parser.add_argument("--steps", type=int, default=60)
    args = parser.parse_args()
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=1)
    torch.manual_seed(0)
    workload = models.cnn()
    model, optimizer = accelerator.prepare(workload.model, workload.optimizer())
    batches = list(workload.batches)

    tuner = None
    if args.plan:
        hook = compression.install(accelerator, model, args.plan)
        if accelerator.is_main_process:
            print(f"plan in use: {', '.join(sorted({c.label for c in hook.plan.configs()}))}")
    elif args.mode == "autotune":
        result, _ = compression.autotune(accelerator, model, workload.loss_fn, batches, optimizer)
        if accelerator.is_main_process:
            result.render()
    else:
        tuner = compression.wrap(accelerator, model, optimizer)

    for step in range(args.steps):
        with accelerator.accumulate(model):
            loss = workload.loss_fn(model, batches[step % len(batches)])
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
        if tuner is not None:
            tuner.record_loss(loss)
        if accelerator.is_main_process and step % 10 == 0:
            print(f"step {step}: loss {loss.item():.4f}")
    if tuner is not None and accelerator.is_main_process:
        for event in tuner.events:
            print(f"advisor, step {event.step}: {event.what}: {event.detail}")


if __name__ == "__main__":
    main()
