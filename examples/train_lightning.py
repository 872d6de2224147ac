"""Lightning on 2 CPU processes with the compression advisor as a callback.

    python examples/train_lightning.py                    # autotune before the first step
    python examples/train_lightning.py --tune wrap        # tune online during the first steps
    python examples/train_lightning.py --plan plan.json   # install a saved plan

Lightning's launcher starts the second process itself (strategy="ddp", gloo on CPU).
"""

import argparse

import lightning as L
import torch
from torch.utils.data import DataLoader

from advisor.integrations.lightning import CompressionCallback
from examples import models


class LitClassifier(L.LightningModule):
    def __init__(self, workload) -> None:
        super().__init__()
        self.net, self.workload_loss = workload.model, workload.loss_fn

    def training_step(self, batch, batch_idx):
        loss = self.workload_loss(self.net, batch)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tune", default="autotune", choices=["autotune", "wrap"])
    parser.add_argument("--plan", default=None)
    parser.add_argument("--steps", type=int, default=60)
    args = parser.parse_args()
    L.seed_everything(0)
    workload = models.cnn()
    loader = DataLoader(list(workload.batches), batch_size=None)  # already batched; Lightning shards it
    callback = CompressionCallback(plan=args.plan) if args.plan else CompressionCallback(tune=args.tune)
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_steps=args.steps,
                        callbacks=[callback], logger=False, enable_checkpointing=False)
    trainer.fit(LitClassifier(workload), loader)
    if trainer.global_rank == 0:
        in_use = sorted({c.label for c in callback.hook.plan.configs()}) if callback.hook else ["fp32 (no hook)"]
        print(f"plan in use: {', '.join(in_use)}")
        if callback.result is not None:
            callback.result.render()
        for event in callback.tuner.events if callback.tuner else []:
            print(f"advisor, step {event.step}: {event.what}: {event.detail}")


if __name__ == "__main__":
    main()
