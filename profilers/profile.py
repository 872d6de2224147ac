"""The cluster profile: what the profilers measured, as typed, versioned JSON.

Everything the performance model and the policies need, and nothing they must guess:
compute timings and the DDP bucket layout, fitted collective costs with their raw points,
kernel costs of each candidate compressor with a fitted size model, gradient fidelity of
each candidate per bucket, and the environment it was all measured in.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from advisor.compressors.forms import check_forms
from advisor.core.documents import VersionedDocument

PROFILE_VERSION = 1
PROFILE_KIND = "compression-advisor/cluster-profile"


def _finite(name: str, value: float, minimum: float = 0.0) -> None:
    if not math.isfinite(value) or value < minimum:
        raise ValueError(f"{name}={value!r}; allowed: a finite number >= {minimum}")


@dataclass
class ParameterTiming:
    """One parameter: its gradient is ready ``ready_s`` after backward starts (slowest rank)."""

    name: str
    layer: str
    numel: int
    shape: list[int]
    ready_s: float

    def __post_init__(self) -> None:
        _finite(f"{self.name}.ready_s", self.ready_s)


@dataclass
class Bucket:
    """A DDP bucket after DDP's rebuild: its parameters in bucket order."""

    index: int
    parameters: list[str]
    numel: int


@dataclass
class ComputeProfile:
    """Per-step compute with communication off (``no_sync``), slowest rank, medians."""

    forward_s: float
    backward_s: float
    optimizer_s: float
    steps: int
    parameters: list[ParameterTiming]
    layer_backward_s: dict[str, float]
    buckets: list[Bucket]
    backward_s_by_rank: list[float] = field(default_factory=list)
    #: seconds per byte of a plain tensor copy on this device, as training gets it: DDP
    #: copies every gradient into its bucket and back, and a comm hook adds a pass
    copy_s_per_byte: float = 0.0

    def __post_init__(self) -> None:
        for name in ("forward_s", "backward_s", "optimizer_s", "copy_s_per_byte"):
            _finite(name, getattr(self, name))

    @property
    def step_s(self) -> float:
        return self.forward_s + self.backward_s + self.optimizer_s


@dataclass
class CollectiveFit:
    """``seconds(nbytes) = latency_s + nbytes * seconds_per_byte`` for one collective.

    ``nbytes`` is what one rank contributes (its input).  ``bandwidth_bps`` is the link
    rate the fit implies once the algorithm's factor is taken out (ring all-reduce moves
    2(p-1)/p of the data over each link, all-gather p-1 times a rank's share).
    """

    collective: str
    world_size: int
    latency_s: float
    seconds_per_byte: float
    bandwidth_bps: float
    r2: float
    points: list[list[float]]
    #: host CPU seconds one op costs a rank (all its threads and the kernel's network
    #: stack, measured as process CPU time while the op ran), ``cpu_latency_s +
    #: nbytes * cpu_s_per_byte``: on a host whose compute is its CPU, this is taken from
    #: the compute an overlapping backward pass gets (0 in profiles that did not measure it)
    cpu_latency_s: float = 0.0
    cpu_s_per_byte: float = 0.0

    def __post_init__(self) -> None:
        _finite("cpu_latency_s", self.cpu_latency_s)
        _finite("cpu_s_per_byte", self.cpu_s_per_byte)

    def predict(self, nbytes: float) -> float:
        return self.latency_s + nbytes * self.seconds_per_byte

    def cpu_seconds(self, nbytes: float) -> float:
        return self.cpu_latency_s + nbytes * self.cpu_s_per_byte


@dataclass
class NetworkProfile:
    fits: dict[str, CollectiveFit]
    elapsed_s: float
    #: extra seconds per byte an all-reduce takes when it sums this element type instead
    #: of float32 (gloo sums float16 element by element through float: several times the
    #: float32 cost on a fast link), measured at one size next to float32
    reduce_s_per_byte: dict[str, float] = field(default_factory=dict)
    #: the same in host CPU seconds: summing is CPU work even where a slow link hides it
    #: in wall time, and on a CPU host it competes with backward
    reduce_cpu_s_per_byte: dict[str, float] = field(default_factory=dict)
    #: extra seconds a message round costs inside a training step beyond what the
    #: back-to-back fits say (see :func:`profilers.network.time_step_rounds`)
    round_s: float = 0.0

    def __post_init__(self) -> None:
        _finite("round_s", self.round_s)
        for dtype, extra in self.reduce_s_per_byte.items():
            _finite(f"reduce_s_per_byte[{dtype}]", extra)
        for dtype, extra in self.reduce_cpu_s_per_byte.items():
            _finite(f"reduce_cpu_s_per_byte[{dtype}]", extra)


def predict_loglog(knots: list[list[float]], numel):
    """Seconds at ``numel`` (scalar or array) from ``[[log n, log t], ...]`` knots.

    Piecewise linear in log-log space between knots, and beyond them along the end
    segments' slopes: cost per element changes where buckets stop fitting in cache, which
    one straight line through all sizes cannot follow.
    """

    k = np.asarray(knots, dtype=np.float64)
    x = np.log(np.maximum(np.asarray(numel, dtype=np.float64), 1.0))
    if len(k) == 1:
        return np.exp(k[0, 1] + (x - k[0, 0]))  # one knot: proportional to size
    y = np.interp(x, k[:, 0], k[:, 1])
    lo_slope = (k[1, 1] - k[0, 1]) / max(k[1, 0] - k[0, 0], 1e-12)
    hi_slope = (k[-1, 1] - k[-2, 1]) / max(k[-1, 0] - k[-2, 0], 1e-12)
    y = np.where(x < k[0, 0], k[0, 1] + (x - k[0, 0]) * max(lo_slope, 0.0), y)
    y = np.where(x > k[-1, 0], k[-1, 1] + (x - k[-1, 0]) * max(hi_slope, 0.0), y)
    return np.exp(y)


@dataclass
class KernelCost:
    """Encode/decode time of one compressor config on this device, by bucket size.

    ``points`` are measured ``[numel, encode_s, decode_s]``; ``encode_knots`` and
    ``decode_knots`` are the fitted model (see :func:`predict_loglog`).
    """

    config: str
    points: list[list[float]]
    encode_knots: list[list[float]]
    decode_knots: list[list[float]]
    world_size: int

    def predict(self, numel):
        """(encode_s, decode_s) at ``numel``; arrays in, arrays out."""
        enc = predict_loglog(self.encode_knots, numel)
        dec = predict_loglog(self.decode_knots, numel)
        if enc.ndim == 0:
            return float(enc), float(dec)
        return enc, dec


@dataclass
class KernelProfile:
    """Each config's cost by size on ``device``, measured with the kernel ``forms`` chosen there.

    ``forms``: per kernel choice (:mod:`advisor.compressors.forms`), the form this device ran
    faster (plans made from this profile carry it); ``form_seconds``: what each form took.
    """

    device: str
    costs: dict[str, KernelCost]
    forms: dict[str, str] = field(default_factory=dict)
    form_seconds: dict[str, dict[str, float]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.forms = check_forms(self.forms)


@dataclass
class FidelityEntry:
    """How one config distorts one bucket's real gradients, with error feedback.

    ``relative_error = ||Σ applied - Σ true|| / ||Σ true||`` over the captured steps;
    ``compression_gain`` is GraVAC's mean ``||C(g)|| / ||g||``; ``update_error`` is the
    same distance for the parameter *updates* the user's optimizer makes from the applied
    and from the true gradients (None when no optimizer was profiled).
    """

    bucket: int
    config: str
    relative_error: float
    compression_gain: float
    update_error: float | None = None

    def __post_init__(self) -> None:
        _finite(f"fidelity of {self.config} on bucket {self.bucket}: relative_error", self.relative_error)
        if self.update_error is not None:
            _finite(f"fidelity of {self.config} on bucket {self.bucket}: update_error", self.update_error)


#: the fidelity measures a tuning problem can budget
FIDELITY_MEASURES = ("gradient", "update")


@dataclass
class FidelityProfile:
    """``optimizer``: the class of the optimizer the updates were replayed through, if any."""

    steps: int
    world_size: int
    entries: list[FidelityEntry]
    optimizer: str | None = None

    @property
    def measures(self) -> tuple[str, ...]:
        """The measures every entry has: ``gradient`` always, ``update`` when the optimizer was replayed."""
        if self.entries and all(e.update_error is not None for e in self.entries):
            return FIDELITY_MEASURES
        return ("gradient",)


@dataclass
class Environment:
    world_size: int
    backend: str
    device: str
    torch_version: str
    advisor_version: str
    hosts: list[str]
    threads: int
    created: str
    note: str = ""


@dataclass
class ClusterProfile(VersionedDocument):
    what = "cluster profile"
    KIND = PROFILE_KIND
    VERSION = PROFILE_VERSION
    REDO = "profile the cluster again with this version"

    environment: Environment
    compute: ComputeProfile
    network: NetworkProfile | None = None
    kernels: KernelProfile | None = None
    fidelity: FidelityProfile | None = None
    kind: str = PROFILE_KIND
    version: int = PROFILE_VERSION

    def bucket_ready_s(self) -> dict[int, float]:
        """Each DDP bucket's last gradient-ready time (seconds after backward starts)."""
        ready = {p.name: p.ready_s for p in self.compute.parameters}
        return {b.index: max(ready[n] for n in b.parameters) for b in self.compute.buckets}

    def collective_costs(self, nbytes: int = 16 << 20) -> dict[str, tuple[float, float]]:
        """Each fitted collective's (seconds, CPU seconds) for an input of ``nbytes``."""
        if self.network is None:
            return {}
        return {name: (fit.predict(nbytes), fit.cpu_seconds(nbytes)) for name, fit in self.network.fits.items()}

    def kernel_costs(self, numel: int = 1 << 20) -> dict[str, tuple[float, float]]:
        """Each timed config's (encode, decode) seconds on a bucket of ``numel`` elements."""
        if self.kernels is None:
            return {}
        return {label: tuple(cost.predict(numel)) for label, cost in self.kernels.costs.items()}
