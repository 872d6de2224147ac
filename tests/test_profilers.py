"""Profilers on real ranks: local processes and the emulated cluster."""

import os
import statistics
import subprocess

import profile_programs as pp
import pytest

from advisor.compressors import parse
from advisor.runtime.timing import measure
from advisor.testbed.emulated import EmulatedCluster, parse_rate, unavailable_reason
from advisor.testbed.jobs import profile_model
from advisor.testbed.launch import RankFailed, launch_local
from profilers.kernels import fit_loglog, square_layout
from profilers.profile import predict_loglog

pytestmark = pytest.mark.slow
NO_TESTBED = unavailable_reason()
needs_testbed = pytest.mark.skipif(NO_TESTBED is not None, reason=NO_TESTBED or "")


def our_namespaces() -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [line.split()[0] for line in out.splitlines() if line.startswith("adv")]


def names_of(cluster) -> set[str]:
    # only this cluster's namespaces: other jobs on the machine may have their own
    return {cluster.switch, *(cluster.host(i) for i in range(cluster.hosts))}


@needs_testbed
# 4 hosts on this machine's 2 cores at 1 Gbit/s are bound by the CPU, not the link (a quiet clean
# run fitted 755 Mbit/s): the fit measures what gloo gets, which that case is not a test of
@pytest.mark.parametrize("hosts, rate", [(2, "100mbit"), (2, "1gbit"), (4, "100mbit")])
def test_fitted_all_reduce_bandwidth_is_within_15_percent_of_the_shaped_rate(hosts, rate):
    with EmulatedCluster(hosts=hosts, rate=rate) as cluster:
        fit = cluster.run(pp.network_only, timeout=120)[0].fits["all_reduce"]
        for _ in range(2):
            if fit.bandwidth_bps >= 0.85 * parse_rate(rate):
                break
            # a busy machine can only slow the ranks, never speed the shaped link: CI once
            # fitted 77 Mbit/s on 4 hosts at 100 Mbit/s, and a full suite 825 Mbit/s twice on
            # 2 hosts at 1 Gbit/s where quiet runs fit 947-960. So a profile below the band is
            # measured again, up to three in all, and the fastest fit is judged.
            again = cluster.run(pp.network_only, timeout=120)[0].fits["all_reduce"]
            fit = max(fit, again, key=lambda f: f.bandwidth_bps)
    assert fit.bandwidth_bps == pytest.approx(parse_rate(rate), rel=0.15), _what_else_runs()
    assert fit.r2 > 0.95
    assert not set(our_namespaces()) & names_of(cluster)


def _what_else_runs() -> str:
    """The load and the busiest processes, so a fit slowed by the machine says by what."""
    try:
        top = subprocess.run(["ps", "-eo", "pcpu,etimes,args", "--sort=-pcpu"], capture_output=True, text=True).stdout
    except OSError as exc:  # a bare machine may lack procps; the load still says something
        top = f"(ps unavailable: {exc})"
    return f"load average {os.getloadavg()}; busiest processes:\n" + "\n".join(top.splitlines()[:8])


def test_cores_are_shared_out_evenly_and_only_when_every_rank_gets_one():
    from advisor.testbed.launch import core_shares

    assert core_shares(2, [0, 1, 2, 3, 4]) == [{0, 1}, {2, 3}]
    assert core_shares(3, [5, 7, 9]) == [{5}, {7}, {9}]
    assert core_shares(4, [0, 1]) is None


@needs_testbed
def test_each_host_of_the_emulated_cluster_runs_on_its_own_cores():
    import os

    from advisor.testbed.launch import core_shares

    if core_shares(2) is None:
        pytest.skip("fewer than 2 cores")
    with EmulatedCluster(hosts=2, rate=None) as cluster:
        cores = cluster.run(pp.rank_cores, timeout=120)
    assert cores[0] and cores[1] and not set(cores[0]) & set(cores[1])
    assert set(cores[0]) | set(cores[1]) <= os.sched_getaffinity(0)


@needs_testbed
def test_namespaces_are_removed_even_when_a_rank_fails():
    with pytest.raises(RankFailed, match="rank 1 failed"):
        with EmulatedCluster(hosts=2, rate="1gbit") as cluster:
            assert names_of(cluster) <= set(our_namespaces())
            cluster.run(pp_fail, timeout=60)
    assert not set(our_namespaces()) & names_of(cluster)


def pp_fail(rank, world_size):
    import profile_programs

    return profile_programs.failing_factory() and None


def test_the_network_profile_records_the_cpu_time_collectives_cost_the_host():
    # over loopback most of an all-reduce is CPU work: gloo's thread and the kernel's
    # copies (measured here: 14 ms of CPU in a 17 ms, 16 MB all-reduce)
    networks = launch_local(pp.loopback_all_reduce, 2, timeout=120)
    fit = networks[0].fits["all_reduce"]
    assert fit.cpu_s_per_byte == networks[1].fits["all_reduce"].cpu_s_per_byte  # the slowest rank's, on both
    assert fit.cpu_s_per_byte > 0
    sixteen_mb = 16 << 20
    assert 0 < fit.cpu_seconds(sixteen_mb) < 4 * fit.predict(sixteen_mb)


def test_a_round_issued_after_compute_is_measured_beyond_the_back_to_back_fit():
    results = launch_local(pp.step_rounds_against, 2, timeout=120)
    assert results[0] == results[1]  # the slowest rank's, on every rank
    against_nothing, against_a_second = results[0]
    # a fit that predicts 0 leaves the whole wait; the wait is real time, so above 0
    assert 0 < against_nothing < 0.5
    # a fit that predicts more than any round took: no extra cost, never a negative one
    assert against_a_second == 0.0


def test_summing_float16_is_measured_dearer_than_float32_per_byte():
    # gloo adds float16 element by element through float: over loopback, where summing
    # rather than the link bounds an all-reduce, that shows (measured here: 2.7x float32)
    results = launch_local(pp.summing_costs, 2, timeout=120)
    assert results[0] == results[1]  # every rank reports the slowest rank's times
    wall, cpu = results[0]
    assert set(wall) == set(cpu) == {"float16", "int64"}
    assert wall["float16"] > 0 and wall["int64"] >= 0
    # the summing is CPU work, measured as such too (a slow link would hide it in wall time)
    assert cpu["float16"] > 0 and cpu["int64"] >= 0


@pytest.mark.parametrize("which", ["mlp", "cnn"])
def test_layer_backward_times_add_up_to_the_measured_backward_time(which):
    results = launch_local(pp.compute_of, 2, (which,), timeout=180)
    for r in results:
        profile = r["profile"]
        total = sum(profile.layer_backward_s.values())
        assert total == pytest.approx(profile.backward_s, rel=0.10)
        assert r["unchanged"] and r["grads_cleared"]  # profiling leaves training state alone
        assert len(profile.backward_s_by_rank) == 2
        assert max(profile.backward_s_by_rank) <= profile.backward_s * 1.0001  # slowest rank sets the pace
    profile = results[0]["profile"]
    # every trainable parameter is in exactly one bucket
    in_buckets = [n for b in profile.buckets for n in b.parameters]
    assert sorted(in_buckets) == sorted(p.name for p in profile.parameters)


@pytest.mark.parametrize("spec", ["fp16", "qsgd(bits=8)", "powersgd(rank=4)", "topk(ratio=0.01)"])
def test_the_kernel_cost_model_fitted_on_live_timings_predicts_a_held_out_size(spec):
    # The accuracy target (25%) is a benchmark (benchmarks/kernel_model.py): on this shared
    # machine a busy neighbour moves single timings by 30-40%.  Here: the live pipeline
    # (measure, fit, predict) lands within a factor of two, which a unit or size mix-up
    # would not (seen under two CPU-bound neighbours: 0.66-1.44).
    comp = parse(spec).build()
    fitted_sizes = [1 << 16, 1 << 18, 1 << 20, 1 << 22]
    held_out = 1 << 21
    sizes = [*fitted_sizes, held_out]
    # interleaved rounds, median per size: a burst of load hits every size alike
    rounds = [[measure(comp, square_layout(n), repeats=5, warmup=1).total_s for n in sizes] for _ in range(4)]
    seconds = [statistics.median(r[i] for r in rounds) for i in range(len(sizes))]
    predicted = float(predict_loglog(fit_loglog(fitted_sizes, seconds[:-1]), held_out))
    assert 0.5 <= predicted / seconds[-1] <= 2.0


def test_profiling_a_model_whose_rank_fails_names_the_rank():
    with pytest.raises(RankFailed, match="rank 1 failed"):
        profile_model("profile_programs:failing_factory", 2, network=False, kernels=False, fidelity=False,
                      timeout=120)


def test_a_model_factory_that_does_not_import_is_refused_before_launching():
    with pytest.raises(ValueError, match="model factory 'no_such_pkg.mod:f' does not import"):
        profile_model("no_such_pkg.mod:f", 2)


@needs_testbed
def test_a_whole_profile_at_1_gbit_fits_in_a_minute_and_round_trips(tmp_path):
    import time

    start = time.monotonic()
    profile = profile_model("advisor.workloads:mlp", 2, rate="1gbit",
                            configs=["fp16", "powersgd(rank=4)", "topk(ratio=0.01)"], timeout=300)
    assert time.monotonic() - start < 90
    assert profile.network.elapsed_s <= 30
    assert 0 <= profile.network.round_s < 0.05  # measured: about 2 ms a round at 1 Gbit/s
    assert profile.environment.world_size == 2 and "1000 Mbit/s" in profile.environment.note
    assert {e.config for e in profile.fidelity.entries} == {"fp16", "powersgd(rank=4)", "topk(ratio=0.01)"}
    fp16 = [e for e in profile.fidelity.entries if e.config == "fp16"]
    assert all(e.relative_error < 1e-2 for e in fp16)
    path = tmp_path / "profile.json"
    profile.save(path)
    from profilers.profile import ClusterProfile

    assert ClusterProfile.load(path) == profile


@needs_testbed
def test_a_terminated_job_still_removes_its_namespaces():
    import signal
    import sys
    import time

    script = (
        "import time\n"
        "from advisor.testbed.emulated import EmulatedCluster\n"
        "with EmulatedCluster(hosts=2, rate='1gbit') as c:\n"
        "    print(c.switch, flush=True)\n"
        "    time.sleep(60)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    switch = proc.stdout.readline().strip()
    assert switch in our_namespaces()
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=30)
    time.sleep(0.2)
    assert switch not in our_namespaces()


def test_adam_like_optimizers_prefer_bf16_gradients_and_sgd_fp16():
    import torch

    from profilers.training_state import preferred_sixteen_bit, scales_per_coordinate

    params = [torch.nn.Parameter(torch.ones(3))]
    assert preferred_sixteen_bit(torch.optim.AdamW(params)) == "bf16"
    assert preferred_sixteen_bit(torch.optim.RMSprop(params)) == "bf16"
    assert preferred_sixteen_bit(torch.optim.SGD(params, lr=0.1, momentum=0.9)) == "fp16"
    assert preferred_sixteen_bit(None) == "fp16"

    class HomeMadeAdam(torch.optim.SGD):  # recognised by the state it keeps, whatever its name
        pass

    custom = HomeMadeAdam(params, lr=0.1)
    assert not scales_per_coordinate(custom)
    custom.state[params[0]]["exp_avg_sq"] = torch.zeros(3)
    assert scales_per_coordinate(custom)


def test_a_network_profile_is_reused_only_where_every_rank_still_holds_a_fresh_one():
    from advisor.testbed.launch import launch_local

    for r in launch_local(pp.network_reuse, 2, timeout=120):
        assert r["same"] and r["reuse_s"] < 0.5, r
        assert r["third_measured"], "rank 0 had no profile left, so every rank measures again"


def test_the_update_error_through_plain_sgd_is_the_gradient_error_and_adam_amplifies_it():
    """Plain SGD's updates are linear in the gradients, so their error is the gradients' error;
    Adam divides by each coordinate's second moment, and the same compressed stream misses by more."""
    import torch

    from advisor.compressors import SegmentLayout
    from profilers.fidelity import UpdateReplay, replay

    torch.manual_seed(0)
    weight = torch.nn.Parameter(torch.randn(32, 16))
    before = weight.detach().clone()
    layout = SegmentLayout(("weight",), ((32, 16),))
    grads = [torch.randn(512) * (1 + torch.arange(512) % 7) for _ in range(6)]
    for optimizer, same in ((torch.optim.SGD([weight], lr=0.1), True), (torch.optim.Adam([weight], lr=1e-3), False)):
        update = UpdateReplay(optimizer, [weight])
        assert replay("none", layout, grads, update)[::2] == (0.0, 0.0), "an exact exchange changes nothing"
        error, _, update_error = replay("powersgd(rank=1)", layout, grads, update)
        assert error > 0.05
        if same:
            assert update_error == pytest.approx(error, rel=1e-6)
        else:
            assert update_error > 1.1 * error, (update_error, error)
    assert torch.equal(weight.detach(), before) and weight.grad is None, "the replay steps copies only"
