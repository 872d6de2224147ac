"""The compression advisor as a Lightning ``Callback``.

::

    from advisor.integrations.lightning import CompressionCallback

    trainer = L.Trainer(accelerator="cpu", devices=2, strategy="ddp",
                        callbacks=[CompressionCallback(plan="plan.json")])        # a saved plan
    # or CompressionCallback(tune="autotune")  profile, search, trial and install first
    # or CompressionCallback(tune="wrap")      tune online during the first steps
    trainer.fit(module, loader)

Why a callback and not ``DDPStrategy(ddp_comm_hook=...)``: Lightning's ``DDPStrategy`` registers
a communication hook only when its root device is CUDA, and the advisor's hook needs the DDP
model itself (parameter names, buckets, the process group) before the first backward.  The
callback registers the hook on ``trainer.strategy.model`` in ``on_fit_start``, after DDP
wrapped the module and before any training step, on every device type.

Plan parameter names are the LightningModule's own (``module.named_parameters()``), as DDP
sees them.  The hook's state (error-feedback residuals, PowerSGD's memory) and the plan ride
in Lightning checkpoints through the callback's ``state_dict``; a run resumed from a checkpoint
installs the saved plan and state instead of tuning again.

**Sharded training** (``ModelParallelStrategy``, the module's ``configure_model`` calling
``fully_shard``): the same callback sets each ``fully_shard`` group's reduce-scatter
(:func:`advisor.install_sharded`), or tunes one with :func:`advisor.autotune_sharded`
(``tune="autotune"``) or :func:`advisor.wrap_sharded` (``tune="wrap"``: it races plans in the
first steps; no watch follows yet).  The accuracy trial's shadows are fresh modules:
``build=`` makes one, by default ``type(module)(**module.hparams)`` given the device mesh and
sharded by its own ``configure_model`` (so the module must ``save_hyperparameters()``).
"""

from __future__ import annotations

import contextlib
import itertools
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

try:
    from lightning.pytorch import Callback
except ImportError as exc:  # pragma: no cover - depends on the installed extras
    try:
        from pytorch_lightning import Callback
    except ImportError:
        raise ImportError(
            "advisor.integrations.lightning needs Lightning: pip install 'compression-advisor[lightning]'"
        ) from exc

import advisor
from advisor.runtime import Plan
from advisor.runtime.plan import as_plan

TUNE_MODES = (None, "autotune", "wrap")
#: tuning modes a sharded (FSDP2) model can take (all of them: wrap through advisor.wrap_sharded)
SHARDED_TUNE_MODES = (None, "autotune", "wrap")
#: the wrap options that still apply when a resumed run only watches its checkpoint's plan
WATCH_OPTIONS = ("watch_every", "backoff", "loss_z", "candidates", "group")


def training_step_loss(pl_module, precision_context: Callable[[], Any] | None = None):
    """``loss_fn(model, batch)`` for the advisor, from the LightningModule's ``training_step``.

    ``model`` is a DDP model around ``pl_module`` or around a copy of it (the accuracy trial and
    the live timing train such copies): the call goes through that DDP's forward, so DDP
    prepares its backward as in Lightning's own loop.  A sharded module (FSDP2) is its own
    model, and its ``training_step`` is called directly, as Lightning does.  Lightning does this with a private
    helper (``_ForwardRedirection``), which is why it is rewritten here: ``forward`` is
    replaced for one call by ``training_step``.  ``self.log`` is muted during the call, so
    tuning steps leave no trace in the user's metrics.
    """
    context = precision_context or contextlib.nullcontext

    def loss_fn(model, batch):
        if isinstance(model, DistributedDataParallel):
            module = model.module
            with _redirected_forward(module), _muted_logging(module), context():
                out = model(batch, 0)
        else:  # a sharded module is its own model: Lightning calls its training_step directly
            module = model
            with _muted_logging(module), context():
                out = module.training_step(batch, 0)
        loss = out.get("loss") if isinstance(out, Mapping) else out
        if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
            raise ValueError(
                f"{type(module).__name__}.training_step returned {type(out).__name__}, not a scalar loss or a dict "
                "with one under 'loss'; pass CompressionCallback(loss_fn=...) (loss_fn(model, batch) -> loss)")
        return loss

    return loss_fn


@contextlib.contextmanager
def _instance_attributes(module, **replacements) -> Iterator[None]:
    """Set attributes on this one instance for a while, then put back exactly what was there."""
    saved = {name: vars(module)[name] for name in replacements if name in vars(module)}
    for name, value in replacements.items():
        object.__setattr__(module, name, value)
    try:
        yield
    finally:
        for name in replacements:
            if name in saved:
                object.__setattr__(module, name, saved[name])
            else:
                vars(module).pop(name, None)


def _redirected_forward(module):
    original = module.forward

    def forward(*args, **kwargs):
        object.__setattr__(module, "forward", original)  # training_step may call the real forward
        return module.training_step(*args, **kwargs)

    return _instance_attributes(module, forward=forward)


def _muted_logging(module):
    def mute(*args, **kwargs):
        return None

    return _instance_attributes(module, log=mute, log_dict=mute)


class CompressionCallback(Callback):
    """Compress DDP's gradients under Lightning: install a plan, autotune one, or tune online.

    Args:
        plan: a :class:`~advisor.runtime.Plan`, its dict, or the path of a plan JSON file;
            installed as it is.  Exclusive with ``tune``.
        tune: ``"autotune"`` (:func:`advisor.autotune` before the first training step: profile,
            search, accuracy trial, live measurement, install) or ``"wrap"`` (:func:`advisor.wrap`:
            observe, trial and watch inside the first steps of ``fit``).
        loss_fn: ``loss_fn(model, batch) -> loss`` for tuning; default: the module's
            ``training_step`` (see :func:`training_step_loss`).  Needed where ``training_step``
            does not return the loss, or under manual optimization.
        batches: representative training batches for tuning; default: the first
            ``tune_batches`` batches of the trainer's train dataloader on each rank.
        tune_batches: how many batches to take from the dataloader.
        accuracy_gate: give ``wrap`` the loss and batches, so the plan it picks on speed must
            also pass the accuracy trial (``autotune`` gates unless ``accuracy_trial=False``).
        **options: more keyword arguments of ``advisor.autotune`` or ``advisor.wrap``.

    After ``fit`` starts: :attr:`hook` is the installed hook, :attr:`result` the autotune result
    (``tune="autotune"``), :attr:`tuner` the online tuner (``tune="wrap"``).

    Raises:
        ValueError: bad arguments (at construction), or a strategy other than DDP (at the start
            of ``fit``, on every rank, before any training step).
    """

    def __init__(self, plan: Plan | Mapping[str, Any] | str | None = None, *, tune: str | None = None,
                 loss_fn=None, batches: Sequence[Any] | None = None, tune_batches: int = 16,
                 accuracy_gate: bool = True, **options: Any) -> None:
        if tune not in TUNE_MODES:
            raise ValueError(f"tune={tune!r}; allowed: {', '.join(repr(m) for m in TUNE_MODES)}")
        if (plan is None) == (tune is None):
            raise ValueError("give exactly one of plan=... (install a saved plan) and tune='autotune' or 'wrap'")
        if not (isinstance(tune_batches, int) and tune_batches >= 1):
            raise ValueError(f"tune_batches={tune_batches!r}; allowed: an int >= 1")
        if plan is not None and options:
            raise ValueError(f"options {sorted(options)} are for tuning; a given plan is installed as it is")
        if "install_plan" in options:
            raise ValueError("install_plan is the callback's job; leave it out")
        self.plan, self.tune, self.loss_fn, self.batches = plan, tune, loss_fn, batches
        self.tune_batches, self.accuracy_gate, self.options = tune_batches, accuracy_gate, dict(options)
        self.hook = None
        self.result = None
        self.tuner = None
        self._restored: dict[str, Any] | None = None
        self._model = None  # the sharded model, where the strategy shards it

    # --- Lightning's hooks ---------------------------------------------------------------
    def on_fit_start(self, trainer, pl_module) -> None:
        self._model = None
        if _is_sharded(trainer):
            return self._sharded_fit_start(trainer)
        ddp = _ddp_of(trainer)
        if self.hook is not None:  # a second fit with the same callback: the model is new
            self.hook.close()
            self.hook = None
        restored, self._restored, self.result, self.tuner = self._restored, None, None, None
        if restored is not None and self.plan is not None and as_plan(self.plan).digest() != \
                Plan.from_dict(restored["plan"]).digest():
            warnings.warn("the checkpoint was trained under another plan than the one given; the given plan is "
                          "installed and the checkpoint's residuals, which belong to the other, are dropped",
                          stacklevel=2)
            restored = None
        if restored is not None:
            # a resumed run keeps the plan it was trained with (no second tuning) and each rank's residuals
            if self.tune == "wrap":
                self.tuner = advisor.wrap(ddp, _the_optimizer(trainer), plan=Plan.from_dict(restored["plan"]),
                                          **{k: v for k, v in self.options.items() if k in WATCH_OPTIONS})
                self.hook = self.tuner.hook
            else:
                self.hook = advisor.install(ddp, restored["plan"])
            if not self.hook.load_gathered_state_dict(restored):
                warnings.warn(f"the checkpoint holds the hook state of {len(restored['ranks'])} ranks, not of this "
                              "run's; the saved plan is installed with fresh residuals", stacklevel=2)
        elif self.plan is not None:
            self.hook = advisor.install(ddp, self.plan)

    def on_train_start(self, trainer, pl_module) -> None:
        if self._model is not None:
            return self._sharded_train_start(trainer, pl_module)
        if self.hook is not None or self.tune is None:
            return
        ddp = _ddp_of(trainer)
        optimizer = _the_optimizer(trainer)
        if self.tune == "autotune":
            loss_fn, batches = self._tuning_data(trainer, pl_module)
            tuned = advisor.autotune(ddp, loss_fn, batches, optimizer, **self.options)
            self.result, self.hook = tuned.document(), tuned.hook
        else:
            gate = {}
            if self.accuracy_gate:
                loss_fn, batches = self._tuning_data(trainer, pl_module)
                gate = {"loss_fn": loss_fn, "batches": batches}
            self.tuner = advisor.wrap(ddp, optimizer, **gate, **self.options)
            self.hook = self.tuner.hook

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        if self.tuner is not None:
            self.tuner.update_starts()  # Lightning's forward ran inside optimizer.step(closure)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self.tuner is None:
            return
        loss = outputs.get("loss") if isinstance(outputs, Mapping) else outputs
        if isinstance(loss, torch.Tensor) and loss.dim() == 0:
            self.tuner.record_loss(loss)  # feeds the loss watch

    # --- checkpoints -------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The plan and every rank's hook state; Lightning calls it on every rank and saves rank 0's."""
        if self._model is not None:  # sharded: the plan in use (the online tuner's, once it decided)
            from advisor.runtime.sharded import gathered_compression_state

            plan = self.tuner.plan if self.tuner is not None else self.hook.plan if self.hook is not None else None
            return gathered_compression_state(self._model, plan) if plan is not None else {}
        return self.hook.gathered_state_dict() if self.hook is not None else {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._restored = dict(state_dict) if state_dict else None

    # --- sharded training ----------------------------------------------------------------------
    def _sharded_fit_start(self, trainer) -> None:
        """Install a given plan on the sharded model before any step; a checkpoint's state arrives later
        (this strategy restores it after setup), so restoring and tuning wait for ``on_train_start``."""
        from advisor.runtime.sharded import install_sharded

        if self.tune not in SHARDED_TUNE_MODES:
            raise ValueError(f"tune={self.tune!r} cannot tune a sharded (fully_shard) model; allowed there: "
                             f"{', '.join(repr(m) for m in SHARDED_TUNE_MODES)}: tune='autotune', or plan=...")
        self._model, self.result, self.hook = trainer.strategy.model, None, None
        if self.plan is not None:
            plan = as_plan(self.plan)
            install_sharded(self._model, plan)
            self.hook = _ShardedInstalled(plan)

    def _sharded_train_start(self, trainer, pl_module) -> None:
        """Resume the checkpoint's plan and residuals (no second tuning), or tune."""
        from advisor.runtime.sharded import install_sharded, load_gathered_compression_state

        restored, self._restored = self._restored, None
        if restored is not None and not restored.get("sharded"):
            raise ValueError("the checkpoint holds a DDP hook's state, but this run shards the model; resume it "
                             "under the strategy it was saved with")
        if restored is not None:
            plan = Plan.from_dict(restored["plan"])
            if self.hook is None:
                install_sharded(self._model, plan)
                self.hook = _ShardedInstalled(plan)
            elif self.hook.plan.digest() != plan.digest():
                warnings.warn("the checkpoint was trained under another plan than the one given; the given plan is "
                              "kept and the checkpoint's residuals, which belong to the other, are dropped",
                              stacklevel=2)
                return
            if not load_gathered_compression_state(self._model, restored):
                warnings.warn(f"the checkpoint holds the compression state of {len(restored['ranks'])} ranks, not "
                              "of this run's; the saved plan is installed with fresh residuals", stacklevel=2)
            return
        if self.hook is not None or self.tune is None:
            return
        options = dict(self.options)
        build = options.pop("build", None)
        if self.tune == "autotune" or self.accuracy_gate:
            loss_fn, batches = self._tuning_data(trainer, pl_module)
            build = build or _default_build(pl_module)
        if self.tune == "autotune":
            self.result = advisor.autotune_sharded(self._model, loss_fn, batches, _the_optimizer(trainer),
                                                   build=build, **options)
            self.hook = _ShardedInstalled(self.result.installed_plan())
        else:
            gate = {"loss_fn": loss_fn, "batches": batches, "build": build} if self.accuracy_gate else {}
            self.tuner = advisor.wrap_sharded(self._model, _the_optimizer(trainer), **gate, **options)

    # --- the pieces ------------------------------------------------------------------------
    def _tuning_data(self, trainer, pl_module):
        loss_fn = self.loss_fn
        if loss_fn is None:
            if not pl_module.automatic_optimization:
                raise ValueError("under manual optimization training_step runs its own backward and step; pass "
                                 "CompressionCallback(loss_fn=...) (loss_fn(model, batch) -> loss) to tune")
            loss_fn = training_step_loss(pl_module, trainer.precision_plugin.train_step_context)
        batches = list(self.batches) if self.batches is not None else _first_batches(trainer, self.tune_batches)
        return loss_fn, batches


class _ShardedInstalled:
    """What the callback installed on a sharded model: the plan (the comms live in FSDP's groups)."""

    def __init__(self, plan: Plan) -> None:
        self.plan = plan

    def close(self) -> None:
        """Nothing to stop: the comms are called by FSDP itself."""


def _is_sharded(trainer) -> bool:
    from torch.distributed.fsdp import FSDPModule

    model = trainer.strategy.model
    return not isinstance(model, DistributedDataParallel) and any(isinstance(m, FSDPModule) for m in model.modules())


def _default_build(pl_module):
    """A fresh copy of the module for the accuracy trial: its class from its saved hyperparameters, given
    the device mesh, sharded by its own ``configure_model``."""
    if not pl_module.hparams and type(pl_module).__init__ is not object.__init__:
        import inspect

        required = [p for p in list(inspect.signature(type(pl_module).__init__).parameters.values())[1:]
                    if p.default is inspect.Parameter.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
        if required:
            raise ValueError(f"the accuracy trial builds fresh copies of {type(pl_module).__name__}, whose __init__ "
                             f"needs {[p.name for p in required]}: call self.save_hyperparameters() in it, or pass "
                             "CompressionCallback(build=...) returning a fresh sharded module")

    def build():
        fresh = type(pl_module)(**pl_module.hparams)
        fresh._device_mesh = pl_module.device_mesh
        fresh.configure_model()
        return fresh

    return build


def _ddp_of(trainer) -> DistributedDataParallel:
    model = trainer.strategy.model
    if not isinstance(model, DistributedDataParallel):
        raise ValueError(
            f"CompressionCallback compresses DistributedDataParallel's gradients, but the trainer's strategy "
            f"{type(trainer.strategy).__name__} gave a {type(model).__name__}; use strategy='ddp' (or "
            "DDPStrategy(...)) with devices >= 2, or remove the callback")
    return model


def _the_optimizer(trainer):
    optimizers = trainer.optimizers
    if len(optimizers) != 1:
        raise ValueError(f"tuning needs the one training optimizer; configure_optimizers gave {len(optimizers)}. "
                         "Install a saved plan instead: CompressionCallback(plan=...)")
    return optimizers[0]


def _first_batches(trainer, count: int) -> list[Any]:
    loader = trainer.train_dataloader
    if not hasattr(loader, "__iter__") or isinstance(loader, (Mapping, list, tuple)):
        raise ValueError(f"the train dataloader is a {type(loader).__name__}; pass CompressionCallback(batches=...) "
                         "with representative training batches")
    batches = [trainer.strategy.batch_to_device(b) for b in itertools.islice(iter(loader), count)]
    if not batches:
        raise ValueError("the train dataloader gave no batches to tune on; pass CompressionCallback(batches=...)")
    return batches
