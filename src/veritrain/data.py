"""Data whose batch for step s depends only on (seed, s).

An auditor replays any interval of a run from its committed checkpoint, so ``batch(step)`` must be a pure
function of the step: the same tensors for step 1000 whether or not steps 0..999 ran before it in this
process. An ordinary ``DataLoader`` iterator is not: its next batch depends on how many came before, and
its shuffle on torch's per-device generator. Here steps are numbered globally, epoch ``e = step //
steps_per_epoch``, and epoch e's order is ``randomness.permutation(seed, e, n, domain="data/order")`` (the
counter-based generator: the same bits on every machine); any step's batch is produced directly.

* ``StepBatchSampler``: a ``torch.utils.data`` batch sampler of the index lists of steps start..stop-1.
* ``StepLoader``: ``batch(step)`` (a Task's ``batch=``), ``indices(step)`` (its ``batch_indices=``),
  ``iter_steps(start, stop)`` (a ``DataLoader`` over a range of steps, with workers and prefetching),
  ``StepLoader.from_dataloader(loader, seed)``.
* ``check_pure_batches``: call ``batch(step)`` again and compare (the trainer does, docs/DATA.md).

Docs: docs/DATA.md.
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import torch
import torch.utils.data as tud

from . import randomness
from .task import TaskError

__all__ = ["StepBatchSampler", "StepLoader", "check_pure_batches", "DOMAIN"]

# the same domain as randomness.epoch_order: where the batch size divides the data set (or with
# drop_last), StepLoader's batches are epoch_order's
DOMAIN = "data/order"

# DataLoader arguments that StepLoader sets itself (the order of the examples)
_ORDER_ARGS = ("batch_size", "shuffle", "sampler", "batch_sampler", "drop_last")


def _positive_int(value, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value <= 0:
        raise TaskError(f"{what} must be a positive integer, got {value!r}")
    return int(value)


class StepBatchSampler(tud.Sampler):
    """The example indices of steps ``start .. stop-1`` (``stop=None``: forever), one list per step.

    Step s belongs to epoch ``s // steps_per_epoch``; within epoch e the examples come in the order
    ``randomness.permutation(seed, e, n, domain=DOMAIN)`` (``shuffle=False``: ``range(n)``), cut into
    batches of ``batch_size``. The last batch of an epoch is short, or dropped with ``drop_last``. Any step
    is computed from (seed, step) alone: ``indices(step)`` needs no earlier step.
    """

    def __init__(self, n: int, batch_size: int, *, seed: int, shuffle: bool = True, drop_last: bool = False,
                 start: int = 0, stop: int | None = None):
        self.n = _positive_int(n, "the data set's size")
        self.batch_size = _positive_int(batch_size, "batch_size")
        if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or not -2**63 <= seed < 2**63:
            raise TaskError(f"seed must be an integer (64-bit), got {seed!r}")
        self.seed, self.shuffle, self.drop_last = int(seed), bool(shuffle), bool(drop_last)
        if drop_last and self.n < self.batch_size:
            raise TaskError(f"drop_last with batch_size {self.batch_size} drops every example of a data set of {self.n}")
        self.steps_per_epoch = self.n // self.batch_size if drop_last else math.ceil(self.n / self.batch_size)
        if start < 0 or (stop is not None and stop < start):
            raise ValueError(f"steps {start}..{stop}: need 0 <= start <= stop")
        self.start, self.stop = int(start), (None if stop is None else int(stop))
        self._order = (None, None)  # (epoch, its order): a cache, not state (it is recomputed the same)

    def epoch(self, step: int) -> int:
        return int(step) // self.steps_per_epoch

    def order(self, epoch: int) -> np.ndarray:
        """The order of the examples in ``epoch``."""
        if self._order[0] != epoch:
            perm = randomness.permutation(self.seed, epoch, self.n, DOMAIN) if self.shuffle else np.arange(self.n)
            self._order = (epoch, perm)
        return self._order[1]

    def indices(self, step: int) -> list[int]:
        """The example indices of ``step``."""
        if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or step < 0:
            raise ValueError(f"step must be a non-negative integer, got {step!r}")
        epoch, k = divmod(int(step), self.steps_per_epoch)
        lo = k * self.batch_size
        return self.order(epoch)[lo: min(lo + self.batch_size, self.n)].tolist()

    def __iter__(self):
        steps = itertools.count(self.start) if self.stop is None else range(self.start, self.stop)
        for step in steps:
            yield self.indices(step)

    def __len__(self) -> int:
        if self.stop is None:
            raise TypeError("StepBatchSampler without stop has no length (it runs forever)")
        return self.stop - self.start


class StepLoader:
    """A data set read by step: ``batch(step)`` is the collated batch of ``step`` (StepBatchSampler's
    indices), computed directly, so it can be a Task's ``batch=`` (and ``indices`` its ``batch_indices=``).

    ``iter_steps(start, stop)`` yields ``(step, batch)`` for a range through a ``DataLoader`` (with
    ``num_workers`` and the other ``dataloader_kwargs``: prefetching, pinned memory); its batches are the
    same as ``batch(step)``'s when the data set's ``__getitem__`` is deterministic.
    """

    def __init__(self, dataset, batch_size: int, *, seed: int = 0, shuffle: bool = True, drop_last: bool = False,
                 collate_fn=None, num_workers: int = 0, **dataloader_kwargs):
        _check_map_style(dataset)
        given = sorted(set(dataloader_kwargs) & set(_ORDER_ARGS + ("dataset",)))
        if given:
            raise TaskError(f"StepLoader sets the order of the examples itself; drop {', '.join(given)} "
                            f"(use batch_size=, shuffle=, drop_last= and seed=)")
        self.dataset = dataset
        self.sampler = StepBatchSampler(len(dataset), batch_size, seed=seed, shuffle=shuffle, drop_last=drop_last)
        self.batch_size, self.seed, self.shuffle, self.drop_last = batch_size, seed, shuffle, drop_last
        self.collate_fn = collate_fn if collate_fn is not None else tud.default_collate
        self.num_workers = int(num_workers)
        self.dataloader_kwargs = dict(dataloader_kwargs)

    @property
    def steps_per_epoch(self) -> int:
        return self.sampler.steps_per_epoch

    def __len__(self) -> int:
        """Steps per epoch (as ``len`` of a DataLoader)."""
        return self.sampler.steps_per_epoch

    def epoch(self, step: int) -> int:
        return self.sampler.epoch(step)

    def indices(self, step: int) -> list[int]:
        """The example indices of ``step`` (for the run's data records: ``Task(batch_indices=...)``)."""
        return self.sampler.indices(step)

    def batch(self, step: int):
        """The collated batch of ``step``, as a DataLoader's worker would fetch it."""
        idx = self.indices(step)
        getitems = getattr(self.dataset, "__getitems__", None)
        items = getitems(idx) if getitems else [self.dataset[i] for i in idx]
        return self.collate_fn(items)

    def loader(self, start: int = 0, stop: int | None = None) -> tud.DataLoader:
        """A DataLoader over steps start..stop-1 (stop None: forever)."""
        kwargs = dict(self.dataloader_kwargs)
        # the workers' base seed is drawn from this generator, not from torch's default one
        kwargs.setdefault("generator", torch.Generator().manual_seed(self.seed))
        sampler = StepBatchSampler(self.sampler.n, self.batch_size, seed=self.seed, shuffle=self.shuffle,
                                   drop_last=self.drop_last, start=start, stop=stop)
        return tud.DataLoader(self.dataset, batch_sampler=sampler, collate_fn=self.collate_fn,
                              num_workers=self.num_workers, **kwargs)

    def iter_steps(self, start: int = 0, stop: int | None = None):
        """``(step, batch)`` for steps start..stop-1, through a DataLoader (workers, prefetching)."""
        return zip(itertools.count(start) if stop is None else range(start, stop), self.loader(start, stop))

    @classmethod
    def from_dataloader(cls, loader: tud.DataLoader, seed: int) -> "StepLoader":
        """A StepLoader with ``loader``'s data set, batch size, shuffle (RandomSampler) or not
        (SequentialSampler), drop_last, collate_fn, workers and memory settings; its order is drawn from
        ``seed`` with veritrain's generator (not from torch's, which the loader would use)."""
        if not isinstance(loader, tud.DataLoader):
            raise TaskError(f"from_dataloader expects a torch.utils.data.DataLoader, got {type(loader).__name__}")
        _check_map_style(loader.dataset)
        bs = loader.batch_sampler
        if loader.batch_size is None or type(bs) is not tud.BatchSampler or bs.sampler is not loader.sampler:
            raise TaskError("StepLoader.from_dataloader: the DataLoader has a custom batch_sampler (or "
                            "batch_size=None); supported are DataLoader(dataset, batch_size=B, shuffle=True|False, "
                            "drop_last=...). For another batching, write batch(step) as a function of the step "
                            "(veritrain.randomness gives reproducible draws)")
        sampler = loader.sampler
        if type(sampler) is tud.SequentialSampler:
            shuffle = False
        elif type(sampler) is tud.RandomSampler and not sampler.replacement \
                and sampler.num_samples == len(loader.dataset):
            shuffle = True
        else:
            raise TaskError(f"StepLoader.from_dataloader: the DataLoader's sampler is {type(sampler).__name__}"
                            f"{' (with replacement or num_samples)' if type(sampler) is tud.RandomSampler else ''}"
                            f"; supported are shuffle=True (RandomSampler without replacement) and shuffle=False "
                            f"(SequentialSampler). For another order, write batch(step) as a function of the step "
                            f"(veritrain.randomness gives reproducible draws)")
        kwargs = {"pin_memory": loader.pin_memory, "timeout": loader.timeout,
                  "worker_init_fn": loader.worker_init_fn, "persistent_workers": loader.persistent_workers}
        if loader.num_workers > 0:
            kwargs["multiprocessing_context"] = loader.multiprocessing_context
            kwargs["prefetch_factor"] = loader.prefetch_factor
        for name in ("pin_memory_device", "in_order"):  # newer torch versions
            if hasattr(loader, name):
                kwargs[name] = getattr(loader, name)
        return cls(loader.dataset, loader.batch_size, seed=seed, shuffle=shuffle, drop_last=loader.drop_last,
                   collate_fn=loader.collate_fn, num_workers=loader.num_workers, **kwargs)


def _check_map_style(dataset):
    if isinstance(dataset, tud.IterableDataset):
        raise TaskError(f"{type(dataset).__name__} is an IterableDataset: it has no random access, so the batch "
                        f"of step s cannot be produced without reading the batches before it (an auditor "
                        f"replays any interval). Use a map-style Dataset (__getitem__ and __len__), e.g. "
                        f"load the examples into a list or tensors, or index your shards by position")
    if not hasattr(dataset, "__getitem__") or not hasattr(dataset, "__len__"):
        raise TaskError(f"{type(dataset).__name__} is not a map-style data set: StepLoader needs __getitem__ "
                        f"and __len__")


# --- the purity check -----------------------------------------------------------------------------


def impure_message(name: str, step: int, what: str) -> str:
    return (f"task {name}: batch(step) is not a pure function of step: {what} (it keeps hidden state between "
            f"calls, e.g. it pulls the next batch from a DataLoader iterator or draws from Python's or NumPy's "
            f"global random generator). An auditor replays any interval from its checkpoint, calling batch({step}) "
            f"without the calls before it: index your data by step, e.g. veritrain.data.StepLoader(dataset, "
            f"batch_size, seed=...).batch, and draw randomness with veritrain.randomness (docs/DATA.md)")


def check_pure_batches(batch_fn, steps, *, recorded: dict | None = None, name: str = "task", work_fn=None) -> dict:
    """Check that ``batch_fn(step)`` is a pure function of the step; returns ``{step: (hash, work)}``.

    Calls ``batch_fn(s)`` for each s in ``steps`` in order and hashes the result
    (``commitments.batch_hash``). A step called twice, or found in ``recorded`` (``{step: hash}`` or
    ``{step: (hash, work)}``: what the step trained on), must give the same hash; ``work_fn()``, called after
    each call, describes the work that call did (the trainer: the engine operations and random draws), which
    must be the same too. Raises TaskError naming the step otherwise.
    """
    from .commitments import batch_hash

    seen = {s: (v if isinstance(v, tuple) else (v, None)) for s, v in (recorded or {}).items()}
    earlier = {s: "what step %d trained on" % s for s in seen}
    for s in steps:
        h = batch_hash(batch_fn(s))
        w = work_fn() if work_fn is not None else None
        if s not in seen:
            seen[s], earlier[s] = (h, w), "the first call"
            continue
        h0, w0 = seen[s]
        if h != h0:
            raise TaskError(impure_message(name, s, f"batch({s}) called again returned different data than "
                                                    f"{earlier[s]}"))
        if w0 is not None and w is not None and w != w0:
            did = lambda x: ", ".join(f"{v} {k}" for k, v in x.items())  # noqa: E731
            raise TaskError(impure_message(name, s, f"batch({s}) called again did other work than {earlier[s]} "
                                                    f"({did(w)}, not {did(w0)}: e.g. something built on first use)"))
    return seen
