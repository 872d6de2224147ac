"""The compression plan: which compressor each group of parameters uses, and how buckets are exchanged.

Groups are named by parameter name (``model.named_parameters()`` of the module DDP wraps),
never by bucket index, so a plan survives DDP's bucket rebuild after iteration 0 and a
change of bucket size.  Parameters in no group use ``default``.

``exchange_mb`` is the bucket layout: consecutive DDP buckets are held back and exchanged
together until they hold at least that many MiB (the iteration's last bucket ends any
group), so a compressor makes one round where DDP's buckets would make several.  It is
a size, not a list of buckets, for the same reason groups are names.

``bucket_cap_mb`` is a layout only DDP can make: buckets smaller than the ones it was built
with, so that gradients leave backward sooner.  A hook cannot split a bucket DDP hands it
whole, so such a plan names the ``bucket_cap_mb`` DDP must be built with
(:func:`advisor.ddp_for` does it); installed on DDP built otherwise it runs, with a warning
that its measured speed assumed those buckets.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from advisor.compressors.forms import check_forms
from advisor.compressors.registry import CompressorConfig, parse
from advisor.core.documents import JsonDocument

PLAN_VERSION = 1
PLAN_KIND = "compression-advisor/plan"


@dataclass(frozen=True)
class PlanGroup:
    parameters: tuple[str, ...]
    compressor: CompressorConfig

    def __post_init__(self) -> None:
        object.__setattr__(self, "parameters", tuple(self.parameters))
        if not self.parameters:
            raise ValueError(f"a plan group with compressor {self.compressor!r} names no parameters")
        try:
            object.__setattr__(self, "compressor", parse(self.compressor))
        except ValueError as exc:
            raise ValueError(f"plan group of {_describe(self.parameters)}: {exc}") from None


@dataclass
class Plan(JsonDocument):
    """A typed, versioned plan; see :meth:`to_dict` for the JSON form."""

    what = "plan"
    KIND = PLAN_KIND
    VERSION = PLAN_VERSION
    REDO = "re-create the plan with this version"

    groups: list[PlanGroup] = field(default_factory=list)
    default: CompressorConfig = field(default_factory=lambda: CompressorConfig("none"))
    warmup_steps: int = 10
    seed: int = 0
    metadata: dict[str, Any] = field(default_factory=dict)
    version: int = PLAN_VERSION
    #: the kernel form of each choice the device runs faster (:mod:`advisor.compressors.forms`);
    #: absent choices run their default form.  Forms round differently, so they are in the digest.
    kernel_forms: dict[str, str] = field(default_factory=dict)
    #: the bucket layout: consecutive DDP buckets are exchanged together until they hold this
    #: many MiB (None: each bucket on its own, as DDP made them); see the module docstring
    exchange_mb: float | None = None
    #: DDP's ``bucket_cap_mb`` the plan was tuned for, where it needs DDP built with smaller
    #: buckets than DDP's default (None: DDP's buckets as built); see the module docstring
    bucket_cap_mb: float | None = None

    def __post_init__(self) -> None:
        self.default = parse(self.default)
        self.kernel_forms = check_forms(self.kernel_forms)
        self.exchange_mb = check_layout_mb(self.exchange_mb)
        self.bucket_cap_mb = check_layout_mb(self.bucket_cap_mb, "bucket_cap_mb")
        if self.exchange_mb is not None and self.bucket_cap_mb is not None:
            raise ValueError(f"plan has exchange_mb={self.exchange_mb:g} and bucket_cap_mb={self.bucket_cap_mb:g}; "
                             "give one layout: exchange_mb joins DDP's buckets in the hook, bucket_cap_mb needs "
                             "DDP built with smaller buckets")
        self.groups = [g if isinstance(g, PlanGroup) else PlanGroup(**g) for g in self.groups]
        if isinstance(self.warmup_steps, bool) or not isinstance(self.warmup_steps, int) or self.warmup_steps < 0:
            raise ValueError(f"plan warmup_steps={self.warmup_steps!r}; allowed: an integer >= 0")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ValueError(f"plan seed={self.seed!r}; allowed: an integer")
        seen: dict[str, int] = {}
        for i, group in enumerate(self.groups):
            for name in group.parameters:
                if name in seen:
                    raise ValueError(
                        f"parameter {name!r} is in plan groups {seen[name]} and {i}; "
                        "each parameter may be in one group only"
                    )
                seen[name] = i
        self._by_name = {name: self.groups[i].compressor for name, i in seen.items()}

    # --- construction -------------------------------------------------------------
    @classmethod
    def uniform(cls, compressor: str | CompressorConfig, **kwargs: Any) -> Plan:
        """A plan where every parameter uses ``compressor``.

        Args:
            compressor: a config in any form :func:`advisor.parse` reads (``"fp16"``, ...).
            **kwargs: more fields: ``warmup_steps`` (uncompressed steps first; default 10),
                ``seed``, ``metadata``, ``kernel_forms``, ``exchange_mb``, ``bucket_cap_mb``.

        Raises:
            ValueError: an unreadable or invalid config, naming the allowed ones.
        """
        return cls(groups=[], default=parse(compressor), **kwargs)

    @classmethod
    def from_assignments(cls, assignments: Mapping[str, str | CompressorConfig], **kwargs: Any) -> Plan:
        """A plan from ``{parameter name: compressor}``; the rest use the default (``none``).

        Names with equal configs share a group.

        Args:
            assignments: parameter names (those of ``ddp_model.module``) to configs in any
                form :func:`advisor.parse` reads.
            **kwargs: more fields, as for :meth:`uniform` (and ``default``).

        Raises:
            ValueError: an invalid config, naming the allowed ones.
        """
        grouped: dict[CompressorConfig, list[str]] = {}
        for name, cfg in assignments.items():
            grouped.setdefault(parse(cfg), []).append(name)
        return cls(groups=[PlanGroup(tuple(n), c) for c, n in grouped.items()], **kwargs)

    # --- queries ------------------------------------------------------------------
    def config_for(self, parameter: str) -> CompressorConfig:
        """The config of one parameter (by its name in ``ddp_model.module``)."""
        return self._by_name.get(parameter, self.default)

    def runs(self, names: Sequence[str], shapes: Sequence[tuple[int, ...]]):
        """Split parameters laid out back to back into runs sharing a compressor.

        Returns ``[(names, shapes, config), ...]``: how the runtime splits a DDP bucket
        into segments, and how the performance model costs one.
        """
        runs: list[tuple[list[str], list[tuple[int, ...]], CompressorConfig]] = []
        for name, shape in zip(names, shapes):
            config = self.config_for(name)
            if runs and runs[-1][2] == config:
                runs[-1][0].append(name)
                runs[-1][1].append(tuple(shape))
            else:
                runs.append(([name], [tuple(shape)], config))
        return runs

    def configs(self) -> list[CompressorConfig]:
        """Every config the plan uses: the default, then each group's."""
        return [self.default, *(g.compressor for g in self.groups)]

    def named_parameters(self) -> set[str]:
        return set(self._by_name)

    def check_against(self, parameter_names: Iterable[str]) -> None:
        """Raise ValueError if the plan names parameters the model does not have."""
        model_names = set(parameter_names)
        missing = sorted(self.named_parameters() - model_names)
        if missing:
            shown = ", ".join(repr(m) for m in missing[:5]) + (" ..." if len(missing) > 5 else "")
            sample = ", ".join(repr(n) for n in sorted(model_names)[:5])
            raise ValueError(
                f"plan names {len(missing)} parameter(s) missing from the model: {shown}. "
                f"Model parameters look like: {sample}. Was the plan made for another model, "
                "or for the module before/after wrapping (names must be those of ddp_model.module)?"
            )

    # --- serialisation ------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": PLAN_KIND,
            "version": self.version,
            "default": self.default.to_dict(),
            "warmup_steps": self.warmup_steps,
            "seed": self.seed,
            "groups": [
                {"parameters": list(g.parameters), "compressor": g.compressor.to_dict()} for g in self.groups
            ],
            "metadata": self.metadata,
            **({"kernel_forms": dict(sorted(self.kernel_forms.items()))} if self.kernel_forms else {}),
            **({"exchange_mb": self.exchange_mb} if self.exchange_mb is not None else {}),
            **({"bucket_cap_mb": self.bucket_cap_mb} if self.bucket_cap_mb is not None else {}),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Plan:
        cls.check_header(data)
        version = data["version"]
        extra = set(data) - {"kind", "version", "default", "warmup_steps", "seed", "groups", "metadata", "kernel_forms",
                                "exchange_mb", "bucket_cap_mb"}
        if extra:
            raise ValueError(f"plan has unknown field(s) {sorted(extra)}")
        groups = []
        for i, g in enumerate(data.get("groups", [])):
            if not isinstance(g, Mapping) or set(g) != {"parameters", "compressor"}:
                raise ValueError(f"plan group {i} must be an object with 'parameters' and 'compressor', got {g!r}")
            if not isinstance(g["parameters"], Sequence) or isinstance(g["parameters"], str):
                raise ValueError(f"plan group {i}: 'parameters' must be a list of names")
            try:
                config = CompressorConfig.from_dict(g["compressor"])
            except ValueError as exc:
                raise ValueError(f"plan group {i} ({_describe(g['parameters'])}): {exc}") from None
            groups.append(PlanGroup(tuple(str(p) for p in g["parameters"]), config))
        return cls(
            groups=groups,
            default=CompressorConfig.from_dict(data.get("default", {"name": "none"})),
            warmup_steps=data.get("warmup_steps", 10),
            seed=data.get("seed", 0),
            metadata=dict(data.get("metadata", {})),
            version=version,
            kernel_forms=data.get("kernel_forms", {}),
            exchange_mb=data.get("exchange_mb"),
            bucket_cap_mb=data.get("bucket_cap_mb"),
        )

    def digest(self) -> str:
        """A hash of everything that changes what goes on the wire (metadata excluded)."""
        d = self.to_dict()
        d.pop("metadata")
        return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]


def check_layout_mb(size_mb: Any, name: str = "exchange_mb") -> float | None:
    """A layout's size in MiB (``exchange_mb``, or ``bucket_cap_mb`` by ``name``) as a float, or None;
    raises ValueError naming the allowed values."""
    if size_mb is None:
        return None
    if isinstance(size_mb, bool) or not isinstance(size_mb, (int, float)) or not (
            math.isfinite(size_mb) and size_mb > 0):
        meaning = ("consecutive DDP buckets are exchanged together until they hold that much), or None (each bucket "
                   "on its own)" if name == "exchange_mb" else
                   "DDP built with buckets of that size), or None (DDP's buckets as built)")
        raise ValueError(f"plan {name}={size_mb!r}; allowed: a size in MiB > 0 ({meaning}")
    return float(size_mb)


def exchange_groups(bucket_bytes: Sequence[int], exchange_mb: float | None) -> list[list[int]]:
    """Which consecutive buckets (indices into ``bucket_bytes``, in the order DDP hands them
    over) are exchanged together under ``exchange_mb``; the hook forms the same groups as the
    buckets arrive, and the performance model prices them."""
    if exchange_mb is None:
        return [[i] for i in range(len(bucket_bytes))]
    cap = exchange_mb * (1 << 20)
    groups: list[list[int]] = []
    held, size = [], 0
    for i, nbytes in enumerate(bucket_bytes):
        held.append(i)
        size += nbytes
        if size >= cap or i == len(bucket_bytes) - 1:
            groups.append(held)
            held, size = [], 0
    return groups


def _describe(names: Any) -> str:
    try:
        names = [str(n) for n in names]
    except TypeError:
        return "?"
    if not names:
        return "no parameters"
    return names[0] if len(names) == 1 else f"{names[0]} and {len(names) - 1} more"


def as_plan(plan: Plan | Mapping[str, Any] | str | Path) -> Plan:
    """The plan in any form a user may hold it.

    Args:
        plan: a :class:`Plan`, its dict form, or the path of its JSON file.

    Returns:
        The validated :class:`Plan`.

    Raises:
        ValueError: a malformed plan, naming the field and the fix (a file's errors name the file).
        TypeError: anything else.
    """
    if isinstance(plan, Plan):
        return plan
    if isinstance(plan, Mapping):
        return Plan.from_dict(plan)
    if isinstance(plan, (str, Path)):
        return Plan.load(plan)
    raise TypeError(f"expected a Plan, a plan dict or a path to a plan file, got {type(plan).__name__}")
