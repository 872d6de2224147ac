#!/usr/bin/env bash
# The CUDA/NCCL checks on a machine with a GPU, one line per check (see device_check.py).
# Installs like `make install` first, so it runs on a fresh machine too.
set -euo pipefail
cd "$(dirname "$0")/.."
make --no-print-directory install >/dev/null
exec .venv/bin/python benchmarks/device_check.py --device "${DEVICE:-cuda}" "$@"
