"""Exact evaluation: every rank's per-observation results, gathered without the padded duplicates.

A :class:`~distutils_ml.data.DistributedDataContainer` pads its shares so every rank runs
the same number of steps; :func:`gather_unpadded` puts the results computed on the shares
(or on their :meth:`~distutils_ml.data.DistributedDataContainer.unpadded` views) back in
the dataset's order, each observation once (Accelerate's ``gather_for_metrics``).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np
import torch

from distutils_ml.arrays import array_subclass, unusual_tensor
from distutils_ml.backends.base import Backend, check_backend
from distutils_ml.collectives import allgather
from distutils_ml.data import DistributedDataContainer, UnpaddedShare
from distutils_ml.objects import allgather_object, exclusive
from distutils_ml.observations import describe_value

__all__ = ["gather_unpadded"]


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
    elif isinstance(leaf, np.ndarray) and (subclass := array_subclass(leaf, f"values{name}")) is not None:
        raise _Problem(TypeError, str(subclass))  # a masked array's mask, gathered as plain rows, would be lost
    elif isinstance(leaf, np.ndarray):
        kind = "object array" if leaf.dtype.hasobject else "array"
        # Text arrays may differ in width across ranks (the longest string): compared by kind, gathered at the widest.
        text = leaf.dtype.kind in "US"
        dtype, rows, device = np.dtype(leaf.dtype.char) if text else leaf.dtype, leaf.shape[1:], None
    else:
        raise _Problem(TypeError, f"values{name}: got {describe_value(leaf)}; allowed: {_ALLOWED_VALUES}")
    if kind != "list" and leaf.ndim == 0:
        raise _Problem(
            TypeError,
            f"values{name}: got {describe_value(leaf)}, which has no observation axis; allowed: {_ALLOWED_VALUES}",
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
            f"share: got {describe_value(share)}; allowed: the DistributedDataContainer the values were computed on "
            "(or its unpadded() view)",
        )
    if (container.rank, container.world_size) != (backend.rank, backend.size):
        raise _Problem(
            ValueError,
            f"share: it was built for rank {container.rank} of {container.world_size}, but this is rank "
            f"{backend.rank} of {backend.size}: pass the container this rank built with this backend",
        )
    return container, (
        container.num_observations,
        container.shuffle,
        container.seed,
        container.drop_last,
        container.epoch,
        container.start,
    )


_FACTS = ("numobs(data)", "shuffle", "seed", "drop_last", "epoch", "set_epoch's start")


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
                "from the same data and options and call set_epoch with the same epoch and start"
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


def _gather_rows(backend: Backend, leaf: Any, rows: tuple[int, ...], m: int, take: np.ndarray) -> Any:
    """Allgather a tensor / array of any dtype as raw bytes (``m`` rows per rank) and pick rows ``take``."""
    w, k = backend.size, len(take)
    if isinstance(leaf, torch.Tensor):
        leaf = leaf.detach().resolve_conj().resolve_neg()  # a lazy view's bits are not its values
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
    seed, drop_last, epoch, set_epoch's start) raise the same error on every rank. Tensors and
    arrays of any dtype travel as raw bytes in one ``allgather`` (CUDA tensors stay on their
    device; a lazy conjugate or negative view as its values); lists and object arrays as pickles.
    Subclasses of NumPy arrays other than ``np.memmap`` (a masked array) are refused: their extra
    state would be lost. Nothing limits the size. Results are
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
        ranks, rows = container.placement()
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
