"""The advisor's plan against PyTorch's own hooks, measured side by side in one run.

Run (root, iproute2):  .venv/bin/python benchmarks/end_to_end.py [--ranks 2,4] [--rates ...] [--models ...]

For each world size, link rate and model, in one job on an emulated cluster: autotune
runs (its wall time on the cluster is reported), then these are measured in interleaved
rounds on the same ranks: compute-only floor (backward with communication off), DDP fp32,
PyTorch's fp16_compress_hook, PyTorch's PowerSGD hook with the whole model in one bucket
(its multi-bucket form aborts on gloo: BACKGROUND.md section 3) at rank 1 and rank 4, and
the advisor's installed plan.  Targets (issue 5): at 1 Gbit/s on the MLP the advisor's plan
>= 2x faster than the fp16 hook and >= 1.2x faster than the best PowerSGD setting;
unshaped, never more than 3% slower than the best baseline; autotune <= 90 s.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.nn.parallel import DistributedDataParallel as DDP

import advisor
from advisor.emulated import EmulatedCluster, unavailable_reason
from advisor.live import slowest, timed_steps
from advisor.workloads import build_workload

MODELS = ("advisor.workloads:mlp", "advisor.workloads:small_cnn", "advisor.workloads:tiny_lm")


def _fresh(spec: str, **ddp_kwargs):
    workload = build_workload(spec)
    return workload, DDP(workload.model, **ddp_kwargs)


def _rank(rank: int, world: int, spec: str, rounds: int, steps: int, warmup: int, measurements: str | None):
    workload, tuned = _fresh(spec)
    batches = list(workload.batches)
    opt = workload.optimizer()
    t0 = time.perf_counter()
    result = advisor.autotune(tuned, workload.loss_fn, batches, opt, trials=1000, measurements_path=measurements,
                              where=f"{spec.split(':')[1]} x{world} @ {os.environ.get('ADVISOR_RATE', '?')}")
    tune_s = time.perf_counter() - t0
    # past the installed plan's uncompressed warm-up steps before anything is timed
    timed_steps(tuned, workload.loss_fn, batches, opt, 1, result.plan_object().warmup_steps)
    settings = {"advisor plan": (tuned, opt)}

    _, plain = _fresh(spec)
    settings["DDP fp32"] = (plain, None)
    _, fp16 = _fresh(spec)
    fp16.register_comm_hook(None, default_hooks.fp16_compress_hook)
    settings["PyTorch fp16 hook"] = (fp16, None)
    for r in (1, 4):
        _, psgd = _fresh(spec, bucket_cap_mb=10_000)  # one bucket: PowerSGD's multi-bucket form fails on gloo
        state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=r, start_powerSGD_iter=2)
        psgd.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
        timed_steps(psgd, workload.loss_fn, batches, None, 1, 3)  # past PowerSGD's own warm-up
        settings[f"PyTorch PowerSGD r{r} (1 bucket)"] = (psgd, None)
    for name, (model, o) in settings.items():
        if o is None:
            settings[name] = (model, torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9))
    times = {name: [] for name in ["compute only"] + list(settings)}
    for _ in range(rounds):
        local = []
        with plain.no_sync():
            local.append(timed_steps(plain, workload.loss_fn, batches, settings["DDP fp32"][1], steps, warmup))
        for name, (model, o) in settings.items():
            local.append(timed_steps(model, workload.loss_fn, batches, o, steps, warmup))
        for name, t in zip(times, slowest(local)):
            times[name].append(t)
    if result.hook is not None:
        result.hook.close()
    result.hook = None
    return {"times": {k: statistics.median(v) for k, v in times.items()}, "rounds": times,
            "tune_s": tune_s, "result": result.to_dict() if rank == 0 else None}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", default="2,4")
    parser.add_argument("--rates", default="100mbit,1gbit,unshaped")
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--json", help="also write the results here")
    parser.add_argument("--measurements", help="append autotune's live measurements to this measurement set "
                        "(data for benchmarks/learned_residual.py)")
    args = parser.parse_args(argv)
    reason = unavailable_reason()
    if reason:
        print(f"skipped: {reason}")
        return 0
    rows = []
    for world in (int(x) for x in args.ranks.split(",")):
        for rate_name in args.rates.split(","):
            rate = None if rate_name == "unshaped" else rate_name
            for spec in args.models.split(","):
                os.environ["ADVISOR_RATE"] = rate_name  # inherited by the ranks: names the measurement context
                with EmulatedCluster(hosts=world, rate=rate) as cluster:
                    out = cluster.run(_rank, (spec, args.rounds, args.steps, args.warmup, args.measurements),
                                      timeout=3000)
                t = out[0]["times"]
                res = out[0]["result"]
                best_psgd = min(t["PyTorch PowerSGD r1 (1 bucket)"], t["PyTorch PowerSGD r4 (1 bucket)"])
                best_base = min(t["DDP fp32"], t["PyTorch fp16 hook"])
                row = {"ranks": world, "rate": rate_name, "model": spec.split(":")[1], "times_s": t,
                       "tune_s": max(o["tune_s"] for o in out), "advice": res["description"],
                       "compress": res["compress"], "reason": res["reason"],
                       "vs_fp16_hook": t["PyTorch fp16 hook"] / t["advisor plan"],
                       "vs_best_powersgd": best_psgd / t["advisor plan"],
                       "vs_best_baseline": best_base / t["advisor plan"], "result": res}
                rows.append(row)
                print(f"\n{world} ranks @ {rate_name}, {row['model']}: advice {row['advice']!r} "
                      f"(autotune {row['tune_s']:.0f} s)")
                for name, s in sorted(t.items(), key=lambda kv: kv[1]):
                    print(f"  {name:32s} {s * 1e3:8.1f} ms/step  {t['DDP fp32'] / s:5.2f}x fp32")
                print(f"  advisor vs fp16 hook {row['vs_fp16_hook']:.2f}x, vs best PowerSGD "
                      f"{row['vs_best_powersgd']:.2f}x, vs best baseline {row['vs_best_baseline']:.2f}x")
                sys.stdout.flush()
                if args.json:
                    with open(args.json, "w") as fh:
                        json.dump(rows, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
