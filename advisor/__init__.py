"""compression-advisor: should you compress gradients on your cluster, and how?

The package reads top to bottom as the data flows (each layer imports only those below it,
checked by the import contract in ``pyproject.toml``):

- ``advisor.core``: versioned documents and their JSON, validation helpers;
- ``advisor.compressors``: the compressors and their registry;
- ``advisor.runtime``: the plan, the DDP hook, its ordered channel, kernel timing;
- ``advisor.perfmodel``: the replay of a DDP iteration for any plan;
- ``profilers`` and ``policies`` (top-level packages): the profiles, and the choice of a plan;
- ``advisor.report``: text renderers;
- ``advisor.tuning``: autotune (offline), wrap (online), live measurement, the accuracy trial;
- ``advisor.testbed``: launcher, emulated cluster, bundled workloads, demo, bench, validate;
- ``advisor.integrations``: Lightning and Accelerate; ``advisor.cli``: the command.
"""

from advisor.compressors import CompressorConfig, available, build, parse
from advisor.core.version import __version__
from advisor.runtime import CompressionHook, FidelityMonitor, FidelityReading, Plan, PlanGroup, install

#: the entry points of the upper layers, by the module that holds each: imported on first use, so
#: that importing a lower layer (``advisor.core``, which profilers and policies build on) never
#: loads the layers above it; and FSDP2's reduce-scatter interface lives in a private torch module
_LAZY = {
    "autotune_model": "advisor.testbed.jobs",
    "ValidationReport": "advisor.testbed.validate",
    "Workload": "advisor.testbed.workloads",
    "autotune": "advisor.tuning.autotune",
    "ddp_for": "advisor.tuning.layout",
    "OnlineTuner": "advisor.tuning.online",
    "TunerEvent": "advisor.tuning.online",
    "wrap": "advisor.tuning.online",
    "AutotuneResult": "advisor.tuning.results",
    "TunedResult": "advisor.tuning.results",
    "install_sharded": "advisor.runtime.sharded",
    "autotune_sharded": "advisor.tuning.sharded",
    "ShardedAutotuneResult": "advisor.tuning.sharded",
    "wrap_sharded": "advisor.tuning.online.sharded",
}


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'advisor' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # looked up once
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


__all__ = [
    "ddp_for",
    "install_sharded",
    "autotune_sharded",
    "wrap_sharded",
    "ShardedAutotuneResult",
    "AutotuneResult",
    "CompressionHook",
    "FidelityMonitor",
    "FidelityReading",
    "TunedResult",
    "TunerEvent",
    "ValidationReport",
    "Workload",
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
