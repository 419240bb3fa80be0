"""MLUtils' observation protocol: ``numobs`` and ``getobs`` over arrays, tensors, datasets and tuples / dicts of them.

An array or tensor holds its observations along the first axis; a tuple or dict of such
holds one observation per member (``(x, y)``); anything else with ``len()`` and integer
indexing (a list, a torch ``Dataset``) is a sequence of observations. The container of
:mod:`distutils_ml.data` indexes its data through these functions.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

__all__ = [
    "Index",
    "as_index",
    "checked_numobs",
    "describe_value",
    "getobs",
    "getobs_at",
    "numobs",
    "split_rows",
]

#: What ``getobs`` and container indexing accept besides an int: a batch of indices.
Index = int | slice | Sequence[int] | np.ndarray | torch.Tensor

_ALLOWED_DATA = (
    "a NumPy array or torch.Tensor of at least one dimension (observations along the first axis), "
    "anything with len() and integer indexing (a list, a map-style torch Dataset), or a tuple / dict of those"
)
_ALLOWED_INDEX = "an int, a slice, a list or range of ints, or a 1-D integer NumPy array or torch.Tensor"


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
    return checked_numobs(data, "numobs")


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
    return getobs_at(data, as_index(idx, "getobs: idx"))


def describe_value(x: Any) -> str:
    """``x`` as an error message names it: an array's kind and shape, else its type and a short repr."""
    if isinstance(x, (np.ndarray, torch.Tensor)):
        return f"a {len(x.shape)}-d {type(x).__module__.split('.')[0]}.{type(x).__name__} of shape {tuple(x.shape)}"
    text = repr(x)
    return f"{type(x).__qualname__} {text[:60] + '...' if len(text) > 60 else text}"


def checked_numobs(data: Any, caller: str, name: str = "data") -> int:
    """``numobs`` whose errors start with ``caller`` and name ``data`` as ``name`` (``data[0]['x']``)."""
    if isinstance(data, (np.ndarray, torch.Tensor)):
        if data.ndim == 0:
            raise TypeError(
                f"{caller}: {name}: got {describe_value(data)}, which has no observation axis; allowed: {_ALLOWED_DATA}"
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
    counts = [(member, checked_numobs(m, caller, member)) for member, m in members]
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
            f"{where}: got {describe_value(data)}, text rather than data (load it first); allowed: {_ALLOWED_DATA}"
        )
    if isinstance(data, torch.utils.data.IterableDataset):
        raise TypeError(
            f"{where}: got the IterableDataset {type(data).__qualname__}, which has no random access, so "
            f"DistributedDataContainer cannot partition it by index; allowed: {_ALLOWED_DATA}. Fix: split the stream "
            "instead: share = dml.split_iterable(backend, dataset), then DataLoader(share, batch_size=...); every rank "
            "reads the whole stream and keeps its own items (docs/data.md, Streaming data: IterableDataset)"
        )
    kind = type(data)
    missing = [m for m in ("__len__", "__getitem__") if not hasattr(kind, m)]
    if missing:
        raise TypeError(
            f"{where}: got {describe_value(data)}, which has no {' or '.join(missing)}; allowed: {_ALLOWED_DATA}"
        )


def as_index(idx: Any, name: str) -> int | slice | np.ndarray:
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
        raise TypeError(f"{name}: got {describe_value(idx)}; allowed: {_ALLOWED_INDEX}")
    if arr.dtype.kind not in "iu" or arr.ndim > 1:
        raise TypeError(f"{name}: got {describe_value(arr)} of dtype {arr.dtype}; allowed: {_ALLOWED_INDEX}")
    if arr.ndim == 0:
        return int(arr)
    return arr.astype(np.int64, copy=False)


def getobs_at(data: Any, index: int | slice | np.ndarray) -> Any:
    """``getobs`` on a normalized index (see :func:`as_index`)."""
    if isinstance(data, np.ndarray):
        return data[index]
    if isinstance(data, torch.Tensor):
        if isinstance(index, np.ndarray):
            # from_numpy shares memory and warns on read-only arrays: copy those.
            index = torch.from_numpy(index if index.flags.writeable else index.copy())
        return data[index]
    if isinstance(data, tuple):
        items = [getobs_at(m, index) for m in data]
        return type(data)(*items) if hasattr(type(data), "_fields") else tuple(items)
    if isinstance(data, Mapping):
        return {k: getobs_at(m, index) for k, m in data.items()}
    if isinstance(index, int):
        return data[index]
    positions = list(range(len(data))[index]) if isinstance(index, slice) else index.tolist()
    getitems = getattr(data, "__getitems__", None)
    if getitems is not None:
        return getitems(positions)
    return [data[i] for i in positions]


def split_rows(data: Any, batch: Any) -> list[Any]:
    """Split ``batch`` (``getobs_at(data, index_array)``) into a list of single observations.

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
        columns = [split_rows(m, b) for m, b in zip(data, batch, strict=True)]
        if hasattr(type(data), "_fields"):
            return [type(data)(*row) for row in zip(*columns, strict=True)]
        return list(zip(*columns, strict=True))
    if isinstance(data, Mapping):
        keys = list(data)
        columns = [split_rows(data[k], batch[k]) for k in keys]
        return [dict(zip(keys, row, strict=True)) for row in zip(*columns, strict=True)]
    return list(batch)
