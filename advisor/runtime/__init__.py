"""Executes a compression plan inside DDP: the plan type, the hook, its ordered channel, its fidelity monitor."""

from advisor.runtime.hook import CompressionHook, compression_hook, install
from advisor.runtime.monitor import FidelityMonitor, FidelityReading
from advisor.runtime.plan import Plan, PlanGroup

__all__ = ["CompressionHook", "FidelityMonitor", "FidelityReading", "Plan", "PlanGroup", "compression_hook", "install"]
