"""Issue 23's comparison: the advisor's plan (bucket layout and kernel forms included) against the best
PyTorch setting chosen in hindsight, side by side, with the noise of each row.

Per (ranks, link rate, model), one job on the emulated cluster (``advisor.testbed.bench``): autotune,
then interleaved rounds of the compute-only floor, DDP fp32, PyTorch's fp16 hook at bucket_cap_mb
1 / 25 / one bucket, PyTorch's PowerSGD rank 1 and 4 (one bucket: its multi-bucket form aborts on
gloo) and the advisor's plan.  PyTorch's hooks carry no accuracy evidence, so by default autotune
decides on speed alone too (``accuracy_trial=False``): the same evidence on both sides.

Printed per row: every setting's ms/step, the advice and its layout, the advisor against the best
PyTorch setting, and the noise (median over settings of half their spread across rounds).  At the
end: the targets, the advisor never slower than the best PyTorch setting beyond the noise, at least
1.1x faster on the median row, and within 1.05x of the floor where the best PyTorch setting is.

Usage: python benchmarks/layout_matrix.py [--ranks 2,4] [--rates 100mbit,1gbit]
[--models advisor.workloads:mlp,...] [--rounds 5] [--steps 4] [--gate] [--out rows.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

from advisor.testbed.bench import MODELS, render_row, run_benchmark


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", default="2")
    parser.add_argument("--rates", default="100mbit,1gbit")
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--gate", action="store_true", help="let autotune run its accuracy trial (the default "
                                                             "decides on speed alone, as PyTorch's hooks are)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    rows = run_benchmark([int(r) for r in args.ranks.split(",")], args.rates.split(","), args.models.split(","),
                         rounds=args.rounds, steps=args.steps, on_row=render_row, matched=False,
                         autotune_kwargs={"trials": 1000, "accuracy_trial": args.gate})
    print()
    print("| ranks | rate | model | advice (layout) | best PyTorch (ms) | advisor (ms) | floor (ms) | "
          "advisor / best PyTorch | noise |")
    print("|---|---|---|---|---|---|---|---|---|")
    ratios = []
    for r in rows:
        t = r["times_s"]
        layout = r["result"].get("exchange_mb")
        ratio = t["advisor plan"] / t[r["best_pytorch"]]
        ratios.append(ratio)
        print(f"| {r['ranks']} | {r['rate']} | {r['model']} | {r['advice']}"
              f"{f' ({layout:g} MiB exchanges)' if layout else ''} | {r['best_pytorch']}: "
              f"{t[r['best_pytorch']] * 1e3:.0f} | {t['advisor plan'] * 1e3:.0f} | {t['compute only'] * 1e3:.0f} | "
              f"{ratio:.2f} | ±{r['noise']:.1%} |")
    slower = [r for r, x in zip(rows, ratios) if x > 1 + r["noise"]]
    near = [(r, x) for r, x in zip(rows, ratios)
            if r["times_s"][r["best_pytorch"]] <= 1.05 * r["times_s"]["compute only"]]
    median_speedup = 1 / statistics.median(ratios)
    named = ", ".join(f"{r['model']} x{r['ranks']} @ {r['rate']}" for r in slower)
    print(f"never slower than the best PyTorch setting beyond the noise: {'PASS' if not slower else 'FAIL: ' + named}")
    print(f"median row: advisor {median_speedup:.2f}x the best PyTorch setting (target >= 1.1): "
          f"{'PASS' if median_speedup >= 1.1 else 'FAIL'}")
    for r, _ in near:
        ok = r["times_s"]["advisor plan"] <= 1.05 * r["times_s"]["compute only"]
        print(f"near the floor ({r['model']} x{r['ranks']} @ {r['rate']}: best PyTorch within 1.05x of it): "
              f"advisor {r['times_s']['advisor plan'] / r['times_s']['compute only']:.2f}x the floor "
              f"{'PASS' if ok else 'FAIL'}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
