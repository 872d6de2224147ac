import os
import sys

import pytest
import torch

# Tests measure behaviour, not speed: one thread keeps parallel ranks from fighting over 2 cores.
torch.set_num_threads(1)
sys.path.insert(0, os.path.dirname(__file__))


@pytest.fixture(scope="session")
def proving_runs():
    """Every run of PROVING_RUNS in one launch on 2 ranks at 100 Mbit/s (test_autotune's and
    test_sharded_autotune's): {name: [rank 0's output, rank 1's]}."""
    from autotune_programs import PROVING_RUNS, proving_online_loops

    from advisor.testbed.emulated import EmulatedCluster, unavailable_reason

    if unavailable_reason() is not None:
        pytest.skip(str(unavailable_reason()))
    with EmulatedCluster(hosts=2, rate="100mbit") as cluster:
        out = cluster.run(proving_online_loops, (list(PROVING_RUNS.values()),), timeout=900)
    return {name: [o[i] for o in out] for i, name in enumerate(PROVING_RUNS)}
