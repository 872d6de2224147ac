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
from advisor.runtime import CompressionHook, FidelityMonitor, FidelityReading, Plan, PlanGroup, install
from advisor.testbed.jobs import autotune_model
from advisor.testbed.validate import ValidationReport
from advisor.testbed.workloads import Workload
from advisor.tuning.autotune import autotune
from advisor.tuning.layout import ddp_for
from advisor.tuning.online import OnlineTuner, TunerEvent, wrap
from advisor.tuning.results import AutotuneResult, TunedResult

__version__ = "0.1.0"

def __getattr__(name: str):
    # FSDP2's reduce-scatter interface lives in a private torch module: imported on first use only
    if name == "install_sharded":
        from advisor.runtime.sharded import install_sharded

        return install_sharded
    if name in ("autotune_sharded", "ShardedAutotuneResult"):
        from advisor.tuning import sharded

        return getattr(sharded, name)
    if name == "wrap_sharded":
        from advisor.tuning.online.sharded import wrap_sharded

        return wrap_sharded
    raise AttributeError(f"module 'advisor' has no attribute {name!r}")


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
