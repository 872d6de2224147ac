"""The testbed: local ranks, the emulated slow cluster, bundled workloads, the demo, bench and validate."""
