"""The advisor command line, through click's CliRunner."""

import json

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
        (["--model", "advisor.workloads"], "write it as 'package.module:function'"),
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
def test_demo_measures_plans_side_by_side(runner):
    result = runner.invoke(main, ["demo", "--steps", "3", "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert data["cluster"]  # says where it ran: emulated network or loopback
    rows = data["rows"]
    labels = [r["label"] for r in rows]
    assert labels[:2] == ["compute only (no communication)", "DDP, no hook"]
    assert "powersgd(rank=4)" in labels
    assert all(r["ms_per_step"] > 0 for r in rows)


def _saved_profile(tmp_path, rate=1e9):
    from test_perfmodel import profile

    prof = profile([(4000 * 4000, 0.04)], rate=rate,
                   kernel_s_per_element={"fp16": (1e-9, 1e-9), "powersgd(rank=4)": (3e-9, 1e-9),
                                         "topk(ratio=0.01)": (5e-9, 1e-9)})
    path = tmp_path / "profile.json"
    prof.save(path)
    return path


def test_whatif_recommends_compression_on_a_slow_link(runner, tmp_path):
    path = _saved_profile(tmp_path)
    result = runner.invoke(main, ["whatif", str(path), "--bandwidth", "100mbit", "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert data["compress"] and data["best"] == "powersgd(rank=4)"


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
