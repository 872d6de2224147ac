"""Real Lightning fits of a sharded module on 2 CPU processes (ModelParallelStrategy: FSDP2 over gloo)
with the CompressionCallback.

Run as ``python lightning_fsdp.py OUT_DIR``: Lightning's launcher starts the second process by
running this script again.  Every rank writes ``OUT_DIR/rank<r>.json``: per fit, the digest of
the final (all-gathered) weights, the training losses, the plan installed and what the callback did.
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
from lightning.pytorch.strategies import ModelParallelStrategy

from advisor.integrations.lightning import CompressionCallback
from advisor.runtime import Plan

warnings.filterwarnings("ignore")

STEPS = 12


class ShardedClassifier(L.LightningModule):
    """Two residual blocks and a head, each block its own fully_shard group, then the root."""

    def __init__(self, width: int = 64) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(16, width), nn.ReLU(), nn.Linear(width, 16))
                                    for _ in range(2))
        self.head = nn.Linear(16, 4)

    def configure_model(self) -> None:
        from torch.distributed.fsdp import fully_shard

        mesh = self.device_mesh["data_parallel"]
        for block in self.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(self, mesh=mesh)

    def forward(self, x):
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def residual_norm(module) -> float:
    """This rank's PowerSGD residuals' norm, over every group."""
    from advisor.runtime.sharded import compression_state_dict

    squares = [t.to_local().norm() ** 2 for k, t in compression_state_dict(module).items() if "residual/" in k]
    return float(sum(squares) ** 0.5) if squares else 0.0


class Losses(L.Callback):
    """Training losses, and the residuals' norm at the start of training (after any resume)."""

    def __init__(self) -> None:
        self.values: list[float] = []
        self.residual_at_start = None

    def on_train_start(self, trainer, pl_module) -> None:
        self.residual_at_start = residual_norm(pl_module)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.values.append(float(outputs["loss"]))


def digest(module) -> str:
    h = hashlib.sha256()
    for p in module.parameters():
        h.update(p.full_tensor().detach().contiguous().numpy().tobytes())  # all-gathered: every rank calls it
    return h.hexdigest()


def fit(callback=None, ckpt_path=None, save_to=None, steps=STEPS) -> dict:
    L.seed_everything(0, verbose=False)
    module, losses = ShardedClassifier(), Losses()
    trainer = L.Trainer(accelerator="cpu", devices=2,
                        strategy=ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1,
                                                       save_distributed_checkpoint=False),
                        max_steps=steps, callbacks=([callback] if callback else []) + [losses], logger=False,
                        enable_progress_bar=False, enable_checkpointing=False, enable_model_summary=False)
    trainer.fit(module, data(), ckpt_path=ckpt_path)
    if save_to:
        trainer.save_checkpoint(save_to)
    out = {"digest": digest(module), "losses": losses.values, "rank": trainer.global_rank}
    if callback is not None:
        in_use = callback.tuner if callback.tuner is not None else callback.hook
        out["plan"] = in_use.plan.digest() if in_use is not None else None
        out["tuned"] = callback.result is not None or callback.tuner is not None
        if callback.tuner is not None:
            out["events"] = [f"{e.what}: {e.detail}" for e in callback.tuner.events]
            out["phase"] = callback.tuner.phase
        if callback.result is not None:
            out["advice"] = callback.result.recommendation
            out["trial_arms"] = len(callback.result.accuracy.arms) if callback.result.accuracy else 0
        out["residual_norm"] = residual_norm(module)
        out["residual_at_start"] = losses.residual_at_start
    return out


def main(out_dir: str) -> None:
    checkpoint = os.path.join(out_dir, "powersgd.ckpt")
    powersgd = Plan.uniform("powersgd(rank=2)", warmup_steps=0)
    runs = {
        "fsdp": lambda: fit(),
        "none": lambda: fit(CompressionCallback(plan=Plan.uniform("none", warmup_steps=0))),
        "powersgd": lambda: fit(CompressionCallback(plan=powersgd), save_to=checkpoint),
        "resumed": lambda: fit(CompressionCallback(tune="autotune"), ckpt_path=checkpoint, steps=STEPS + 4),
        "autotune": lambda: fit(CompressionCallback(
            tune="autotune", tune_batches=8, candidates=["none", "bf16", "powersgd(rank=2)"], trial_s=4.0, top=1,
            rounds=2, max_rounds=2, steps=2)),
        "wrap": lambda: fit(CompressionCallback(
            tune="wrap", tune_batches=8, candidates=["none", "bf16", "powersgd(rank=2)"], observe_steps=3,
            trial_steps=2, trial_rounds=2, max_trial_rounds=2, top=1, trial_s=3.0), steps=40),
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
