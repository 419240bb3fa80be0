"""``synchronize``: make every rank hold root's model, optimizer or nested state.

The value is flattened into leaves. Array leaves (tensors, NumPy arrays) are
overwritten in place with root's data, fused into one broadcast per dtype and
device type. Every other leaf (numbers, strings, None, any picklable object) comes
back as root's value. Containers (dict, list, tuple, namedtuple, dataclass) are
rebuilt with the same types; ``torch.nn.Module`` and ``torch.optim.Optimizer`` are
synchronized in place and returned.

Nothing fails on one rank only. In order:

1. Root describes its tree (container types, dict keys, lengths, dataclass fields,
   parameter names, array shapes / dtypes / device types) and pickles its plain
   leaves, inside one object broadcast (:func:`~distutils_ml.objects.run_on_root`):
   a failure there raises on every rank.
2. Every rank prepares everything that could fail locally: its own description,
   compared with root's; root's plain leaves unpickled; arrays checked writable;
   optimizer state created; staging buffers allocated (root's filled); the result
   containers rebuilt. Nothing is installed yet.
3. The ranks agree (one small allgather): if any rank failed in step 2, every rank
   raises, naming each failing rank and why, and no array has moved.
4. Root's arrays travel as flat 1-D buffers, one broadcast per (dtype, device type),
   sized from root's description alone, so a rank's local layout (strides,
   contiguity) never changes which collectives it calls. A leaf that is not a plain
   contiguous buffer is staged through a copy. Optimizer state is installed last.
   Anything that still fails here aborts the job (``backend._abort``): the ranks
   already agreed to go on, and raising on one rank would leave the others' data
   queued for its next collective.

The walk is :mod:`distutils_ml.tree`'s, the broadcast :mod:`distutils_ml.fused_broadcast`'s
and the agreement :mod:`distutils_ml.agreement`'s; this module puts them in that order.
"""

from __future__ import annotations

import pickle
from typing import Any, TypeVar

from distutils_ml.agreement import agree
from distutils_ml.backends.base import Backend, check_backend
from distutils_ml.collectives import check_root
from distutils_ml.fused_broadcast import FusedBroadcast
from distutils_ml.objects import exclusive, run_on_root
from distutils_ml.tree import (
    Flat,
    Mismatch,
    Node,
    first_difference,
    is_array,
    state_skeleton,
    sync_batchnorm_refused,
    type_name,
)

__all__ = ["synchronize"]

T = TypeVar("T")


def synchronize(backend: Backend, x: T, root: int = 0) -> T:
    """Make every rank hold root's value of ``x`` (Lux's ``synchronize!!``).

    Arrays and tensors are overwritten in place; numbers, strings, None and other
    picklable leaves are returned as root's values; dict / list / tuple / namedtuple /
    dataclass containers are rebuilt with the same types. A ``torch.nn.Module`` has
    its parameters and buffers synchronized in place; a ``torch.optim.Optimizer``
    (or ``DistributedOptimizer``) its hyper-parameters and state, entries that only
    root has being created. Array leaves travel in one broadcast per dtype.

    Every rank raises, before any array moves, if any rank cannot take part: a
    structure that differs from root's, a value it cannot unpickle, an array it cannot
    write. Dict entries are matched by key, whatever the insertion order (except in an
    ``OrderedDict``, whose order is part of its value).

    Args:
        backend: from ``dml.get_distributed_backend``.
        x: the value; every rank passes the same structure (container types, dict
            keys in any order, lengths, dataclass fields, parameter names) with arrays
            of the same shapes, dtypes and device types.
        root: the rank whose value everyone ends with.

    Returns:
        ``x`` with root's values (the same object for arrays, modules, optimizers; on
        root, its own plain values).

    Raises:
        ValueError: a rank's structure or array shapes differ from root's (raised on
            every rank, before any array is sent, naming each difference).
        TypeError: a dict holding arrays has a key that is not a plain value (str,
            int, float, bool, bytes, None, Enum, tuples of those), a leaf cannot be
            sent or root's value cannot be pickled (raised on every rank).
        RuntimeError: a rank cannot unpickle root's value, or ``x`` holds a
            ``torch.nn.SyncBatchNorm`` in a world of several ranks without a
            ``torch.distributed`` process group (raised on every rank).

    Example:
        >>> model = dml.synchronize(backend, torch.nn.Linear(4, 2))  # rank 0's weights everywhere
        >>> opt = dml.synchronize(backend, torch.optim.Adam(model.parameters()))
        >>> dml.synchronize(backend, {"epoch": 3, "scale": torch.ones(2)}, root=0)
        {'epoch': 3, 'scale': tensor([1., 1.])}
    """
    check_backend(backend, "synchronize")
    root = check_root(backend, root)
    with exclusive(backend, "synchronize"):
        root = backend.acting_root(root)
        return _synchronize(backend, x, root)


def _synchronize(backend: Backend, x: T, root: int) -> T:
    is_root = backend.rank == root
    refuse = sync_batchnorm_refused(backend)
    held: list[Flat] = []

    def describe() -> tuple[list[Any], list[Node], list[tuple[str, bytes] | None]]:
        """Root's structure, optimizer state entries and pickled plain leaves (inside the broadcast)."""
        flat = Flat(x, None, refuse)
        held.append(flat)
        blobs = [
            None if is_array(leaf) else _dumps(leaf, path)
            for leaf, path in zip(flat.leaves, flat.leaf_paths, strict=True)
        ]
        return [state_skeleton(o) for o in flat.optimizers], [d for _, d in flat.nodes], blobs

    skeletons, root_nodes, blobs = run_on_root(backend, describe, root=root, what="synchronize")

    failure: Exception | None = None
    try:
        if is_root:
            flat = held[0]
            values = flat.leaves
        else:
            flat = Flat(x, skeletons, refuse)
            difference = first_difference(flat.nodes, root_nodes)
            if difference is not None:
                raise Mismatch(difference)
            values = [
                leaf if blob is None else _loads(blob, path, root)
                for leaf, path, blob in zip(flat.leaves, flat.leaf_paths, blobs, strict=True)
            ]
        arrays = [i for i, leaf in enumerate(flat.leaves) if is_array(leaf)]
        fused = FusedBroadcast(
            [flat.leaves[i] for i in arrays],
            [flat.leaf_paths[i] for i in arrays],
            [root_nodes[flat.leaf_nodes[i]][1:4] for i in arrays],  # root's description: the agreed plan
            is_root,
        )
        out = flat.rebuild(iter(values))
    except Exception as e:  # reported through the agreement: every rank raises
        failure = e
    agree(backend, "synchronize", root, failure)
    try:
        fused.run(backend, root)
        for commit in flat.commits:
            commit()
    except Exception as e:
        backend._abort(
            f"synchronize: rank {backend.rank} failed after every rank agreed to go on ({type(e).__name__}: {e}); "
            "the ranks' values may now differ, so the job cannot continue"
        )
    return out


def _dumps(value: Any, path: str) -> tuple[str, bytes]:
    try:
        return type_name(value), pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as e:
        raise TypeError(f"{path}: root's value cannot be pickled: {type(e).__name__}: {e}") from e


def _loads(blob: tuple[str, bytes], path: str, root: int) -> Any:
    kind, data = blob
    try:
        return pickle.loads(data)
    except Exception as e:
        raise RuntimeError(
            f"{path}: root {root}'s value (a {kind}) cannot be unpickled here: {type(e).__name__}: {e}. Every rank "
            "must be able to import its class: define it in a module, not in root's __main__ or under a rank test"
        ) from e
