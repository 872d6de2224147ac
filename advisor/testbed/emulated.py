"""An emulated cluster on one machine: N hosts in network namespaces behind a shaped switch.

Each host is a network namespace with one veth interface; the other ends of the veths sit
on a bridge in a "switch" namespace.  Every link is shaped with ``tc tbf`` in both
directions (host egress and switch egress towards the host), so each host sees a full-
duplex link of the given rate, like a real host on a switched network.  One rank runs in
each host, with gloo bound to the host's interface (``GLOO_SOCKET_IFNAME``).

Needs root and iproute2 (``ip``, ``tc``).  Addresses are private ones on the testbed's own
veths, inside its own namespaces; nothing leaves the machine.  Namespaces are always
removed on exit, even when a rank fails.

    with EmulatedCluster(hosts=2, rate="1gbit") as cluster:
        results = cluster.run(my_fn, args=(...,))

Compute is shared: all ranks run on this machine's cores.  When
there are at least as many cores as hosts, each host's process (all its threads) is pinned
to its own cores, as on separate machines: unpinned, the scheduler moves ranks' compute,
communication and gloo threads across the shared cores, and every synchronisation point
pays for the ranks' collisions (docs/benchmarks.md has the numbers).
"""

from __future__ import annotations

import atexit
import os
import re
import shutil
import signal
import subprocess
import threading
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from advisor.testbed.launch import launch_local

_RATE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmg]?)(bit|bps)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}


def parse_rate(rate: str | float | int) -> float:
    """Bits per second from ``"100mbit"``, ``"1gbit"``, ``"10Gbit"`` or a number."""
    if isinstance(rate, (int, float)):
        if rate <= 0:
            raise ValueError(f"rate={rate!r}; allowed: a positive number of bits per second")
        return float(rate)
    match = _RATE.match(str(rate))
    if not match:
        raise ValueError(f"cannot read rate {rate!r}; write e.g. '100mbit', '1gbit' or a number of bit/s")
    value, unit, kind = match.groups()
    bits = float(value) * _UNITS[unit.lower()]
    if (kind or "bit").lower() == "bps":  # bytes per second, tc's spelling
        bits *= 8
    if bits <= 0:
        raise ValueError(f"rate {rate!r} must be positive")
    return bits


def unavailable_reason() -> str | None:
    """Why an emulated cluster cannot be built here, or None if it can."""
    if os.geteuid() != 0:
        return "the emulated cluster needs root (network namespaces and tc)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"the emulated cluster needs iproute2 ('{tool}' not found); install it (apt-get install iproute2)"
    probe = f"advprobe{uuid.uuid4().hex[:6]}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"cannot create network namespaces here: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def _sh(*args: str, ns: str | None = None) -> None:
    cmd = (["ip", "netns", "exec", ns] if ns else []) + list(args)
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"emulated cluster: `{' '.join(cmd)}` failed: {done.stderr.strip()}")


@dataclass
class EmulatedCluster:
    """``hosts`` namespaces on a switch, every link shaped to ``rate`` (None: unshaped)."""

    hosts: int = 2
    rate: str | float | None = "1gbit"
    delay_ms: float = 0.0
    #: give each host its own cores, as separate machines have (when there are enough)
    pin_cores: bool = True
    subnet: int = field(default_factory=lambda: 16 + uuid.uuid4().int % 200)
    _tag: str = field(default_factory=lambda: uuid.uuid4().hex[:6], repr=False)
    _up: bool = field(default=False, repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self.hosts, int) or not 1 <= self.hosts <= 64:
            raise ValueError(f"hosts={self.hosts!r}; allowed: an integer in 1..64")
        self.rate_bps = None if self.rate is None else parse_rate(self.rate)
        if self.delay_ms < 0:
            raise ValueError(f"delay_ms={self.delay_ms}; allowed: >= 0")

    # --- names --------------------------------------------------------------------
    @property
    def switch(self) -> str:
        return f"advsw{self._tag}"

    def host(self, i: int) -> str:
        return f"advh{self._tag}{i}"

    def address(self, i: int) -> str:
        return f"10.213.{self.subnet}.{i + 1}"

    interface = "eth0"  # the host side of each veth, renamed inside its namespace

    # --- lifecycle ----------------------------------------------------------------
    def __enter__(self) -> EmulatedCluster:
        reason = unavailable_reason()
        if reason:
            raise RuntimeError(reason)
        atexit.register(self.close)
        self._catch_sigterm()
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _shape(self, dev: str, ns: str) -> None:
        if self.rate_bps is None and not self.delay_ms:
            return
        if self.rate_bps is not None:
            # A small bucket (1 ms of data, at least 16 KiB): a bigger one lets small
            # messages through at memory speed and hides the link's latency.
            burst = max(16 * 1024, int(self.rate_bps / 8 / 1000))
            _sh("tc", "qdisc", "add", "dev", dev, "root", "handle", "1:", "tbf",
                "rate", f"{int(self.rate_bps)}bit", "burst", str(burst), "latency", "100ms", ns=ns)
            if self.delay_ms:
                _sh("tc", "qdisc", "add", "dev", dev, "parent", "1:1", "handle", "10:", "netem",
                    "delay", f"{self.delay_ms}ms", ns=ns)
        else:
            _sh("tc", "qdisc", "add", "dev", dev, "root", "netem", "delay", f"{self.delay_ms}ms", ns=ns)

    def _build(self) -> None:
        self._up = True
        _sh("ip", "netns", "add", self.switch)
        _sh("ip", "link", "add", "br0", "type", "bridge", ns=self.switch)
        _sh("ip", "link", "set", "br0", "up", ns=self.switch)
        for i in range(self.hosts):
            ns, peer, local = self.host(i), f"s{i}", f"h{self._tag}{i}"
            _sh("ip", "netns", "add", ns)
            _sh("ip", "link", "add", local, "type", "veth", "peer", "name", peer, "netns", self.switch)
            _sh("ip", "link", "set", local, "netns", ns)
            _sh("ip", "link", "set", local, "name", self.interface, ns=ns)
            _sh("ip", "addr", "add", f"{self.address(i)}/24", "dev", self.interface, ns=ns)
            _sh("ip", "link", "set", self.interface, "up", ns=ns)
            _sh("ip", "link", "set", "lo", "up", ns=ns)
            _sh("ip", "link", "set", peer, "master", "br0", ns=self.switch)
            _sh("ip", "link", "set", peer, "up", ns=self.switch)
            self._shape(self.interface, ns)
            self._shape(peer, self.switch)
        self._write_hosts()

    def _write_hosts(self) -> None:
        """Give every host's namespace a hosts file naming all cluster addresses (``ip netns``'s
        /etc/netns/NAME/hosts convention): c10d looks up each peer's host name, and without
        one it warns on every connection."""
        # c10d listens on IPv6 sockets, where a peer shows as its v4-mapped address
        names = "".join(f"{self.address(j)} {self.host(j)}\n::ffff:{self.address(j)} {self.host(j)}\n"
                        for j in range(self.hosts))
        for i in range(self.hosts):
            folder = Path("/etc/netns") / self.host(i)
            folder.mkdir(parents=True, exist_ok=True)
            (folder / "hosts").write_text(f"127.0.0.1 localhost\n::1 localhost\n{names}")

    def _catch_sigterm(self) -> None:
        # atexit does not run when the process is terminated by a signal; turning SIGTERM
        # into SystemExit unwinds the ``with`` block, so the namespaces are removed.
        self._previous_sigterm = None
        if threading.current_thread() is threading.main_thread() and \
                signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
            def terminate(signum, frame):
                raise SystemExit(128 + signum)

            self._previous_sigterm = signal.signal(signal.SIGTERM, terminate)

    def close(self) -> None:
        """Remove every namespace this cluster made (idempotent)."""
        if getattr(self, "_previous_sigterm", None) is not None:
            signal.signal(signal.SIGTERM, self._previous_sigterm)
            self._previous_sigterm = None
        if not self._up:
            return
        for ns in [self.host(i) for i in range(self.hosts)] + [self.switch]:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
            shutil.rmtree(Path("/etc/netns") / ns, ignore_errors=True)
        self._up = False

    # --- running ranks --------------------------------------------------------------
    def run(
        self,
        fn: Callable[..., Any],
        args: Sequence[Any] = (),
        *,
        timeout: float = 300.0,
        threads: int = 1,
    ) -> list[Any]:
        """``fn(rank, world_size, *args)`` with rank i in host i; results in rank order."""
        if not self._up:
            raise RuntimeError("the emulated cluster is not up; use it as `with EmulatedCluster(...) as c:`")
        return launch_local(
            fn,
            self.hosts,
            args,
            timeout=timeout,
            threads=threads,
            addr=self.address(0),
            env={"GLOO_SOCKET_IFNAME": self.interface},
            netns=[self.host(i) for i in range(self.hosts)],
            pin=self.pin_cores,
        )

    def describe(self) -> str:
        rate = "unshaped" if self.rate_bps is None else f"{self.rate_bps / 1e6:g} Mbit/s"
        return f"{self.hosts} hosts in network namespaces, links {rate}" + (
            f", +{self.delay_ms} ms" if self.delay_ms else ""
        )


def run_ranks(fn: Callable[..., Any], nproc: int, make_args: Callable[[str], Sequence[Any]], *,
              rate: str | float | None = None, timeout: float = 600.0) -> list[Any]:
    """Run ``fn(rank, nproc, *make_args(where))`` on ``nproc`` ranks; the ranks' results.

    With ``rate`` the ranks are hosts of an emulated cluster with links of that rate (root
    and iproute2); without, local processes over loopback.  ``where`` describes which, for
    the job to record.
    """

    if rate is None:
        return launch_local(fn, nproc, make_args(f"{nproc} local processes over loopback"), timeout=timeout)
    with EmulatedCluster(hosts=nproc, rate=rate) as cluster:
        return cluster.run(fn, make_args(f"emulated cluster: {cluster.describe()}"), timeout=timeout)
