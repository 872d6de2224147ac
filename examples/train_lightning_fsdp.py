"""Lightning with the model sharded (FSDP2) on 2 CPU processes, the compression advisor as a callback.

    python examples/train_lightning_fsdp.py                    # autotune a reduce-scatter per group
    python examples/train_lightning_fsdp.py --plan plan.json   # install a saved plan

``ModelParallelStrategy`` calls the module's ``configure_model``, which shards each block and
then the root with ``fully_shard``; the callback then chooses each group's reduce-scatter
(``advisor.autotune_sharded``: profile, accuracy trial, live measurement).  The accuracy trial
builds fresh copies of the module from its saved hyperparameters, so ``__init__`` calls
``save_hyperparameters()``.
"""

import argparse

import lightning as L
import torch
import torch.nn as nn
import torch.nn.functional as F
from lightning.pytorch.strategies import ModelParallelStrategy
from torch.utils.data import DataLoader, TensorDataset

from advisor.integrations.lightning import CompressionCallback


class ShardedClassifier(L.LightningModule):
    def __init__(self, width: int = 512, blocks: int = 4) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.stem = nn.Linear(64, 128)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(128, width), nn.GELU(), nn.Linear(width, 128))
                                    for _ in range(blocks))
        self.head = nn.Linear(128, 10)

    def configure_model(self) -> None:
        from torch.distributed.fsdp import fully_shard

        mesh = self.device_mesh["data_parallel"]
        for block in self.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(self, mesh=mesh)

    def forward(self, x):
        x = self.stem(x)
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def data() -> DataLoader:
    """Labels from a fixed random teacher: learnable, and not learnt in a few steps."""
    g = torch.Generator().manual_seed(0)
    teacher = nn.Sequential(nn.Linear(64, 32), nn.Tanh(), nn.Linear(32, 10))
    x = torch.randn(8192, 64, generator=g)
    with torch.no_grad():
        y = teacher(x).argmax(dim=1)
    return DataLoader(TensorDataset(x, y), batch_size=64)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--plan", default=None)
    parser.add_argument("--steps", type=int, default=60)
    args = parser.parse_args()
    L.seed_everything(0)
    callback = (CompressionCallback(plan=args.plan) if args.plan else
                CompressionCallback(tune="autotune", expected_steps=20_000, tune_batches=16))
    trainer = L.Trainer(accelerator="cpu", devices=2,
                        strategy=ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1),
                        max_steps=args.steps, callbacks=[callback], logger=False, enable_checkpointing=False)
    trainer.fit(ShardedClassifier(), data())
    if trainer.global_rank == 0:
        if callback.result is not None:
            print("\n".join(callback.result.summary()))
        else:
            print(f"plan in use: {', '.join(sorted({c.label for c in callback.hook.plan.configs()}))}")


if __name__ == "__main__":
    main()
