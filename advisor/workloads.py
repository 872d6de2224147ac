"""Workloads: a model with its loss and data, named ``package.module:factory`` on the CLI.

A factory is a zero-argument callable returning a :class:`Workload`.  Every rank calls it
(with the same seed), so it must build the same model everywhere.
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn


@dataclass
class Workload:
    """What the advisor needs to run training steps of a model."""

    model: nn.Module
    loss_fn: Callable[[nn.Module, Any], torch.Tensor]
    batches: Iterable[Any]
    make_optimizer: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer] | None = None
    name: str = "workload"

    def optimizer(self) -> torch.optim.Optimizer:
        params = self.model.parameters()
        if self.make_optimizer is None:
            return torch.optim.SGD(params, lr=0.01, momentum=0.9)
        return self.make_optimizer(params)


def load_factory(spec: str) -> Callable[[], Workload]:
    """Import ``package.module:factory``; errors say what is wrong and how to write it."""
    if not isinstance(spec, str) or spec.count(":") != 1:
        raise ValueError(f"model factory {spec!r}: write it as 'package.module:function'")
    module_name, attr = spec.split(":")
    # like ``python -m``: the user's own modules, run from their project directory
    if os.getcwd() not in sys.path:
        sys.path.append(os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # the user's module may fail in any way while importing
        raise ValueError(f"model factory {spec!r} does not import: {type(exc).__name__}: {exc}") from None
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise ValueError(f"model factory {spec!r}: module {module_name!r} has no callable {attr!r}")
    return factory


def build_workload(spec: str, seed: int = 0) -> Workload:
    factory = load_factory(spec)
    torch.manual_seed(seed)
    workload = factory()
    if not isinstance(workload, Workload):
        raise ValueError(
            f"model factory {spec!r} returned {type(workload).__name__}; it must return advisor.workloads.Workload"
        )
    return workload


def _cross_entropy(model: nn.Module, batch) -> torch.Tensor:
    x, y = batch
    return nn.functional.cross_entropy(model(x), y)


def synthetic_batches(shape: tuple[int, ...], classes: int, count: int = 8, seed: int = 0) -> list:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(*shape, generator=g), torch.randint(0, classes, (shape[0],), generator=g)) for _ in range(count)]


def mlp() -> Workload:
    """BACKGROUND.md's 5.3M-parameter MLP (Linear 1024-2048-1024-1024-10), batch 64."""
    model = nn.Sequential(
        nn.Linear(1024, 2048), nn.ReLU(), nn.Linear(2048, 1024), nn.ReLU(),
        nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10),
    )
    return Workload(model, _cross_entropy, synthetic_batches((64, 1024), 10), name="mlp-5.3M")


def small_cnn() -> Workload:
    """A small CNN on 32x32 images (conv weights are 4-D: PowerSGD reshapes them)."""
    model = nn.Sequential(
        nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(64 * 8 * 8, 256), nn.ReLU(), nn.Linear(256, 10),
    )
    return Workload(model, _cross_entropy, synthetic_batches((32, 3, 32, 32), 10), name="cnn")


class _TinyLM(nn.Module):
    def __init__(self, vocab: int = 2000, dim: int = 128, layers: int = 2, heads: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        block = nn.TransformerEncoderLayer(dim, heads, dim_feedforward=4 * dim, batch_first=True, dropout=0.0)
        self.blocks = nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.embed(tokens)))


def _next_token_loss(model: nn.Module, batch) -> torch.Tensor:
    tokens = batch
    logits = model(tokens[:, :-1])
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


def tiny_lm() -> Workload:
    """A small transformer language model (embedding-heavy: 0.5M of 1.2M parameters)."""
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, 2000, (16, 65), generator=g) for _ in range(8)]
    return Workload(_TinyLM(), _next_token_loss, batches, name="tiny-lm")


class _DigitsNet(nn.Module):
    """A small CNN for 8x8 digits (~0.3M parameters: convolutions, a wide hidden layer)."""

    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 32, 3, padding=1), nn.ReLU(), nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(),
            nn.MaxPool2d(2), nn.Flatten(),
        )
        self.classifier = nn.Sequential(nn.Linear(64 * 4 * 4, 256), nn.ReLU(), nn.Linear(256, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x.view(-1, 1, 8, 8)))


def digits_data(seed: int = 0, test_fraction: float = 0.25):
    """scikit-learn's digits (ships with it: no download), scaled to [0, 1], split once."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    data = load_digits()
    x = torch.tensor(data.data / 16.0, dtype=torch.float32)
    y = torch.tensor(data.target, dtype=torch.long)
    idx_train, idx_test = train_test_split(range(len(y)), test_size=test_fraction, random_state=seed,
                                           stratify=data.target)
    return x[idx_train], y[idx_train], x[idx_test], y[idx_test]


def digits() -> Workload:
    """The digits CNN with batches of 32 real training images (for profiling and tuning)."""
    x, y, _, _ = digits_data()
    batches = [(x[i : i + 32], y[i : i + 32]) for i in range(0, 256, 32)]
    return Workload(_DigitsNet(), _cross_entropy, batches, name="digits-cnn")
