"""Cluster profile types: JSON round trip and the errors of bad files."""


import pytest

from advisor.core.documents import SchemaError, from_jsonable, to_jsonable
from profilers.network import fit_collective, reduction_dtypes_of
from profilers.profile import (
    Bucket,
    ClusterProfile,
    ComputeProfile,
    Environment,
    NetworkProfile,
    ParameterTiming,
)


def sample_profile() -> ClusterProfile:
    points = [(b, 1e-4 + b / 1.25e8) for b in (4096, 65536, 1 << 20, 1 << 24)]
    return ClusterProfile(
        environment=Environment(2, "gloo", "cpu", "2.13.0", "0.1.0", ["a", "b"], 1, "2026-11-29T00:00:00+00:00"),
        compute=ComputeProfile(
            forward_s=0.01, backward_s=0.02, optimizer_s=0.001, steps=4,
            parameters=[ParameterTiming("fc.weight", "fc", 100, [10, 10], 0.015)],
            layer_backward_s={"fc": 0.015},
            buckets=[Bucket(0, ["fc.weight"], 100)],
        ),
        network=NetworkProfile({"all_reduce": fit_collective("all_reduce", 2, points)}, 1.0),
    )


def test_profile_round_trips_through_json(tmp_path):
    profile = sample_profile()
    path = tmp_path / "p.json"
    profile.save(path)
    again = ClusterProfile.load(path)
    assert again == profile
    assert again.network.fits["all_reduce"].predict(1 << 20) == pytest.approx(1e-4 + (1 << 20) / 1.25e8, rel=0.02)


def test_an_older_version_says_to_profile_again(tmp_path):
    data = sample_profile().to_dict()
    data["version"] = 0
    with pytest.raises(ValueError, match="version 0 is not supported .* profile the cluster again"):
        ClusterProfile.from_dict(data)


def test_a_bad_value_is_named_by_its_path():
    data = sample_profile().to_dict()
    data["compute"]["parameters"][0]["ready_s"] = "soon"
    with pytest.raises(ValueError, match=r"compute\.parameters\[0\]\.ready_s: expected a number, got 'soon'"):
        ClusterProfile.from_dict(data)


def test_missing_and_unknown_fields_are_named():
    data = sample_profile().to_dict()
    del data["compute"]["backward_s"]
    with pytest.raises(ValueError, match=r"compute\.backward_s: missing"):
        ClusterProfile.from_dict(data)
    data = sample_profile().to_dict()
    data["compute"]["speed"] = 3
    with pytest.raises(ValueError, match=r"unknown field\(s\) \['speed'\]"):
        ClusterProfile.from_dict(data)


def test_negative_times_are_refused():
    data = sample_profile().to_dict()
    data["compute"]["forward_s"] = -1.0
    with pytest.raises(ValueError, match="forward_s=-1.0; allowed: a finite number >= 0"):
        ClusterProfile.from_dict(data)


def test_not_a_profile_and_not_json(tmp_path):
    with pytest.raises(ValueError, match="not a cluster profile"):
        ClusterProfile.from_dict({"kind": "compression-advisor/plan", "version": 1})
    bad = tmp_path / "bad.json"
    bad.write_text("{nope")
    with pytest.raises(ValueError, match="bad.json: cluster profile is not valid JSON"):
        ClusterProfile.load(bad)
    with pytest.raises(ValueError, match="does not exist"):
        ClusterProfile.load(tmp_path / "missing.json")


def test_every_document_kind_is_registered_once_and_read_back_by_its_kind(tmp_path):
    import advisor.testbed.validate  # noqa: F401  (registers the validation report)
    import advisor.tuning.sharded  # noqa: F401  (registers the sharded profile and result)
    from advisor.core.documents import DOCUMENT_KINDS, read_document
    from advisor.perfmodel import PerformanceModel
    from advisor.runtime import Plan
    from advisor.tuning.results import AutotuneResult, TunedResult

    assert {cls.__name__ for cls in DOCUMENT_KINDS.values()} == {
        "Plan", "ClusterProfile", "Timeline", "AutotuneResult", "ValidationReport", "MeasurementSet",
        "ShardedProfile", "ShardedAutotuneResult"}
    assert all(kind.startswith("compression-advisor/") for kind in DOCUMENT_KINDS)
    assert TunedResult not in DOCUMENT_KINDS.values()  # it reads back as the plain document
    profile = sample_profile()
    plan = Plan.uniform("none", warmup_steps=0)
    timeline = PerformanceModel(profile).predict(plan)
    for name, document in (("profile", profile), ("plan", plan), ("timeline", timeline)):
        document.save(tmp_path / f"{name}.json")
        back = read_document(tmp_path / f"{name}.json")
        assert type(back) is type(document) and back.to_dict() == document.to_dict()
    with pytest.raises(ValueError, match="timeline.json is not a plan or an autotune result"):
        read_document(tmp_path / "timeline.json", accept=(Plan, AutotuneResult))
    (tmp_path / "odd.json").write_text('{"kind": "compression-advisor/plan", "version": 9}')
    with pytest.raises(ValueError, match="odd.json: plan version 9 is not supported"):
        read_document(tmp_path / "odd.json")


def test_the_network_fit_recovers_latency_and_bandwidth_of_a_known_line():
    latency, rate = 2e-4, 1e9  # 1 Gbit/s links, 2 ranks: ring factor 1
    points = [(b, latency + b * 8 / rate) for b in (4096 * 2**k for k in range(12))]
    points[3] = (points[3][0], points[3][1] * 3)  # one outlier: the robust fit ignores it
    fit = fit_collective("all_reduce", 2, points)
    assert fit.bandwidth_bps == pytest.approx(rate, rel=0.02)
    assert fit.latency_s == pytest.approx(latency, rel=0.1)


def test_fast_small_ops_among_slow_ones_do_not_bend_the_bandwidth_fit():
    # measured on the emulated cluster at 100 Mbit/s (ms): small ops took 0.3 or 4 ms
    # depending on whether a rank's threads were awake; weighted by their own times, the
    # 0.3 ms ones once outweighed every large message and fitted 1.1 Gbit/s
    measured = [(4096, 4.0), (4096, 3.8), (4096, 0.3), (8192, 0.3), (8192, 4.1), (8192, 3.5),
                (16384, 3.8), (16384, 0.3), (16384, 3.9), (32768, 2.7), (32768, 2.3), (32768, 2.5),
                (65536, 7.7), (65536, 4.6), (65536, 8.4), (131072, 14.1), (131072, 13.6), (131072, 10.3),
                (262144, 24.2), (262144, 24.0), (262144, 21.7), (524288, 44.5), (524288, 44.7),
                (524288, 47.5), (1048576, 92.4), (1048576, 91.2), (1048576, 90.3), (2097152, 183.4),
                (2097152, 187.7), (2097152, 185.4), (4194304, 367.7), (4194304, 394.9), (4194304, 373.6),
                (8388608, 733.2), (8388608, 722.1), (8388608, 725.1)]
    fit = fit_collective("all_reduce", 2, [(b, ms / 1e3) for b, ms in measured])
    assert fit.bandwidth_bps == pytest.approx(92e6, rel=0.05)
    assert fit.r2 > 0.99
    assert 0 <= fit.latency_s < 4e-3


def test_the_kernel_model_interpolates_and_extrapolates_a_power_law():
    from profilers.kernels import fit_loglog
    from profilers.profile import predict_loglog

    sizes = [2**k for k in range(12, 24, 2)]
    times = [1e-9 * n**1.1 for n in sizes]
    knots = fit_loglog(sizes, times)
    for n in (3000, 2**17 + 5, 2**25):  # below, between and above the measured sizes
        assert float(predict_loglog(knots, n)) == pytest.approx(1e-9 * n**1.1, rel=0.02)
    # noise that would make time shrink with size is pooled away: never decreasing
    noisy = fit_loglog([1, 2, 4, 8], [1.0, 0.5, 2.0, 4.0])
    values = predict_loglog(noisy, [1, 2, 4, 8])
    assert all(a <= b for a, b in zip(values, values[1:]))


def test_a_slowed_half_of_the_compute_steps_is_dropped():
    from profilers.compute import steady_steps

    steady = [0.030, 0.031, 0.029, 0.030, 0.031, 0.030]
    assert steady_steps(steady) == list(range(6))
    burst = [0.030, 0.031, 0.029, 0.060, 0.065, 0.058]  # other work started halfway
    assert steady_steps(burst) == [0, 1, 2]
    assert steady_steps([0.06, 0.07, 0.03, 0.03]) == [2, 3]
    assert steady_steps([0.03, 0.09]) == [0, 1]  # too few steps to judge


def test_network_profiles_without_summing_costs_still_load():
    doc = NetworkProfile({"all_reduce": fit_collective("all_reduce", 2, [(4096, 1e-4), (1 << 20, 1e-2)])}, 1.0,
                         {"float16": 3e-9})
    data = to_jsonable(doc)
    assert from_jsonable(NetworkProfile, data).reduce_s_per_byte == {"float16": 3e-9}
    del data["reduce_s_per_byte"]
    assert from_jsonable(NetworkProfile, data).reduce_s_per_byte == {}
    with pytest.raises(SchemaError, match="reduce_s_per_byte"):
        from_jsonable(NetworkProfile, {**data, "reduce_s_per_byte": {"float16": -1.0}})


def test_the_summed_types_are_those_the_candidates_all_reduce():
    configs = ["none", "fp16", "bf16", "powersgd(rank=4)", "intquant(bits=8)", "intquant(bits=4, packed=0)", "topk(ratio=0.01)"]
    # intquant packs into int64 lanes; unpacked 4-bit codes plus a headroom bit sum in int8
    assert reduction_dtypes_of(configs, 2) == ("bfloat16", "float16", "int64", "int8")
    assert reduction_dtypes_of(["none", "topk(ratio=0.01)"], 2) == ()
