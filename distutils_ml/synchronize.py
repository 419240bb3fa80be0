"""``synchronize``: make every rank hold root's model, optimizer or nested state.

The value is flattened into leaves. Array leaves (tensors, NumPy arrays) are
overwritten in place with root's data, fused into one broadcast per dtype and
device. Every other leaf (numbers, strings, None, any picklable object) comes back
as root's value, all in one object broadcast. Containers (dict, list, tuple,
namedtuple, dataclass) are rebuilt with the same types; ``torch.nn.Module`` and
``torch.optim.Optimizer`` are synchronized in place and returned.
"""

from __future__ import annotations

import copy
import dataclasses
import pickle
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import numpy as np
import torch

from distutils_ml.arrays import ArrayLike, dtype_name
from distutils_ml.backends.base import Backend, check_backend
from distutils_ml.collectives import _check_root, allgather, bcast

__all__ = ["synchronize"]

T = TypeVar("T")
Rebuild = Callable[[Iterator[Any]], Any]


def _is_array(x: Any) -> bool:
    return isinstance(x, (torch.Tensor, np.ndarray))


def _flatten(x: Any, leaves: list[Any]) -> Rebuild:
    """Append ``x``'s leaves to ``leaves``; return a function rebuilding ``x`` from new leaf values."""
    if _is_array(x):
        leaves.append(x)
        return lambda it: (next(it), x)[1]  # arrays are synchronized in place
    if isinstance(x, torch.nn.Module):
        for t in _module_tensors(x):
            leaves.append(t)

        def rebuild_module(it: Iterator[Any]) -> Any:
            for _ in _module_tensors(x):
                next(it)
            return x

        return rebuild_module
    if isinstance(x, torch.optim.Optimizer):
        inner = _flatten(_optimizer_tree(x), leaves)
        return lambda it: _apply_optimizer_tree(x, inner(it))
    if not _holds_arrays(x):  # a plain subtree is one value: root's replaces it whole
        leaves.append(x)
        return next
    if isinstance(x, dict):
        keys = list(x)
        parts = [_flatten(x[k], leaves) for k in keys]

        def rebuild_dict(it: Iterator[Any]) -> Any:
            new = copy.copy(x)  # keeps the type, an OrderedDict's order, a defaultdict's factory
            new.clear()
            new.update((k, p(it)) for k, p in zip(keys, parts, strict=True))
            return new

        return rebuild_dict
    if isinstance(x, (list, tuple)):
        parts = [_flatten(v, leaves) for v in x]
        if hasattr(type(x), "_fields"):  # namedtuple
            return lambda it: type(x)(*(p(it) for p in parts))
        if type(x) in (list, tuple):
            return lambda it: type(x)(p(it) for p in parts)

        def rebuild_sequence(it: Iterator[Any]) -> Any:
            values = [p(it) for p in parts]
            if isinstance(x, tuple):
                return type(x)(values)
            new = copy.copy(x)
            new[:] = values
            return new

        return rebuild_sequence
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        names = [f.name for f in dataclasses.fields(x)]
        parts = [_flatten(getattr(x, n), leaves) for n in names]

        def rebuild_dataclass(it: Iterator[Any]) -> Any:
            new = copy.copy(x)
            for n, p in zip(names, parts, strict=True):
                object.__setattr__(new, n, p(it))  # frozen dataclasses too
            return new

        return rebuild_dataclass
    leaves.append(x)
    return next


def _children(x: Any) -> list[Any]:
    if isinstance(x, dict):
        return list(x.values())
    if isinstance(x, (list, tuple)):
        return list(x)
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return [getattr(x, f.name) for f in dataclasses.fields(x)]
    return []


def _holds_arrays(x: Any) -> bool:
    """Whether ``x`` is or contains an array, module or optimizer (something synchronized in place)."""
    if _is_array(x) or isinstance(x, (torch.nn.Module, torch.optim.Optimizer)):
        return True
    return any(_holds_arrays(c) for c in _children(x))


def _module_tensors(m: torch.nn.Module) -> Iterator[torch.Tensor]:
    for p in m.parameters():
        yield p.data
    yield from m.buffers()


def _optimizer_tree(opt: torch.optim.Optimizer) -> dict[str, Any]:
    """Hyper-parameters and per-parameter state, in parameter order."""
    params = [p for g in opt.param_groups for p in g["params"]]
    return {
        "hyper": [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups],
        "state": [dict(opt.state.get(p, {})) for p in params],
    }


def _apply_optimizer_tree(opt: torch.optim.Optimizer, tree: dict[str, Any]) -> torch.optim.Optimizer:
    for group, hyper in zip(opt.param_groups, tree["hyper"], strict=True):
        group.update(hyper)
    params = [p for g in opt.param_groups for p in g["params"]]
    for p, state in zip(params, tree["state"], strict=True):
        if state:
            opt.state[p] = state
        else:
            opt.state.pop(p, None)
    return opt


def _match_optimizer_state(backend: Backend, opt: torch.optim.Optimizer, root: int) -> None:
    """Give every rank root's set of state entries (torch creates state lazily, at the first step).

    Entries that root has and this rank lacks are created (filled later by the data
    broadcast); entries root lacks are dropped.
    """
    params = [p for g in opt.param_groups for p in g["params"]]
    skeleton = None
    if backend.rank == root:
        skeleton = [
            {k: (tuple(v.shape), v.dtype) if isinstance(v, torch.Tensor) else None for k, v in opt.state[p].items()}
            if p in opt.state
            else {}
            for p in params
        ]
    skeleton = backend._bcast_object(skeleton, root)
    if backend.rank == root:
        return
    if len(skeleton) != len(params):
        raise ValueError(
            f"synchronize: root's optimizer has {len(skeleton)} parameters, rank {backend.rank}'s has {len(params)}"
        )
    for p, entries in zip(params, skeleton, strict=True):
        mine = opt.state.get(p, {})
        new = {}
        for k, spec in entries.items():
            have = mine.get(k)
            fits = isinstance(have, torch.Tensor) and tuple(have.shape) == spec[0] and have.dtype == spec[1]
            if spec is None or fits:  # plain values are replaced by root's later
                new[k] = have
            else:
                device = p.device if spec[0] == tuple(p.shape) else torch.device("cpu")
                new[k] = torch.empty(spec[0], dtype=spec[1], device=device)
        if new:
            opt.state[p] = new
        else:
            opt.state.pop(p, None)


def _describe(leaf: Any) -> tuple:
    """What must agree across ranks about a leaf: ("array", shape, dtype) or ("object",)."""
    if _is_array(leaf):
        return ("array", tuple(leaf.shape), dtype_name(leaf))
    return ("object",)


def synchronize(backend: Backend, x: T, root: int = 0) -> T:
    """Make every rank hold root's value of ``x`` (Lux's ``synchronize!!``).

    Arrays and tensors are overwritten in place; numbers, strings, None and other
    picklable leaves are returned as root's values; dict / list / tuple / namedtuple /
    dataclass containers are rebuilt with the same types. A ``torch.nn.Module`` has
    its parameters and buffers synchronized in place; a ``torch.optim.Optimizer``
    (or ``DistributedOptimizer``) its hyper-parameters and state, entries that only
    root has being created. Array leaves travel in one broadcast per dtype.

    Args:
        backend: from ``dml.get_distributed_backend``.
        x: the value; every rank passes the same structure with arrays of the same
            shapes and dtypes.
        root: the rank whose value everyone ends with.

    Returns:
        ``x`` with root's values (the same object for arrays, modules, optimizers).

    Raises:
        ValueError: a rank's structure or array shapes differ from root's (raised on
            every rank, before any array is sent).

    Example:
        >>> model = dml.synchronize(backend, model)
        >>> opt = dml.synchronize(backend, opt)
    """
    check_backend(backend, "synchronize")
    root = _check_root(backend, root)
    for opt in _optimizers(x):
        _match_optimizer_state(backend, opt, root)
    leaves: list[Any] = []
    rebuild = _flatten(x, leaves)
    shape = [_describe(leaf) for leaf in leaves]
    objects = [None if _is_array(leaf) else leaf for leaf in leaves]

    # 1. Root's structure and plain values, in one object broadcast (pickled on root first,
    #    so an unpicklable value fails on every rank rather than leaving the others waiting).
    payload: Any = None
    if backend.rank == root:
        try:
            payload = ("ok", shape, pickle.dumps(objects))
        except Exception as e:
            payload = ("error", f"root's value cannot be pickled: {type(e).__name__}: {e}", None)
    status, root_shape, blob = backend._bcast_object(payload, root)
    if status == "error":
        raise TypeError(f"synchronize: {root_shape}")

    # 2. Agree that every rank's arrays match root's, before any array is sent.
    mismatch = _first_mismatch(shape, root_shape)
    if mismatch is None and backend.rank != root:
        mismatch = _first_read_only(leaves)
    flags = np.zeros(backend.size, dtype=np.int8)
    allgather(backend, np.array(mismatch is not None, dtype=np.int8), flags)
    if flags.any():
        bad = [r for r in range(backend.size) if flags[r]]
        detail = f"; here: {mismatch}" if mismatch else ""
        raise ValueError(f"synchronize: rank(s) {bad} hold a structure that differs from root {root}'s{detail}")

    # 3. Array leaves: one broadcast per dtype/device.
    _broadcast_arrays(backend, [leaf for leaf in leaves if _is_array(leaf)], root)
    root_objects = pickle.loads(blob)
    values = (leaf if _is_array(leaf) else obj for leaf, obj in zip(leaves, root_objects, strict=True))
    return rebuild(values)


def _optimizers(x: Any) -> Iterator[torch.optim.Optimizer]:
    """Optimizers inside ``x`` (top level or nested in containers)."""
    if isinstance(x, torch.optim.Optimizer):
        yield x
    else:
        for c in _children(x):
            yield from _optimizers(c)


def _first_mismatch(mine: list[tuple], roots: list[tuple]) -> str | None:
    if len(mine) != len(roots):
        return f"{len(mine)} leaves, root has {len(roots)}"
    for i, (a, b) in enumerate(zip(mine, roots, strict=True)):
        if a != b:
            return f"leaf {i} is {_show(a)}, root's is {_show(b)}"
    return None


def _first_read_only(leaves: list[Any]) -> str | None:
    for i, leaf in enumerate(leaves):
        if isinstance(leaf, np.ndarray) and not leaf.flags.writeable:
            return f"leaf {i} is a read-only array and cannot receive root's data"
    return None


def _show(d: tuple) -> str:
    return f"an array of shape {d[1]} and dtype {d[2]}" if d[0] == "array" else "a plain value"


def _broadcast_arrays(backend: Backend, arrays: list[ArrayLike], root: int) -> None:
    """Broadcast ``arrays`` in place, fused into one flat buffer per dtype and device."""
    groups: dict[tuple[str, str], list[torch.Tensor]] = {}
    for a in arrays:
        t = torch.from_numpy(a) if isinstance(a, np.ndarray) else a.detach()
        groups.setdefault((dtype_name(a), str(t.device)), []).append(t)
    for tensors in groups.values():
        if len(tensors) == 1 and tensors[0].is_contiguous():
            bcast(backend, tensors[0], root=root)
            continue
        if backend.rank == root:
            flat = torch.cat([t.reshape(-1) for t in tensors])
        else:
            flat = torch.empty(sum(t.numel() for t in tensors), dtype=tensors[0].dtype, device=tensors[0].device)
        bcast(backend, flat, root=root)
        if backend.rank != root:
            offset = 0
            for t in tensors:
                n = t.numel()
                t.copy_(flat[offset : offset + n].view(t.shape))
                offset += n
