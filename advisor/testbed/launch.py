"""Launch a function on N local ranks (gloo), collect each rank's return value.

Used by the tests, the benchmarks and the CLI's embedded cluster.  A rank that raises or
dies ends the whole job with an error naming it; a job that runs past ``timeout`` is killed
and reported with the ranks still running: never a hang.
"""

from __future__ import annotations

import ctypes
import datetime
import gc
import logging
import multiprocessing
import os
import socket
import tempfile
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

log = logging.getLogger("advisor.testbed.launch")


class RankFailed(RuntimeError):
    """A rank raised, died, or did not finish in time."""

    def __init__(self, message: str, rank: int | None = None) -> None:
        super().__init__(message)
        self.rank = rank


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port the OS reports free right now (never a hard-coded one)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def enter_netns(name: str) -> None:
    """Move this process into network namespace ``name`` (as ``ip netns exec`` does).

    Called first thing in a fresh rank process, before any socket or network thread
    exists: threads created afterwards inherit the namespace.
    """
    clone_newnet = 0x40000000
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"/var/run/netns/{name}", os.O_RDONLY)
    try:
        if libc.setns(fd, clone_newnet) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns into network namespace {name!r} failed: {os.strerror(err)}")
    finally:
        os.close(fd)
    hosts = f"/etc/netns/{name}/hosts"
    if os.path.exists(hosts):
        _bind_hosts_file(libc, hosts)


def _bind_hosts_file(libc, hosts: str) -> None:
    """Show this process ``hosts`` as /etc/hosts, in a mount namespace of its own (as ``ip netns
    exec`` does), so the namespace's peers have names."""
    clone_newns, ms_rec, ms_private, ms_bind = 0x00020000, 0x4000, 1 << 18, 0x1000
    if libc.unshare(clone_newns) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"unshare of the mount namespace failed: {os.strerror(err)}")
    for source, target, flags in ((b"none", b"/", ms_rec | ms_private), (hosts.encode(), b"/etc/hosts", ms_bind)):
        if libc.mount(source, target, None, flags, None) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"mounting {hosts} over /etc/hosts failed: {os.strerror(err)}")


def core_shares(world_size: int, cores: Sequence[int] | None = None) -> list[set[int]] | None:
    """Disjoint sets of cores, one a rank, as even as possible; None if there are too few.

    ``cores`` defaults to the cores this process may run on.
    """
    cores = sorted(os.sched_getaffinity(0) if cores is None else cores)
    per_rank = len(cores) // world_size
    if per_rank < 1:
        return None
    return [set(cores[r * per_rank : (r + 1) * per_rank]) for r in range(world_size)]


def pin_process(cores: set[int]) -> None:
    """Restrict every thread of this process (and threads it starts later) to ``cores``."""
    for task in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(task), cores)
        except (ProcessLookupError, PermissionError):  # a thread that just ended
            pass
    os.sched_setaffinity(0, cores)


def _rank_entry(
    rank: int,
    fn: Callable[..., Any],
    world_size: int,
    addr: str,
    port: int,
    args: Sequence[Any],
    result_dir: str,
    threads: int,
    timeout_s: float,
    env: Mapping[str, str],
    netns: Sequence[str] | None,
    shares: Sequence[set[int]] | None = None,
) -> None:
    if shares:
        pin_process(shares[rank])
    if netns:
        enter_netns(netns[rank])
    os.environ.update(env)
    os.environ.update(MASTER_ADDR=addr, MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size))
    torch.set_num_threads(threads)
    report = Path(result_dir) / f"rank{rank}.err"
    try:
        timeout = datetime.timedelta(seconds=timeout_s)
        store = dist.TCPStore(addr, port, world_size, is_master=rank == 0, timeout=timeout)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=timeout)
        try:
            result = fn(rank, world_size, *args)
            leave_together(store)
            # saved before teardown: a crash while gloo shuts down cannot lose the result
            partial = Path(result_dir) / f"rank{rank}.pt.partial"
            torch.save(result, partial)
            partial.rename(Path(result_dir) / f"rank{rank}.pt")
            # Free the job's DDP models (held in reference cycles) now, on this thread:
            # left to interpreter shutdown, a gloo thread may drop the last reference to a
            # finished collective's tensors then and abort (pytorch/pytorch#190489; seen
            # with PyTorch's own comm hooks in the benchmark).
            del result
            gc.collect()
        except BaseException:
            # written before the group closes, so the root cause is dated before the
            # "connection reset" its peers will report next
            report.write_text(traceback.format_exc())
            raise
        finally:
            dist.destroy_process_group()
    except BaseException:
        if not report.exists():
            report.write_text(traceback.format_exc())
        raise


def leave_together(store: dist.Store | None = None) -> None:
    """Close gloo only once every rank is done with it; call before destroy_process_group.

    A rank that tears down its gloo pairs while a peer still reads the tail of the last
    collective can abort that peer ("terminate called without an active exception").  The
    store is a separate connection: every rank checks in, and the store's host (rank 0)
    leaves last.  Without a store at hand it uses the process group's own (private API,
    so a barrier stands in where that is missing).
    """
    rank, world_size = dist.get_rank(), dist.get_world_size()
    if store is None:
        getter = getattr(dist.distributed_c10d, "_get_default_store", None)
        if getter is None:
            dist.barrier()
            return
        store = getter()
    store.set(f"advisor/done/{rank}", "1")
    store.wait([f"advisor/done/{r}" for r in range(world_size)])
    if rank != 0:
        store.set(f"advisor/left/{rank}", "1")
    else:
        store.wait([f"advisor/left/{r}" for r in range(1, world_size)])


def _wait(processes, result_dir: str, timeout: float, grace: float = 3.0) -> None:
    """Wait for every rank; raise RankFailed naming the rank that failed or hung.

    A rank that exits abnormally *after* saving its result (a crash in gloo's teardown at
    exit) has done its work: that is logged, not raised.  A rank that fails before gives
    its peers ``grace`` seconds to fail in consequence, so the root cause can be named.
    """
    deadline = time.monotonic() + timeout
    failed_at = None
    while True:
        codes = [p.exitcode for p in processes]
        done = [Path(result_dir, f"rank{r}.pt").exists() for r in range(len(processes))]
        if all(c is not None for c in codes):
            break
        if failed_at is None and any(c not in (None, 0) and not d for c, d in zip(codes, done)):
            failed_at = time.monotonic()
        if failed_at is not None and time.monotonic() - failed_at > grace:
            break
        if time.monotonic() > deadline:
            alive = [i for i, p in enumerate(processes) if p.is_alive()]
            raise RankFailed(f"rank(s) {alive} did not finish within {timeout:.0f} s", alive[0] if alive else None)
        time.sleep(0.05)
    codes = [p.exitcode for p in processes]
    done = [Path(result_dir, f"rank{r}.pt").exists() for r in range(len(processes))]
    if all(done):
        for rank, code in enumerate(codes):
            if code not in (0, None):
                log.warning("rank %d exited with code %s after finishing its work (a crash at teardown); "
                            "its result is kept", rank, code)
        return
    if any(Path(result_dir).glob("rank*.err")):
        raise _first_failure(result_dir, next(r for r, d in enumerate(done) if not d), "")
    rank = next(r for r, d in enumerate(done) if not d)
    raise RankFailed(f"rank {rank} died (exit code {codes[rank]})", rank)


def _first_failure(result_dir: str, reported: int, fallback: str) -> RankFailed:
    """The rank that failed first (its peers usually fail next, of a broken connection)."""
    reports = sorted(Path(result_dir).glob("rank*.err"), key=lambda p: p.stat().st_mtime_ns)
    if not reports:
        return RankFailed(f"rank {reported} failed:\n{fallback}", reported)
    first = int(reports[0].stem[4:])
    message = f"rank {first} failed:\n{reports[0].read_text()}"
    later = [int(p.stem[4:]) for p in reports[1:]]
    if later:
        message += f"\n(then rank(s) {later} failed in consequence)"
    return RankFailed(message, first)


def launch_local(
    fn: Callable[..., Any],
    world_size: int,
    args: Sequence[Any] = (),
    *,
    timeout: float = 300.0,
    threads: int = 1,
    addr: str = "127.0.0.1",
    env: Mapping[str, str] | None = None,
    netns: Sequence[str] | None = None,
    pin: bool = False,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` spawned processes with gloo.

    Args:
        fn: importable (defined at module level); runs with the process group initialised.
        world_size: how many ranks.
        args: more positional arguments of ``fn`` (picklable).
        timeout: seconds before every rank is stopped.
        threads: torch threads per rank.
        addr: rank 0's address (in its namespace, with ``netns``).
        env: more environment variables for the ranks.
        netns: rank i runs in network namespace ``netns[i]`` (the emulated cluster).
        pin: give each rank its own cores (:func:`core_shares`) where there are at least as
            many cores as ranks, as separate machines have; with fewer they share them all.

    Returns:
        The ranks' return values, in rank order.

    Raises:
        RankFailed: a rank raised, died or timed out; the message carries each failing
            rank's error and the others are stopped.  A free port is chosen again when the
            one picked was taken meanwhile.
    """
    shares = core_shares(world_size) if pin else None
    for attempt in range(3):
        try:
            return _launch_once(fn, world_size, args, timeout, threads, addr, env, netns, shares)
        except RankFailed as exc:
            # The free port was taken between asking for it and binding it: pick another.
            if "Address already in use" not in str(exc) or attempt == 2:
                raise
    raise AssertionError("unreachable")


def _start_method() -> str:
    """``forkserver`` with torch and the advisor imported once, where the platform has it.

    Every rank is then a fork of a process that has paid for ``import torch`` (seconds
    each with ``spawn``); the server itself runs no torch work, so no thread pools or
    process groups are inherited.  Where fork is unavailable (Windows, macOS defaults) it
    stays ``spawn``.
    """
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return "spawn"
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["torch", "torch.distributed", "advisor.testbed.launch"])
    return "forkserver"


def _launch_once(
    fn: Callable[..., Any],
    world_size: int,
    args: Sequence[Any],
    timeout: float,
    threads: int,
    addr: str,
    env: Mapping[str, str] | None = None,
    netns: Sequence[str] | None = None,
    shares: list[set[int]] | None = None,
) -> list[Any]:
    if world_size < 1:
        raise ValueError(f"world_size={world_size}; allowed: an integer >= 1")
    if netns is not None and len(netns) != world_size:
        raise ValueError(f"got {len(netns)} network namespaces for {world_size} ranks")
    # a fresh namespace has every port free; on the host, ask the OS for one
    port = free_port() if netns else free_port(addr)
    with tempfile.TemporaryDirectory(prefix="advisor-ranks-") as result_dir:
        ctx = mp.start_processes(
            _rank_entry,
            args=(fn, world_size, addr, port, tuple(args), result_dir, threads, timeout, dict(env or {}),
                  list(netns) if netns else None, shares),
            nprocs=world_size,
            join=False,
            start_method=_start_method(),
        )
        try:
            _wait(ctx.processes, result_dir, timeout)
        finally:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
                    p.join(5)
        return [torch.load(Path(result_dir) / f"rank{r}.pt", weights_only=False) for r in range(world_size)]
