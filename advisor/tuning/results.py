"""The autotune result: a typed, versioned report that renders in rich and as JSON."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from advisor.core.documents import VersionedDocument
from advisor.core.speedups import speedup
from advisor.report.text import fitted_table, short_count, wrappable
from advisor.runtime.plan import Plan
from advisor.tuning.accuracy import AccuracyTrialReport
from policies.do_no_harm import LiveMeasurement
from policies.learned import Measurement

RESULT_KIND = "compression-advisor/autotune-result"
RESULT_VERSION = 1


@dataclass
class BucketRow:
    """One DDP bucket under the chosen plan, as the performance model sees it."""

    index: int
    parameters: int
    numel: int
    config: str
    encode_s: float
    comm_s: float
    decode_s: float
    wire_bytes: int
    fidelity_error: float


def bucket_rows(problem, choices) -> list[BucketRow]:
    """The model's view of each bucket under ``choices`` (one config index per bucket)."""
    import numpy as np

    costs = problem.costs
    return [
        BucketRow(int(problem.model.buckets[b].index), len(problem.parameter_names[b]),
                  int(problem.model.buckets[b].numel), problem.configs[int(c)], float(costs.encode_s[b, c]),
                  float(costs.comm_s[b, c]), float(costs.decode_s[b, c]), int(costs.wire_bytes[b, c]),
                  float(problem.errors[b, c]))
        for b, c in enumerate(np.asarray(choices).reshape(-1))
    ]


@dataclass
class AutotuneResult(VersionedDocument):
    """What autotune found, predicted, measured and chose, and why."""

    what = "autotune result"
    KIND = RESULT_KIND
    VERSION = RESULT_VERSION

    plan: dict[str, Any]
    recommendation: str
    compress: bool
    description: str
    reason: str
    predicted_s: dict[str, float]
    measured: list[LiveMeasurement]
    speedup: dict[str, float]
    fidelity_error: float
    fidelity_budget: float
    reference: str | None
    policy: str
    policy_evaluations: int
    seconds: dict[str, float]
    world_size: int
    where: str
    buckets: list[BucketRow] = field(default_factory=list)
    #: the policy's best distinct plans, best first (the top ones are measured live)
    searched_top: list[str] = field(default_factory=list)
    #: every live-measured plan with its model features: data for the learned correction
    measurements: list[Measurement] = field(default_factory=list)
    #: the accuracy trial (None when none ran) and where the fidelity budget came from
    accuracy: AccuracyTrialReport | None = None
    budget_source: str = ""
    fidelity_measure: str = "gradient"
    kind: str = RESULT_KIND
    version: int = RESULT_VERSION
    #: the installed CompressionHook (None when the advice is native fp32); not in the JSON
    hook: Any = field(default=None, init=False, repr=False, compare=False)

    def __getstate__(self) -> dict:
        # the hook is live state of this process (a worker thread, a process group): a
        # result sent to another process carries only its data
        state = dict(self.__dict__)
        state["hook"] = None
        return state

    def save_png(self, path) -> None:
        """Measured vs predicted step time of every plan measured live."""
        save_measured_vs_predicted_png(self, path)

    def plan_object(self) -> Plan:
        return Plan.from_dict(self.plan)

    def measured_s(self, label: str) -> float | None:
        for m in self.measured:
            if m.label == label:
                return m.median_s
        return None

    def render(self, console=None) -> None:
        from rich.console import Console
        from rich.table import Table

        console = console or Console()
        verdict = "compress" if self.compress else "do not compress"
        console.print(f"[bold]Advice ({self.where}, {self.world_size} ranks): {verdict}: "
                      f"{self.description}[/bold]")
        console.print(f"Why: {self.reason}")
        table = Table(title="Measured live (interleaved rounds, slowest rank)")
        for col, justify in (("plan", "left"), ("kind", "left"), ("ms/step", "right"), ("noise", "right"),
                             ("predicted ms", "right"), ("vs fp32", "right")):
            table.add_column(col, justify=justify)
        fp32 = self.measured_s("fp32")
        for m in sorted(self.measured, key=lambda m: m.median_s):
            chosen = " <- chosen" if m.label == self.recommendation else ""
            table.add_row(
                (m.description or m.label) + chosen, m.kind, f"{m.median_s * 1e3:.1f}", f"±{m.noise:.1%}",
                f"{m.predicted_s * 1e3:.1f}" if m.predicted_s else "-",
                f"{speedup(fp32, m.median_s):.2f}x" if fp32 else "-",
            )
        console.print(table)
        floor = self.predicted_s.get("compute_only")
        if floor:
            console.print(f"Compute-only floor (backward with communication off, measured by the profiler): "
                          f"{floor * 1e3:.1f} ms/step")
        s = self.speedup
        console.print(
            f"Speed-up of the advice: measured {s.get('measured_vs_fp32', float('nan')):.2f}x vs fp32, "
            f"{s.get('measured_vs_16bit', float('nan')):.2f}x vs 16-bit; predicted "
            f"{s.get('predicted_vs_fp32', float('nan')):.2f}x / {s.get('predicted_vs_16bit', float('nan')):.2f}x. "
            f"Fidelity ({self.fidelity_measure}) error {self.fidelity_error:.3g}, budget {self.fidelity_budget:.3g}: "
            + (self.budget_source or (f"the error of {self.reference} everywhere" if self.reference else "given"))
        )
        if self.accuracy is not None:
            render_accuracy(self.accuracy, console)
        console.print(
            f"Cost: profile {self.seconds.get('profile', 0):.1f} s, accuracy trial "
            f"{self.seconds.get('accuracy', 0):.1f} s, search {self.seconds.get('search', 0):.1f} s "
            f"({self.policy}, {self.policy_evaluations} plans predicted), live measurement "
            f"{self.seconds.get('measure', 0):.1f} s; total {self.seconds.get('total', 0):.1f} s"
        )
        if self.buckets:
            render_buckets(self.buckets, console)


def render_accuracy(report: AccuracyTrialReport, console) -> None:
    """The accuracy trial: each arm's fidelity error, gap behind fp32 and verdict."""
    from rich.table import Table

    where = "held-out batches" if report.held_out else "the training batches (none held out)"
    table = Table(title=f"Accuracy trial: {report.steps} steps from the current weights, {report.metric} on {where}")
    for col, justify in (("plan", "left"), ("role", "left"), ("fidelity err", "right"),
                         (f"final {report.metric}", "right"), ("gap vs fp32", "right"), ("verdict", "left")):
        # text columns wrap; numbers never do
        table.add_column(col, justify=justify, overflow="fold", no_wrap=justify == "right")

    for arm in report.arms:
        table.add_row(wrappable(arm.description), arm.kind,
                      f"{arm.fidelity_error:.3g}" if arm.fidelity_error is not None else "-",
                      f"{arm.values[-1]:.4g}", f"{arm.gap:+.2%}" if arm.gap is not None else "diverged",
                      "pass" if arm.accepted else "REJECTED")
    console.print(table)
    console.print(f"Trial noise (two fp32 batch orders): {report.noise:.2%}; tolerance {report.tolerance:.2%}; "
                  f"length: {report.length_reason}; {report.seconds:.1f} s")


def save_measured_vs_predicted_png(result: AutotuneResult, path) -> None:
    """Bars of each live-measured plan: measured (with its round spread) next to predicted."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    rows = sorted(result.measured, key=lambda m: m.median_s)
    x = np.arange(len(rows))
    fig, ax = plt.subplots(figsize=(max(6, 1.3 * len(rows)), 4))
    measured = [m.median_s * 1e3 for m in rows]
    spread = [[(m.median_s - min(m.round_s)) * 1e3 for m in rows], [(max(m.round_s) - m.median_s) * 1e3 for m in rows]]
    ax.bar(x - 0.2, measured, 0.4, yerr=spread, capsize=3, label="measured (median, round range)")
    ax.bar(x + 0.2, [(m.predicted_s or 0) * 1e3 for m in rows], 0.4, label="predicted")
    floor = result.predicted_s.get("compute_only")
    if floor:
        ax.axhline(floor * 1e3, color="grey", ls=":", lw=1, label="compute-only floor")
    ax.set_xticks(x, [("* " if m.label == result.recommendation else "") + (m.description or m.label)
                      for m in rows], rotation=20, ha="right", fontsize=8)
    ax.set_ylabel("ms per step")
    ax.set_title(f"{result.where}: measured vs predicted (* = advice)", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def render_buckets(rows: list[BucketRow], console) -> None:

    cells = [[str(r.index), str(r.parameters), short_count(r.numel), wrappable(r.config), f"{r.encode_s * 1e3:.2f}",
              f"{r.comm_s * 1e3:.2f}", f"{r.decode_s * 1e3:.2f}", f"{r.wire_bytes / 1024:.0f}",
              f"{r.fidelity_error:.2g}"] for r in rows]
    table = fitted_table("Per bucket (in the order backward produces them;\n#: bucket, par: parameters, size: "
                         "elements, err: fidelity error)",
                         ("#", "par", "size", "compressor", "enc ms", "comm ms", "dec ms", "KiB", "err"), cells,
                         "compressor", console.width)
    console.print(table)
