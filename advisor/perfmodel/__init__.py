"""Performance model: a DDP iteration replayed for any plan, with what-if scenarios."""

from .model import CandidateCosts, NetworkModel, PerformanceModel, Scenario
from .timeline import BucketSpan, Timeline

__all__ = ["BucketSpan", "CandidateCosts", "NetworkModel", "PerformanceModel", "Scenario", "Timeline"]
