"""Draw a time-to-accuracy validation (:class:`advisor.testbed.validate.ValidationReport`)."""

from __future__ import annotations

import statistics

from rich.console import Console
from rich.table import Table


def render_validation(report, console: Console | None = None) -> None:
    """Each arm's final metric, its gap behind fp32, step time, time to the target and speed-up."""
    console = console or Console()
    console.print(f"[bold]Time to accuracy: {report.model}, {report.world_size} ranks, {report.where}[/bold]")
    if report.advice:
        console.print(f"Plan: {report.description} ({report.advice})")
    table = Table(title=f"{report.steps} steps from the same start and batches; held-out {report.metric}")
    for col in ("arm", f"final {report.metric}", "vs fp32", "ms/step", "time to target", "TTA speed-up"):
        table.add_column(col, justify="left" if col == "arm" else "right")
    for a in report.arms:
        tta = report.time_to_target_s.get(a.label)
        faster = report.time_to_target_speedup(a.label)
        table.add_row(a.description, f"{a.final(report.metric):.4g}", f"{report.gap(a.kind):+.2%}",
                      f"{a.step_s * 1e3:.1f}", f"{tta:.1f} s" if tta is not None else "never",
                      f"{faster:.2f}x" if faster else "-")
    console.print(table)
    s = report.speedup

    def fmt(x):
        return f"{x:.2f}x" if x is not None else "n/a (a target not reached)"

    console.print(f"Target: {report.metric} {'>=' if report.higher_is_better else '<='} {report.target:.4g} "
                  f"({report.target_source}). Time-to-accuracy speed-up of the plan: {fmt(s.get('vs_fp32'))} "
                  f"vs fp32, {fmt(s.get('vs_16bit'))} vs 16-bit.")
    if report.runs:
        _render_runs(report, console)
    noise = report.noise()
    if noise is not None:
        console.print(f"Noise: the two fp32 runs (batch orders) end {noise:.2%} apart in {report.metric}; the "
                      f"plan's gap is {report.gap():+.2%}" + (" (within it)." if report.gap() <= noise else
                                                             " (beyond it)."))


def _render_runs(report, console: Console) -> None:
    """Each batch order's comparison, then the plan's gap and speed-up over all of them."""
    table = Table(title=f"The same comparison in {len(report.runs)} batch orders (each timed to its own target)")
    for col in ("order", "target", "plan vs fp32", "TTA vs fp32", "TTA vs 16-bit"):
        table.add_column(col, justify="right")

    def fmt(x):
        return f"{x:.2f}x" if x is not None else "-"

    for r in report.runs:
        table.add_row(str(r.order), f"{r.target:.4g}", f"{r.gap(report.higher_is_better):+.2%}",
                      fmt(r.speedup("fp32")), fmt(r.speedup("16-bit")))
    console.print(table)
    mean, low, high = report.gap_interval()
    faster = [x for x in (r.speedup("16-bit") for r in report.runs) if x is not None]
    console.print(f"Over {len(report.runs)} orders the plan is {mean:+.2%} behind fp32 (95%: {low:+.2%} to "
                  f"{high:+.2%}); to accuracy vs 16-bit: " + (
                      f"median {statistics.median(faster):.2f}x, {min(faster):.2f}-{max(faster):.2f}x"
                      + (f" ({len(report.runs) - len(faster)} order(s) where one arm never reached it)"
                         if len(faster) < len(report.runs) else "") if faster else "never reached in any order"))


def save_validation_png(report, path) -> None:
    """The arms' held-out curves by step and by training time, with the target."""
    import matplotlib  # loaded only to draw: it takes seconds to import

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for a, style in zip(report.arms, ("-", (0, (1, 1)), "--", "-.", ":")):
        axes[0].plot(a.steps, a.metrics[report.metric], linestyle=style, label=a.description)
        axes[1].plot(a.seconds, a.metrics[report.metric], linestyle=style, label=a.description)
    axes[0].set(xlabel="step", ylabel=f"held-out {report.metric}")
    axes[1].set(xlabel="training time (s)", ylabel=f"held-out {report.metric}")
    for ax in axes:
        ax.axhline(report.target, color="grey", lw=0.8, ls=":")
        ax.legend(fontsize=8)
    fig.suptitle(f"{report.model}: time to accuracy ({report.where})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
