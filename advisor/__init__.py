"""compression-advisor: should you compress gradients on your cluster, and how?"""

from .compressors import CompressorConfig, available, build, parse
from .runtime import CompressionHook, Plan, PlanGroup, install

__version__ = "0.1.0"

from .autotune import autotune, autotune_model  # noqa: E402  (needs __version__ for profiles)
from .online import OnlineTuner, wrap  # noqa: E402

__all__ = [
    "CompressionHook",
    "CompressorConfig",
    "Plan",
    "PlanGroup",
    "__version__",
    "autotune",
    "autotune_model",
    "OnlineTuner",
    "wrap",
    "available",
    "build",
    "install",
    "parse",
]
