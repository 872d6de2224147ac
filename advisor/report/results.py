"""Draw tuning results: an autotune result, its accuracy trial, its buckets, a search's summary.

Everything drawn here is computed by the library (:mod:`advisor.tuning.results`,
:mod:`advisor.tuning.accuracy`); these functions only lay it out in rich or matplotlib.
"""

from __future__ import annotations

import statistics

import numpy as np
from rich.console import Console

from advisor.report.text import fitted_table, short_count, wrappable


def render_result(result, console: Console | None = None) -> None:
    """An :class:`advisor.tuning.results.AutotuneResult`: advice, why, the evidence, trial, cost, buckets."""
    console = console or Console()
    verdict = "compress" if result.compress else "do not compress"
    console.print(f"[bold]Advice ({result.where}, {result.world_size} ranks): {verdict}: "
                  f"{result.description}[/bold]")
    console.print(f"Why: {result.reason}")
    render_evidence(result, console)
    for r in getattr(result, "retimed", []):
        what = ("Run-off after the race, runner-up beside leader" if r.is_runoff
                else "Re-timed after the race")
        console.print(
            f"{what}: {r.label} {statistics.median(r.plan_s) * 1e3:.1f} vs {r.baseline} "
            f"{statistics.median(r.baseline_s) * 1e3:.1f} ms/step, the two alone in {len(r.plan_s)} rounds of "
            f"{r.steps} steps: {r.speedup:.2f}x per step ({r.low:.2f}-{r.high:.2f}, 95%); the race had said "
            f"{r.race_speedup:.2f}x")
    floor = result.predicted_s.get("compute_only")
    if floor:
        console.print(f"Compute-only floor (backward with communication off, measured by the profiler): "
                      f"{floor * 1e3:.1f} ms/step")
    s = result.speedup
    console.print(
        f"Step speed-up of the advice: in the race {s.get('measured_vs_fp32', float('nan')):.2f}x vs fp32, "
        f"{s.get('measured_vs_16bit', float('nan')):.2f}x vs 16-bit; predicted "
        f"{s.get('predicted_vs_fp32', float('nan')):.2f}x / {s.get('predicted_vs_16bit', float('nan')):.2f}x. "
        f"Fidelity ({result.fidelity_measure}) error {result.fidelity_error:.3g}, budget {result.fidelity_budget:.3g}: "
        + (result.budget_source or (f"the error of {result.reference} everywhere" if result.reference else "given"))
    )
    if result.accuracy_unproven:
        console.print(f"[bold]Accuracy not trialled[/bold] ({result.accuracy_unproven}): the speed-ups are per "
                      "step, not to the same accuracy")
    if result.accuracy is not None:
        render_accuracy(result.accuracy, console)
    console.print(
        f"Cost: profile {result.seconds.get('profile', 0):.1f} s, accuracy trial "
        f"{result.seconds.get('accuracy', 0):.1f} s, search {result.seconds.get('search', 0):.1f} s "
        f"({result.policy}, {result.policy_evaluations} plans predicted), live measurement "
        f"{result.seconds.get('measure', 0):.1f} s; total {result.seconds.get('total', 0):.1f} s"
    )
    if result.layouts:
        render_layouts(result, console)
    if result.buckets:
        render_buckets(result.buckets, console)


def render_layouts(result, console) -> None:
    """The bucket layouts searched, the one the advice runs, and how to build DDP for it."""
    console.print("Bucket layouts searched (best predicted plan each): " + "; ".join(result.layouts))
    if result.exchange_mb is None and result.bucket_cap_mb is not None:
        console.print(f"Layout of the advice: DDP's buckets at {result.bucket_cap_mb:g} MiB, smaller than the ones "
                      "this DDP model was built with; it was measured so. Only DDP makes its buckets smaller: build "
                      f"DDP with bucket_cap_mb={result.bucket_cap_mb:g} (advisor.ddp_for(module, result)); on the "
                      "DDP model it was tuned on the plan runs, more slowly")
    elif result.exchange_mb is None:
        console.print("Layout of the advice: DDP's own buckets")
    else:
        console.print(f"Layout of the advice: DDP's buckets exchanged together up to {result.exchange_mb:g} MiB, "
                      f"measured on a copy of DDP built with bucket_cap_mb={result.bucket_cap_mb:g}, which makes "
                      "these buckets itself: build DDP so (advisor.ddp_for(module, result)); on the DDP model it "
                      "was tuned on the hook joins the buckets with a copy each, more slowly")


def _bounded(value, low, high) -> str:
    """A ratio over its 95% bounds, on two lines so that the table stays narrow."""
    if value is None:
        return "-"
    return f"{value:.2f}x\n{low:.2f}-{high:.2f}"


def render_evidence(result, console) -> None:
    """Per measured plan: step time, step speed-up, step efficiency, time-to-accuracy speed-up, verdict."""
    by_label = {m.label: m for m in result.measured}
    base = next((e.label for e in result.evidence if e.step_speedup == 1.0 and e.step_low == 1.0), None)
    cells = []
    for e in result.evidence:
        m = by_label[e.label]
        chosen = " <- advice" if e.label == result.recommendation else ""
        cells.append([wrappable((m.description or m.label) + chosen), f"{m.median_s * 1e3:.1f}",
                      _bounded(e.step_speedup, e.step_low, e.step_high),
                      _bounded(e.efficiency, e.efficiency_low, e.efficiency_high),
                      _bounded(e.time_to_accuracy, e.tta_low, e.tta_high),
                      (e.status or ("baseline" if e.kind == "fp32" else "not trialled"))
                      + ("; per step re-timed" if getattr(e, "retimed", False) else "")])
    title = ("Against the best baseline" + (f" ({base})" if base else "") + ", with 95% bounds: speed-up per step "
             "(live), step efficiency (fp32 steps per step, from the accuracy trial), speed-up to the same accuracy")
    table = fitted_table(title, ("plan", "ms/step", "per step", "efficiency", "to accuracy", "verdict"), cells,
                         "plan", console.width)
    console.print(table)


#: the roles of the trial's own arms, in a word
_ROLES = {"fp32": "fp32", "fp32 (other order)": "noise"}


def render_accuracy(report, console) -> None:
    """The accuracy trial: how sure it could be, and each arm's gap behind fp32, efficiency and verdict."""
    where = "held-out batches" if report.held_out else "the training batches (none held out)"
    cells = []
    for arm in report.arms:
        trained = bool(arm.values)
        cells.append([wrappable(arm.description), _ROLES.get(arm.kind, arm.kind),
                      f"{arm.fidelity_error:.3g}" if arm.fidelity_error is not None else "-",
                      f"{arm.values[-1]:.4g}" if trained else "-",
                      (f"{arm.gap:+.2%}" if arm.gap is not None else "diverged") if trained else "not run",
                      f"{arm.efficiency:.2f}x" if arm.efficiency is not None else "-",
                      "" if arm.kind in _ROLES else arm.status])
    console.print(fitted_table(f"Accuracy trial: {report.steps} steps from the current weights, {report.metric} on "
                               f"{where} (noise: fp32 in another batch order)",
                               ("plan", "role", "fidelity error", f"final {report.metric}", "gap vs fp32",
                                "efficiency", "verdict"), cells, "plan", console.width))
    power = ("powered" if report.powered else "NOT powered: no compressed plan can be proven")
    console.print(f"How sure: the trial could detect a gap of {report.detectable:.2%} (80% power, 5%) against a "
                  f"tolerance of {report.tolerance:.2%}: {power}. Noise from two fp32 batch orders (standard error "
                  f"{report.se:.2%}); fp32 improved {report.progress:.1%}. Length: {report.length_reason}; "
                  f"{report.seconds:.1f} s")
    if report.evaluation_steps is not None:  # it sets how far apart the checkpoints are
        console.print(f"One evaluation costs about {report.evaluation_steps:.2g} training steps ({report.evaluation_cost}); "
                      f"so {len(report.checkpoints) - 1} checkpoints: steps {', '.join(map(str, report.checkpoints[1:6]))}"
                      f"{' ... ' + str(report.checkpoints[-1]) if len(report.checkpoints) > 6 else ''}")
    if report.exchange_free:
        console.print("The fp32 arms and 16-bit casts trained exchange-free: each rank computed every rank's "
                      f"gradients from the gathered batches, and no gradient crossed the link"
                      f"{' (' + report.exchange_reason + ')' if report.exchange_reason else ''}")
    elif report.exchange_reason:
        console.print(f"Every arm exchanged its gradients over the link ({report.exchange_reason})")
    if not report.powered:
        console.print(f"To prove more: {report.what_would_prove()}")
    for warning in report.warnings:
        console.print(f"[bold]Warning:[/bold] {warning}")


def save_measured_vs_predicted_png(result, path) -> None:
    """Bars of each live-measured plan: measured (with its round spread) next to predicted."""
    import matplotlib  # loaded only to draw: it takes seconds to import

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

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


def render_buckets(rows, console) -> None:
    """Per bucket under the chosen plan: its compressor, the model's costs, bytes and fidelity error."""
    cells = [[str(r.index), str(r.parameters), short_count(r.numel), wrappable(r.config), f"{r.encode_s * 1e3:.2f}",
              f"{r.comm_s * 1e3:.2f}", f"{r.decode_s * 1e3:.2f}", f"{r.wire_bytes / 1024:.0f}",
              f"{r.fidelity_error:.2g}"] for r in rows]
    table = fitted_table("Per bucket (in the order backward produces them;\n#: bucket, par: parameters, size: "
                         "elements, err: fidelity error)",
                         ("#", "par", "size", "compressor", "enc ms", "comm ms", "dec ms", "KiB", "err"), cells,
                         "compressor", console.width)
    console.print(table)


def render_search(summary: dict, rows, console) -> None:
    """A search on a saved profile (``advisor tune``): the predicted best plan and its buckets."""
    s16 = summary["speedup_vs_16bit"]
    console.print(f"[bold]Predicted best plan: {summary['description']}[/bold] "
                  f"({summary['predicted_s'] * 1e3:.1f} ms/iteration at {summary['world_size']} workers; "
                  f"compute-only floor {summary['compute_only_s'] * 1e3:.1f} ms)")
    console.print(f"{summary['speedup_vs_fp32']:.2f}x vs fp32"
                  + (f", {s16:.2f}x vs 16-bit" if s16 else "")
                  + f"; fidelity error {summary['fidelity_error']:.3g} (budget {summary['fidelity_budget']:.3g}); "
                  f"{summary['policy']}: {summary['evaluations']} plans in {summary['search_s']:.1f} s")
    render_buckets(rows, console)
