"""The performance model on constructed profiles whose answers are known by hand."""

import dataclasses
import json
import math

import numpy as np
import pytest

from advisor.perfmodel import PerformanceModel, Scenario, Timeline
from advisor.runtime import Plan
from profilers.network import fit_collective
from profilers.profile import (
    Bucket,
    ClusterProfile,
    ComputeProfile,
    Environment,
    KernelCost,
    KernelProfile,
    NetworkProfile,
    ParameterTiming,
)

MS = 1e-3


def linear_knots(seconds_per_element: float) -> list[list[float]]:
    """Knots of t = c·n (a straight line in log-log space with slope 1)."""
    return [[math.log(n), math.log(seconds_per_element * n)] for n in (1e3, 1e8)]


def network(latency_s: float, rate_bps: float, world: int) -> NetworkProfile:
    sizes = [4096 * 2**k for k in range(12)]
    fits = {}
    for name, hops, factor in (("all_reduce", 2 * (world - 1), 2 * (world - 1) / world),
                               ("all_gather", world - 1, world - 1)):
        points = [(b, hops * latency_s + factor * 8 * b / rate_bps) for b in sizes]
        fits[name] = fit_collective(name, world, points)
    return NetworkProfile(fits, 1.0)


def profile(buckets, forward=10 * MS, backward=40 * MS, optimizer=2 * MS, world=2,
            latency=0.0, rate=1e9, kernel_s_per_element=None) -> ClusterProfile:
    """``buckets``: [(numel, ready_s)]; one square-ish parameter per bucket."""
    params, bucket_list = [], []
    for i, (numel, ready) in enumerate(buckets):
        side = int(math.isqrt(numel))
        params.append(ParameterTiming(f"l{i}.weight", f"l{i}", side * side, [side, side], ready))
        bucket_list.append(Bucket(i, [f"l{i}.weight"], side * side))
    costs = {}
    for label, per_element in (kernel_s_per_element or {}).items():
        costs[label] = KernelCost(label, [], linear_knots(per_element[0]), linear_knots(per_element[1]), world)
    return ClusterProfile(
        environment=Environment(world, "gloo", "cpu", "x", "x", ["h"] * world, 1, "now"),
        compute=ComputeProfile(forward, backward, optimizer, 1, params, {}, bucket_list),
        network=network(latency, rate, world),
        kernels=KernelProfile("cpu", costs),
    )


def test_one_bucket_at_the_end_of_backward_exposes_all_its_communication():
    numel = 1000 * 1000  # 4 MB fp32
    prof = profile([(numel, 40 * MS)], kernel_s_per_element={"fp16": (1e-9, 2e-9)})
    model = PerformanceModel(prof)
    t = model.predict(Plan.uniform("fp16", warmup_steps=0))
    enc, dec = 1e-9 * numel, 2e-9 * numel
    comm = 2 * (2 - 1) / 2 * 8 * (numel + 1) * 2 / 1e9  # ring, 2 ranks, fp16 payload + flag
    expected = 10 * MS + 40 * MS + enc + comm + dec + 2 * MS
    assert t.iteration_s == pytest.approx(expected, rel=0.01)
    assert t.exposed_comm_s == pytest.approx(enc + comm + dec, rel=0.02)


def test_with_perfect_overlap_only_the_last_bucket_shows():
    small = 250 * 250  # 0.25 MB: 2 ms at 1 Gbit, far less than the backward gaps
    prof = profile([(small, 5 * MS), (small, 15 * MS), (small, 25 * MS), (small, 40 * MS)])
    model = PerformanceModel(prof)
    t = model.predict(Plan.uniform("none", warmup_steps=0))
    last_comm = 8 * small * 4 / 1e9
    assert t.iteration_s == pytest.approx(model.compute_only_s + last_comm, rel=0.02)
    assert [b.wait_s for b in t.buckets] == pytest.approx([0.0] * 4, abs=1e-9)


def test_encode_delays_the_rest_of_backward():
    numel = 500 * 500
    prof = profile([(numel, 10 * MS), (numel, 40 * MS)], kernel_s_per_element={"qsgd(bits=8)": (2e-8, 1e-15)})
    t = PerformanceModel(prof).predict(Plan.uniform("qsgd(bits=8)", warmup_steps=0))
    enc = 2e-8 * numel
    assert t.backward_end_s == pytest.approx(40 * MS + 2 * enc)
    assert t.buckets[1].encode_start_s == pytest.approx(40 * MS + enc)


def with_collective_cpu(prof: ClusterProfile, cpu_s_per_byte: float, device: str = "cpu") -> ClusterProfile:
    fits = {name: dataclasses.replace(fit, cpu_s_per_byte=cpu_s_per_byte) for name, fit in prof.network.fits.items()}
    environment = dataclasses.replace(prof.environment, device=device)
    return dataclasses.replace(prof, network=NetworkProfile(fits, 1.0), environment=environment)


def test_on_a_cpu_host_a_collective_during_backward_takes_its_cpu_time_from_backward():
    numel = 250 * 250  # 0.25 MB: a 2 ms all-reduce at 1 Gbit/s
    prof = profile([(numel, 10 * MS), (numel, 40 * MS)])
    plan = Plan.uniform("none", warmup_steps=0)
    free = PerformanceModel(prof).predict(plan)
    per_byte = 4e-9
    loaded = PerformanceModel(with_collective_cpu(prof, per_byte)).predict(plan)
    cpu = 4 * numel * per_byte  # 1 ms for bucket 0's all-reduce, wholly inside backward
    assert loaded.backward_end_s == pytest.approx(free.backward_end_s + cpu)
    # bucket 1's all-reduce starts as backward ends: it takes nothing from it
    assert loaded.iteration_s == pytest.approx(free.iteration_s + cpu)
    # the same profile from a GPU host: backward runs on the device, not on the CPU
    on_gpu = PerformanceModel(with_collective_cpu(prof, per_byte, device="cuda:0")).predict(plan)
    assert on_gpu.iteration_s == pytest.approx(free.iteration_s)


def test_only_the_share_of_a_collective_that_overlaps_backward_slows_it():
    numel = 250 * 250
    prof = profile([(numel, 39 * MS), (numel, 40 * MS)])  # bucket 0's 2 ms all-reduce: half inside
    plan = Plan.uniform("none", warmup_steps=0)
    free = PerformanceModel(prof).predict(plan)
    per_byte = 4e-9
    loaded = PerformanceModel(with_collective_cpu(prof, per_byte)).predict(plan)
    assert loaded.backward_end_s == pytest.approx(free.backward_end_s + 0.5 * 4 * numel * per_byte)


def test_summing_cpu_that_a_slow_link_hides_still_slows_a_cpu_backward():
    numel = 500 * 500  # fp16: 0.5 MB, a 4 ms all-reduce at 1 Gbit/s, wholly inside backward
    prof = profile([(numel, 10 * MS), (numel, 40 * MS)], kernel_s_per_element={"fp16": (1e-15, 1e-15)})
    plan = Plan.uniform("fp16", warmup_steps=0)
    free = PerformanceModel(prof).predict(plan)
    prof.network.reduce_s_per_byte = {}  # the link hides the summing: no extra wall time
    prof.network.reduce_cpu_s_per_byte = {"float16": 2e-9}
    loaded = PerformanceModel(prof).predict(plan)
    wire = 2 * (numel + 1)  # fp16 payload and the runtime's flag element
    assert loaded.backward_end_s == pytest.approx(free.backward_end_s + wire * 2e-9, rel=1e-6)
    assert loaded.buckets[0].comm_end_s - loaded.buckets[0].comm_start_s == pytest.approx(
        free.buckets[0].comm_end_s - free.buckets[0].comm_start_s)


def test_predict_many_charges_collective_cpu_time_as_predict_does():
    numel = 250 * 250
    kernels = {"fp16": (1e-9, 1e-9), "powersgd(rank=4)": (3e-9, 1e-9)}
    prof = with_collective_cpu(profile([(numel, 10 * MS), (numel, 25 * MS), (numel, 40 * MS)],
                                       kernel_s_per_element=kernels), 4e-9)
    model = PerformanceModel(prof)
    configs = ["none", "fp16", "powersgd(rank=4)"]
    costs = model.candidate_costs(configs)
    choices = np.array([[0, 0, 0], [1, 2, 0], [2, 1, 1]])
    many = model.predict_many(choices, costs)
    for row, predicted in zip(choices, many):
        plan = Plan.from_assignments({f"l{b}.weight": configs[c] for b, c in enumerate(row)}, warmup_steps=0)
        assert predicted == pytest.approx(model.predict(plan).iteration_s)


def test_all_gather_compressors_lose_ground_as_workers_grow():
    numel = 4000 * 4000
    kernels = {"topk(ratio=0.01)": (5e-9, 1e-9), "intquant(bits=8)": (3e-9, 1e-9)}
    prof = profile([(numel, 40 * MS)], kernel_s_per_element=kernels)
    ratios = []
    for p in (2, 8, 64, 512):
        model = PerformanceModel(prof, Scenario(world_size=p))
        topk = model.predict(Plan.uniform("topk(ratio=0.01)", warmup_steps=0)).iteration_s
        fp32 = model.predict(Plan.uniform("none", warmup_steps=0)).iteration_s
        ratios.append(topk / fp32)
    assert ratios == sorted(ratios)  # top-k's advantage shrinks with every step up in workers
    assert ratios[0] < 1 < ratios[-1]  # it wins at 2 workers and loses at 512


def test_all_reduce_bandwidth_term_hardly_grows_with_workers():
    numel = 4000 * 4000
    prof = profile([(numel, 40 * MS)])
    times = [PerformanceModel(prof, Scenario(world_size=p)).predict(Plan.uniform("none", warmup_steps=0)).iteration_s
             for p in (2, 16, 1024)]
    assert times[2] < 2.1 * times[0]  # ring factor 2(p-1)/p stays below 2


def test_compression_helps_mainly_at_low_bandwidth():
    numel = 4000 * 4000
    kernels = {"powersgd(rank=4)": (3e-9, 1e-9)}
    prof = profile([(numel, 40 * MS)], kernel_s_per_element=kernels)
    speedups = {}
    for rate in (1e8, 1e9, 1e10, 1e11):
        model = PerformanceModel(prof, Scenario(bandwidth_bps=rate))
        fp32 = model.predict(Plan.uniform("none", warmup_steps=0)).iteration_s
        psgd = model.predict(Plan.uniform("powersgd(rank=4)", warmup_steps=0)).iteration_s
        speedups[rate] = fp32 / psgd
    assert speedups[1e8] > 5 and speedups[1e11] < 1.05
    assert list(speedups.values()) == sorted(speedups.values(), reverse=True)


def test_a_faster_device_scales_compute_and_kernels_not_the_network():
    numel = 1000 * 1000
    prof = profile([(numel, 40 * MS)], kernel_s_per_element={"fp16": (1e-9, 1e-9)})
    slow = PerformanceModel(prof).predict(Plan.uniform("fp16", warmup_steps=0))
    fast = PerformanceModel(prof, Scenario(compute_speedup=10)).predict(Plan.uniform("fp16", warmup_steps=0))
    comm = slow.buckets[0].comm_end_s - slow.buckets[0].comm_start_s
    assert fast.compute_only_s == pytest.approx(slow.compute_only_s / 10)
    assert fast.buckets[0].comm_end_s - fast.buckets[0].comm_start_s == pytest.approx(comm)


def test_many_plans_at_once_agree_with_one_at_a_time():
    prof = profile([(300 * 300, t * MS) for t in (5, 12, 20, 31, 40)],
                   kernel_s_per_element={"fp16": (1e-9, 1e-9), "powersgd(rank=1)": (4e-9, 1e-9)})
    model = PerformanceModel(prof)
    configs = ["none", "fp16", "powersgd(rank=1)"]
    costs = model.candidate_costs(configs)
    rng = np.random.default_rng(0)
    choices = rng.integers(0, 3, size=(20, 5))
    many = model.predict_many(choices, costs)
    for row, predicted in zip(choices, many):
        order = [b.parameters[0] for b in model.buckets]
        plan = Plan.from_assignments({name: configs[c] for name, c in zip(order, row)}, warmup_steps=0)
        assert model.predict(plan).iteration_s == pytest.approx(predicted, rel=1e-9)


def test_calibration_recovers_a_known_overlap_factor():
    prof = profile([(1000 * 1000, 40 * MS)], kernel_s_per_element={"fp16": (1e-9, 1e-9)})
    model = PerformanceModel(prof)
    plans = [Plan.uniform(c, warmup_steps=0) for c in ("none", "fp16")]
    truth = PerformanceModel(prof, overlap=1.2)
    measured = [truth.predict(p).iteration_s for p in plans]
    assert model.calibrate(plans, measured) == pytest.approx(1.2)


def test_a_missing_kernel_cost_names_the_config():
    prof = profile([(1000, 1 * MS)])
    with pytest.raises(ValueError, match="no kernel cost for 'topk\\(ratio=0.01\\)'"):
        PerformanceModel(prof).predict(Plan.uniform("topk:0.01", warmup_steps=0))


def test_bad_scenarios_are_refused():
    with pytest.raises(ValueError, match="world_size=0; allowed: an integer in 1..1024"):
        Scenario(world_size=0)
    with pytest.raises(ValueError, match="bandwidth_bps=-1"):
        Scenario(bandwidth_bps=-1)


def test_timelines_export_to_chrome_trace_png_and_json(tmp_path):
    prof = profile([(300 * 300, 10 * MS), (300 * 300, 40 * MS)], kernel_s_per_element={"fp16": (1e-9, 1e-9)})
    t = PerformanceModel(prof).predict(Plan.uniform("fp16", warmup_steps=0))
    t.save_trace(tmp_path / "t.json")
    trace = json.loads((tmp_path / "t.json").read_text())
    names = {e["name"] for e in trace["traceEvents"]}
    assert {"forward", "backward", "optimizer", "comm b0 fp16", "decode b1"} <= names
    t.save_png(tmp_path / "t.png")
    assert (tmp_path / "t.png").read_bytes()[:4] == b"\x89PNG"
    assert Timeline.from_dict(json.loads(json.dumps(t.to_dict()))) == t


def test_ddp_bucket_copies_delay_backward_and_add_a_tail():
    numel = 1000 * 1000
    prof = profile([(numel, 40 * MS)])
    prof.compute.copy_s_per_byte = 1e-10  # 10 GB/s
    t = PerformanceModel(prof).predict(Plan.uniform("none", warmup_steps=0))
    copy = numel * 4 * 1e-10
    comm = 8 * numel * 4 / 1e9
    assert t.backward_end_s == pytest.approx(40 * MS + copy)  # copied in on the backward thread
    assert t.iteration_s == pytest.approx(10 * MS + 40 * MS + copy + comm + copy + 2 * MS, rel=0.01)


def test_summing_float16_costs_its_measured_extra_per_byte_on_top_of_the_link():
    numel = 1000 * 1000
    prof = profile([(numel, 40 * MS)], kernel_s_per_element={"fp16": (1e-9, 1e-9)})
    plain = PerformanceModel(prof).predict(Plan.uniform("fp16", warmup_steps=0))
    prof.network.reduce_s_per_byte = {"float16": 5e-9}
    summed = PerformanceModel(prof).predict(Plan.uniform("fp16", warmup_steps=0))
    extra = (numel + 1) * 2 * 5e-9  # fp16 payload + flag, 5 ns a byte
    assert summed.iteration_s - plain.iteration_s == pytest.approx(extra, rel=1e-6)
    # float32 sums (plan none) pay nothing extra
    none = Plan.uniform("none", warmup_steps=0)
    prof.kernels.costs["none"] = prof.kernels.costs["fp16"]
    assert PerformanceModel(prof).predict(none).iteration_s == pytest.approx(
        PerformanceModel(profile([(numel, 40 * MS)], kernel_s_per_element={"none": (1e-9, 1e-9)})).predict(none).iteration_s)


def test_summing_cost_follows_the_device_and_the_ring_share_not_the_link():
    numel = 1000 * 1000
    prof = profile([(numel, 40 * MS)], kernel_s_per_element={"fp16": (1e-9, 1e-9)})
    prof.network.reduce_s_per_byte = {"float16": 4e-9}
    base = PerformanceModel(prof).network.reduce_s_per_byte["float16"]
    assert PerformanceModel(prof, Scenario(compute_speedup=4)).network.reduce_s_per_byte["float16"] == pytest.approx(base / 4)
    assert PerformanceModel(prof, Scenario(bandwidth_bps=1e8)).network.reduce_s_per_byte["float16"] == pytest.approx(base)
    # a ring of 8 sums 7/8 of the data on each rank, a ring of 2 half of it
    assert PerformanceModel(prof, Scenario(world_size=8)).network.reduce_s_per_byte["float16"] == pytest.approx(base * 1.75)


def test_calibration_recovers_a_known_per_round_cost_and_overlap():
    per = {c: (1e-9, 1e-9) for c in ("none", "fp16", "powersgd(rank=4)", "topk(ratio=0.01)")}
    prof = profile([(1000 * 1000, 20 * MS), (1000 * 1000, 40 * MS)], kernel_s_per_element=per)
    plans = [Plan.uniform(c, warmup_steps=0) for c in per]  # 1 round each, PowerSGD 2
    truth = PerformanceModel(prof, overlap=1.1, round_s=2e-3)
    measured = [truth.predict(p).iteration_s for p in plans]
    model = PerformanceModel(prof)
    assert model.calibrate(plans, measured) == pytest.approx(1.1, rel=1e-3)
    assert model.round_s == pytest.approx(2e-3)
    assert [model.predict(p).iteration_s for p in plans] == pytest.approx(measured, rel=1e-6)


def test_every_synchronous_round_costs_round_s():
    per = {"powersgd(rank=4)": (1e-9, 1e-9), "fp16": (1e-9, 1e-9)}
    prof = profile([(1000 * 1000, 40 * MS)], kernel_s_per_element=per)
    for config, rounds in (("fp16", 1), ("powersgd(rank=4)", 2)):
        plan = Plan.uniform(config, warmup_steps=0)
        base = PerformanceModel(prof).predict(plan).iteration_s
        assert PerformanceModel(prof, round_s=3e-3).predict(plan).iteration_s - base == pytest.approx(rounds * 3e-3)
    with pytest.raises(ValueError, match="round_s"):
        PerformanceModel(prof, round_s=-1.0)


def test_the_per_round_cost_the_network_profiler_measured_is_charged_by_default():
    per = {"powersgd(rank=4)": (1e-9, 1e-9)}
    prof = profile([(1000 * 1000, 40 * MS)], kernel_s_per_element=per)
    plan = Plan.uniform("powersgd(rank=4)", warmup_steps=0)  # two rounds
    without = PerformanceModel(prof).predict(plan).iteration_s
    measured = dataclasses.replace(prof, network=dataclasses.replace(prof.network, round_s=2e-3))
    assert PerformanceModel(measured).round_s == 2e-3
    assert PerformanceModel(measured).predict(plan).iteration_s - without == pytest.approx(2 * 2e-3)
    # an explicit value (a calibrated one) replaces the profiled one
    assert PerformanceModel(measured, round_s=0.0).predict(plan).iteration_s == pytest.approx(without)
    # calibrating on one plan learns the overlap alone and keeps the profiled per-round cost
    model = PerformanceModel(measured)
    model.calibrate([plan], [PerformanceModel(measured).predict(plan).iteration_s])
    assert model.round_s == 2e-3


def test_profiles_saved_before_the_per_round_measurement_load_with_none(tmp_path):
    prof = profile([(1000 * 1000, 40 * MS)])
    doc = prof.to_dict()
    del doc["network"]["round_s"]
    assert ClusterProfile.from_dict(doc).network.round_s == 0.0
    doc["network"]["round_s"] = -1.0
    with pytest.raises(ValueError, match="round_s"):
        ClusterProfile.from_dict(doc)
