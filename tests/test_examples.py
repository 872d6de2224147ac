"""The examples run as documented."""

import importlib.util
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


def _plan_file(tmp_path) -> str:
    from advisor.runtime import Plan

    path = tmp_path / "plan.json"
    Plan.uniform("fp16").save(path)
    return str(path)


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("lightning") is None,
                    reason="Lightning is not installed (pip install 'compression-advisor[lightning]')")
def test_the_lightning_example_installs_a_saved_plan(tmp_path):
    out = subprocess.run([sys.executable, "examples/train_lightning.py", "--plan", _plan_file(tmp_path),
                          "--steps", "8"], cwd=ROOT, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT})
    assert out.returncode == 0, out.stderr[-3000:]
    assert "plan in use: fp16" in out.stdout


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("accelerate") is None,
                    reason="Accelerate is not installed (pip install 'compression-advisor[accelerate]')")
def test_the_accelerate_example_installs_a_saved_plan(tmp_path):
    from advisor.testbed.launch import free_port

    out = subprocess.run([sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
                          "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
                          "--main_process_port", str(free_port()), "examples/train_accelerate.py",
                          "--plan", _plan_file(tmp_path), "--steps", "8"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT})
    assert out.returncode == 0, out.stderr[-3000:]
    assert "plan in use: fp16" in out.stdout and "step 0: loss" in out.stdout
