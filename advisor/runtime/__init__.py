"""Executes a compression plan inside DDP: the plan type, the hook, its ordered channel."""

from .hook import CompressionHook, compression_hook, install
from .plan import Plan, PlanGroup

__all__ = ["CompressionHook", "Plan", "PlanGroup", "compression_hook", "install"]
