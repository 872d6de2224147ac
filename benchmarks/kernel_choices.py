"""The compressors' kernel forms timed on this device, and the form the kernel profiler would choose.

Run:  .venv/bin/python benchmarks/kernel_choices.py [--repeats 7] [--device cpu]

Each kernel choice (:mod:`advisor.compressors.forms`) is timed in both its forms, in the same
run, with CPU caches flushed before every repetition (:func:`profilers.kernels.time_forms`,
what ``advisor profile`` and ``autotune`` run on the real device); the chosen form is the
faster one where it beats the default by more than the margin, else the default.  One
layout choice that is not a form (it is the same on every device) is timed beside them:
lane-major packing of 8-bit codes against interleaved words.
"""

from __future__ import annotations

import argparse

import torch

from advisor.compressors.forms import CHOICE_MARGIN, CHOICES, choose_forms
from advisor.runtime.timing import CacheFlusher, time_call
from profilers.kernels import time_forms


def _packing(repeats: int) -> tuple[float, float]:
    lanes, words = 7, (1 << 20) // 7
    codes = torch.randint(0, 255, (lanes * words,), dtype=torch.int64)
    shifts = torch.arange(lanes, dtype=torch.int64) * 9
    packed = torch.empty(words, dtype=torch.int64)
    flush = CacheFlusher()
    lane_major = time_call(lambda: torch.sum(codes.view(lanes, words) << shifts[:, None], dim=0, out=packed),
                           repeats=repeats, flush=flush)
    interleaved = time_call(lambda: torch.sum(codes.view(words, lanes) << shifts[None, :], dim=1, out=packed),
                            repeats=repeats, flush=flush)
    return lane_major, interleaved


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    torch.set_num_threads(1)
    seconds = time_forms(args.device, repeats=args.repeats)
    chosen = choose_forms(seconds)
    print(f"kernel forms on {args.device} (one thread, caches flushed, median of {args.repeats}; a form is chosen "
          f"over the default where it is more than {CHOICE_MARGIN:.0%} faster)")
    print(f"{'choice':24} {'default':>9} {'ms':>7} {'other':>14} {'ms':>7} {'default/other':>14} {'chosen':>14}")
    for name, choice in CHOICES.items():
        other = next(f for f in choice.forms if f != choice.default)
        d, o = seconds[name][choice.default], seconds[name][other]
        print(f"{name:24} {choice.default:>9} {d * 1e3:7.3f} {other:>14} {o * 1e3:7.3f} {d / o:13.2f}x "
              f"{chosen[name]:>14}")
    lane_major, interleaved = _packing(args.repeats)
    print(f"packing 1M 8-bit codes: lane-major {lane_major * 1e3:.3f} ms, interleaved {interleaved * 1e3:.3f} ms "
          f"({interleaved / lane_major:.2f}x; lane-major is used)")


if __name__ == "__main__":
    main()
