"""Batches as users hold them: lists and loaders, drawn lazily, held-out ones never trained on."""

import warnings

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from advisor.testbed.launch import launch_local
from advisor.tuning.data import ORDER_BLOCK, BatchSourceError, BatchStream


class Counting:
    """An iterable that counts how many batches were drawn from it."""

    def __init__(self, n: int, fail_at: int | None = None) -> None:
        self.n, self.fail_at, self.drawn = n, fail_at, 0

    def __iter__(self):
        for i in range(self.n):
            if i == self.fail_at:
                raise OSError("disk went away")
            self.drawn += 1
            yield torch.full((2,), float(i))


def test_a_list_gives_its_last_quarter_to_held_out_and_trains_on_the_rest():
    batches = [torch.full((2,), float(i)) for i in range(16)]
    stream = BatchStream(batches)
    held = stream.held_out()
    assert [int(b[0]) for b in held] == [12, 13, 14, 15]
    assert [int(stream.train(i)[0]) for i in range(14)] == list(range(12)) + [0, 1], "steps beyond it cycle"
    assert BatchStream(batches[:4]).held_out() == [], "too few to spare: evaluate on the training batches"


def test_a_loader_is_drawn_only_as_far_as_the_steps_need():
    source = Counting(1000)
    stream = BatchStream(source)
    held = stream.held_out()
    assert len(held) == 4 and source.drawn == 5, "held-out first, then one training batch"
    stream.train(9)
    assert source.drawn == 14
    assert stream.head(3)[0][0] == 4.0, "the held-out batches are not training batches"


def test_a_dataloader_works_and_is_never_passed_twice():
    data = TensorDataset(torch.arange(40.0).reshape(20, 2))
    stream = BatchStream(DataLoader(data, batch_size=2))
    held = stream.held_out()
    trained = [stream.train(i) for i in range(30)]
    held_rows = {tuple(r.tolist()) for (b,) in held for r in b}
    trained_rows = {tuple(r.tolist()) for (b,) in trained for r in b}
    assert stream.distinct == 6 and not held_rows & trained_rows
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert stream.warn_if_memorising(100) is not None and "memorisation" in str(caught[0].message)
    assert stream.warn_if_memorising(12) is None


def test_the_noise_arm_sees_the_same_batches_in_another_order():
    stream = BatchStream(Counting(1000))
    stream.held_out(0)
    first = [int(stream.train(i)[0]) for i in range(2 * ORDER_BLOCK)]
    other = [int(stream.other_order(i)[0]) for i in range(2 * ORDER_BLOCK)]
    assert first != other
    assert sorted(first[:ORDER_BLOCK]) == sorted(other[:ORDER_BLOCK]), "shuffled within each block"
    shuffled_list = BatchStream([torch.full((1,), float(i)) for i in range(10)])
    assert sorted(int(shuffled_list.other_order(i)[0]) for i in range(10)) == list(range(10))


def test_a_loader_that_raises_or_yields_nothing_is_named():
    stream = BatchStream(Counting(100, fail_at=3), name="batches")
    with pytest.raises(BatchSourceError, match=r"batches \(Counting\) raised OSError: disk went away"):
        stream.held_out()
    with pytest.raises(BatchSourceError, match="yielded no training batches"):
        BatchStream(iter([])).head(1)
    with pytest.raises(TypeError, match="iterable of batches"):
        BatchStream(3)


def draw_where_rank_one_fails(rank: int, world: int):
    from advisor.tuning.data import draw_on_every_rank

    stream = BatchStream(Counting(100, fail_at=5 if rank == 1 else None))
    stream.held_out(0)
    try:
        draw_on_every_rank(stream, 10)
    except BatchSourceError as exc:
        return str(exc)
    return None


@pytest.mark.slow
def test_a_loader_that_fails_on_one_rank_fails_on_every_rank_naming_it():
    errors = launch_local(draw_where_rank_one_fails, 2, timeout=120)
    assert errors[0] == errors[1] and errors[0] is not None
    assert "rank 1: batches (Counting) raised OSError: disk went away" in errors[0]
