"""``split_iterable``: this rank's and this DataLoader worker's items of a stream (an ``IterableDataset``).

A stream has no random access, so :class:`~distutils_ml.data.DistributedDataContainer`
cannot partition it by index. Instead every rank, and every DataLoader worker of every
rank, reads the whole stream in the same order and keeps every ``W*K``-th item: rank ``r``
of ``W``, worker ``k`` of ``K``, keeps the items at positions ``i`` with
``i % (W*K) == r*K + k``. By default the stream's last, incomplete group of ``W*K``
items is dropped, so every rank and every worker yields the same number of items and a
training loop runs the same number of steps on every rank. Nothing is communicated.
"""

from __future__ import annotations

import itertools
import numbers
from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np
import torch

from distutils_ml.backends.base import Backend, check_backend
from distutils_ml.observations import describe_value

__all__ = ["IterableShare", "SizedIterableShare", "split_iterable"]

_ALLOWED_DATASET = (
    "an iterable that starts the stream anew at every iter() and yields the same items in the same order on "
    "every rank (a torch IterableDataset, a list, any object with __iter__)"
)
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1


def _check_int(value: Any, name: str, low: int, high: int) -> int:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name}: got {describe_value(value)}; allowed: an int")
    if not low <= int(value) <= high:
        raise ValueError(f"{name}: got {int(value)}; allowed: an int in [{low}, {high}]")
    return int(value)


def _check_dataset(dataset: Any) -> None:
    where = "split_iterable: dataset"
    if isinstance(dataset, (str, bytes)):
        raise TypeError(f"{where}: got {describe_value(dataset)}, text rather than data; allowed: {_ALLOWED_DATASET}")
    if isinstance(dataset, Iterator):
        raise TypeError(
            f"{where}: got the iterator {type(dataset).__qualname__}, which can be read only once (every epoch "
            f"after the first would be empty); allowed: {_ALLOWED_DATASET}. Fix: pass the object that makes the "
            "iterator (an IterableDataset whose __iter__ opens the stream), not a generator or iter(...)"
        )
    if not isinstance(dataset, Iterable):
        fix = (
            "; a map-style dataset (len() and integer indexing) is split by dml.DistributedDataContainer(backend, "
            "dataset)"
            if hasattr(type(dataset), "__getitem__")
            else ""
        )
        raise TypeError(
            f"{where}: got {describe_value(dataset)}, which has no __iter__; allowed: {_ALLOWED_DATASET}{fix}"
        )


def split_iterable(backend: Backend, dataset: Iterable[Any], *, drop_remainder: bool = True) -> IterableShare:
    """This rank's items of the stream ``dataset``, split again among DataLoader workers.

    Rank ``r`` of ``W`` (``backend.rank`` and ``backend.size``, read here), iterating in
    DataLoader worker ``k`` of ``K`` (``K = 1``, ``k = 0`` outside a worker), yields the
    items of ``dataset`` at stream positions ``i`` with ``i % (W*K) == r*K + k``, in stream
    order. Every rank and every worker reads the whole stream, so ``dataset`` must yield
    the same items in the same order in every process, and must not split itself among
    DataLoader workers (``get_worker_info``) or ranks.

    With ``drop_remainder=True`` (the default) only complete groups of ``W*K`` consecutive
    items are yielded: the stream's last partial group (at most ``W*K - 1`` items) is
    dropped, and every rank and worker yields exactly the same number of items, so every
    rank runs the same number of training steps. With ``False`` every item is yielded
    once, by one rank and worker, but counts may differ by one: a rank with one batch more
    would wait forever in that step's collective unless the ranks agree on when to stop.
    Train with ``drop_remainder=True``.

    Nothing is communicated: every rank computes its share alone. The result holds the
    rank and world size, not the backend, so it pickles (DataLoader workers). Its
    ``set_epoch(epoch)`` is passed on to ``dataset.set_epoch`` if ``dataset`` has one (a
    stream that reshuffles every epoch), in this process and in the DataLoader workers'
    copies, persistent ones included; without one it is harmless.

    ``len(share)`` exists when ``dataset`` has ``len()``: the number of items this rank
    yields iterated without DataLoader workers (``len(dataset) // W`` with
    ``drop_remainder``). With ``K`` workers the rank yields ``K * (len(dataset) // (W*K))``
    items with ``drop_remainder``, up to ``K - 1`` fewer.

    Args:
        backend: the backend whose rank and world size define the share.
        dataset: the stream: an ``IterableDataset`` (or any iterable but a one-shot
            iterator) that starts anew at every ``iter()``. Not copied.
        drop_remainder: drop the stream's last incomplete group so every rank and worker
            yields the same number of items.

    Returns:
        An ``IterableDataset`` (a :class:`SizedIterableShare` when ``dataset`` has ``len()``),
        to give to a ``torch.utils.data.DataLoader``.

    Raises:
        TypeError: ``backend`` is not a backend instance, ``dataset`` is not iterable or is
            a one-shot iterator (a generator), or ``drop_remainder`` is not a bool.

    Example:
        >>> class Squares(torch.utils.data.IterableDataset):
        ...     def __iter__(self):
        ...         return (i * i for i in range(5))
        >>> share = dml.split_iterable(backend, Squares())
        >>> [batch.tolist() for batch in torch.utils.data.DataLoader(share, batch_size=2)]  # a world of one: all
        [[0, 1], [4, 9], [16]]
    """
    check_backend(backend, "split_iterable")
    _check_dataset(dataset)
    if not isinstance(drop_remainder, (bool, np.bool_)):
        raise TypeError(
            f"split_iterable: drop_remainder: got {describe_value(drop_remainder)}; allowed: True (every rank yields "
            "the same number of items; train with it) or False (every item once, counts may differ by one)"
        )
    share_type = SizedIterableShare if hasattr(type(dataset), "__len__") else IterableShare
    return share_type(dataset, int(backend.rank), int(backend.size), bool(drop_remainder))


class IterableShare(torch.utils.data.IterableDataset):
    """A rank's items of a stream, split again among DataLoader workers: made by :func:`split_iterable`."""

    def __init__(self, dataset: Iterable[Any], rank: int, world_size: int, drop_remainder: bool) -> None:
        self._dataset = dataset
        self._rank = rank
        self._world_size = world_size
        self._drop_remainder = drop_remainder
        # [set, epoch]: shared memory, so DataLoader workers' copies (persistent ones too) see set_epoch.
        self._epoch_cell = torch.zeros(2, dtype=torch.int64).share_memory_()
        self._applied: int | None = None  # the epoch last passed to this copy's dataset

    @property
    def dataset(self) -> Iterable[Any]:
        """The whole stream, as given."""
        return self._dataset

    @property
    def rank(self) -> int:
        """The rank whose share this is (the backend's rank at construction)."""
        return self._rank

    @property
    def world_size(self) -> int:
        """The number of ranks the stream is split over (the backend's size at construction)."""
        return self._world_size

    @property
    def drop_remainder(self) -> bool:
        """Whether the stream's last incomplete group of ``world_size * workers`` items is dropped."""
        return self._drop_remainder

    def set_epoch(self, epoch: int) -> None:
        """Pass ``epoch`` to the stream's ``set_epoch``, here and in DataLoader workers' copies.

        Call it on every rank before each epoch, as for a ``DistributedSampler``. The
        stream's ``set_epoch`` is called at once in this process, and in each DataLoader
        worker before it next iterates (persistent workers included). A stream without
        ``set_epoch`` is left alone.

        Args:
            epoch: the epoch number, the same on every rank.
        """
        epoch = _check_int(epoch, "set_epoch: epoch", _INT64_MIN, _INT64_MAX)
        self._epoch_cell[1] = epoch
        self._epoch_cell[0] = 1
        self._follow_epoch()

    def _follow_epoch(self) -> None:
        if not int(self._epoch_cell[0]):
            return
        epoch = int(self._epoch_cell[1])
        set_epoch = getattr(self._dataset, "set_epoch", None)
        if set_epoch is not None and epoch != self._applied:
            set_epoch(epoch)
        self._applied = epoch

    def worker_items(self, worker: int, num_workers: int) -> Iterator[Any]:
        """The items worker ``worker`` of ``num_workers`` of this rank yields, in stream order.

        What ``iter(share)`` returns inside a DataLoader worker, with the worker's numbers
        (``0, 1`` outside one): the items at positions ``i`` with ``i % (W*K) ==
        rank*K + worker``, ``W`` the world size and ``K`` = ``num_workers``.

        Raises:
            TypeError: ``worker`` or ``num_workers`` is not an int.
            ValueError: ``num_workers < 1`` or ``worker`` is not in ``0 .. num_workers-1``.
        """
        num_workers = _check_int(num_workers, "worker_items: num_workers", 1, _INT64_MAX)
        worker = _check_int(worker, "worker_items: worker", 0, num_workers - 1)
        return self._items(worker, num_workers)

    def _items(self, worker: int, num_workers: int) -> Iterator[Any]:
        self._follow_epoch()
        group = self._world_size * num_workers
        slot = self._rank * num_workers + worker
        stream = iter(self._dataset)
        if not self._drop_remainder:
            yield from itertools.islice(stream, slot, None, group)
            return
        last = group - 1
        held = None
        for position, item in enumerate(stream):
            place = position % group
            if place == slot:
                held = item
            if place == last:  # the group is complete: its item at this slot is kept
                yield held
                held = None

    def __iter__(self) -> Iterator[Any]:
        info = torch.utils.data.get_worker_info()
        if info is None:
            return self._items(0, 1)
        return self._items(info.id, info.num_workers)

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(rank={self._rank} of {self._world_size}, drop_remainder={self._drop_remainder}, "
            f"dataset={describe_value(self._dataset)})"
        )


class SizedIterableShare(IterableShare):
    """An :class:`IterableShare` of a stream with ``len()``: it has ``len()`` too."""

    def __len__(self) -> int:
        """The number of items this rank yields iterated without DataLoader workers.

        ``len(dataset) // W`` with ``drop_remainder``, else the count of positions ``i <
        len(dataset)`` with ``i % W == rank``. With ``K`` workers and ``drop_remainder`` the
        rank yields ``K * (len(dataset) // (W*K))`` items.
        """
        n = len(self._dataset)  # type: ignore[arg-type]
        if self._drop_remainder:
            return n // self._world_size
        return len(range(self._rank, n, self._world_size))
