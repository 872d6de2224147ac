#!/usr/bin/env bash
# The CUDA/NCCL checks in one call, one line each (see device_check.py), with the python3 and
# torch the machine has: nothing is built, nothing is fetched from a network.
#   on the lent GPU machine:  bash benchmarks/device_check.sh            (carry .whl: make device-wheels)
#   here, a dry run on CPU:   bash benchmarks/device_check.sh --dry-run  (imports only what that machine has)
# Results: one line per check on stdout, and device_check.json in $OUT (else .device-out/).
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
dry=0
if [ "${1:-}" = "--dry-run" ]; then dry=1; shift; fi
py=${PYTHON:-python3}
if [ $dry = 1 ] && [ -z "${PYTHON:-}" ] && [ -x .venv/bin/python ]; then py=.venv/bin/python; fi
site=$root/.device-site
rm -rf "$site"
# here the wheels are the machine's (CPython 3.12): pip installs them as for it, and their
# compiled parts, if any, stay unused (SQLAlchemy, the one carried, runs without them)
target=()
if [ $dry = 1 ]; then target=(--python-version 3.12 --implementation cp --only-binary=:all:); fi
if compgen -G ".whl/*.whl" >/dev/null; then
  "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir "${target[@]}" --target "$site" .whl/*.whl
fi
path="$site:$root"
device=${DEVICE:-cuda}
if [ $dry = 1 ]; then
  export ADVISOR_DEVICE_PACKAGES=$root/benchmarks/device_packages.txt ADVISOR_DEVICE_SITE=$site
  path="$root/benchmarks/device_dry_run:$path"
  device=cpu
fi
export PYTHONPATH="$path${PYTHONPATH:+:$PYTHONPATH}"
exec "$py" benchmarks/device_check.py --device "$device" --out "${OUT:-$root/.device-out}" "$@"
