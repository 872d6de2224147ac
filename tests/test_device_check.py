"""The device check, ready for the lent GPU machine: its wheels are complete, and its CPU dry run passes
importing only what that machine has."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

import device_wheels  # noqa: E402

NO_WHEELS = "no wheels in .whl/: `make test` fetches them (make device-wheels)"


def test_the_carried_wheels_meet_every_requirement_on_the_machine():
    assert list(device_wheels.WHEELS.glob("*.whl")), NO_WHEELS
    problems = device_wheels.check()
    assert problems == [], problems
    carried = {device_wheels.wheel_metadata(p)[0] for p in device_wheels.WHEELS.glob("*.whl")}
    assert "optuna" in carried, "the machine has no optuna: it must travel as a wheel"
    assert not carried & device_wheels.device_packages(), "nothing the machine has is carried again"


def test_the_wheel_check_names_a_requirement_nobody_meets(tmp_path):
    wheels = sorted(device_wheels.WHEELS.glob("*.whl"))
    assert wheels, NO_WHEELS
    optuna = next(p for p in wheels if p.name.startswith("optuna-"))
    (tmp_path / optuna.name).write_bytes(optuna.read_bytes())
    problems = device_wheels.check(tmp_path)
    assert any("needs sqlalchemy" in p and "neither carried nor on the machine" in p for p in problems), problems


@pytest.mark.slow
def test_the_dry_run_passes_every_check_that_needs_no_gpu_and_skips_the_rest(tmp_path):
    assert list(device_wheels.WHEELS.glob("*.whl")), NO_WHEELS
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "OUT")}
    env.update(OUT=str(tmp_path), PYTHON=sys.executable)
    # the smallest bundled model and three of the option matrix's cases (test_options runs its own
    # matrix, compiling with aot_eager; inductor is checked only here): the dry run checks the path,
    # the GPU run autotunes the text LM under every case
    done = subprocess.run(["bash", str(ROOT / "benchmarks" / "device_check.sh"), "--dry-run", "--repeats", "2",
                           "--models", "digits", "--cases", "fp32,GradScaler,compile"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads((tmp_path / "device_check.json").read_text())
    status = {line["check"]: line["status"] for line in report["lines"]}
    assert report["passed"] and report["device"] == "cpu"
    assert status["imports"] == "PASS" and status["autotune digits"] == "PASS"
    assert status["NCCL, world size 1"] == "SKIP" and status["matrix, SyncBatchNorm"] == "SKIP"
    assert status["sharded comms, world size 1 on gloo"] == "PASS"
    assert [c for c, s in status.items() if s == "PASS" and c.startswith("matrix, ")] == [
        "matrix, fp32", "matrix, fp16 autocast + GradScaler (overflows at first)", "matrix, torch.compile(ddp), inductor"]
    assert not [c for c, s in status.items() if s == "FAIL"]


def test_the_dry_run_refuses_an_import_the_machine_lacks(tmp_path):
    guard = ROOT / "benchmarks" / "device_dry_run"
    listing = tmp_path / "packages.txt"
    listing.write_text("torch\nnumpy\n")
    env = {**os.environ, "PYTHONPATH": str(guard), "ADVISOR_DEVICE_PACKAGES": str(listing)}
    done = subprocess.run([sys.executable, "-c", "import numpy; import rich"], env=env, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode != 0 and "'rich'" in done.stderr and "not on the device machine" in done.stderr
