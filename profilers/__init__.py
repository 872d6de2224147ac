"""Profilers of the live cluster (compute, network, kernels, gradient fidelity)."""
