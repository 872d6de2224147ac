"""Autotune online, inside the user's own training loop: observe -> race -> watch.

:func:`wrap` is the entry point; :mod:`.tuner` drives the phases, each in its own module
(:mod:`.observe`, :mod:`.trial`, :mod:`.watch`), between them the steps shared with
:func:`advisor.autotune` (:mod:`advisor.tuning.steps`).
"""

from advisor.tuning.online.observe import OBSERVE, Observation
from advisor.tuning.online.trial import TRIAL, TRIAL_SETTLE, Race
from advisor.tuning.online.tuner import OnlineTuner, TunerEvent, wrap
from advisor.tuning.online.watch import WATCH, Watch, loss_trend

__all__ = ["OBSERVE", "TRIAL", "TRIAL_SETTLE", "WATCH", "Observation", "OnlineTuner", "Race", "TunerEvent", "Watch",
           "loss_trend", "wrap"]
