"""The compression advisor after Hugging Face Accelerate's ``prepare``.

::

    from advisor.integrations import accelerate as compression

    accelerator = Accelerator()
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    hook = compression.install(accelerator, model, "plan.json")            # a saved plan
    # or result, hook = compression.autotune(accelerator, model, loss_fn, batches, optimizer)
    # or tuner = compression.wrap(accelerator, model, optimizer)           # tune online
    for batch in loader:                                                   # the loop, unchanged
        ...

Accelerate's own ``DistributedDataParallelKwargs(comm_hook=...)`` takes only PyTorch's built-in
hooks, so the advisor registers its hook on the prepared DDP model, before the first backward.
Each call registers the hook with ``accelerator.register_for_checkpointing``, so
``accelerator.save_state`` / ``load_state`` carry its residuals (load after the same plan is
installed).  The optimizer may be the ``AcceleratedOptimizer`` that ``prepare`` returned; the
advisor works on the torch optimizer inside it.  Launch with ``accelerate launch
--num_processes N`` (``--multi_gpu`` and ``Accelerator(cpu=True)`` give N CPU processes on gloo).
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from typing import Any

from torch.nn.parallel import DistributedDataParallel

try:
    from accelerate import Accelerator
    from accelerate.utils import DistributedType
except ImportError as exc:  # pragma: no cover - depends on the installed extras
    raise ImportError(
        "advisor.integrations.accelerate needs Accelerate: pip install 'compression-advisor[accelerate]'"
    ) from exc

import advisor
from advisor.runtime import CompressionHook, Plan

#: Accelerate's data-parallel set-ups whose prepared model is a DistributedDataParallel
DATA_PARALLEL = tuple(t for t in DistributedType if t.name.startswith("MULTI_"))


def prepared_ddp(accelerator: Accelerator, model) -> DistributedDataParallel:
    """The DDP model ``accelerator.prepare`` made, or an error that says why there is none."""
    if not isinstance(accelerator, Accelerator):
        raise TypeError(f"expected the Accelerator that prepared the model, got {type(accelerator).__name__}")
    kind = accelerator.distributed_type
    if kind not in DATA_PARALLEL:
        allowed = ", ".join(t.value for t in DATA_PARALLEL)
        raise ValueError(
            f"the accelerator runs {kind.value}; gradient compression needs DistributedDataParallel, which "
            f"Accelerate uses for {allowed}. Launch several processes (accelerate launch --num_processes N) "
            "without DeepSpeed or FSDP")
    if not isinstance(model, DistributedDataParallel):
        raise ValueError(f"got a {type(model).__name__}; pass the model that accelerator.prepare returned (a "
                         "DistributedDataParallel), before any training step")
    return model


def torch_optimizer(optimizer):
    """The torch optimizer inside Accelerate's ``AcceleratedOptimizer`` (or ``optimizer`` itself)."""
    return getattr(optimizer, "optimizer", optimizer) if optimizer is not None else None


class CheckpointedHook:
    """What ``register_for_checkpointing`` holds for a hook: every rank's state (Accelerate saves
    the main process's objects only, and residuals are rank-local)."""

    def __init__(self, hook: CompressionHook) -> None:
        self.hook = hook

    def state_dict(self):
        return self.hook.gathered_state_dict()

    def load_state_dict(self, state) -> None:
        if not self.hook.load_gathered_state_dict(state):
            warnings.warn(f"the saved hook state is of {len(state['ranks'])} processes, not of this run's; the "
                          "residuals start from zero", stacklevel=2)


def install(accelerator: Accelerator, model, plan: Plan | Mapping[str, Any] | str) -> CompressionHook:
    """Install a saved plan on the prepared model; every process calls it.

    Args:
        accelerator: the multi-process :class:`accelerate.Accelerator`.
        model: the model ``accelerator.prepare`` returned.
        plan: a :class:`~advisor.runtime.Plan`, its dict, or the path of its JSON file.

    Returns:
        The installed hook, registered so ``save_state``/``load_state`` keep every rank's residuals.

    Raises:
        ValueError: no DDP model (the message names Accelerate's set-up), or an invalid plan
            (on every process, before the first step).
    """
    hook = advisor.install(prepared_ddp(accelerator, model), plan)
    accelerator.register_for_checkpointing(CheckpointedHook(hook))
    return hook


def autotune(accelerator: Accelerator, model, loss_fn, batches: Sequence[Any], optimizer=None, **options: Any):
    """:func:`advisor.autotune` on the prepared model; every process calls it.

    Args:
        accelerator: the multi-process :class:`accelerate.Accelerator`.
        model: the model ``accelerator.prepare`` returned.
        loss_fn: ``loss_fn(model, batch) -> loss``, as for :func:`advisor.autotune`.
        batches: training batches on the accelerator's device.
        optimizer: the prepared optimizer (its torch optimizer is used).
        **options: more keyword arguments of :func:`advisor.autotune`.

    Returns:
        ``(result, hook)``: the :class:`~advisor.tuning.results.AutotuneResult` and the
        installed hook (registered for checkpoints), or None where the advice is native fp32.

    Raises:
        ValueError: no DDP model (the message names Accelerate's set-up), or a bad argument
            of autotune, on every process before any work.
    """
    tuned = advisor.autotune(prepared_ddp(accelerator, model), loss_fn, batches, torch_optimizer(optimizer),
                             **options)
    if tuned.hook is not None:
        accelerator.register_for_checkpointing(CheckpointedHook(tuned.hook))
    return tuned.document(), tuned.hook


def wrap(accelerator: Accelerator, model, optimizer=None, **options: Any):
    """:func:`advisor.wrap` on the prepared model, before the first step; every process calls it.

    Args:
        accelerator: the multi-process :class:`accelerate.Accelerator`.
        model: the model ``accelerator.prepare`` returned.
        optimizer: the prepared optimizer (its torch optimizer is timed).
        **options: more keyword arguments of :func:`advisor.wrap`.

    Returns:
        The :class:`~advisor.tuning.online.OnlineTuner`; its hook is registered for
        checkpoints.  Call ``tuner.record_loss(loss)`` once a step for the loss watch.

    Raises:
        ValueError: no DDP model, or a bad argument of wrap, before any step.
    """
    tuner = advisor.wrap(prepared_ddp(accelerator, model), torch_optimizer(optimizer), **options)
    accelerator.register_for_checkpointing(CheckpointedHook(tuner.hook))
    return tuner
