"""The state of ``ShardedOptimizer``: consolidated from every rank's shard, and loaded into this rank's.

``state_dict(to=0)`` consolidates the full state on one rank, on the CPU, one entry (state key
and flat buffer) at a time: each rank copies its shard of an entry to a host buffer, the shards
are allgathered there, and the receiving rank cuts the parameters' entries out of them.
``load_state_dict()`` cuts this rank's pieces out of a full state, for any world size, and moves
only them to the device. :class:`ShardedState` holds this for the optimizer, which inherits it.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from distutils_ml.backends.base import Backend
from distutils_ml.collectives import allgather
from distutils_ml.objects import allgather_object
from distutils_ml.sharded_layout import Bucket, Flat, Piece

__all__ = ["ShardedState"]

#: What a parameter's state was kept as while the layout is rebuilt: by ``id`` of the parameter, the parameter,
#: its old index and its full entries; and the (old index, key) of the entries that lived on its device.
Kept = tuple[dict[int, tuple[torch.Tensor, int, dict[str, Any]]], set[tuple[int, str]]]


class ShardedState:
    """The state half of ``ShardedOptimizer``: its full state gathered from the shards, and cut back into them.

    A mixin: it reads the sharded layout (``_params``, ``_pieces``, ``_buckets`` ...) that
    ``ShardedOptimizer`` builds, and the shard optimizer that steps ``_pieces``.
    """

    _backend: Backend
    optimizer: torch.optim.Optimizer
    _inner: torch.optim.Optimizer
    _params: list[torch.Tensor]
    _index: dict[int, int]
    _offset: list[int]
    _flats: list[Flat]
    _buckets: list[Bucket]
    _bucket_of: list[int]
    _pieces: list[Piece]
    _sync_hyper: Callable[[], None]

    def _full_state_dict(self, to: Any) -> dict[str, Any] | None:
        """``state_dict(to)``: the full state on rank ``to`` (every rank with None), None on the others."""
        to = _check_to(to, self._backend.size)
        if self._backend.in_collective():  # inside another collective, which runs this on one rank only
            raise RuntimeError(
                "DistributedOptimizer(shard_state=True).state_dict() is a collective (every rank consolidates the "
                "state), called here from inside another collective on this rank alone, where it would wait for "
                "ranks that never join. Call opt.state_dict() on every rank and pass its result instead, e.g. "
                "dml.save(backend, {'opt': opt.state_dict()}, path)"
            )
        full, _ = self._gather_state(to)
        if full is None:
            return None
        outer = self.optimizer
        added = []
        for i, entries in full.items():
            outer.state[self._params[i]] = entries
            added.append(self._params[i])
        try:
            result = outer.state_dict()
        finally:
            for p in added:
                outer.state.pop(p, None)
        # Parameters the wrapped optimizer keeps whole (frozen ones with state of their own): on the CPU too.
        result["state"] = {
            i: {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in e.items()} if isinstance(e, dict) else e
            for i, e in result["state"].items()
        }
        return result

    def _load_full(self, state_dict: dict[str, Any]) -> None:
        """``load_state_dict(state_dict)``: this rank's slices of a full state into its pieces."""
        self._check_loadable(state_dict)
        theirs = {
            _storage(v)
            for entries in state_dict["state"].values()
            if isinstance(entries, dict)
            for v in entries.values()
            if isinstance(v, torch.Tensor)
        }
        mine = self._slices(state_dict)
        self._inner.state.clear()  # this rank's old shard goes before the new one arrives
        self.optimizer.load_state_dict(mine)
        self._scatter_state(theirs)

    def _keep_state(self) -> Kept:
        """Every sharded parameter's full state, on every rank (a collective), kept while the layout is rebuilt."""
        full, at_param = self._gather_state(None)
        assert full is not None
        return {id(self._params[i]): (self._params[i], i, entries) for i, entries in full.items()}, at_param

    def _restore_state(self, kept: Kept) -> None:
        """State kept by ``_keep_state`` into the new layout's pieces, placed where it was (device or CPU)."""
        kept_by_id, at_param = kept
        for pc in self._pieces:
            p = self._params[pc.index]
            if id(p) not in kept_by_id:
                continue
            _, old, entries = kept_by_id[id(p)]
            self._inner.state[pc.tensor] = {
                k: _place(pc, p, v, (old, k) in at_param) if isinstance(v, torch.Tensor) else copy.deepcopy(v)
                for k, v in entries.items()
            }
        for p, _, entries in kept_by_id.values():  # no longer sharded (its requires_grad switched off): kept whole
            if self._index.get(id(p)) is None:
                self.optimizer.state[p] = entries

    def _check_loadable(self, state_dict: Any) -> None:
        """``TypeError`` / ``ValueError`` unless ``state_dict`` is an optimizer state of this optimizer's groups."""
        how = (
            "pass the full state on every rank: rank 0's opt.state_dict() as saved in a checkpoint (dml.load "
            "returns it on every rank), or opt.state_dict(to=None), which returns it on every rank"
        )
        if not isinstance(state_dict, dict):
            raise TypeError(
                f"ShardedOptimizer.load_state_dict: state_dict: got {type(state_dict).__qualname__}; allowed: a dict "
                f"in torch's format. opt.state_dict() returns the full state on rank 0 only (None elsewhere): {how}"
            )
        missing = [k for k in ("state", "param_groups") if k not in state_dict]
        if missing:
            keys = ", ".join(repr(k) for k in list(state_dict)[:8]) or "none"
            raise ValueError(
                f"ShardedOptimizer.load_state_dict: state_dict: has no {' or '.join(map(repr, missing))} (its keys: "
                f"{keys}); allowed: an optimizer state dict with 'state' and 'param_groups': {how}"
            )
        state, saved, groups = state_dict["state"], state_dict["param_groups"], self.optimizer.param_groups
        if not isinstance(state, dict) or not isinstance(saved, (list, tuple)):
            raise TypeError(
                f"ShardedOptimizer.load_state_dict: state_dict: 'state' is a {type(state).__qualname__} and "
                f"'param_groups' a {type(saved).__qualname__}; allowed: a dict and a list, as in torch's format: {how}"
            )
        if not all(isinstance(g, dict) and "params" in g for g in saved):
            raise ValueError(
                "ShardedOptimizer.load_state_dict: state_dict: 'param_groups' holds an entry that is not a dict with "
                f"'params'; allowed: the groups of an optimizer's state dict: {how}"
            )
        if len(saved) != len(groups):
            raise ValueError(
                f"ShardedOptimizer.load_state_dict: state_dict: has {len(saved)} parameter groups, this optimizer "
                f"{len(groups)}; allowed: the state of an optimizer over the same parameter groups"
            )
        for g, (have, want) in enumerate(zip(saved, groups, strict=True)):
            if len(have["params"]) != len(want["params"]):
                raise ValueError(
                    f"ShardedOptimizer.load_state_dict: state_dict: parameter group {g} has {len(have['params'])} "
                    f"parameters, this optimizer's {len(want['params'])}; allowed: the state of an optimizer over "
                    "the same parameters"
                )

    def _slices(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """``state_dict`` with each sharded parameter's entries cut to this rank's piece (views of the given
        tensors where they are contiguous); parameters with no element on this rank left out."""
        saved = [k for g in state_dict["param_groups"] for k in g["params"]]
        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        piece_of = {pc.index: pc for pc in self._pieces}
        known = set(saved)
        state: dict[Any, Any] = {k: v for k, v in state_dict["state"].items() if k not in known}  # torch keeps these
        for key, p in zip(saved, params, strict=True):
            entries = state_dict["state"].get(key)
            if entries is None:
                continue
            i = self._index.get(id(p))
            if i is None or self._params[i] is not p or not isinstance(entries, dict):
                state[key] = entries  # not sharded (frozen): the wrapped optimizer keeps it whole
                continue
            pc = piece_of.get(i)
            if pc is None:
                continue  # no element of it on this rank
            state[key] = {k: _cut(pc, p, v) if isinstance(v, torch.Tensor) else v for k, v in entries.items()}
        return {**state_dict, "state": state}

    def _scatter_state(self, theirs: set[int] | None = None) -> None:
        """Move the wrapped optimizer's state of the sharded parameters into this rank's pieces.

        An entry shaped like its parameter is cut to the piece (a copy). Others (entries already
        cut by ``load_state_dict``, values such as ``step``) are taken as they are, copied only
        when they are the caller's: ``theirs`` holds the storages of the tensors given to
        ``load_state_dict`` (None: copy every tensor).
        """
        outer, inner = self.optimizer, self._inner
        for pc in self._pieces:
            p = self._params[pc.index]
            entries = outer.state.get(p)
            if not entries:
                continue
            mine: dict[str, Any] = {}
            for k, v in entries.items():
                if not isinstance(v, torch.Tensor):
                    mine[k] = copy.deepcopy(v)
                elif _cut(pc, p, v) is not v:
                    mine[k] = _cut(pc, p, v).clone()
                elif theirs is None or _storage(v) in theirs:
                    mine[k] = v.detach().clone()
                else:
                    mine[k] = v.detach()
            inner.state[pc.tensor] = mine
        for p in self._params:
            outer.state.pop(p, None)
        self._sync_hyper()

    def _gather_state(self, to: int | None) -> tuple[dict[int, dict[str, Any]] | None, set[tuple[int, str]]]:
        """Every sharded parameter's full state, by index in ``_params``, on the CPU, on rank ``to`` (every rank
        with None; None on the others), and the (index, key) of the entries that lived on their parameter's
        device. Collectives: one allgather of what each rank holds, one of host buffers per flat buffer and key."""
        backend = self._backend
        meta: dict[int, list[tuple[str, tuple[Any, ...]]]] = {}
        for pc in self._pieces:
            entries = self._inner.state.get(pc.tensor)
            if not entries:
                continue
            p = self._params[pc.index]
            described = []
            for k, v in entries.items():
                if not isinstance(v, torch.Tensor):
                    described.append((k, ("object", v)))
                elif pc.grad is not None and _is_share(pc, p, v):
                    described.append((k, ("shard", v.dtype, v.device == pc.tensor.device)))
                else:
                    described.append((k, ("value", v.detach().cpu(), v.device == pc.tensor.device)))
            meta[pc.index] = described
        every = allgather_object(backend, (to, meta))
        for r, (theirs, _) in enumerate(every):
            if theirs != every[0][0]:
                raise ValueError(
                    f"ShardedOptimizer.state_dict: to: rank 0 passed {every[0][0]!r}, rank {r} {theirs!r}; allowed: "
                    "the same on every rank (the rank that receives the full state, or None for every rank)"
                )
        merged: dict[int, list[tuple[str, tuple[Any, ...]]]] = {}
        for _, described_by_rank in every:
            for i, described in described_by_rank.items():
                merged.setdefault(i, described)
        full: dict[int, dict[str, Any]] = {}
        at_param: set[tuple[int, str]] = set()
        groups: dict[tuple[int, str, torch.dtype], list[int]] = {}
        flat_index = {id(f): n for n, f in enumerate(self._flats)}
        for i in sorted(merged):
            entries = full[i] = {}
            for k, what in merged[i]:
                if what[0] == "object":
                    entries[k] = copy.deepcopy(what[1])
                    continue
                if what[2]:
                    at_param.add((i, k))
                if what[0] == "shard":
                    flat = self._buckets[self._bucket_of[i]].flat
                    groups.setdefault((flat_index[id(flat)], k, what[1]), []).append(i)
                    entries[k] = None  # filled below, in this order
                else:
                    entries[k] = what[1].clone()
        mine = to is None or backend.rank == to
        for (f, k, dtype), members in groups.items():
            self._gather_entry(self._flats[f], (k, dtype), members, full if mine else None)
        return (full if mine else None), at_param

    def _gather_entry(
        self, flat: Flat, entry: tuple[str, torch.dtype], members: list[int], full: dict[int, Any] | None
    ) -> None:
        """State ``entry`` (key, dtype) of parameters ``members`` (all in ``flat``) from every rank, on the CPU.

        This rank's shard of it goes to a host buffer piece by piece (no device memory), the shards
        are allgathered there, and ``full`` receives each member's entry, cut out of them (None:
        this rank keeps nothing).
        """
        key, dtype = entry
        shard = torch.zeros(flat.shard, dtype=dtype)
        wanted = set(members)
        for pc in self._pieces:
            value = self._inner.state.get(pc.tensor, {}).get(key) if pc.index in wanted else None
            if isinstance(value, torch.Tensor) and pc.grad is not None:
                shard[pc.shard_at : pc.shard_at + pc.hi - pc.lo].copy_(value.detach().reshape(-1))
        every = torch.empty(self._backend.size, flat.shard, dtype=dtype)
        allgather(self._backend, shard, every)
        if full is None:
            return
        buckets: dict[int, torch.Tensor] = {}
        for i in members:
            k = self._bucket_of[i]
            b = self._buckets[k]
            if k not in buckets:  # the bucket's elements in flat order: piece 0, piece 1, ...
                buckets[k] = every[:, b.shard_at : b.shard_at + b.piece].reshape(-1)
            p = self._params[i]
            at = self._offset[i] - b.start
            full[i][key] = buckets[k][at : at + p.numel()].view(p.shape).clone()


def _check_to(to: Any, size: int) -> int | None:
    """``to`` of ``state_dict`` as an int (or None), or the error every rank raises alike before communicating."""
    allowed = f"a rank from 0 to {size - 1} (the one that receives the full state), or None for every rank"
    if to is None:
        return None
    if isinstance(to, bool) or not isinstance(to, (int, np.integer)):
        raise TypeError(f"ShardedOptimizer.state_dict: to: got {type(to).__qualname__} {to!r}; allowed: {allowed}")
    if not 0 <= to < size:
        raise ValueError(
            f"ShardedOptimizer.state_dict: to: got {int(to)}, but this job has {size} rank(s); allowed: {allowed}"
        )
    return int(to)


def _cut(pc: Piece, p: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """State tensor ``v`` of parameter ``p`` cut to piece ``pc`` when it is shaped like ``p`` (a view where it
    is contiguous); ``v`` itself when it is whole already or no per-element entry."""
    if pc.whole or v.shape != p.shape:
        return v
    return v.detach().reshape(-1)[pc.lo : pc.hi]


def _place(pc: Piece, p: torch.Tensor, v: torch.Tensor, at_param: bool) -> torch.Tensor:
    """Piece ``pc``'s own copy of full entry ``v`` (on the CPU), on its parameter's device or, if not
    ``at_param``, the CPU."""
    piece = _cut(pc, p, v)
    return piece.to(pc.tensor.device if at_param else torch.device("cpu"), copy=piece is not v)


def _storage(v: torch.Tensor) -> int:
    """Where ``v``'s storage starts: tensors with the same one share their memory."""
    return v.untyped_storage().data_ptr()


def _is_share(pc: Piece, p: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether state tensor ``v`` of piece ``pc`` (of parameter ``p``) holds one value per element of the piece."""
    if pc.whole:
        return tuple(v.shape) == tuple(p.shape)
    return v.dim() == 1 and v.numel() == pc.hi - pc.lo
