"""The ``advisor`` command line (grows with the product; all logic lives in the library)."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import sys

import click
import torch.distributed as dist
from rich.console import Console
from rich.table import Table
from torch.nn.parallel import DistributedDataParallel

from advisor.compressors import parse
from advisor.compressors.registry import REGISTRY, available
from advisor.core.documents import read_document
from advisor.perfmodel import Scenario
from advisor.report.results import render_search
from advisor.report.text import render_plan, render_profile
from advisor.runtime import Plan
from advisor.testbed.bench import MODELS, render_row, run_benchmark
from advisor.testbed.demo import DEMO_RUN_STEPS, demo_cluster_description, run_demo
from advisor.testbed.emulated import parse_rate, unavailable_reason
from advisor.testbed.jobs import profile_model
from advisor.testbed.launch import RankFailed, leave_together
from advisor.testbed.validate import validate_workload
from advisor.testbed.workloads import build_workload, load_factory
from advisor.tuning.prediction import predict_plan
from advisor.tuning.results import AutotuneResult, bucket_rows, search_summary
from advisor.tuning.whatif import budget_evidence, what_if
from policies.baselines import SIXTEEN_BIT
from policies.greedy import GreedyPolicy
from policies.optuna_search import OptunaPolicy
from policies.problem import TuningProblem
from profilers.cluster import profile_cluster
from profilers.profile import ClusterProfile


@click.group()
@click.version_option(package_name="compression-advisor")
def main() -> None:
    """Should you compress gradients on your cluster, and how?"""


@main.command("compressors")
@click.option("--json", "as_json", is_flag=True, help="Print JSON for scripts.")
def compressors_cmd(as_json: bool) -> None:
    """List the compressors and their parameters."""
    if as_json:
        click.echo(json.dumps(available(), indent=2))
        return

    table = Table(title="Compressors")
    table.add_column("name")
    table.add_column("parameters")
    table.add_column("what it does")
    for name, entry in REGISTRY.items():
        params = ", ".join(f"{p}: {s.allowed}" for p, s in entry.params.items()) or "-"
        table.add_row(name, params, entry.summary)
    Console().print(table)


def split_configs(text: str) -> list[str]:
    """``"fp16,intquant(bits=8, packed=0)"`` -> two configs: commas inside () stay."""
    return [part.strip() for part in re.split(r",(?![^()]*\))", text) if part.strip()]


def fail(reason: str) -> None:
    """Bad input: one line on stderr, exit code 2."""
    click.echo(f"error: {reason}", err=True)
    sys.exit(2)


def _under_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or ("RANK" in os.environ and "WORLD_SIZE" in os.environ)


def _profile_here(spec: str, kwargs: dict):
    """Profile in this process, one rank of a job torchrun started."""


    dist.init_process_group("gloo")
    try:
        workload = build_workload(spec)
        ddp = DistributedDataParallel(workload.model)
        profile = profile_cluster(ddp, workload.loss_fn, workload.batches, workload.optimizer(), **kwargs)
        leave_together()
        return profile if dist.get_rank() == 0 else None
    finally:
        dist.destroy_process_group()


@main.command("profile")
@click.option("--model", "spec", required=True, help="Workload factory, as package.module:function.")
@click.option("--nproc", default=2, show_default=True, help="Ranks to launch (ignored under torchrun).")
@click.option("--rate", default=None, help="Run on an emulated cluster with links of this rate, e.g. 1gbit (root).")
@click.option("--configs", default=None, help="Comma-separated candidate compressors (default: all).")
@click.option("--network/--no-network", default=True, help="Measure collectives.")
@click.option("--kernels/--no-kernels", default=True, help="Measure compressor costs.")
@click.option("--fidelity/--no-fidelity", default=True, help="Measure gradient fidelity.")
@click.option("--timeout", default=600.0, show_default=True, help="Seconds before a stuck rank ends the job.")
@click.option("--out", "out_path", default="profile.json", show_default=True, help="Where to write the profile.")
@click.option("--json", "as_json", is_flag=True, help="Print the profile JSON instead of tables.")
def profile_cmd(spec, nproc, rate, configs, network, kernels, fidelity, timeout, out_path, as_json) -> None:
    """Profile the cluster for a model: compute, network, compressor costs, fidelity."""
    try:

        load_factory(spec)
        if nproc < 1:
            raise ValueError(f"--nproc={nproc}; allowed: an integer >= 1")
        config_list = [parse(c).label for c in split_configs(configs)] if configs else None
        if rate is not None:
            parse_rate(rate)
            reason = unavailable_reason()
            if reason:
                raise ValueError(f"--rate needs the emulated cluster, but {reason}")
    except ValueError as exc:
        fail(str(exc))
    kwargs = {"network": network, "kernels": kernels, "fidelity": fidelity}
    if config_list:
        kwargs["configs"] = config_list
    try:
        if _under_torchrun():
            profile = _profile_here(spec, kwargs)
            if profile is None:
                return
        else:


            with Console(stderr=True).status(f"profiling {spec} on {nproc} ranks ..."):
                profile = profile_model(spec, nproc, rate=rate, timeout=timeout, **kwargs)
    except RankFailed as exc:
        fail(str(exc).splitlines()[0] + " (" + str(exc).strip().splitlines()[-1] + ")")
    profile.save(out_path)
    if as_json:
        click.echo(profile.to_json())
        return

    render_profile(profile)
    click.echo(f"profile written to {out_path}")


_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(s|ms|us|µs)?\s*$")


def parse_duration(text: str) -> float:
    """Seconds from ``"50us"``, ``"0.2ms"``, ``"1s"`` or a number of seconds."""
    match = _DURATION.match(str(text))
    if not match:
        raise ValueError(f"cannot read duration {text!r}; write e.g. '50us', '0.2ms' or a number of seconds")
    value, unit = float(match.group(1)), match.group(2) or "s"
    return value * {"s": 1.0, "ms": 1e-3, "us": 1e-6, "µs": 1e-6}[unit]


@main.command("whatif")
@click.argument("profile_path", metavar="PROFILE")
@click.option("--world-size", type=int, default=None, help="Workers (1..1024); default: as profiled.")
@click.option("--bandwidth", default=None, help="Per-link rate, e.g. 10Gbit; default: as profiled.")
@click.option("--latency", default=None, help="Per-hop latency, e.g. 50us; default: as profiled.")
@click.option("--speedup", type=float, default=1.0, show_default=True, help="Device this many times faster.")
@click.option("--budget", type=float, default=None, help="Largest size-weighted fidelity error allowed.")
@click.option("--reference", default=None, help="A config you trust; its error everywhere is the budget.")
@click.option("--result", "result_path", default=None,
              help="An autotune result JSON: use the budget its accuracy trial earned.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON for scripts.")
def whatif_cmd(profile_path, world_size, bandwidth, latency, speedup, budget, reference, result_path,
               as_json) -> None:
    """Would compression help on another cluster, and which compressor, within the accuracy budget?"""

    try:
        profile = ClusterProfile.load(profile_path)
        scenario = Scenario(
            world_size=world_size,
            bandwidth_bps=parse_rate(bandwidth) if bandwidth is not None else None,
            latency_s=parse_duration(latency) if latency is not None else None,
            compute_speedup=speedup,
        )
        accuracy = AutotuneResult.load(result_path).accuracy if result_path else None
        found = what_if(profile, scenario, budget=budget, reference=reference, accuracy=accuracy)
    except ValueError as exc:
        fail(str(exc))
    if as_json:
        click.echo(json.dumps({
            "scenario": {"world_size": found.world_size, "bandwidth_bps": scenario.bandwidth_bps,
                         "latency_s": scenario.latency_s, "compute_speedup": speedup},
            "predicted_s": {r.config: r.predicted_s for r in found.rows},
            **{k: v for k, v in dataclasses.asdict(found).items() if k != "rows"},
            "rows": [dataclasses.asdict(r) for r in found.rows],
        }, indent=2))
        return

    base_s = next(r.predicted_s for r in found.rows if r.config == found.best_baseline)
    table = Table(title=f"Predicted iteration at {found.world_size} workers (compute-only floor "
                        f"{found.compute_only_s * 1e3:.1f} ms)")
    trialled = any(r.trial for r in found.rows)
    columns = [("plan, every bucket", "left"), ("ms/iter", "right"), (f"vs {found.best_baseline}", "right"),
               (f"{found.fidelity_measure} error", "right"), ("in budget", "left")]
    if trialled:  # the accuracy trial's evidence, where a result was given
        columns += [("trial", "left"), ("efficiency", "right"), ("to accuracy (95% low)", "right")]
    for col, justify in columns:
        table.add_column(col, justify=justify)
    for r in found.rows:
        layout = f" [{r.layout.strip()}]" if r.layout else ""
        cells = [r.config + layout, f"{r.predicted_s * 1e3:.1f}", f"{base_s / r.predicted_s:.2f}x",
                 f"{r.fidelity_error:.3g}", "yes" if r.within_budget else "no"]
        if trialled:
            cells += [r.trial or "-", f"{r.efficiency:.2f}" if r.efficiency is not None else "-",
                      f"{r.to_accuracy:.2f}x ({r.to_accuracy_low:.2f}x)" if r.to_accuracy is not None else "-"]
        table.add_row(*cells)
    console = Console(width=max(Console().width, 120 if trialled else 80))
    console.print(table)
    console.print(f"Budget {found.budget:.3g}: {found.budget_source}")
    if any(r.exchange_mb is not None for r in found.rows):
        console.print("[in n MiB exchanges]: DDP's buckets exchanged together up to n MiB (Plan.exchange_mb), "
                      "predicted faster than DDP's own buckets, on DDP built with bucket_cap_mb=n "
                      "(advisor.ddp_for builds it); joined in the hook on DDP built otherwise, with a copy each")
    if any(r.bucket_cap_mb is not None for r in found.rows):
        console.print("[with DDP's buckets at n MiB]: predicted faster with DDP built with bucket_cap_mb=n "
                      "(Plan.bucket_cap_mb; advisor.ddp_for builds it)")
    console.print(found.verdict)


@main.command("demo")
@click.option("--steps", default=5, show_default=True, help="Timed steps per plan and round of live measurement.")
@click.option("--rounds", default=3, show_default=True, help="Interleaved rounds of live measurement.")
@click.option("--run-steps", default=DEMO_RUN_STEPS, show_default=True,
              help="Length of the training run the advice is for; the accuracy trial may take 2% of it.")
@click.option("--json", "as_json", is_flag=True, help="Print the autotune result as JSON for scripts.")
def demo_cmd(steps: int, rounds: int, run_steps: int, as_json: bool) -> None:
    """Autotune a bundled text LM (real text, momentum SGD) on a local 2-process cluster and print the advice."""
    if steps < 1 or rounds < 1 or run_steps < 1:
        fail(f"--steps={steps} --rounds={rounds} --run-steps={run_steps}; allowed: integers >= 1")
    where = demo_cluster_description()
    if as_json:
        click.echo(run_demo(steps=steps, rounds=rounds, expected_steps=run_steps).to_json())
        return

    console = Console()
    console.print(f"Autotuning a 1.5M-parameter transformer LM on the standard library's sources, for a run of "
                  f"{run_steps:,} steps, on {where} (about a minute and a half); rank 0's stages:",
                  highlight=False)
    result = run_demo(steps=steps, rounds=rounds, expected_steps=run_steps, show_progress=True)
    result.render(console)


@main.command("tune")
@click.argument("profile_path", metavar="PROFILE")
@click.option("--candidates", default=None, help="Comma-separated configs to choose from (default: all profiled).")
@click.option("--budget", type=float, default=None, help="Largest size-weighted fidelity error (default: the reference's).")
@click.option("--reference", default=None, help="A config you trust; its error everywhere is the budget.")
@click.option("--result", "result_path", default=None,
              help="An autotune result JSON: use the budget its accuracy trial earned.")
@click.option("--policy", type=click.Choice(["optuna", "greedy"]), default="optuna", show_default=True)
@click.option("--trials", default=2000, show_default=True, help="Optuna trials.")
@click.option("--storage", default=None, help="Optuna storage URL (sqlite:///study.db) to resume a study.")
@click.option("--world-size", type=int, default=None, help="Tune for this many workers (what-if).")
@click.option("--bandwidth", default=None, help="Tune for this per-link rate, e.g. 10Gbit (what-if).")
@click.option("--warmup-steps", default=10, show_default=True, help="Uncompressed steps at the start.")
@click.option("--out", "out_path", default="plan.json", show_default=True, help="Where to write the plan.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON for scripts.")
def tune_cmd(profile_path, candidates, budget, reference, result_path, policy, trials, storage, world_size,
             bandwidth, warmup_steps, out_path, as_json) -> None:
    """Choose a plan from a saved profile (predicted; autotune also proves it live)."""
    try:
        profile = ClusterProfile.load(profile_path)
        scenario = Scenario(world_size=world_size,
                            bandwidth_bps=parse_rate(bandwidth) if bandwidth is not None else None)

        accuracy = AutotuneResult.load(result_path).accuracy if result_path else None
        evidence, budget_source, _ = budget_evidence(budget, reference, accuracy)
        problem = TuningProblem.from_profile(profile, split_configs(candidates) if candidates else None,
                                             scenario=scenario, **evidence)
        chosen = (OptunaPolicy(n_trials=trials, storage=storage, study_name="advisor-tune" if storage else None)
                  if policy == "optuna" else GreedyPolicy())
        if warmup_steps < 0:
            raise ValueError(f"--warmup-steps={warmup_steps}; allowed: an integer >= 0")
        if policy == "optuna":

            with Console(stderr=True).status(f"searching {trials} plans with Optuna ..."):
                found = chosen.search(problem)
        else:
            found = chosen.search(problem)
    except ValueError as exc:
        fail(str(exc))

    rows = bucket_rows(problem, found.choices)
    summary = search_summary(problem, found, rows)
    summary["budget_source"] = budget_source
    summary["checked"] = False
    plan = problem.plan(found.choices, warmup_steps=warmup_steps,
                        metadata={"advisor": "tune", "description": summary["description"],
                                  "profile": str(profile_path)})
    plan.save(out_path)
    if as_json:
        click.echo(json.dumps({**summary, "plan": plan.to_dict(), "plan_path": str(out_path)}, indent=2))
        return

    console = Console()
    render_search(summary, rows, console)
    console.print(f"Budget: {budget_source}. This plan rests on a prediction no trial has checked, for speed or "
                  f"accuracy; plan written to {out_path}: prove it with `advisor validate --plan {out_path}` or "
                  "advisor.autotune(...)")


@main.command("report")
@click.argument("path", metavar="PLAN|PROFILE|RESULT")
@click.option("--profile", "profile_path", default=None, help="The cluster profile to predict a PLAN on.")
@click.option("--png", default=None,
              help="Also write a PNG: a PLAN's predicted timeline, or a RESULT's measured vs predicted times.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON for scripts.")
def report_cmd(path, profile_path, png, as_json) -> None:
    """Explain a plan (per bucket, predicted on a profile), a profile, or an autotune result."""
    try:
        document = read_document(path, accept=(Plan, ClusterProfile, AutotuneResult))
        if isinstance(document, AutotuneResult):
            if png:
                document.save_png(png)
            if as_json:
                click.echo(document.to_json())
            else:
                document.render(Console())
        elif isinstance(document, ClusterProfile):
            if as_json:
                click.echo(document.to_json())
            else:
                render_profile(document)
        else:
            if profile_path is None:
                raise ValueError("a plan is reported against a cluster profile: add --profile PROFILE")
            profile = ClusterProfile.load(profile_path)
            document.check_against(p.name for p in profile.compute.parameters)
            prediction = predict_plan(document, profile)
            if as_json:  # stdout carries the JSON only
                if png:
                    prediction.timeline.save_png(png)
                click.echo(json.dumps(prediction.to_dict(), indent=2))
            else:
                render_plan(prediction, Console(), png)
    except ValueError as exc:
        fail(str(exc))


@main.command("validate")
@click.option("--model", "spec", default="advisor.workloads:digits", show_default=True,
              help="Workload factory (package.module:function) with evaluate or held-out batches.")
@click.option("--plan", "plan_path", default=None, help="The plan to validate (default: autotune one in the job).")
@click.option("--rate", default=None, help="Emulated link rate, e.g. 100mbit (root); default: loopback.")
@click.option("--steps", default=300, show_default=True, help="Training steps per arm.")
@click.option("--eval-every", type=int, default=None, help="Steps between evaluations (default: steps/20).")
@click.option("--sixteen", type=click.Choice(SIXTEEN_BIT), default=None,
              help="The 16-bit cast trained as the strong baseline (default: bf16 for Adam-like optimizers, "
                   "else fp16).")
@click.option("--target", type=float, default=None, help="Metric value to time every arm to (default: fp32's final).")
@click.option("--nproc", default=2, show_default=True)
@click.option("--runs", default=1, show_default=True,
              help="Repeat the comparison in this many batch orders: the plan's gap behind fp32 then comes with a "
                   "95% interval, and its speed-up with its range.")
@click.option("--sharded", is_flag=True, help="Shard every arm with the workload's shard= (FSDP2) and put the plan on "
                                             "its fully_shard groups' reduce-scatters.")
@click.option("--timeout", default=3000.0, show_default=True,
              help="Seconds the whole job may take before its ranks are stopped (a long run on a slow link needs more).")
@click.option("--png", default=None, help="Write the curves (against steps and wall time) here.")
@click.option("--out", "out_path", default=None, help="Write the validation report JSON here.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON for scripts.")
def validate_cmd(spec, plan_path, rate, steps, eval_every, sixteen, target, nproc, runs, sharded, timeout, png,
                 out_path, as_json) -> None:
    """Time to accuracy: fp32, 16-bit and the plan from the same start and batches."""
    try:
        report = validate_workload(spec, plan_path, nproc=nproc, rate=rate, steps=steps, eval_every=eval_every,
                                   sixteen=sixteen, target=target, sharded=sharded, runs=runs, timeout=timeout,
                                   progress=True)
    except ValueError as exc:
        fail(str(exc))
    if out_path:
        report.save(out_path)
    if png:
        report.save_png(png)
    if as_json:
        click.echo(report.to_json())
        return
    report.render(Console())


@main.command("bench")
@click.option("--ranks", default="2,4", show_default=True, help="World sizes, comma-separated.")
@click.option("--rates", default="100mbit,1gbit,unshaped", show_default=True,
              help="Link rates (emulated cluster, root); 'unshaped' is loopback speed.")
@click.option("--models", default=None, help="Workload factories, comma-separated (default: MLP, CNN, tiny LM).")
@click.option("--rounds", default=3, show_default=True)
@click.option("--steps", default=4, show_default=True)
@click.option("--measurements", default=None, help="Append autotune's live measurements to this file.")
@click.option("--out", "out_path", default=None, help="Write the rows as JSON here (after every row).")
@click.option("--matched/--no-matched", default=True, show_default=True,
              help="Also tune with PowerSGD rank 1's fidelity budget, to compare with PyTorch's rank 1 at equal "
                   "accuracy cost.")
@click.option("--run-steps", type=int, default=None,
              help="Length of the training run the advice is for; the accuracy trial may take 2% of it "
                   "(default: not known, the trial's time budget applies).")
@click.option("--json", "as_json", is_flag=True, help="Print JSON for scripts.")
def bench_cmd(ranks, rates, models, rounds, steps, measurements, out_path, matched, run_steps, as_json) -> None:
    """The end-to-end benchmark: the advisor's plan vs DDP fp32 and PyTorch's fp16 and PowerSGD hooks."""
    try:
        world_sizes = [int(x) for x in ranks.split(",")]
        if any(w < 1 for w in world_sizes):
            raise ValueError(f"--ranks={ranks!r}; allowed: integers >= 1")
        rate_list = [r.strip() for r in rates.split(",") if r.strip()]
        for r in rate_list:
            if r != "unshaped":
                parse_rate(r)
        specs = [m.strip() for m in models.split(",")] if models else list(MODELS)
        for spec in specs:
            load_factory(spec)
        if rounds < 1 or steps < 1:
            raise ValueError(f"--rounds={rounds} --steps={steps}; allowed: integers >= 1")
        if run_steps is not None and run_steps < 1:
            raise ValueError(f"--run-steps={run_steps}; allowed: an integer >= 1")
    except ValueError as exc:
        fail(str(exc) if "invalid literal" not in str(exc) else f"--ranks={ranks!r}; write e.g. 2,4")

    console = Console(stderr=as_json)
    rows: list = []

    def on_row(row):
        rows.append(row)
        if out_path:
            with open(out_path, "w") as fh:
                json.dump(rows, fh, indent=1)
        if not as_json:
            render_row(row, console)

    try:
        run_benchmark(world_sizes, rate_list, specs, rounds=rounds, steps=steps, measurements=measurements,
                      on_row=on_row, matched=matched,
                      autotune_kwargs={"expected_steps": run_steps} if run_steps else None)
    except ValueError as exc:
        fail(str(exc))
    if as_json:
        click.echo(json.dumps(rows, indent=1))


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
