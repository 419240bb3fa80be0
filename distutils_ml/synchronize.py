"""``synchronize``: make every rank hold root's model, optimizer or nested state.

The value is flattened into leaves. Array leaves (tensors, NumPy arrays) are
overwritten in place with root's data, fused into one broadcast per dtype and
device. Every other leaf (numbers, strings, None, any picklable object) comes back
as root's value, all in one object broadcast. Containers (dict, list, tuple,
namedtuple, dataclass) are rebuilt with the same types; ``torch.nn.Module`` and
``torch.optim.Optimizer`` are synchronized in place and returned.

Every rank describes its tree (container types, dict keys, lengths, dataclass
fields, parameter names, array shapes / dtypes / device types) and compares it with
root's before any array is sent; a difference raises on every rank, naming it.

The walker is our own rather than ``torch.utils._pytree`` (private; optree is not a
dependency): pytree treats dataclasses and dict / list subclasses as leaves unless
registered process-wide, has no "a plain subtree is one value" rule, and its
TreeSpec equality cannot name the first difference.
"""

from __future__ import annotations

import copy
import dataclasses
import pickle
from collections import OrderedDict
from collections.abc import Callable, Iterator
from enum import Enum
from typing import Any, TypeVar

import numpy as np
import torch

from distutils_ml.arrays import ArrayLike, dtype_name
from distutils_ml.backends.base import Backend, check_backend
from distutils_ml.collectives import _check_root, allgather, bcast

__all__ = ["synchronize"]

T = TypeVar("T")
Rebuild = Callable[[Iterator[Any]], Any]
Node = tuple[Any, ...]  # what must agree across ranks about one container or leaf
_PLAIN_KEYS = (str, int, float, bytes, Enum, type(None))


def _is_array(x: Any) -> bool:
    return isinstance(x, (torch.Tensor, np.ndarray))


class _Flat:
    """``x``'s leaves and structure in one depth-first order, and how to rebuild ``x``.

    ``nodes`` holds ``(path, description)`` for every container and leaf; two ranks
    hold the same structure exactly when their descriptions are equal, and the first
    unequal pair names the first difference (the paths agree up to it).
    ``states`` maps ``id(optimizer)`` to the per-parameter state to use instead of
    the optimizer's own (the entries matched to root's, not yet installed).
    """

    def __init__(self, x: Any, states: dict[int, list[dict[str, Any]]]) -> None:
        self.leaves: list[Any] = []
        self.leaf_paths: list[str] = []
        self.nodes: list[tuple[str, Node]] = []
        self._states = states
        self.rebuild = self._walk(x, "x")

    def _leaf(self, x: Any, path: str) -> None:
        self.leaves.append(x)
        self.leaf_paths.append(path)
        self.nodes.append((path, _describe(x)))

    def _walk(self, x: Any, path: str) -> Rebuild:
        """Append ``x``'s leaves and nodes; return a function rebuilding ``x`` from new leaf values."""
        if _is_array(x):
            self._leaf(x, path)
            return lambda it: (next(it), x)[1]  # arrays are synchronized in place
        if isinstance(x, torch.nn.Module):
            return self._module(x, path)
        if isinstance(x, torch.optim.Optimizer):
            return self._optimizer(x, path)
        if not _holds_arrays(x):  # a plain subtree is one value: root's replaces it whole
            self._leaf(x, path)
            return next
        if isinstance(x, dict):
            return self._dict(x, path)
        if isinstance(x, (list, tuple)):
            return self._sequence(x, path)
        if dataclasses.is_dataclass(x) and not isinstance(x, type):
            return self._dataclass(x, path)
        self._leaf(x, path)
        return next

    def _module(self, m: torch.nn.Module, path: str) -> Rebuild:
        named = [*((n, p.data) for n, p in m.named_parameters()), *m.named_buffers()]
        self.nodes.append((path, ("module", _type_name(m), tuple(n for n, _ in named))))
        for n, t in named:
            self._leaf(t, f"{path}.{n}")

        def rebuild_module(it: Iterator[Any]) -> Any:
            for _ in named:
                next(it)
            return m

        return rebuild_module

    def _optimizer(self, opt: torch.optim.Optimizer, path: str) -> Rebuild:
        self.nodes.append((path, ("optimizer", _type_name(opt), tuple(len(g["params"]) for g in opt.param_groups))))
        hyper = self._walk(
            [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups], f"{path}.param_groups"
        )
        if id(opt) in self._states:
            states = self._states[id(opt)]
        else:
            states = [dict(opt.state.get(p, {})) for p in _params(opt)]
        state = self._walk(states, f"{path}.state")

        def rebuild_optimizer(it: Iterator[Any]) -> Any:
            for group, values in zip(opt.param_groups, hyper(it), strict=True):
                group.update(values)
            for p, values in zip(_params(opt), state(it), strict=True):
                if values:
                    opt.state[p] = values
                else:
                    opt.state.pop(p, None)
            return opt

        return rebuild_optimizer

    def _dict(self, x: dict, path: str) -> Rebuild:
        keys = list(x)
        if not isinstance(x, OrderedDict) and (
            all(isinstance(k, str) for k in keys) or all(isinstance(k, int) for k in keys)
        ):
            keys.sort()  # the same keys in another insertion order are the same structure
        tokens = [_key_token(k) for k in keys]
        self.nodes.append((path, ("dict", _type_name(x), tuple(tokens))))
        parts = [self._walk(x[k], f"{path}[{t!r}]") for k, t in zip(keys, tokens, strict=True)]

        def rebuild_dict(it: Iterator[Any]) -> Any:
            values = {k: p(it) for k, p in zip(keys, parts, strict=True)}
            new = copy.copy(x)  # keeps the type, an OrderedDict's order, a defaultdict's factory
            new.clear()
            new.update((k, values[k]) for k in x)
            return new

        return rebuild_dict

    def _sequence(self, x: list | tuple, path: str) -> Rebuild:
        self.nodes.append((path, ("sequence", _type_name(x), len(x))))
        parts = [self._walk(v, f"{path}[{i}]") for i, v in enumerate(x)]
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

    def _dataclass(self, x: Any, path: str) -> Rebuild:
        names = [f.name for f in dataclasses.fields(x)]
        self.nodes.append((path, ("dataclass", _type_name(x), tuple(names))))
        parts = [self._walk(getattr(x, n), f"{path}.{n}") for n in names]

        def rebuild_dataclass(it: Iterator[Any]) -> Any:
            new = copy.copy(x)
            for n, p in zip(names, parts, strict=True):
                object.__setattr__(new, n, p(it))  # frozen dataclasses too
            return new

        return rebuild_dataclass


def _type_name(x: Any) -> str:
    return f"{type(x).__module__}.{type(x).__qualname__}"


def _key_token(k: Any) -> Any:
    """A dict key as ranks compare it: itself when it pickles to an equal value, else its type."""
    if isinstance(k, tuple):
        return tuple(_key_token(v) for v in k)
    return k if isinstance(k, _PLAIN_KEYS) else f"<{type(k).__qualname__}>"


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


def _params(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for g in opt.param_groups for p in g["params"]]


def _state_skeleton(opt: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """Root's state entries per parameter: tensors as (shape, dtype, where), plain values as None.

    ``where`` is "param" for an entry on its parameter's device (so each rank uses its
    own parameter's device, e.g. its own GPU), else the device type ("cpu" for Adam's
    ``step`` next to a CUDA parameter).
    """
    return [
        {
            k: (tuple(v.shape), v.dtype, "param" if v.device == p.device else v.device.type)
            if isinstance(v, torch.Tensor)
            else None
            for k, v in opt.state.get(p, {}).items()
        }
        for p in _params(opt)
    ]


def _match_states(
    opts: list[torch.optim.Optimizer], skeletons: list[list[dict[str, Any]]]
) -> tuple[dict[int, list[dict[str, Any]]], str | None]:
    """Per-parameter state holding root's set of entries (torch creates state lazily, at the first step).

    Entries that root has and this rank lacks (or holds with another shape, dtype or
    device) are created, to be filled by the data broadcast; plain values are
    placeholders replaced by root's; entries root lacks are dropped. Nothing is
    installed here. Returns the states by ``id(optimizer)`` and a mismatch, if any.
    """
    if len(skeletons) != len(opts):
        return {}, f"x holds {len(opts)} optimizer(s), root's holds {len(skeletons)}"
    for i, (opt, skeleton) in enumerate(zip(opts, skeletons, strict=True)):
        if len(skeleton) != len(_params(opt)):
            return {}, f"optimizer {i} has {len(_params(opt))} parameters, root's has {len(skeleton)}"
    states: dict[int, list[dict[str, Any]]] = {}
    for opt, skeleton in zip(opts, skeletons, strict=True):
        states[id(opt)] = []
        for p, entries in zip(_params(opt), skeleton, strict=True):
            mine = opt.state.get(p, {})
            new = {}
            for k, spec in entries.items():
                have = mine.get(k)
                if spec is None:
                    new[k] = None
                    continue
                shape, dtype, where = spec
                device = p.device if where == "param" else torch.device(where)
                fits = (
                    isinstance(have, torch.Tensor)
                    and tuple(have.shape) == shape
                    and have.dtype == dtype
                    and have.device.type == device.type
                )
                new[k] = have if fits else torch.empty(shape, dtype=dtype, device=device)
            states[id(opt)].append(new)
    return states, None


def _describe(leaf: Any) -> Node:
    """What must agree across ranks about a leaf: ("array", shape, dtype, device type) or ("object",)."""
    if _is_array(leaf):
        device = leaf.device.type if isinstance(leaf, torch.Tensor) else "cpu"
        return ("array", tuple(leaf.shape), dtype_name(leaf), device)
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
        x: the value; every rank passes the same structure (container types, dict
            keys in any order, lengths, dataclass fields, parameter names) with arrays
            of the same shapes, dtypes and device types.
        root: the rank whose value everyone ends with.

    Returns:
        ``x`` with root's values (the same object for arrays, modules, optimizers).

    Raises:
        ValueError: a rank's structure or array shapes differ from root's (raised on
            every rank, before any array is sent, naming the first difference).

    Example:
        >>> model = dml.synchronize(backend, torch.nn.Linear(4, 2))  # rank 0's weights everywhere
        >>> opt = dml.synchronize(backend, torch.optim.Adam(model.parameters()))
        >>> dml.synchronize(backend, {"epoch": 3, "scale": torch.ones(2)}, root=0)
        {'epoch': 3, 'scale': tensor([1., 1.])}
    """
    check_backend(backend, "synchronize")
    root = _check_root(backend, root)
    opts = list(_optimizers(x))

    # 1. Root's optimizer state entries, structure and plain values, in one object broadcast
    #    (pickled on root first, so an unpicklable value fails on every rank rather than
    #    leaving the others waiting).
    payload: Any = None
    if backend.rank == root:
        try:
            flat = _Flat(x, {})  # raises for a leaf no backend can send (e.g. an unsupported dtype)
        except (TypeError, ValueError) as e:
            payload = ("error", type(e).__name__, f"root's value: {e}")
        else:
            objects = [None if _is_array(leaf) else leaf for leaf in flat.leaves]
            try:
                skeletons = [_state_skeleton(o) for o in opts]
                payload = ("ok", "", pickle.dumps((skeletons, [d for _, d in flat.nodes], objects)))
            except Exception as e:
                payload = ("error", "TypeError", f"root's value cannot be pickled: {type(e).__name__}: {e}")
    status, kind, blob = backend._bcast_object(payload, root)
    if status == "error":
        raise (ValueError if kind == "ValueError" else TypeError)(f"synchronize: {blob}")
    skeletons, root_nodes, root_objects = pickle.loads(blob)

    # 2. Agree that every rank's structure and arrays match root's, before any array is sent.
    mismatch = None
    if backend.rank != root:
        states, mismatch = _match_states(opts, skeletons)
        if mismatch is None:
            try:
                flat = _Flat(x, states)
            except (TypeError, ValueError) as e:  # reported through the agreement below, on every rank
                mismatch = f"{type(e).__name__}: {e}"
            else:
                mismatch = _first_difference(flat.nodes, root_nodes) or _first_read_only(flat)
    flags = np.zeros(backend.size, dtype=np.int8)
    allgather(backend, np.array(mismatch is not None, dtype=np.int8), flags)
    if flags.any():
        bad = [r for r in range(backend.size) if flags[r]]
        detail = f"; here: {mismatch}" if mismatch else ""
        raise ValueError(
            f"synchronize: rank(s) {bad} hold a structure that differs from root {root}'s{detail}. "
            "Pass the same containers, keys, lengths and array shapes on every rank."
        )

    # 3. Array leaves: one broadcast per dtype/device; optimizer state is installed by the rebuild.
    _broadcast_arrays(backend, [leaf for leaf in flat.leaves if _is_array(leaf)], root)
    values = (leaf if _is_array(leaf) else obj for leaf, obj in zip(flat.leaves, root_objects, strict=True))
    return flat.rebuild(values)


def _optimizers(x: Any) -> Iterator[torch.optim.Optimizer]:
    """Optimizers inside ``x`` (top level or nested in containers)."""
    if isinstance(x, torch.optim.Optimizer):
        yield x
    else:
        for c in _children(x):
            yield from _optimizers(c)


def _first_difference(mine: list[tuple[str, Node]], roots: list[Node]) -> str | None:
    """The first node that differs from root's, or None.

    Nodes are depth-first and a container's node fixes how many children follow, so
    nodes equal up to the end of either list mean equal lists.
    """
    for (path, a), b in zip(mine, roots, strict=False):
        if a != b:
            return f"{path} is {_show(a)}, root's is {_show(b)}"
    return None


def _first_read_only(flat: _Flat) -> str | None:
    for leaf, path in zip(flat.leaves, flat.leaf_paths, strict=True):
        if isinstance(leaf, np.ndarray) and not leaf.flags.writeable:
            return f"{path} is a read-only array and cannot receive root's data"
    return None


def _show(node: Node) -> str:
    kind, rest = node[0], node[1:]
    if kind == "array":
        return f"an array of shape {rest[0]}, dtype {rest[1]} on {rest[2]}"
    if kind == "object":
        return "a plain value"
    full = rest[0]
    name = full.rpartition(".")[2]
    article = "an" if name[:1].lower() in "aeiou" else "a"
    if kind == "dict":
        return f"{article} {name} with keys {list(rest[1])}"
    if kind == "sequence":
        return f"{article} {name} of length {rest[1]}"
    if kind == "dataclass":
        return f"{article} {name} with fields {list(rest[1])}"
    if kind == "module":
        return f"{article} {name} ({full}) with {len(rest[1])} parameters and buffers {_names(rest[1])}"
    return f"{article} {name} ({full}) with {sum(rest[1])} parameters in groups of {list(rest[1])}"


def _names(names: tuple[str, ...], shown: int = 8) -> str:
    more = f" and {len(names) - shown} more" if len(names) > shown else ""
    return f"{list(names[:shown])}{more}"


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
