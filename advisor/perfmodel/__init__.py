"""Performance model: a DDP iteration replayed for any plan, with what-if scenarios."""

from advisor.perfmodel.model import CandidateCosts, NetworkModel, PerformanceModel, Scenario
from advisor.perfmodel.timeline import BucketSpan, Timeline

__all__ = ["BucketSpan", "CandidateCosts", "NetworkModel", "PerformanceModel", "Scenario", "Timeline"]
