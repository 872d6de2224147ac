"""The ``advisor`` command line (grows with the product; all logic lives in the library)."""

from __future__ import annotations

import json
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
