"""Measure without training: save a model's and optimizer's state, restore it afterwards."""

from __future__ import annotations

import copy
from collections.abc import Mapping

import torch


class StateGuard:
    """Saves a model's parameters/buffers and its optimizer's state; restores them on exit.

    Gradients are cleared on exit (``set_to_none``), so measurement steps leave nothing behind.
    """

    def __init__(self, module: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None) -> None:
        self.module = module
        self.optimizer = optimizer

    def __enter__(self) -> StateGuard:
        self._model = copy.deepcopy(self.module.state_dict())
        self._opt = copy.deepcopy(self.optimizer.state_dict()) if self.optimizer is not None else None
        return self

    def __exit__(self, *exc) -> None:
        self.module.load_state_dict(self._model)
        if self.optimizer is not None:
            self.optimizer.load_state_dict(self._opt)
        self.module.zero_grad(set_to_none=True)


def optimizer_over(optimizer: torch.optim.Optimizer, replacements: Mapping[int, torch.Tensor]) -> torch.optim.Optimizer:
    """The same optimizer (type, groups' hyperparameters, per-parameter state) over other tensors.

    ``replacements`` maps ``id(parameter)`` of the optimizer's parameters to the tensor that
    takes its place; parameters not in it are left out (and so are groups left empty).
    The state is a deep copy: stepping the result never touches ``optimizer``.
    """
    groups, state = [], {}
    for group in optimizer.param_groups:
        params = [replacements[id(p)] for p in group["params"] if id(p) in replacements]
        if params:
            groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": params})
        for p in group["params"]:
            if id(p) in replacements and p in optimizer.state:
                state[replacements[id(p)]] = optimizer.state[p]
    try:
        clone = type(optimizer)(groups)
    except TypeError:  # an optimizer whose constructor needs more than its groups
        clone = type(optimizer)(groups, **optimizer.defaults)
    for param, value in state.items():
        clone.state[param] = copy.deepcopy(value)
    return clone


def clone_optimizer(optimizer: torch.optim.Optimizer, source: torch.nn.Module,
                    target: torch.nn.Module) -> torch.optim.Optimizer:
    """The same optimizer over ``target``, a copy of ``source`` (same parameter names).

    Raises ValueError naming the problem when the optimizer holds tensors that are not
    ``source``'s parameters.
    """
    names = {id(p): n for n, p in source.named_parameters()}
    for i, group in enumerate(optimizer.param_groups):
        foreign = sum(id(p) not in names for p in group["params"])
        if foreign:
            raise ValueError(f"optimizer parameter group {i} holds {foreign} tensor(s) that are not parameters of the "
                             "model; pass the optimizer built over this model's parameters")
    targets = dict(target.named_parameters())
    return optimizer_over(optimizer, {i: targets[n] for i, n in names.items()})


#: state a per-coordinate adaptive optimizer keeps (Adam's second moment, RMSprop's and
#: Adagrad's running squares, Adadelta's, Adafactor's factored rows)
_SECOND_MOMENT_STATE = ("exp_avg_sq", "square_avg", "sum", "acc_delta", "exp_avg_sq_row", "exp_inf")
_ADAPTIVE = ("Adam", "AdamW", "Adamax", "NAdam", "RAdam", "RMSprop", "Adagrad", "Adadelta", "SparseAdam",
             "Adafactor", "LAMB", "Lamb")


def scales_per_coordinate(optimizer: torch.optim.Optimizer | None) -> bool:
    """Whether the optimizer divides each coordinate by its own running magnitude (Adam, RMSprop, ...).

    Such optimizers turn a tiny gradient coordinate into an lr-sized step, so the relative
    precision of small gradients matters to them, not only the absolute error.
    """
    if optimizer is None:
        return False
    if type(optimizer).__name__ in _ADAPTIVE:
        return True
    return any(key in state for state in optimizer.state.values() for key in _SECOND_MOMENT_STATE)


def preferred_sixteen_bit(optimizer: torch.optim.Optimizer | None) -> str:
    """The 16-bit cast to prefer when both cost the same: bf16 for per-coordinate optimizers, else fp16.

    fp16 ends its normal range at 6.1e-5: late in training most gradient entries sit below it
    (subnormal, a few bits of mantissa) or flush to zero, which Adam-like optimizers magnify;
    bf16 keeps fp32's range.  For SGD the absolute error stays tiny and fp16's finer mantissa wins.
    """
    return "bf16" if scales_per_coordinate(optimizer) else "fp16"
