"""Executes a compression plan inside DDP: the plan type, the hook, its ordered channel."""

from advisor.runtime.hook import CompressionHook, compression_hook, install
from advisor.runtime.plan import Plan, PlanGroup

__all__ = ["CompressionHook", "Plan", "PlanGroup", "compression_hook", "install"]
