"""PowerSGD (Vogels et al., NeurIPS 2019): rank-r approximation by one power iteration.

Wire protocol, two all-reduces (both summable, so it scales like dense all-reduce):

1. ``P = M Q`` for every compressible matrix, plus every uncompressed tensor (1-D tensors
   and matrices that would not shrink) in the same message;
2. after orthogonalising the summed P on every rank, ``Q = Mᵀ P̂``.

Decode is ``P̂ Q̄ᵀ``.  The summed Q is kept as the next step's starting Q (warm start),
identical on all ranks because it came out of an all-reduce.  The initial Q is drawn from a
generator seeded by parameter name, so ranks agree without communicating.

Error feedback uses this rank's own estimate ``P̂ Q_localᵀ``: by linearity the mean of the
local estimates is exactly the decoded update, so residuals account for every lost bit.
"""

from __future__ import annotations

import math

import torch

from advisor.compressors.base import Collective, Compressor, Exchange, Message, SegmentLayout, WireSpec, is_finite, stable_hash
from advisor.compressors.forms import form_of


def matrix_shape(shape: tuple[int, ...]) -> tuple[int, int] | None:
    """The 2-D view PowerSGD compresses, or None for tensors it sends as they are."""
    if len(shape) < 2:
        return None
    return shape[0], math.prod(shape[1:])


def orthogonalize_(p: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """Orthonormalise the columns of ``p`` (n x r) in place."""
    if p.shape[1] == 1:
        p.div_(p.norm() + eps)
    else:
        q, _ = torch.linalg.qr(p, mode="reduced")
        p.copy_(q)
    return p


#: outer products smaller than this always go as one matmul: the choice between forms is timed
#: (and matters) on out-of-cache matrices
_FORM_MIN_NUMEL = 1 << 18
#: from this rank up, products are always one matmul (a loop of rank-1 updates only pays at low rank)
_RANK1_UPDATES_MAX_RANK = 4
#: from this rank up, the projection has two forms
_TRANSPOSED_PROJECTION_MIN_RANK = 4


def outer_form(rank: int, numel: int, forms=None) -> str:
    """The form of ``P·Qᵀ`` at this rank and size under ``forms`` (a plan's kernel forms)."""
    if rank > _RANK1_UPDATES_MAX_RANK or numel < _FORM_MIN_NUMEL:
        return "matmul"
    return form_of(forms, "powersgd-outer-rank1" if rank == 1 else "powersgd-outer-rank2-4")


def outer_product_(p: torch.Tensor, qt: torch.Tensor, out: torch.Tensor, subtract: bool = False,
                   form: str = "matmul") -> torch.Tensor:
    """``out = p·qt``, or ``out -= p·qt`` with ``subtract``; ``p`` is (n, r), ``qt`` (r, m).

    ``form``: ``"matmul"``, or ``"rank1-updates"`` (one BLAS ger a rank): on some CPUs sgemm
    with an inner dimension of 1 to 4 on an out-of-cache matrix runs far below memory speed
    while ger streams it; the kernel profiler times both on the device
    (:mod:`advisor.compressors.forms`).
    """
    if form == "matmul":
        if subtract:
            return out.addmm_(p, qt, alpha=-1.0)
        return torch.matmul(p, qt, out=out)
    alpha = -1.0 if subtract else 1.0
    for k in range(p.shape[1]):
        if k == 0 and not subtract:
            torch.outer(p[:, 0], qt[0], out=out)
        else:
            out.addr_(p[:, k], qt[k], alpha=alpha)
    return out


def project_(mat: torch.Tensor, qt: torch.Tensor, out: torch.Tensor, ctx=None) -> torch.Tensor:
    """``out = mat·qtᵀ`` (n x r) for ``mat`` (n, m) and ``qt`` (r, m).

    Two forms from rank 4 up (``ctx.form("powersgd-projection")``): ``"direct"``, or
    ``"transposed"``, the (r, n) product ``Q Mᵀ`` into a small scratch buffer, copied into
    place: some BLAS pick their kernel by the output's layout, and ran that one faster.
    """
    r = qt.shape[0]
    form = ctx.form("powersgd-projection") if ctx is not None else "direct"
    if r < _TRANSPOSED_PROJECTION_MIN_RANK or form == "direct":
        return torch.matmul(mat, qt.t(), out=out)
    n = mat.shape[0]
    scratch = ctx.buffer(f"p-transposed-{r * n}", r * n, mat.dtype, mat.device).view(r, n)
    torch.matmul(qt, mat.t(), out=scratch)
    return out.copy_(scratch.t())


class PowerSGD(Compressor):
    name = "powersgd"
    detects_nonfinite = True  # P = MQ is non-finite iff M is (NaN·0 is NaN)

    def __init__(self, rank: int = 1, warm_start: bool = True, error_feedback: bool | None = None):
        super().__init__(error_feedback)
        self.rank = int(rank)
        self.warm_start = bool(warm_start)

    @property
    def params(self):
        return {"rank": self.rank}

    def state_keys(self) -> tuple[str, ...]:
        return ("q",)

    def _plan(self, layout: SegmentLayout):
        """Split parameters into (index, n, m, r) to compress and indices to send dense."""
        compressed, dense = [], []
        for i, shape in enumerate(layout.shapes):
            nm = matrix_shape(shape)
            if nm is not None:
                n, m = nm
                r = min(self.rank, n, m)
                if (n + m) * r < n * m:
                    compressed.append((i, n, m, r))
                    continue
            dense.append(i)
        return compressed, dense

    def wire(self, layout: SegmentLayout, world_size: int) -> list[WireSpec]:
        compressed, dense = self._plan(layout)
        numels = layout.numels
        first = sum(n * r for _, n, _, r in compressed) + sum(numels[i] for i in dense) + 1
        specs = [WireSpec(Collective.ALL_REDUCE_SUM, first * 4)]
        if compressed:
            specs.append(WireSpec(Collective.ALL_REDUCE_SUM, sum(m * r for _, _, m, r in compressed) * 4))
        return specs

    def _initial_q(self, name: str, m: int, r: int, ctx, device) -> torch.Tensor:
        gen = ctx.generator(stable_hash(name), device)
        return torch.randn(r, m, generator=gen, device=device)

    def exchange(self, inp, out, layout, state, ctx) -> Exchange:
        compressed, dense = self._plan(layout)
        views_in = layout.views(inp)
        views_out = layout.views(out)
        qmem = state.setdefault("q", {})

        p_numel = sum(n * r for _, n, _, r in compressed)
        dense_numel = sum(views_in[i].numel() for i in dense)
        first = ctx.payload(p_numel + dense_numel, torch.float32, inp.device)
        ps, offset = [], 0
        for i, n, m, r in compressed:
            name = layout.names[i]
            # Q is kept transposed, (r, m): on CPU, Pᵀ·M is several times faster than Mᵀ·P
            qt = qmem.get(name) if self.warm_start else None
            if qt is None or qt.shape != (r, m):
                qt = self._initial_q(name, m, r, ctx, inp.device)
            qmem[name] = qt
            p = first[offset : offset + n * r].view(n, r)
            project_(views_in[i].view(n, m), qt, p, ctx)
            ps.append(p)
            offset += n * r
        for i in dense:
            k = views_in[i].numel()
            first[offset : offset + k].copy_(views_in[i].reshape(-1))
            offset += k
        ctx.nonfinite = not is_finite(first)

        if not compressed:
            if ctx.keep_residual:
                inp.zero_()
            summed = yield Message(first, Collective.ALL_REDUCE_SUM, last=True)
            self._write_dense(summed, 0, dense, views_out, ctx.world_size)
            return

        summed_p = yield Message(first, Collective.ALL_REDUCE_SUM, last=False)
        # Dense tensors are done after round one; keep their sums before the buffer is reused.
        dense_sums = summed_p[p_numel:].clone() if dense else None

        q_local = ctx.buffer("q", sum(m * r for _, _, m, r in compressed), torch.float32, inp.device)
        p_hats, offset_p, offset_q = [], 0, 0
        for (i, n, m, r) in compressed:
            p_hat = orthogonalize_(summed_p[offset_p : offset_p + n * r].view(n, r).clone())
            p_hats.append(p_hat)
            mat = views_in[i].view(n, m)
            qt = q_local[offset_q : offset_q + m * r].view(r, m)
            torch.matmul(p_hat.t(), mat, out=qt)
            if ctx.keep_residual:
                outer_product_(p_hat, qt, mat, subtract=True, form=outer_form(r, mat.numel(), ctx.forms))
            offset_p += n * r
            offset_q += m * r
        if ctx.keep_residual:
            for i in dense:
                views_in[i].zero_()

        summed_q = yield Message(q_local, Collective.ALL_REDUCE_SUM, last=True)
        offset_q = 0
        summed_q.mul_(1.0 / ctx.world_size)  # average Q (small) rather than M (large)
        for (i, n, m, r), p_hat in zip(compressed, p_hats):
            qt_mean = summed_q[offset_q : offset_q + m * r].view(r, m)
            qmem[layout.names[i]] = qt_mean.clone()
            outer_product_(p_hat, qt_mean, views_out[i].view(n, m), form=outer_form(r, n * m, ctx.forms))
            offset_q += m * r
        if dense:
            self._write_dense(dense_sums, 0, dense, views_out, ctx.world_size)

    @staticmethod
    def _write_dense(summed, offset, dense, views_out, world_size):
        for i in dense:
            k = views_out[i].numel()
            torch.mul(summed[offset : offset + k].view_as(views_out[i]), 1.0 / world_size, out=views_out[i])
            offset += k
