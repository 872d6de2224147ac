"""The embedded demo: autotune a bundled model on a local 2-process gloo cluster.

As root with iproute2 the two ranks run on an emulated cluster with 1 Gbit/s links (the
situation compression is for); elsewhere over loopback, and the output says which.  The
advisor profiles the cluster, searches plans, measures the best few live next to native
DDP fp32 and the 16-bit casts, and prints its advice with the numbers behind it.
"""

from __future__ import annotations

import torch.nn as nn

from advisor.testbed.emulated import parse_rate, unavailable_reason
from advisor.testbed.jobs import autotune_model
from advisor.testbed.workloads import mlp

DEMO_MODEL = "advisor.workloads:mlp"
DEMO_RATE = "1gbit"


def bundled_mlp() -> nn.Module:
    """The 5.3M-parameter MLP the seed study measured: Linear 1024-2048-1024-1024-10."""
    return mlp().model


def demo_rate(rate: str | None = DEMO_RATE) -> str | None:
    """The emulated link rate the demo will use, or None for loopback."""

    return rate if rate is not None and unavailable_reason() is None else None


def demo_cluster_description(rate: str | None = DEMO_RATE) -> str:

    rate = demo_rate(rate)
    if rate is None:
        return "2 local ranks over loopback (unshaped)"
    return f"2 hosts on an emulated {parse_rate(rate) / 1e6:g} Mbit/s network"


def run_demo(model: str = DEMO_MODEL, rate: str | None = DEMO_RATE, progress=None, **kwargs):
    """Autotune a bundled workload on an embedded 2-rank cluster (what ``make demo`` runs).

    Args:
        model: the workload factory, ``package.module:function``.
        rate: the emulated link rate (root and iproute2), or None for loopback.
        progress: print each stage of rank 0.
        **kwargs: more keyword arguments of :func:`advisor.autotune`.

    Returns:
        Rank 0's :class:`advisor.tuning.results.AutotuneResult`.

    Raises:
        ValueError: a bad argument.  RankFailed: a rank failed (its error in the message).
    """

    kwargs.setdefault("trials", 1000)
    return autotune_model(model, 2, rate=demo_rate(rate), where=demo_cluster_description(rate), **kwargs)
