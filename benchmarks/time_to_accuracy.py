"""Time to accuracy of the advice, side by side with fp32 and the 16-bit cast, called as users call it.

Per row (task, link rate, optimizer, how the batches are handed over), one job on the emulated
cluster (loopback without root) calls ``advisor.autotune`` ``--repeats`` times from the same
start, as for a run of ``--expected-steps`` steps, then trains fp32 (in two batch orders),
the 16-bit cast and the first call's advice from the same start and batches for ``--steps``
steps (``advisor.testbed.validate``); the cast and the advice train on until they reach
fp32's final held-out loss, so each one's time to it is measured.  Each row prints the
advice of every repeat with its evidence, the final losses, the time to fp32's final loss,
and the checks of issue 21's targets:

* accuracy: the advice's final held-out loss within 1% of fp32's, or the advice is a baseline
  (and how far apart the two fp32 orders ended: the noise of that measurement);
* time: the advice reaches fp32's final loss no later than the best baseline, beyond the noise
  of that measurement in the same run: the larger of the arms' step-time noise and how far apart
  the two fp32 orders reached the loss (a run's time to a loss varies with its batch order);
* repeats: every repeat gives the same advice, or advice whose time-to-accuracy intervals overlap;
* where a compressed plan is proven at 100 Mbit/s: at least 1.3x sooner than the 16-bit cast.

With ``--runs N`` the validation repeats the comparison in N batch orders (``validate_workload(runs=N)``):
the accuracy check then takes the advice's mean gap behind fp32 over the orders (with its 95%
interval), and the time checks the median over orders of each order's own ratio.

Tasks: ``text`` (the bundled 1.5M-parameter transformer LM), ``rnn`` (an 8.7M-parameter
LSTM LM) and ``tlm`` (a 10M-parameter transformer LM), all on the Python standard
library's sources (real text; held-out modules), and ``conv`` (a conv net on scikit-learn's
digits, real images).  Data forms: ``list8`` (8 batches a rank, as a list) and ``loader``
(the rank's whole shard as a DataLoader, drawn lazily).

Usage: python benchmarks/time_to_accuracy.py [--tasks text,rnn,tlm,conv] [--rates 100mbit,1gbit]
[--optimizers sgd,adamw] [--data list8,loader] [--steps N] [--repeats 3] [--expected-steps 30000] [--runs 1]
[--timeout 3000] [--out rows.json]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time

import torch
import torch.nn as nn

from advisor.runtime import Plan
from advisor.testbed import workloads
from advisor.testbed.emulated import unavailable_reason
from advisor.testbed.validate import NOISE, validate_workload
from advisor.testbed.workloads import (
    TEXT_CONTEXT,
    Workload,
    _next_token_loss,
    _RecurrentLM,
    _TextLM,
    _windows,
    stdlib_text_corpus,
)
from policies.evidence import signed_relative
from policies.problem import BASELINES

STEPS = {"text": 300, "rnn": 200, "tlm": 200, "conv": 300}
DATA = {"list8": 8, "loader": "loader"}


def _optimizer(name: str, lr: float):
    if name == "sgd":
        return lambda params: torch.optim.SGD(params, lr=lr, momentum=0.9)
    return lambda params: torch.optim.AdamW(params, lr=lr, weight_decay=0.01)


def _text_task(model: nn.Module, name: str, batch: int = 8) -> Workload:
    """``model`` on the stdlib text with an 8192-word vocabulary, batches of ``batch`` x 64 tokens."""
    train, held = stdlib_text_corpus(vocab=8192)
    windows = torch.stack(_windows(train, 1, TEXT_CONTEXT))[:, 0]
    windows = windows[torch.randperm(len(windows), generator=torch.Generator().manual_seed(0))]
    batches = list(windows[: len(windows) // batch * batch].split(batch))
    return Workload(model, _next_token_loss, batches, name=name, held_out=_windows(held, 16, TEXT_CONTEXT)[:4])


def _conv_task() -> Workload:
    """A conv net (4 conv layers, 0.6M parameters) on the digits, upsampled to 16x16."""
    x, y, x_test, y_test = workloads.digits_data()
    up = nn.Upsample(size=(16, 16), mode="bilinear", align_corners=False)

    def images(t: torch.Tensor) -> torch.Tensor:
        return up(t.view(-1, 1, 8, 8))

    x, x_test = images(x), images(x_test)
    model = nn.Sequential(
        nn.Conv2d(1, 32, 3, padding=1), nn.ReLU(), nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(64, 128, 3, padding=1), nn.ReLU(), nn.Conv2d(128, 128, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(128 * 4 * 4, 256), nn.ReLU(), nn.Linear(256, 10))
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))
    batches = [(x[order[i : i + 32]], y[order[i : i + 32]]) for i in range(0, len(y) - 31, 32)]
    return Workload(model, workloads._cross_entropy, batches, name="digits-conv",
                    evaluate=workloads._digits_evaluator(x_test, y_test))


TASKS = {"text": workloads.text_lm, "rnn": lambda: _text_task(_RecurrentLM(vocab=8192, dim=384), "stdlib-lstm-lm"),
         "tlm": lambda: _text_task(_TextLM(vocab=8192, dim=320, layers=4, heads=5), "stdlib-transformer-lm"),
         "conv": _conv_task}
LR = {("text", "sgd"): 0.1, ("rnn", "sgd"): 0.5, ("tlm", "sgd"): 0.1, ("conv", "sgd"): 0.05}


def _variant(task: str, optimizer: str):
    """A workload factory: the task trained with the optimizer (module level, so ranks can import it)."""
    def factory():
        workload = TASKS[task]()
        workload.make_optimizer = _optimizer(optimizer, LR.get((task, optimizer), 2e-3))
        return workload
    return factory


for _task in TASKS:
    for _opt in ("sgd", "adamw"):
        globals()[f"{_task}_{_opt}"] = _variant(_task, _opt)


def _evidence(result: dict) -> str:
    """The chosen plan's time-to-accuracy evidence in a few words."""
    row = next((e for e in result["evidence"] if e["label"] == result["recommendation"]), None)
    trial = result.get("accuracy")
    power = (f"trial {trial['checkpoints'][-1]} steps, detects {trial['detectable']:.2%}" + (" (powered)" if trial["powered"]
                                                                                   else "")) if trial else "no trial"
    if trial and not trial["powered"]:  # why it ended unpowered: the budget, or fp32 learning nothing visible
        reason = trial["length_reason"]
        power += f" ({reason[:120]}{'...' if len(reason) > 120 else ''})"
    tta = (f"{row['time_to_accuracy']:.2f}x ({row['tta_low']:.2f}-{row['tta_high']:.2f})"
           if row and row["time_to_accuracy"] is not None else "-")
    again = [f"re-timed {r['label']} {r['speedup']:.2f}x ({r['low']:.2f}-{r['high']:.2f}) per step vs {r['baseline']}, "
             f"race {r['race_speedup']:.2f}x" for r in result.get("retimed", [])]
    return f"{result['description']} [to accuracy {tta}; {power}" + "".join(f"; {a}" for a in again) + "]"


def _agree(results: list[dict]) -> bool:
    """Same advice, or time-to-accuracy intervals that overlap."""
    if len({r["recommendation"] if not r["compress"] else r["description"] for r in results}) == 1:
        return True
    bounds = []
    for r in results:
        row = next((e for e in r["evidence"] if e["label"] == r["recommendation"]), None)
        if row is None or row["tta_low"] is None:
            return False
        bounds.append((row["tta_low"], row["tta_high"]))
    return max(lo for lo, _ in bounds) <= min(hi for _, hi in bounds)


def row(task: str, rate: str | None, optimizer: str, data: str, steps: int, repeats: int,
        expected_steps: int, runs: int = 1, timeout: float = 3000.0) -> dict:
    spec = f"benchmarks.time_to_accuracy:{task}_{optimizer}"
    t0 = time.perf_counter()
    report = validate_workload(spec, None, rate=rate, steps=steps, eval_every=max(1, steps // 20), runs=runs,
                               timeout=timeout,
                               autotune_kwargs={"data": DATA[data], "repeats": repeats,
                                                "expected_steps": expected_steps})
    sixteen, plan = report.arm("16-bit"), report.arm("plan")
    advised = Plan.from_dict(report.plan)
    compresses = any(c.label not in BASELINES for c in advised.configs())
    gap, noise = report.gap(), report.noise()
    # the last checkpoint alone is as noisy as the two fp32 orders are apart; the mean over the
    # last few is shown beside it, for the plan and for the other fp32 order alike
    late = {label: _late_gap(report, label) for label in ("plan", NOISE)}
    accuracy_ok = gap <= 0.01 or not compresses
    tta = report.time_to_target_s
    best_base = min((t for t in (tta["fp32"], tta[sixteen.label]) if t is not None), default=None)
    step_noise = max(a.step_noise for a in report.arms)
    other = tta.get(NOISE)
    order_noise = abs(other / tta["fp32"] - 1) if other is not None and tta["fp32"] else None
    time_noise = max(step_noise, order_noise or 0.0)
    time_ok = tta["plan"] is not None and (best_base is None or tta["plan"] <= best_base * (1 + time_noise))
    vs16 = report.speedup["vs_16bit"]
    if vs16 is None and tta["plan"] is not None and tta[sixteen.label] is None:
        vs16 = sixteen.seconds[-1] / tta["plan"]  # the cast never got there: at least this
    speed_ok = None if not (compresses and rate == "100mbit") else (vs16 is not None and vs16 >= 1.3)
    replicated = _replicated(report, time_noise) if report.runs else None
    if replicated is not None:  # the verdicts rest on every order, not on the first alone
        accuracy_ok = replicated["gap"] <= 0.01 or not compresses
        time_ok = replicated["time_ok"]
        speed_ok = None if speed_ok is None else replicated["vs_16bit"] is not None and replicated["vs_16bit"] >= 1.3
    results = [report.autotune, *report.repeats]
    return {"task": task, "rate": rate or "loopback", "optimizer": optimizer, "data": data, "steps": steps,
            "advice": plan.description, "compresses": compresses, "repeats": [_evidence(r) for r in results],
            "repeats_agree": _agree(results), "final": {a.label: a.final(report.metric) for a in report.arms},
            "ms_per_step": {a.label: a.step_s * 1e3 for a in report.arms},
            "step_noise": {a.label: a.step_noise for a in report.arms}, "time_to_target_s": tta,
            "order_noise": order_noise, "time_noise": time_noise,
            "speedup": report.speedup, "vs_16bit_at_least": vs16, "target": report.target, "gap": gap,
            "final_noise": noise, "late_gap": late, "accuracy_ok": accuracy_ok, "time_ok": time_ok, "speedup_ok": speed_ok,
            "autotune_s": [r["seconds"]["total"] for r in results], "wall_s": time.perf_counter() - t0,
            "replicated": replicated, "report": report.to_dict()}


def _replicated(report, time_noise: float) -> dict:
    """Over the batch orders: the advice's mean gap and its 95% interval, each order's time-to-accuracy
    ratios (best baseline's time over the advice's; 0 where the advice never got there), and the time
    check on their median."""
    mean, low, high = report.gap_interval()
    ratios, vs16 = [], []
    for r in report.runs:
        t = r.time_to_target_s
        base = min((x for x in (t["fp32"], t["16-bit"]) if x is not None), default=None)
        ratios.append(0.0 if t["plan"] is None else (base / t["plan"] if base is not None else math.inf))
        vs16.append(r.speedup("16-bit") or 0.0)
    median = statistics.median(ratios)
    return {"orders": len(report.runs), "gaps": [r.gap(report.higher_is_better) for r in report.runs],
            "gap": mean, "gap_low": low, "gap_high": high, "vs_best": ratios, "vs_best_median": median,
            "vs_16bit_each": vs16, "vs_16bit": statistics.median(vs16), "time_ok": median * (1 + time_noise) >= 1}


#: the late checkpoints averaged beside the final one
LATE_CHECKPOINTS = 5


def _late_gap(report, label: str) -> float | None:
    """The arm's mean relative gap behind fp32 over the last :data:`LATE_CHECKPOINTS` checkpoints
    (positive: worse); None where the report has no such arm."""
    try:
        arm, fp32 = report.arm(label), report.arm("fp32")
    except KeyError:
        return None
    # an arm may train on past the step the arms are compared at (to reach the target): align by step
    at = arm.compared_at or fp32.steps[-1]
    mine = dict(zip(arm.steps, arm.metrics[report.metric]))
    theirs = dict(zip(fp32.steps, fp32.metrics[report.metric]))
    common = [s for s in fp32.steps if s in mine and s <= at][-LATE_CHECKPOINTS:]
    if not common:
        return None
    return statistics.fmean(signed_relative([mine[s] for s in common], [theirs[s] for s in common],
                                            report.higher_is_better))


def show(r: dict) -> None:
    tta = {k: (f"{v:.1f}s" if v is not None else "never") for k, v in r["time_to_target_s"].items()}
    print(f"{r['task']:5s} {r['rate']:8s} {r['optimizer']:5s} {r['data']:6s} advice: {r['advice']}")
    for i, text in enumerate(r["repeats"]):
        print(f"    call {i + 1}: {text}")
    print("    final loss: " + ", ".join(f"{k} {v:.4f}" for k, v in r["final"].items())
          + f"; advice vs fp32 {r['gap']:+.2%}, fp32 vs fp32 (other order) {r['final_noise']:.2%}")
    late = r.get("late_gap") or {}
    if late.get("plan") is not None and late.get(NOISE) is not None:
        print(f"    mean gap behind fp32 over the last {LATE_CHECKPOINTS} checkpoints: advice {late['plan']:+.2%}, "
              f"fp32 (other order) {late[NOISE]:+.2%}")
    print("    ms/step: " + ", ".join(f"{k} {v:.1f} (±{r['step_noise'][k]:.1%})" for k, v in r["ms_per_step"].items()))
    s16 = r["vs_16bit_at_least"]
    print(f"    time to {r['target']:.4f}: " + ", ".join(f"{k} {v}" for k, v in tta.items())
          + (f"; advice vs 16-bit {s16:.2f}x" if s16 else ""))
    orders = r.get("order_noise")
    print(f"    noise of the time: steps ±{max(r['step_noise'].values()):.1%}, the two fp32 orders "
          + (f"{orders:.1%} apart" if orders is not None else "(the other order never reached it)")
          + f": ±{r['time_noise']:.1%}")
    rep = r.get("replicated")
    if rep:
        print(f"    over {rep['orders']} batch orders: advice vs fp32 " + ", ".join(f"{g:+.2%}" for g in rep["gaps"])
              + f"; mean {rep['gap']:+.2%} (95%: {rep['gap_low']:+.2%} to {rep['gap_high']:+.2%}); to accuracy vs the "
              "best baseline " + ", ".join(f"{x:.2f}x" for x in rep["vs_best"]) + f" (median {rep['vs_best_median']:.2f}x)"
              + ", vs 16-bit " + ", ".join(f"{x:.2f}x" for x in rep["vs_16bit_each"]) + f" (median {rep['vs_16bit']:.2f}x)")
    print(f"    targets{' (over every order)' if rep else ''}: accuracy {'PASS' if r['accuracy_ok'] else 'FAIL'}, "
          f"time {'PASS' if r['time_ok'] else 'FAIL'}, "
          f"repeats {'agree' if r['repeats_agree'] else 'DISAGREE'}, 1.3x vs 16-bit "
          f"{'n/a' if r['speedup_ok'] is None else ('PASS' if r['speedup_ok'] else 'FAIL')}; autotune "
          + ", ".join(f"{s:.0f}" for s in r["autotune_s"]) + f" s; row {r['wall_s']:.0f} s", flush=True)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", default="text,rnn,tlm,conv")
    parser.add_argument("--rates", default="100mbit,1gbit")
    parser.add_argument("--optimizers", default="sgd,adamw")
    parser.add_argument("--data", default="list8,loader")
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--expected-steps", type=int, default=30_000)
    parser.add_argument("--runs", type=int, default=1)
    # a row's job is stopped after this long: the LSTM at 100 Mbit/s runs past the default
    parser.add_argument("--timeout", type=float, default=3000.0, help="seconds a row's job may take")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    rates = [r for r in args.rates.split(",") if r]
    if unavailable_reason() is not None:
        print(f"note: {unavailable_reason()}; running on loopback instead of {rates}")
        rates = [None]
    rows = []
    for task in args.tasks.split(","):
        for rate in rates:
            for optimizer in args.optimizers.split(","):
                for data in args.data.split(","):
                    r = row(task, rate, optimizer, data, args.steps or STEPS[task], args.repeats,
                            args.expected_steps, args.runs, args.timeout)
                    show(r)
                    rows.append(r)
                    if args.out:
                        with open(args.out, "w") as fh:
                            json.dump(rows, fh, indent=1, default=lambda o: None if isinstance(o, float)
                                      and not math.isfinite(o) else o)
    passed = sum(r["accuracy_ok"] and r["time_ok"] and r["repeats_agree"] and r["speedup_ok"] is not False
                 for r in rows)
    print(f"{passed} of {len(rows)} rows meet every target")
    return 0


if __name__ == "__main__":
    sys.exit(main())
