"""The online check on a plan installed from the start: does it fire where the plan falls behind late, and only there?

Per batch order (``--orders``), one job (2 ranks over loopback: accuracy is counted, not timed)
trains from the same start, on the rank's whole shard in that order, for ``--steps`` steps:

* **fp32**: DDP with no hook;
* **unwatched**: the plan installed with ``advisor.install``, nothing watching it;
* **watched**: the plan given to ``advisor.wrap(ddp, opt, plan=..., loss_fn=..., batches=...)``, as a user
  keeps checking a plan from ``autotune`` (``result.watch``): the fidelity monitor every step, the
  loop's loss reported (``tuner.record_loss``), and the paired re-trials at ``--retrial-share`` of
  the training time, their trial's budget ``--trial-share`` of ``--expected-steps``.

The held-out metric is read every ``--eval-every`` steps.  It prints, per order, each arm's final
value, its mean over the last five checkpoints and over the second half of the run against fp32's
in the same order, how far the fp32 runs of different orders end apart (the noise a single run's
gap is read against), and what the watch did: its fidelity windows, re-trials and back-offs,
each at its step.  Over the orders it prints the unwatched plan's mean gaps with 95% intervals
(Student's t, paired by order), so whether the plan truly falls behind, and whether the watch
fired where it did or did not.

At the defaults (``--expected-steps 30000``, a 2% trial share, a 3% re-trial share) the first
re-trial comes after 20,000 steps, so within a few hundred only the fidelity monitor acts; pass a
larger ``--retrial-share`` (and a shorter ``--expected-steps``) to see what re-trials would find.

Usage: python benchmarks/online_check.py [--task benchmarks.time_to_accuracy:conv_adamw] [--plan bf16]
[--orders 3] [--steps 300] [--eval-every 15] [--expected-steps 30000] [--trial-share 0.02]
[--retrial-share 0.03] [--out results.json]
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import random
import statistics
import sys
import time

import torch
from torch.nn.parallel import DistributedDataParallel

import advisor
from advisor.runtime import Plan
from advisor.testbed.launch import launch_local
from advisor.testbed.validate import mean_interval, relative_gap
from advisor.testbed.workloads import build_workload
from advisor.tuning.accuracy import evaluate_on_every_rank, higher_is_better

ARMS = ("fp32", "unwatched", "watched")
LATE = 5  # checkpoints averaged at the end: one checkpoint alone is as noisy as two fp32 orders are apart


def _late_half(curve: list[float]) -> float:
    """The mean over the second half of the run's checkpoints: a held-out loss that spikes now and
    then (AdamW late in training) is read over many checkpoints, not at the one where it spiked."""
    return statistics.fmean(curve[len(curve) // 2:])


def _train(rank: int, world: int, workload, plan_text: str, arm: str, order: int, steps: int, eval_every: int,
           watch: dict) -> dict:
    """One arm in one batch order, from the workload's initial weights: its held-out curve, and for the
    watched arm what the watch did."""
    torch.manual_seed(0)
    evaluate, metric = workload.evaluator(), workload.metric
    mine = list(workload.batches)[rank::world]
    batches = random.Random(order).sample(mine, len(mine)) if order else mine
    model = copy.deepcopy(workload.model)
    ddp = DistributedDataParallel(model)
    opt = workload.optimizer(model)
    plan = Plan.uniform(plan_text, warmup_steps=0)
    hook = tuner = None
    if arm == "unwatched":
        hook = advisor.install(ddp, plan)
    elif arm == "watched":
        tuner = advisor.wrap(ddp, opt, plan=plan, loss_fn=workload.loss_fn, batches=batches, **workload.judged_by(),
                             metric=metric, **watch)
    checkpoints, curve = [0], [evaluate_on_every_rank(evaluate, [model], metric, require_finite=True)[0][metric]]
    t0 = time.perf_counter()
    for step in range(1, steps + 1):
        opt.zero_grad(set_to_none=True)
        loss = workload.loss_fn(ddp, batches[(step - 1) % len(batches)])
        loss.backward()
        opt.step()
        if tuner is not None:
            tuner.record_loss(loss)
        if step % eval_every == 0 or step == steps:
            checkpoints.append(step)
            curve.append(evaluate_on_every_rank(evaluate, [model], metric)[0][metric])
    out = {"checkpoints": checkpoints, "curve": curve, "seconds": time.perf_counter() - t0}
    if tuner is not None:
        out["events"] = [(e.step, e.what, e.detail) for e in tuner.events]
        out["fidelity"] = [(r.first_step, r.error, r.zeroed) for r in tuner.fidelity]
        out["retrials"] = [(s, digest, a.gap, a.status, a.reason) for s, digest, a in tuner.retrials]
        out["final_plan"] = ", ".join(sorted({c.label for c in tuner.plan.configs()}))
        tuner.close()
    if hook is not None:
        hook.close()
    return out


def _job(rank: int, world: int, spec: str, plan_text: str, order: int, steps: int, eval_every: int,
         watch: dict) -> dict:
    torch.manual_seed(0)
    workload = build_workload(spec)
    arms = {arm: _train(rank, world, workload, plan_text, arm, order, steps, eval_every, watch) for arm in ARMS}
    return arms if rank == 0 else {}


def _late(curve: list[float]) -> float:
    return statistics.fmean(curve[-LATE:])


def _interval(gaps: list[float]) -> tuple[float, float, float]:
    return mean_interval(gaps) or (statistics.fmean(gaps), math.nan, math.nan)


def run(spec: str, plan_text: str, orders: int, steps: int, eval_every: int, watch: dict) -> dict:
    metric = build_workload(spec).metric
    higher = higher_is_better(metric)
    rows = []
    for order in range(orders):
        t0 = time.perf_counter()
        arms = launch_local(_job, 2, (spec, plan_text, order, steps, eval_every, watch), timeout=3600)[0]
        fp32 = arms["fp32"]["curve"]
        rows.append({"order": order, "arms": arms, "wall_s": time.perf_counter() - t0,
                     "final": {a: arms[a]["curve"][-1] for a in ARMS},
                     "gap": {a: relative_gap(arms[a]["curve"][-1], fp32[-1], higher) for a in ARMS[1:]},
                     "late_gap": {a: relative_gap(_late(arms[a]["curve"]), _late(fp32), higher) for a in ARMS[1:]},
                     "half_gap": {a: relative_gap(_late_half(arms[a]["curve"]), _late_half(fp32), higher) for a in ARMS[1:]}})
        show_order(rows[-1], plan_text)
    fp32_finals = [r["final"]["fp32"] for r in rows]
    fp32_late = [_late(r["arms"]["fp32"]["curve"]) for r in rows]
    fp32_half = [_late_half(r["arms"]["fp32"]["curve"]) for r in rows]
    summary = {
        "fp32_orders_apart": (max(fp32_finals) - min(fp32_finals)) / min(fp32_finals) if orders > 1 else None,
        "fp32_late_orders_apart": (max(fp32_late) - min(fp32_late)) / min(fp32_late) if orders > 1 else None,
        "fp32_half_orders_apart": (max(fp32_half) - min(fp32_half)) / min(fp32_half) if orders > 1 else None,
        "unwatched_half_gap": _interval([r["half_gap"]["unwatched"] for r in rows]),
        "unwatched_late_gap": _interval([r["late_gap"]["unwatched"] for r in rows]),
        "unwatched_final_gap": _interval([r["gap"]["unwatched"] for r in rows]),
        "watched_late_gap": _interval([r["late_gap"]["watched"] for r in rows]),
        "fired": [next((s for s, w, _ in r["arms"]["watched"]["events"] if w == "back-off"), None) for r in rows],
    }
    return {"task": spec, "plan": plan_text, "metric": metric, "steps": steps, "watch": watch, "orders": rows,
            "summary": summary}


def show_order(r: dict, plan_text: str) -> None:
    watched = r["arms"]["watched"]
    print(f"order {r['order']}: final fp32 {r['final']['fp32']:.4g}, {plan_text} unwatched {r['final']['unwatched']:.4g} "
          f"({r['gap']['unwatched']:+.1%}; last {LATE} checkpoints {r['late_gap']['unwatched']:+.1%}; second half "
          f"{r['half_gap']['unwatched']:+.1%}), watched "
          f"{r['final']['watched']:.4g} ({r['gap']['watched']:+.1%}; {r['late_gap']['watched']:+.1%}); "
          f"watched ends on {watched['final_plan']} ({r['wall_s']:.0f} s)")
    errors = ", ".join(f"{e:.2%}@{s}" for s, e, _ in watched["fidelity"])
    print(f"    fidelity windows: {errors or 'none'}")
    for step, digest, gap, status, _ in watched["retrials"]:
        print(f"    re-trial at step {step} of {digest}: {gap:+.2%}, {status}")
    for step, what, detail in watched["events"]:
        if what in ("back-off", "re-trial"):
            print(f"    {what} at step {step}: {detail}")
    sys.stdout.flush()


def show(result: dict) -> None:
    s = result["summary"]

    def interval(name: str) -> str:
        mean, low, high = s[name]
        return f"{mean:+.1%}" + ("" if math.isnan(low) else f" (95%: {low:+.1%} to {high:+.1%})")

    print(f"{result['plan']} on {result['task']}, {result['steps']} steps, {len(result['orders'])} orders:")
    if s["fp32_orders_apart"] is not None:
        print(f"    fp32's orders end {s['fp32_orders_apart']:.1%} apart (last {LATE} checkpoints: "
              f"{s['fp32_late_orders_apart']:.1%}; second half: {s['fp32_half_orders_apart']:.1%})")
    print(f"    unwatched behind fp32 over the last {LATE} checkpoints: {interval('unwatched_late_gap')}; "
          f"over the second half: {interval('unwatched_half_gap')}; at the end: {interval('unwatched_final_gap')}")
    print(f"    watched: {interval('watched_late_gap')}; backed off at steps {s['fired']}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--task", default="benchmarks.time_to_accuracy:conv_adamw")
    parser.add_argument("--plan", default="bf16")
    parser.add_argument("--orders", type=int, default=3)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--eval-every", type=int, default=15)
    parser.add_argument("--expected-steps", type=int, default=30_000)
    parser.add_argument("--trial-share", type=float, default=0.02)
    parser.add_argument("--retrial-share", type=float, default=0.03)
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    watch = {"expected_steps": args.expected_steps, "trial_share": args.trial_share,
             "retrial_share": args.retrial_share}
    result = run(args.task, args.plan, args.orders, args.steps, args.eval_every, watch)
    show(result)
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(result, fh, indent=1, default=lambda o: None if isinstance(o, float) and not math.isfinite(o)
                      else str(o))
    return 0


if __name__ == "__main__":
    sys.exit(main())
