"""Run one segment exchange for several simulated ranks in one process, in lockstep.

The same code path the hook runs (error feedback, non-finite guard, compressor rounds),
with the collectives computed locally: sum, max, or stacking for all-gather.  Used by the
tests to check multi-rank maths without processes, and by the fidelity profiler to replay
captured gradients at any world size.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from advisor.compressors.base import Collective, Compressor, ExchangeContext, Message, SegmentLayout
from advisor.runtime.segment import ResidualStore, guarded_exchange


def combine(messages: Sequence[Message]) -> torch.Tensor:
    collective = messages[0].collective
    tensors = [m.tensor for m in messages]
    if any(m.collective is not collective for m in messages):
        raise RuntimeError("simulated ranks issued different collectives (collective mismatch)")
    if any(t.shape != tensors[0].shape or t.dtype != tensors[0].dtype for t in tensors):
        raise RuntimeError("simulated ranks sent payloads of different size or type (collective mismatch)")
    if collective is Collective.ALL_GATHER:
        return torch.stack(tensors)
    if collective is Collective.ALL_REDUCE_MAX:
        return torch.stack(tensors).amax(dim=0)
    return torch.stack(tensors).sum(dim=0)


@dataclass
class SimulatedRanks:
    """Per-rank memory (residuals, compressor state) for repeated simulated exchanges."""

    world_size: int
    seed: int = 0
    residuals: list[ResidualStore] = field(default_factory=list)
    states: list[dict[str, Any]] = field(default_factory=list)
    step: int = 0
    bytes_sent: int = 0
    #: kernel forms, as a plan names them (:mod:`advisor.compressors.forms`)
    forms: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.residuals = [ResidualStore() for _ in range(self.world_size)]
        self.states = [{} for _ in range(self.world_size)]
        self.workspaces: list[dict] = [{} for _ in range(self.world_size)]

    def exchange(self, compressor: Compressor, grads: Sequence[torch.Tensor], layout: SegmentLayout) -> list[torch.Tensor]:
        """Each rank's averaged result for this step's gradients (inputs are not modified)."""
        if len(grads) != self.world_size:
            raise ValueError(f"got {len(grads)} gradients for {self.world_size} ranks")
        bufs = [g.detach().reshape(-1).to(torch.float32).clone() for g in grads]
        gens = [
            guarded_exchange(
                compressor,
                buf,
                layout,
                self.states[r],
                self.residuals[r] if compressor.error_feedback else None,
                ExchangeContext(
                    self.world_size,
                    step=self.step,
                    seed=self.seed,
                    rank=r,
                    workspace=self.workspaces[r].setdefault(layout.names, {}),
                    forms=self.forms,
                ),
            )
            for r, buf in enumerate(bufs)
        ]
        messages = [next(g) for g in gens]
        while True:
            for m in messages:
                self.bytes_sent += m.nbytes
            combined = combine(messages)
            nxt, done = [], 0
            for g in gens:
                try:
                    # every rank gets its own copy, as after a real collective
                    nxt.append(g.send(combined.clone()))
                except StopIteration:
                    done += 1
            if done:
                if done != len(gens):
                    raise RuntimeError("simulated ranks ended their exchanges after different rounds")
                break
            messages = nxt
        self.step += 1
        return bufs
