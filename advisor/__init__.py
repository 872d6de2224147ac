"""compression-advisor: should you compress gradients on your cluster, and how?"""

from .compressors import CompressorConfig, available, build, parse
from .runtime import CompressionHook, Plan, PlanGroup, install

__version__ = "0.1.0"

__all__ = [
    "CompressionHook",
    "CompressorConfig",
    "Plan",
    "PlanGroup",
    "__version__",
    "available",
    "build",
    "install",
    "parse",
]
