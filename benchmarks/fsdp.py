"""Sharded training (FSDP2): each reduce-scatter the advisor can install, per step, side by side.

Per link rate, one job on the emulated cluster (2 ranks by default): a pre-norm transformer LM on
the Python standard library's text (8192-word vocabulary, one ``fully_shard`` per block plus the
root), built once per setting from the same seed, then interleaved rounds of training steps on the
same batches, the setting order rotating:

* FSDP fp32, gloo's own reduce-scatter (an all-reduce of the whole buffer: about twice the bytes),
  and the same again (the noise of the comparison);
* FSDP fp32 through the exact all-to-all reduce-scatter (``ExactReduceScatter``): the fair baseline;
* ``MixedPrecisionPolicy(reduce_dtype=bfloat16)``: FSDP's own 16-bit baseline;
* the advisor's bf16 and int8 reduce-scatters (``install_sharded``).

Printed: the median ms/step of each, each against the best exact baseline, the noise, and the
held-out loss each reached (every setting trains the same steps, so a lossy one shows its cost).

Usage: python benchmarks/fsdp.py [--rates 100mbit,1gbit] [--ranks 2] [--rounds 4] [--steps 3]
[--dim 512] [--layers 6]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

SETTINGS = ("fp32, gloo reduce-scatter", "fp32, gloo reduce-scatter (again)", "fp32, exact all-to-all",
            "reduce_dtype=bf16", "advisor bf16", "advisor int8")


def _model(dim: int, layers: int, setting: str):
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from advisor.runtime import Plan
    from advisor.runtime.sharded import ExactReduceScatter, install_sharded, sharded_groups
    from advisor.testbed.workloads import _TextLM

    torch.manual_seed(0)
    model = _TextLM(vocab=8192, dim=dim, layers=layers, heads=dim // 64)
    kwargs = {"mp_policy": MixedPrecisionPolicy(reduce_dtype=torch.bfloat16)} if setting == "reduce_dtype=bf16" else {}
    for layer in model.blocks.layers:
        fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)
    if setting == "fp32, exact all-to-all":
        for _, module, _ in sharded_groups(model):
            module.set_custom_reduce_scatter(ExactReduceScatter())
    elif setting.startswith("advisor"):
        install_sharded(model, Plan.uniform("bf16" if setting.endswith("bf16") else "intquant(bits=8)",
                                            warmup_steps=0))
    return model


def bench_rank(rank: int, world: int, dim: int, layers: int, rounds: int, steps: int):
    from advisor.core.collectives import slowest
    from advisor.testbed.workloads import TEXT_CONTEXT, _next_token_loss, _windows, stdlib_text_corpus

    train, held = stdlib_text_corpus(vocab=8192)
    windows = torch.stack(_windows(train, 1, TEXT_CONTEXT))[:, 0]
    batches = list(windows[: len(windows) // 8 * 8].split(8))[rank::world]
    held_out = _windows(held, 16, TEXT_CONTEXT)[:2]
    models = {s: _model(dim, layers, s) for s in SETTINGS}
    optimizers = {s: torch.optim.AdamW(m.parameters(), lr=1e-3) for s, m in models.items()}
    params = sum(p.numel() for p in models[SETTINGS[0]].parameters())  # DTensors: numel() is the global size
    times = {s: [] for s in SETTINGS}
    step = 0

    def train_step(setting: str, i: int) -> None:
        optimizers[setting].zero_grad()
        _next_token_loss(models[setting], batches[i % len(batches)]).backward()
        optimizers[setting].step()

    for setting in SETTINGS:  # warm-up: lazy init and the first all-gathers
        train_step(setting, 0)
    for r in range(rounds):
        order = SETTINGS[r % len(SETTINGS):] + SETTINGS[: r % len(SETTINGS)]
        local = []
        for setting in order:
            t0 = time.perf_counter()
            for k in range(steps):
                train_step(setting, step + k)
            local.append((time.perf_counter() - t0) / steps)
        step += steps
        for setting, seconds in zip(order, slowest(local)):
            times[setting].append(seconds)
    with torch.no_grad():
        held = {s: statistics.mean(float(_next_token_loss(m, b)) for b in held_out) for s, m in models.items()}
    return {"times": times, "held_out": held, "params": params, "steps": 1 + rounds * steps}


def main(argv=None) -> int:
    from advisor.testbed.emulated import EmulatedCluster, unavailable_reason

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rates", default="100mbit,1gbit")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--layers", type=int, default=6)
    args = parser.parse_args(argv)
    why = unavailable_reason()
    if why is not None:
        print(f"needs the emulated cluster: {why}", file=sys.stderr)
        return 2
    for rate in args.rates.split(","):
        with EmulatedCluster(hosts=args.ranks, rate=rate) as cluster:
            out = cluster.run(bench_rank, (args.dim, args.layers, args.rounds, args.steps), timeout=3000)[0]
        med = {s: statistics.median(v) for s, v in out["times"].items()}
        noise = abs(med[SETTINGS[1]] / med[SETTINGS[0]] - 1)
        best_exact = min(med["fp32, gloo reduce-scatter"], med["fp32, exact all-to-all"])
        print(f"\n{args.ranks} ranks @ {rate}: transformer LM, {out['params'] / 1e6:.1f}M parameters, "
              f"{args.layers + 1} fully_shard groups, {out['steps']} steps each (interleaved rounds of {args.steps})")
        print(f"{'setting':36s} {'ms/step':>9s} {'vs best exact fp32':>19s} {'held-out loss':>14s}")
        for s in SETTINGS:
            print(f"{s:36s} {med[s] * 1e3:9.0f} {best_exact / med[s]:18.2f}x {out['held_out'][s]:14.4f}")
        print(f"noise: the same setting twice differs by {noise:.1%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
