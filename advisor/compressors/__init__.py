"""Gradient compressors behind one interface, and the registry that names them."""

from advisor.compressors.base import Collective, Compressor, ExchangeContext, Message, SegmentLayout, WireSpec
from advisor.compressors.registry import REGISTRY, CompressorConfig, available, build, parse

__all__ = [
    "Collective",
    "Compressor",
    "CompressorConfig",
    "ExchangeContext",
    "Message",
    "REGISTRY",
    "SegmentLayout",
    "WireSpec",
    "available",
    "build",
    "parse",
]
