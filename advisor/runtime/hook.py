"""The DDP communication hook that executes a :class:`Plan`.

``install(ddp_model, plan)`` validates the plan on every rank, checks that all ranks hold
the same plan, and registers :func:`compression_hook` with a :class:`CompressionHook`
state object.  For each bucket the hook splits the bucket's flat buffer into segments of
consecutive parameters that share a compressor, and hands one job to the process's
ordered channel (see ``channel.py``): per segment, what crosses the wire is whatever that
segment's compressor sends, plus one flag element (see ``segment.py``).

Where the plan has a bucket layout (``Plan.exchange_mb``), the hook holds buckets back
and hands them over as one job once they hold that many MiB (or at the iteration's last
bucket): their buffers are copied side by side, so a compressor makes one round for all
of them (PowerSGD one P and one Q all-reduce), and each bucket's part of the result is
copied back into its own buffer.  Every rank sees the same buckets in the same order, so
every rank forms the same groups.
"""

from __future__ import annotations

import functools
import logging
import warnings
import weakref
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from advisor.compressors.base import Collective, Compressor, ExchangeContext, Message, SegmentLayout
from advisor.compressors.registry import CompressorConfig
from advisor.core.collectives import every_rank, rank, world_size
from advisor.runtime.channel import Job, LocalChannel, OrderedExecutor, ProcessGroupChannel
from advisor.runtime.plan import Plan, as_plan
from advisor.runtime.segment import ResidualStore, guarded_exchange

log = logging.getLogger("advisor.runtime")

STATE_VERSION = 1
_UNCOMPRESSED = CompressorConfig("none")


class CompressionHook:
    """State of the hook on one rank: plan, compressors, residuals, step counter.

    Construct through :func:`install`.  ``step`` counts synchronised backward passes
    (it advances when the last bucket of an iteration is handed over).
    """

    def __init__(self, plan: Plan, parameter_names: Mapping[int, str], group=None) -> None:
        self.plan = plan
        self.group = group
        self.world_size = world_size(group)
        self.rank = rank(group)
        self.step = 0
        self.nonfinite_events = 0
        self._names = dict(parameter_names)
        self._compressors: dict[CompressorConfig, Compressor] = {}
        self._compressor_state: dict[str, Any] = {}
        self._residuals = ResidualStore()
        self._layouts: dict[tuple[int, ...], list[tuple[SegmentLayout, CompressorConfig, int]]] = {}
        self._workspaces: dict[tuple[str, ...], dict] = {}
        #: buckets the plan's layout holds back for a joint exchange: (buffer, parameters, DDP's future)
        self._held: list[tuple[torch.Tensor, list, torch.futures.Future]] = []
        self._held_bytes = 0
        #: work handles of all-reduces issued directly (plans that compress nothing), kept until the
        #: iteration after theirs so that gloo's thread never drops the last reference (channel.py)
        self._direct_works: list = []
        self._direct_works_before: list = []
        self._uncompressed = self._compresses_nothing(plan)
        #: whether some parameter has sparse gradients: their buckets go through the channel, so
        #: every bucket must (one thread issues the hook's collectives, in one order)
        self.sparse_gradients = False
        #: residuals of parameters whose new config has no error feedback, delivered
        #: (added to the gradient) on their next step so no update is lost
        self._pending: dict[str, torch.Tensor] = {}
        #: (step, plan digest, reason) for every plan this hook has run
        self.plan_history: list[tuple[int, str, str]] = [(0, plan.digest(), "installed")]
        #: callables ``(layout, local_gradient, config)`` shown each segment before it is
        #: exchanged (profilers and the online tuner watch gradients this way); they must
        #: copy what they keep
        self.observers: list = []
        #: callables ``(layout, delivered_mean, config)`` shown each segment's result once its
        #: bucket's exchange is done, before DDP sees it (the fidelity monitor compares it with
        #: the exact mean); they must copy what they keep
        self.deliveries: list = []
        channel = ProcessGroupChannel(traffic_group(group)) if self.world_size > 1 else LocalChannel()
        self.channel = channel
        self._executor = OrderedExecutor(channel, threaded=self.world_size > 1)
        # the worker stops when this state goes (its DDP model collected), at exit, or on close()
        self._release = weakref.finalize(self, self._executor.close)

    def __enter__(self) -> CompressionHook:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # --- per bucket ---------------------------------------------------------------
    def _compressor(self, config: CompressorConfig) -> Compressor:
        comp = self._compressors.get(config)
        if comp is None:
            comp = self._compressors[config] = config.build()
        return comp

    def segments(self, parameters) -> list[tuple[SegmentLayout, CompressorConfig, int]]:
        """Runs of consecutive parameters with the same compressor, with their offsets."""
        key = tuple(id(p) for p in parameters)
        cached = self._layouts.get(key)
        if cached is not None:
            return cached
        names = [self._names.get(id(p)) for p in parameters]
        if None in names:
            raise RuntimeError("a DDP bucket holds a parameter the hook was not installed with")
        result, offset = [], 0
        for run_names, run_shapes, config in self.plan.runs(names, [tuple(p.shape) for p in parameters]):
            layout = SegmentLayout(tuple(run_names), tuple(run_shapes))
            result.append((layout, config, offset))
            offset += layout.numel
        self._layouts[key] = result
        return result

    def _compresses_nothing(self, plan: Plan) -> bool:
        return plan.exchange_mb is None and all(
            c.name == "none" and not self._compressor(c).error_feedback for c in plan.configs())

    def direct_future(self, bucket) -> torch.futures.Future | None:
        """Under a plan that compresses nothing, the bucket's all-reduce issued here, as PyTorch's
        ``allreduce_hook`` does (the mean, in fp32, in place); None where the channel must carry it.

        Safe to bypass the channel: every rank takes this path for every bucket of the iteration,
        in DDP's bucket order, and the channel is idle between iterations (plans change only then).
        Issued on DDP's own group, from the thread that runs backward, in order with DDP's and the
        user's collectives there, as PyTorch's hooks are: the hooks' second group (``traffic_group``)
        was measurably slower (docs/benchmarks.md, the hook's own cost).
        """
        if not self._uncompressed or self.world_size == 1 or self.deliveries or self._held or self.sparse_gradients:
            return None
        buffer = bucket.buffer()
        if self._pending or self.observers:
            for layout, config, offset in self.segments(bucket.parameters()):
                self._before_exchange(layout, buffer[offset : offset + layout.numel], config)
        buffer.mul_(1.0 / self.world_size)
        self.channel.messages_sent += 1
        self.channel.bytes_sent += buffer.numel() * buffer.element_size()
        work = dist.all_reduce(buffer, group=self.group, async_op=True)
        self._direct_works.append(work)
        if bucket.is_last():
            self._direct_works_before, self._direct_works = self._direct_works, []
        return work.get_future().then(_first_value)

    def take_bucket(self, bucket) -> tuple[list[Job], torch.futures.Future]:
        """The jobs to hand to the channel now, in order (none while the plan's layout holds
        ``bucket`` back for a joint exchange), and the future DDP waits on for ``bucket``."""
        buffer = bucket.buffer()
        last = bucket.is_last()
        if buffer.is_sparse:
            # a sparse bucket crosses alone; buckets held before it go first, in the same order on every rank
            held = self._flush_held(last=False)
            job = self._sparse_job(buffer, last)
            return [job] if held is None else [held, job], job.future
        if self.plan.exchange_mb is None and not self._held:
            job = self._dense_job(buffer, bucket.parameters(), last)
            return [job], job.for_ddp if job.for_ddp is not None else job.future
        waits: torch.futures.Future = torch.futures.Future()
        self._held.append((buffer, bucket.parameters(), waits))
        self._held_bytes += buffer.numel() * buffer.element_size()
        cap = (self.plan.exchange_mb or 0.0) * (1 << 20)
        if not last and self._held_bytes < cap:
            return [], waits
        return [self._flush_held(last)], waits

    def _flush_held(self, last: bool) -> Job | None:
        """One job for the held buckets: their buffers side by side in one (a copy), exchanged as
        one bucket; each bucket's slice of the result is copied back into its own buffer."""
        held, self._held, self._held_bytes = self._held, [], 0
        if not held:
            return None
        buffers = [b for b, _, _ in held]
        joint = buffers[0] if len(held) == 1 else torch.cat(buffers)
        job = self._dense_job(joint, [p for _, params, _ in held for p in params], last)
        done = job.for_ddp if job.for_ddp is not None else job.future
        offset = 0
        for buffer, _, waits in held:
            done.add_done_callback(functools.partial(_pass_slice, waits, buffer, offset))
            offset += buffer.numel()
        return job

    def _dense_job(self, buffer: torch.Tensor, parameters, last: bool) -> Job:
        fut: torch.futures.Future = torch.futures.Future()
        warming_up = self.step < self.plan.warmup_steps
        exchanges, delivered = [], []
        for layout, config, offset in self.segments(parameters):
            if warming_up:
                config = _UNCOMPRESSED
            delivered.append((layout, config, offset))
            compressor = self._compressor(config)
            ctx = ExchangeContext(
                self.world_size,
                step=self.step,
                seed=self.plan.seed,
                rank=self.rank,
                workspace=self._workspaces.setdefault(layout.names, {}),
                forms=self.plan.kernel_forms,
            )
            residuals = self._residuals if compressor.error_feedback else None
            grad = buffer[offset : offset + layout.numel]
            self._before_exchange(layout, grad, config)
            exchanges.append(
                guarded_exchange(
                    compressor, grad, layout, self._compressor_state, residuals, ctx, self._count_nonfinite
                )
            )
        job = Job(exchanges, fut, buffer, ends_iteration=last)
        if self.deliveries:
            # chained, not a done-callback: DDP must not go on before the deliveries were shown
            job.for_ddp = fut.then(lambda done: self._show_deliveries(done.value(), delivered))
        return job

    def _show_deliveries(self, buffer: torch.Tensor, segments) -> torch.Tensor:
        for layout, config, offset in segments:
            for show in self.deliveries:
                show(layout, buffer[offset : offset + layout.numel], config)
        return buffer

    def _sparse_job(self, grad: torch.Tensor, last: bool) -> Job:
        """A sparse gradient (``nn.Embedding(sparse=True)``) crosses uncompressed, as in PyTorch's
        ``allreduce_hook``: DDP gives it a bucket of its own, and the compressors slice dense
        buffers.  gloo all-reduces the coalesced indices and values in place."""
        mean = grad.coalesce()
        if self.world_size > 1:
            mean.mul_(1.0 / self.world_size)
        return Job([_sparse_sum(mean)], torch.futures.Future(), mean, ends_iteration=last)

    def _before_exchange(self, layout: SegmentLayout, grad: torch.Tensor, config: CompressorConfig) -> None:
        """A segment's gradient, before it crosses: residuals left by a plan change go in, then observers see it."""
        if self._pending:
            self._deliver_pending(layout, grad)
        for observe in self.observers:
            observe(layout, grad, config)

    def _deliver_pending(self, layout: SegmentLayout, grad: torch.Tensor) -> None:
        for name, view in zip(layout.names, layout.views(grad)):
            pending = self._pending.pop(name, None)
            if pending is not None:
                view.add_(pending.view_as(view))

    # --- changing plans -------------------------------------------------------------
    def set_plan(self, plan: Plan | Mapping[str, Any] | str | Path, reason: str = "", verify: bool = True) -> None:
        """Run ``plan`` from the next iteration on; call on every rank between iterations.

        Residuals stay with their parameters when the new config also uses error feedback;
        otherwise they are added to that parameter's next gradient, so no update is lost.

        Args:
            plan: a :class:`Plan`, its dict, or the path of its JSON file.
            reason: kept in :attr:`plan_history` and logged.
            verify: compare the plan's digest across ranks (one small collective).

        Raises:
            ValueError: a malformed plan, one naming parameters the model lacks, or (with
                ``verify``) ranks given different plans; on every rank, the plan unchanged.
        """
        plan = as_plan(plan)
        plan.check_against(self._names.values())
        if verify:
            digests = every_rank(plan.digest(), self.group)
            if len(set(digests)) > 1:
                raise ValueError(f"ranks switched to different plans (digests by rank: {digests}); plan unchanged")
        for name, residual in list(self._residuals.state_dict().items()):
            if not self._compressor(plan.config_for(name)).error_feedback:
                self._pending[name] = residual
        self._residuals.drop([n for n in self._pending])
        self.plan = plan
        self._uncompressed = self._compresses_nothing(plan)
        self._layouts.clear()
        self.plan_history.append((self.step, plan.digest(), reason))
        log.info("plan changed at step %d (%s): %s", self.step, reason or "no reason given", plan.digest())

    def _count_nonfinite(self, layout: SegmentLayout, step: int) -> None:
        self.nonfinite_events += 1

    # --- checkpointing ------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Residuals, compressor memory (PowerSGD's Q) and counters, keyed by parameter name."""
        return {
            "version": STATE_VERSION,
            "plan_digest": self.plan.digest(),
            "step": self.step,
            "nonfinite_events": self.nonfinite_events,
            "residuals": self._residuals.state_dict(),
            "pending": {name: t.detach().clone() for name, t in self._pending.items()},
            "compressor_state": {
                key: {name: t.detach().clone() for name, t in per_name.items()}
                for key, per_name in self._compressor_state.items()
            },
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what :meth:`state_dict` saved, under the same plan.

        Raises:
            ValueError: another state version, another plan's state, or parameters this
                model does not have; nothing is changed.
        """
        if not isinstance(state, Mapping) or state.get("version") != STATE_VERSION:
            got = state.get("version") if isinstance(state, Mapping) else type(state).__name__
            raise ValueError(f"hook state version {got!r} is not supported; expected {STATE_VERSION}")
        if state.get("plan_digest") != self.plan.digest():
            raise ValueError(
                f"hook state was saved under plan {state.get('plan_digest')} but plan "
                f"{self.plan.digest()} is installed; load it with the same plan"
            )
        known = set(self._names.values())
        names = set(state["residuals"]) | {n for d in state["compressor_state"].values() for n in d}
        unknown = sorted(names - known)
        if unknown:
            raise ValueError(f"hook state has parameters missing from the model: {unknown[:5]}")
        self.step = int(state["step"])
        self.nonfinite_events = int(state.get("nonfinite_events", 0))
        self._residuals.load_state_dict(state["residuals"])
        self._pending = {name: t.detach().clone() for name, t in state.get("pending", {}).items()}
        self._compressor_state = {
            key: {name: t.detach().clone() for name, t in per_name.items()}
            for key, per_name in state["compressor_state"].items()
        }

    def gathered_state_dict(self) -> dict[str, Any]:
        """The plan and every rank's :meth:`state_dict`; collective, so every rank calls it.

        Residuals are rank-local, but Lightning's and Accelerate's checkpoints keep rank 0's
        objects only; this gathers them all, so each rank can take its own back.
        """
        return {"version": STATE_VERSION, "plan": self.plan.to_dict(), "ranks": every_rank(self.state_dict(), self.group)}

    def load_gathered_state_dict(self, gathered: Mapping[str, Any]) -> bool:
        """Load this rank's part of :meth:`gathered_state_dict`; False (nothing loaded) where the
        world size changed since it was saved: the residuals then start from zero."""
        if not isinstance(gathered, Mapping) or gathered.get("version") != STATE_VERSION or "ranks" not in gathered:
            raise ValueError("not a gathered hook state (expected the dict of CompressionHook.gathered_state_dict)")
        states = gathered["ranks"]
        if len(states) != self.world_size:
            return False
        self.load_state_dict(states[self.rank])
        return True

    def residual_norm(self) -> float:
        return self._residuals.norm()

    def close(self) -> None:
        """Stop the channel's worker; the DDP model must not run backward under this hook again."""
        self._release()


def compression_hook(state: CompressionHook, bucket):  # no annotations: DDP checks them by value
    """DDP comm hook: encode the bucket, hand its collectives to the ordered channel.

    Register it with ``ddp.register_comm_hook(state, compression_hook)`` (what :func:`install`
    does, after checking the plan on every rank).

    Args:
        state: the :class:`CompressionHook` holding the plan, the residuals and the channel.
        bucket: DDP's ``GradBucket`` (DDP passes it by the name ``bucket``).

    Returns:
        A ``torch.futures.Future`` that yields the bucket's mean gradient.

    Raises:
        RuntimeError: through the future, where a collective or a compressor failed; the
            message names the bucket and the step.
    """
    # take_bucket encodes here, on the thread that runs backward, as PyTorch's own hooks do:
    # encoding competes with backward for the device either way, and on CPU a second busy
    # thread per rank only adds contention.  Only the collectives go to the channel.
    direct = state.direct_future(bucket)
    if direct is not None:
        if bucket.is_last():
            state.step += 1
        return direct
    jobs, waits = state.take_bucket(bucket)
    for job in jobs:
        if job.ends_iteration:
            state.step += 1
        state._executor.submit(job)
    return waits


def _pass_slice(waits: torch.futures.Future, buffer: torch.Tensor, offset: int, done: torch.futures.Future) -> None:
    """Complete a held bucket's future with its slice of the joint result, copied back into the
    bucket's own buffer (DDP reads a hook's result at the bucket's offsets from the start of the
    tensor's storage, so a slice of a larger tensor cannot be handed over); or with the failure."""
    try:
        result = done.value()
        if result.data_ptr() != buffer.data_ptr():
            buffer.copy_(result[offset : offset + buffer.numel()])
        waits.set_result(buffer)
    except Exception as exc:  # the exchange failed: every held bucket's future carries why
        waits.set_exception(exc)


def _first_value(done: torch.futures.Future) -> torch.Tensor:
    return done.value()[0]


def _sparse_sum(grad: torch.Tensor):
    yield Message(grad, Collective.ALL_REDUCE_SUM, last=True)


#: the hooks' own process group per user group (keyed by the group's ranks and backend)
_TRAFFIC_GROUPS: dict[tuple, Any] = {}


def traffic_group(group=None):
    """A process group of ``group``'s ranks that carries only the hooks' collectives; made once.

    The hook's rounds are issued from the channel's thread while DDP (the used-parameter map
    of ``find_unused_parameters``, ``static_graph``'s checks) and the user (an all-reduce of
    the loss) issue collectives on ``group`` from the training thread.  On one group the two
    streams can interleave in a different order on each rank, and gloo then matches the
    wrong messages; on two groups each stream keeps its own order.  Every rank of ``group``
    makes its first hook at the same point (:func:`install` is collective), so they create
    it together.
    """
    ranks = tuple(dist.get_process_group_ranks(group if group is not None else dist.group.WORLD))
    key = (ranks, str(dist.get_backend(group)))
    made = _TRAFFIC_GROUPS.get(key)
    if made is None:
        made = _TRAFFIC_GROUPS[key] = dist.new_group(list(ranks), backend=key[1], use_local_synchronization=True)
    return made


def sparse_parameters(module: torch.nn.Module) -> list[str]:
    """Names of parameters whose gradients are sparse (``nn.Embedding(sparse=True)`` and kin): they
    cross uncompressed, so the profilers and policies leave them out."""
    names = []
    for prefix, sub in module.named_modules():
        if isinstance(sub, (torch.nn.Embedding, torch.nn.EmbeddingBag)) and sub.sparse:
            names += [f"{prefix}.{n}" if prefix else n for n, p in sub.named_parameters(recurse=False)
                      if p.requires_grad]
    return names


def _trainable_names(module: torch.nn.Module) -> dict[int, str]:
    return {id(p): name for name, p in module.named_parameters() if p.requires_grad}


def warn_if_buckets_differ(ddp_model: DistributedDataParallel, plan: Plan) -> None:
    """Warn where ``plan`` was tuned for DDP buckets of another size than ``ddp_model`` was built with:
    it runs, but not at the speed it was measured at (only DDP can make its buckets smaller)."""
    if plan.bucket_cap_mb is None:
        return
    built = getattr(ddp_model, "bucket_bytes_cap", 0)
    built_mb = built / (1 << 20)
    explicit = not getattr(ddp_model, "bucket_bytes_cap_default", False)
    if explicit and built == int(plan.bucket_cap_mb * (1 << 20)):  # DDP's own rounding of the cap
        return
    warnings.warn(f"the plan was tuned for DDP built with bucket_cap_mb={plan.bucket_cap_mb:g}, this DDP model "
                  f"has {'the default ' if not explicit else ''}{built_mb:.4g} MiB buckets: the plan runs, but not "
                  f"at the speed it was measured at. Build DDP with advisor.ddp_for(module, plan) (or "
                  f"DistributedDataParallel(module, bucket_cap_mb={plan.bucket_cap_mb:g}))", stacklevel=3)


def install(
    ddp_model: DistributedDataParallel, plan: Plan | Mapping[str, Any] | str | Path, group=None
) -> CompressionHook:
    """Validate ``plan`` on every rank and register the compression hook; call before the first backward.

    Args:
        ddp_model: the DDP model whose gradients the plan compresses.
        plan: a :class:`Plan`, its dict, or the path of its JSON file.
        group: the process group DDP uses (default: the world).

    Returns:
        The installed :class:`CompressionHook` (a context manager; ``state_dict`` for checkpoints).

    Raises:
        TypeError: ``ddp_model`` is not a DistributedDataParallel.
        ValueError: on every rank (never on some only, which would hang the others) when any
            rank's plan cannot be read, is invalid for the model, or differs from the others'.
        RuntimeError: DDP already has a communication hook.
    """
    if not isinstance(ddp_model, DistributedDataParallel):
        raise TypeError(
            f"install() needs a torch.nn.parallel.DistributedDataParallel model, got {type(ddp_model).__name__}"
        )
    names = _trainable_names(ddp_model.module)
    error, digest = None, None
    try:
        plan = as_plan(plan)
        plan.check_against(names.values())
        digest = plan.digest()
    except (ValueError, TypeError) as exc:
        error = str(exc)
    if world_size(group) > 1:
        everyone = every_rank({"error": error, "digest": digest, "rank": rank(group)}, group)
        errors = [f"rank {e['rank']}: {e['error']}" for e in everyone if e["error"]]
        if errors:
            raise ValueError("invalid plan: " + "; ".join(errors))
        digests = {e["rank"]: e["digest"] for e in everyone}
        if len(set(digests.values())) > 1:
            raise ValueError(
                f"ranks hold different plans (digests by rank: {digests}); "
                "give every rank the same plan file"
            )
    elif error:
        raise ValueError(f"invalid plan: {error}")
    sparse = sparse_parameters(ddp_model.module)
    if sparse:
        log.info("parameters %s have sparse gradients: they cross uncompressed, whatever the plan says", sparse)
    warn_if_buckets_differ(ddp_model, plan)
    state = CompressionHook(plan, names, group)
    state.sparse_gradients = bool(sparse)
    try:
        ddp_model.register_comm_hook(state, compression_hook)
    except RuntimeError as exc:
        raise RuntimeError(
            f"could not register the compression hook: {exc}. DDP takes one hook per model, "
            "registered before the first backward pass; wrap a fresh DDP model"
        ) from exc
    return state
