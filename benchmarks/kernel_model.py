"""Does the kernel cost model predict sizes it was not fitted on?

Run:  .venv/bin/python benchmarks/kernel_model.py [--rounds 4]

For each config, encode+decode time is measured on the profiler's ladder of sizes and on
two held-out sizes, in interleaved rounds (median per size, so load bursts on this shared
machine hit every size alike); the size model is fitted on the ladder only and predicts
the held-out sizes.  Target: |predicted - measured| / measured <= 25%.
"""

from __future__ import annotations

import argparse
import statistics

from advisor.compressors import parse
from advisor.runtime.timing import measure
from profilers.kernels import fit_loglog, square_layout
from profilers.profile import predict_loglog

CONFIGS = ["fp16", "bf16", "qsgd(bits=8)", "intquant(bits=8)", "powersgd(rank=4)", "topk(ratio=0.01)", "signsgd"]
LADDER = [1 << 16, 1 << 18, 1 << 20, 1 << 22]
HELD_OUT = [1 << 19, 1 << 21]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=4)
    args = parser.parse_args(argv)
    sizes = LADDER + HELD_OUT
    worst = 0.0
    print(f"{'config':18s} " + " ".join(f"{'n=' + str(n):>22s}" for n in HELD_OUT))
    for spec in CONFIGS:
        comp = parse(spec).build()
        rounds = [[measure(comp, square_layout(n), repeats=5, warmup=1).total_s for n in sizes]
                  for _ in range(args.rounds)]
        seconds = [statistics.median(r[i] for r in rounds) for i in range(len(sizes))]
        knots = fit_loglog(LADDER, seconds[: len(LADDER)])
        cells = []
        for n, measured in zip(HELD_OUT, seconds[len(LADDER):]):
            predicted = float(predict_loglog(knots, n))
            error = abs(predicted - measured) / measured
            worst = max(worst, error)
            cells.append(f"{measured * 1e3:7.2f} vs {predicted * 1e3:7.2f} ms {error:5.1%}")
        print(f"{spec:18s} " + " ".join(f"{c:>22s}" for c in cells))
    verdict = "PASS" if worst <= 0.25 else "FAIL"
    print(f"worst held-out error {worst:.1%} (target <= 25%) {verdict}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
