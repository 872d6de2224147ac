"""The advisor inside Lightning and Accelerate: real 2-process launches on CPU (gloo).

Each framework runs one job script (tests/framework_jobs/) that trains several times in the
same two processes; the tests read what every rank wrote.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from events import event_kinds

from advisor.testbed.launch import free_port

JOBS = Path(__file__).parent / "framework_jobs"
ROOT = Path(__file__).parent.parent

needs_lightning = pytest.mark.skipif(importlib.util.find_spec("lightning") is None,
                                     reason="Lightning is not installed (pip install 'compression-advisor[lightning]')")
needs_accelerate = pytest.mark.skipif(importlib.util.find_spec("accelerate") is None,
                                      reason="Accelerate is not installed (pip install 'compression-advisor[accelerate]')")


def _run(command: list[str], out: Path, timeout: float) -> list[dict]:
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK",
                                                             "WORLD_SIZE")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    env["OMP_NUM_THREADS"] = "1"
    done = subprocess.run(command, cwd=out, env=env, capture_output=True, text=True, timeout=timeout)
    ranks = [out / f"rank{r}.json" for r in range(2)]
    if done.returncode != 0 or not all(p.exists() for p in ranks):
        raise AssertionError(f"the job failed (exit {done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}")
    return [json.loads(p.read_text()) for p in ranks]


def _ok(results: list[dict], run: str) -> list[dict]:
    for rank, r in enumerate(results):
        assert r[run]["error"] is None, f"{run}, rank {rank}:\n{r[run]['error']}"
    return [r[run] for r in results]


def _ranks_agree(runs: list[dict]) -> None:
    assert runs[0]["digest"] == runs[1]["digest"], "the ranks ended with different weights"


def _follows(reference: list[dict], runs: list[dict], slack: float) -> None:
    for ref, run in zip(reference, runs):
        assert all(math.isfinite(v) for v in run["losses"]), run["losses"]
        assert abs(run["losses"][-1] - ref["losses"][-1]) <= slack * ref["losses"][0], (ref["losses"], run["losses"])


# --- Lightning ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def lightning_fits(tmp_path_factory):
    out = tmp_path_factory.mktemp("lightning")
    return _run([sys.executable, str(JOBS / "lightning_fit.py"), str(out)], out, timeout=420)


@needs_lightning
@pytest.mark.slow
def test_lightning_plan_none_is_bitwise_lightning_ddp(lightning_fits):
    ddp, none = _ok(lightning_fits, "ddp"), _ok(lightning_fits, "none")
    assert [r["digest"] for r in none] == [r["digest"] for r in ddp]
    assert [r["losses"] for r in none] == [r["losses"] for r in ddp]


@needs_lightning
@pytest.mark.slow
def test_lightning_mixed_plan_trains_like_ddp_on_every_rank(lightning_fits):
    mixed = _ok(lightning_fits, "mixed")
    _ranks_agree(mixed)
    assert all(len(r["labels"]) >= 6 for r in mixed), "the plan should mix the compressor families"
    _follows(_ok(lightning_fits, "ddp"), mixed, slack=0.25)


@needs_lightning
@pytest.mark.slow
def test_lightning_checkpoint_brings_back_the_plan_and_each_ranks_residuals_instead_of_tuning(lightning_fits):
    mixed, resumed = _ok(lightning_fits, "mixed"), _ok(lightning_fits, "resumed")
    for before, after in zip(mixed, resumed):
        assert after["plan"] == before["plan"] and not after["tuned"]
        assert before["residual_norm"] > 0
        assert after["residual_at_start"] == pytest.approx(before["residual_norm"], rel=1e-12)
        assert len(after["losses"]) == 4  # the 4 steps after the checkpoint's 12
    assert mixed[0]["residual_norm"] != mixed[1]["residual_norm"], "residuals are rank-local"
    _ranks_agree(resumed)


@needs_lightning
@pytest.mark.slow
def test_lightning_autotune_under_bf16_mixed_precision_tunes_from_training_step(lightning_fits):
    runs = _ok(lightning_fits, "autotune bf16-mixed")
    _ranks_agree(runs)
    assert runs[0]["advice"] == runs[1]["advice"] and runs[0]["tuned"]
    assert all(math.isfinite(v) for r in runs for v in r["losses"])
    # tuning ran training_step many times, with self.log muted: Lightning saw only the fit's steps
    assert all(r["real_logs"] == len(r["losses"]) for r in runs), [(r["real_logs"], len(r["losses"])) for r in runs]


@needs_lightning
@pytest.mark.slow
def test_lightning_wrap_tunes_online_and_decides_on_every_rank(lightning_fits):
    runs = _ok(lightning_fits, "wrap")
    _ranks_agree(runs)
    for r in runs:
        assert any(e.startswith("decided") for e in r["events"]), r["events"]
    assert event_kinds(runs[0]["events"]) == event_kinds(runs[1]["events"]) and runs[0]["plan"] == runs[1]["plan"]


@needs_lightning
def test_the_callback_refuses_a_strategy_without_ddp_and_bad_arguments():
    from advisor.integrations.lightning import CompressionCallback, _ddp_of

    single = SimpleNamespace(strategy=SimpleNamespace(model=torch.nn.Linear(2, 2)))
    with pytest.raises(ValueError, match="strategy='ddp'"):
        _ddp_of(single)
    with pytest.raises(ValueError, match="exactly one of plan"):
        CompressionCallback()
    with pytest.raises(ValueError, match="tune='online'; allowed: None, 'autotune', 'wrap'"):
        CompressionCallback(tune="online")
    with pytest.raises(ValueError, match="tune_batches=0"):
        CompressionCallback(tune="wrap", tune_batches=0)
    with pytest.raises(ValueError, match=r"options \['trials'\] are for tuning"):
        CompressionCallback(plan="plan.json", trials=5)


# --- Accelerate --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def accelerate_runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("accelerate")
    command = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
               "--num_machines", "1", "--mixed_precision", "bf16", "--dynamo_backend", "no",
               "--main_process_port", str(free_port()), str(JOBS / "accelerate_train.py"), str(out)]
    return _run(command, out, timeout=420)


@needs_accelerate
@pytest.mark.slow
def test_accelerate_plan_none_is_bitwise_accelerate_ddp(accelerate_runs):
    ddp, none = _ok(accelerate_runs, "ddp"), _ok(accelerate_runs, "none")
    assert ddp[0]["ddp"] == "DistributedDataParallel" and ddp[0]["optimizer"] == "AcceleratedOptimizer"
    assert [r["digest"] for r in none] == [r["digest"] for r in ddp]


@needs_accelerate
@pytest.mark.slow
def test_accelerate_mixed_plan_under_bf16_and_accumulation_trains_like_ddp(accelerate_runs):
    mixed = _ok(accelerate_runs, "mixed")
    _ranks_agree(mixed)
    _follows(_ok(accelerate_runs, "ddp"), mixed, slack=0.25)


@needs_accelerate
@pytest.mark.slow
def test_accelerate_save_and_load_state_bring_back_each_ranks_residuals(accelerate_runs):
    for r in _ok(accelerate_runs, "mixed"):
        assert r["restored_weights"]
        assert r["residual_after_more_steps"] != r["saved_residual"]
        assert r["restored_residual"] == pytest.approx(r["saved_residual"], rel=1e-12)
    a, b = _ok(accelerate_runs, "mixed")
    assert a["saved_residual"] != b["saved_residual"], "residuals are rank-local"


@needs_accelerate
@pytest.mark.slow
def test_accelerate_autotune_keeps_the_weights_and_agrees_on_every_rank(accelerate_runs):
    runs = _ok(accelerate_runs, "autotune")
    _ranks_agree(runs)
    assert all(r["weights_kept"] for r in runs)
    assert runs[0]["advice"] == runs[1]["advice"] and runs[0]["plan"] == runs[1]["plan"]


@needs_accelerate
@pytest.mark.slow
def test_accelerate_wrap_tunes_online_and_decides_on_every_rank(accelerate_runs):
    runs = _ok(accelerate_runs, "wrap")
    _ranks_agree(runs)
    assert all(any(e.startswith("decided") for e in r["events"]) for r in runs), runs[0]["events"]


@needs_accelerate
@pytest.mark.slow
def test_accelerate_refuses_a_model_that_was_not_prepared_with_the_way_out(accelerate_runs):
    for r in accelerate_runs:
        assert "pass the model that accelerator.prepare returned" in r["refused"], r["refused"]


@needs_accelerate
def test_accelerate_refuses_a_single_process_accelerator_and_names_the_launch():
    from accelerate import Accelerator

    from advisor.integrations.accelerate import prepared_ddp

    with pytest.raises(ValueError, match=r"runs NO; .*accelerate launch --num_processes N"):
        prepared_ddp(Accelerator(cpu=True), torch.nn.Linear(2, 2))
    with pytest.raises(TypeError, match="expected the Accelerator that prepared the model"):
        prepared_ddp(object(), torch.nn.Linear(2, 2))


@pytest.fixture(scope="module")
def lightning_fsdp_fits(tmp_path_factory):
    out = tmp_path_factory.mktemp("lightning_fsdp")
    return _run([sys.executable, str(JOBS / "lightning_fsdp.py"), str(out)], out, timeout=600)


@needs_lightning
@pytest.mark.slow
def test_lightning_fsdp2_plan_none_is_bitwise_lightnings_own_sharded_training(lightning_fsdp_fits):
    fsdp, none = _ok(lightning_fsdp_fits, "fsdp"), _ok(lightning_fsdp_fits, "none")
    for a, b in zip(fsdp, none):
        assert a["digest"] == b["digest"] and a["losses"] == b["losses"]


@needs_lightning
@pytest.mark.slow
def test_lightning_fsdp2_powersgd_plan_trains_alike_on_every_rank_and_resumes_with_its_residuals(lightning_fsdp_fits):
    saved, resumed = _ok(lightning_fsdp_fits, "powersgd"), _ok(lightning_fsdp_fits, "resumed")
    _ranks_agree(saved)
    _ranks_agree(resumed)
    for s, r in zip(saved, resumed):
        assert s["residual_norm"] > 0
        # the checkpoint's plan comes back instead of a second tuning, with this rank's own residuals
        assert r["plan"] == s["plan"] and not r["tuned"]
        assert r["residual_at_start"] == pytest.approx(s["residual_norm"], rel=1e-6)
    assert saved[0]["residual_norm"] != saved[1]["residual_norm"]  # residuals are each rank's own


@needs_lightning
@pytest.mark.slow
def test_lightning_fsdp2_autotune_tunes_the_sharded_model_on_every_rank(lightning_fsdp_fits):
    runs = _ok(lightning_fsdp_fits, "autotune")
    _ranks_agree(runs)
    assert all(r["tuned"] and r["trial_arms"] >= 2 for r in runs)
    assert runs[0]["advice"] == runs[1]["advice"] and runs[0]["plan"] == runs[1]["plan"]
    if runs[0]["advice"] == "fp32":  # nothing installed: training is Lightning's own, from unchanged weights
        assert runs[0]["digest"] == _ok(lightning_fsdp_fits, "fsdp")[0]["digest"]


@needs_lightning
@pytest.mark.slow
def test_lightning_fsdp2_wrap_tunes_online_and_decides_on_every_rank(lightning_fsdp_fits):
    runs = _ok(lightning_fsdp_fits, "wrap")
    _ranks_agree(runs)
    assert all(r["phase"] == "decided" and r["tuned"] for r in runs)
    assert runs[0]["plan"] == runs[1]["plan"]
    whats = [[e.split(":")[0] for e in r["events"]] for r in runs]  # texts hold each rank's own timings
    assert whats[0] == whats[1] and whats[0][0] == "profiled"
