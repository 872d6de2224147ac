"""Profilers of the live cluster (compute, network, kernels, gradient fidelity)."""

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
