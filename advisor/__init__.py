"""compression-advisor: should you compress gradients on your cluster, and how?"""

from .compressors import CompressorConfig, available, build, parse
from .runtime import CompressionHook, Plan, PlanGroup, install

__version__ = "0.1.0"

# the functions live in modules of other names (advisor.autotuning, advisor.online): a
# submodule named like the function would replace it as a package attribute once imported
_LAZY = {"autotune": "autotuning", "autotune_model": "autotuning", "OnlineTuner": "online", "wrap": "online"}


def __getattr__(name):
    # autotune and wrap pull in the policies, which import advisor's submodules: loading
    # them on first use keeps `import policies...` free of an import cycle
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module 'advisor' has no attribute {name!r}")

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
