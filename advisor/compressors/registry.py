"""Names and parameters of every compressor, validated before anything runs."""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from advisor.compressors.base import Compressor
from advisor.compressors.casts import Bf16, Fp16, NoCompression
from advisor.compressors.powersgd import PowerSGD
from advisor.compressors.quantize import QSGD, IntQuant
from advisor.compressors.sign import SignSGD
from advisor.compressors.sparse import RandomK, TopK


@dataclass(frozen=True)
class ParamSpec:
    """One parameter of a compressor: its type, default, and what values are allowed."""

    kind: type
    default: Any
    allowed: str
    check: Callable[[Any], bool]


def _ratio() -> ParamSpec:
    return ParamSpec(float, 0.01, "a number in (0, 1]", lambda v: 0.0 < v <= 1.0)


def _bits(low: int) -> ParamSpec:
    return ParamSpec(int, 8, f"an integer in {low}..8", lambda v: low <= v <= 8)


@dataclass(frozen=True)
class Entry:
    factory: type[Compressor]
    params: Mapping[str, ParamSpec] = field(default_factory=dict)
    summary: str = ""


REGISTRY: dict[str, Entry] = {
    "none": Entry(NoCompression, {}, "fp32 all-reduce (DDP's default)"),
    "fp16": Entry(Fp16, {}, "cast to float16, all-reduce"),
    "bf16": Entry(Bf16, {}, "cast to bfloat16, all-reduce"),
    "powersgd": Entry(
        PowerSGD,
        {"rank": ParamSpec(int, 1, "an integer >= 1", lambda v: v >= 1)},
        "rank-r power iteration, two all-reduces, warm start",
    ),
    "topk": Entry(TopK, {"ratio": _ratio()}, "largest ratio·n magnitudes, all-gather"),
    "randomk": Entry(RandomK, {"ratio": _ratio()}, "ratio·n shared random coordinates, all-reduce"),
    "qsgd": Entry(QSGD, {"bits": _bits(2)}, "stochastic b-bit quantisation, packed, all-gather"),
    "intquant": Entry(
        IntQuant,
        {"bits": _bits(2), "packed": ParamSpec(int, 1, "0 or 1", lambda v: v in (0, 1))},
        "shared-scale b-bit integers summed in all-reduce (packed=1: int64 lanes; 0: int8/16)",
    ),
    "signsgd": Entry(SignSGD, {}, "1 bit a value plus a scale a parameter, all-gather"),
}


def available() -> dict[str, dict[str, str]]:
    """Every compressor the advisor knows, for listings and scripts.

    Returns:
        ``{name: {parameter: allowed values}}``, e.g. ``{"topk": {"ratio": "0 < ratio <= 1"}}``.
    """
    return {name: {p: spec.allowed for p, spec in e.params.items()} for name, e in REGISTRY.items()}


@dataclass(frozen=True)
class CompressorConfig:
    """A compressor name with its parameters; validated on creation.

    ``error_feedback=None`` means the compressor's default (on for lossy ones).
    """

    name: str
    params: Mapping[str, Any] = field(default_factory=dict)
    error_feedback: bool | None = None

    def __post_init__(self) -> None:
        entry = REGISTRY.get(self.name)
        if entry is None:
            raise ValueError(
                f"unknown compressor {self.name!r}; allowed: {', '.join(sorted(REGISTRY))}"
            )
        unknown = set(self.params) - set(entry.params)
        if unknown:
            allowed = ", ".join(entry.params) or "none"
            raise ValueError(
                f"compressor {self.name!r} has no parameter {', '.join(sorted(unknown))}; "
                f"its parameters: {allowed}"
            )
        clean = {}
        for pname, spec in entry.params.items():
            value = self.params.get(pname, spec.default)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"{self.name}: {pname}={value!r} is not a number; allowed: {spec.allowed}")
            if spec.kind is int and float(value) != int(value):
                raise ValueError(f"{self.name}: {pname}={value!r} is not an integer; allowed: {spec.allowed}")
            value = spec.kind(value)
            if not spec.check(value):
                raise ValueError(f"{self.name}: {pname}={value!r} is invalid; allowed: {spec.allowed}")
            clean[pname] = value
        if self.error_feedback not in (None, True, False):
            raise ValueError(f"{self.name}: error_feedback={self.error_feedback!r}; allowed: true, false or null")
        object.__setattr__(self, "params", clean)

    def __hash__(self) -> int:
        return hash((self.name, tuple(sorted(self.params.items())), self.error_feedback))

    def build(self) -> Compressor:
        return REGISTRY[self.name].factory(**self.params, error_feedback=self.error_feedback)

    @property
    def label(self) -> str:
        """Short human form, e.g. ``topk(ratio=0.01)``; :func:`parse` reads it back."""
        parts = [f"{k}={v}" for k, v in self.params.items()]
        if self.error_feedback is not None:
            parts.append("ef" if self.error_feedback else "no-ef")
        return f"{self.name}({', '.join(parts)})" if parts else self.name

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"name": self.name, "params": dict(self.params)}
        if self.error_feedback is not None:
            d["error_feedback"] = self.error_feedback
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> CompressorConfig:
        if not isinstance(d, Mapping) or "name" not in d:
            raise ValueError(f"a compressor must be an object with a 'name', got {d!r}")
        extra = set(d) - {"name", "params", "error_feedback"}
        if extra:
            raise ValueError(f"compressor {d.get('name')!r}: unknown field(s) {sorted(extra)}")
        params = d.get("params") or {}
        if not isinstance(params, Mapping):
            raise ValueError(f"compressor {d['name']!r}: 'params' must be an object, got {params!r}")
        return cls(str(d["name"]), dict(params), d.get("error_feedback"))


_CALL = re.compile(r"^\s*([a-z0-9_]+)\s*(?:\((.*)\)|:(.*))?\s*$")


def parse(text: str | CompressorConfig | Mapping[str, Any]) -> CompressorConfig:
    """Read a compressor config from its text or dict form.

    Args:
        text: ``"topk(ratio=0.01)"``, ``"topk:0.01"``, ``"powersgd(4, no-ef)"`` (unnamed values
            fill the parameters in order; ``ef``/``no-ef`` set error feedback), ``"fp16"``,
            a dict (the JSON form), or a config (returned as it is).

    Returns:
        The validated :class:`CompressorConfig`.

    Raises:
        ValueError: text that cannot be read, an unknown compressor or parameter, or a
            value outside what the parameter allows; each names the allowed ones.
    """
    if isinstance(text, CompressorConfig):
        return text
    if isinstance(text, Mapping):
        return CompressorConfig.from_dict(text)
    match = _CALL.match(str(text))
    if not match:
        raise ValueError(f"cannot read compressor {text!r}; write e.g. 'powersgd(rank=4)' or 'topk:0.01'")
    name, call_args, short_arg = match.groups()
    params: dict[str, Any] = {}
    error_feedback = None
    entry = REGISTRY.get(name)
    args = [a.strip() for a in (call_args or short_arg or "").split(",") if a.strip()]
    positional = list(entry.params) if entry is not None else []
    for position, arg in enumerate(args):
        if arg in ("ef", "no-ef"):
            error_feedback = arg == "ef"
            continue
        if "=" in arg:
            key, value = (s.strip() for s in arg.split("=", 1))
        else:  # unnamed values fill the parameters in their declared order
            if position >= len(positional):
                raise ValueError(f"cannot read compressor {text!r}: name the parameter, e.g. 'topk(ratio=0.01)'")
            key, value = positional[position], arg
        try:
            params[key] = float(value) if any(c in value for c in ".eE") else int(value)
        except ValueError:
            raise ValueError(f"compressor {text!r}: {key}={value!r} is not a number") from None
    return CompressorConfig(name, params, error_feedback)


def build(config: str | CompressorConfig | Mapping[str, Any]) -> Compressor:
    """A ready compressor from a config in any form :func:`parse` reads.

    Args:
        config: the config, as text, dict or :class:`CompressorConfig`.

    Returns:
        A new :class:`advisor.compressors.Compressor` (its state lives in the hook, not in it).

    Raises:
        ValueError: as :func:`parse`.
    """
    return parse(config).build()
