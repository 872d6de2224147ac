"""The ``advisor`` command line (grows with the product; all logic lives in the library)."""

from __future__ import annotations

import json
import os
import re
import sys

import click


@click.group()
@click.version_option(package_name="compression-advisor")
def main() -> None:
    """Should you compress gradients on your cluster, and how?"""


@main.command("compressors")
@click.option("--json", "as_json", is_flag=True, help="Print JSON for scripts.")
def compressors_cmd(as_json: bool) -> None:
    """List the compressors and their parameters."""
    from .compressors.registry import REGISTRY, available

    if as_json:
        click.echo(json.dumps(available(), indent=2))
        return
    from rich.console import Console
    from rich.table import Table

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
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from profilers.cluster import profile_cluster

    from .workloads import build_workload

    from .launch import leave_together

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
    from .compressors import parse
    from .emulated import parse_rate, unavailable_reason
    from .launch import RankFailed

    try:
        from .workloads import load_factory

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
            from profilers.cluster import profile_model

            from rich.console import Console

            with Console(stderr=True).status(f"profiling {spec} on {nproc} ranks ..."):
                profile = profile_model(spec, nproc, rate=rate, timeout=timeout, **kwargs)
    except RankFailed as exc:
        fail(str(exc).splitlines()[0] + " (" + str(exc).strip().splitlines()[-1] + ")")
    profile.save(out_path)
    if as_json:
        click.echo(profile.to_json())
        return
    from .reports import render_profile

    render_profile(profile)
    click.echo(f"profile written to {out_path}")


@main.command("demo")
@click.option("--steps", default=20, show_default=True, help="Timed steps per plan.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON for scripts.")
def demo_cmd(steps: int, as_json: bool) -> None:
    """Run plans side by side on a local 2-process cluster and print what is fastest."""
    from .demo import as_dicts, render, run_demo

    if steps < 1:
        raise click.UsageError(f"--steps={steps}; allowed: an integer >= 1")
    if as_json:
        click.echo(json.dumps(as_dicts(run_demo(steps=steps)), indent=2))
        return
    from rich.console import Console

    console = Console()
    with console.status("measuring plans on a local 2-rank gloo cluster ..."):
        rows = run_demo(steps=steps)
    render(rows, console)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
