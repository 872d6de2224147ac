"""Phase 1 of the online tuner: observe real training steps, then profile from them."""

from __future__ import annotations

import statistics
import time

import torch
from torch.nn.parallel import DistributedDataParallel

from advisor.compressors import SegmentLayout
from advisor.core.collectives import slowest, world_size
from advisor.runtime import CompressionHook
from profilers.cluster import environment_of, shared_forms, slowest_kernels
from profilers.compute import copy_rate, ddp_buckets, layer_costs, layer_of
from profilers.fidelity import fidelity_of
from profilers.kernels import profile_kernels
from profilers.network import NETWORK_REUSE_S, profile_network, reduction_dtypes_of
from profilers.profile import Bucket, ClusterProfile, ComputeProfile, ParameterTiming

OBSERVE = "observe"


class Observation:
    """Records what a cluster profile needs from the user's own steps under fp32.

    Per step: when it starts, how long its forward takes, when each parameter's gradient is
    ready (post-accumulate hooks, from the forward's end), how long the optimizer's update
    takes; and each hook segment's local gradients (after DDP's bucket rebuild), to replay
    fidelity on.  :meth:`profile` turns them into a :class:`ClusterProfile` on every rank.
    """

    name = OBSERVE

    def __init__(self, ddp: DistributedDataParallel, hook: CompressionHook) -> None:
        self.ddp, self.hook = ddp, hook
        self.starts: list[float] = []
        self.forward_s: list[float] = []
        self.optimizer_s: list[float] = []
        #: per step, each parameter's gradient-ready time (seconds after the forward ended)
        self.ready_runs: list[dict[str, float]] = []
        #: per hook segment (its parameter names), the local gradients of every observed step
        self.grads: dict[tuple[str, ...], list[torch.Tensor]] = {}
        self._ready: dict[str, float] = {}
        self._forward_end = 0.0
        self._handles: list = []
        self._observer = None

    def start(self) -> None:
        """Register the gradient-ready stamps and the gradient capture."""
        named = [(n, p) for n, p in self.ddp.module.named_parameters() if p.requires_grad]

        def stamp(name):
            def record(_param):
                self._ready[name] = time.perf_counter() - self._forward_end
            return record

        self._handles = [p.register_post_accumulate_grad_hook(stamp(n)) for n, p in named]

        def capture(layout: SegmentLayout, grad: torch.Tensor, config) -> None:
            if len(self.starts) >= 2:  # after DDP's bucket rebuild
                self.grads.setdefault(layout.names, []).append(grad.detach().clone())

        self._observer = capture
        self.hook.observers.append(capture)

    def stop(self) -> None:
        """Remove the stamps and the capture; what was recorded stays."""
        for h in self._handles:
            h.remove()
        self._handles = []
        if self._observer is not None and self._observer in self.hook.observers:
            self.hook.observers.remove(self._observer)
        self._observer = None

    close = stop

    def step_starts(self, now: float) -> int:
        """A training step starts; returns how many have started under observation."""
        if self._ready:
            self.ready_runs.append(dict(self._ready))
            self._ready.clear()
        self.starts.append(now)
        return len(self.starts) - 1

    def forward_ends(self, now: float) -> None:
        self._forward_end = now
        if self.starts:
            self.forward_s.append(now - self.starts[-1])

    def optimizer_ran(self, seconds: float) -> None:
        self.optimizer_s.append(seconds)

    def profile(self, candidates: list[str], group=None) -> ClusterProfile:
        """The cluster profile: compute from the observed steps, the rest measured briefly now."""
        world = world_size(group)
        named = [(n, p) for n, p in self.ddp.module.named_parameters() if p.requires_grad]
        names = [n for n, _ in named]
        runs = self.ready_runs[1:] or self.ready_runs  # the first step includes DDP's set-up
        forward = statistics.median(self.forward_s[1:] or self.forward_s)
        backward = statistics.median(max(r.values()) for r in runs)
        optimizer = statistics.median(self.optimizer_s[1:]) if len(self.optimizer_s) > 1 else 0.0
        local = [forward, backward, optimizer, copy_rate(named)]
        local += [statistics.median(r.get(n, backward) for r in runs) for n in names]
        merged = slowest(local, group)
        ready = dict(zip(names, merged[4:]))
        buckets = ddp_buckets(self.ddp, None, None) if self._rebuilt() else self._segments_as_buckets()
        shapes = {n: p.shape for n, p in named}
        compute = ComputeProfile(
            forward_s=merged[0], backward_s=merged[1], optimizer_s=merged[2], steps=len(runs),
            parameters=[ParameterTiming(n, layer_of(n), shapes[n].numel(), list(shapes[n]), ready[n]) for n in names],
            layer_backward_s=layer_costs(ready, names), buckets=buckets, copy_s_per_byte=merged[3],
        )
        network = profile_network(group=group, budget_s=8.0, max_op_s=0.3, repeats=2, reuse_within_s=NETWORK_REUSE_S,
                                  reduction_dtypes=reduction_dtypes_of(candidates, world))
        layouts = [SegmentLayout(tuple(b.parameters), tuple(tuple(shapes[n]) for n in b.parameters)) for b in buckets]
        configs = [c for c in candidates if c != "none"]
        device = next(self.ddp.module.parameters()).device
        forms, form_seconds = shared_forms(device, group)
        kernels = slowest_kernels(profile_kernels(layouts, configs, world_size=world, device=device,
                                                  ladder=(1 << 14, 1 << 17, 1 << 20), repeats=3, forms=forms,
                                                  form_seconds=form_seconds), group)
        streams = [self.grads.get(layout.names) or [] for layout in layouts]
        fidelity = fidelity_of(streams, layouts, buckets, configs,
                               steps=len(next(iter(self.grads.values()), [])), group=group)
        environment = environment_of(self.ddp, group, "online, inside the training loop")
        return ClusterProfile(environment=environment, compute=compute, network=network, kernels=kernels,
                              fidelity=fidelity)

    def _rebuilt(self) -> bool:
        return bool(self.ddp._get_ddp_logging_data().get("rebuilt_per_bucket_param_indices"))

    def _segments_as_buckets(self) -> list[Bucket]:
        params = dict(self.ddp.module.named_parameters())
        return [Bucket(i, list(names), sum(params[n].numel() for n in names)) for i, names in enumerate(self.grads)]
