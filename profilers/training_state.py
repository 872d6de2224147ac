"""Measure without training: save a model's and optimizer's state, restore it afterwards."""

from __future__ import annotations

import copy

import torch


class StateGuard:
    """Saves a model's parameters/buffers and its optimizer's state; restores them on exit.

    Gradients are cleared on exit (``set_to_none``), so measurement steps leave nothing behind.
    """

    def __init__(self, module: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None) -> None:
        self.module = module
        self.optimizer = optimizer

    def __enter__(self) -> "StateGuard":
        self._model = copy.deepcopy(self.module.state_dict())
        self._opt = copy.deepcopy(self.optimizer.state_dict()) if self.optimizer is not None else None
        return self

    def __exit__(self, *exc) -> None:
        self.module.load_state_dict(self._model)
        if self.optimizer is not None:
            self.optimizer.load_state_dict(self._opt)
        self.module.zero_grad(set_to_none=True)
