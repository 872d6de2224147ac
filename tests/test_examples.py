"""The examples run as documented."""

import os
import subprocess
import sys

import pytest

from examples import models

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("factory", ["cnn", "transformer_lm", "embedding_heavy"])
def test_example_models_train_a_step(factory):
    workload = getattr(models, factory)()
    batch = next(iter(workload.batches))
    loss = workload.loss_fn(workload.model, batch)
    loss.backward()
    assert all(p.grad is not None for p in workload.model.parameters())


@pytest.mark.slow
def test_quickstart_runs_and_prints_the_advice():
    out = subprocess.run([sys.executable, "examples/quickstart.py"], cwd=ROOT, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "Advice" in out.stdout and "Why:" in out.stdout


@pytest.mark.slow
def test_torchrun_script_tunes_online_with_wrap():
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                          "examples/train_torchrun.py", "--model", "cnn", "--mode", "wrap", "--steps", "60"],
                         cwd=ROOT, capture_output=True, text=True, timeout=600,
                         env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT})
    assert out.returncode == 0, out.stderr[-3000:]
    assert "advisor, step" in out.stdout and "decided" in out.stdout
