"""Collective latency and bandwidth between the real ranks, fitted with scikit-learn.

Every rank runs the same schedule: for each collective and each message size (4 KiB
doubling to 64 MiB), a warm-up op, then timed ops, each started after a barrier and timed
as the slowest rank saw it.  Sizes stop growing once one op takes longer than
``max_op_s`` (a 64 MiB all-reduce at 100 Mbit/s takes seconds and says nothing more about
bandwidth than a 4 MiB one), so the whole run fits a time budget.  A robust linear model
(Huber) fits ``t = latency + bytes · seconds_per_byte`` per collective, weighted so small
messages (which carry the latency) count as much as large ones.

Each timed op also records the CPU time the rank's process spent while it ran (all
threads, user and system: gloo's threads and the kernel's network stack; the calling
thread only waits), fitted the same way: on a host that computes on its CPU, that time
is taken from a backward pass the collective overlaps (over loopback, most of an
all-reduce's time is CPU time; ``advisor report PROFILE`` shows it per collective).
"""

from __future__ import annotations

import copy
import resource
import statistics
import time
from collections.abc import Sequence

import numpy as np
import torch
import torch.distributed as dist
from scipy.stats import trim_mean
from sklearn.linear_model import HuberRegressor
from sklearn.metrics import r2_score

from advisor.compressors import SegmentLayout, parse
from advisor.core.collectives import slowest

from .profile import CollectiveFit, NetworkProfile

COLLECTIVES = ("all_reduce", "all_gather", "broadcast")
MIN_BYTES = 4 << 10
MAX_BYTES = 64 << 20
#: element types the candidate compressors' all-reduces sum, besides float32
REDUCTION_DTYPES = ("float16", "bfloat16", "int8", "int32", "int64")
REDUCTION_PROBE_BYTES = (1 << 20, 8 << 20)
#: a probe op should last about this long: long enough that summing shows above the
#: scheduling jitter of a fast link (milliseconds here), short enough on a slow one
REDUCTION_PROBE_S = 0.01
#: float32/dtype op pairs timed per type by :func:`time_reductions`
REDUCTION_PAIRS = 7
#: :func:`time_step_rounds`: payload (a PowerSGD P, a scale vector), rounds, and the
#: compute before each round (an encode's worth)
STEP_ROUND_BYTES = 16 << 10
STEP_ROUNDS = 40
STEP_ROUND_WORK_S = 0.002


def reduction_dtypes_of(configs: Sequence[str], world_size: int) -> tuple[str, ...]:
    """The non-float32 element types the all-reduces of ``configs`` sum."""

    layout = SegmentLayout(("probe.weight",), ((1024, 1024),))
    found = {
        w.dtype
        for c in configs
        for w in parse(c).build().wire(layout, world_size)
        if w.collective.is_all_reduce and w.dtype != "float32"
    }
    return tuple(sorted(found))


def _op(collective: str, nbytes: int, group, dtype: torch.dtype = torch.float32):
    world = dist.get_world_size(group)
    t = torch.ones(max(1, nbytes // dtype.itemsize), dtype=dtype)
    if collective == "all_reduce":
        return lambda: dist.all_reduce(t, group=group)
    if collective == "all_gather":
        out = torch.empty(world * t.numel())
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        return lambda: gather(out, t, group=group)
    if collective == "broadcast":
        return lambda: dist.broadcast(t, src=0, group=group)
    raise ValueError(f"unknown collective {collective!r}; allowed: {', '.join(COLLECTIVES)}")


def process_cpu_s() -> float:
    """CPU seconds of this process so far, every thread, user and system."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _timed_with_cpu(op, group) -> tuple[float, float]:
    """Wall and process CPU seconds of one op started after a barrier (the most any rank saw)."""
    dist.barrier(group=group)
    c0 = process_cpu_s()
    t0 = time.perf_counter()
    op()
    wall = time.perf_counter() - t0
    return tuple(slowest([wall, process_cpu_s() - c0], group))


def time_collective(collective: str, nbytes: int, repeats: int, group=None) -> list[tuple[float, float]]:
    """(wall, CPU) seconds of each timed op, each the most any rank saw."""
    op = _op(collective, nbytes, group)
    op()  # warm-up: connections, buffers
    return [_timed_with_cpu(op, group) for _ in range(repeats)]


def time_reductions(dtypes: Sequence[str], nbytes: int = REDUCTION_PROBE_BYTES[1], repeats: int = REDUCTION_PAIRS,
                    group=None) -> tuple[dict[str, float], dict[str, float]]:
    """Extra (wall, CPU) seconds per byte of all-reducing each dtype instead of float32, same bytes.

    Each op of a dtype is paired with a float32 op just before it, so drift on a shared
    machine hits both alike, and the same size cancels the latency.  A dtype counts as
    dearer only when nearly every pair says so (a sign test: all but one of ``repeats``);
    on a slow link, where gloo's summing hides behind the transfer, the wall-time
    differences are noise either way and the extra cost is 0.  The same test on the
    process CPU time of the pairs sees the summing even where the link hides it.
    """
    ops = {name: _op("all_reduce", nbytes, group, getattr(torch, name)) for name in ("float32", *dtypes)}
    for op in ops.values():
        op()  # warm-up
    walls: dict[str, list[float]] = {name: [] for name in dtypes}
    cpus: dict[str, list[float]] = {name: [] for name in dtypes}
    for _ in range(repeats):
        for name in dtypes:
            base_wall, base_cpu = _timed_with_cpu(ops["float32"], group)
            wall, cpu_s = _timed_with_cpu(ops[name], group)
            walls[name].append(wall - base_wall)
            cpus[name].append(cpu_s - base_cpu)

    def extra(differences: dict[str, list[float]]) -> dict[str, float]:
        out = {}
        for name, diffs in differences.items():
            dearer = sum(d > 0 for d in diffs) >= len(diffs) - 1
            out[name] = statistics.median(diffs) / nbytes if dearer else 0.0
        return out

    return extra(walls), extra(cpus)


def time_step_rounds(fit: CollectiveFit, nbytes: int = STEP_ROUND_BYTES, rounds: int = STEP_ROUNDS,
                     work_s: float = STEP_ROUND_WORK_S, group=None) -> float:
    """Extra seconds a small all-reduce costs when issued as a training step issues it.

    The fits time ops back to back after a barrier: every rank arrives at once, with its
    communication threads awake.  In a step each round follows compute of its own (an
    encode, a stretch of backward), so the ranks arrive apart, as their compute varies,
    and a waiting rank's threads wake from idle, so a small op takes several times longer
    than back to back; the performance model charges the difference to every message
    round of a plan.  Here every rank runs the same matrix products for about ``work_s``,
    then the op, ``rounds`` times; the result is the trimmed mean wait (the most any rank
    saw) less what ``fit`` predicts, and never below 0.
    """
    a = torch.randn(192, 192)
    torch.mm(a, a)
    t0 = time.perf_counter()
    for _ in range(20):
        torch.mm(a, a)
    per_product = (time.perf_counter() - t0) / 20
    # the same work on every rank: the largest count any rank asks for
    count = int(slowest([max(1, round(work_s / max(per_product, 1e-9)))], group)[0])
    op = _op("all_reduce", nbytes, group)
    op()  # warm-up
    dist.barrier(group=group)
    waits = []
    for _ in range(rounds):
        for _ in range(int(count)):
            torch.mm(a, a)
        t0 = time.perf_counter()
        op()
        waits.append(time.perf_counter() - t0)
    # trimmed: a pause of the shared machine in one round is not a cost of every round
    mean_wait = slowest([float(trim_mean(waits, 0.1))], group)[0]
    return max(0.0, mean_wait - fit.predict(nbytes))


def algorithm_factor(collective: str, world_size: int) -> float:
    """Bytes crossing each link per byte of a rank's input, for gloo's algorithms."""
    p = world_size
    if p <= 1:
        return 0.0
    if collective == "all_reduce":
        return 2.0 * (p - 1) / p  # ring: reduce-scatter then all-gather
    if collective == "all_gather":
        return float(p - 1)  # every other rank's share arrives over the link
    return float(p - 1)  # broadcast: gloo's root sends every peer a full copy (measured)


def _huber_line(x: np.ndarray, y: np.ndarray, weights: np.ndarray | None = None) -> tuple[float, float]:
    """(intercept, slope) of a Huber fit of ``y`` against ``x``, unclipped."""
    scale = x.max()
    model = HuberRegressor(epsilon=1.5, alpha=0.0, max_iter=1000)
    model.fit(x[:, None] / scale, y, sample_weight=None if weights is None else weights / weights.mean())
    return float(model.intercept_), float(model.coef_[0]) / scale


def _robust_line(x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    """(intercept, slope) of a Huber fit of ``y`` against ``x``, both clipped at 0.

    Points are weighted ~1/time, so every size counts about equally in relative terms and
    small messages (which carry the latency) are not drowned by large ones.  A point
    weighted by its own time can outweigh everything else, though: one fast small op
    among slow ones (depending on whether a rank's threads were awake) once fitted a
    100 Mbit/s link at ten times its rate.  So a second fit weights by an
    unweighted first fit's prediction instead, which no single point sets, and the
    self-weighted fit stands only where it explains the points about as well (R²).
    """
    def clipped(line: tuple[float, float]) -> tuple[float, float]:
        return max(line[0], 0.0), max(line[1], 0.0)

    def r2(line: tuple[float, float]) -> float:
        return float(r2_score(y, line[0] + x * line[1])) if len(y) > 2 else 1.0

    own = clipped(_huber_line(x, y, 1.0 / np.maximum(y, 1e-9)))
    intercept, slope = _huber_line(x, y)
    floor = max(float(np.median(y[x == x.min()])), 1e-9)
    guarded = clipped(_huber_line(x, y, 1.0 / np.maximum(intercept + slope * x, floor)))
    return own if r2(own) >= r2(guarded) - 0.05 else guarded


def fit_collective(
    collective: str, world_size: int, points: list[tuple[int, float]], cpu_points: list[tuple[int, float]] | None = None
) -> CollectiveFit:
    """Robust linear fits of time, and of CPU time if given, against bytes (HuberRegressor)."""
    x = np.array([b for b, _ in points], dtype=np.float64)
    y = np.array([t for _, t in points], dtype=np.float64)
    latency, seconds_per_byte = _robust_line(x, y)
    seconds_per_byte = max(seconds_per_byte, 1e-15)
    cpu_latency = cpu_per_byte = 0.0
    if cpu_points:
        cpu_latency, cpu_per_byte = _robust_line(np.array([b for b, _ in cpu_points], dtype=np.float64),
                                                 np.array([c for _, c in cpu_points], dtype=np.float64))
    predicted = latency + x * seconds_per_byte
    factor = algorithm_factor(collective, world_size)
    bandwidth = factor * 8.0 / seconds_per_byte if factor else float("inf")
    return CollectiveFit(
        collective=collective,
        world_size=world_size,
        latency_s=latency,
        seconds_per_byte=seconds_per_byte,
        bandwidth_bps=bandwidth if np.isfinite(bandwidth) else 0.0,
        r2=float(r2_score(y, predicted)) if len(points) > 2 else 1.0,
        points=[[float(b), float(t)] for b, t in points],
        cpu_latency_s=cpu_latency,
        cpu_s_per_byte=cpu_per_byte,
    )


#: how long autotune and wrap reuse a network profile this process measured on the same group:
#: the links of one job do not change, and a second tuning in the same job (another model,
#: a resumed fit) need not stall for them again
NETWORK_REUSE_S = 600.0

#: network profiles this process measured: (ranks, backend, collectives, dtypes) -> (when, profile)
_MEASURED: dict[tuple, tuple[float, NetworkProfile]] = {}


def profile_network(
    group=None,
    collectives=COLLECTIVES,
    min_bytes: int = MIN_BYTES,
    max_bytes: int = MAX_BYTES,
    repeats: int = 3,
    max_op_s: float = 0.6,
    budget_s: float = 25.0,
    reduction_dtypes: Sequence[str] = REDUCTION_DTYPES,
    reuse_within_s: float = 0.0,
) -> NetworkProfile:
    """Measure and fit every collective; call on every rank at the same point.

    Args:
        group: the process group (default: the world).
        collectives: which to measure, of ``all_reduce``, ``all_gather`` and ``broadcast``.
        min_bytes, max_bytes: the message sizes, doubling from one to the other.
        repeats: timings per size (the median counts).
        max_op_s: stop growing a collective's sizes once one op takes this long.
        budget_s: the most seconds the whole profile may take.
        reduction_dtypes: dtypes whose all-reduce sum is timed against float32's
            (:func:`time_reductions`), if the budget allows.
        reuse_within_s: above 0, return the profile this process measured on the same ranks,
            backend, collectives and dtypes at most that many seconds ago, where every rank
            still has one (one small collective decides).

    Returns:
        A :class:`NetworkProfile`: a latency/bandwidth fit per collective (slowest rank).

    Raises:
        RuntimeError: no initialised process group.
    """
    key = (tuple(dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)),
           str(dist.get_backend(group)), tuple(collectives), tuple(reduction_dtypes))
    if reuse_within_s > 0:
        cached = _MEASURED.get(key)
        fresh = cached is not None and time.perf_counter() - cached[0] <= reuse_within_s
        if slowest([0.0 if fresh else 1.0], group)[0] == 0.0:  # fresh on every rank
            return copy.deepcopy(cached[1])
    profile = _measure_network(group, collectives, min_bytes, max_bytes, repeats, max_op_s, budget_s,
                               reduction_dtypes)
    _MEASURED[key] = (time.perf_counter(), profile)
    return profile


def _measure_network(group, collectives, min_bytes, max_bytes, repeats, max_op_s, budget_s,
                     reduction_dtypes) -> NetworkProfile:
    start = time.perf_counter()
    world = dist.get_world_size(group)
    fits = {}
    per_collective_budget = budget_s / max(1, len(collectives))
    for collective in collectives:
        points: list[tuple[int, float]] = []
        cpu_points: list[tuple[int, float]] = []
        began = time.perf_counter()
        nbytes = min_bytes
        while nbytes <= max_bytes:
            timed = time_collective(collective, nbytes, repeats, group)
            points += [(nbytes, wall) for wall, _ in timed]
            cpu_points += [(nbytes, cpu) for _, cpu in timed]
            op_s = statistics.median(wall for wall, _ in timed)
            # every rank decides from the same (all-reduced) numbers: schedules stay aligned
            spent = slowest([time.perf_counter() - began], group)[0]
            if op_s > max_op_s or spent + 2.5 * op_s * (repeats + 1) > per_collective_budget:
                break
            nbytes *= 2
        fits[collective] = fit_collective(collective, world, points, cpu_points)
    round_s = 0.0
    if "all_reduce" in fits:
        round_s = time_step_rounds(fits["all_reduce"], group=group)
    extra: dict[str, float] = {}
    extra_cpu: dict[str, float] = {}
    if "all_reduce" in fits and reduction_dtypes:
        fit = fits["all_reduce"]
        low, high = REDUCTION_PROBE_BYTES
        nbytes = low
        while nbytes < high and fit.predict(2 * nbytes) <= REDUCTION_PROBE_S:
            nbytes *= 2
        # the timed pairs and a warm-up per type, each op with its barrier and its max
        per_op = fit.predict(nbytes) + 2 * fit.predict(4)
        expected = per_op * (2 * REDUCTION_PAIRS + 1) * (1 + len(reduction_dtypes))
        # every rank decides from the same (all-reduced) numbers
        if slowest([time.perf_counter() - start], group)[0] + expected <= budget_s:
            extra, extra_cpu = time_reductions(reduction_dtypes, nbytes, group=group)
    return NetworkProfile(fits=fits, elapsed_s=time.perf_counter() - start, reduce_s_per_byte=extra,
                          reduce_cpu_s_per_byte=extra_cpu, round_s=round_s)
