"""Real Lightning fits on 2 CPU processes (strategy="ddp", gloo) with the CompressionCallback.

Run as ``python lightning_fit.py OUT_DIR``: Lightning's launcher starts the second process by
running this script again.  Every rank writes ``OUT_DIR/rank<r>.json``: per fit, the digest of
the final weights, the training losses, the installed plan and what the callback did.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import traceback
import warnings

import lightning as L
import torch
import torch.nn as nn
import torch.nn.functional as F
from common import data  # this script's own folder

from advisor.integrations.lightning import CompressionCallback
from advisor.runtime import Plan

warnings.filterwarnings("ignore", ".*does not have many workers.*")
warnings.filterwarnings("ignore", ".*number of training batches.*")

STEPS = 12
FAMILIES = ["fp16", "powersgd(rank=2)", "topk(ratio=0.1)", "intquant(bits=8)", "bf16", "signsgd"]


class Classifier(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.real_logs = 0
        self.net = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4))

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss)  # the callback's tuning steps must not reach this
        return loss

    def log(self, *args, **kwargs):
        self.real_logs += 1  # calls that reached Lightning (the callback mutes them while it tunes)
        return super().log(*args, **kwargs)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


class Losses(L.Callback):
    """Training losses, and the hook's residual norm at the start of training (after any resume)."""

    def __init__(self) -> None:
        self.values: list[float] = []
        self.residual_at_start = None

    def on_train_start(self, trainer, pl_module) -> None:
        for cb in trainer.callbacks:
            if isinstance(cb, CompressionCallback) and cb.hook is not None:
                self.residual_at_start = cb.hook.residual_norm()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.values.append(float(outputs["loss"]))


def digest(module) -> str:
    h = hashlib.sha256()
    for p in module.parameters():
        h.update(p.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


def fit(callback=None, precision="32-true", ckpt_path=None, save_to=None, steps=STEPS) -> dict:
    L.seed_everything(0, verbose=False)
    module, losses = Classifier(), Losses()
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_steps=steps, precision=precision,
                        callbacks=([callback] if callback else []) + [losses], logger=False,
                        enable_progress_bar=False, enable_checkpointing=False, enable_model_summary=False)
    trainer.fit(module, data(), ckpt_path=ckpt_path)
    if save_to:
        trainer.save_checkpoint(save_to)
    out = {"digest": digest(module), "losses": losses.values, "rank": trainer.global_rank,
           "real_logs": module.real_logs}
    if callback is not None:
        hook = callback.hook
        out["plan"] = hook.plan.digest() if hook is not None else None
        out["labels"] = sorted({c.label for c in hook.plan.configs()}) if hook is not None else []
        out["residual_norm"] = hook.residual_norm() if hook is not None else 0.0
        out["residual_at_start"] = losses.residual_at_start
        out["tuned"] = callback.result is not None or callback.tuner is not None
        if callback.result is not None:
            out["advice"] = callback.result.recommendation
            out["trial_arms"] = len(callback.result.accuracy.arms) if callback.result.accuracy else 0
        if callback.tuner is not None:
            out["events"] = [f"{e.what}: {e.detail}" for e in callback.tuner.events]
    return out


def main(out_dir: str) -> None:
    names = [n for n, p in Classifier().named_parameters()]
    mixed = Plan.from_assignments({n: FAMILIES[i % len(FAMILIES)] for i, n in enumerate(names)}, warmup_steps=2)
    checkpoint = os.path.join(out_dir, "mixed.ckpt")
    runs = {
        "ddp": lambda: fit(),
        "none": lambda: fit(CompressionCallback(plan=Plan.uniform("none", warmup_steps=0))),
        "mixed": lambda: fit(CompressionCallback(plan=mixed), save_to=checkpoint),
        "resumed": lambda: fit(CompressionCallback(tune="autotune"), ckpt_path=checkpoint, steps=STEPS + 4),
        "autotune bf16-mixed": lambda: fit(CompressionCallback(
            tune="autotune", tune_batches=12, candidates=["none", "fp16", "powersgd(rank=2)", "topk(ratio=0.1)"],
            trial_s=4.0, trials=60, top=1, rounds=1, steps=2, warmup_steps=0), precision="bf16-mixed"),
        "wrap": lambda: fit(CompressionCallback(
            tune="wrap", tune_batches=8, candidates=["none", "fp16", "powersgd(rank=2)"], observe_steps=3,
            trial_steps=2, trial_rounds=2, max_trial_rounds=2, top=1, trials=60, trial_s=3.0, budget=10.0), steps=30),
    }
    results = {}
    for name, run in runs.items():
        try:
            results[name] = run()
            results[name]["error"] = None
        except Exception:  # recorded for the test, which names the fit and the rank
            results[name] = {"error": traceback.format_exc()}
    rank = int(os.environ.get("LOCAL_RANK", "0"))
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main(sys.argv[1])
