"""wrap's online race against autotune's live measurement: do the two tuners measure the same speeds?

Per (link rate, model), one job on the emulated cluster (loopback without root): ``advisor.autotune``
(speed only: ``accuracy_trial=False``) and ``advisor.wrap`` inside a plain training loop take
turns, ``--repeats`` times each, on fresh copies of the same model.  Both measure the baselines
(fp32 and the 16-bit cast, the same plans in both) and their own short-lists of compressed
plans.  Printed per row: every plan's ms/step under each tuner (the median of its round
medians, slowest rank), wrap's over autotune's for the plans both measured, and the noise of
each: how far the same tuner's repeats are apart.  The target (issue 21): wrap measures the
same speeds as autotune, within that noise, and both stop measuring once the decision is
settled (the rounds each needed are printed).

wrap runs with ``loss_fn`` and ``batches`` so that compressed plans enter its race; its
accuracy trial then judges only the race's winner, and its time is not counted here.

Usage: python benchmarks/online_race.py [--rates 1gbit] [--models advisor.workloads:mlp,...] [--repeats 2]
[--steps N] [--out rows.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the ranks import this module by name

import advisor  # noqa: E402
from advisor.testbed.emulated import run_ranks, unavailable_reason  # noqa: E402
from advisor.testbed.workloads import build_workload  # noqa: E402

MODELS = ("advisor.workloads:mlp", "advisor.workloads:rnn_lm")


def job(rank: int, world: int, where: str, spec: str, repeats: int, steps: int) -> dict:
    """Every rank: autotune, then wrap, ``repeats`` times; each tuner's measured ms per plan."""
    calls = []
    for i in range(repeats):
        for tuner in ("autotune", "wrap"):
            torch.manual_seed(0)
            workload = build_workload(spec)
            ddp = DDP(workload.model)
            opt = workload.optimizer()
            batches = list(workload.batches)
            t0 = time.perf_counter()
            if tuner == "autotune":
                result = advisor.autotune(ddp, workload.loss_fn, batches, opt, accuracy_trial=False,
                                          install_plan=False, where=where)
                measured = {(m.description or m.label): m.round_s for m in result.measured}
                rounds = len(next(iter(measured.values())))
                advice = result.description
            else:
                wrapped = advisor.wrap(ddp, opt, loss_fn=workload.loss_fn, batches=batches, trial_s=15.0,
                                       retrial_share=None, fidelity_sample=0)
                n = 0
                while wrapped.phase != "watch" and n < steps:
                    opt.zero_grad()
                    workload.loss_fn(ddp, batches[n % len(batches)]).backward()
                    opt.step()
                    n += 1
                measured = {m.description or m.label: m.round_s for m in wrapped.measured}
                rounds = len(next(iter(measured.values()), []))
                advice = wrapped.decision.chosen if wrapped.phase == "watch" else f"undecided after {n} steps"
                wrapped.close()
            calls.append({"tuner": tuner, "call": i, "measured": measured, "rounds": rounds, "advice": advice,
                          "seconds": time.perf_counter() - t0})
    return {"rank": rank, "calls": calls}


def _median_ms(rounds: list[float]) -> float:
    return statistics.median(rounds) * 1e3


def summarise(spec: str, rate: str | None, calls: list[dict]) -> dict:
    """Per plan: each call's ms; wrap over autotune where both measured it; each tuner's repeat spread."""
    by_tuner: dict[str, list[dict[str, float]]] = {"autotune": [], "wrap": []}
    for c in calls:
        by_tuner[c["tuner"]].append({plan: _median_ms(r) for plan, r in c["measured"].items()})
    plans = sorted({p for ms in by_tuner["autotune"] + by_tuner["wrap"] for p in ms})
    rows = []
    for plan in plans:
        a = [ms[plan] for ms in by_tuner["autotune"] if plan in ms]
        w = [ms[plan] for ms in by_tuner["wrap"] if plan in ms]
        ratio = statistics.median(w) / statistics.median(a) if a and w else None
        # the noise of each tuner: the spread of its own repeats, relative (max/min - 1)
        spread = {name: (max(v) / min(v) - 1) if len(v) > 1 else None for name, v in (("autotune", a), ("wrap", w))}
        rows.append({"plan": plan, "autotune_ms": a, "wrap_ms": w, "wrap_over_autotune": ratio, "spread": spread})
    return {"model": spec, "rate": rate or "loopback", "plans": rows,
            "rounds": {t: [c["rounds"] for c in calls if c["tuner"] == t] for t in by_tuner},
            "advice": {t: [c["advice"] for c in calls if c["tuner"] == t] for t in by_tuner},
            "seconds": {t: [round(c["seconds"], 1) for c in calls if c["tuner"] == t] for t in by_tuner}}


def show(row: dict) -> None:
    print(f"\n{row['model']} @ {row['rate']}: rounds autotune {row['rounds']['autotune']}, wrap {row['rounds']['wrap']}; "
          f"seconds autotune {row['seconds']['autotune']}, wrap {row['seconds']['wrap']}")
    print("| plan | autotune ms (calls) | wrap ms (calls) | wrap / autotune | autotune repeats apart | wrap repeats apart |")
    print("|---|---|---|---|---|---|")
    for p in row["plans"]:
        def ms(v):
            return ", ".join(f"{x:.1f}" for x in v) or "-"

        def pct(x):
            return "-" if x is None else f"{x:.1%}"
        ratio = "-" if p["wrap_over_autotune"] is None else f"{p['wrap_over_autotune']:.3f}"
        print(f"| {p['plan']} | {ms(p['autotune_ms'])} | {ms(p['wrap_ms'])} | {ratio} | {pct(p['spread']['autotune'])} "
              f"| {pct(p['spread']['wrap'])} |")
    shared = [p for p in row["plans"] if p["wrap_over_autotune"] is not None]
    noise = [s for p in shared for s in p["spread"].values() if s is not None]
    bound = max(noise) if noise else None
    worst = max((abs(p["wrap_over_autotune"] - 1) for p in shared), default=None)
    if worst is not None and bound is not None:
        verdict = "PASS" if worst <= bound else "FAIL"
        print(f"same speeds: the largest wrap/autotune difference {worst:.1%} vs the largest repeat spread "
              f"{bound:.1%}: {verdict}")
    print("advice: autotune " + "; ".join(row["advice"]["autotune"]) + " | wrap " + "; ".join(row["advice"]["wrap"]),
          flush=True)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rates", default="1gbit")
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--steps", type=int, default=400, help="wrap's step limit before it must have decided")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    from benchmarks.online_race import job as rank_job  # by module name, so the ranks can import it

    rates = [r for r in args.rates.split(",") if r]
    if unavailable_reason() is not None:
        print(f"note: {unavailable_reason()}; running on loopback instead of {rates}")
        rates = [None]
    rows = []
    for rate in rates:
        for spec in args.models.split(","):
            out = run_ranks(rank_job, 2, lambda where, spec=spec: (where, spec, args.repeats, args.steps), rate=rate,
                            timeout=3000)
            row = summarise(spec, rate, out[0]["calls"])
            show(row)
            rows.append(row)
            if args.out:
                Path(args.out).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
