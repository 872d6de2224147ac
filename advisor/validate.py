"""Accuracy, end to end: train the fp32 baseline and a plan from the same seed, compare.

On scikit-learn's digits data set (it ships with scikit-learn), every rank trains on its
shard of the training split with DDP; after each epoch rank 0 evaluates the full test
split.  Baseline (native DDP fp32) and plan run in the same job, from the same initial
weights and the same batch order, one after the other.  The report holds loss and
accuracy curves against epochs and wall time, final accuracies, and the time each run
took to reach the target accuracy (by default the baseline's final accuracy minus one
point).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel

from .runtime import Plan, install
from .runtime.plan import as_plan
from .schema import VersionedDocument, check_int
from .workloads import _DigitsNet, digits_data

VALIDATION_KIND = "compression-advisor/validation"


@dataclass
class Curve:
    """Per epoch: mean training loss, test accuracy, wall seconds since the start."""

    label: str
    loss: list[float] = field(default_factory=list)
    accuracy: list[float] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)

    def time_to(self, target: float) -> float | None:
        for acc, s in zip(self.accuracy, self.seconds):
            if acc >= target:
                return s
        return None


@dataclass
class ValidationReport(VersionedDocument):
    what = "validation report"
    KIND = VALIDATION_KIND
    VERSION = 1

    plan: dict[str, Any]
    description: str
    world_size: int
    epochs: int
    baseline: Curve
    compressed: Curve
    target_accuracy: float
    baseline_time_to_target_s: float | None
    compressed_time_to_target_s: float | None
    kind: str = VALIDATION_KIND
    version: int = 1

    @property
    def accuracy_gap(self) -> float:
        """Baseline final accuracy minus the plan's, in points (positive: the plan lost)."""
        return 100 * (self.baseline.accuracy[-1] - self.compressed.accuracy[-1])

    def render(self, console=None) -> None:
        from rich.console import Console
        from rich.table import Table

        console = console or Console()
        table = Table(title=f"Digits, {self.world_size} ranks, {self.epochs} epochs: {self.description}")
        for col in ("epoch", "fp32 loss", "fp32 acc", "plan loss", "plan acc"):
            table.add_column(col, justify="right")
        for e in range(self.epochs):
            table.add_row(str(e + 1), f"{self.baseline.loss[e]:.4f}", f"{self.baseline.accuracy[e]:.1%}",
                          f"{self.compressed.loss[e]:.4f}", f"{self.compressed.accuracy[e]:.1%}")
        console.print(table)

        def fmt(s):
            return f"{s:.1f} s" if s is not None else "not reached"

        console.print(f"Final test accuracy: fp32 {self.baseline.accuracy[-1]:.1%}, plan "
                      f"{self.compressed.accuracy[-1]:.1%} (gap {self.accuracy_gap:+.1f} points). Time to "
                      f"{self.target_accuracy:.1%}: fp32 {fmt(self.baseline_time_to_target_s)}, plan "
                      f"{fmt(self.compressed_time_to_target_s)}")

    def save_png(self, path) -> None:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
        for curve, style in ((self.baseline, "-"), (self.compressed, "--")):
            epochs = range(1, len(curve.loss) + 1)
            axes[0].plot(epochs, curve.loss, style, label=curve.label)
            axes[1].plot(epochs, [100 * a for a in curve.accuracy], style, label=curve.label)
            axes[2].plot(curve.seconds, [100 * a for a in curve.accuracy], style, label=curve.label)
        axes[0].set(xlabel="epoch", ylabel="training loss", yscale="log")
        axes[1].set(xlabel="epoch", ylabel="test accuracy (%)")
        axes[2].set(xlabel="wall time (s)", ylabel="test accuracy (%)")
        axes[2].axhline(100 * self.target_accuracy, color="grey", lw=0.8, ls=":")
        for ax in axes:
            ax.legend()
        fig.suptitle(f"fp32 vs {self.description}")
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)


def _train(plan: Plan | None, epochs: int, batch: int, lr: float, seed: int, label: str) -> Curve:
    rank, world = dist.get_rank(), dist.get_world_size()
    x, y, x_test, y_test = digits_data(seed)
    torch.manual_seed(seed)
    model = _DigitsNet()
    ddp = DistributedDataParallel(model)
    hook = install(ddp, plan) if plan is not None else None
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    order = torch.Generator().manual_seed(seed)
    curve = Curve(label)
    start = time.perf_counter()
    try:
        for _ in range(epochs):
            perm = torch.randperm(len(y), generator=order)  # same on every rank: shard it
            shard = perm[rank::world]
            steps = len(shard) // batch
            total = torch.zeros(2, dtype=torch.float64)
            model.train()
            for s in range(steps):
                idx = shard[s * batch : (s + 1) * batch]
                opt.zero_grad(set_to_none=True)
                loss = nn.functional.cross_entropy(ddp(x[idx]), y[idx])
                loss.backward()
                opt.step()
                total += torch.tensor([float(loss.detach()), 1.0], dtype=torch.float64)
            dist.all_reduce(total)
            model.eval()
            with torch.no_grad():
                accuracy = float((model(x_test).argmax(1) == y_test).float().mean())
            curve.loss.append(float(total[0] / total[1]))
            curve.accuracy.append(accuracy)
            curve.seconds.append(time.perf_counter() - start)
    finally:
        if hook is not None:
            hook.close()
    return curve


def _validate_rank(rank: int, world: int, plan_dict: dict, epochs: int, batch: int, lr: float, seed: int):
    plan = Plan.from_dict(plan_dict)
    baseline = _train(None, epochs, batch, lr, seed, "fp32 (DDP)")
    compressed = _train(plan, epochs, batch, lr, seed, "plan")
    return baseline, compressed


def validate_accuracy(
    plan,
    *,
    world_size: int = 2,
    epochs: int = 12,
    batch: int = 32,
    lr: float = 0.05,
    seed: int = 0,
    target_accuracy: float | None = None,
    description: str | None = None,
    timeout: float = 600.0,
) -> ValidationReport:
    """Train fp32 and ``plan`` (a Plan, its dict or a path) on digits; compare the curves.

    The plan must name parameters of the digits network
    (:func:`advisor.workloads.digits`): tune it on that workload.
    """
    from .launch import launch_local

    plan = as_plan(plan)
    plan.check_against(name for name, _ in _DigitsNet().named_parameters())
    for name, value in (("world_size", world_size), ("epochs", epochs), ("batch", batch)):
        check_int(name, value)
    if not lr > 0:
        raise ValueError(f"lr={lr!r}; allowed: > 0")
    baseline, compressed = launch_local(
        _validate_rank, world_size, (plan.to_dict(), epochs, batch, lr, seed), timeout=timeout
    )[0]
    target = target_accuracy if target_accuracy is not None else baseline.accuracy[-1] - 0.01
    compressed.label = description or plan.metadata.get("description") or "plan"
    return ValidationReport(
        plan=plan.to_dict(),
        description=compressed.label,
        world_size=world_size,
        epochs=epochs,
        baseline=baseline,
        compressed=compressed,
        target_accuracy=target,
        baseline_time_to_target_s=baseline.time_to(target),
        compressed_time_to_target_s=compressed.time_to(target),
    )


def tuned_digits_plan(bandwidth: str = "100mbit", trials: int = 500, world_size: int = 2,
                      warmup_steps: int = 10) -> Plan:
    """Profile the digits network on local ranks and tune a plan for links of ``bandwidth``.

    The profile (compute, kernels, fidelity on the real gradients) is measured here; the
    network is what-if: on loopback every plan would lose to fp32, so the plan is tuned for
    the slow cluster where compression pays, under the default fidelity budget.
    """
    from policies.optuna_search import OptunaPolicy
    from policies.problem import TuningProblem
    from profilers.cluster import profile_model

    from .autotuning import DEFAULT_CANDIDATES
    from .emulated import parse_rate
    from .perfmodel import Scenario

    configs = [c for c in DEFAULT_CANDIDATES if c != "none"]
    profile = profile_model("advisor.workloads:digits", world_size, configs=configs)
    problem = TuningProblem.from_profile(profile, DEFAULT_CANDIDATES,
                                         scenario=Scenario(bandwidth_bps=parse_rate(bandwidth)))
    found = OptunaPolicy(n_trials=trials).search(problem)
    return problem.plan(found.choices, warmup_steps=warmup_steps,
                        metadata={"advisor": "tune", "description": problem.describe(found.choices),
                                  "bandwidth": bandwidth})
