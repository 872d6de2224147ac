"""The end-to-end benchmark: the advisor's plan against PyTorch's own hooks, side by side.

For each world size, link rate and model, in one job on an emulated cluster (root and
iproute2; loopback ranks otherwise, with only the unshaped rate): autotune runs (its wall
time on the cluster is reported), then these are measured in interleaved rounds on the
same ranks: the compute-only floor (backward with communication off), DDP fp32, PyTorch's
``fp16_compress_hook`` at DDP's bucket_cap_mb of 1, 25 (default) and one bucket, PyTorch's
PowerSGD hook with the whole model in one bucket (its
multi-bucket form aborts on gloo) at rank 1 and rank 4, and the
advisor's installed plan (timed past its warm-up).  With ``matched`` a second copy of the
model is autotuned under the fidelity budget of PowerSGD rank 1 and measured in the same
rounds: PyTorch's rank 1 loses more of the gradient than the advisor's default budget
(PowerSGD rank 4's error) allows, so this is the comparison at equal accuracy cost.
With ``same_plan`` the advisor's hook also runs PowerSGD rank 1 everywhere, in PyTorch's one
bucket, on DDP's own buckets and on DDP's own buckets joined into one exchange, in the same
rounds: set beside PyTorch's rank 1 they tell the hook's own cost apart from the cost of the
bucket layout, and the join's copies apart from DDP's own one bucket.

An advice with a bucket layout is timed on DDP built for it by :func:`advisor.ddp_for`, as the
README tells a user to run it.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence

import torch
from rich.console import Console
from rich.table import Table
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.nn.parallel import DistributedDataParallel as DDP

import advisor
from advisor.core.collectives import slowest
from advisor.core.speedups import speedup, speedups
from advisor.testbed.emulated import EmulatedCluster, unavailable_reason
from advisor.testbed.launch import launch_local
from advisor.testbed.workloads import build_workload
from advisor.tuning.live import timed_steps

MODELS = ("advisor.workloads:mlp", "advisor.workloads:small_cnn", "advisor.workloads:tiny_lm",
          "advisor.workloads:rnn_lm")
RATES = ("100mbit", "1gbit", "unshaped")
MATCHED = "advisor plan, r1's budget"
#: DDP's bucket_cap_mb grid PyTorch's fp16 hook runs at (DDP's default is 25); the best is chosen in hindsight
FP16_CAPS_MB = (1, 25, 10_000)
SETTINGS = ("compute only", "DDP fp32", "PyTorch fp16 hook", "PyTorch fp16 hook, 1 MiB buckets",
            "PyTorch fp16 hook, 1 bucket", "PyTorch PowerSGD r1 (1 bucket)", "PyTorch PowerSGD r4 (1 bucket)",
            "advisor plan", MATCHED)
#: every PyTorch setting: the best of them, in hindsight, is what the advisor is held against
PYTORCH = tuple(s for s in SETTINGS if s.startswith(("DDP fp32", "PyTorch")))
#: the matched comparison: the advisor held to the fidelity of PowerSGD rank 1
MATCHED_REFERENCE = "powersgd(rank=1)"
#: ``same_plan``'s settings: PyTorch's rank 1 plan through the advisor's hook, in each layout, as
#: (DDP's bucket_cap_mb, the plan's exchange_mb); 10,000 MiB holds any model whole.  The join beside
#: DDP's own one bucket is the cost of the hook's copies, which ddp_for spares an advised join
SAME_PLAN = {"advisor hook, PowerSGD r1 (1 bucket)": (10_000, None),
             "advisor hook, PowerSGD r1 (DDP's buckets)": (None, None),
             "advisor hook, PowerSGD r1 (DDP's buckets joined)": (None, 10_000)}


def layout_of(result: dict) -> str:
    """The bucket layout of an autotune result's advice, in words."""
    if result.get("exchange_mb"):
        return (f"DDP's buckets exchanged together up to {result['exchange_mb']:g} MiB, timed on DDP built "
                "so by ddp_for")
    smaller = (result.get("plan") or {}).get("bucket_cap_mb")
    return f"DDP built with {smaller:g} MiB buckets" if smaller else "DDP's own buckets"


def _fresh(spec: str, **ddp_kwargs):
    workload = build_workload(spec)
    return workload, DDP(workload.model, **ddp_kwargs)


def _autotuned(spec: str, batches: list, where: str, measurements: str | None, autotune_kwargs: dict):
    """A fresh copy of the model, autotuned, past its plan's warm-up: (model, optimizer, result, seconds)."""
    workload, model = _fresh(spec)
    opt = workload.optimizer()  # over this copy's parameters
    t0 = time.perf_counter()
    result = advisor.autotune(model, workload.loss_fn, batches, opt, measurements_path=measurements, where=where,
                              **autotune_kwargs)
    tune_s = time.perf_counter() - t0
    plan = result.plan_object()
    if plan.bucket_cap_mb is not None or plan.exchange_mb is not None:
        # timed as the README tells a user to run an advice with a layout: DDP built for it by
        # ddp_for (smaller buckets only DDP makes; a join DDP makes without the hook's copies)
        if result.hook is not None:
            result.hook.close()
        workload = build_workload(spec)
        model, result.hook = advisor.ddp_for(workload.model, result)
        opt = workload.optimizer()
    # past the installed plan's uncompressed warm-up before anything is timed
    timed_steps(model, workload.loss_fn, batches, opt, 1, plan.warmup_steps)
    return model, opt, result, tune_s


def bench_rank(rank: int, world: int, spec: str, rounds: int, steps: int, warmup: int,
               measurements: str | None, where: str, autotune_kwargs: dict, matched: bool = True,
               same_plan: bool = False):
    workload = build_workload(spec)
    batches = list(workload.batches)
    tuned, opt, result, tune_s = _autotuned(spec, batches, where, measurements, autotune_kwargs)
    settings = {"advisor plan": (tuned, opt)}
    matched_result = None
    if matched:
        # Held to PyTorch's rank 1's error (the default budget is earned in the accuracy trial,
        # or PowerSGD rank 4's), the advisor shows what it does at the fidelity of that baseline.
        held, held_opt, matched_result, matched_tune_s = _autotuned(
            spec, batches, where, measurements, {**autotune_kwargs, "reference": MATCHED_REFERENCE})
        settings[MATCHED] = (held, held_opt)
    _, plain = _fresh(spec)
    settings["DDP fp32"] = (plain, None)
    for cap, name in zip(FP16_CAPS_MB, ("PyTorch fp16 hook, 1 MiB buckets", "PyTorch fp16 hook",
                                        "PyTorch fp16 hook, 1 bucket")):
        _, fp16 = _fresh(spec, bucket_cap_mb=cap)
        fp16.register_comm_hook(None, default_hooks.fp16_compress_hook)
        settings[name] = (fp16, None)
    for r in (1, 4):
        _, psgd = _fresh(spec, bucket_cap_mb=10_000)  # one bucket: the multi-bucket form fails on gloo
        state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=r, start_powerSGD_iter=2)
        psgd.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
        timed_steps(psgd, workload.loss_fn, batches, None, 1, 3)  # past PowerSGD's own warm-up
        settings[f"PyTorch PowerSGD r{r} (1 bucket)"] = (psgd, None)
    hooks = []
    for name, (cap, exchange_mb) in SAME_PLAN.items() if same_plan else ():
        _, ours = _fresh(spec, **({} if cap is None else {"bucket_cap_mb": cap}))
        plan = advisor.Plan.uniform(MATCHED_REFERENCE, warmup_steps=0, exchange_mb=exchange_mb)
        hooks.append(advisor.install(ours, plan))
        timed_steps(ours, workload.loss_fn, batches, None, 1, 3)  # as PyTorch's: past the first steps
        settings[name] = (ours, None)
    for name, (model, o) in settings.items():
        if o is None:
            settings[name] = (model, torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9))
    times: dict[str, list[float]] = {name: [] for name in ["compute only", *settings]}
    for _ in range(rounds):
        local = []
        with plain.no_sync():
            local.append(timed_steps(plain, workload.loss_fn, batches, settings["DDP fp32"][1], steps, warmup))
        for model, o in settings.values():
            local.append(timed_steps(model, workload.loss_fn, batches, o, steps, warmup))
        for name, t in zip(times, slowest(local)):
            times[name].append(t)
    for r in (result, matched_result):
        if r is not None and r.hook is not None:
            r.hook.close()
    for hook in hooks:
        hook.close()
    out = {"times": {k: statistics.median(v) for k, v in times.items()}, "rounds": times,
           "tune_s": tune_s, "result": result.to_dict() if rank == 0 else None}
    if matched_result is not None:
        out.update(matched_tune_s=matched_tune_s, matched_result=matched_result.to_dict() if rank == 0 else None)
    return out


def run_benchmark(ranks: Sequence[int] = (2, 4), rates: Sequence[str] = RATES, models: Sequence[str] = MODELS,
                  rounds: int = 3, steps: int = 4, warmup: int = 2, measurements: str | None = None,
                  on_row: Callable[[dict], None] | None = None, autotune_kwargs: dict | None = None,
                  matched: bool = True, same_plan: bool = False) -> list[dict]:
    """Autotune, then time the advice next to DDP fp32, 16-bit and PyTorch's PowerSGD, side by side.

    Args:
        ranks, rates, models: the grid (rates need root for the emulated cluster; None is loopback).
        rounds, steps, warmup: interleaved rounds of timed steps after untimed ones.
        measurements: append the live measurements to that measurement set file.
        on_row: sees each row as soon as it is measured.
        autotune_kwargs: more keyword arguments of :func:`advisor.autotune` (``trials`` 1000 unless given).
        matched: also autotune with the fidelity budget of PowerSGD rank 1 (a second tuned
            copy measured in the same rounds), to compare with PyTorch's rank 1 at the same
            accuracy cost.
        same_plan: also time PyTorch's PowerSGD rank 1 plan through the advisor's hook, in one
            bucket, on DDP's own and on DDP's own joined (:data:`SAME_PLAN`): the hook's cost
            apart from the layout's, and the join's copies apart from DDP's one bucket.

    Returns:
        One dict per (world size, rate, model): each setting's median step time and the advice.

    Raises:
        ValueError: a rate other than loopback without the emulated cluster (it names why).
    """
    emulated = unavailable_reason() is None
    rows = []
    for world in ranks:
        for rate_name in rates:
            rate = None if rate_name == "unshaped" else rate_name
            if rate is not None and not emulated:
                raise ValueError(f"rate {rate_name!r} needs the emulated cluster, but {unavailable_reason()}")
            for spec in models:
                where = f"{spec.split(':')[-1]} x{world} @ {rate_name}"
                args = (spec, rounds, steps, warmup, measurements, where, {"trials": 1000, **(autotune_kwargs or {})},
                        matched, same_plan)
                if emulated:
                    with EmulatedCluster(hosts=world, rate=rate) as cluster:
                        out = cluster.run(bench_rank, args, timeout=3000)
                else:
                    out = launch_local(bench_rank, world, args, timeout=3000)
                t = out[0]["times"]
                res = out[0]["result"]
                best_psgd = min(t["PyTorch PowerSGD r1 (1 bucket)"], t["PyTorch PowerSGD r4 (1 bucket)"])
                best_base = min(t["DDP fp32"], t["PyTorch fp16 hook"])
                best_pytorch = min(PYTORCH, key=lambda name: t[name])
                row = {"ranks": world, "rate": rate_name, "model": spec.split(":")[-1], "times_s": t,
                       "rounds_s": out[0]["rounds"], "tune_s": max(o["tune_s"] for o in out),
                       "advice": res["description"], "compress": res["compress"], "reason": res["reason"],
                       **speedups({"vs_fp16_hook": t["PyTorch fp16 hook"], "vs_best_powersgd": best_psgd,
                                   "vs_best_baseline": best_base, "vs_best_pytorch": t[best_pytorch]},
                                  t["advisor plan"]),
                       "best_pytorch": best_pytorch, "noise": _noise(out[0]["rounds"]), "result": res}
                if MATCHED in t:
                    held = out[0]["matched_result"]
                    row.update(matched_advice=held["description"], matched_result=held,
                               matched_tune_s=max(o["matched_tune_s"] for o in out),
                               matched_vs_powersgd_r1=speedup(t["PyTorch PowerSGD r1 (1 bucket)"], t[MATCHED]),
                               matched_fidelity=held.get("fidelity_error"), matched_budget=held.get("fidelity_budget"),
                               matched_budget_source=held.get("budget_source"))
                rows.append(row)
                if on_row is not None:
                    on_row(row)
    return rows


def _noise(rounds: dict[str, list[float]]) -> float:
    """The comparison's noise: each setting's median absolute deviation across rounds relative to its
    median (robust to a stray round), the median over settings, as a fraction."""
    spreads = []
    for v in rounds.values():
        if len(v) > 1:
            mid = statistics.median(v)
            spreads.append(statistics.median(abs(x - mid) for x in v) / mid)
    return statistics.median(spreads) if spreads else float("nan")


def pair_noise(rounds: dict[str, list[float]], one: str, other: str) -> float:
    """The noise of one comparison: the rounds are interleaved, so each round's ``one``/``other``
    ratio is a paired measurement of it; their median absolute deviation relative to their median,
    as a fraction.  A setting that swings more than most widens this past :func:`_noise`'s median."""
    ratios = [a / b for a, b in zip(rounds[one], rounds[other])]
    if len(ratios) < 2:
        return float("nan")
    mid = statistics.median(ratios)
    return statistics.median(abs(x - mid) for x in ratios) / mid


def render_row(row: dict, console=None) -> None:
    """One benchmark row: every setting's step time and its speed-up over DDP fp32."""
    console = console or Console()
    t = row["times_s"]
    table = Table(title=f"{row['ranks']} ranks @ {row['rate']}, {row['model']}: advice {row['advice']} "
                        f"(autotune {row['tune_s']:.0f} s)")
    table.add_column("setting")
    table.add_column("ms/step", justify="right")
    table.add_column("vs DDP fp32", justify="right")
    for name, s in sorted(t.items(), key=lambda kv: kv[1]):
        table.add_row(name, f"{s * 1e3:.1f}", f"{speedup(t['DDP fp32'], s):.2f}x")
    console.print(table)
    console.print(f"advisor plan vs PyTorch fp16 hook {row['vs_fp16_hook']:.2f}x, vs best PyTorch PowerSGD "
                  f"{row['vs_best_powersgd']:.2f}x, vs best baseline {row['vs_best_baseline']:.2f}x, vs the best "
                  f"PyTorch setting in hindsight ({row['best_pytorch']}) {row['vs_best_pytorch']:.2f}x; "
                  f"noise ±{row['noise']:.1%} (a setting's median absolute deviation across rounds, median)")
    console.print(f"advice's bucket layout: {layout_of(row.get('result') or {})}")
    if "matched_advice" in row:
        console.print(f"held to PowerSGD rank 1's fidelity budget: advice {row['matched_advice']} "
                      f"(autotune {row['matched_tune_s']:.0f} s), {row['matched_vs_powersgd_r1']:.2f}x vs "
                      "PyTorch's PowerSGD rank 1")

