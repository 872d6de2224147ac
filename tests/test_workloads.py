"""The bench's workloads: every rank builds the same model from the same seed, and it trains."""

import pytest
import torch

from advisor.testbed.bench import MODELS
from advisor.testbed.workloads import build_workload

BENCH_WORKLOADS = (*MODELS, "advisor.workloads:compute_bound_cnn", "advisor.workloads:near_floor_cnn")


@pytest.mark.parametrize("spec", BENCH_WORKLOADS)
def test_every_rank_builds_the_same_model_and_it_takes_a_finite_step(spec):
    first, second = build_workload(spec), build_workload(spec)
    for (name, a), (_, b) in zip(first.model.named_parameters(), second.model.named_parameters(), strict=True):
        assert torch.equal(a, b), f"{spec}: parameter {name} differs between two builds from seed 0"
    batch = next(iter(first.batches))
    loss = first.loss_fn(first.model, batch)
    loss.backward()
    assert torch.isfinite(loss)
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in first.model.parameters())


@pytest.mark.parametrize("spec", ["advisor.workloads:compute_bound_cnn", "advisor.workloads:near_floor_cnn"])
def test_the_compute_bound_cnns_are_the_size_their_docstrings_say(spec):
    model = build_workload(spec).model
    assert 1.8e6 < sum(p.numel() for p in model.parameters()) < 2.0e6


def test_the_near_floor_cnn_is_the_compute_bound_cnn_at_four_times_the_batch():
    small, large = build_workload("advisor.workloads:compute_bound_cnn"), build_workload("advisor.workloads:near_floor_cnn")
    assert next(iter(large.batches))[0].shape[0] == 4 * next(iter(small.batches))[0].shape[0]
