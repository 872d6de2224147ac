"""Encode+decode cost of every compressor config, next to a plain copy and PyTorch's own maths.

Run:  .venv/bin/python benchmarks/compressors.py [--sizes 1M,16M] [--repeats 5] [--json out.json]

For each bucket (1M elements: one 1024x1024 matrix; 16M: four 2048x2048 matrices) it
prints the median encode and decode time of each config (error feedback on where it is
the default, world size 2 for the decode of all-gathered payloads), its throughput in
input GB/s, and its throughput as a fraction of a plain fp32 copy of the same bucket (the
memory-bandwidth reference).  Caches are flushed before every timed repetition, of the
copy and of the codecs alike, so the copy measures memory bandwidth (a 4 MiB bucket
otherwise copies from L2/L3 at several times DRAM speed); the "hot" columns repeat the
measurement without flushing.  Targets are judged on the flushed (memory) numbers.
Then PowerSGD against PyTorch's own PowerSGD maths on the same matrices, and top-k
against ``torch.topk`` on the same tensor.  All in one run, so
the ratios compare like with like on a noisy machine.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from advisor.compressors import SegmentLayout, parse
from advisor.compressors.sparse import kept_count
from advisor.runtime.timing import CacheFlusher, measure, time_call

CONFIGS = [
    "none", "fp16", "bf16",
    "powersgd(rank=1)", "powersgd(rank=4)",
    "topk(ratio=0.01)", "randomk(ratio=0.01)",
    "qsgd(bits=8)", "qsgd(bits=4)", "qsgd(bits=2)",
    "intquant(bits=8)", "intquant(bits=4)", "intquant(bits=8, packed=0)", "intquant(bits=4, packed=0)",
    "signsgd",
]

BUCKETS = {
    "1M": SegmentLayout(("fc.weight",), ((1024, 1024),)),
    "16M": SegmentLayout(tuple(f"layer{i}.weight" for i in range(4)), ((2048, 2048),) * 4),
}

TARGETS = {
    "fp16": ("copy", 0.40), "bf16": ("copy", 0.40),
    "qsgd(bits=8)": ("copy", 0.20), "intquant(bits=8)": ("copy", 0.20),
    "intquant(bits=8, packed=0)": ("copy", 0.20),
}


def torch_powersgd_maths(matrices: list[torch.Tensor], qs: list[torch.Tensor]):
    """PyTorch's PowerSGD hook maths for one step, with its error feedback, on our matrices.

    The same calls ``powerSGD_hook`` makes (its ``_orthogonalize`` included), without the
    communication: M += error, P = MQ, orthogonalise P, Q = MᵀP, M ≈ PQᵀ, error = input - M.
    """
    from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import _orthogonalize

    errors = [torch.zeros_like(m) for m in matrices]

    def run():
        for m, q, err in zip(matrices, qs, errors):
            m.add_(err)  # the hook adds the previous error first
            saved = m.clone()  # input_tensor_cp, kept for error feedback
            p = torch.matmul(m, q)
            _orthogonalize(p.unsqueeze(0))
            torch.matmul(m.t(), p, out=q)
            approx = torch.matmul(p, q.t())
            saved.sub_(approx)  # the error the hook stores

    return run


def bench_bucket(label: str, layout: SegmentLayout, repeats: int) -> dict:
    x = torch.randn(layout.numel)
    dst = torch.empty_like(x)
    flush = CacheFlusher()
    copy_s = time_call(lambda: dst.copy_(x), repeats=repeats, flush=flush)
    copy_hot_s = time_call(lambda: dst.copy_(x), repeats=repeats)
    rows = []
    for spec in CONFIGS:
        comp = parse(spec).build()
        t = measure(comp, layout, world_size=2, repeats=repeats, grad=x, flush=flush)
        hot = measure(comp, layout, world_size=2, repeats=repeats, grad=x)
        rows.append({
            "config": spec,
            "encode_ms": t.encode_s * 1e3,
            "decode_ms": t.decode_s * 1e3,
            "total_ms": t.total_s * 1e3,
            "gb_per_s": layout.numel * 4 / t.total_s / 1e9,
            "of_copy": copy_s / t.total_s,
            "hot_total_ms": hot.total_s * 1e3,
            "hot_of_copy": copy_hot_s / hot.total_s,
            "wire_bytes": t.wire_bytes,
            "ratio": layout.numel * 4 / t.wire_bytes,
        })
    refs = {}
    for rank in (1, 4):
        mats = [v.clone() for v in layout.views(x)]
        qs = [torch.randn(s[1], rank) for s in layout.shapes]
        refs[f"torch powersgd(rank={rank})"] = time_call(torch_powersgd_maths(mats, qs), repeats=repeats, flush=flush)
    k = kept_count(layout.numel, 0.01)
    refs["torch.topk(1%)"] = time_call(lambda: torch.topk(x.abs(), k, sorted=False), repeats=repeats, flush=flush)
    return {"bucket": label, "numel": layout.numel, "copy_ms": copy_s * 1e3, "copy_hot_ms": copy_hot_s * 1e3,
            "rows": rows, "references_ms": {k: v * 1e3 for k, v in refs.items()}}


def report(results: list[dict]) -> list[str]:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    verdicts = []
    for res in results:
        table = Table(title=f"{res['bucket']} elements ({res['numel']:,}): copy {res['copy_ms']:.2f} ms from memory, "
                            f"{res['copy_hot_ms']:.2f} ms from cache; threads={torch.get_num_threads()}")
        for col in ("config", "encode ms", "decode ms", "total ms", "GB/s", "x copy", "hot total ms", "hot x copy",
                    "wire ratio"):
            table.add_column(col, justify="right" if col != "config" else "left", no_wrap=col == "config")
        by = {}
        for r in res["rows"]:
            by[r["config"]] = r
            table.add_row(r["config"], f"{r['encode_ms']:.2f}", f"{r['decode_ms']:.2f}", f"{r['total_ms']:.2f}",
                          f"{r['gb_per_s']:.2f}", f"{r['of_copy']:.2f}", f"{r['hot_total_ms']:.2f}",
                          f"{r['hot_of_copy']:.2f}", f"{r['ratio']:.1f}")
        console.print(table)
        refs = res["references_ms"]
        for spec, (_, need) in TARGETS.items():
            got = by[spec]["of_copy"]
            verdicts.append(f"{res['bucket']} {spec}: {got:.0%} of copy throughput (target >= {need:.0%}) "
                            f"{'PASS' if got >= need else 'FAIL'}")
        for rank in (1, 4):
            ours = by[f"powersgd(rank={rank})"]["total_ms"]
            theirs = refs[f"torch powersgd(rank={rank})"]
            verdicts.append(f"{res['bucket']} powersgd rank {rank}: ours {ours:.2f} ms vs PyTorch {theirs:.2f} ms "
                            f"= {theirs / ours:.2f}x (target >= 1) {'PASS' if ours <= theirs else 'FAIL'}")
        ours = by["topk(ratio=0.01)"]["total_ms"]
        theirs = refs["torch.topk(1%)"]
        verdicts.append(f"{res['bucket']} topk 1%: ours (encode+decode) {ours:.2f} ms vs torch.topk alone "
                        f"{theirs:.2f} ms = {theirs / ours:.2f}x (target >= 1) {'PASS' if ours <= theirs else 'FAIL'}")
    for v in verdicts:
        console.print(v)
    return verdicts


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1M,16M", help="comma-separated subset of: " + ", ".join(BUCKETS))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args(argv)
    # small buckets take microseconds: repeat them more so the median is stable
    results = [
        bench_bucket(s, BUCKETS[s], args.repeats * max(1, min(8, (1 << 24) // BUCKETS[s].numel)))
        for s in args.sizes.split(",")
    ]
    verdicts = report(results)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"results": results, "verdicts": verdicts, "threads": torch.get_num_threads()}, fh, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
