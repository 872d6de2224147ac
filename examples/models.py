"""Models of different shapes, as workload factories the CLI can name.

    advisor profile --model examples.models:embedding_heavy --nproc 2
    advisor demo   # uses the bundled MLP

Each factory returns an :class:`advisor.testbed.workloads.Workload`: the model, its loss, a few
batches, and (optionally) its optimizer.  Every rank calls the factory with the same seed.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from advisor.testbed.workloads import Workload, small_cnn, tiny_lm


def cnn() -> Workload:
    """A small CNN on 32x32 images: 4-D convolution weights, a dense head."""
    return small_cnn()


def transformer_lm() -> Workload:
    """A 2-layer transformer language model (attention, feed-forward, tied-size head)."""
    return tiny_lm()


class _Recommender(nn.Module):
    """Embedding-heavy: 2 large tables (95% of the parameters) and a small MLP on top."""

    def __init__(self, users: int = 20_000, items: int = 20_000, dim: int = 64) -> None:
        super().__init__()
        self.users = nn.Embedding(users, dim)
        self.items = nn.Embedding(items, dim)
        self.mlp = nn.Sequential(nn.Linear(2 * dim, 256), nn.ReLU(), nn.Linear(256, 1))

    def forward(self, batch: torch.Tensor) -> torch.Tensor:
        return self.mlp(torch.cat([self.users(batch[:, 0]), self.items(batch[:, 1])], dim=1)).squeeze(1)


def _click_loss(model: nn.Module, batch) -> torch.Tensor:
    pairs, clicked = batch
    return nn.functional.binary_cross_entropy_with_logits(model(pairs), clicked)


def embedding_heavy() -> Workload:
    """A recommender: dense embedding gradients (most rows zero), where top-k shines."""
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randint(0, 20_000, (256, 2), generator=g), torch.rand(256, generator=g).round())
               for _ in range(8)]
    return Workload(_Recommender(), _click_loss, batches, name="recommender-2.6M")
