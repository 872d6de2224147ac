"""The advisor command line, through click's CliRunner."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from advisor.cli import main, split_configs


@pytest.fixture
def runner():
    return CliRunner()


def test_compressors_lists_the_registry_as_json(runner):
    result = runner.invoke(main, ["compressors", "--json"])
    assert result.exit_code == 0
    data = json.loads(result.output)
    assert data["powersgd"] == {"rank": "an integer >= 1"}


def test_compressors_prints_a_table(runner):
    result = runner.invoke(main, ["compressors"])
    assert result.exit_code == 0 and "intquant" in result.output


def test_config_lists_keep_commas_inside_parentheses():
    assert split_configs("fp16, intquant(bits=8, packed=0),topk:0.01") == ["fp16", "intquant(bits=8, packed=0)", "topk:0.01"]


@pytest.mark.parametrize(
    "args,reason",
    [
        (["--model", "no_such_pkg:f"], "model factory 'no_such_pkg:f' does not import"),
        (["--model", "advisor.testbed.workloads"], "write it as 'package.module:function'"),
        (["--model", "advisor.workloads:nothing"], "has no callable 'nothing'"),
        (["--model", "advisor.workloads:mlp", "--configs", "zip"], "unknown compressor 'zip'"),
        (["--model", "advisor.workloads:mlp", "--rate", "fast"], "cannot read rate 'fast'"),
        (["--model", "advisor.workloads:mlp", "--nproc", "0"], "--nproc=0"),
    ],
)
def test_profile_refuses_bad_input_with_exit_code_2_and_one_line(runner, args, reason):
    result = runner.invoke(main, ["profile", *args])
    assert result.exit_code == 2
    assert reason in result.output
    assert len(result.output.strip().splitlines()) == 1


@pytest.mark.slow
def test_profile_writes_a_profile_and_prints_json(runner, tmp_path):
    out = tmp_path / "p.json"
    result = runner.invoke(
        main,
        ["profile", "--model", "advisor.workloads:small_cnn", "--nproc", "2", "--no-network", "--no-kernels",
         "--configs", "fp16,qsgd(bits=8)", "--out", str(out), "--json"],
    )
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert data["kind"] == "compression-advisor/cluster-profile"
    assert {e["config"] for e in data["fidelity"]["entries"]} == {"fp16", "qsgd(bits=8)"}
    assert out.exists()


@pytest.mark.slow
def test_demo_autotunes_and_prints_the_advice_as_json(runner):
    # a run of 5,000 steps: its 2% buys a trial too short to prove a compressed plan, which the
    # evidence must then say (the default run's trial takes a minute more)
    result = runner.invoke(main, ["demo", "--steps", "2", "--rounds", "2", "--run-steps", "5000", "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert data["kind"] == "compression-advisor/autotune-result"
    assert data["where"]  # says where it ran: emulated network or loopback
    kinds = {m["kind"] for m in data["measured"]}
    assert {"fp32", "16-bit"} <= kinds
    assert data["recommendation"] in {m["label"] for m in data["measured"]}
    assert data["reason"]
    # the evidence beside the speed-up: the trial's power, and every plan's case
    assert data["accuracy"]["tolerance"] == 0.01 and data["accuracy"]["detectable"] > 0
    assert {e["label"] for e in data["evidence"]} == {m["label"] for m in data["measured"]}
    assert not data["accuracy"]["powered"] and not data["compress"]
    assert data["accuracy"]["steps_needed"] > data["accuracy"]["checkpoints"][-1]
    candidates = [e["status"] for e in data["evidence"] if e["kind"] == "candidate"]
    assert "accepted" not in candidates, data["evidence"]  # (a plan the race did not need is not judged)


def test_demo_refuses_bad_numbers(runner):
    result = runner.invoke(main, ["demo", "--steps", "0"])
    assert result.exit_code == 2 and "--steps=0" in result.output
    result = runner.invoke(main, ["demo", "--run-steps", "-3"])
    assert result.exit_code == 2 and "--run-steps=-3" in result.output


def _tuning_profile_path(tmp_path, rate):
    from constructed import tuning_profile

    path = tmp_path / "profile.json"
    tuning_profile(n_buckets=8, rate=rate).save(path)
    return path


def test_tune_writes_a_plan_that_compresses_on_a_slow_link(runner, tmp_path):
    path = _tuning_profile_path(tmp_path, 1e8)
    out = tmp_path / "plan.json"
    result = runner.invoke(main, ["tune", str(path), "--trials", "200", "--out", str(out), "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert data["speedup_vs_fp32"] > 2 and data["fidelity_error"] <= data["fidelity_budget"] + 1e-9
    from advisor.runtime import Plan

    plan = Plan.load(out)
    assert {plan.config_for(f"l{i}.weight").label for i in range(8)} != {"none"}
    human = runner.invoke(main, ["tune", str(path), "--policy", "greedy", "--out", str(out)])
    assert human.exit_code == 0 and "Predicted best plan" in human.output


def test_tune_what_if_a_fast_network_says_do_nothing(runner, tmp_path):
    path = _tuning_profile_path(tmp_path, 1e8)
    result = runner.invoke(main, ["tune", str(path), "--bandwidth", "100gbit", "--policy", "greedy",
                                  "--out", str(tmp_path / "p.json"), "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["description"] == "none everywhere"


@pytest.mark.parametrize("args, message", [
    (["tune", "missing.json"], "does not exist"),
    (["tune", "{profile}", "--candidates", "zstd"], "unknown compressor"),
    (["tune", "{profile}", "--budget", "-1"], "budget=-1"),
    (["tune", "{profile}", "--reference", "signsgd"], "reference config 'signsgd'"),
])
def test_tune_bad_input_exits_2_with_one_line(runner, tmp_path, args, message):
    path = _tuning_profile_path(tmp_path, 1e9)
    result = runner.invoke(main, [a.replace("{profile}", str(path)) for a in args])
    assert result.exit_code == 2, result.output
    assert message in result.output and len(result.output.strip().splitlines()) == 1


def _saved_profile(tmp_path, rate=1e9):
    from test_perfmodel import profile

    prof = profile([(4000 * 4000, 0.04)], rate=rate,
                   kernel_s_per_element={"fp16": (1e-9, 1e-9), "powersgd(rank=4)": (3e-9, 1e-9),
                                         "topk(ratio=0.01)": (5e-9, 1e-9)})
    from profilers.profile import FidelityEntry, FidelityProfile

    errors = {"fp16": 0.001, "powersgd(rank=4)": 0.3, "topk(ratio=0.01)": 0.6}
    prof.fidelity = FidelityProfile(6, 2, [FidelityEntry(b.index, c, e, 1 - e) for b in prof.compute.buckets
                                           for c, e in errors.items()])
    path = tmp_path / "profile.json"
    prof.save(path)
    return path


def test_whatif_names_the_faster_plan_on_a_slow_link_but_advises_the_baseline_until_a_trial_proves_it(runner, tmp_path):
    path = _saved_profile(tmp_path)
    result = runner.invoke(main, ["whatif", str(path), "--bandwidth", "100mbit", "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert data["best"] == "powersgd(rank=4)" and not data["compress"]
    assert data["advice"] == data["best_baseline"] and "no trial has checked its accuracy" in data["verdict"]


def _trial(efficiency: float, status: str = "accepted"):
    """An accuracy trial that ran fp32 twice and PowerSGD rank 4 everywhere at ``efficiency``."""
    from advisor.tuning.accuracy import AccuracyTrialReport, ArmResult
    from policies import accuracy_gate as gate

    report = AccuracyTrialReport(metric="loss", higher_is_better=False, checkpoints=[0, 20, 40, 60], tolerance=0.01,
                                 se=0.002, detectable=0.006, powered=True, steps_needed=40, kappa=5.0, kappa_se=0.5,
                                 progress=0.3, held_out=True, length_reason="powered", seconds=10.0)
    report.arms = [ArmResult("fp32", gate.REFERENCE, "fp32 (native DDP)", [3.0, 2.5], 5.0, True, "", 0.0,
                             efficiency=1.0, efficiency_se=0.0),
                   ArmResult("p4", gate.LADDER, "powersgd(rank=4) everywhere", [3.0, 2.51], 5.0,
                             status == "accepted", "", 0.004, status=status, efficiency=efficiency,
                             efficiency_se=0.03)]
    return report


def test_whatif_advises_a_plan_the_trial_proved_by_its_time_to_accuracy(tmp_path):
    from advisor.perfmodel import Scenario
    from advisor.tuning.whatif import what_if
    from profilers.profile import ClusterProfile

    profile = ClusterProfile.load(_saved_profile(tmp_path))
    slow = Scenario(bandwidth_bps=1e8)
    proven = what_if(profile, slow, accuracy=_trial(0.95))
    row = next(r for r in proven.rows if r.config == "powersgd(rank=4)")
    base = next(r for r in proven.rows if r.config == proven.best_baseline)
    assert proven.compress and proven.advice == "powersgd(rank=4)" and "compress with" in proven.verdict
    assert row.to_accuracy == pytest.approx(base.predicted_s / row.predicted_s * 0.95)
    assert 1 < row.to_accuracy_low < row.to_accuracy
    inefficient = what_if(profile, slow, accuracy=_trial(0.05))  # 20x fewer fp32 steps' worth per step
    assert not inefficient.compress and inefficient.advice == inefficient.best_baseline
    assert "not shown faster" in inefficient.verdict
    rejected = what_if(profile, slow, accuracy=_trial(0.95, "rejected"))
    assert not rejected.compress and "the accuracy trial rejected it" in rejected.verdict


def test_whatif_shows_the_trials_evidence_beside_the_prediction(runner, tmp_path, monkeypatch):
    import advisor.cli as cli

    class Result:
        accuracy = _trial(0.95)

    monkeypatch.setattr(cli.AutotuneResult, "load", staticmethod(lambda path: Result()))
    path = _saved_profile(tmp_path)
    shown = runner.invoke(main, ["whatif", str(path), "--bandwidth", "100mbit", "--result", "r.json"])
    assert shown.exit_code == 0, shown.output
    assert "to accuracy" in shown.output and "accepted" in shown.output and "compress with powersgd" in shown.output


def test_whatif_keeps_to_the_fidelity_budget_and_says_what_no_trial_has_checked(runner, tmp_path):
    path = _saved_profile(tmp_path)
    assumed = json.loads(runner.invoke(main, ["whatif", str(path), "--bandwidth", "100mbit", "--json"]).output)
    assert assumed["budget_source"].startswith("assumed") and not assumed["checked"]
    assert "no trial has checked" in assumed["verdict"]
    assert all(r["within_budget"] for r in assumed["rows"] if r["config"] == assumed["best"])
    strict = json.loads(runner.invoke(main, ["whatif", str(path), "--bandwidth", "100mbit", "--budget", "0",
                                             "--json"]).output)
    assert strict["best"] == "none" and not strict["compress"]
    assert assumed["best"] in strict["over_budget_faster"] and "over the budget" in strict["verdict"]


def test_whatif_says_do_not_compress_on_a_fast_link(runner, tmp_path):
    path = _saved_profile(tmp_path)
    result = runner.invoke(main, ["whatif", str(path), "--bandwidth", "400Gbit", "--world-size", "512"])
    assert result.exit_code == 0, result.output
    assert "do not compress" in result.output


@pytest.mark.parametrize(
    "args,reason",
    [
        (["missing.json"], "does not exist"),
        (["{p}", "--world-size", "0"], "world_size=0; allowed: an integer in 1..1024"),
        (["{p}", "--bandwidth", "fast"], "cannot read rate 'fast'"),
        (["{p}", "--latency", "soon"], "cannot read duration 'soon'"),
    ],
)
def test_whatif_refuses_bad_input_with_exit_code_2(runner, tmp_path, args, reason):
    path = _saved_profile(tmp_path)
    result = runner.invoke(main, ["whatif", *[a.replace("{p}", str(path)) for a in args]])
    assert result.exit_code == 2
    assert reason in result.output


def test_report_explains_a_plan_per_bucket_with_a_timeline(runner, tmp_path):
    path = _tuning_profile_path(tmp_path, 1e8)
    plan_path = tmp_path / "plan.json"
    assert runner.invoke(main, ["tune", str(path), "--policy", "greedy", "--out", str(plan_path)]).exit_code == 0
    result = runner.invoke(main, ["report", str(plan_path), "--profile", str(path), "--png", str(tmp_path / "t.png")])
    assert result.exit_code == 0, result.output
    assert "bucket 0" in result.output and "# on the wire" in result.output and "vs fp32" in result.output
    assert (tmp_path / "t.png").exists()
    data = json.loads(runner.invoke(main, ["report", str(plan_path), "--profile", str(path), "--json"]).output)
    assert len(data["buckets"]) == 8 and data["speedup_vs_fp32"] > 1
    # a tuned plan is a prediction: nothing has trialled it for accuracy, and the report says so
    assert not data["accuracy_checked"] and "no trial has checked" in " ".join(result.output.split())


def test_report_renders_a_profile(runner, tmp_path):
    path = _tuning_profile_path(tmp_path, 1e9)
    result = runner.invoke(main, ["report", str(path)])
    assert result.exit_code == 0 and "Cluster profile" in result.output
    assert "A message round inside a step" not in result.output  # none measured
    doc = json.loads(path.read_text())
    doc["network"]["round_s"] = 0.0021
    path.write_text(json.dumps(doc))
    result = runner.invoke(main, ["report", str(path)])
    assert "A message round inside a step costs 2.10 ms" in result.output


@pytest.mark.parametrize("content, message", [
    (None, "does not exist"),
    ("{not json", "not valid JSON"),
    ('{"kind": "something-else"}', "is not a plan, a cluster profile or an autotune result"),
    ('{"kind": "compression-advisor/plan", "version": 1, "groups": [], "default": {"name": "zstd"}}', "unknown compressor"),
])
def test_report_bad_input_exits_2_with_one_line(runner, tmp_path, content, message):
    path = tmp_path / "x.json"
    if content is not None:
        path.write_text(content)
    result = runner.invoke(main, ["report", str(path)])
    assert result.exit_code == 2, result.output
    assert message in result.output and len(result.output.strip().splitlines()) == 1


def test_report_of_a_plan_needs_a_profile_of_the_same_model(runner, tmp_path):
    path = _tuning_profile_path(tmp_path, 1e9)
    plan = tmp_path / "plan.json"
    from advisor.runtime import Plan

    Plan.from_assignments({"encoder.weight": "fp16"}).save(plan)
    assert "add --profile" in runner.invoke(main, ["report", str(plan)]).output
    result = runner.invoke(main, ["report", str(plan), "--profile", str(path)])
    assert result.exit_code == 2 and "missing from the model" in result.output


@pytest.mark.slow
def test_validate_trains_fp32_16bit_and_a_plan_on_digits(runner, tmp_path):
    from advisor.runtime import Plan

    plan = tmp_path / "plan.json"
    Plan.uniform("powersgd(rank=4)", warmup_steps=5).save(plan)
    # The installed command in its own process, off a terminal: the ranks' stderr is then the
    # command's, whichever process started the rank server (in pytest an earlier test may have).
    advisor = Path(sys.executable).with_name("advisor")
    result = subprocess.run([str(advisor), "validate", "--plan", str(plan), "--steps", "30", "--eval-every", "10",
                             "--json", "--png", str(tmp_path / "c.png")], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    data = json.loads(result.stdout)  # the stages go to stderr
    assert [a["kind"] for a in data["arms"]] == ["fp32", "fp32 (other order)", "16-bit", "plan"]
    assert data["arms"][0]["steps"] == [0, 10, 20, 30]
    # the others train on until they reach fp32's final loss, up to twice the steps
    assert all(a["steps"][:4] == [0, 10, 20, 30] and a["steps"][-1] <= 60 for a in data["arms"])
    assert set(data["time_to_target_s"]) == {"fp32", "fp32 (other order)", "fp16", "plan"}
    assert (tmp_path / "c.png").exists()
    # off a terminal, a line a stage: here the job's, then rank 0's as each arm ends
    assert "rank 0's stages" in result.stderr
    stages = [line.split("s  ", 1)[1] for line in result.stderr.splitlines() if "s  trained " in line]
    assert [line.split(":")[0] for line in stages] == ["trained fp32", "trained fp32 (other order)",
                                                       "trained fp16", "trained plan"]
    assert stages[0].startswith("trained fp32: 30 steps, ") and "held-out loss" in stages[0]
    shown = runner.invoke(main, ["validate", "--plan", str(plan), "--steps", "10", "--eval-every", "5", "--runs", "3"])
    assert shown.exit_code == 0 and "Time-to-accuracy speed-up" in shown.output
    said = " ".join(shown.output.split())
    assert "the two fp32 runs (batch orders) end" in said
    assert "The same comparison in 3 batch orders" in said and "Over 3 orders the plan is" in said


def test_validate_refuses_a_plan_for_another_model(runner, tmp_path):
    plan = tmp_path / "plan.json"
    from advisor.runtime import Plan

    Plan.from_assignments({"encoder.weight": "fp16"}).save(plan)
    result = runner.invoke(main, ["validate", "--plan", str(plan)])
    assert result.exit_code == 2 and "missing from the model" in result.output


@pytest.mark.parametrize("args, message", [
    (["bench", "--ranks", "two"], "--ranks='two'"),
    (["bench", "--rates", "fast"], "cannot read rate"),
    (["bench", "--models", "nosuch.module:f"], "does not import"),
    (["bench", "--run-steps", "0"], "--run-steps=0"),
])
def test_bench_bad_input_exits_2_with_one_line(runner, args, message):
    result = runner.invoke(main, args)
    assert result.exit_code == 2, result.output
    assert message in result.output and len(result.output.strip().splitlines()) == 1


@pytest.mark.slow
def test_bench_measures_the_advisor_next_to_pytorchs_hooks(runner, tmp_path):
    result = runner.invoke(main, ["bench", "--ranks", "2", "--rates", "unshaped", "--models",
                                  "autotune_programs:medium_mlp", "--rounds", "1", "--steps", "2",
                                  "--run-steps", "1000", "--json"])
    assert result.exit_code == 0, result.output
    row = json.loads(result.output)[0]
    from advisor.testbed.bench import SETTINGS

    assert set(row["times_s"]) == set(SETTINGS)
    assert row["result"]["kind"] == "compression-advisor/autotune-result"
    # the matched comparison: tuned again under PowerSGD rank 1's fidelity budget (looser than
    # an assumed rank-4 budget; an earned one may lie either side of it)
    assert row["matched_budget_source"] == "given: the error of powersgd(rank=1) everywhere", row
    if row["result"]["budget_source"].startswith("assumed"):
        assert row["matched_budget"] > row["result"]["fidelity_budget"]
    assert row["matched_fidelity"] <= row["matched_budget"] + 1e-9 and row["matched_advice"]


def test_reports_at_80_columns_never_cut_a_number(runner, tmp_path):
    path = _tuning_profile_path(tmp_path, 1e8)
    plan_path = tmp_path / "plan.json"
    assert runner.invoke(main, ["tune", str(path), "--policy", "greedy", "--out", str(plan_path)]).exit_code == 0
    for args in (["report", str(plan_path), "--profile", str(path)], ["report", str(path)]):
        out = runner.invoke(main, args, env={"COLUMNS": "80"}).output
        assert "…" not in out, out
        assert max(len(line) for line in out.splitlines()) <= 80
    shown = runner.invoke(main, ["report", str(path)], env={"COLUMNS": "80"}).output
    assert "(0.98)" in shown and "0.898" in shown  # every bucket's numbers, in tables that fit
