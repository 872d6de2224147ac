"""Exchange-free trial arms: every rank computes every rank's gradients, so no gradient crosses the link.

The accuracy trial's fp32 pair (and its 16-bit arm) must send every gradient at full size:
on a slow link those arms cost many times a compressed one, and they set how long the
whole trial takes.  Their exchange is *elementwise* (each averaged element depends only on
the same element of every rank's gradient: fp32's mean, a 16-bit cast's), so it can be
replayed exactly on one rank.  An exchange-free arm gathers each rank's batches (bytes of
tokens or pixels, far fewer than a gradient's), runs the forward and backward of every
rank's batch on one copy of the model, and averages the gradients through the same
compressor code the hook runs (:class:`advisor.runtime.simulate.SimulatedRanks`).  With
the same batches, the same weights and the same arithmetic, it trains the model that DDP
would train: on two ranks bit for bit (a sum of two numbers has one order); on more, up to
the order in which the collective adds the ranks' values.

It costs ``world`` forward and backward passes a step instead of one, plus the batches'
gather, so the trial uses it only where the performance model predicts that cheaper than
the link (:func:`exchange_free_pays`).  Lossy plans are not elementwise (PowerSGD and top-k
depend on the bucket's layout) and always run on a real DDP shadow; they are cheap on a slow
link anyway.

Where DDP would differ:

- buffers (BatchNorm's running statistics) follow DDP's ``broadcast_buffers``: each
  simulated rank's forward starts from rank 0's buffers (or its own, without broadcast),
  and this rank evaluates with its own, as a real rank would;
- random layers (dropout) draw from this rank's generator for every simulated rank;
- parameters with sparse gradients rule it out (:func:`supports_exchange_free`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils._pytree import tree_map

from advisor.compressors.base import Collective, SegmentLayout
from advisor.compressors.registry import CompressorConfig, parse
from advisor.core.collectives import every_rank, from_rank_zero, rank, world_size
from advisor.runtime.hook import sparse_parameters
from advisor.runtime.plan import Plan
from advisor.runtime.simulate import SimulatedRanks
from advisor.tuning.live import LossFn, module_copy
from profilers.training_state import clone_optimizer

#: exchange-free arms run only where predicted at most this share of a real fp32 step: the
#: prediction errs by some percent, and a wrong choice costs trial time, never correctness
PAYS_BELOW = 0.75

_UNCOMPRESSED = parse("none")


def is_elementwise(plan: Plan | None) -> bool:
    """Whether every config of ``plan`` averages element by element (None: native fp32), so that
    an exchange-free arm replays it exactly."""
    return plan is None or all(c.build().elementwise for c in plan.configs())


def supports_exchange_free(ddp: DistributedDataParallel) -> tuple[bool, str]:
    """Whether ``ddp``'s model can train exchange-free, and why not where it cannot."""
    sparse = sparse_parameters(ddp.module)
    if sparse:
        return False, f"parameters {sparse} have sparse gradients, which DDP exchanges its own way"
    return True, ""


def batch_bytes(batch: Any) -> int:
    """The bytes of the tensors in one batch (what gathering it sends, give or take pickling)."""
    total = 0

    def count(leaf):
        nonlocal total
        if torch.is_tensor(leaf):
            total += leaf.numel() * leaf.element_size()
        return leaf

    tree_map(count, batch)
    return total


def exchange_free_pays(model, one_batch_bytes: int) -> tuple[bool, str]:
    """Whether an exchange-free fp32 step is predicted cheaper than a real one, with the numbers.

    ``model``: a :class:`advisor.perfmodel.model.PerformanceModel` of the job (DDP's own
    buckets).  Exchange-free: every rank's forward and backward on this rank, one optimizer
    step, and an all-gather of one batch a rank.  Real: the model's fp32 timeline.
    """
    world = model.world
    if world < 2:
        return False, "one rank: nothing crosses a link"
    gather = float(model.network.seconds(Collective.ALL_GATHER, one_batch_bytes))
    real = float(model.predict(Plan.uniform("none", warmup_steps=0)).iteration_s)
    free = exchange_free_step_s(model, one_batch_bytes)
    pays = free < PAYS_BELOW * real
    return pays, (f"predicted {free * 1e3:.0f} ms a step exchange-free ({world} ranks' forward and backward here, "
                  f"{gather * 1e3:.0f} ms to gather the batches) against {real * 1e3:.0f} ms for fp32 over the link")


def exchange_free_step_s(model, one_batch_bytes: int) -> float:
    """The predicted seconds of one exchange-free step: every rank's forward and backward here, one
    optimizer step, and the gather of one batch a rank."""
    local = model.world * (model.forward_s + model.backward_s) + model.optimizer_s
    return local + float(model.network.seconds(Collective.ALL_GATHER, one_batch_bytes))


class _LocalReplica(nn.Module):
    """The module under a DDP-like face (``.module``), for a ``loss_fn`` that reaches through it."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)


class ExchangeFreeArm:
    """One trial arm trained exchange-free: a copy of ``ddp``'s module and a clone of ``optimizer``.

    Every rank calls :meth:`train` with the same arguments: it gathers the ranks' batches
    (one collective per call) and steps the copy as DDP with ``plan``'s elementwise hook
    (None: native fp32) would.  ``module`` is what the trial evaluates.
    """

    def __init__(self, ddp: DistributedDataParallel, loss_fn: LossFn, optimizer: torch.optim.Optimizer,
                 plan: Plan | None, group=None) -> None:
        if not is_elementwise(plan):
            raise ValueError(f"an exchange-free arm replays elementwise exchanges only (fp32, 16-bit casts); "
                             f"plan {plan.metadata.get('description') or plan.digest()} is not")
        self.loss_fn, self.group, self.plan = loss_fn, group, plan
        self.world, self.rank = world_size(group), rank(group)
        self.module = module_copy(ddp.module)
        self.model = _LocalReplica(self.module)
        self.optimizer = clone_optimizer(optimizer, ddp.module, self.module)
        self.broadcast_buffers = bool(getattr(ddp, "broadcast_buffers", True))
        self.parameters = [(n, p) for n, p in self.module.named_parameters() if p.requires_grad]
        self.layouts = {n: SegmentLayout((n,), (tuple(p.shape),)) for n, p in self.parameters}
        self.configs = {n: plan.config_for(n) if plan is not None else _UNCOMPRESSED for n, p in self.parameters}
        self.compressors: dict[CompressorConfig, Any] = {}
        self.ranks = SimulatedRanks(self.world, seed=plan.seed if plan is not None else 0,
                                    forms=dict(plan.kernel_forms) if plan is not None else {})
        self.step = 0
        buffers = {n: b.detach().clone() for n, b in self.module.named_buffers()}
        if buffers:  # as DDP's first forward does, every rank starts from rank 0's
            buffers = from_rank_zero(_to_cpu(buffers), group)
            self._load_buffers(buffers)
        self.buffers: list[dict[str, torch.Tensor]] = [buffers for _ in range(self.world)]

    def close(self) -> None:
        """Nothing is installed on anything: the arm is a copy."""

    def train(self, batch: Callable[[int], Any], start: int, count: int) -> None:
        """``count`` steps from step ``start``; rank ``r``'s batch at step ``i`` is its ``batch(i)``."""
        mine = [_to_cpu(batch(i)) for i in range(start, start + count)]
        everyone = every_rank(mine, self.group)
        device = next(iter(self.module.parameters())).device
        for j in range(count):
            self._step([tree_map(lambda t: t.to(device) if torch.is_tensor(t) else t, everyone[w][j])
                        for w in range(self.world)])

    # --- one step -------------------------------------------------------------------
    def _step(self, batches: Sequence[Any]) -> None:
        grads: list[list[torch.Tensor]] = []
        before, after = self.buffers, list(self.buffers)
        for w, b in enumerate(batches):
            if before[0]:  # each rank's forward starts from rank 0's buffers of the step before
                self._load_buffers(before[0] if self.broadcast_buffers else before[w])
            self.optimizer.zero_grad(set_to_none=True)
            self.loss_fn(self.model, b).backward()
            grads.append([_flat_gradient(p) for _, p in self.parameters])
            if before[0]:
                after[w] = {n: t.detach().clone() for n, t in self.module.named_buffers()}
        self.buffers = after
        if after[0]:  # this rank evaluates with its own, as a real rank would
            self._load_buffers(after[self.rank])
        warming_up = self.plan is not None and self.step < self.plan.warmup_steps
        for k, (name, p) in enumerate(self.parameters):
            config = _UNCOMPRESSED if warming_up else self.configs[name]
            self.ranks.step = self.step
            averaged = self.ranks.exchange(self._compressor(config), [g[k] for g in grads], self.layouts[name])
            p.grad = averaged[self.rank].view_as(p).to(p.dtype)
        self.optimizer.step()
        self.step += 1

    def _compressor(self, config: CompressorConfig):
        compressor = self.compressors.get(config)
        if compressor is None:
            compressor = self.compressors[config] = config.build()
        return compressor

    def _load_buffers(self, buffers: dict[str, torch.Tensor]) -> None:
        for name, buf in self.module.named_buffers():
            buf.copy_(buffers[name])


def _flat_gradient(p: torch.nn.Parameter) -> torch.Tensor:
    """The parameter's gradient, flat, in float32 (zeros where it got none, as DDP sends)."""
    if p.grad is None:
        return torch.zeros(p.numel(), dtype=torch.float32, device=p.device)
    return p.grad.detach().reshape(-1).float().clone()


def _to_cpu(batch: Any) -> Any:
    """A batch with its tensors on the CPU, to pickle for the gather whatever device each rank holds;
    copied, since a pickled view carries its whole storage (a batch sliced from a corpus would
    send the corpus)."""
    return tree_map(lambda t: t.detach().to("cpu").clone(memory_format=torch.contiguous_format)
                    if torch.is_tensor(t) else t, batch)
