"""The embedded demo: a local 2-process gloo cluster, a bundled model, measured side by side.

Until the policies land, the demo measures what the runtime can already prove: each
uniform plan's real step time, next to DDP without a hook and the compute-only floor
(backward with communication off), and the fastest of them.  As root with iproute2 it runs
on an emulated cluster with 1 Gbit/s links; elsewhere over loopback, and says which.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass

import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

from .launch import launch_local
from .runtime import Plan, install
from .workloads import mlp

DEFAULT_CONFIGS = ("none", "fp16", "bf16", "powersgd(rank=4)", "topk(ratio=0.01)", "intquant(bits=4)")


def bundled_mlp() -> nn.Module:
    """BACKGROUND.md's 5.3M-parameter MLP: Linear 1024-2048-1024-1024-10."""
    return mlp().model


@dataclass
class DemoRow:
    label: str
    ms_per_step: float
    final_loss: float | None


def _time_steps(model, x, y, steps: int, sync: bool = True) -> tuple[float, float]:
    times, loss = [], None
    for _ in range(steps):
        t0 = time.perf_counter()
        model.zero_grad(set_to_none=True)
        if sync:
            loss = nn.functional.cross_entropy(model(x), y)
            loss.backward()
        else:
            with model.no_sync():
                loss = nn.functional.cross_entropy(model(x), y)
                loss.backward()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), float(loss.detach())


def _demo_rank(rank: int, world_size: int, configs: tuple[str, ...], steps: int, warmup: int):
    torch.manual_seed(0)
    x = torch.randn(64, 1024, generator=torch.Generator().manual_seed(rank))
    y = torch.randint(0, 10, (64,), generator=torch.Generator().manual_seed(rank))
    rows = []
    plain = DDP(bundled_mlp())
    _time_steps(plain, x, y, warmup)
    rows.append(("compute only (no communication)", *_time_steps(plain, x, y, steps, sync=False)))
    rows.append(("DDP, no hook", *_time_steps(plain, x, y, steps)))
    for spec in configs:
        torch.manual_seed(0)
        model = DDP(bundled_mlp())
        install(model, Plan.uniform(spec, warmup_steps=2))
        _time_steps(model, x, y, warmup)
        rows.append((spec, *_time_steps(model, x, y, steps)))
    return rows


DEMO_RATE = "1gbit"


def demo_cluster_description(rate: str | None = DEMO_RATE) -> str:
    """Where the demo will run: an emulated slow link as root with iproute2, else loopback."""
    from .emulated import parse_rate, unavailable_reason

    if rate is None or unavailable_reason() is not None:
        return "2 local ranks over loopback (unshaped)"
    return f"2 hosts on an emulated {parse_rate(rate) / 1e6:g} Mbit/s network"


def run_demo(
    configs=DEFAULT_CONFIGS, world_size: int = 2, steps: int = 20, warmup: int = 5, rate: str | None = DEMO_RATE
) -> list[DemoRow]:
    """Measure each config on a ``world_size``-rank cluster; returns rank-0-paced rows.

    With root and iproute2 the ranks run on an emulated cluster with links of ``rate``
    (the situation compression is for); elsewhere over loopback.
    """
    from .emulated import EmulatedCluster, unavailable_reason

    args = (tuple(configs), steps, warmup)
    if rate is not None and unavailable_reason() is None:
        with EmulatedCluster(hosts=world_size, rate=rate) as cluster:
            per_rank = cluster.run(_demo_rank, args, timeout=900)
    else:
        per_rank = launch_local(_demo_rank, world_size, args, timeout=600)
    rows = []
    for i, (label, _, loss) in enumerate(per_rank[0]):
        slowest = max(r[i][1] for r in per_rank)  # the slowest rank sets the pace
        rows.append(DemoRow(label, slowest * 1e3, loss))
    return rows


def render(rows: list[DemoRow], console=None, where: str = "2 local ranks over loopback (unshaped)") -> None:
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    baseline = next(r for r in rows if r.label == "DDP, no hook").ms_per_step
    table = Table(title=f"Measured step time, {where} (gloo, CPU)")
    table.add_column("plan")
    table.add_column("ms/step", justify="right")
    table.add_column("vs DDP fp32", justify="right")
    for r in rows:
        table.add_row(r.label, f"{r.ms_per_step:.1f}", f"{baseline / r.ms_per_step:.2f}x")
    console.print(table)
    candidates = [r for r in rows if not r.label.startswith("compute only")]
    best = min(candidates, key=lambda r: r.ms_per_step)
    console.print(
        f"Fastest measured here: [bold]{best.label}[/bold] ({best.ms_per_step:.1f} ms/step, "
        f"{baseline / best.ms_per_step:.2f}x DDP fp32). Per-bucket tuning (autotune) is not built yet."
    )


def as_dicts(rows: list[DemoRow]) -> list[dict]:
    return [asdict(r) for r in rows]
