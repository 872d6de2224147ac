"""Quickstart: wrap a model in DDP, call advisor.autotune, keep training.

    .venv/bin/python examples/quickstart.py            # 2 local ranks over loopback

In a real job you would start the ranks with torchrun (see train_torchrun.py); here the
advisor's own launcher starts 2 local processes so the example runs anywhere.
"""

import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

import advisor
from advisor.testbed.launch import launch_local


def train(rank: int, world_size: int):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(512, 1024), nn.ReLU(), nn.Linear(1024, 512), nn.ReLU(), nn.Linear(512, 10))
    ddp = DDP(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    batches = [(torch.randn(32, 512), torch.randint(0, 10, (32,))) for _ in range(8)]

    def loss_fn(m, batch):
        x, y = batch
        return nn.functional.cross_entropy(m(x), y)

    # profile, search, measure the best plans live, install the winner (or nothing)
    result = advisor.autotune(ddp, loss_fn, batches, optimizer, trials=500)

    for step in range(20):  # training goes on as before
        x, y = batches[step % len(batches)]
        optimizer.zero_grad()
        loss_fn(ddp, (x, y)).backward()
        optimizer.step()
    return result  # the hook closes itself at exit; the result travels without it


if __name__ == "__main__":
    result = launch_local(train, 2)[0]
    result.render()
