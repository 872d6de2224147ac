"""The advisor's plan against PyTorch's own hooks, measured side by side in one run.

Run (root, iproute2):  .venv/bin/python benchmarks/end_to_end.py [--ranks 2,4] [--rates ...] [--models ...]
(the same as ``advisor bench``; the logic lives in ``advisor/bench.py``).

For each world size, link rate and model, in one job on an emulated cluster: autotune runs
(its wall time on the cluster is reported), then the compute-only floor, DDP fp32, PyTorch's
fp16_compress_hook, PyTorch's PowerSGD hook with the whole model in one bucket at rank 1 and
rank 4, and the advisor's installed plan are measured in interleaved rounds on the same
ranks.  Targets (issue 5): at 1 Gbit/s on the MLP the advisor's plan >= 2x faster than the
fp16 hook and >= 1.2x faster than the best PowerSGD setting; unshaped, never more than 3%
slower than the best baseline; autotune <= 90 s.
"""

import sys

from advisor.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", *sys.argv[1:]]))
