"""The tree engine under ``synchronize``: flatten a value, describe it, name the first difference.

:class:`Flat` walks a value (dict, list, tuple, namedtuple, dataclass, ``torch.nn.Module``,
``torch.optim.Optimizer``, arrays and plain leaves) in one depth-first order: its leaves,
a description of every container and leaf that two ranks can compare, and a function that
rebuilds the value from new leaves. :func:`first_difference` names the first place where a
rank's description differs from root's. Nothing here communicates.

The walker is our own rather than ``torch.utils._pytree`` (private; optree is not a
dependency): pytree treats dataclasses and dict / list subclasses as leaves unless
registered process-wide, has no "a plain subtree is one value" rule, and its
TreeSpec equality cannot name the first difference.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from collections import OrderedDict
from collections.abc import Callable, Iterator
from enum import Enum
from typing import Any

import numpy as np
import torch

from distutils_ml.arrays import dtype_name, unusual_tensor
from distutils_ml.backends.base import Backend

__all__ = [
    "Flat",
    "Mismatch",
    "Node",
    "Spec",
    "array_spec",
    "first_difference",
    "is_array",
    "match_state",
    "refuse_sync_batchnorm",
    "show",
    "state_skeleton",
    "sync_batchnorm_refused",
    "type_name",
]

Rebuild = Callable[[Iterator[Any]], Any]
Node = tuple[Any, ...]  # what must agree across ranks about one container or leaf
Spec = tuple[tuple[int, ...], str, str]  # an array leaf as ranks agree on it: shape, dtype name, device type
_DEVICE_TYPES = ("cpu", "cuda")
_ALLOWED_KEYS = (
    "str, int, float, bool, bytes, None, Enum members and tuples of those "
    "(NumPy integer / floating / bool scalars count as int / float / bool)"
)


def is_array(x: Any) -> bool:
    return isinstance(x, (torch.Tensor, np.ndarray))


class Mismatch(ValueError):
    """A rank's value differs in structure from root's (reported through the agreement)."""


class Flat:
    """``x``'s leaves and structure in one depth-first order, and how to rebuild ``x``.

    ``nodes`` holds ``(path, description)`` for every container and leaf; two ranks
    hold the same structure exactly when their descriptions are equal, and the first
    unequal pair names the first difference (the paths agree up to it).
    With root's optimizer state ``skeletons``, each optimizer's state is matched to
    root's (entries created, not yet installed) instead of taken as it is.
    ``rebuild`` builds the result without touching ``x``: what must change in place
    (an optimizer's hyper-parameters and state) is appended to ``commits`` instead.
    """

    def __init__(self, x: Any, skeletons: list[list[dict[str, Any]]] | None, refuse_sync_bn: bool) -> None:
        self.leaves: list[Any] = []
        self.leaf_paths: list[str] = []
        self.leaf_nodes: list[int] = []  # each leaf's index in ``nodes``
        self.nodes: list[tuple[str, Node]] = []
        self.optimizers: list[torch.optim.Optimizer] = []
        self.commits: list[Callable[[], None]] = []
        self._skeletons = skeletons
        self._refuse_sync_bn = refuse_sync_bn
        self.rebuild = self._walk(x, "x")

    def _leaf(self, x: Any, path: str) -> None:
        self.leaves.append(x)
        self.leaf_paths.append(path)
        self.leaf_nodes.append(len(self.nodes))
        self.nodes.append((path, ("array", *array_spec(x, path)) if is_array(x) else ("object",)))

    def _walk(self, x: Any, path: str) -> Rebuild:
        """Append ``x``'s leaves and nodes; return a function rebuilding ``x`` from new leaf values."""
        if is_array(x):
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
        if self._refuse_sync_bn:
            refuse_sync_batchnorm(m, path, "synchronize")
        named = [*((n, p.data) for n, p in m.named_parameters()), *m.named_buffers()]
        self.nodes.append((path, ("module", type_name(m), tuple(n for n, _ in named))))
        for n, t in named:
            self._leaf(t, f"{path}.{n}")

        def rebuild_module(it: Iterator[Any]) -> Any:
            for _ in named:
                next(it)
            return m

        return rebuild_module

    def _optimizer(self, opt: torch.optim.Optimizer, path: str) -> Rebuild:
        index = len(self.optimizers)
        self.optimizers.append(opt)
        self.nodes.append((path, ("optimizer", type_name(opt), tuple(len(g["params"]) for g in opt.param_groups))))
        hyper = self._walk(
            [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups], f"{path}.param_groups"
        )
        if self._skeletons is not None and index < len(self._skeletons):
            states = match_state(opt, self._skeletons[index], f"{path}: optimizer {index}")
        else:  # root's own, or one root does not have (the structure comparison names it)
            states = [dict(opt.state.get(p, {})) for p in _params(opt)]
        state = self._walk(states, f"{path}.state")

        def rebuild_optimizer(it: Iterator[Any]) -> Any:
            groups, per_param = hyper(it), state(it)

            def install() -> None:
                for group, values in zip(opt.param_groups, groups, strict=True):
                    group.update(values)
                for p, values in zip(_params(opt), per_param, strict=True):
                    if values:
                        opt.state[p] = values
                    else:
                        opt.state.pop(p, None)

            self.commits.append(install)
            return opt

        return rebuild_optimizer

    def _dict(self, x: dict, path: str) -> Rebuild:
        keys = list(x)
        tokens = [_key_token(_canonical_key(k, path)) for k in keys]
        order = list(range(len(keys)))
        if not isinstance(x, OrderedDict):  # the same keys in another insertion order are the same structure
            order.sort(key=tokens.__getitem__)
        keys, tokens = [keys[i] for i in order], [tokens[i] for i in order]
        self.nodes.append((path, ("dict", type_name(x), tuple(tokens))))
        parts = [self._walk(x[k], f"{path}[{_token_text(t)}]") for k, t in zip(keys, tokens, strict=True)]

        def rebuild_dict(it: Iterator[Any]) -> Any:
            values = {k: p(it) for k, p in zip(keys, parts, strict=True)}
            new = copy.copy(x)  # keeps the type, an OrderedDict's order, a defaultdict's factory
            new.clear()
            new.update((k, values[k]) for k in x)
            return new

        return rebuild_dict

    def _sequence(self, x: list | tuple, path: str) -> Rebuild:
        self.nodes.append((path, ("sequence", type_name(x), len(x))))
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
        self.nodes.append((path, ("dataclass", type_name(x), tuple(names))))
        parts = [self._walk(getattr(x, n), f"{path}.{n}") for n in names]

        def rebuild_dataclass(it: Iterator[Any]) -> Any:
            new = copy.copy(x)
            for n, p in zip(names, parts, strict=True):
                object.__setattr__(new, n, p(it))  # frozen dataclasses too
            return new

        return rebuild_dataclass


def type_name(x: Any) -> str:
    return f"{type(x).__module__}.{type(x).__qualname__}"


# -- dict keys: matched by value ------------------------------------------------------------


def _canonical_key(k: Any, path: str) -> Any:
    """``k`` as a plain Python value (NumPy scalars become int / float / bool); anything else is refused."""
    if isinstance(k, Enum) or k is None:
        return k
    if isinstance(k, (bool, np.bool_)):
        return bool(k)
    if isinstance(k, (int, np.integer)):
        return int(k)
    if isinstance(k, (float, np.floating)):
        value = float(k)
        if math.isnan(value):
            raise TypeError(
                f"{path}: a dict key is NaN, which equals no key on another rank (NaN != NaN); "
                f"allowed dict keys: {_ALLOWED_KEYS}. Use another key (e.g. the string 'nan')"
            )
        return value
    if isinstance(k, str):
        return str(k)
    if isinstance(k, bytes):
        return bytes(k)
    if isinstance(k, tuple):
        return tuple(_canonical_key(v, path) for v in k)
    raise TypeError(
        f"{path}: a dict holding arrays has a key of type {type_name(k)} ({_short(k)}); ranks match dict "
        f"entries by key value, so the keys must be plain values: {_ALLOWED_KEYS}. Convert the keys "
        "(e.g. {str(k): v for k, v in d.items()}), or keep arrays out of this dict so it travels as one value"
    )


def _key_token(k: Any) -> tuple[str, Any]:
    """A canonical key as ranks compare and sort it: (type, text), so that 1, 1.0 and True differ."""
    if isinstance(k, Enum):
        return (f"enum {type_name(k)}", f"{type(k).__qualname__}.{k.name}")
    if isinstance(k, tuple):
        return ("tuple", tuple(_key_token(v) for v in k))
    return (type(k).__name__, repr(k))


def _token_text(token: tuple[str, Any]) -> str:
    kind, text = token
    if kind != "tuple":
        return text
    parts = [_token_text(t) for t in text]
    return f"({parts[0]},)" if len(parts) == 1 else f"({', '.join(parts)})"


def _short(x: Any, limit: int = 60) -> str:
    try:
        text = repr(x)
    except Exception:
        text = f"<{type(x).__qualname__}>"
    return text if len(text) <= limit else f"{text[: limit - 3]}..."


# -- leaves -----------------------------------------------------------------------------------


def array_spec(leaf: torch.Tensor | np.ndarray, path: str) -> Spec:
    """What every rank must agree on about an array leaf: (shape, dtype name, device type).

    Raises:
        TypeError: a leaf no collective can send: an unsupported dtype, a sparse / nested /
            uninitialized tensor, a device other than CPU or CUDA.
    """
    if isinstance(leaf, torch.Tensor):
        if isinstance(leaf, torch.nn.parameter.UninitializedTensorMixin):
            raise TypeError(
                f"{path}: an uninitialized parameter or buffer (of a lazy module); run one forward pass first"
            )
        unusual = unusual_tensor(leaf, path, in_place=False)
        if unusual is not None:
            raise unusual
        if leaf.device.type not in _DEVICE_TYPES:
            raise TypeError(f"{path}: a tensor on device '{leaf.device}'; allowed: CPU or CUDA tensors")
        device = leaf.device.type
    else:
        device = "cpu"
    try:
        name = dtype_name(leaf)
    except TypeError as e:
        raise TypeError(f"{path}: {e}") from None
    return tuple(leaf.shape), name, device


def _holds_arrays(x: Any) -> bool:
    """Whether ``x`` is or contains an array, module or optimizer (something synchronized in place)."""
    if is_array(x) or isinstance(x, (torch.nn.Module, torch.optim.Optimizer)):
        return True
    return any(_holds_arrays(c) for c in _children(x))


def _children(x: Any) -> list[Any]:
    if isinstance(x, dict):
        return list(x.values())
    if isinstance(x, (list, tuple)):
        return list(x)
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return [getattr(x, f.name) for f in dataclasses.fields(x)]
    return []


def show(node: Node) -> str:
    kind, rest = node[0], node[1:]
    if kind == "array":
        return f"an array of shape {rest[0]}, dtype {rest[1]} on {rest[2]}"
    if kind == "object":
        return "a plain value"
    full = rest[0]
    name = full.rpartition(".")[2]
    article = "an" if name[:1].lower() in "aeiou" else "a"
    if kind == "dict":
        return f"{article} {name} with keys [{', '.join(_token_text(t) for t in rest[1])}]"
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


def first_difference(mine: list[tuple[str, Node]], roots: list[Node]) -> str | None:
    """The first node that differs from root's, or None.

    Nodes are depth-first and a container's node fixes how many children follow, so
    nodes equal up to the end of either list mean equal lists.
    """
    for (path, a), b in zip(mine, roots, strict=False):
        if a != b:
            return f"{path} is {show(a)}, root's is {show(b)}"
    return None


# -- SyncBatchNorm ------------------------------------------------------------------------------


def sync_batchnorm_refused(backend: Backend) -> bool:
    """Whether ``torch.nn.SyncBatchNorm`` would silently act as plain BatchNorm in this world."""
    if backend.size == 1:
        return False
    dist = torch.distributed
    return not (dist.is_available() and dist.is_initialized())


def refuse_sync_batchnorm(module: torch.nn.Module, path: str, caller: str) -> None:
    """Raise ``RuntimeError`` if ``module`` holds a ``torch.nn.SyncBatchNorm`` (call where it is refused)."""
    for name, layer in module.named_modules():
        if isinstance(layer, torch.nn.SyncBatchNorm):
            where = f"{path}.{name}" if name else path
            raise RuntimeError(
                f"{caller}: {where} is a torch.nn.SyncBatchNorm, which needs a torch.distributed process group; "
                "distutils_ml does not create one, so it would silently act as plain BatchNorm (each rank "
                "normalizing with its own batch statistics). To reduce batch statistics across ranks, convert "
                "the model first: model = dml.convert_sync_batchnorm(backend, model) (dml.SyncBatchNorm). For "
                "per-rank statistics use torch.nn.BatchNorm1d/2d/3d instead, optionally with "
                "dml.broadcast_buffers(backend, model) to keep rank 0's running statistics on every rank as DDP does"
            )


# -- optimizer state ----------------------------------------------------------------------------


def _params(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for g in opt.param_groups for p in g["params"]]


@dataclasses.dataclass(frozen=True)
class _Nested:
    """Root's state entry that is a list, tuple or dict (LBFGS keeps lists of tensors): the spec of each item."""

    kind: type
    items: tuple[Any, ...] | dict[Any, Any]


def _entry_spec(v: Any, p: torch.Tensor) -> Any:
    """A state entry's spec: a tensor as (shape, dtype, where), a plain list / tuple / dict as :class:`_Nested`,
    anything else as None (a plain value, replaced by root's)."""
    if isinstance(v, torch.Tensor):
        return (tuple(v.shape), v.dtype, "param" if v.device == p.device else v.device.type)
    if type(v) in (list, tuple):
        return _Nested(type(v), tuple(_entry_spec(x, p) for x in v))
    if type(v) is dict:
        return _Nested(dict, {k: _entry_spec(x, p) for k, x in v.items()})
    return None


def state_skeleton(opt: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """Root's state entries per parameter: tensors as (shape, dtype, where), plain lists, tuples and dicts of them
    as their items' specs, plain values as None.

    ``where`` is "param" for an entry on its parameter's device (so each rank uses its
    own parameter's device, e.g. its own GPU), else the device type ("cpu" for Adam's
    ``step`` next to a CUDA parameter).
    """
    return [{k: _entry_spec(v, p) for k, v in opt.state.get(p, {}).items()} for p in _params(opt)]


def _matching(spec: Any, have: Any, p: torch.Tensor) -> Any:
    """This rank's value for root's entry ``spec``: its own tensor where it fits, else a new one; containers
    rebuilt item by item; a placeholder (None) for a plain value."""
    if spec is None:
        return None
    if isinstance(spec, _Nested):
        if spec.kind is dict:
            assert isinstance(spec.items, dict)
            mine = have if type(have) is dict else {}
            return {k: _matching(s, mine.get(k), p) for k, s in spec.items.items()}
        assert isinstance(spec.items, tuple)
        fits = type(have) is spec.kind and len(have) == len(spec.items)
        return spec.kind(_matching(s, have[i] if fits else None, p) for i, s in enumerate(spec.items))
    shape, dtype, where = spec
    device = p.device if where == "param" else torch.device(where)
    fits = (
        isinstance(have, torch.Tensor)
        and tuple(have.shape) == shape
        and have.dtype == dtype
        and have.device.type == device.type
    )
    return have if fits else torch.empty(shape, dtype=dtype, device=device)


def match_state(opt: torch.optim.Optimizer, skeleton: list[dict[str, Any]], name: str) -> list[dict[str, Any]]:
    """Per-parameter state holding root's set of entries (torch creates state lazily, at the first step).

    Entries that root has and this rank lacks (or holds with another shape, dtype or
    device) are created, to be filled by the data broadcast, inside lists, tuples and dicts too;
    plain values are placeholders replaced by root's; entries root lacks are dropped. Nothing is
    installed here.

    Raises:
        Mismatch: the optimizer's parameter count differs from root's.
    """
    params = _params(opt)
    if len(skeleton) != len(params):
        raise Mismatch(f"{name} has {len(params)} parameters, root's has {len(skeleton)}")
    return [
        {k: _matching(spec, opt.state.get(p, {}).get(k), p) for k, spec in entries.items()}
        for p, entries in zip(params, skeleton, strict=True)
    ]
