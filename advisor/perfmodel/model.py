"""Replay a DDP iteration for any plan from a ClusterProfile, and ask what-if questions.

The iteration, as the runtime executes it (and as the seed paper models it, plus encode
and decode):

* forward, then backward; each bucket becomes ready when its last gradient is ready
  (measured);
* the bucket is encoded on the thread that runs backward (the runtime encodes in the hook),
  so every encode delays the rest of backward: compressors compete with backward;
* collectives go through one channel in bucket order; a bucket's messages cost what the
  fitted collective model says for their bytes and type (ring all-reduce: the bandwidth
  term hardly grows with the number of workers; all-gather: it grows linearly);
* decode follows the collective on the communication side, in bucket order;
* DDP copies each gradient into its bucket as it becomes ready (on the backward thread)
  and every averaged bucket back into the gradients at the end, at the measured copy rate;
* on a host that computes on its CPU, a collective running while backward runs takes its
  measured CPU time (gloo's threads, the kernel's network stack) from backward, in
  proportion to how much of it overlaps backward: over loopback nearly all of a
  collective's time is CPU time, so "overlapped" communication is not free there;
* the optimizer runs when backward and every decode are done.

Every message round also costs ``round_s`` beyond the network fit: the fits time ops back
to back, with the ranks arriving together and their threads awake, while in a step each
round follows compute of its own, so ranks arrive apart and wake from idle.  The network
profiler measures it (``NetworkProfile.round_s``).

Two calibration terms are learned from measured step times by
:meth:`PerformanceModel.calibrate`, not guessed: ``overlap`` stretches the
backward-and-communication part (imperfect overlap; 1.0 until calibrated), and
``round_s`` replaces the profiled per-round cost.

Everything is vectorised over plans: ``predict_many`` takes a (plans x buckets) matrix of
config indices and loops over buckets only.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from advisor.compressors import Collective, SegmentLayout, parse
from advisor.compressors.registry import CompressorConfig
from advisor.perfmodel.buckets import buckets_for_cap
from advisor.perfmodel.timeline import BucketSpan, Timeline
from advisor.runtime.plan import Plan, check_layout_mb, exchange_groups


@dataclass(frozen=True)
class Scenario:
    """A what-if: the same profile on another cluster.

    ``world_size``: workers (1 to 1024); ``bandwidth_bps`` / ``latency_s``: per-link rate
    and per-hop latency; ``compute_speedup``: a device that many times faster (compute and
    compressor kernels scale, the network does not).
    """

    world_size: int | None = None
    bandwidth_bps: float | None = None
    latency_s: float | None = None
    compute_speedup: float = 1.0

    def __post_init__(self) -> None:
        if self.world_size is not None and not (isinstance(self.world_size, int) and 1 <= self.world_size <= 1024):
            raise ValueError(f"world_size={self.world_size!r}; allowed: an integer in 1..1024")
        if self.bandwidth_bps is not None and not self.bandwidth_bps > 0:
            raise ValueError(f"bandwidth_bps={self.bandwidth_bps!r}; allowed: > 0")
        if self.latency_s is not None and not self.latency_s >= 0:
            raise ValueError(f"latency_s={self.latency_s!r}; allowed: >= 0")
        if not self.compute_speedup > 0:
            raise ValueError(f"compute_speedup={self.compute_speedup!r}; allowed: > 0")


def _ring_share(p: int) -> float:
    return (p - 1) / p if p > 1 else 0.0


class NetworkModel:
    """Per-link latency and bandwidth behind each collective, at any world size.

    From a fit at ``p0`` workers: ring all-reduce ``t = 2(p-1)·α + 2(p-1)/p·8b/BW``,
    all-gather ``t = (p-1)·α + (p-1)·8b/BW`` (b = one rank's bytes), so α and BW are the
    fit's latency and bandwidth with the algorithm's factors taken out.  An all-reduce
    that sums another type than float32 adds its measured extra summing cost per byte.
    """

    def __init__(self, fits: Mapping, profiled_world: int, scenario: Scenario,
                 reduce_s_per_byte: Mapping[str, float] | None = None,
                 reduce_cpu_s_per_byte: Mapping[str, float] | None = None) -> None:
        self.world = scenario.world_size or profiled_world
        # CPU work a rank does for a collective grows with the bytes it handles: (p-1)/p
        # of its input twice for a ring all-reduce, (p-1) shares for an all-gather
        self.cpu: dict[str, tuple[float, float]] = {}
        for name, handled in (("all_reduce", _ring_share), ("all_gather", lambda p: float(max(p - 1, 0)))):
            fit = fits.get(name)
            if fit is not None and profiled_world > 1:
                self.cpu[name] = (fit.cpu_latency_s, fit.cpu_s_per_byte * handled(self.world) / handled(profiled_world))
        # Summing is work on each rank (a share (p-1)/p of the data in a ring), not link
        # time: it scales with the device, not with the scenario's bandwidth.
        rescale = _ring_share(self.world) / _ring_share(profiled_world) if profiled_world > 1 else 1.0
        self.reduce_s_per_byte = {
            dtype: extra * rescale / scenario.compute_speedup for dtype, extra in (reduce_s_per_byte or {}).items()
        }
        # the summing's CPU time: a slow link hides it in wall time only; where the CPU
        # measurement missed it, its wall time (summing on a fast link is CPU work) stands in
        cpu_extra = {dtype: extra * rescale for dtype, extra in (reduce_cpu_s_per_byte or {}).items()}
        self.reduce_cpu_s_per_byte = {
            dtype: max(self.reduce_s_per_byte.get(dtype, 0.0), cpu_extra.get(dtype, 0.0))
            for dtype in {*self.reduce_s_per_byte, *cpu_extra}
        }
        self.links: dict[str, tuple[float, float]] = {}
        for name, hops in (("all_reduce", lambda p: 2 * (p - 1)), ("all_gather", lambda p: p - 1)):
            fit = fits.get(name)
            if fit is None:
                continue
            alpha = fit.latency_s / max(1, hops(profiled_world))
            bandwidth = fit.bandwidth_bps if fit.bandwidth_bps > 0 else 1e12
            if scenario.latency_s is not None:
                alpha = scenario.latency_s
            if scenario.bandwidth_bps is not None:
                bandwidth = scenario.bandwidth_bps
            self.links[name] = (alpha, bandwidth)
        if "all_reduce" not in self.links:
            raise ValueError("the profile has no all-reduce fit; profile the network (advisor profile --network)")
        self.links.setdefault("all_gather", self.links["all_reduce"])

    def seconds(self, collective: Collective, nbytes, dtype: str = "float32") -> np.ndarray:
        p = self.world
        nbytes = np.asarray(nbytes, dtype=np.float64)
        if p <= 1:
            return np.zeros_like(nbytes)
        if collective is Collective.ALL_GATHER:
            alpha, bw = self.links["all_gather"]
            return (p - 1) * alpha + (p - 1) * 8.0 * nbytes / bw
        alpha, bw = self.links["all_reduce"]
        summing = nbytes * self.reduce_s_per_byte.get(dtype, 0.0)
        return 2 * (p - 1) * alpha + 2.0 * _ring_share(p) * 8.0 * nbytes / bw + summing

    def cpu_seconds(self, collective: Collective, nbytes, dtype: str = "float32") -> np.ndarray:
        """Host CPU seconds a rank spends on the collective (0 where not measured)."""
        nbytes = np.asarray(nbytes, dtype=np.float64)
        if self.world <= 1:
            return np.zeros_like(nbytes)
        name = "all_gather" if collective is Collective.ALL_GATHER else "all_reduce"
        latency, per_byte = self.cpu.get(name, (0.0, 0.0))
        summing = 0.0 if collective is Collective.ALL_GATHER else nbytes * self.reduce_cpu_s_per_byte.get(dtype, 0.0)
        return latency + nbytes * per_byte + summing


@dataclass(frozen=True)
class ExchangeUnit:
    """DDP buckets the layout exchanges together, seen as one bucket (named by the first one's index)."""

    index: int
    parameters: list[str]
    numel: int


@dataclass
class CandidateCosts:
    """Per bucket (rows) and config (columns): encode, comm, decode seconds, wire bytes."""

    configs: list[str]
    encode_s: np.ndarray
    comm_s: np.ndarray
    decode_s: np.ndarray
    wire_bytes: np.ndarray
    #: host CPU seconds of the collectives (see :meth:`PerformanceModel.segment_cost`)
    comm_cpu_s: np.ndarray | None = None


class PerformanceModel:
    """Predict iteration timelines from a :class:`profilers.profile.ClusterProfile`."""

    def __init__(self, profile, scenario: Scenario | None = None, overlap: float = 1.0,
                 round_s: float | None = None, exchange_mb: float | None = None,
                 bucket_cap_mb: float | None = None, join_in_ddp: bool = False) -> None:
        """``round_s``: cost of a message round beyond the network fit; by default what
        the profile measured (0 for profiles from before that measurement).  ``exchange_mb``:
        the bucket layout (:class:`advisor.runtime.Plan`): DDP's buckets are exchanged in
        groups of that size, and the model's units (``buckets``) are those groups.
        ``bucket_cap_mb``: DDP built with buckets of that size instead of the profiled ones
        (the other layout, :attr:`advisor.runtime.Plan.bucket_cap_mb`).  ``join_in_ddp``: a
        join runs as :func:`advisor.ddp_for` builds it, on DDP's own buckets of the join's size,
        which the model's units then are, without the hook's copies (False: the hook joins
        DDP's buckets and copies them together, as on a DDP model built otherwise)."""
        if not isinstance(join_in_ddp, bool):
            raise ValueError(f"join_in_ddp={join_in_ddp!r}; allowed: True or False")
        self.profile = profile
        self.scenario = scenario or Scenario()
        if not overlap > 0:
            raise ValueError(f"overlap={overlap!r}; allowed: > 0")
        if round_s is None:
            round_s = profile.network.round_s if profile.network is not None else 0.0
        if not (math.isfinite(round_s) and round_s >= 0):
            raise ValueError(f"round_s={round_s!r}; allowed: a finite number >= 0")
        self.overlap = overlap
        self.round_s = round_s
        compute = profile.compute
        self.world = self.scenario.world_size or profile.environment.world_size
        speed = self.scenario.compute_speedup
        if profile.network is None:
            raise ValueError("the profile has no network measurements; profile again with the network profiler on")
        self.network = NetworkModel(profile.network.fits, profile.environment.world_size, self.scenario,
                                    profile.network.reduce_s_per_byte, profile.network.reduce_cpu_s_per_byte)
        # communication's CPU time slows backward only where backward runs on the CPU
        self.cpu_interference = str(profile.environment.device).startswith("cpu")
        ready = {p.name: p.ready_s / speed for p in compute.parameters}
        shapes = {p.name: tuple(p.shape) for p in compute.parameters}
        self.bucket_cap_mb = check_layout_mb(bucket_cap_mb, "bucket_cap_mb")
        self.exchange_mb = check_layout_mb(exchange_mb)
        if self.exchange_mb is not None and self.bucket_cap_mb is not None:
            raise ValueError("a layout either joins DDP's buckets (exchange_mb) or rebuilds them (bucket_cap_mb), "
                             "not both")
        self.join_in_ddp = join_in_ddp
        joined_by_ddp = join_in_ddp and self.exchange_mb is not None
        cap = self.exchange_mb if joined_by_ddp else self.bucket_cap_mb
        built = compute.buckets if cap is None else buckets_for_cap(compute.parameters, cap)
        # DDP hands buckets over in the order their gradients become ready (after its rebuild)
        handed_over = sorted(built, key=lambda b: max(ready[n] for n in b.parameters))
        #: the DDP buckets behind each unit the model replays (one each, unless the hook joins them)
        self.members = [[handed_over[i] for i in group]
                        for group in exchange_groups([b.numel * 4 for b in handed_over],
                                                     None if joined_by_ddp else self.exchange_mb)]
        self.buckets = [m[0] if len(m) == 1 else ExchangeUnit(m[0].index, [n for b in m for n in b.parameters],
                                                              sum(b.numel for b in m)) for m in self.members]
        self.layouts = [SegmentLayout(tuple(b.parameters), tuple(shapes[n] for n in b.parameters)) for b in self.buckets]
        self.ready_s = np.array([max(ready[n] for n in b.parameters) for b in self.buckets])
        self.forward_s = compute.forward_s / speed
        self.backward_s = compute.backward_s / speed
        self.optimizer_s = compute.optimizer_s / speed
        # DDP's own passes with a comm hook: each gradient is copied into its bucket as it
        # becomes ready (on the backward thread) and the averaged bucket back afterwards;
        # buckets exchanged together are also copied into one buffer and their results back
        copy = compute.copy_s_per_byte / speed
        self.copy_in_s = np.array([b.numel * 4 * copy * (1 if len(m) == 1 else 3)
                                   for b, m in zip(self.buckets, self.members)])
        self.copy_out_s = float(sum(b.numel * 4 * copy for b in self.buckets))
        self._siblings: dict[tuple[float | None, float | None, bool], PerformanceModel] = {
            (*self.layout, self.join_in_ddp): self}

    # --- costs ----------------------------------------------------------------------
    def _kernel_seconds(self, config: CompressorConfig, numel: int) -> tuple[float, float]:
        if config.name == "none" and config.error_feedback is not True:
            cost = self.profile.kernels.costs.get("none") if self.profile.kernels else None
            if cost is None:
                return 0.0, 0.0  # a division pass: negligible next to the all-reduce
        kernels = self.profile.kernels
        cost = kernels.costs.get(config.label) if kernels is not None else None
        if cost is None:
            raise ValueError(
                f"the profile has no kernel cost for {config.label!r}; profile with it among the candidate "
                f"configs (advisor profile --configs ...). It has: {sorted(kernels.costs) if kernels else []}"
            )
        enc, dec = cost.predict(numel)
        comp = config.build()
        if comp.uses_all_gather and cost.world_size > 0:
            dec *= self.world / cost.world_size  # decode handles one payload per rank
        speed = self.scenario.compute_speedup
        return enc / speed, dec / speed

    def segment_cost(self, config: CompressorConfig, layout: SegmentLayout) -> tuple[float, float, float, int, float]:
        """Encode, comm and decode seconds, wire bytes, and the host CPU seconds of the
        segment's collectives (0 unless backward runs on the CPU)."""
        comp = config.build()
        wires = comp.wire(layout, self.world)
        comm = float(sum(self.network.seconds(w.collective, w.nbytes, w.dtype) for w in wires))
        if self.world > 1:
            comm += self.round_s * len(wires)
        cpu = 0.0
        if self.cpu_interference:
            cpu = float(sum(self.network.cpu_seconds(w.collective, w.nbytes, w.dtype) for w in wires))
        enc, dec = self._kernel_seconds(config, layout.numel)
        return enc, comm, dec, sum(w.nbytes for w in wires), cpu

    def candidate_costs(self, configs: Sequence[str | CompressorConfig]) -> CandidateCosts:
        parsed = [parse(c) for c in configs]
        shape = (len(self.layouts), len(parsed))
        enc, comm, dec, wire, cpu = (np.zeros(shape) for _ in range(5))
        for i, layout in enumerate(self.layouts):
            for j, config in enumerate(parsed):
                enc[i, j], comm[i, j], dec[i, j], wire[i, j], cpu[i, j] = self.segment_cost(config, layout)
        return CandidateCosts([c.label for c in parsed], enc, comm, dec, wire, cpu)

    # --- prediction -----------------------------------------------------------------
    def _replay(self, enc: np.ndarray, comm: np.ndarray, dec: np.ndarray, cpu: np.ndarray | None = None):
        """The recurrence over buckets; arrays are (plans, buckets)."""
        plans = enc.shape[0]
        if cpu is None:
            cpu = np.zeros_like(comm)
        shift = np.zeros(plans)
        comm_free = np.zeros(plans)
        decode_free = np.zeros(plans)
        spans = []
        for b in range(enc.shape[1]):
            shift = shift + self.copy_in_s[b]
            enc_start = self.ready_s[b] + shift
            enc_end = enc_start + enc[:, b]
            shift = shift + enc[:, b]
            comm_start = np.maximum(enc_end, comm_free)
            comm_end = comm_start + comm[:, b]
            comm_free = comm_end
            # the share of this collective that runs while backward (as far as known) runs
            # takes that share of its CPU time from backward
            overlapping = np.clip(self.backward_s + shift - comm_start, 0.0, None)
            shift = shift + cpu[:, b] * np.minimum(1.0, overlapping / np.maximum(comm[:, b], 1e-12))
            decode_end = np.maximum(comm_end, decode_free) + dec[:, b]
            decode_free = decode_end
            spans.append((enc_start, enc_end, comm_start, comm_end, decode_end))
        backward_end = self.backward_s + shift
        end = np.maximum(backward_end, decode_free) + self.copy_out_s
        iteration = self.forward_s + self.overlap * end + self.optimizer_s
        return iteration, backward_end, spans

    def predict_many(self, choices: np.ndarray, costs: CandidateCosts) -> np.ndarray:
        """Iteration seconds for each plan; ``choices[p, b]`` indexes ``costs.configs``."""
        choices = np.asarray(choices)
        if choices.ndim != 2 or choices.shape[1] != len(self.layouts):
            raise ValueError(f"choices must be (plans, {len(self.layouts)} buckets), got {choices.shape}")
        rows = np.arange(len(self.layouts))[None, :]
        cpu = costs.comm_cpu_s[rows, choices] if costs.comm_cpu_s is not None else None
        iteration, _, _ = self._replay(costs.encode_s[rows, choices], costs.comm_s[rows, choices],
                                       costs.decode_s[rows, choices], cpu)
        return iteration

    @property
    def compute_only_s(self) -> float:
        return self.forward_s + self.backward_s + self.optimizer_s

    @property
    def layout(self) -> tuple[float | None, float | None]:
        """``(exchange_mb, bucket_cap_mb)``: how this model's units are made from the profiled buckets."""
        return self.exchange_mb, self.bucket_cap_mb

    def with_layout(self, exchange_mb: float | None, bucket_cap_mb: float | None = None, *,
                    join_in_ddp: bool | None = None) -> PerformanceModel:
        """This model (calibration included) under another bucket layout; ``join_in_ddp`` as the
        constructor's (None: as this model's)."""
        exchange_mb = check_layout_mb(exchange_mb)
        join_in_ddp = self.join_in_ddp if join_in_ddp is None else join_in_ddp
        key = (exchange_mb, check_layout_mb(bucket_cap_mb, "bucket_cap_mb"), join_in_ddp)
        sibling = self._siblings.get(key)
        if sibling is None or (sibling.overlap, sibling.round_s) != (self.overlap, self.round_s):
            sibling = PerformanceModel(self.profile, self.scenario, self.overlap, self.round_s, *key)
            sibling._siblings = self._siblings
            self._siblings[key] = sibling
        return sibling

    def predict(self, plan: Plan) -> Timeline:
        """The timeline of one plan (parameters of one bucket may use different configs), under
        the plan's own bucket layout."""
        if (plan.exchange_mb, plan.bucket_cap_mb) != self.layout:
            return self.with_layout(plan.exchange_mb, plan.bucket_cap_mb).predict(plan)
        enc = np.zeros((1, len(self.layouts)))
        comm, dec, cpu = np.zeros_like(enc), np.zeros_like(enc), np.zeros_like(enc)
        labels, wires = [], []
        for b, layout in enumerate(self.layouts):
            segments = _segments(layout, plan)
            total = np.zeros(5)
            for seg_layout, config in segments:
                total += np.array(self.segment_cost(config, seg_layout))
            enc[0, b], comm[0, b], dec[0, b], cpu[0, b] = total[0], total[1], total[2], total[4]
            wires.append(int(total[3]))
            labels.append("+".join(dict.fromkeys(c.label for _, c in segments)))
        iteration, backward_end, spans = self._replay(enc, comm, dec, cpu)
        return Timeline(
            iteration_s=float(iteration[0]),
            forward_s=self.forward_s,
            backward_end_s=float(backward_end[0]),
            optimizer_s=self.optimizer_s,
            compute_only_s=self.compute_only_s,
            buckets=[
                BucketSpan(self.buckets[b].index, labels[b], float(self.ready_s[b]),
                           *(float(x[0]) for x in spans[b]), wires[b])
                for b in range(len(self.layouts))
            ],
        )

    # --- calibration ----------------------------------------------------------------
    #: per-round costs tried by :meth:`calibrate` (seconds)
    ROUND_GRID_S = tuple(i * 0.25e-3 for i in range(41))

    def calibrate(self, plans: Sequence[Plan], measured_s: Sequence[float]) -> float:
        """Learn ``round_s`` and ``overlap`` from measured step times; returns ``overlap``.

        Least squares: for each ``round_s`` on a grid (0 to 10 ms; the replay is not
        linear in it), ``overlap`` in closed form; the pair with the smallest squared
        error wins.  With a single plan only ``overlap`` is learned (``round_s`` stays as
        profiled).
        """
        if len(plans) != len(measured_s) or not plans:
            raise ValueError("calibrate needs one measured step time per plan, and at least one plan")
        target = np.asarray(measured_s, dtype=np.float64) - self.forward_s - self.optimizer_s
        saved = self.overlap, self.round_s
        best = None
        try:
            for round_s in self.ROUND_GRID_S if len(plans) > 1 else (saved[1],):
                self.overlap, self.round_s = 1.0, round_s
                ends = np.array([self.predict(p).iteration_s - self.forward_s - self.optimizer_s for p in plans])
                overlap = float(np.dot(ends, target) / max(np.dot(ends, ends), 1e-18))
                error = float(np.sum((overlap * ends - target) ** 2))
                if math.isfinite(overlap) and overlap > 0 and (best is None or error < best[0]):
                    best = (error, overlap, round_s)
        finally:
            self.overlap, self.round_s = saved
        if best is None:
            raise ValueError("calibration found no positive overlap factor; the measurements do not fit this profile")
        _, self.overlap, self.round_s = best
        return self.overlap


def _segments(layout: SegmentLayout, plan: Plan) -> list[tuple[SegmentLayout, CompressorConfig]]:
    """The bucket's segments, split as the runtime splits them."""
    return [(SegmentLayout(tuple(n), tuple(s)), c) for n, s, c in plan.runs(layout.names, layout.shapes)]
