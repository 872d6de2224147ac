"""Does the learned correction reduce the performance model's error on held-out measurements?

Run:  .venv/bin/python benchmarks/learned_residual.py MEASUREMENTS.json [MORE.json ...]

The measurement sets come from autotune's live measurements (``autotune(...,
measurements_path=...)``; ``advisor bench --measurements FILE`` collects them for 3 models
x 2 world sizes x 3 link rates).  Two protocols:

* held-out measurements (leave one out): the correction is fitted on every other
  measurement, as when a cluster's measurement log has grown over earlier autotune runs;
* held-out contexts: every measurement of one (model, world size, rate) is left out, the
  harder question of transfer to a model or network never measured.

Prints |predicted - measured| / measured for the raw model and the corrected one.
"""

from __future__ import annotations

import argparse
import statistics
import sys

import numpy as np
from scipy.stats import spearmanr

from policies.learned import MeasurementSet, ResidualModel


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("paths", nargs="+")
    args = parser.parse_args(argv)
    data = MeasurementSet()
    for path in args.paths:
        data.measurements.extend(MeasurementSet.load(path).measurements)
    contexts = data.contexts()
    if len(contexts) < 3:
        print(f"need measurements from at least 3 contexts, have {len(contexts)}")
        return 1
    X, P, M = data.arrays()
    raw = np.abs(P - M) / M
    loo = []
    for i in range(len(M)):
        keep = np.arange(len(M)) != i
        model = ResidualModel().fit(X[keep], P[keep], M[keep])
        loo.append(abs(model.predict(X[i : i + 1], P[i : i + 1])[0] - M[i]) / M[i])
    print(f"{len(data.measurements)} measurements in {len(contexts)} contexts\n")
    print(f"held-out measurements (leave one out): raw model median {np.median(raw):.1%}, worst {raw.max():.1%}; "
          f"with the learned correction median {np.median(loo):.1%}, worst {max(loo):.1%}\n")
    raw_all, fixed_all = [], []
    print("held-out contexts:")
    print(f"{'context':28s} {'n':>3s} {'raw median':>11s} {'raw worst':>10s} {'learned median':>15s} "
          f"{'learned worst':>14s} {'rho raw':>8s} {'rho learned':>11s}")
    for held in contexts:
        train = [c for c in contexts if c != held]
        model = ResidualModel().fit(*data.arrays(train))
        X, predicted, measured = data.arrays([held])
        corrected = model.predict(X, predicted)
        raw = np.abs(predicted - measured) / measured
        fixed = np.abs(corrected - measured) / measured
        raw_all += raw.tolist()
        fixed_all += fixed.tolist()
        rho_raw = spearmanr(predicted, measured).statistic if len(measured) > 2 else float("nan")
        rho_fixed = spearmanr(corrected, measured).statistic if len(measured) > 2 else float("nan")
        print(f"{held:28s} {len(measured):3d} {np.median(raw):11.1%} {raw.max():10.1%} {np.median(fixed):15.1%} "
              f"{fixed.max():14.1%} {rho_raw:8.2f} {rho_fixed:11.2f}")
    print(f"\nall held-out contexts: raw model median {statistics.median(raw_all):.1%}, worst "
          f"{max(raw_all):.1%}; with the learned correction median {statistics.median(fixed_all):.1%}, worst "
          f"{max(fixed_all):.1%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
