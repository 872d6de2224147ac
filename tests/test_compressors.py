"""Compressor maths, checked on simulated ranks running the runtime's own exchange path."""

import math

import pytest
import torch

from advisor.compressors import REGISTRY, CompressorConfig, SegmentLayout, available, parse
from advisor.compressors.base import ExchangeContext
from advisor.compressors.packing import lane_words, pack_bits, pack_lanes, packed_nbytes, unpack_bits, unpack_lanes
from advisor.compressors.powersgd import outer_product_, project_
from advisor.compressors.sparse import stratified_indices, topk_abs_indices
from advisor.runtime.simulate import SimulatedRanks

LAYOUT = SegmentLayout(("conv.w", "fc.b", "fc.w"), ((16, 8, 3, 3), (100,), (120, 90)))
LOSSY = ["powersgd(rank=1)", "powersgd(rank=4)", "topk(ratio=0.05)", "randomk(ratio=0.1)",
         "qsgd(bits=2)", "qsgd(bits=5)", "qsgd(bits=8)", "intquant(bits=3)", "intquant(bits=8)",
         "intquant(bits=8, packed=0)", "intquant(bits=4, packed=0)", "signsgd"]
ALL = ["none", "fp16", "bf16"] + LOSSY


def grads(world, seed, numel=LAYOUT.numel):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(numel, generator=g) for _ in range(world)]


@pytest.mark.parametrize("spec", ALL)
@pytest.mark.parametrize("world", [1, 2, 4])
def test_every_rank_gets_the_same_mean_and_the_advertised_bytes(spec, world):
    comp = parse(spec).build()
    sim = SimulatedRanks(world)
    outs = sim.exchange(comp, grads(world, 0), LAYOUT)
    for o in outs[1:]:
        assert torch.equal(outs[0], o)
    assert sim.bytes_sent == world * comp.wire_bytes(LAYOUT, world)
    assert torch.isfinite(outs[0]).all()


@pytest.mark.parametrize("world", [1, 3])
def test_none_is_the_exact_mean(world):
    g = grads(world, 1)
    out = SimulatedRanks(world).exchange(parse("none").build(), g, LAYOUT)[0]
    expected = sum(x * (1.0 / world) for x in g)
    assert torch.equal(out, expected)


@pytest.mark.parametrize("spec,dtype", [("fp16", torch.float16), ("bf16", torch.bfloat16)])
def test_casts_are_within_the_dtype_tolerance(spec, dtype):
    # each rank's cast and the 16-bit sum each round once: within two machine epsilons
    tol = 2 * torch.finfo(dtype).eps
    g = grads(2, 2)
    out = SimulatedRanks(2).exchange(parse(spec).build(), g, LAYOUT)[0]
    mean = (g[0] + g[1]) / 2
    # relative to the inputs' magnitude: the mean itself may cancel to near zero
    magnitude = (g[0].abs() + g[1].abs()) / 2
    assert ((out - mean).abs() <= tol * magnitude + 1e-7).all()


@pytest.mark.parametrize("spec", LOSSY)
@pytest.mark.parametrize("world", [1, 2, 4])
def test_error_feedback_accounts_for_every_lost_bit(spec, world):
    """sum(applied) + mean(residuals) == sum(true mean gradients), and residuals stay bounded."""
    comp = parse(spec).build()
    assert comp.error_feedback
    sim = SimulatedRanks(world)
    applied = torch.zeros(LAYOUT.numel, dtype=torch.float64)
    true = torch.zeros(LAYOUT.numel, dtype=torch.float64)
    residual_norms = []
    for step in range(40):
        g = grads(world, 100 + step)
        applied += sim.exchange(comp, g, LAYOUT)[0].double()
        true += torch.stack(g).double().mean(0)
        residual_norms.append(math.sqrt(sum(r.norm() ** 2 for r in sim.residuals)))
    mean_residual = sum(torch.cat([t.reshape(-1) for t in r._by_name.values()]).double() for r in sim.residuals) / world
    assert torch.allclose(applied + mean_residual, true, atol=1e-3, rtol=1e-4)
    # bounded: after a transient the residual stops growing (a non-contractive
    # compressor under error feedback grows it step after step)
    assert max(residual_norms[20:]) < 1.5 * max(residual_norms[:20]) + 1e-6


def test_error_feedback_can_be_turned_off():
    comp = CompressorConfig("topk", {"ratio": 0.1}, error_feedback=False).build()
    sim = SimulatedRanks(2)
    sim.exchange(comp, grads(2, 3), LAYOUT)
    assert all(r.norm() == 0 for r in sim.residuals)


def test_powersgd_recovers_a_low_rank_gradient_after_warm_start():
    layout = SegmentLayout(("w",), ((64, 48),))
    g = torch.Generator().manual_seed(0)
    low_rank = (torch.randn(64, 2, generator=g) @ torch.randn(2, 48, generator=g)).reshape(-1)
    comp = CompressorConfig("powersgd", {"rank": 2}, error_feedback=False).build()
    sim = SimulatedRanks(2)
    for _ in range(3):
        out = sim.exchange(comp, [low_rank, low_rank], layout)[0]
    assert torch.allclose(out, low_rank, atol=1e-4)


@pytest.mark.parametrize("form", ["matmul", "rank1-updates"])
@pytest.mark.parametrize("rank", [1, 2, 4, 8])
@pytest.mark.parametrize("shape", [(64, 64), (1024, 512)])
def test_powersgd_outer_products_match_a_matmul_in_either_form(rank, shape, form):
    gen = torch.Generator().manual_seed(rank)
    p, qt = torch.randn(shape[0], rank, generator=gen), torch.randn(rank, shape[1], generator=gen)
    m = torch.randn(shape, generator=gen)
    out = torch.full(shape, float("nan"))
    torch.testing.assert_close(outer_product_(p, qt, out, form=form), p @ qt, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(outer_product_(p, qt, m.clone(), subtract=True, form=form), m - p @ qt,
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("form", ["direct", "transposed"])
@pytest.mark.parametrize("rank", [1, 3, 4, 8])
def test_powersgd_projection_matches_a_matmul_in_either_form(rank, form):
    gen = torch.Generator().manual_seed(rank)
    m, qt = torch.randn(300, 200, generator=gen), torch.randn(rank, 200, generator=gen)
    out = torch.full((300, rank), float("nan"))
    ctx = ExchangeContext(2, forms={"powersgd-projection": form})
    torch.testing.assert_close(project_(m, qt, out, ctx), m @ qt.t(), rtol=1e-5, atol=1e-4)


def test_powersgd_sends_vectors_and_unshrinkable_matrices_uncompressed():
    layout = SegmentLayout(("b", "tiny"), ((50,), (2, 3)))
    comp = parse("powersgd(rank=4)").build()
    g = grads(2, 4, layout.numel)
    out = SimulatedRanks(2).exchange(comp, g, layout)[0]
    assert torch.allclose(out, (g[0] + g[1]) / 2)
    assert len(comp.wire(layout, 2)) == 1


def test_topk_selection_is_exact():
    for numel, k in [(1000, 10), (300_000, 3000), (1 << 20, 100)]:
        x = torch.randn(numel)
        ours = set(topk_abs_indices(x, k).tolist())
        ref = set(torch.topk(x.abs(), k).indices.tolist())
        assert ours == ref


def test_randomk_indices_are_distinct_and_cover_the_whole_tensor():
    gen = torch.Generator().manual_seed(0)
    idx = stratified_indices(1003, 100, gen, "cpu")
    assert len(set(idx.tolist())) == 100
    assert idx.min() >= 0 and idx.max() < 1003
    assert idx.max() > 990  # the last stratum is used


@pytest.mark.parametrize("bits", range(1, 9))
def test_bit_packing_round_trips(bits):
    codes = torch.randint(0, 1 << bits, (1001,))
    packed = pack_bits(codes, bits)
    assert packed.numel() == packed_nbytes(1001, bits) <= math.ceil(1001 * bits / 8) + bits
    assert torch.equal(unpack_bits(packed, bits, 1001), codes)
    rows = torch.stack([packed, packed])
    assert torch.equal(unpack_bits(rows, bits, 1001)[1], codes)


def test_lanes_sum_without_overflow_at_the_largest_codes():
    bits, world = 4, 8
    lane = bits + 3
    top = (1 << bits) - 2  # largest unsigned code: 2 * levels
    codes = torch.full((999,), top, dtype=torch.int64)
    words = torch.empty(lane_words(999, lane), dtype=torch.int64)
    pack_lanes(codes.clone(), lane, words)  # codes are scratch to pack_lanes
    summed = words * world
    assert torch.equal(unpack_lanes(summed, lane, 999), codes * world)


def test_qsgd_is_unbiased_without_error_feedback():
    layout = SegmentLayout(("w",), ((4096,),))
    x = torch.randn(4096)
    comp = CompressorConfig("qsgd", {"bits": 2}, error_feedback=False).build()
    sim = SimulatedRanks(1)
    mean = sum(sim.exchange(comp, [x], layout)[0] for _ in range(1000)) / 1000
    # 2-bit codes are {-max, 0, +max}: rounding to nearest would be off by ~|x| on most
    # values; the stochastic average is off only by sampling noise (~0.04 here)
    assert (mean - x).abs().mean() < 0.1 * x.abs().mean()


def test_intquant_sums_inside_all_reduce():
    comp = parse("intquant(bits=8)").build()
    assert all(w.collective.is_all_reduce for w in comp.wire(LAYOUT, 64))
    assert parse("topk:0.01").build().uses_all_gather


def test_all_gather_payloads_grow_relative_to_all_reduce_with_world_size():
    # per-rank bytes are constant, but all-gather receives world_size of them
    top, iq = parse("topk:0.01").build(), parse("intquant:4").build()
    assert top.wire_bytes(LAYOUT, 2) == top.wire_bytes(LAYOUT, 64)
    assert iq.wire_bytes(LAYOUT, 64) >= iq.wire_bytes(LAYOUT, 2)  # headroom bits only


@pytest.mark.parametrize("spec", ["fp16"] + LOSSY)
def test_nonfinite_on_one_rank_falls_back_to_fp32_and_resets_the_residual(spec, caplog):
    comp = parse(spec).build()
    sim = SimulatedRanks(2)
    sim.exchange(comp, grads(2, 5), LAYOUT)  # builds up some residual
    g = grads(2, 6)
    g[1][7] = float("nan")
    with caplog.at_level("WARNING", logger="advisor.runtime"):
        outs = sim.exchange(comp, g, LAYOUT)
    assert torch.isnan(outs[0][7]) and torch.isnan(outs[1][7])
    finite = torch.ones(LAYOUT.numel, dtype=torch.bool)
    finite[7] = False
    assert torch.equal(outs[0][finite], ((g[0] + g[1]) * 0.5)[finite])
    for r in sim.residuals:
        assert r.norm() == 0
    assert sum("non-finite" in m for m in caplog.messages) == 2  # one a rank
    # training goes on: the next step is compressed again and finite
    outs = sim.exchange(comp, grads(2, 7), LAYOUT)
    assert torch.isfinite(outs[0]).all()


def test_registry_lists_every_required_compressor():
    assert {"none", "fp16", "bf16", "powersgd", "topk", "randomk", "qsgd", "intquant", "signsgd"} <= set(REGISTRY)
    assert available()["topk"] == {"ratio": "a number in (0, 1]"}
    assert available()["intquant"] == {"bits": "an integer in 2..8", "packed": "0 or 1"}


@pytest.mark.parametrize(
    "spec,message",
    [
        ("zip", "unknown compressor 'zip'; allowed: bf16, fp16, intquant, none, powersgd, qsgd, randomk, signsgd, topk"),
        ("topk(ratio=0)", "topk: ratio=0.0 is invalid; allowed: a number in (0, 1]"),
        ("topk(ratio=1.5)", "allowed: a number in (0, 1]"),
        ("powersgd(rank=0)", "powersgd: rank=0 is invalid; allowed: an integer >= 1"),
        ("powersgd(rank=1.5)", "not an integer"),
        ("qsgd(bits=9)", "qsgd: bits=9 is invalid; allowed: an integer in 2..8"),
        ("intquant(bits=1)", "allowed: an integer in 2..8"),
        ("fp16(ratio=0.1)", "compressor 'fp16' has no parameter ratio"),
        ("topk(ratio=abc)", "is not a number"),
        ("intquant(bits=8, packed=2)", "intquant: packed=2 is invalid; allowed: 0 or 1"),
        ("topk(0.1, 3)", "name the parameter"),
    ],
)
def test_invalid_configs_name_the_bad_value_and_the_allowed_ones(spec, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)").replace(".", r"\.")):
        parse(spec)


def test_configs_round_trip_through_text_and_dicts():
    for spec in ALL + ["topk(ratio=0.01, no-ef)", "fp16(ef)", "signsgd(no-ef)"]:
        cfg = parse(spec)
        assert parse(cfg.label) == cfg
        assert CompressorConfig.from_dict(cfg.to_dict()) == cfg
    assert parse("signsgd(no-ef)").label == "signsgd(no-ef)"  # no empty parameter before the flag
    assert parse("powersgd:4") == CompressorConfig("powersgd", {"rank": 4})
    assert parse("topk:0.01").params == {"ratio": 0.01}
    assert parse("intquant(4, 0)").params == {"bits": 4, "packed": 0}


@pytest.mark.parametrize("spec", ALL)
def test_an_embedding_row_no_batch_touches_never_turns_non_finite(spec):
    """Rows that get one gradient and then none keep only a residual, shrinking every step
    (by ~254x for 8-bit integers) until it is below what a scale can divide by."""
    layout = SegmentLayout(("emb.weight",), ((512, 16),))
    comp = parse(spec).build()
    sim = SimulatedRanks(2)
    first = torch.zeros(512, 16)
    first[:3] = 1e-3 * torch.randn(3, 16, generator=torch.Generator().manual_seed(0))
    for step in range(40):
        g = first.reshape(-1) if step == 0 else torch.zeros(512 * 16)
        outs = sim.exchange(comp, [g.clone(), g.clone()], layout)
        assert all(torch.isfinite(o).all() for o in outs), f"{spec}: non-finite output at step {step}"


def test_a_mean_that_decodes_to_nan_from_finite_inputs_is_skipped_on_every_rank_and_its_residual_reset():
    from advisor.compressors.casts import Fp16

    class DecodesBadly(Fp16):  # finite inputs, a broken decode (as intquant's underflowed scale was)
        def exchange(self, inp, out, layout, state, ctx):
            yield from super().exchange(inp, out, layout, state, ctx)
            out.view(-1)[0] = float("nan")

    comp = DecodesBadly(error_feedback=True)
    sim = SimulatedRanks(2)
    g = [torch.randn(LAYOUT.numel) for _ in range(2)]
    out = sim.exchange(comp, g, LAYOUT)
    for rank in range(2):
        assert torch.equal(out[rank], torch.zeros(LAYOUT.numel)), "the optimizer must see zeros, not NaN"
        assert sim.residuals[rank].norm() == 0.0
