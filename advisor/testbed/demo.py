"""The embedded demo: autotune a bundled model that learns from real data on a local 2-process cluster.

The task is a transformer language model on the Python standard library's own sources
(real text every installation ships), trained with momentum SGD, as for a run of
:data:`DEMO_RUN_STEPS` steps.  As root with iproute2 the two ranks run on an emulated
cluster with 1 Gbit/s links (the situation compression is for); elsewhere over loopback,
and the output says which.  The advisor profiles the cluster, trials accuracy within 2% of
that run, searches plans, measures the best few live next to native DDP fp32 and the 16-bit
cast, and prints its advice with the evidence behind it: each plan's speed-up per step, its
step efficiency and its speed-up to the same accuracy, and how sure the trial could be.
"""

from __future__ import annotations

from advisor.testbed.emulated import parse_rate, unavailable_reason
from advisor.testbed.jobs import autotune_model

DEMO_MODEL = "advisor.workloads:text_lm_sgd"
DEMO_RATE = "1gbit"
#: the run the demo tunes for: the accuracy trial may take 2% of it
DEMO_RUN_STEPS = 30_000


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
    kwargs.setdefault("expected_steps", DEMO_RUN_STEPS)
    kwargs.setdefault("max_rounds", 5)
    return autotune_model(model, 2, rate=demo_rate(rate), where=demo_cluster_description(rate), **kwargs)
