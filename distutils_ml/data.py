"""``DistributedDataContainer``: this rank's share of a dataset; ``numobs`` and ``getobs``.

The partition is exactly that of ``torch.utils.data.DistributedSampler`` for the same
epoch: the (possibly shuffled) index list is padded by repeating its start until its
length is a multiple of the world size, and rank ``r`` takes every ``W``-th index
starting at ``r``. Every rank therefore has the same ``len`` and runs the same number
of steps, whatever the number of observations (Lux's contiguous split leaves the last
rank short, or with no share at all, and a collective then hangs or crashes).

Data follow MLUtils' conventions: an array or tensor holds its observations along the
first axis; a tuple or dict of such holds one observation per member (``(x, y)``); and
anything else with ``len()`` and integer indexing (a list, a torch ``Dataset``) is a
sequence of observations.

Exact evaluation: :meth:`DistributedDataContainer.unpadded` is this rank's share without
the padding (a dataset view for a ``DataLoader``), and :func:`gather_unpadded` gathers
per-observation results of every rank onto every rank, in the dataset's order, without
the padded duplicates (Accelerate's ``gather_for_metrics``).
"""

from __future__ import annotations

import numbers
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from distutils_ml.arrays import unusual_tensor
from distutils_ml.backends.base import Backend, check_backend
from distutils_ml.collectives import allgather
from distutils_ml.objects import allgather_object, exclusive

__all__ = ["DistributedDataContainer", "UnpaddedShare", "gather_unpadded", "getobs", "numobs"]

#: What ``getobs`` and container indexing accept besides an int: a batch of indices.
Index = int | slice | Sequence[int] | np.ndarray | torch.Tensor

_ALLOWED_DATA = (
    "a NumPy array or torch.Tensor of at least one dimension (observations along the first axis), "
    "anything with len() and integer indexing (a list, a map-style torch Dataset), or a tuple / dict of those"
)
_ALLOWED_INDEX = "an int, a slice, a list or range of ints, or a 1-D integer NumPy array or torch.Tensor"
# The seeds torch.Generator.manual_seed accepts.
_SEED_MIN, _SEED_MAX = -(2**63), 2**64 - 1
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1


# -- numobs / getobs -------------------------------------------------------------------


def numobs(data: Any) -> int:
    """The number of observations in ``data``.

    Args:
        data: an array or tensor (observations along the first axis), anything with
            ``len()`` and integer indexing, or a tuple / dict of those.

    Returns:
        The length of the first axis, ``len(data)``, or for a tuple / dict the count its
        members share.

    Raises:
        TypeError: ``data`` is none of the allowed kinds.
        ValueError: members of a tuple / dict hold different numbers of observations.

    Example:
        >>> dml.numobs((np.zeros((10, 3)), np.arange(10)))
        10
    """
    return _numobs(data, "numobs")


def getobs(data: Any, idx: Index) -> Any:
    """Observation ``idx`` of ``data``, or a batch of observations.

    An int gives one observation (for a tuple / dict: a tuple / dict of one observation
    per member). A slice, list, range or integer array gives a batch, fetched with one
    call per member: fancy indexing for arrays and tensors, the dataset's
    ``__getitems__`` when it has one (as torch's DataLoader does), else a list of
    ``data[i]``. Indices are passed to the members as given, so their bounds and
    negative-index rules apply.

    Args:
        data: as for :func:`numobs`.
        idx: an int, slice, list or range of ints, or a 1-D integer array / tensor.

    Returns:
        One observation, or a batch: an array / tensor for array members, a list for
        generic datasets, a tuple / dict of member batches for a tuple / dict.

    Raises:
        TypeError: ``idx`` is not an integer index or batch of indices.

    Example:
        >>> x, y = np.arange(12).reshape(6, 2), ["a", "b", "c", "d", "e", "f"]
        >>> dml.getobs((x, y), 5)
        (array([10, 11]), 'f')
        >>> dml.getobs((x, y), [0, 5])[1]
        ['a', 'f']
    """
    return _getobs(data, _as_index(idx, "getobs: idx"))


def _describe(x: Any) -> str:
    if isinstance(x, (np.ndarray, torch.Tensor)):
        return f"a {len(x.shape)}-d {type(x).__module__.split('.')[0]}.{type(x).__name__} of shape {tuple(x.shape)}"
    text = repr(x)
    return f"{type(x).__qualname__} {text[:60] + '...' if len(text) > 60 else text}"


def _numobs(data: Any, caller: str, name: str = "data") -> int:
    """``numobs`` whose errors start with ``caller`` and name ``data`` as ``name`` (``data[0]['x']``)."""
    if isinstance(data, (np.ndarray, torch.Tensor)):
        if data.ndim == 0:
            raise TypeError(
                f"{caller}: {name}: got {_describe(data)}, which has no observation axis; allowed: {_ALLOWED_DATA}"
            )
        return int(data.shape[0])
    if isinstance(data, tuple):
        members = [(f"{name}[{i}]", m) for i, m in enumerate(data)]
    elif isinstance(data, Mapping):
        members = [(f"{name}[{k!r}]", m) for k, m in data.items()]
    else:
        _check_generic(data, f"{caller}: {name}")
        return len(data)
    if not members:
        raise ValueError(
            f"{caller}: {name}: got an empty {type(data).__name__}; a tuple / dict needs at least one member"
        )
    counts = [(member, _numobs(m, caller, member)) for member, m in members]
    if any(c != counts[0][1] for _, c in counts):
        listed = ", ".join(f"{member} has {c}" for member, c in counts)
        raise ValueError(
            f"{caller}: {name}: members hold different numbers of observations: {listed}; "
            "every member needs the same number of observations along its first axis"
        )
    return counts[0][1]


def _check_generic(data: Any, where: str) -> None:
    if isinstance(data, (str, bytes)):
        raise TypeError(
            f"{where}: got {_describe(data)}, text rather than data (load it first); allowed: {_ALLOWED_DATA}"
        )
    if isinstance(data, torch.utils.data.IterableDataset):
        raise TypeError(
            f"{where}: got the IterableDataset {type(data).__qualname__}, which has no random access; "
            f"allowed: {_ALLOWED_DATA}"
        )
    kind = type(data)
    missing = [m for m in ("__len__", "__getitem__") if not hasattr(kind, m)]
    if missing:
        raise TypeError(
            f"{where}: got {_describe(data)}, which has no {' or '.join(missing)}; allowed: {_ALLOWED_DATA}"
        )


def _as_index(idx: Any, name: str) -> int | slice | np.ndarray:
    """``idx`` as an int, a slice, or a 1-D int64 array."""
    if isinstance(idx, (bool, np.bool_)):
        raise TypeError(f"{name}: got the bool {idx!r}; allowed: {_ALLOWED_INDEX}")
    if isinstance(idx, (int, np.integer)):
        return int(idx)
    if isinstance(idx, slice):
        return idx
    if isinstance(idx, range):
        return np.arange(idx.start, idx.stop, idx.step, dtype=np.int64)
    if isinstance(idx, torch.Tensor):
        arr = idx.detach().cpu().numpy()
    elif isinstance(idx, np.ndarray):
        arr = idx
    elif isinstance(idx, list):
        arr = np.asarray(idx) if idx else np.empty(0, dtype=np.int64)
    else:
        raise TypeError(f"{name}: got {_describe(idx)}; allowed: {_ALLOWED_INDEX}")
    if arr.dtype.kind not in "iu" or arr.ndim > 1:
        raise TypeError(f"{name}: got {_describe(arr)} of dtype {arr.dtype}; allowed: {_ALLOWED_INDEX}")
    if arr.ndim == 0:
        return int(arr)
    return arr.astype(np.int64, copy=False)


def _getobs(data: Any, index: int | slice | np.ndarray) -> Any:
    """``getobs`` on a normalized index (see :func:`_as_index`)."""
    if isinstance(data, np.ndarray):
        return data[index]
    if isinstance(data, torch.Tensor):
        if isinstance(index, np.ndarray):
            # from_numpy shares memory and warns on read-only arrays: copy those.
            index = torch.from_numpy(index if index.flags.writeable else index.copy())
        return data[index]
    if isinstance(data, tuple):
        items = [_getobs(m, index) for m in data]
        return type(data)(*items) if hasattr(type(data), "_fields") else tuple(items)
    if isinstance(data, Mapping):
        return {k: _getobs(m, index) for k, m in data.items()}
    if isinstance(index, int):
        return data[index]
    positions = list(range(len(data))[index]) if isinstance(index, slice) else index.tolist()
    getitems = getattr(data, "__getitems__", None)
    if getitems is not None:
        return getitems(positions)
    return [data[i] for i in positions]


def _rows(data: Any, batch: Any) -> list[Any]:
    """Split ``batch`` (``_getobs(data, index_array)``) into a list of single observations.

    Numeric NumPy batches are split as tensors (views of ``torch.from_numpy``): torch's
    default collate turns each NumPy row into a tensor anyway, one slow call per row;
    tensor rows it stacks at once, with the same dtype and values.
    """
    if isinstance(data, np.ndarray):
        if batch.dtype.kind in "biufc" and batch.dtype.isnative:
            return list(torch.from_numpy(batch).unbind(0))
        return list(batch)
    if isinstance(data, torch.Tensor):
        return list(batch.unbind(0))
    if isinstance(data, tuple):
        columns = [_rows(m, b) for m, b in zip(data, batch, strict=True)]
        if hasattr(type(data), "_fields"):
            return [type(data)(*row) for row in zip(*columns, strict=True)]
        return list(zip(*columns, strict=True))
    if isinstance(data, Mapping):
        keys = list(data)
        columns = [_rows(data[k], batch[k]) for k in keys]
        return [dict(zip(keys, row, strict=True)) for row in zip(*columns, strict=True)]
    return list(batch)


# -- the container ---------------------------------------------------------------------


def _check_int(value: Any, name: str, low: int, high: int) -> int:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name}: got {_describe(value)}; allowed: an int")
    if not low <= int(value) <= high:
        raise ValueError(f"{name}: got {int(value)}; allowed: an int in [{low}, {high}]")
    return int(value)


def _check_bool(value: Any, name: str) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name}: got {_describe(value)}; allowed: True or False")
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
        n = _numobs(data, "DistributedDataContainer")
        self._seed = _check_int(seed, "DistributedDataContainer: seed", _SEED_MIN, _SEED_MAX)
        self._shuffle = _check_bool(shuffle, "DistributedDataContainer: shuffle")
        self._drop_last = _check_bool(drop_last, "DistributedDataContainer: drop_last")
        self._data = data
        self._rank = int(backend.rank)
        self._world_size = int(backend.size)
        self._n = n
        w = self._world_size
        # DistributedSampler's arithmetic: ceil(N / W), or floor(N / W) with drop_last.
        self._num_samples = n // w if drop_last else -(-n // w)
        self._total_size = self._num_samples * w
        # Positions >= N of the padded list are padding; this rank's are its last ones.
        own = max(0, -(-(n - self._rank) // w))
        self._num_padded = self._num_samples - min(self._num_samples, own)
        self._epoch_cell = torch.zeros(1, dtype=torch.int64).share_memory_()
        self._attach()

    def _attach(self) -> None:
        self._epoch_view = self._epoch_cell.numpy()
        self._cache: tuple[int, np.ndarray] = (int(self._epoch_view[0]), self._partition(int(self._epoch_view[0])))

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

    def _partition(self, epoch: int) -> np.ndarray:
        """This rank's global indices for ``epoch``, as a read-only int64 array."""
        n = self._n
        order = self._order(epoch)
        positions = np.arange(self._rank, self._total_size, self._world_size, dtype=np.int64)
        mine = order[positions % n] if n else positions
        mine.setflags(write=False)
        return mine

    def _current(self) -> np.ndarray:
        epoch, indices = self._cache
        now = self._epoch_view[0]
        if now != epoch:  # set_epoch was called here or, for a worker's copy, in the parent
            now = int(now)
            indices = self._partition(now)
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
        return self._num_padded

    @property
    def epoch(self) -> int:
        """The epoch whose partition the container holds (see :meth:`set_epoch`)."""
        return int(self._epoch_view[0])

    @property
    def indices(self) -> np.ndarray:
        """This rank's global indices for the current epoch: a read-only 1-D int64 array."""
        return self._current()

    def set_epoch(self, epoch: int) -> None:
        """Take the partition of ``epoch``: with ``shuffle``, the order seeded by ``seed + epoch``.

        Call it on every rank before each epoch (with ``DistributedSampler``'s rule: the
        same epoch gives the same order). DataLoader workers' copies of the container
        follow, including persistent ones.

        Args:
            epoch: the epoch number, the same on every rank.

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
        index = _as_index(idx, "DistributedDataContainer: index")
        if isinstance(index, int):
            n = self._num_samples
            if not -n <= index < n:
                raise _out_of_range(index, n)
            return _getobs(self._data, int(self._current()[index]))
        return _getobs(self._data, self._global(index))

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
        index = _as_index(indices, "DistributedDataContainer.__getitems__: indices")
        if isinstance(index, int):
            index = np.array([index], dtype=np.int64)
        return _rows(self._data, _getobs(self._data, self._global(index)))

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
                f"UnpaddedShare: container: got {_describe(container)}; allowed: a DistributedDataContainer "
                "(call share.unpadded())"
            )
        self._container = container
        self._len = len(container) - container.num_padded

    @property
    def container(self) -> DistributedDataContainer:
        """The container this is a view of."""
        return self._container

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
        index = _as_index(idx, "UnpaddedShare: index")
        if isinstance(index, int):
            n = self._len
            if not -n <= index < n:
                raise _out_of_range(index, n, "UnpaddedShare")
            return self._container[index + n if index < 0 else index]
        return self._container[self._positions(index)]

    def __getitems__(self, indices: Sequence[int]) -> list[Any]:
        """The observations at positions ``indices`` as a list, fetched as one batch (what a DataLoader calls)."""
        index = _as_index(indices, "UnpaddedShare.__getitems__: indices")
        if isinstance(index, int):
            index = np.array([index], dtype=np.int64)
        return self._container.__getitems__(self._positions(index))

    def __repr__(self) -> str:
        return f"UnpaddedShare(len={self._len}, of {self._container!r})"


# -- gathering per-observation results ------------------------------------------------------


_ALLOWED_VALUES = (
    "a torch.Tensor or NumPy array with one row per observation (along the first axis), a list with one "
    "entry per observation, or a tuple / dict of those"
)


class _Problem(Exception):
    """A rank's own problem with its arguments, sent to every rank before any data moves."""

    def __init__(self, kind: type[Exception], message: str) -> None:
        super().__init__(message)
        self.kind = kind


def _leaf_spec(leaf: Any, name: str, padded: int, unpadded: int) -> tuple[Any, ...]:
    """One leaf's (name, kind, dtype to agree on, row shape, device type, length, dtype)."""
    if isinstance(leaf, list):
        kind, dtype, rows, device = "list", None, (), None
    elif isinstance(leaf, torch.Tensor):
        unusual = unusual_tensor(leaf, f"values{name}", in_place=False)
        if unusual is not None:
            raise _Problem(TypeError, str(unusual))
        kind, dtype, rows, device = "tensor", leaf.dtype, tuple(leaf.shape[1:]), leaf.device.type
    elif isinstance(leaf, np.ndarray):
        kind = "object array" if leaf.dtype.hasobject else "array"
        # Text arrays may differ in width across ranks (the longest string): compared by kind, gathered at the widest.
        text = leaf.dtype.kind in "US"
        dtype, rows, device = np.dtype(leaf.dtype.char) if text else leaf.dtype, leaf.shape[1:], None
    else:
        raise _Problem(TypeError, f"values{name}: got {_describe(leaf)}; allowed: {_ALLOWED_VALUES}")
    if kind != "list" and leaf.ndim == 0:
        raise _Problem(
            TypeError, f"values{name}: got {_describe(leaf)}, which has no observation axis; allowed: {_ALLOWED_VALUES}"
        )
    if len(leaf) not in (padded, unpadded):
        allowed = f"{padded}" if padded == unpadded else f"{padded} (the share) or {unpadded} (share.unpadded())"
        hint = " (concatenate per-batch results first, e.g. with torch.cat)" if kind == "list" else ""
        raise _Problem(
            ValueError,
            f"values{name}: got {len(leaf)} observations; allowed: {allowed}, one result per observation of "
            f"this rank's share or of its unpadded view{hint}",
        )
    return name, kind, dtype, rows, device, len(leaf), getattr(leaf, "dtype", None)


def _flatten(values: Any, name: str, padded: int, unpadded: int, leaves: list[Any]) -> Any:
    """The layout of ``values`` (tuples / dicts), to compare across ranks; appends each leaf's (spec, value)."""
    if isinstance(values, tuple):
        members = [_flatten(v, f"{name}[{i}]", padded, unpadded, leaves) for i, v in enumerate(values)]
        return (type(values).__qualname__, members)
    if isinstance(values, Mapping):
        keys = list(values)
        return ("dict", keys, [_flatten(values[k], f"{name}[{k!r}]", padded, unpadded, leaves) for k in keys])
    leaves.append((_leaf_spec(values, name, padded, unpadded), values))
    return "leaf"


def _rebuild(template: Any, leaves: Iterator[Any]) -> Any:
    """``template`` with its leaves replaced by the next items of ``leaves``."""
    if isinstance(template, tuple):
        items = [_rebuild(v, leaves) for v in template]
        return type(template)(*items) if hasattr(type(template), "_fields") else type(template)(items)
    if isinstance(template, Mapping):
        return {k: _rebuild(v, leaves) for k, v in template.items()}
    return next(leaves)


def _share_facts(share: Any, backend: Backend) -> tuple[DistributedDataContainer, tuple[Any, ...]]:
    """The container behind ``share``, and the facts about its partition every rank must share."""
    container = share.container if isinstance(share, UnpaddedShare) else share
    if not isinstance(container, DistributedDataContainer):
        raise _Problem(
            TypeError,
            f"share: got {_describe(share)}; allowed: the DistributedDataContainer the values were computed on "
            "(or its unpadded() view)",
        )
    if (container._rank, container._world_size) != (backend.rank, backend.size):
        raise _Problem(
            ValueError,
            f"share: it was built for rank {container._rank} of {container._world_size}, but this is rank "
            f"{backend.rank} of {backend.size}: pass the container this rank built with this backend",
        )
    return container, (container._n, container._shuffle, container._seed, container._drop_last, container.epoch)


_FACTS = ("numobs(data)", "shuffle", "seed", "drop_last", "epoch")


def _verdict(reports: list[tuple[Any, ...]]) -> tuple[type[Exception], str] | None:
    """The first problem of any rank, the same on every rank (they all see the same reports)."""
    for rank, (problem, *_) in enumerate(reports):
        if problem is not None:
            return problem[0], f"rank {rank}: {problem[1]}"
    facts = [r[1] for r in reports]
    for k, what in enumerate(_FACTS):
        if len({f[k] for f in facts}) > 1:
            listed = ", ".join(f"rank {r}: {f[k]!r}" for r, f in enumerate(facts))
            return ValueError, (
                f"share: the ranks' containers differ in {what} ({listed}); every rank must build its container "
                "from the same data and options and call set_epoch with the same epoch"
            )
    structures = [r[2] for r in reports]
    for rank, structure in enumerate(structures):
        if structure != structures[0]:
            return TypeError, (
                f"values: rank {rank} passes a different structure than rank 0 ({structure!r} vs {structures[0]!r}); "
                "every rank must pass the same kind of values (the same tuple / dict layout)"
            )
    for k, first in enumerate(reports[0][3]):
        for rank, report in enumerate(reports):
            name, *spec = report[3][k][:5]
            for what, mine, theirs in zip(("kind", "dtype", "row shape", "device"), spec, first[1:5], strict=True):
                if mine != theirs:
                    return TypeError, (
                        f"values{name}: rank {rank} passes {what} {mine!r}, rank 0 {theirs!r}; every rank must pass "
                        "the same kind, dtype, shape after the first axis and device type"
                    )
    return None


def _sources(container: DistributedDataContainer) -> tuple[np.ndarray, np.ndarray]:
    """For each kept observation in ascending global index: the rank holding it and its row there."""
    n, w, m = container._n, container._world_size, container._num_samples
    kept = m * w if container._drop_last else n  # positions of the padded index list that are not padding
    positions = np.arange(kept, dtype=np.int64)
    if container._shuffle:
        positions = np.argsort(container._order(container.epoch)[:kept], kind="stable")
    return positions % w, positions // w


def _gather_rows(backend: Backend, leaf: Any, rows: tuple[int, ...], m: int, take: np.ndarray) -> Any:
    """Allgather a tensor / array of any dtype as raw bytes (``m`` rows per rank) and pick rows ``take``."""
    w, k = backend.size, len(take)
    if isinstance(leaf, torch.Tensor):
        leaf = leaf.detach()
        if m == 0 or 0 in rows:  # the same on every rank: nothing to send
            return leaf.new_empty((k, *rows))
        send = leaf if len(leaf) == m else torch.cat([leaf, leaf.new_zeros((m - len(leaf), *rows))])
        send = send.contiguous().reshape(m, -1).view(torch.uint8)
        recv = allgather(backend, send, send.new_empty((w, *send.shape)))
        picked = recv.reshape(w * m, -1).index_select(0, torch.from_numpy(take).to(leaf.device))
        return picked.view(leaf.dtype).reshape(k, *rows)
    if m == 0 or 0 in rows:
        return np.empty((k, *rows), dtype=leaf.dtype)
    send = np.zeros((m, *rows), dtype=leaf.dtype)
    send[: len(leaf)] = leaf
    send = send.reshape(m, -1).view(np.uint8)
    recv = allgather(backend, send, np.empty((w, *send.shape), dtype=np.uint8))
    return recv.reshape(w * m, -1)[take].view(leaf.dtype).reshape(k, *rows)


def _gather_objects(backend: Backend, leaf: Any, unpadded: int, ranks: np.ndarray, rows: np.ndarray) -> Any:
    """Allgather a list / object array's unpadded entries as pickles and pick the kept ones in order."""
    pieces = allgather_object(backend, leaf[:unpadded])
    if isinstance(leaf, list):
        return [pieces[r][j] for r, j in zip(ranks.tolist(), rows.tolist(), strict=True)]
    offsets = np.cumsum([0] + [len(p) for p in pieces[:-1]])
    return np.concatenate(pieces)[offsets[ranks] + rows]


def gather_unpadded(backend: Backend, values: Any, share: DistributedDataContainer | UnpaddedShare) -> Any:
    """Every rank's per-observation results, on every rank, in the dataset's order, without the padded duplicates.

    What Accelerate's ``gather_for_metrics`` does for ``DistributedSampler`` users: each
    rank computes one result per observation of its share (``values``, e.g. predictions
    or per-sample losses), and every rank gets the results of the whole dataset, each
    observation once, ordered by its index in the data (``result[g]`` belongs to
    observation ``g``, whatever the shuffle and epoch). With ``drop_last`` the dropped
    observations have no result: the others come in ascending index order
    (``gather_unpadded(backend, share.indices, share)`` lists their indices).

    Each rank may pass results for its whole share (the padding is dropped) or for
    ``share.unpadded()``. Before any data moves, the ranks exchange what they pass; a
    rank whose length fits neither, values of different kinds, dtypes, row shapes or
    device types across ranks, or containers built differently (data length, shuffle,
    seed, drop_last, epoch) raise the same error on every rank. Tensors and arrays of
    any dtype travel as raw bytes in one ``allgather`` (CUDA tensors stay on their
    device); lists and object arrays as pickles. Nothing limits the size. Results are
    not differentiable.

    Args:
        backend: from ``dml.get_distributed_backend``.
        values: this rank's results, one per observation along the first axis: a
            ``torch.Tensor``, a NumPy array, a list, or a tuple / dict of those (each
            member gathered alike; e.g. ``(predictions, labels)``).
        share: the container the results were computed on (on every rank at the same
            epoch), or its :meth:`~DistributedDataContainer.unpadded` view.

    Returns:
        ``values``' kind with one row / entry per observation of the dataset: a tensor
        on this rank's ``values``' device, an array, a list, or a tuple / dict of those.

    Raises:
        TypeError: ``values`` or ``share`` is of a kind not allowed, or the ranks' values
            differ in kind, dtype, row shape or device type (raised on every rank).
        ValueError: a rank's values have a length other than its share's or its unpadded
            view's, or the ranks' containers differ (raised on every rank).

    Example:
        >>> data = torch.utils.data.TensorDataset(torch.randn(10, 3), torch.arange(10))
        >>> share = dml.DistributedDataContainer(backend, data, shuffle=True)
        >>> loader = torch.utils.data.DataLoader(share.unpadded(), batch_size=4)
        >>> labels = torch.cat([yb for xb, yb in loader])  # e.g. predictions in a real loop
        >>> dml.gather_unpadded(backend, labels, share)  # every rank: the dataset's order
        tensor([0, 1, 2, 3, 4, 5, 6, 7, 8, 9])
    """
    check_backend(backend, "gather_unpadded")
    with exclusive(backend, "gather_unpadded"):
        report: tuple[Any, ...]
        leaves: list[Any] = []
        try:
            container, facts = _share_facts(share, backend)
            structure = _flatten(values, "", len(container), len(container.unpadded()), leaves)
            report = (None, facts, structure, [spec for spec, _ in leaves])
        except _Problem as problem:
            report = ((problem.kind, str(problem)), None, None, None)
        reports = allgather_object(backend, report)
        verdict = _verdict(reports)
        if verdict is not None:
            raise verdict[0](f"gather_unpadded: {verdict[1]}")
        ranks, rows = _sources(container)
        take = ranks * len(container) + rows
        unpadded = len(container) - container.num_padded
        gathered = []
        for k, (spec, leaf) in enumerate(leaves):
            if spec[1] in ("list", "object array"):
                gathered.append(_gather_objects(backend, leaf, unpadded, ranks, rows))
                continue
            if spec[1] == "array" and leaf.dtype.kind in "US":
                widest = np.result_type(*(r[3][k][6] for r in reports))
                gathered.append(_gather_rows(backend, leaf.astype(widest, copy=False), spec[3], len(container), take))
            else:
                gathered.append(_gather_rows(backend, leaf, spec[3], len(container), take))
        return _rebuild(values, iter(gathered))
