"""Rich renderings of the advisor's data for people (scripts use the JSON forms)."""

from __future__ import annotations

import io
from collections.abc import Sequence

from rich import box
from rich.console import Console
from rich.table import Table


def render_profile(profile, console: Console | None = None) -> None:
    """Summarise a ClusterProfile: environment, compute, network fits, kernels, fidelity."""
    console = console or Console()
    env, comp = profile.environment, profile.compute
    console.print(
        f"[bold]Cluster profile[/bold]: {env.world_size} ranks, {env.backend}, {env.device}, torch "
        f"{env.torch_version}, {env.threads} thread(s) a rank. {env.note}"
    )
    console.print(
        f"Compute (slowest rank, no communication): forward {comp.forward_s * 1e3:.1f} ms, backward "
        f"{comp.backward_s * 1e3:.1f} ms, optimizer {comp.optimizer_s * 1e3:.1f} ms; "
        f"{len(comp.parameters)} parameters in {len(comp.buckets)} DDP buckets."
    )
    buckets = Table(title="DDP buckets (after rebuild)")
    for col in ("bucket", "parameters", "elements", "last gradient ready (ms)"):
        buckets.add_column(col, justify="left" if col == "parameters" else "right")
    ready = profile.bucket_ready_s()
    for b in comp.buckets:
        names = ", ".join(b.parameters[:3]) + (f" +{len(b.parameters) - 3}" if len(b.parameters) > 3 else "")
        buckets.add_row(str(b.index), names, f"{b.numel:,}", f"{ready[b.index] * 1e3:.2f}")
    console.print(buckets)
    if profile.network is not None:
        net = Table(title=f"Collectives (fitted; measured in {profile.network.elapsed_s:.1f} s)")
        for col in ("collective", "latency (ms)", "link bandwidth (Mbit/s)", "host CPU per 16 MB (ms)", "R²",
                    "points"):
            net.add_column(col, justify="right" if col != "collective" else "left")
        costs = profile.collective_costs(16 << 20)
        for name, fit in profile.network.fits.items():
            # the CPU time an op of a 16 MB input costs the host (it competes with a CPU backward)
            net.add_row(name, f"{fit.latency_s * 1e3:.3f}", f"{fit.bandwidth_bps / 1e6:.0f}",
                        f"{costs[name][1] * 1e3:.1f}", f"{fit.r2:.3f}", str(len(fit.points)))
        if profile.network.round_s:
            net.caption = (f"A message round inside a step costs {profile.network.round_s * 1e3:.2f} ms more "
                           "than the fit (ranks arrive apart, threads wake from idle).")
        console.print(net)
    if profile.kernels is not None:
        kern = Table(title=f"Compressor cost on {profile.kernels.device} (fitted, per 1M elements)")
        for col in ("config", "encode (ms)", "decode (ms)"):
            kern.add_column(col, justify="right" if col != "config" else "left")
        for label, (enc, dec) in profile.kernel_costs(1 << 20).items():
            kern.add_row(label, f"{enc * 1e3:.2f}", f"{dec * 1e3:.2f}")
        console.print(kern)
    if profile.fidelity is not None:
        render_fidelity(profile.fidelity, comp.buckets, console)


def natural_width(table: Table) -> int:
    """Columns ``table`` takes when nothing squeezes it (its title may wrap, its cells do not)."""
    wide = Console(width=1000, file=io.StringIO())
    table_title, table.title = table.title, None
    try:
        with wide.capture() as captured:
            wide.print(table)
    finally:
        table.title = table_title
    return max((len(line.rstrip()) for line in captured.get().splitlines()), default=0)


def fitted_table(title: str, headers: Sequence[str], cells: Sequence[Sequence[str]], name: str,
                 width: int) -> Table:
    """A table of numbers that fits ``width`` columns without cutting one: headers break at
    their spaces, numbers never wrap, and only the ``name`` column (text) wraps to make room."""
    widths = [max([len(line) for row in cells for line in row[i].split("\n")]
                  + [max(len(w) for w in header.split())])
              for i, header in enumerate(headers)]
    at = list(headers).index(name)

    def table_of(name_width: int) -> Table:
        table = Table(title=title, box=box.SIMPLE_HEAD, pad_edge=False)
        for i, header in enumerate(headers):
            if i == at:
                table.add_column(header, overflow="fold", width=name_width)
            else:
                table.add_column(header.replace(" ", "\n"), justify="right", no_wrap=True, min_width=widths[i])
        for row in cells:
            table.add_row(*row)
        return table

    # the name column's width adds one for one to the table's: one measurement says how much to give up
    excess = natural_width(table_of(widths[at])) - width
    return table_of(max(len(name), widths[at] - max(0, excess)))


def render_fidelity(fidelity, buckets, console: Console) -> None:
    """Fidelity error and compression gain per config (rows) and bucket (columns).

    Wide models are split into several tables of as many buckets as fit the console, so
    no number is ever cut.
    """
    by_config: dict[str, dict[int, tuple[float, float]]] = {}
    for e in fidelity.entries:
        by_config.setdefault(e.config, {})[e.bucket] = (e.relative_error, e.compression_gain)
    label_width = max([len("config")] + [len(c) for c in by_config])
    indices = [b.index for b in buckets]
    cell = max(len("(0.00)"), len(str(max(indices, default=0))))
    title = (f"Gradient fidelity over {fidelity.steps} captured steps (error feedback on): relative error "
             "per bucket, and in brackets the compression gain ||C(g)||/||g||")

    def table_of(chunk: list[int], first: bool) -> Table:
        fid = Table(title=title if first else None, box=box.SIMPLE_HEAD, pad_edge=False)
        fid.add_column("config \\ bucket" if label_width >= 15 else "config", no_wrap=True)
        for index in chunk:
            fid.add_column(str(index), justify="right", no_wrap=True, min_width=cell)
        for label, per_bucket in by_config.items():
            fid.add_row(label, *[f"{per_bucket[i][0]:.3f}" if i in per_bucket else "-" for i in chunk])
            fid.add_row("", *[f"({per_bucket[i][1]:.2f})" if i in per_bucket else "" for i in chunk],
                        style="dim")
        return fid

    # every bucket column is as wide as the next: two measurements give how many fit
    one = natural_width(table_of(indices[:1], True))
    step = natural_width(table_of(indices[:2], True)) - one if len(indices) > 1 else 1
    per_table = max(1, min(len(indices), 1 + (console.width - one) // max(step, 1)))
    for part, start in enumerate(range(0, len(indices), per_table)):
        fid = table_of(indices[start : start + per_table], part == 0)
        console.print(fid)


def wrappable(label: str) -> str:
    """A config label with a space before its parameters, where a narrow table may wrap it."""
    return label.replace("(", " (", 1)


def short_count(n: int) -> str:
    """``4,197,376`` -> ``4.20M``: narrow enough for an 80-column table."""
    if n >= 1_000_000:
        return f"{n / 1e6:.2f}M"
    if n >= 10_000:
        return f"{n / 1e3:.0f}k"
    return f"{n:,}"


def timeline_bars(timeline, width: int = 64) -> list[str]:
    """A text timeline of backward: one line for backward, one per bucket.

    ``=`` backward compute, ``e`` encode, ``.`` waiting for the channel, ``#`` on the wire,
    ``d`` decode; the scale runs from the start of backward to the end of the last decode.
    """
    end = max([timeline.backward_end_s] + [b.decode_end_s for b in timeline.buckets]) or 1e-9

    def col(t: float) -> int:
        return max(0, min(width, round(t / end * width)))

    lines = ["backward  |" + "=" * col(timeline.backward_end_s) + " " * (width - col(timeline.backward_end_s)) + "|"]
    for b in timeline.buckets:
        row = [" "] * width
        for start, stop, ch in ((b.encode_start_s, b.encode_end_s, "e"), (b.encode_end_s, b.comm_start_s, "."),
                                (b.comm_start_s, b.comm_end_s, "#"), (b.comm_end_s, b.decode_end_s, "d")):
            a, z = col(start), col(stop)
            if z == a and stop > start:
                z = min(width, a + 1)
            for i in range(a, z):
                row[i] = ch
        lines.append(f"bucket {b.bucket:<3d}|" + "".join(row) + f"| {b.config}")
    lines.append(f"          0{'':{width - 12}}{end * 1e3:8.1f} ms")
    return lines


def render_plan(prediction, console: Console | None = None, png: str | None = None) -> None:
    """A :class:`advisor.tuning.prediction.PlanPrediction`: per bucket, the baselines, the timeline."""
    console = console or Console()
    title = (f"Plan {prediction.plan_digest} on {prediction.world_size} ranks ({prediction.where});\n"
             "#: bucket, par: parameters, size: elements, err: fidelity error (n/p: not profiled)")
    cells = [[str(r.bucket), str(r.parameters), short_count(r.numel), wrappable(r.config), f"{r.encode_s * 1e3:.2f}",
              f"{r.wait_s * 1e3:.2f}", f"{r.comm_s * 1e3:.2f}", f"{r.decode_s * 1e3:.2f}", f"{r.wire_bytes / 1024:.0f}",
              f"{r.fidelity_error:.2g}" if r.fidelity_error is not None else "n/p"] for r in prediction.buckets]
    console.print(fitted_table(title, ("#", "par", "size", "compressor", "enc ms", "wait ms", "comm ms", "dec ms",
                                       "KiB", "err"), cells, "compressor", console.width))
    console.print(f"Predicted {prediction.predicted_s * 1e3:.1f} ms/iteration (compute-only floor "
                  f"{prediction.compute_only_s * 1e3:.1f} ms): {prediction.speedup_vs_fp32:.2f}x vs fp32"
                  + (f", {prediction.speedup_vs_16bit:.2f}x vs 16-bit" if prediction.speedup_vs_16bit else "") + ".")
    console.print(f"Accuracy: checked, {prediction.accuracy}" if prediction.accuracy else
                  "Accuracy: this rests on a prediction no trial has checked; prove the plan with "
                  "`advisor validate --plan PLAN` (or let autotune trial it)")
    timeline = prediction.timeline
    label = max([len(b.config) for b in timeline.buckets] + [0])
    for line in timeline_bars(timeline, width=max(20, min(64, console.width - 14 - label))):
        console.print(line, markup=False, highlight=False)
    console.print("= backward  e encode  . wait for the channel  # on the wire  d decode", markup=False,
                  highlight=False)
    if png:
        timeline.save_png(png)
        console.print(f"timeline plot written to {png}")
