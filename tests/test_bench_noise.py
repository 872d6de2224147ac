"""The layout benchmark's noise: a comparison is as noisy as its own two settings across interleaved rounds."""

import math

from advisor.testbed.bench import _noise, pair_noise


def test_a_pair_is_as_noisy_as_its_per_round_ratio_not_the_median_setting():
    rounds = {"steady a": [1.0, 1.0, 1.01, 0.99, 1.0], "steady b": [2.0, 2.02, 2.0, 1.98, 2.0],
              "advisor": [1.0, 1.0, 1.0, 1.0, 1.0], "swinging": [1.0, 1.2, 0.8, 1.1, 0.9]}
    assert _noise(rounds) < 0.01  # most settings are steady
    assert pair_noise(rounds, "advisor", "swinging") > 0.08  # this comparison is not
    # a round that slows both settings alike is the machine, not a difference between them
    together = {"a": [1.0, 1.2, 0.9, 1.4, 1.1], "b": [2.0, 2.4, 1.8, 2.8, 2.2]}
    assert pair_noise(together, "a", "b") == 0.0 < _noise(together)
    assert math.isnan(pair_noise({"a": [1.0], "b": [2.0]}, "a", "b"))
