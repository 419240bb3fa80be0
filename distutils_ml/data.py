"""``DistributedDataContainer``: this rank's share of a dataset, and its view without the padding.

The partition is exactly that of ``torch.utils.data.DistributedSampler`` for the same
epoch: the (possibly shuffled) index list is padded by repeating its start until its
length is a multiple of the world size, and rank ``r`` takes every ``W``-th index
starting at ``r``. Every rank therefore has the same ``len`` and runs the same number
of steps, whatever the number of observations (Lux's contiguous split leaves the last
rank short, or with no share at all, and a collective then hangs or crashes).

Data follow MLUtils' conventions: an array or tensor holds its observations along the
first axis; a tuple or dict of such holds one observation per member (``(x, y)``); and
anything else with ``len()`` and integer indexing (a list, a torch ``Dataset``) is a
sequence of observations. :mod:`distutils_ml.observations` implements them (``numobs``,
``getobs``, importable from here too).

Exact evaluation: :meth:`DistributedDataContainer.unpadded` is this rank's share without
the padding (a dataset view for a ``DataLoader``); :func:`~distutils_ml.evaluation.gather_unpadded`
gathers the per-observation results computed on it.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from distutils_ml.backends.base import Backend, check_backend
from distutils_ml.observations import (
    Index,
    as_index,
    checked_numobs,
    describe_value,
    getobs,
    getobs_at,
    numobs,
    split_rows,
)

__all__ = ["DistributedDataContainer", "UnpaddedShare", "getobs", "numobs"]

# The seeds torch.Generator.manual_seed accepts.
_SEED_MIN, _SEED_MAX = -(2**63), 2**64 - 1
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1


# -- the container ---------------------------------------------------------------------


def _check_int(value: Any, name: str, low: int, high: int) -> int:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name}: got {describe_value(value)}; allowed: an int")
    if not low <= int(value) <= high:
        raise ValueError(f"{name}: got {int(value)}; allowed: an int in [{low}, {high}]")
    return int(value)


def _check_bool(value: Any, name: str) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name}: got {describe_value(value)}; allowed: True or False")
    return bool(value)


def _out_of_range(i: int, n: int, owner: str = "DistributedDataContainer") -> IndexError:
    return IndexError(f"{owner}: index {i} is out of range for this rank's {n} observations (allowed: {-n} .. {n - 1})")


class DistributedDataContainer(torch.utils.data.Dataset):
    """This rank's share of ``data``, partitioned exactly like ``DistributedSampler``.

    Rank ``r`` of ``W`` takes every ``W``-th index starting at ``r`` of the index list
    (shuffled with ``torch.randperm`` seeded by ``seed + epoch`` when ``shuffle``),
    padded by repeating its start so that every rank has the same ``len``; with
    ``drop_last`` the tail is dropped instead. Each rank computes its share locally:
    construction communicates nothing, but every rank must pass the same data length,
    ``shuffle``, ``seed`` and ``drop_last``.

    Padding duplicates observations held elsewhere. ``num_padded`` (0 or 1) says how
    many of this rank's observations are padding; they are its last ones, so the
    first ``len(ddc) - ddc.num_padded`` observations of every rank together hold each
    observation exactly once. For exact evaluation, iterate over :meth:`unpadded` (a
    dataset view without the padding, for any data and a DataLoader) and gather the
    per-observation results with :func:`gather_unpadded`.

    ``ddc[i]`` is one observation (negative ``i`` counts from the end); ``ddc[batch]``
    with a slice, list or integer array is a batch in ``getobs``'s layout, fetched with
    one call per member. As the dataset of ``torch.utils.data.DataLoader`` (or
    torchdata's ``StatefulDataLoader``), pass ``shuffle=False`` to the loader: the
    container shuffles itself. The loader fetches each batch with one call to
    ``__getitems__``, which returns the list of observations its ``collate_fn``
    expects (with NumPy rows as tensors, as the default collate makes them). Faster
    still, let the loader read whole batches: ``DataLoader(ddc, batch_size=None,
    sampler=BatchSampler(SequentialSampler(ddc), 64, drop_last=False))``.

    The container holds only this rank's number and the world size, not the backend,
    so it pickles (DataLoader workers); the epoch lives in a small shared-memory cell,
    so ``set_epoch`` also reaches the copies held by ``persistent_workers``.

    Args:
        backend: the backend whose rank and world size define the share.
        data: as for :func:`numobs`; not copied.
        shuffle: reshuffle every epoch (see :meth:`set_epoch`).
        seed: the shuffle's seed; the same on every rank.
        drop_last: drop the tail so the length is a multiple of the world size,
            instead of padding.

    Raises:
        TypeError: ``backend`` is not a backend instance, ``data`` is none of the
            allowed kinds, ``seed`` is not an int, ``shuffle`` or ``drop_last`` is not a bool.
        ValueError: members of a tuple / dict ``data`` hold different numbers of observations.

    Example:
        >>> x, y = np.random.rand(100, 3).astype(np.float32), np.arange(100)
        >>> ddc = dml.DistributedDataContainer(backend, (x, y), shuffle=True, seed=42)
        >>> len(ddc), ddc.num_padded  # this rank's share (all of it in a world of one)
        (100, 0)
        >>> loader = torch.utils.data.DataLoader(ddc, batch_size=64)
        >>> for epoch in range(2):
        ...     ddc.set_epoch(epoch)  # a new shuffle, the same on every rank
        ...     for xb, yb in loader:
        ...         pass
        >>> xb.shape, yb.shape
        (torch.Size([36, 3]), torch.Size([36]))
    """

    def __init__(
        self, backend: Backend, data: Any, *, shuffle: bool = False, seed: int = 0, drop_last: bool = False
    ) -> None:
        check_backend(backend, "DistributedDataContainer")
        n = checked_numobs(data, "DistributedDataContainer")
        self._seed = _check_int(seed, "DistributedDataContainer: seed", _SEED_MIN, _SEED_MAX)
        self._shuffle = _check_bool(shuffle, "DistributedDataContainer: shuffle")
        self._drop_last = _check_bool(drop_last, "DistributedDataContainer: drop_last")
        self._data = data
        self._rank = int(backend.rank)
        self._world_size = int(backend.size)
        self._n = n
        self._sizes(0)
        self._epoch_cell = torch.zeros(2, dtype=torch.int64).share_memory_()  # (epoch, start)
        self._attach()

    def _sizes(self, start: int) -> None:
        """This rank's share of the epoch's index list after its first ``start`` positions."""
        n, w = self._n, self._world_size
        rest = max(0, n - start)
        # DistributedSampler's arithmetic: ceil(rest / W), or floor(rest / W) with drop_last.
        self._num_samples = rest // w if self._drop_last else -(-rest // w)
        self._total_size = self._num_samples * w
        # Positions >= N of the padded list are padding; this rank's are its last ones.
        own = max(0, -(-(rest - self._rank) // w))
        self._num_padded = self._num_samples - min(self._num_samples, own)
        self._sized = start

    def _attach(self) -> None:
        self._epoch_view = self._epoch_cell.numpy()
        epoch, start = (int(v) for v in self._epoch_view)
        self._cache: tuple[tuple[int, int], np.ndarray] = ((epoch, start), self._partition(epoch, start))

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        del state["_epoch_view"], state["_cache"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._attach()

    def _order(self, epoch: int) -> np.ndarray:
        """The index list of ``epoch`` before padding: a permutation of ``0 .. N-1`` (int64)."""
        if self._shuffle:
            gen = torch.Generator().manual_seed(self._seed + epoch)
            return torch.randperm(self._n, generator=gen).numpy()
        return np.arange(self._n, dtype=np.int64)

    def _partition(self, epoch: int, start: int) -> np.ndarray:
        """This rank's global indices for ``epoch`` resumed after ``start`` positions, as a read-only int64 array."""
        if start != self._sized:
            self._sizes(start)
        n = self._n
        order = self._order(epoch)
        positions = start + np.arange(self._rank, self._total_size, self._world_size, dtype=np.int64)
        mine = order[positions % n] if n else positions
        mine.setflags(write=False)
        return mine

    def _current(self) -> np.ndarray:
        key, indices = self._cache
        now = (int(self._epoch_view[0]), int(self._epoch_view[1]))
        if now != key:  # set_epoch was called here or, for a worker's copy, in the parent
            indices = self._partition(*now)
            self._cache = (now, indices)
        return indices

    @property
    def data(self) -> Any:
        """The whole dataset, as given (every rank holds it; the container reads its share)."""
        return self._data

    @property
    def shuffle(self) -> bool:
        """Whether the index list is shuffled every epoch."""
        return self._shuffle

    @property
    def seed(self) -> int:
        """The shuffle's seed: epoch ``e`` is ordered by ``torch.randperm`` seeded with ``seed + e``."""
        return self._seed

    @property
    def drop_last(self) -> bool:
        """Whether the tail is dropped (instead of padding) to split the data evenly."""
        return self._drop_last

    @property
    def num_padded(self) -> int:
        """How many of this rank's observations are padding (0 or 1): its last ones.

        The first ``len(ddc) - ddc.num_padded`` observations of all ranks together hold
        every observation exactly once (:meth:`unpadded` is a view of them). Always 0
        with ``drop_last``.
        """
        self._current()  # the sizes of the current (epoch, start)
        return self._num_padded

    @property
    def rank(self) -> int:
        """The rank whose share this is (the backend's rank at construction)."""
        return self._rank

    @property
    def world_size(self) -> int:
        """The number of ranks the data is split over (the backend's size at construction)."""
        return self._world_size

    @property
    def num_observations(self) -> int:
        """The number of observations in the whole dataset (``numobs(data)``)."""
        return self._n

    def placement(self) -> tuple[np.ndarray, np.ndarray]:
        """For each observation kept this epoch, in ascending global index: the rank that holds it and its row
        there (two int64 arrays; with ``drop_last`` the dropped tail is left out, padding never appears)."""
        self._current()  # the sizes of the current (epoch, start)
        n, w, m, start = self._n, self._world_size, self._num_samples, self.start
        kept = m * w if self._drop_last else max(0, n - start)  # positions of the index list that are not padding
        positions = np.arange(kept, dtype=np.int64)
        if self._shuffle or start:
            positions = np.argsort(self._order(self.epoch)[start : start + kept], kind="stable")
        return positions % w, positions // w

    @property
    def epoch(self) -> int:
        """The epoch whose partition the container holds (see :meth:`set_epoch`)."""
        return int(self._epoch_view[0])

    @property
    def start(self) -> int:
        """How many positions of the epoch's index list came before this partition (:meth:`set_epoch`); 0 unless
        an epoch was resumed part way."""
        return int(self._epoch_view[1])

    @property
    def indices(self) -> np.ndarray:
        """This rank's global indices for the current epoch: a read-only 1-D int64 array."""
        return self._current()

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        """Take the partition of ``epoch``: with ``shuffle``, the order seeded by ``seed + epoch``.

        Call it on every rank before each epoch (with ``DistributedSampler``'s rule: the
        same epoch gives the same order). DataLoader workers' copies of the container
        follow, including persistent ones.

        ``start`` resumes an epoch part way: the epoch's index list without its first ``start`` positions is
        partitioned as a whole epoch is (padded by repeating the start of the epoch's order). After each of W ranks
        consumed its first k observations of the epoch, those are exactly the first ``k * W`` positions, so
        ``set_epoch(epoch, k * W)`` gives each of the same W ranks the rest of its own share, and W' other ranks
        the rest of the epoch split over them, each observation once (:class:`~distutils_ml.TrainState` does
        this).

        Args:
            epoch: the epoch number, the same on every rank.
            start: positions of the epoch's index list already consumed, 0 to ``numobs(data)``.

        Example:
            >>> ddc = dml.DistributedDataContainer(backend, np.arange(10), shuffle=True)
            >>> ddc.set_epoch(3)  # before each epoch's loop, on every rank
        """
        epoch = _check_int(epoch, "set_epoch: epoch", _INT64_MIN, _INT64_MAX)
        if not _SEED_MIN <= self._seed + epoch <= _SEED_MAX:
            raise ValueError(
                f"set_epoch: epoch: got {epoch}; seed + epoch = {self._seed + epoch} must lie in "
                f"[{_SEED_MIN}, {_SEED_MAX}] (torch.Generator.manual_seed)"
            )
        start = _check_int(start, "set_epoch: start", 0, self._n)
        self._epoch_view[1] = start
        self._epoch_view[0] = epoch
        self._current()

    def unpadded(self) -> UnpaddedShare:
        """This rank's share without its padding: a dataset view of its first ``len - num_padded`` observations.

        The views of all ranks together hold every observation exactly once (with
        ``drop_last``: every observation not dropped), so evaluation over them is exact.
        It works with any data and as the dataset of a ``DataLoader``, indexes like the
        container, and follows :meth:`set_epoch`. Gather the per-observation results
        with :func:`gather_unpadded`.

        Returns:
            A view of this container (nothing is copied).

        Example:
            >>> data = torch.utils.data.TensorDataset(torch.randn(10, 3), torch.arange(10))
            >>> share = dml.DistributedDataContainer(backend, data)
            >>> loader = torch.utils.data.DataLoader(share.unpadded(), batch_size=4)
            >>> [len(yb) for xb, yb in loader]  # a world of one: all 10, no padding
            [4, 4, 2]
        """
        return UnpaddedShare(self)

    def __len__(self) -> int:
        self._current()  # the sizes of the current (epoch, start)
        return self._num_samples

    def _global(self, index: slice | np.ndarray) -> np.ndarray:
        """The global indices at local positions ``index`` (a slice or an int64 array)."""
        indices = self._current()
        if isinstance(index, slice):
            return indices[index].copy()
        try:
            return indices[index]
        except IndexError:
            n = self._num_samples
            raise _out_of_range(int(index[(index < -n) | (index >= n)][0]), n) from None

    def __getitem__(self, idx: Index) -> Any:
        """One observation (``idx`` an int), or a batch (``idx`` a slice, list or integer array).

        Args:
            idx: a local position ``0 .. len-1`` (negative counts from the end), or a batch of them.

        Returns:
            ``getobs(data, global_index)``: an observation, or a batch in ``getobs``'s layout.

        Raises:
            IndexError: a position is out of range.
            TypeError: ``idx`` is not an integer index or batch of indices.
        """
        index = as_index(idx, "DistributedDataContainer: index")
        if isinstance(index, int):
            indices = self._current()  # first: it refreshes the sizes (a worker's copy follows set_epoch)
            n = self._num_samples
            if not -n <= index < n:
                raise _out_of_range(index, n)
            return getobs_at(self._data, int(indices[index]))
        return getobs_at(self._data, self._global(index))

    def __getitems__(self, indices: Sequence[int]) -> list[Any]:
        """The observations at local positions ``indices``, fetched as one batch.

        torch's DataLoader calls this with each batch of positions and hands the result
        to its ``collate_fn``, which expects a list of observations: the batch is read
        with one call per member (fancy indexing for arrays and tensors), then split
        into per-observation views. Rows of numeric NumPy arrays come as tensors
        sharing their memory, which the default collate stacks in one call (it would
        convert NumPy rows one by one, to the same tensors).

        Args:
            indices: local positions.

        Returns:
            A list of observations, ``[ddc[i] for i in indices]`` with NumPy numbers as tensors.
        """
        index = as_index(indices, "DistributedDataContainer.__getitems__: indices")
        if isinstance(index, int):
            index = np.array([index], dtype=np.int64)
        return split_rows(self._data, getobs_at(self._data, self._global(index)))

    def __repr__(self) -> str:
        return (
            f"DistributedDataContainer(rank={self._rank} of {self._world_size}, len={len(self)}, "
            f"num_padded={self._num_padded}, epoch={self.epoch}, shuffle={self._shuffle}, seed={self._seed}, "
            f"drop_last={self._drop_last}, numobs(data)={self._n})"
        )


class UnpaddedShare(torch.utils.data.Dataset):
    """This rank's share without its padding: the first ``len(share) - share.num_padded`` observations.

    Made by :meth:`DistributedDataContainer.unpadded`. A map-style dataset that indexes
    like the container (an int gives one observation, a slice, list or integer array a
    batch in ``getobs``'s layout) and feeds a ``DataLoader`` the same way, with any data
    (arrays, tuples / dicts, any map-style dataset such as ``TensorDataset``). It reads
    the container's current epoch, so it follows :meth:`~DistributedDataContainer.set_epoch`,
    and it pickles (DataLoader workers).

    Ranks' views may differ in length by one: a loop over them runs a different number
    of steps on different ranks, so put no collective inside it; gather the results
    after the loop with :func:`gather_unpadded`.
    """

    def __init__(self, container: DistributedDataContainer) -> None:
        if not isinstance(container, DistributedDataContainer):
            raise TypeError(
                f"UnpaddedShare: container: got {describe_value(container)}; allowed: a DistributedDataContainer "
                "(call share.unpadded())"
            )
        self._container = container

    @property
    def container(self) -> DistributedDataContainer:
        """The container this is a view of."""
        return self._container

    @property
    def _len(self) -> int:
        container = self._container
        container._current()  # the sizes of its current (epoch, start)
        return len(container) - container.num_padded

    @property
    def indices(self) -> np.ndarray:
        """The global indices of this view's observations for the current epoch (read-only int64)."""
        return self._container.indices[: self._len]

    def __len__(self) -> int:
        return self._len

    def _positions(self, index: slice | np.ndarray) -> np.ndarray:
        """Container positions of the view positions ``index`` (negative ones count from the view's end)."""
        n = self._len
        if isinstance(index, slice):
            return np.arange(n, dtype=np.int64)[index]
        outside = (index < -n) | (index >= n)
        if outside.any():
            raise _out_of_range(int(index[outside][0]), n, "UnpaddedShare")
        return np.where(index < 0, index + n, index)

    def __getitem__(self, idx: Index) -> Any:
        """One observation (``idx`` an int), or a batch (a slice, list or integer array), as the container's.

        Raises:
            IndexError: a position is out of range (``-len .. len-1``).
            TypeError: ``idx`` is not an integer index or batch of indices.
        """
        index = as_index(idx, "UnpaddedShare: index")
        if isinstance(index, int):
            n = self._len
            if not -n <= index < n:
                raise _out_of_range(index, n, "UnpaddedShare")
            return self._container[index + n if index < 0 else index]
        return self._container[self._positions(index)]

    def __getitems__(self, indices: Sequence[int]) -> list[Any]:
        """The observations at positions ``indices`` as a list, fetched as one batch (what a DataLoader calls)."""
        index = as_index(indices, "UnpaddedShare.__getitems__: indices")
        if isinstance(index, int):
            index = np.array([index], dtype=np.int64)
        return self._container.__getitems__(self._positions(index))

    def __repr__(self) -> str:
        return f"UnpaddedShare(len={self._len}, of {self._container!r})"
