"""Compute profile: forward, backward and optimizer time, gradient-ready times, DDP buckets.

Steps run under ``ddp.no_sync()`` so no communication is timed.  Each parameter's
gradient-ready time comes from ``Tensor.register_post_accumulate_grad_hook`` (it fires
right after the gradient is accumulated, before DDP would hand the bucket over), relative
to the start of backward.  Each layer's backward cost is the gap between its last gradient
and the previous layer's, in backward order.  Numbers are medians over the timed steps on
each rank, then the slowest rank's (it sets the pace of synchronous training).

Profiling leaves training state as it found it: model and optimizer state are saved
before and restored after, hooks are removed, and gradients are cleared.
"""

from __future__ import annotations

import itertools
import statistics
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

from advisor.core.collectives import every_rank, slowest
from advisor.runtime.hook import sparse_parameters

from .profile import Bucket, ComputeProfile, ParameterTiming
from .training_state import StateGuard

LossFn = Callable[[torch.nn.Module, Any], torch.Tensor]


def _named_trainable(module: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    return [(n, p) for n, p in module.named_parameters() if p.requires_grad]


def layer_of(name: str) -> str:
    """The module a parameter belongs to (``encoder.fc1.weight`` -> ``encoder.fc1``)."""
    return name.rsplit(".", 1)[0] if "." in name else name


def ddp_buckets(ddp: DistributedDataParallel, loss_fn: LossFn, batch: Any) -> list[Bucket]:
    """DDP's rebuilt bucket layout (which parameters share a bucket, in which order).

    DDP reports it through its logging data once it has rebuilt its buckets (after the
    second synchronised backward pass); if it has not yet, this runs synchronised
    backward passes (gradients only, no optimizer step) until it has.
    """
    named = _named_trainable(ddp.module)
    sparse = set(sparse_parameters(ddp.module))  # buckets of their own, always uncompressed: left out
    for _ in range(4):
        data = ddp._get_ddp_logging_data()
        indices = data.get("rebuilt_per_bucket_param_indices")
        if indices:
            buckets = []
            for group in str(indices).split(", "):
                names = [named[int(j)][0] for j in group.split()]
                if sparse.issuperset(names):
                    continue
                numel = sum(named[int(j)][1].numel() for j in group.split())
                buckets.append(Bucket(index=len(buckets), parameters=names, numel=numel))
            return buckets
        ddp.zero_grad(set_to_none=True)
        loss_fn(ddp, batch).backward()
    # Older or newer PyTorch without that logging: DDP's documented rule, one cap per
    # bucket filled in reverse parameter order.
    cap = int(data.get("bucket_cap_bytes", 25 << 20))
    buckets, current, size = [], [], 0
    for name, p in reversed(named):
        if name in sparse:
            continue
        current.append(name)
        size += p.numel() * p.element_size()
        if size >= cap:
            buckets.append(current)
            current, size = [], 0
    if current:
        buckets.append(current)
    by_name = dict(named)
    return [Bucket(i, b, sum(by_name[n].numel() for n in b)) for i, b in enumerate(buckets)]


def layer_costs(ready: dict[str, float], order: list[str]) -> dict[str, float]:
    """Backward cost of each layer from gradient-ready times (seconds from backward start)."""
    layer_ready: dict[str, float] = {}
    for name in order:
        layer = layer_of(name)
        layer_ready[layer] = max(layer_ready.get(layer, 0.0), ready[name])
    costs, previous = {}, 0.0
    for layer, t in sorted(layer_ready.items(), key=lambda kv: kv[1]):
        costs[layer] = max(0.0, t - previous)
        previous = t
    return costs


def steady_steps(backward_s: list[float], tolerance: float = 1.25) -> list[int]:
    """Indices of the timed steps to keep: all, unless one half ran much slower.

    On a shared machine a burst of other work can slow a stretch of steps; noise only ever
    adds time, so when the two halves' medians differ by more than ``tolerance`` x the
    faster half alone is kept.
    """
    n = len(backward_s)
    if n < 4:
        return list(range(n))
    halves = [list(range(n // 2)), list(range(n // 2, n))]
    medians = [statistics.median(backward_s[i] for i in h) for h in halves]
    if max(medians) > tolerance * min(medians):
        return halves[medians.index(min(medians))]
    return list(range(n))


def profile_compute(
    ddp: DistributedDataParallel,
    loss_fn: LossFn,
    batches: Iterable[Any],
    optimizer: torch.optim.Optimizer | None = None,
    steps: int = 8,
    warmup: int = 3,
    group=None,
) -> ComputeProfile:
    """Time forward, backward (per parameter), optimizer and copies, without communication.

    Call on every rank at the same point.

    Args:
        ddp: the DDP model; steps run under ``no_sync`` and its state is restored after.
        loss_fn: ``loss_fn(model, batch) -> loss``, the forward pass.
        batches: cycled if there are fewer than ``warmup + steps``.
        optimizer: timed when given (its state is restored after).
        steps, warmup: timed steps, after untimed ones.

    Returns:
        A :class:`ComputeProfile` with the slowest rank's medians and DDP's buckets.

    Raises:
        TypeError: not a DDP model.  ValueError: bad step counts or no batches.
    """
    if not isinstance(ddp, DistributedDataParallel):
        raise TypeError(f"profile_compute needs a DistributedDataParallel model, got {type(ddp).__name__}")
    if steps < 1 or warmup < 0:
        raise ValueError(f"steps={steps}, warmup={warmup}; allowed: steps >= 1, warmup >= 0")
    batch_list = list(itertools.islice(iter(batches), warmup + steps))
    if not batch_list:
        raise ValueError("profile_compute got no batches")
    named = _named_trainable(ddp.module)
    fwd, bwd, opt, ready_runs, buckets = _local_steps(ddp, loss_fn, batch_list, optimizer, named, warmup, steps)
    keep = steady_steps(bwd)
    fwd, bwd, opt = ([series[i] for i in keep] for series in (fwd, bwd, opt))
    ready_runs = [ready_runs[i] for i in keep]
    names = [n for n, _ in named]
    local = [statistics.median(fwd), statistics.median(bwd), statistics.median(opt), copy_rate(named)]
    # median ready times (robust to one slow step), slowest rank per parameter
    local += [statistics.median(run[n] for run in ready_runs) for n in names]
    merged = slowest(local, group)
    forward_s, backward_s, optimizer_s, copy_s_per_byte = merged[:4]
    ready = dict(zip(names, merged[4:]))
    # layer costs from the median ready times add up to the last gradient's ready time;
    # medians of per-step layer costs would not (each step's jitter lands on other layers)
    layer_backward = layer_costs(ready, names)
    by_name = dict(named)
    return ComputeProfile(
        forward_s=forward_s,
        backward_s=backward_s,
        optimizer_s=optimizer_s,
        steps=len(bwd),  # the steps kept (see steady_steps)
        parameters=[
            ParameterTiming(n, layer_of(n), by_name[n].numel(), list(by_name[n].shape), ready[n]) for n in names
        ],
        layer_backward_s=layer_backward,
        buckets=buckets,
        backward_s_by_rank=every_rank(local[1], group),
        copy_s_per_byte=copy_s_per_byte,
    )


def _local_steps(ddp, loss_fn, batch_list, optimizer, named, warmup: int, steps: int):
    """This rank's timed steps without communication (``no_sync``), weights and optimizer restored.

    Returns the forward, backward and optimizer seconds and each parameter's gradient-ready
    time (from the backward's start) of the steps after ``warmup``, and DDP's buckets.
    """
    feed = itertools.cycle(batch_list)
    stamps: dict[str, float] = {}
    handles = [
        p.register_post_accumulate_grad_hook(lambda _p, _n=name: stamps.__setitem__(_n, time.perf_counter()))
        for name, p in named
    ]
    fwd, bwd, opt, ready_runs = [], [], [], []
    with StateGuard(ddp.module, optimizer):
        try:
            if getattr(ddp, "static_graph", False):
                # a static graph must learn its graph in a synced backward before any under
                # no_sync (PyTorch asserts otherwise); gradients are discarded, weights untouched
                ddp.zero_grad(set_to_none=True)
                loss_fn(ddp, batch_list[0]).backward()
            for i in range(warmup + steps):
                batch = next(feed)
                ddp.zero_grad(set_to_none=True)
                stamps.clear()
                with ddp.no_sync():
                    t0 = time.perf_counter()
                    loss = loss_fn(ddp, batch)
                    t1 = time.perf_counter()
                    loss.backward()
                    t2 = time.perf_counter()
                if optimizer is not None:
                    optimizer.step()
                t3 = time.perf_counter()
                if i >= warmup:
                    fwd.append(t1 - t0)
                    bwd.append(t2 - t1)
                    opt.append(t3 - t2)
                    ready_runs.append({n: stamps.get(n, t2) - t1 for n, _ in named})
            buckets = ddp_buckets(ddp, loss_fn, batch_list[0])
        finally:
            for h in handles:
                h.remove()
    return fwd, bwd, opt, ready_runs, buckets


def copy_rate(named, repeats: int = 5) -> float:
    """Seconds per byte of copying a buffer the size of all gradients (median of runs)."""
    numel = sum(p.numel() for _, p in named)
    device = named[0][1].device if named else "cpu"
    src = torch.ones(numel, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)  # first touch: page faults are not the steady state
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        dst.copy_(src)
        if src.is_cuda:
            torch.cuda.synchronize(src.device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) / max(1, numel * 4)
