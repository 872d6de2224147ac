"""The CPU kernel choices the compressors make, each timed against the obvious alternative.

Run:  .venv/bin/python benchmarks/kernel_choices.py [--repeats 7]

Each row times the form the code uses next to the one it avoids, in the same run, with
caches flushed before every repetition; the ratio is avoided / used (above 1: the choice
pays).  On a GPU or another BLAS the answer may differ, which is why the code keeps the
plain form there.

- intquant: float32 -> int64 codes (and back) through int32, against one direct conversion.
- packing: lane-major words (whole contiguous rows reduced), against interleaved words
  (7-element rows reduced).
- PowerSGD ``P Qᵀ`` at ranks 2 and 4 on 2048x1024: rank-1 updates, against one matmul.
- PowerSGD ``M Q`` at ranks 4 and 8: the (r, n) product transposed into place, against
  the (n, r) product.
"""

from __future__ import annotations

import argparse

import torch

from advisor.runtime.timing import CacheFlusher, time_call


def _rows(repeats: int) -> list[tuple[str, str, float, str, float]]:
    flush = CacheFlusher()
    rows = []

    def pair(what: str, used_name: str, used, avoided_name: str, avoided) -> None:
        used_s = time_call(used, repeats=repeats, flush=flush)
        avoided_s = time_call(avoided, repeats=repeats, flush=flush)
        rows.append((what, used_name, used_s, avoided_name, avoided_s))

    values = torch.randn(1 << 20) * 100
    as_int64 = torch.empty(1 << 20, dtype=torch.int64)
    as_int32 = torch.empty(1 << 20, dtype=torch.int32)
    back = torch.empty(1 << 20)
    pair("intquant: float32 -> int64, 1M", "via int32", lambda: as_int64.copy_(as_int32.copy_(values)),
         "direct", lambda: as_int64.copy_(values))
    pair("intquant: int64 -> float32, 1M", "via int32", lambda: back.copy_(as_int32.copy_(as_int64)),
         "direct", lambda: back.copy_(as_int64))

    lanes, words = 7, (1 << 20) // 7
    codes = torch.randint(0, 255, (lanes * words,), dtype=torch.int64)
    shifts = torch.arange(lanes, dtype=torch.int64) * 9
    packed = torch.empty(words, dtype=torch.int64)
    pair("packing: 1M 8-bit codes into words", "lane-major",
         lambda: torch.sum(codes.view(lanes, words) << shifts[:, None], dim=0, out=packed),
         "interleaved", lambda: torch.sum(codes.view(words, lanes) << shifts[None, :], dim=1, out=packed))

    n, m = 2048, 1024
    for rank in (2, 4):
        p, qt, out = torch.randn(n, rank), torch.randn(rank, m), torch.empty(n, m)

        def rank_one_updates(p=p, qt=qt, out=out, rank=rank):
            out.zero_()
            for i in range(rank):
                out.addr_(p[:, i], qt[i])

        pair(f"PowerSGD P·Qᵀ, {n}x{m} rank {rank}", "rank-1 updates", rank_one_updates,
             "one matmul", lambda p=p, qt=qt, out=out: torch.mm(p, qt, out=out))
    mat = torch.randn(n, m)
    for rank in (4, 8):
        qt, out, scratch = torch.randn(rank, m), torch.empty(n, rank), torch.empty(rank, n)
        pair(f"PowerSGD M·Q, {n}x{m} rank {rank}", "(r, n) transposed",
             lambda qt=qt, out=out, scratch=scratch: out.copy_(torch.mm(qt, mat.t(), out=scratch).t()),
             "(n, r)", lambda qt=qt, out=out: torch.mm(mat, qt.t(), out=out))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"{'what':38} {'used':>20} {'ms':>7} {'avoided':>14} {'ms':>7} {'avoided/used':>13}")
    for what, used_name, used_s, avoided_name, avoided_s in _rows(args.repeats):
        print(f"{what:38} {used_name:>20} {used_s * 1e3:7.3f} {avoided_name:>14} {avoided_s * 1e3:7.3f} "
              f"{avoided_s / used_s:12.2f}x")


if __name__ == "__main__":
    main()
