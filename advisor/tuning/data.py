"""The user's batches as the tuners draw them: lazily, remembered, and agreed on by every rank.

Users hold data as a list of a few batches or as a ``DataLoader`` over an epoch.  A
:class:`BatchStream` takes either.  It draws batches only when a step needs one, and keeps
those it drew, so that the paired arms of an accuracy trial replay the very same batches.
Nothing beyond what was asked for is materialised.  Held-out batches (when the user gives
neither ``held_out`` nor ``evaluate``) come from the stream itself and are never trained on.

Drawing happens on every rank at its own pace, but a failure must end the job on every
rank, not leave the others waiting in a collective: :func:`draw_on_every_rank` draws, then
agrees through one small all-reduce whether every rank succeeded, and raises the same
error, naming each failing rank, everywhere.
"""

from __future__ import annotations

import logging
import random
import warnings
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

from advisor.core.collectives import every_rank, slowest

log = logging.getLogger("advisor.tuning.data")

#: held-out batches taken from the front of a stream when neither held_out nor evaluate is given
STREAM_HELD_OUT = 4
#: a list of at least this many batches gives a quarter of them (at most 8) to held-out evaluation
LIST_HELD_OUT_FROM = 8
#: the noise arm's order is shuffled within blocks of this many drawn batches
ORDER_BLOCK = 16
#: epochs over the same few batches beyond which a trial measures memorisation, not learning
MEMORISATION_EPOCHS = 4


class BatchSourceError(ValueError):
    """The user's batches could not be drawn: the iterable raised, or yielded nothing."""


class BatchStream:
    """Training batches drawn on demand from a list or any iterable, and remembered.

    ``batches``: a sequence, or any iterable such as a ``DataLoader`` or a generator, drawn
    one batch at a time as steps need them.  Steps beyond what the input holds cycle over
    the batches it gave (one pass, so held-out batches are never trained on).  Call
    :meth:`held_out` before the first training batch is drawn.
    """

    def __init__(self, batches: Iterable[Any], *, name: str = "batches") -> None:
        try:
            iter(batches)
        except TypeError:
            raise TypeError(f"{name} must be an iterable of batches (a list, a DataLoader), got "
                            f"{type(batches).__name__}") from None
        self.name = name
        self.source = type(batches).__name__
        self._listed = isinstance(batches, Sequence)
        self._iterable = batches
        self._iterator: Iterator[Any] | None = None
        self._drawn: list[Any] = list(batches) if self._listed else []
        self._held_batches: list[Any] | None = None
        #: training batches in one pass over the input, once known (None: not ended yet)
        self._epoch: int | None = len(self._drawn) if self._listed else None
        self._ended = self._listed  # no more batches will come
        self._whole_order: list[int] | None = None  # the noise arm's order once the input has ended

    def describe(self) -> str:
        return f"{self.name} ({self.source})"

    @property
    def distinct(self) -> int | None:
        """How many distinct training batches one pass over the input gives (None: not known yet)."""
        return self._epoch

    def held_out(self, count: int | None = None) -> list[Any]:
        """Set aside held-out batches, never trained on (once; later calls return the same ones).

        A list of at least :data:`LIST_HELD_OUT_FROM` batches gives its last quarter (at most
        8); a shorter list gives none (the trial then evaluates on what it trains on and says
        so); any other iterable gives its first :data:`STREAM_HELD_OUT` batches.
        """
        if self._held_batches is None:
            if self._listed:
                n = len(self._drawn)
                if count is None:
                    count = min(8, max(2, n // 4)) if n >= LIST_HELD_OUT_FROM else 0
                count = min(count, n - 1)
                self._held_batches = self._drawn[n - count:] if count > 0 else []
                self._drawn = self._drawn[: n - count]
                self._epoch = len(self._drawn)
            else:
                if self._drawn:
                    raise RuntimeError("held-out batches must be set aside before training batches are drawn")
                count = STREAM_HELD_OUT if count is None else count
                held = []
                while len(held) < count:
                    batch = self._next()
                    if batch is _END:
                        break
                    held.append(batch)
                self._held_batches = held
                self._draw(1)  # at least one batch must remain to train on
        return list(self._held_batches)

    def train(self, i: int) -> Any:
        """The ``i``-th training batch (from 0), drawn if need be."""
        self._draw(i + 1)
        return self._drawn[i % len(self._drawn)]

    def other_order(self, i: int, seed: int = 1) -> Any:
        """The batch the noise arm trains on at step ``i``: the same batches in another order.

        Where the input has ended (a list, a spent loader), its batches are shuffled as a
        whole; a stream's are shuffled within blocks of :data:`ORDER_BLOCK` as they are
        drawn, so no batch is drawn before a step needs its block.
        """
        block = i // ORDER_BLOCK
        if not self._ended:
            self._draw((block + 1) * ORDER_BLOCK)
        if self._ended:
            if self._whole_order is None or len(self._whole_order) != len(self._drawn):
                self._whole_order = list(range(len(self._drawn)))
                random.Random(seed).shuffle(self._whole_order)
            return self._drawn[self._whole_order[i % len(self._whole_order)]]
        order = list(range(ORDER_BLOCK))
        random.Random(seed * 1_000_003 + block).shuffle(order)
        return self._drawn[block * ORDER_BLOCK + order[i % ORDER_BLOCK]]

    def head(self, count: int) -> list[Any]:
        """The first ``count`` training batches (fewer where fewer exist), for profiling and timing."""
        self._draw(count)
        return self._drawn[:count]

    def draw(self, count: int) -> int:
        """Draw until ``count`` training batches exist (or the input ends); return how many do."""
        self._draw(count)
        return len(self._drawn)

    def epochs(self, steps: int) -> float:
        """How many passes over the input's distinct batches ``steps`` training steps make (0: unknown)."""
        return steps / self._epoch if self._epoch else 0.0

    def warn_if_memorising(self, steps: int, say=None) -> str | None:
        """Warn when ``steps`` would cycle the same few batches so often that a trial measures
        memorisation rather than learning; returns the warning, or None."""
        epochs = self.epochs(steps)
        if epochs <= MEMORISATION_EPOCHS:
            return None
        message = (f"the accuracy trial trains {steps} steps on the {self._epoch} training batches of "
                   f"{self.describe()}, {epochs:.0f} passes over each: it may measure memorisation, not "
                   "learning. Pass more batches (a DataLoader is drawn lazily, as the trial needs them)")
        warnings.warn(message, stacklevel=3)
        if say is not None:
            say(f"warning: {message}")
        return message

    # --- drawing ---------------------------------------------------------------------------
    def _draw(self, count: int) -> None:
        while len(self._drawn) < count and not self._ended:
            batch = self._next()
            if batch is _END:
                self._ended = True
                break
            self._drawn.append(batch)
        if not self._drawn and self._ended:
            raise BatchSourceError(f"{self.describe()} yielded no training batches"
                                   + (f" beyond the {len(self._held_batches)} held out" if self._held_batches else "")
                                   + "; the tuners need at least one batch of real training data")

    def _next(self) -> Any:
        """The input's next batch, or _END when it has ended.

        An input that ends is not iterated again: a second pass over a loader would yield
        the held-out batches again, to be trained on.  Steps beyond one pass cycle it.
        """
        if self._iterator is None:
            try:
                self._iterator = iter(self._iterable)
            except Exception as exc:  # a loader whose __iter__ fails (workers, a closed file, ...)
                raise BatchSourceError(f"{self.describe()} raised {type(exc).__name__}: {exc} when iterated") from exc
        try:
            return next(self._iterator)
        except StopIteration:
            self._epoch = len(self._drawn)
            return _END
        except Exception as exc:  # the user's loader may fail in any way; name it and its error
            raise BatchSourceError(f"{self.describe()} raised {type(exc).__name__}: {exc} while drawing batch "
                                   f"{len(self._drawn) + len(self._held_batches or []) + 1}") from exc


_END = object()


def draw_on_every_rank(stream: BatchStream, count: int, group=None) -> None:
    """Draw ``count`` training batches on every rank; a failure on any rank raises on all.

    One all-reduce carries every rank's failure flag; only when one is set are the
    messages gathered.
    """
    problem = None
    try:
        stream.draw(count)
    except BatchSourceError as exc:
        problem = str(exc)
    _agree(problem, group)


def set_aside_on_every_rank(stream: BatchStream, count: int | None = None, group=None) -> list[Any]:
    """:meth:`BatchStream.held_out` on every rank, failing on all where it fails on one."""
    problem, held = None, []
    try:
        held = stream.held_out(count)
    except BatchSourceError as exc:
        problem = str(exc)
    _agree(problem, group)
    return held


def _agree(problem: str | None, group) -> None:
    failed = slowest([1.0 if problem is not None else 0.0], group)[0] > 0
    if failed:
        messages = every_rank(problem, group)
        detail = "; ".join(f"rank {r}: {m}" for r, m in enumerate(messages) if m is not None)
        raise BatchSourceError(f"drawing training batches failed ({detail}); nothing of the model or optimizer "
                               "changed")
