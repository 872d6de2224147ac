"""Real Accelerate training on 2 CPU processes (``accelerate launch --multi_gpu --num_processes 2``).

One Accelerator (bf16 autocast, gradient accumulation over 2 batches) trains the same seeded
model several times: plain DDP, plan ``none`` (must be bitwise DDP), a plan mixing the
compressor families with a save_state / load_state round trip, autotune, and wrap.  Every rank
writes ``OUT_DIR/rank<r>.json``.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import traceback

import torch
import torch.nn as nn
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.utils import set_seed
from common import data  # this script's own folder

from advisor.integrations import accelerate as compression
from advisor.runtime import Plan

STEPS = 16
FAMILIES = ["fp16", "powersgd(rank=2)", "topk(ratio=0.1)", "intquant(bits=8)", "bf16", "signsgd"]


def model() -> nn.Module:
    return nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4))


def loss_fn(net, batch):
    x, y = batch
    return F.cross_entropy(net(x), y)


def digest(net) -> str:
    h = hashlib.sha256()
    for p in net.parameters():
        h.update(p.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


def train(accelerator: Accelerator, how: str, state_dir: str) -> dict:
    set_seed(0)
    net = model()
    opt = torch.optim.AdamW(net.parameters(), lr=3e-3)
    net, opt, loader = accelerator.prepare(net, opt, data())
    out: dict = {"ddp": type(net).__name__, "optimizer": type(opt).__name__}
    hook, tuner = None, None
    if how == "none":
        hook = compression.install(accelerator, net, Plan.uniform("none", warmup_steps=0))
    elif how == "mixed":
        names = [n for n, _ in net.module.named_parameters()]
        hook = compression.install(accelerator, net, Plan.from_assignments(
            {n: FAMILIES[i % len(FAMILIES)] for i, n in enumerate(names)}, warmup_steps=2))
    elif how == "autotune":
        batches = [b for _, b in zip(range(12), loader)]
        before = digest(net)
        result, hook = compression.autotune(
            accelerator, net, loss_fn, batches, opt, candidates=["none", "fp16", "powersgd(rank=2)",
                                                                 "topk(ratio=0.1)"],
            trial_s=4.0, trials=60, top=1, rounds=1, steps=2, warmup_steps=0)
        out.update(advice=result.recommendation, weights_kept=digest(net) == before,
                   trial_arms=len(result.accuracy.arms) if result.accuracy else 0)
    elif how == "wrap":
        tuner = compression.wrap(accelerator, net, opt, candidates=["none", "fp16", "powersgd(rank=2)"],
                                 observe_steps=3, trial_steps=2, trial_rounds=2, max_trial_rounds=2, top=1,
                                 trials=60, budget=10.0)
        hook = tuner.hook
    losses, saved = [], None
    steps = 2 * STEPS if how == "wrap" else STEPS
    for step, batch in zip(range(steps), loader):
        with accelerator.accumulate(net):
            loss = loss_fn(net, batch)
            accelerator.backward(loss)
            opt.step()
            opt.zero_grad()
        losses.append(float(loss.detach()))
        if tuner is not None:
            tuner.record_loss(loss)
        if how == "mixed" and step == STEPS - 4:
            accelerator.save_state(state_dir)
            saved = {"digest": digest(net), "residual": hook.residual_norm()}
    if saved is not None:
        moved = hook.residual_norm()
        accelerator.load_state(state_dir)
        out.update(restored_weights=digest(net) == saved["digest"], saved_residual=saved["residual"],
                   residual_after_more_steps=moved, restored_residual=hook.residual_norm())
    out.update(digest=digest(net), losses=losses, plan=hook.plan.digest() if hook is not None else None,
               events=[f"{e.what}: {e.detail}" for e in tuner.events] if tuner is not None else [])
    return out


def main(out_dir: str) -> None:
    accelerator = Accelerator(cpu=True, mixed_precision="bf16", gradient_accumulation_steps=2)
    results = {}
    for how in ("ddp", "none", "mixed", "autotune", "wrap"):
        try:
            results[how] = train(accelerator, how, os.path.join(out_dir, "state"))
            results[how]["error"] = None
        except Exception:  # recorded for the test, which names the run and the rank
            results[how] = {"error": traceback.format_exc()}
    results["refused"] = refusal(accelerator)
    with open(os.path.join(out_dir, f"rank{accelerator.process_index}.json"), "w") as f:
        json.dump(results, f)


def refusal(accelerator) -> str:
    """A model that did not go through prepare is refused with the way out."""
    try:
        compression.install(accelerator, model(), Plan.uniform("fp16"))
    except ValueError as exc:
        return str(exc)
    return "not refused"


if __name__ == "__main__":
    main(sys.argv[1])
