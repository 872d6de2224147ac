"""Profilers of the live cluster (compute, network, kernels, gradient fidelity)."""

# The advisor package (whose lower layers this one builds on) loads first, whichever package a
# program imports first: its root re-exports the tuning entry points, which import this one.
import advisor  # noqa: F401

from .profile import (
    Bucket,
    ClusterProfile,
    CollectiveFit,
    ComputeProfile,
    Environment,
    FidelityEntry,
    FidelityProfile,
    KernelCost,
    KernelProfile,
    NetworkProfile,
    ParameterTiming,
)

__all__ = [
    "Bucket",
    "ClusterProfile",
    "CollectiveFit",
    "ComputeProfile",
    "Environment",
    "FidelityEntry",
    "FidelityProfile",
    "KernelCost",
    "KernelProfile",
    "NetworkProfile",
    "ParameterTiming",
]
