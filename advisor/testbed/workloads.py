"""Workloads: a model with its loss and data, named ``package.module:factory`` on the CLI.

A factory is a zero-argument callable returning a :class:`Workload`.  Every rank calls it
(with the same seed), so it must build the same model everywhere.
"""

from __future__ import annotations

import functools
import glob
import importlib
import math
import os
import re
import sys
import sysconfig
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

from advisor.tuning.accuracy import Evaluator, held_out_loss


@dataclass
class Workload:
    """What the advisor needs to run training steps of a model, and to judge them.

    ``held_out``: batches training never sees; ``evaluate(model) -> {metric: value}``
    judges a model on this rank (default: the mean ``loss_fn`` over ``held_out``, as
    ``{"loss": ...}``).  ``metric`` names the value that decides, ``target`` the value a
    run must reach (default: whatever the fp32 run reaches).
    """

    model: nn.Module
    loss_fn: Callable[[nn.Module, Any], torch.Tensor]
    batches: Iterable[Any]
    make_optimizer: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer] | None = None
    name: str = "workload"
    held_out: Sequence[Any] | None = None
    evaluate: Evaluator | None = None
    metric: str = "loss"
    target: float | None = None
    #: ``shard(model)``: applies ``fully_shard`` to the model's blocks, then its root, in place; how
    #: the workload trains sharded (``advisor validate --sharded``), None where it does not
    shard: Callable[[nn.Module], None] | None = None

    def optimizer(self, model: nn.Module | None = None) -> torch.optim.Optimizer:
        """The workload's optimizer over ``model``'s parameters (default: the workload's model)."""
        params = (model if model is not None else self.model).parameters()
        if self.make_optimizer is None:
            return torch.optim.SGD(params, lr=0.01, momentum=0.9)
        return self.make_optimizer(params)

    def judged_by(self) -> dict[str, Any]:
        """How the tuners are told to judge it, as a user holding it would: ``evaluate=`` where it
        has one, else ``held_out=`` (the tuners then count what an evaluation costs instead of
        timing it, so the same call checkpoints at the same steps whatever the machine's load)."""
        if self.evaluate is not None:
            return {"evaluate": self.evaluate}
        return {"held_out": list(self.held_out)} if self.held_out else {}

    def evaluator(self) -> Evaluator | None:
        """``evaluate``, or the held-out loss when only ``held_out`` is given; None when neither is."""
        if self.evaluate is not None:
            return self.evaluate
        if self.held_out:
            return held_out_loss(self.loss_fn, self.held_out)
        return None


#: the bundled workloads' short module name in model specs (``advisor.workloads:digits``)
BUNDLED_ALIASES = {"advisor.workloads": __name__}


def load_factory(spec: str) -> Callable[[], Workload]:
    """Import ``package.module:factory``; errors say what is wrong and how to write it."""
    if not isinstance(spec, str) or spec.count(":") != 1:
        raise ValueError(f"model factory {spec!r}: write it as 'package.module:function'")
    module_name, attr = spec.split(":")
    module_name = BUNDLED_ALIASES.get(module_name, module_name)
    # like ``python -m``: the user's own modules, run from their project directory
    if os.getcwd() not in sys.path:
        sys.path.append(os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # the user's module may fail in any way while importing
        raise ValueError(f"model factory {spec!r} does not import: {type(exc).__name__}: {exc}") from None
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise ValueError(f"model factory {spec!r}: module {module_name!r} has no callable {attr!r}")
    return factory


def build_workload(spec: str, seed: int = 0) -> Workload:
    factory = load_factory(spec)
    torch.manual_seed(seed)
    workload = factory()
    if not isinstance(workload, Workload):
        raise ValueError(
            f"model factory {spec!r} returned {type(workload).__name__}; it must return advisor.testbed.workloads.Workload"
        )
    return workload


def shard(batches: Iterable[Any], rank: int, world_size: int) -> Iterable[Any]:
    """This rank's share of a workload's batches, as data-parallel ranks see different data:
    batch ``rank``, ``rank + world_size``, ...; an iterable that is not a list is left whole
    (a loader shards itself, with a DistributedSampler)."""
    if isinstance(batches, Sequence) and len(batches) >= world_size > 1:
        return list(batches)[rank::world_size]
    return batches


def _cross_entropy(model: nn.Module, batch) -> torch.Tensor:
    x, y = batch
    return nn.functional.cross_entropy(model(x), y)


def synthetic_batches(shape: tuple[int, ...], classes: int, count: int = 8, seed: int = 0) -> list:
    """Gaussian inputs labelled by a fixed random linear teacher: learnable, and the same rule on
    batches training never sees, so an accuracy trial on held-out batches can see learning."""
    g = torch.Generator().manual_seed(seed)
    teacher = torch.randn(math.prod(shape[1:]), classes, generator=g)
    batches = []
    for _ in range(count):
        x = torch.randn(*shape, generator=g)
        batches.append((x, (x.reshape(shape[0], -1) @ teacher).argmax(1)))
    return batches


def mlp() -> Workload:
    """The 5.3M-parameter MLP the seed study measured (Linear 1024-2048-1024-1024-10), batch 64."""
    model = nn.Sequential(
        nn.Linear(1024, 2048), nn.ReLU(), nn.Linear(2048, 1024), nn.ReLU(),
        nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10),
    )
    return Workload(model, _cross_entropy, synthetic_batches((64, 1024), 10), name="mlp-5.3M")


def small_cnn() -> Workload:
    """A small CNN on 32x32 images (conv weights are 4-D: PowerSGD reshapes them)."""
    model = nn.Sequential(
        nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(64 * 8 * 8, 256), nn.ReLU(), nn.Linear(256, 10),
    )
    return Workload(model, _cross_entropy, synthetic_batches((32, 3, 32, 32), 10), name="cnn")


def compute_bound_cnn() -> Workload:
    """A VGG-style CNN whose backward outweighs its gradient's exchange at 1 Gbit/s (1.9M parameters,
    five 3x3 convolutions up to 192 channels on 32x32 images, batch 32): where PyTorch's hooks can
    reach the compute floor, so whether the advice does too is tested."""
    return Workload(_vgg_cnn(), _cross_entropy, synthetic_batches((32, 3, 32, 32), 10), name="compute-bound-cnn")


def near_floor_cnn() -> Workload:
    """The compute-bound CNN at batch 128: four times the backward for the same gradient, so the
    exchange and the hook's own cost are a few percent of a step and the best PyTorch setting
    lands within 1.05x of the compute floor (issue 23's near-the-floor target needs such a row)."""
    return Workload(_vgg_cnn(), _cross_entropy, synthetic_batches((128, 3, 32, 32), 10), name="near-floor-cnn")


def _vgg_cnn(w: int = 48) -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, w, 3, padding=1), nn.ReLU(),
        nn.Conv2d(w, w, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(w, 2 * w, 3, padding=1), nn.ReLU(),
        nn.Conv2d(2 * w, 2 * w, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(2 * w, 4 * w, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(4 * w * 4 * 4, 512), nn.ReLU(), nn.Linear(512, 10),
    )


class _TinyLM(nn.Module):
    def __init__(self, vocab: int = 2000, dim: int = 128, layers: int = 2, heads: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        block = nn.TransformerEncoderLayer(dim, heads, dim_feedforward=4 * dim, batch_first=True, dropout=0.0)
        self.blocks = nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.embed(tokens)))


def _next_token_loss(model: nn.Module, batch) -> torch.Tensor:
    tokens = batch
    logits = model(tokens[:, :-1])
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


def tiny_lm() -> Workload:
    """A small transformer language model (embedding-heavy: 0.5M of 1.2M parameters)."""
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, 2000, (16, 65), generator=g) for _ in range(8)]
    return Workload(_TinyLM(), _next_token_loss, batches, name="tiny-lm")


class _RecurrentLM(nn.Module):
    """A word-level LSTM language model: embedding, LSTM layers, output (the benchmarks size it up)."""

    def __init__(self, vocab: int = 2000, dim: int = 256, layers: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.rnn = nn.LSTM(dim, dim, layers, batch_first=True)
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.rnn(self.embed(tokens))[0])


def rnn_lm() -> Workload:
    """A small recurrent (LSTM) language model on random tokens (2.1M parameters; its LSTM matrices are 4x tall)."""
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, 2000, (16, 65), generator=g) for _ in range(8)]
    return Workload(_RecurrentLM(), _next_token_loss, batches, name="rnn-lm")


class _DigitsNet(nn.Module):
    """A small CNN for 8x8 digits (~0.3M parameters: convolutions, a wide hidden layer)."""

    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 32, 3, padding=1), nn.ReLU(), nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(),
            nn.MaxPool2d(2), nn.Flatten(),
        )
        self.classifier = nn.Sequential(nn.Linear(64 * 4 * 4, 256), nn.ReLU(), nn.Linear(256, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x.view(-1, 1, 8, 8)))


def digits_data(seed: int = 0, test_fraction: float = 0.25):
    """scikit-learn's digits (ships with it: no download), scaled to [0, 1], split once."""

    data = load_digits()
    x = torch.tensor(data.data / 16.0, dtype=torch.float32)
    y = torch.tensor(data.target, dtype=torch.long)
    idx_train, idx_test = train_test_split(range(len(y)), test_size=test_fraction, random_state=seed,
                                           stratify=data.target)
    return x[idx_train], y[idx_train], x[idx_test], y[idx_test]


def _digits_evaluator(x_test: torch.Tensor, y_test: torch.Tensor) -> Evaluator:
    def evaluate(model: nn.Module) -> dict[str, float]:
        was_training = model.training
        model.eval()
        try:
            with torch.no_grad():
                logits = model(x_test)
        finally:
            model.train(was_training)
        return {"loss": float(nn.functional.cross_entropy(logits, y_test)),
                "accuracy": float((logits.argmax(1) == y_test).float().mean())}

    return evaluate


def digits() -> Workload:
    """The digits CNN on scikit-learn's 8x8 digits: batches of 32 real training images in a
    fixed shuffled order, judged by loss and accuracy on the held-out test split."""
    x, y, x_test, y_test = digits_data()
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))
    batches = [(x[order[i : i + 32]], y[order[i : i + 32]]) for i in range(0, len(y) - 31, 32)]
    return Workload(_DigitsNet(), _cross_entropy, batches, name="digits-cnn",
                    held_out=[(x_test, y_test)], evaluate=_digits_evaluator(x_test, y_test),
                    make_optimizer=lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9),
                    shard=_shard_digits)


def _shard_digits(model: nn.Module) -> None:
    """The convolutions, the classifier, then the root: three ``fully_shard`` groups."""
    from torch.distributed.fsdp import fully_shard

    fully_shard(model.features)
    fully_shard(model.classifier)
    fully_shard(model)


# --- a language model on real text: the Python standard library's own sources ------------------
#: every Python installation ships these files, so the task needs no download
TEXT_VOCAB = 4096
TEXT_CONTEXT = 64
_TOKEN = re.compile(r"[A-Za-z_]+|\d+|\S")


@functools.lru_cache(maxsize=2)
def stdlib_text_corpus(files: int = 120, vocab: int = TEXT_VOCAB) -> tuple[torch.Tensor, torch.Tensor]:
    """(train, held-out) token ids from the first ``files`` top-level stdlib modules, by name.

    Words, numbers and single symbols are tokens; the ``vocab - 1`` most frequent in the
    training files get ids, every other token is 0 (unknown).  Every tenth file is held out,
    so held-out text comes from modules training never reads.
    """
    paths = sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "*.py")))[:files]
    if len(paths) < 20:
        raise RuntimeError(f"the standard library at {sysconfig.get_paths()['stdlib']} has only {len(paths)} "
                           "top-level modules; the text task needs at least 20")
    texts = []
    for path in paths:
        with open(path, encoding="utf-8", errors="replace") as fh:
            texts.append(_TOKEN.findall(fh.read()))
    train = [t for i, t in enumerate(texts) if i % 10 != 0]
    held = [t for i, t in enumerate(texts) if i % 10 == 0]
    counts = Counter(tok for text in train for tok in text)
    ids = {tok: i + 1 for i, (tok, _) in enumerate(counts.most_common(vocab - 1))}

    def encode(group):
        return torch.tensor([ids.get(tok, 0) for text in group for tok in text], dtype=torch.long)

    return encode(train), encode(held)


def _windows(tokens: torch.Tensor, batch: int, context: int) -> list[torch.Tensor]:
    """Non-overlapping (batch, context + 1) windows, in order."""
    per = batch * (context + 1)
    count = len(tokens) // per
    return [tokens[i * per : (i + 1) * per].view(batch, context + 1) for i in range(count)]


class _TextLM(nn.Module):
    """A small pre-norm transformer language model; half its parameters are embedding and output."""

    def __init__(self, vocab: int = TEXT_VOCAB, dim: int = 128, layers: int = 2, heads: int = 4,
                 context: int = TEXT_CONTEXT) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.position = nn.Parameter(torch.randn(context, dim) / math.sqrt(dim))
        block = nn.TransformerEncoderLayer(dim, heads, dim_feedforward=4 * dim, batch_first=True, dropout=0.0,
                                           norm_first=True)
        self.blocks = nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab)
        mask = torch.triu(torch.full((context, context), float("-inf")), diagonal=1)
        self.register_buffer("causal", mask, persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        n = tokens.shape[1]
        h = self.embed(tokens) + self.position[:n]
        h = self.blocks(h, mask=self.causal[:n, :n], is_causal=True)
        return self.head(self.norm(h))


def text_lm_sgd() -> Workload:
    """:func:`text_lm` trained with momentum SGD (lr 0.1), as PowerSGD's authors trained their LMs."""
    workload = text_lm()
    workload.name = "stdlib-text-lm-sgd"
    workload.make_optimizer = lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9)
    return workload


def text_lm() -> Workload:
    """A ~1.5M-parameter transformer LM on the standard library's sources (real text), AdamW
    (lr 2e-3), batches of 16 x 64 tokens, judged by held-out loss on modules it never trains on.

    Windows are shuffled once (fixed seed) and batched: in corpus order every batch would
    come from one module, and the order of modules, not the optimiser, would shape the curve.
    """
    train, held = stdlib_text_corpus()
    windows = torch.stack(_windows(train, 1, TEXT_CONTEXT))[:, 0]
    windows = windows[torch.randperm(len(windows), generator=torch.Generator().manual_seed(0))]
    batches = list(windows[: len(windows) // 16 * 16].split(16))
    held_out = _windows(held, 16, TEXT_CONTEXT)[:4]
    return Workload(_TextLM(), _next_token_loss, batches, name="stdlib-text-lm", held_out=held_out,
                    make_optimizer=lambda params: torch.optim.AdamW(params, lr=2e-3, weight_decay=0.01),
                    shard=_shard_text_lm)


def _shard_text_lm(model: nn.Module) -> None:
    """One ``fully_shard`` group per transformer layer, then the root (embeddings, norm, head)."""
    from torch.distributed.fsdp import fully_shard

    for layer in model.blocks.layers:
        fully_shard(layer)
    fully_shard(model)
