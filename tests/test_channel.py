"""The ordered channel keeps finished collective handles alive long enough to die safely.

A gloo worker thread that drops the last reference to a finished work needs the GIL to
free its tensors; at interpreter shutdown that aborts the process.  The executor keeps
each handle until a whole iteration later, and releases the rest at exit itself.
"""

import gc
import time
import weakref

import torch

from advisor.compressors.base import Collective, Message
from advisor.runtime import channel as channel_module
from advisor.runtime.channel import Channel, Job, OrderedExecutor


class _Handle:
    def wait(self) -> bool:
        return True


class _RecordingChannel(Channel):
    """Completes at once; remembers a weak reference to every handle it gave out."""

    world_size = 2

    def __init__(self) -> None:
        self.handles: list[weakref.ref] = []

    def issue(self, message: Message):
        handle = _Handle()
        self.handles.append(weakref.ref(handle))
        return handle, message.tensor


def _two_round_exchange(tensor: torch.Tensor):
    result = yield Message(tensor, Collective.ALL_REDUCE_SUM, last=False)
    yield Message(result, Collective.ALL_REDUCE_SUM, last=True)


def _run_iteration(executor: OrderedExecutor, buckets: int = 3) -> None:
    jobs = []
    for b in range(buckets):
        fut = torch.futures.Future()
        tensor = torch.ones(4)
        jobs.append(Job([_two_round_exchange(tensor)], fut, tensor, ends_iteration=b == buckets - 1))
    for job in jobs:
        executor.submit(job)
    for job in jobs:
        job.future.wait()


def _alive(refs) -> int:
    gc.collect()
    return sum(ref() is not None for ref in refs)


def _wait_for_the_worker_to_finish_the_iteration(executor: OrderedExecutor) -> None:
    # the last future is set just before the worker moves this iteration's handles aside
    deadline = time.monotonic() + 10
    while executor._retired and time.monotonic() < deadline:
        time.sleep(0.001)


def test_finished_handles_are_held_until_the_next_iteration_ends():
    chan = _RecordingChannel()
    executor = OrderedExecutor(chan, threaded=True)
    try:
        _run_iteration(executor)
        _wait_for_the_worker_to_finish_the_iteration(executor)
        first = list(chan.handles)
        assert len(first) == 6 and _alive(first) == 6, "the ended iteration's handles are still held"

        _run_iteration(executor)
        _wait_for_the_worker_to_finish_the_iteration(executor)
        second = chan.handles[6:]
        assert _alive(first) == 0 and _alive(second) == 6
    finally:
        executor.close()
    assert _alive(chan.handles) == 0


def test_at_exit_the_workers_stop_and_the_main_thread_drops_the_handles():
    chan = _RecordingChannel()
    executor = OrderedExecutor(chan, threaded=True)
    _run_iteration(executor)
    _wait_for_the_worker_to_finish_the_iteration(executor)
    assert _alive(chan.handles) == 6

    channel_module._close_at_exit()

    assert not executor._thread.is_alive()
    assert _alive(chan.handles) == 0
