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

The walker is our own rather than ``torch.utils._pytree`` (private; optree is not a
dependency): pytree treats dataclasses and dict / list subclasses as leaves unless
registered process-wide, has no "a plain subtree is one value" rule, and its
TreeSpec equality cannot name the first difference.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import pickle
from collections import OrderedDict
from collections.abc import Callable, Iterator
from enum import Enum
from typing import Any, TypeVar

import numpy as np
import torch

from distutils_ml.arrays import TORCH_DTYPE, OnDevice, cuda_tensor, dtype_name, result_view, unusual_tensor
from distutils_ml.backends.base import Backend, check_backend
from distutils_ml.collectives import _check_root, allgather, bcast
from distutils_ml.objects import allgather_object, exclusive, run_on_root

__all__ = ["synchronize"]

T = TypeVar("T")
Rebuild = Callable[[Iterator[Any]], Any]
Node = tuple[Any, ...]  # what must agree across ranks about one container or leaf
Spec = tuple[tuple[int, ...], str, str]  # an array leaf as ranks agree on it: shape, dtype name, device type
_DEVICE_TYPES = ("cpu", "cuda")
_ALLOWED_KEYS = (
    "str, int, float, bool, bytes, None, Enum members and tuples of those "
    "(NumPy integer / floating / bool scalars count as int / float / bool)"
)


def _is_array(x: Any) -> bool:
    return isinstance(x, (torch.Tensor, np.ndarray))


class _Mismatch(ValueError):
    """A rank's value differs in structure from root's (reported through the agreement)."""


class _Flat:
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
        self.nodes.append((path, ("array", *array_spec(x, path)) if _is_array(x) else ("object",)))

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
        if self._refuse_sync_bn:
            refuse_sync_batchnorm(m, path, "synchronize")
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
        index = len(self.optimizers)
        self.optimizers.append(opt)
        self.nodes.append((path, ("optimizer", _type_name(opt), tuple(len(g["params"]) for g in opt.param_groups))))
        hyper = self._walk(
            [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups], f"{path}.param_groups"
        )
        if self._skeletons is not None and index < len(self._skeletons):
            states = _match_state(opt, self._skeletons[index], f"{path}: optimizer {index}")
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
        self.nodes.append((path, ("dict", _type_name(x), tuple(tokens))))
        parts = [self._walk(x[k], f"{path}[{_token_text(t)}]") for k, t in zip(keys, tokens, strict=True)]

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
        f"{path}: a dict holding arrays has a key of type {_type_name(k)} ({_short(k)}); ranks match dict "
        f"entries by key value, so the keys must be plain values: {_ALLOWED_KEYS}. Convert the keys "
        "(e.g. {str(k): v for k, v in d.items()}), or keep arrays out of this dict so it travels as one value"
    )


def _key_token(k: Any) -> tuple[str, Any]:
    """A canonical key as ranks compare and sort it: (type, text), so that 1, 1.0 and True differ."""
    if isinstance(k, Enum):
        return (f"enum {_type_name(k)}", f"{type(k).__qualname__}.{k.name}")
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


def _check_writable(leaf: torch.Tensor | np.ndarray, path: str) -> None:
    """Raise unless root's data can be written into ``leaf`` in place."""
    if isinstance(leaf, np.ndarray):
        if not leaf.flags.writeable:
            raise ValueError(f"{path}: a read-only array cannot receive root's data; pass a writable array")
    elif leaf.numel() > 1 and any(s == 0 and n > 1 for s, n in zip(leaf.stride(), leaf.shape, strict=True)):
        raise ValueError(
            f"{path}: elements of this tensor share memory (an expanded view) and cannot each receive root's "
            "data; pass a tensor with memory of its own (.clone())"
        )


def _holds_arrays(x: Any) -> bool:
    """Whether ``x`` is or contains an array, module or optimizer (something synchronized in place)."""
    if _is_array(x) or isinstance(x, (torch.nn.Module, torch.optim.Optimizer)):
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


def _dumps(value: Any, path: str) -> tuple[str, bytes]:
    try:
        return _type_name(value), pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
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


def _match_state(opt: torch.optim.Optimizer, skeleton: list[dict[str, Any]], name: str) -> list[dict[str, Any]]:
    """Per-parameter state holding root's set of entries (torch creates state lazily, at the first step).

    Entries that root has and this rank lacks (or holds with another shape, dtype or
    device) are created, to be filled by the data broadcast; plain values are
    placeholders replaced by root's; entries root lacks are dropped. Nothing is
    installed here.

    Raises:
        _Mismatch: the optimizer's parameter count differs from root's.
    """
    params = _params(opt)
    if len(skeleton) != len(params):
        raise _Mismatch(f"{name} has {len(params)} parameters, root's has {len(skeleton)}")
    states = []
    for p, entries in zip(params, skeleton, strict=True):
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
        states.append(new)
    return states


# -- the fused broadcast ------------------------------------------------------------------------


class FusedBroadcast:
    """Root's arrays into every rank's arrays: one flat 1-D broadcast per (dtype, device type).

    Built before the ranks agree, from the agreed ``specs`` (root's shapes, dtypes and
    device types) alone: every rank calls the same collectives with the same shapes,
    whatever its arrays' layout. Construction does everything that can fail locally
    (checks, staging buffers, root's copy into them); :meth:`run` then only broadcasts
    and, off root, copies staged data back into the arrays.

    A group of one contiguous leaf that the collectives accept as it is travels in place
    (a 1-D view of it); any other leaf (negative or other strides, read-only on root,
    a view torch will not hand to NumPy) is copied into a flat buffer and back.
    """

    def __init__(self, leaves: list[Any], paths: list[str], specs: list[Spec], is_root: bool) -> None:
        self.is_root = is_root
        members: dict[tuple[str, str], list[tuple[Any, tuple[int, ...]]]] = {}
        for leaf, path, (shape, dtype, device) in zip(leaves, paths, specs, strict=True):
            if not is_root:
                _check_writable(leaf, path)
            members.setdefault((dtype, device), []).append((leaf, shape))
        # (buffer, [(leaf, segment)]): the buffer each broadcast sends, and where each leaf's data sits in it
        self.groups: list[tuple[Any, list[tuple[Any, Any]]]] = []
        for (dtype, _), group in members.items():
            total = sum(math.prod(shape) for _, shape in group)
            if total == 0:
                continue
            direct = _in_place_buffer(group[0][0]) if len(group) == 1 else None
            if direct is not None:
                self.groups.append((direct, []))
                continue
            flat = _flat_buffer(total, dtype, group[0][0])
            segments, offset = [], 0
            for leaf, shape in group:
                n = math.prod(shape)
                segment = _segment(flat[offset : offset + n].reshape(shape), leaf)
                if is_root:
                    _copy(segment, leaf)
                segments.append((leaf, segment))
                offset += n
            self.groups.append((flat, segments))

    def run(self, backend: Backend, root: int) -> None:
        """Broadcast every group from root; off root, copy staged data into the leaves."""
        for buf, segments in self.groups:
            bcast(backend, buf, root=root)
            if not self.is_root:
                for leaf, segment in segments:
                    _copy(leaf, segment)


def _in_place_buffer(leaf: Any) -> Any:
    """A flat 1-D view of ``leaf`` that ``bcast`` accepts as it is, or None (then it is staged)."""
    if isinstance(leaf, np.ndarray):
        if not (leaf.flags.c_contiguous and leaf.flags.writeable):
            return None
        return leaf.reshape(-1)
    view = leaf.detach()
    if not view.is_contiguous():
        return None
    view = view.view(-1)
    try:
        result_view(view, "buf")
    except OnDevice:
        if not cuda_tensor(view, "buf").is_contiguous():
            return None
    except Exception:
        return None
    return view


def _flat_buffer(total: int, dtype: str, first: Any) -> Any:
    """A staging buffer: NumPy for CPU dtypes NumPy has, else a torch tensor on ``first``'s device."""
    if isinstance(first, np.ndarray) or (first.device.type == "cpu" and dtype != "bfloat16"):
        return np.empty(total, dtype=np.dtype(dtype))
    return torch.empty(total, dtype=TORCH_DTYPE[dtype], device=first.device)


def _segment(part: Any, leaf: Any) -> Any:
    """``leaf``'s part of the staging buffer, of ``leaf``'s kind (array or tensor)."""
    if isinstance(leaf, torch.Tensor) and isinstance(part, np.ndarray):
        return torch.from_numpy(part)  # our own contiguous buffer: always accepted
    return part


def _copy(dst: Any, src: Any) -> None:
    """``dst[...] = src`` for same-kind arrays of one shape, whatever their strides."""
    if isinstance(dst, np.ndarray):
        np.copyto(dst, src)
    else:
        dst.detach().copy_(src.detach())


# -- the agreement --------------------------------------------------------------------------


def agree(
    backend: Backend,
    caller: str,
    root: int,
    failure: Exception | None,
    *,
    signature: int = 0,
    listing: list[tuple[Any, ...]] | None = None,
    differs: str = "hold a structure that differs from",
    fix: str = "Pass the same containers, keys, lengths and array shapes on every rank",
) -> None:
    """Raise on every rank if any rank failed to prepare, or its ``signature`` differs from root's.

    One allgather of two int64 per rank when all is well. Otherwise every rank gathers
    every rank's report (and ``listing``, which names the first entry where a rank's
    signature differs from root's) and raises the same exception class: ``ValueError``
    when every failing rank differs from root, else that of the lowest failing rank
    where it is a ``TypeError``, ``ValueError`` or ``RuntimeError``, else ``RuntimeError``.
    """
    mine = np.array([failure is not None, signature], dtype=np.int64)
    every = np.empty((backend.size, 2), dtype=np.int64)
    allgather(backend, mine, every)
    bad = [r for r in range(backend.size) if every[r, 0] or every[r, 1] != every[root, 1]]
    if not bad:
        return
    report = None
    if failure is not None:
        report = ("mismatch" if isinstance(failure, _Mismatch) else type(failure).__name__, str(failure))
    reports = allgather_object(backend, (report, listing))
    details: dict[str, list[int]] = {}
    kinds = []
    for r in bad:
        (kind, text), theirs = reports[r][0] or ("mismatch", None), reports[r][1]
        if text is None:
            text = _first_listed_difference(theirs or [], reports[root][1] or [])
        kinds.append(kind)
        details.setdefault(text if kind == "mismatch" else f"{kind}: {text}", []).append(r)
    detail = "; ".join(f"rank {rs[0]}: {t}" if len(rs) == 1 else f"ranks {rs}: {t}" for t, rs in details.items())
    if all(k == "mismatch" for k in kinds):
        raise ValueError(f"{caller}: rank(s) {bad} {differs} root {root}'s: {detail}. {fix}; nothing was sent")
    cls = {"TypeError": TypeError, "ValueError": ValueError, "mismatch": ValueError}.get(kinds[0], RuntimeError)
    raise cls(f"{caller}: rank(s) {bad} cannot take part (nothing was sent; every rank raises): {detail}")


def _first_listed_difference(mine: list[tuple[Any, ...]], roots: list[tuple[Any, ...]]) -> str:
    for a, b in zip(mine, roots, strict=False):
        if a != b:
            return f"{a[0]} is {_show(('array', *a[1:]))}, root's {b[0]} is {_show(('array', *b[1:]))}"
    return f"{len(mine)} entries, root's has {len(roots)}"


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


def _first_difference(mine: list[tuple[str, Node]], roots: list[Node]) -> str | None:
    """The first node that differs from root's, or None.

    Nodes are depth-first and a container's node fixes how many children follow, so
    nodes equal up to the end of either list mean equal lists.
    """
    for (path, a), b in zip(mine, roots, strict=False):
        if a != b:
            return f"{path} is {_show(a)}, root's is {_show(b)}"
    return None


# -- synchronize ---------------------------------------------------------------------------------


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
    root = _check_root(backend, root)
    with exclusive(backend, "synchronize"):
        return _synchronize(backend, x, root)


def _synchronize(backend: Backend, x: T, root: int) -> T:
    is_root = backend.rank == root
    refuse = sync_batchnorm_refused(backend)
    held: list[_Flat] = []

    def describe() -> tuple[list[Any], list[Node], list[tuple[str, bytes] | None]]:
        """Root's structure, optimizer state entries and pickled plain leaves (inside the broadcast)."""
        flat = _Flat(x, None, refuse)
        held.append(flat)
        blobs = [
            None if _is_array(leaf) else _dumps(leaf, path)
            for leaf, path in zip(flat.leaves, flat.leaf_paths, strict=True)
        ]
        return [_state_skeleton(o) for o in flat.optimizers], [d for _, d in flat.nodes], blobs

    skeletons, root_nodes, blobs = run_on_root(backend, describe, root=root, what="synchronize")

    failure: Exception | None = None
    try:
        if is_root:
            flat = held[0]
            values = flat.leaves
        else:
            flat = _Flat(x, skeletons, refuse)
            difference = _first_difference(flat.nodes, root_nodes)
            if difference is not None:
                raise _Mismatch(difference)
            values = [
                leaf if blob is None else _loads(blob, path, root)
                for leaf, path, blob in zip(flat.leaves, flat.leaf_paths, blobs, strict=True)
            ]
        arrays = [i for i, leaf in enumerate(flat.leaves) if _is_array(leaf)]
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
