"""One ordered communication channel per process: the same collectives, in the same order, on every rank.

Why not issue collectives from future callbacks, as PyTorch's PowerSGD hook does?  A
callback runs when *its* collective finishes, which differs between ranks, so a second
round of bucket 0 can be issued before or after the first round of bucket 1 depending on
timing: gloo then matches the wrong messages ("collective mismatch").

Here every bucket becomes a job on one worker thread.  The worker issues each job's rounds
strictly in job order, waiting between the rounds of one exchange; only the *final* round
of an exchange is left in flight while later jobs are issued, so consecutive buckets still
overlap.  The worker never blocks on a final round while it could issue a new job: a
finished collective wakes it through its future, and it decodes finished rounds oldest
first: blocking on the oldest final round would hold back the next bucket's first round
until that round ended.  What a final round's completion might still send
(the non-finite fallback) is held back and issued at the iteration's end, after every
regular collective, in job order: the issue order is a function of the bucket order alone,
identical on all ranks.

Why keep finished work handles for an iteration?  A gloo worker thread marks a collective
done and only then drops its own reference to the work; when it drops the *last* one, the
work's tensors (which have Python objects) need the GIL to die.  At interpreter shutdown
that thread is killed inside C++ and the process aborts ("terminate called without an
active exception", pytorch/pytorch#190489).  Holding each handle until the next iteration
ends (and, at exit, until after a short pause) makes Python drop the last reference, on a
thread that holds the GIL while the interpreter is alive.
"""

from __future__ import annotations

import atexit
import queue
import threading
import time
import weakref
from collections import deque
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from advisor.compressors.base import Collective, Exchange, Message, cached_buffer


class Channel:
    """Issues one message's collective; returns (handle with ``wait()``, result tensor)."""

    world_size: int = 1

    def issue(self, message: Message):  # pragma: no cover - interface
        raise NotImplementedError


class _Done:
    def wait(self) -> bool:
        return True


class LocalChannel(Channel):
    """World size 1: combining one rank's message is the identity; nothing goes on a wire."""

    world_size = 1

    def issue(self, message: Message):
        result = message.tensor
        if message.collective is Collective.ALL_GATHER:
            result = result.unsqueeze(0)
        return _Done(), result


_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class ProcessGroupChannel(Channel):
    """Collectives over a torch.distributed process group (gloo, NCCL, ...)."""

    def __init__(self, group=None) -> None:
        self.group = group
        self.world_size = dist.get_world_size(group)
        self.messages_sent = 0
        self.bytes_sent = 0

    def issue(self, message: Message):
        t = message.tensor
        self.messages_sent += 1
        self.bytes_sent += message.nbytes
        if message.collective is Collective.ALL_REDUCE_SUM:
            return dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.group, async_op=True), t
        if message.collective is Collective.ALL_REDUCE_MAX:
            return dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group, async_op=True), t
        numel = self.world_size * t.numel()
        if message.workspace is not None:
            out = cached_buffer(message.workspace, "gathered", numel, t.dtype, t.device)
        else:
            out = torch.empty(numel, dtype=t.dtype, device=t.device)
        work = _all_gather_single(out, t, group=self.group, async_op=True)
        return work, out.view(self.world_size, t.numel())


@dataclass
class Job:
    """A bucket: its segment exchanges and the future DDP waits on.

    Constructing a job runs every exchange up to its first message, in the caller's
    thread (local work only: encoding); the executor then only issues, in order.
    """

    exchanges: list[Exchange]
    future: torch.futures.Future
    result: torch.Tensor
    ends_iteration: bool
    #: the future DDP waits on where it is not ``future`` itself (chained through the hook's
    #: delivery callbacks)
    for_ddp: torch.futures.Future | None = None
    first_messages: list[Message] = field(init=False)
    remaining: int = field(init=False)

    def __post_init__(self) -> None:
        self.remaining = len(self.exchanges)
        self.first_messages = [next(exchange) for exchange in self.exchanges]


@dataclass
class _InFlight:
    job: Job
    exchange: Exchange
    handle: object
    result: torch.Tensor


class OrderedExecutor:
    """Runs jobs' exchanges over a :class:`Channel` in a rank-independent order.

    ``threaded=False`` runs each job to completion in the caller's thread (world size 1,
    and the in-process simulations used by tests and profilers).
    """

    def __init__(self, channel: Channel, threaded: bool = True, name: str = "advisor-comm") -> None:
        self.channel = channel
        self.threaded = threaded
        self._in_flight: deque[_InFlight] = deque()
        self._deferred: list[tuple[Job, Exchange, Message]] = []
        self._queue: queue.Queue = queue.Queue()  # jobs, _WAKE, None (stop)
        self._thread: threading.Thread | None = None
        self._name = name
        self._lock = threading.Lock()
        #: finished work handles of this iteration and the one before (see the module doc)
        self._retired: list = []
        self._retired_before: list = []

    # --- public -------------------------------------------------------------------
    def submit(self, job: Job) -> None:
        if not self.threaded:
            self._run_guarded(job)
            self._drain()
            return
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._loop, name=self._name, daemon=True)
                self._thread.start()
                # Stop the worker before interpreter shutdown: a daemon thread killed inside
                # a torch call at exit aborts the process ("terminate called ...").  At exit
                # _close_at_exit does it; this finalizer covers executors collected earlier.
                finalizer = weakref.finalize(self, _stop_worker, self._queue, self._thread,
                                             (self._retired, self._retired_before))
                finalizer.atexit = False
                _running.add(self)
        self._queue.put(job)

    def close(self) -> None:
        if self._thread is not None:
            _stop_worker(self._queue, self._thread, (self._retired, self._retired_before))

    # --- worker -------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            item = self._queue.get()  # a job, a finished collective's wake-up, or None: stop
            if item is None:
                return
            if item is not _WAKE:
                self._run_guarded(item)
                if item.ends_iteration:
                    self._drain()
                    continue
            self._complete_finished()

    def _complete_finished(self) -> None:
        """Decode final rounds that have finished, oldest first, without blocking."""
        while self._in_flight and _is_done(self._in_flight[0].handle):
            self._complete_oldest()

    def _wake_when_done(self, handle) -> None:
        if not self.threaded:
            return
        get_future = getattr(handle, "get_future", None)
        if get_future is None:  # a handle that is done at once (or only knows wait())
            self._queue.put(_WAKE)
            return
        try:
            future = get_future()
        except RuntimeError:  # a backend without futures: finished at the iteration's end
            return
        jobs = self._queue
        future.add_done_callback(lambda _f: jobs.put(_WAKE))

    def _run_guarded(self, job: Job) -> None:
        try:
            self._issue(job)
        except BaseException as exc:  # never leave DDP waiting on a future that cannot finish
            self._fail_all(exc, job)

    def _issue(self, job: Job) -> None:
        for exchange, message in zip(job.exchanges, job.first_messages):
            while True:
                handle, result = self.channel.issue(message)
                if message.last:
                    self._in_flight.append(_InFlight(job, exchange, handle, result))
                    self._wake_when_done(handle)
                    break
                handle.wait()
                self._retired.append(handle)
                try:
                    message = exchange.send(result)
                except StopIteration:
                    self._segment_done(job)
                    break

    def _complete_oldest(self) -> None:
        item = self._in_flight.popleft()
        try:
            item.handle.wait()
            self._retired.append(item.handle)
            try:
                fallback = item.exchange.send(item.result)
            except StopIteration:
                self._segment_done(item.job)
                return
            self._deferred.append((item.job, item.exchange, fallback))
        except BaseException as exc:
            self._fail_all(exc, item.job)

    def _drain(self) -> None:
        """Finish everything in flight, then issue held-back fallbacks in job order."""
        while self._in_flight:
            self._complete_oldest()
        deferred, self._deferred = self._deferred, []
        for job, exchange, message in deferred:
            try:
                handle, result = self.channel.issue(message)
                handle.wait()
                self._retired.append(handle)
                try:
                    exchange.send(result)
                except StopIteration:
                    pass
                self._segment_done(job)
            except BaseException as exc:
                self._fail_all(exc, job)
        # a whole iteration later, gloo's threads are long done with the older handles
        self._retired_before[:] = self._retired
        self._retired.clear()

    def _segment_done(self, job: Job) -> None:
        job.remaining -= 1
        if job.remaining == 0 and not job.future.done():
            job.future.set_result(job.result)

    def _fail_all(self, exc: BaseException, job: Job) -> None:
        jobs = [job] + [i.job for i in self._in_flight] + [j for j, _, _ in self._deferred]
        self._in_flight.clear()
        self._deferred.clear()
        for j in jobs:
            if not j.future.done():
                j.future.set_exception(exc)


#: queued when a collective left in flight finishes
_WAKE = object()


def _is_done(handle) -> bool:
    probe = getattr(handle, "is_completed", None)
    return True if probe is None else bool(probe())


def _stop_worker(jobs: queue.Queue, thread: threading.Thread, retired: tuple[list, ...] = ()) -> None:
    if thread is threading.current_thread():  # a finalizer run by a collection on the worker itself
        jobs.put(None)
        return
    if thread.is_alive():
        jobs.put(None)
        thread.join(timeout=30)
    for handles in retired:
        handles.clear()


_running: weakref.WeakSet[OrderedExecutor] = weakref.WeakSet()


@atexit.register
def _close_at_exit() -> None:
    """Stop every worker and release its handles while the interpreter is fully alive."""
    executors = list(_running)
    for executor in executors:
        if executor._thread is not None:
            _stop_worker(executor._queue, executor._thread)
    if any(executor._retired or executor._retired_before for executor in executors):
        time.sleep(0.05)  # let gloo's threads drop their references first (module doc)
    for executor in executors:
        executor._retired.clear()
        executor._retired_before.clear()
