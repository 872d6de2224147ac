"""Measure plans live on the running job, without touching the user's training state.

Compression plans run on a *shadow*: a copy of the user's module in its own DDP wrapper
with the compression hook, so the user's model keeps no hook (DDP takes one hook per
model, forever) unless the advice is to compress.  The native fp32 baseline runs on the
user's own DDP model, whose parameters and optimizer state are saved before and restored
after.  Plans are measured in interleaved rounds, so drift on a shared machine hits all
of them alike, and each round starts one plan later than the last, so that no plan always
follows the same one; each round's median step time is all-reduced with MAX (the slowest
rank sets the pace), so every rank holds the same numbers.
"""

from __future__ import annotations

import copy
import statistics
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

from advisor.core.collectives import slowest
from advisor.core.documents import check_int
from advisor.runtime import CompressionHook, Plan, install
from advisor.tuning.layout import built_for
from profilers.training_state import StateGuard, clone_optimizer

LossFn = Callable[[torch.nn.Module, Any], torch.Tensor]

_MIB = 1024 * 1024


def bucketing_kwargs(ddp: DistributedDataParallel) -> dict[str, Any]:
    """DDP constructor arguments that give a copy of ``ddp``'s model the same buckets.

    Why not just ``bucket_cap_mb=ddp.bucket_bytes_cap``: DDP gives its first bucket a
    small cap (1 MiB) only when no cap was passed; passing the default 25 MiB explicitly
    merges that first bucket into the next.  A plan measured on such a copy runs on other
    buckets than the ones it was tuned for, and its time says little about the real one.
    """
    kwargs: dict[str, Any] = {}
    caps = list(getattr(ddp, "bucket_bytes_cap_list", None) or [])
    if caps:
        kwargs["bucket_cap_mb_list"] = [c / _MIB for c in caps]
    elif not getattr(ddp, "bucket_bytes_cap_default", False):
        kwargs["bucket_cap_mb"] = ddp.bucket_bytes_cap / _MIB
    for name in ("gradient_as_bucket_view", "find_unused_parameters"):
        if hasattr(ddp, name):
            kwargs[name] = getattr(ddp, name)
    if getattr(ddp, "broadcast_buffers", True) is False:  # only passed when not the default
        kwargs["broadcast_buffers"] = False
    if getattr(ddp, "static_graph", False):
        kwargs["static_graph"] = True
    if ddp.device_ids:
        kwargs["device_ids"] = ddp.device_ids
    return kwargs


def module_copy(module: torch.nn.Module) -> torch.nn.Module:
    """A deep copy of ``module`` whose ``forward`` runs the copy.

    A framework may patch ``forward`` on the instance for one call: Lightning's forward
    redirection does during every ``training_step``, which is when the online tuner's
    accuracy trial copies the model.  Such a function keeps pointing at the original
    module after a deep copy, so the copy would run the original's ``training_step``; it
    is dropped, and the copy runs its class's ``forward``.  A bound method of the module
    (Accelerate's autocast wrapper) is rebound to the copy by the deep copy and stays.
    """
    duplicate = copy.deepcopy(module)
    forward = vars(duplicate).get("forward")
    if forward is not None and getattr(forward, "__self__", None) is not duplicate:
        del vars(duplicate)["forward"]
    return duplicate


def shadow_ddp(ddp: DistributedDataParallel, bucket_cap_mb: float | None = None) -> DistributedDataParallel:
    """A copy of ``ddp``'s module (its current weights) in its own DDP wrapper, with the same buckets,
    or with buckets of ``bucket_cap_mb`` where given (a plan's rebuilt layout)."""
    module = module_copy(ddp.module)
    kwargs = bucketing_kwargs(ddp)
    if bucket_cap_mb is not None:
        kwargs.pop("bucket_cap_mb_list", None)
        kwargs["bucket_cap_mb"] = bucket_cap_mb
    with warnings.catch_warnings():  # newer PyTorch renames broadcast_buffers; same meaning
        warnings.filterwarnings("ignore", message=".*broadcast_buffers.*", category=FutureWarning)
        return DistributedDataParallel(module, process_group=ddp.process_group, **kwargs)


def shadow_of(ddp: DistributedDataParallel, optimizer: torch.optim.Optimizer | None,
              bucket_cap_mb: float | None = None):
    """A shadow DDP copy (buckets as :func:`shadow_ddp`) with a clone of ``optimizer`` (its state too), for timing steps."""
    shadow = shadow_ddp(ddp, bucket_cap_mb)
    opt = None
    if optimizer is not None:
        try:
            opt = clone_optimizer(optimizer, ddp.module, shadow.module)
        except (TypeError, ValueError):  # timing needs a step of like cost, not this exact optimizer
            opt = torch.optim.SGD(shadow.module.parameters(), lr=1e-3)
    return shadow, opt


def timed_steps(model, loss_fn: LossFn, batches: Sequence[Any], optimizer, steps: int, warmup: int,
                start: int = 0, finite: list | None = None) -> float:
    """Median seconds of ``steps`` full training steps after ``warmup`` untimed ones.

    A non-finite loss raises, unless ``finite`` is given: then ``False`` is appended to it
    and the caller decides (with the other ranks: raising on one rank only would leave the
    others waiting in a collective).
    """
    times = []
    for i in range(warmup + steps):
        batch = batches[(start + i) % len(batches)]
        t0 = time.perf_counter()
        model.zero_grad(set_to_none=True)
        loss = loss_fn(model, batch)
        loss.backward()
        if optimizer is not None:
            optimizer.step()
        if not torch.isfinite(loss.detach()).all():
            if finite is None:
                raise FloatingPointError(f"loss became {float(loss)} while measuring; the plan or the model diverges")
            finite.append(False)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure_plans(
    ddp: DistributedDataParallel,
    loss_fn: LossFn,
    batches: Sequence[Any],
    optimizer: torch.optim.Optimizer | None,
    plans: Mapping[str, Plan],
    *,
    native: bool = True,
    rounds: int = 3,
    steps: int | Mapping[str, int] = 5,
    warmup: int = 2,
    max_rounds: int | None = None,
    settled: Callable[[dict[str, list[float]]], bool] | None = None,
    group=None,
    progress: Callable[[str], None] | None = None,
) -> dict[str, list[float]]:
    """Measure plans live in interleaved rounds; every rank calls it with the same plans.

    Args:
        ddp: the user's DDP model (fp32 runs on it natively; plans on a shadow copy, built for
            the plan's bucket layout as :func:`advisor.ddp_for` builds it).
        loss_fn: ``loss_fn(model, batch) -> loss``.
        batches: training batches, cycled.
        optimizer: the training optimizer (the shadow trains with a clone of it).
        plans: ``{label: plan}`` to measure.
        native: also measure native DDP fp32, as ``"fp32"``.
        rounds: interleaved rounds (each gives one median per label).
        max_rounds, settled: after ``rounds`` rounds, another while ``settled(result)`` is
            False, up to ``max_rounds`` in all (every rank holds the same result, so every
            rank stops at the same round).
        steps: timed steps per round, or per label (slow plans need fewer steps to be
            measured well, and cost the most cluster time).
        warmup: untimed steps the first time each model runs.
        progress: ``progress(message)`` hears each plan as its round starts.

    Returns:
        ``{label: [median step seconds of each round]}``, the slowest rank's, ``"fp32"`` first.
        The user's model and optimizer end exactly as they started.

    Raises:
        ValueError: no batches, or a bad count.
        FloatingPointError: the loss became non-finite on some rank (on every rank; state restored).
    """
    batches = list(batches)
    if not batches:
        raise ValueError("measuring plans needs at least one batch")
    labels = (["fp32"] if native else []) + list(plans)
    per_label = _steps_per_label(labels, steps, rounds)
    # each plan as DDP built for its layout runs it (advisor.ddp_for): a join on a shadow whose DDP
    # makes the joined buckets itself, as the advice is run, not on the user's buckets with the
    # hook's copies; one shadow per cap, its hook switched between the plans that share it
    built = {label: built_for(plan) for label, plan in plans.items()}
    shadows: dict[float | None, tuple[DistributedDataParallel, Any, CompressionHook]] = {}
    result: dict[str, list[float]] = {label: [] for label in labels}
    try:
        for cap, plan in built.values():
            if cap not in shadows:
                shadow, shadow_opt = shadow_of(ddp, optimizer, cap)
                shadows[cap] = (shadow, shadow_opt, install(shadow, plan, group=group))
        with StateGuard(ddp.module, optimizer):
            def run(label: str, settle: int, finite: list[bool]) -> float:
                if label == "fp32":
                    return timed_steps(ddp, loss_fn, batches, optimizer, per_label[label], settle, finite=finite)
                cap, plan = built[label]
                shadow, shadow_opt, hook = shadows[cap]
                hook.set_plan(plan, reason=f"live measurement of {label}", verify=False)
                return timed_steps(shadow, loss_fn, batches, shadow_opt, per_label[label], settle, finite=finite)

            def model_of(label: str):
                return "native" if label == "fp32" else built[label][0]

            _interleaved(labels, run, model_of, result, rounds, max_rounds, settled, warmup, group, progress)
    finally:
        for _, _, hook in shadows.values():
            hook.close()
    return result


def measure_sharded_plans(
    model: torch.nn.Module,
    loss_fn: LossFn,
    batches: Sequence[Any],
    optimizer: torch.optim.Optimizer | None,
    plans: Mapping[str, Plan],
    *,
    rounds: int = 3,
    steps: int | Mapping[str, int] = 3,
    warmup: int = 2,
    max_rounds: int | None = None,
    settled: Callable[[dict[str, list[float]]], bool] | None = None,
    group=None,
    progress: Callable[[str], None] | None = None,
) -> dict[str, list[float]]:
    """:func:`measure_plans` for a sharded (FSDP2) model: every plan on the model itself.

    A sharded model cannot be deep-copied (FSDP refuses), so each plan's reduce-scatters are
    switched in and out of the user's own model (:class:`advisor.runtime.sharded.ShardedSwitch`)
    between steps, its weights and optimizer state saved before and restored after, and FSDP's
    own reduce-scatters put back.  ``plans`` maps labels to plans (plan ``none``: FSDP's own
    path).  Returns ``{label: [median step seconds of each round]}``, the slowest rank's.
    """
    from advisor.runtime.sharded import ShardedSwitch

    batches = list(batches)
    if not batches:
        raise ValueError("measuring plans needs at least one batch")
    labels = list(plans)
    per_label = _steps_per_label(labels, steps, rounds)
    switch = ShardedSwitch(model, group)
    result: dict[str, list[float]] = {label: [] for label in labels}
    try:
        with StateGuard(model, optimizer):
            def run(label: str, settle: int, finite: list[bool]) -> float:
                switch.set(plans[label])
                return timed_steps(model, loss_fn, batches, optimizer, per_label[label], settle, finite=finite)

            _interleaved(labels, run, lambda label: "model", result, rounds, max_rounds, settled, warmup, group,
                         progress)
    finally:
        switch.restore()
    return result


def _steps_per_label(labels: Sequence[str], steps: int | Mapping[str, int], rounds: int) -> dict[str, int]:
    """Each label's timed steps a round; a bad count, or a label without one, is refused."""
    per_label = dict(steps) if isinstance(steps, Mapping) else {label: steps for label in labels}
    for name, value in [("rounds", rounds)] + [(f"steps[{k}]", v) for k, v in per_label.items()]:
        check_int(name, value)
    missing = [label for label in labels if label not in per_label]
    if missing:
        raise ValueError(f"steps names no count for {missing}")
    return per_label


def _interleaved(labels: Sequence[str], run, model_of, result: dict[str, list[float]], rounds: int,
                 max_rounds: int | None, settled, warmup: int, group, progress) -> None:
    """``rounds`` interleaved rounds into ``result``, then more while ``settled(result)`` is False, up to
    ``max_rounds`` (every rank holds the same result, so every rank stops at the same round)."""
    used: set = set()
    r = 0
    while r < rounds or (settled is not None and r < (max_rounds or rounds) and not settled(result)):
        announce = (lambda label, r=r: progress(f"round {r + 1}/{max(rounds, r + 1)}: {label}")) if progress else None
        for label, seconds in _round(labels, r, run, model_of, used, warmup, group, announce).items():
            result[label].append(seconds)
        r += 1


def _round(labels: Sequence[str], index: int, run: Callable[[str, int, list[bool]], float], model_of,
           used: set, warmup: int, group, announce: Callable[[str], None] | None = None) -> dict[str, float]:
    """Round ``index``: each label's median step time, the slowest rank's.

    The round starts at label ``index`` (mod their number) and wraps: a plan that always ran
    right after the same other one would carry whatever that one leaves behind (a busy link,
    a cold cache) in every round, a bias that pairing by round cannot show.

    ``run(label, settle, finite)`` times the label's steps after ``settle`` untimed ones and
    appends whether each loss was finite.  A model's first steps include DDP's bucket
    rebuild: ``warmup`` settle steps the first time each model (``model_of(label)``) runs
    (``used`` remembers which did), afterwards one step settles a new plan.
    """
    start = index % len(labels)
    order = list(labels[start:]) + list(labels[:start])
    local, bad = {}, {}
    for label in order:
        if announce is not None:
            announce(label)
        model = model_of(label)
        settle = warmup if model not in used else min(warmup, 1)
        used.add(model)
        finite: list[bool] = []
        local[label] = run(label, settle, finite)
        bad[label] = 0.0 if all(finite) else 1.0
    # one collective carries every rank's times and non-finite flags, in the labels' own order
    merged = slowest([local[label] for label in labels] + [bad[label] for label in labels], group)
    diverged = [label for label, flag in zip(labels, merged[len(labels):]) if flag > 0]
    if diverged:
        raise FloatingPointError(
            f"the loss became NaN/Inf on some rank while measuring {', '.join(diverged)}; the model "
            "and optimizer are restored. Check the batches and learning rate (a plan whose loss "
            "diverges is unusable)")
    return dict(zip(labels, merged[: len(labels)]))
