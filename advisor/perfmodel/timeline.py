"""The predicted timeline of one DDP iteration, with Chrome-trace and PNG exports."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from advisor.core.documents import VersionedDocument

TIMELINE_KIND = "compression-advisor/timeline"
TIMELINE_VERSION = 1


@dataclass
class BucketSpan:
    """Times (s from the start of backward) of one bucket's work."""

    bucket: int
    config: str
    ready_s: float
    encode_start_s: float
    encode_end_s: float
    comm_start_s: float
    comm_end_s: float
    decode_end_s: float
    wire_bytes: int

    @property
    def wait_s(self) -> float:
        return self.comm_start_s - self.encode_end_s


@dataclass
class Timeline(VersionedDocument):
    """One iteration: forward, backward with its buckets, optimizer."""

    what = "timeline"
    KIND = TIMELINE_KIND
    VERSION = TIMELINE_VERSION

    iteration_s: float
    forward_s: float
    backward_end_s: float
    optimizer_s: float
    compute_only_s: float
    buckets: list[BucketSpan] = field(default_factory=list)
    kind: str = TIMELINE_KIND
    version: int = TIMELINE_VERSION

    @property
    def exposed_comm_s(self) -> float:
        """Time the iteration waits for communication beyond the compute-only floor."""
        return max(0.0, self.iteration_s - self.compute_only_s)

    # --- exports ------------------------------------------------------------------
    def chrome_trace(self) -> dict:
        """Chrome/Perfetto trace events (open in ui.perfetto.dev or chrome://tracing)."""
        us = 1e6
        t0 = self.forward_s  # backward starts after forward
        events = [
            {"name": "forward", "ph": "X", "pid": 0, "tid": 0, "ts": 0.0, "dur": self.forward_s * us},
            {"name": "backward", "ph": "X", "pid": 0, "tid": 0, "ts": t0 * us, "dur": self.backward_end_s * us},
            {"name": "optimizer", "ph": "X", "pid": 0, "tid": 0,
             "ts": (self.iteration_s - self.optimizer_s) * us, "dur": self.optimizer_s * us},
        ]
        for b in self.buckets:
            args = {"config": b.config, "wire_bytes": b.wire_bytes}
            events += [
                {"name": f"encode b{b.bucket}", "ph": "X", "pid": 0, "tid": 1, "args": args,
                 "ts": (t0 + b.encode_start_s) * us, "dur": (b.encode_end_s - b.encode_start_s) * us},
                {"name": f"comm b{b.bucket} {b.config}", "ph": "X", "pid": 0, "tid": 2, "args": args,
                 "ts": (t0 + b.comm_start_s) * us, "dur": (b.comm_end_s - b.comm_start_s) * us},
                {"name": f"decode b{b.bucket}", "ph": "X", "pid": 0, "tid": 3, "args": args,
                 "ts": (t0 + b.comm_end_s) * us, "dur": (b.decode_end_s - b.comm_end_s) * us},
            ]
        names = {0: "compute", 1: "encode (on the compute thread)", 2: "communication", 3: "decode"}
        events += [{"name": "thread_name", "ph": "M", "pid": 0, "tid": t, "args": {"name": n}} for t, n in names.items()]
        return {"traceEvents": events, "displayTimeUnit": "ms"}

    def save_trace(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.chrome_trace()))

    def save_png(self, path: str | Path, title: str = "") -> None:
        """A bar per lane: compute, encode, communication, decode."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        ms = 1e3
        t0 = self.forward_s
        fig, ax = plt.subplots(figsize=(10, 2.8))
        lanes = {"compute": 3, "encode": 2, "comm": 1, "decode": 0}
        ax.broken_barh([(0, self.forward_s * ms)], (lanes["compute"] - 0.4, 0.8), color="#8da0cb", label="forward")
        ax.broken_barh([(t0 * ms, self.backward_end_s * ms)], (lanes["compute"] - 0.4, 0.8), color="#66c2a5",
                       label="backward")
        ax.broken_barh([((self.iteration_s - self.optimizer_s) * ms, self.optimizer_s * ms)],
                       (lanes["compute"] - 0.4, 0.8), color="#e78ac3", label="optimizer")
        for b in self.buckets:
            ax.broken_barh([((t0 + b.encode_start_s) * ms, (b.encode_end_s - b.encode_start_s) * ms)],
                           (lanes["encode"] - 0.4, 0.8), color="#fc8d62")
            ax.broken_barh([((t0 + b.comm_start_s) * ms, (b.comm_end_s - b.comm_start_s) * ms)],
                           (lanes["comm"] - 0.4, 0.8), color="#a6d854", edgecolor="black", linewidth=0.3)
            ax.broken_barh([((t0 + b.comm_end_s) * ms, (b.decode_end_s - b.comm_end_s) * ms)],
                           (lanes["decode"] - 0.4, 0.8), color="#ffd92f")
        ax.set_yticks(list(lanes.values()), list(lanes.keys()))
        ax.set_xlabel("ms")
        ax.axvline(self.compute_only_s * ms, color="grey", linestyle="--", linewidth=1)
        ax.set_title(title or f"predicted iteration {self.iteration_s * ms:.1f} ms "
                              f"(compute-only floor {self.compute_only_s * ms:.1f} ms)")
        ax.legend(loc="upper right", fontsize=7)
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
