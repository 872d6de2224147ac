"""Kernel forms: two ways a compressor can compute the same step, and which one a device runs faster.

Some steps have forms that give the same result (to rounding) at speeds that depend on the
device and its BLAS: a low-rank outer product as one matmul or as rank-1 updates, PowerSGD's
projection as ``M Qᵀ`` or ``(Q Mᵀ)ᵀ``, integer codes converted directly or through int32.
A choice made once on one CPU does not carry to another (``benchmarks/kernel_choices.py``
found three of four such choices losing on a later CPU), so each is timed on the real device
by the kernel profiler (:func:`profilers.kernels.time_forms`), the faster form is kept in the cluster profile
and in the plan (``Plan.kernel_forms``), and the hook runs what the plan names.  The forms
round differently, so every rank must run the same one: the plan's digest covers them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

#: a faster form must beat the default by this much to be chosen: timing noise on a shared host
#: is a few percent, and a false choice costs as much as it seems to gain
CHOICE_MARGIN = 0.05


@dataclass(frozen=True)
class KernelChoice:
    """One step with alternative forms: their names, the plain one, and a probe that times a form.

    ``probe(form, device)`` returns a callable running that form once at a representative shape.
    """

    name: str
    forms: tuple[str, ...]
    default: str
    probe: Callable[[str, torch.device], Callable[[], object]]
    what: str


def _outer_probe(rank: int):
    def probe(form: str, device: torch.device):
        n, m = 2048, 1024
        p, qt = torch.randn(n, rank, device=device), torch.randn(rank, m, device=device)
        out = torch.empty(n, m, device=device)
        if form == "matmul":
            return lambda: torch.matmul(p, qt, out=out)

        def updates():
            torch.outer(p[:, 0], qt[0], out=out)
            for k in range(1, rank):
                out.addr_(p[:, k], qt[k])

        return updates

    return probe


def _projection_probe(form: str, device: torch.device):
    n, m, rank = 2048, 1024, 8
    mat, qt = torch.randn(n, m, device=device), torch.randn(rank, m, device=device)
    out, scratch = torch.empty(n, rank, device=device), torch.empty(rank, n, device=device)
    if form == "direct":
        return lambda: torch.matmul(mat, qt.t(), out=out)
    return lambda: out.copy_(torch.matmul(qt, mat.t(), out=scratch).t())


def _conversion_probe(form: str, device: torch.device):
    values = torch.randn(1 << 20, device=device) * 100
    wide = torch.empty(1 << 20, dtype=torch.int64, device=device)
    narrow = torch.empty(1 << 20, dtype=torch.int32, device=device)
    back = torch.empty(1 << 20, device=device)
    if form == "direct":
        return lambda: back.copy_(wide.copy_(values))
    return lambda: back.copy_(narrow.copy_(wide.copy_(narrow.copy_(values))))


CHOICES: dict[str, KernelChoice] = {c.name: c for c in (
    KernelChoice("powersgd-outer-rank1", ("matmul", "rank1-updates"), "matmul", _outer_probe(1),
                 "PowerSGD's P·Qᵀ at rank 1 on large matrices"),
    KernelChoice("powersgd-outer-rank2-4", ("matmul", "rank1-updates"), "matmul", _outer_probe(4),
                 "PowerSGD's P·Qᵀ at ranks 2-4 on large matrices"),
    KernelChoice("powersgd-projection", ("direct", "transposed"), "direct", _projection_probe,
                 "PowerSGD's M·Qᵀ from rank 4 up"),
    KernelChoice("intquant-conversion", ("direct", "via-int32"), "direct", _conversion_probe,
                 "packed integer quantisation's float <-> int64 codes"),
)}


def check_forms(forms: Mapping[str, str]) -> dict[str, str]:
    """``forms`` as a plain dict, or ValueError naming the unknown choice or form and the allowed ones."""
    if not isinstance(forms, Mapping):
        raise ValueError(f"kernel_forms={forms!r}; allowed: a mapping of kernel choice to form")
    for choice, form in forms.items():
        known = CHOICES.get(choice)
        if known is None:
            raise ValueError(f"unknown kernel choice {choice!r}; allowed: {sorted(CHOICES)}")
        if form not in known.forms:
            raise ValueError(f"kernel choice {choice!r} has no form {form!r}; allowed: {list(known.forms)}")
    return dict(forms)


def form_of(forms: Mapping[str, str] | None, choice: str) -> str:
    """The form to run for ``choice``: the one named in ``forms``, else the choice's default."""
    chosen = (forms or {}).get(choice)
    return chosen if chosen is not None else CHOICES[choice].default


def choose_forms(timings: Mapping[str, Mapping[str, float]], margin: float = CHOICE_MARGIN) -> dict[str, str]:
    """Per choice, the fastest form where it beats the default by more than ``margin``, else the default."""
    chosen = {}
    for name, seconds in timings.items():
        default = CHOICES[name].default
        fastest = min(seconds, key=seconds.get)
        chosen[name] = fastest if seconds[fastest] < (1 - margin) * seconds[default] else default
    return chosen
