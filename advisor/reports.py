"""Rich renderings of the advisor's data for people (scripts use the JSON forms)."""

from __future__ import annotations

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
    ready = {p.name: p.ready_s for p in comp.parameters}
    for b in comp.buckets:
        names = ", ".join(b.parameters[:3]) + (f" +{len(b.parameters) - 3}" if len(b.parameters) > 3 else "")
        buckets.add_row(str(b.index), names, f"{b.numel:,}", f"{max(ready[n] for n in b.parameters) * 1e3:.2f}")
    console.print(buckets)
    if profile.network is not None:
        net = Table(title=f"Collectives (fitted; measured in {profile.network.elapsed_s:.1f} s)")
        for col in ("collective", "latency (ms)", "link bandwidth (Mbit/s)", "R²", "points"):
            net.add_column(col, justify="right" if col != "collective" else "left")
        for name, fit in profile.network.fits.items():
            net.add_row(name, f"{fit.latency_s * 1e3:.3f}", f"{fit.bandwidth_bps / 1e6:.0f}", f"{fit.r2:.3f}",
                        str(len(fit.points)))
        console.print(net)
    if profile.kernels is not None:
        kern = Table(title=f"Compressor cost on {profile.kernels.device} (fitted, per 1M elements)")
        for col in ("config", "encode (ms)", "decode (ms)"):
            kern.add_column(col, justify="right" if col != "config" else "left")
        for label, cost in profile.kernels.costs.items():
            enc, dec = cost.predict(1 << 20)
            kern.add_row(label, f"{enc * 1e3:.2f}", f"{dec * 1e3:.2f}")
        console.print(kern)
    if profile.fidelity is not None:
        fid = Table(title=f"Gradient fidelity over {profile.fidelity.steps} captured steps (error feedback on)")
        fid.add_column("config")
        for b in comp.buckets:
            fid.add_column(f"bucket {b.index} error / gain", justify="right")
        by_config: dict[str, dict[int, tuple[float, float]]] = {}
        for e in profile.fidelity.entries:
            by_config.setdefault(e.config, {})[e.bucket] = (e.relative_error, e.compression_gain)
        for label, per_bucket in by_config.items():
            fid.add_row(label, *[f"{per_bucket[b.index][0]:.3f} / {per_bucket[b.index][1]:.2f}"
                                 for b in comp.buckets if b.index in per_bucket])
        console.print(fid)
