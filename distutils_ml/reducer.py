"""Gradient buckets allreduced after backward or during it (``GradientReducer``, a ``BucketMachine``).

How gradients travel (chosen by measurement on CPU, see docs/benchmarks): a gradient of
at least ``bucket_bytes`` is its own bucket, reduced in place in ``.grad``, zero-copy (the
backend cuts it into segments); smaller gradients share flat buckets of about
``bucket_bytes`` per dtype and device (:mod:`distutils_ml.buckets` cuts them and runs the
rounds during backward). After a reduction each small parameter's ``.grad`` *is* its slice
of a bucket (as with DDP's ``gradient_as_bucket_view``): when gradients are kept between
steps backward adds into the bucket and nothing is copied; a fresh gradient is copied in
once and replaced by its slice.

The last bucket carries a small header: one flag per parameter (which ranks have a
gradient: a parameter whose ``.grad`` is None on some ranks counts as zeros there, one
whose ``.grad`` is None on every rank stays None), whether a rank found its parameters
changed since the plan was built, and in which order each rank's buckets became ready.
So those checks cost no extra message, and each ends in the same error on every rank.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from distutils_ml.backends.base import Backend, ReduceOp, resolve_op
from distutils_ml.buckets import (
    REDUCER_CUT,
    BucketBytes,
    BucketMachine,
    Round,
    check_communication_dtype,
    cut_buckets,
    encode_order,
    identity_differs,
    identity_error,
    is_slice,
    order_error,
    order_mismatch,
    ring_array,
)
from distutils_ml.collectives import allgather, allreduce
from distutils_ml.gloo import GlooTransport
from distutils_ml.joined import world_average, world_average_requested
from distutils_ml.objects import allgather_object, digest
from distutils_ml.sparse import sparse_allreduce
from distutils_ml.transport import transport_for

__all__ = ["GradientReducer", "ReducedValues", "agree_on_settings", "ranks_text"]

_SETTINGS = ("op", "communication_dtype", "bucket_bytes", "sparse_as_dense", "parameters")
_HALVES = (torch.float16, torch.bfloat16)
_SPARSE_OPS = (ReduceOp.SUM, ReduceOp.AVG)  # what sparse_allreduce reduces


@dataclass
class _Bucket:
    """Parameters reduced in one collective: one large gradient in place (``direct``), or flat slices of ``flat``."""

    params: list[int]
    direct: bool
    flat: torch.Tensor | None = None
    # (parameter index, its flat slice of the bucket, that slice shaped like the parameter)
    slots: list[tuple[int, torch.Tensor, torch.Tensor]] = field(default_factory=list)
    head: int = 0  # elements of header at the start of flat (the last bucket only)


class GradientReducer(BucketMachine):
    """Reduces the gradients of ``params()`` across ranks in fixed-order buckets, after or during backward.

    ``params`` returns the parameters (the same list, in the same order, on every rank);
    ``labels`` names them for error messages. ``reduce()`` reduces now; ``attach()`` makes
    every ``backward()`` reduce before it returns, until ``detach()``. ``skip`` (when
    attached) tells whether the current backward only accumulates locally (``no_sync``).
    """

    def __init__(
        self,
        caller: str,
        op: Any,
        bucket_bytes: BucketBytes,
        communication_dtype: torch.dtype | None,
        *,
        params: Callable[[], list[torch.Tensor]],
        labels: Callable[[], list[str]],
        fix: str,
        identity: int,
    ) -> None:
        self.caller = caller
        self.identity = identity  # buckets.machine_identity: its number on its backend, carried by the header
        self.op = resolve_op(op)
        self.bucket_bytes = bucket_bytes  # checked by default_bucket_bytes, which every caller goes through
        self.comm_dtype = check_communication_dtype(communication_dtype)
        self._params_of = params
        self._labels = labels
        self._fix = fix
        # The header counts ranks holding a gradient: SUM/AVG/MAX keep "somebody has one" > 0.
        self._head_op = ReduceOp.MAX if self.op in (ReduceOp.PROD, ReduceOp.MIN) else self.op
        self._plan_key: tuple | None = None
        self._params: list[torch.Tensor] = []
        self._buckets: list[_Bucket] = []
        self._bucket_of: list[int] = []
        self._index: dict[int, int] = {}
        self._init_rounds()
        self._ring: GlooTransport | None = None
        self.backend: Backend | None = None
        self.overlap = False
        #: asked at the first hook of each backward: True leaves its gradients unreduced (``no_sync``)
        self.skip: Callable[[], bool] = lambda: False
        #: called after each reduction that ran during a backward
        self.on_reduced: Callable[[], None] = lambda: None
        #: every reduced gradient is multiplied by this (dml.join: W / the number of ranks that had data)
        self.scale = 1.0
        #: whether dml.join sets ``scale`` (a DistributedOptimizer's reducer): its averages ask for the world's, as
        #: ``scale`` makes them the ranks' with data; other reducers' (allreduce_gradients) are, inside dml.join,
        #: averages over the ranks with data by themselves
        self.rescaled = False
        #: reduce sparse gradients as dense tensors (Horovod's option); else they go as sparse (SUM and AVG)
        self.sparse_as_dense = False
        self._sparse_ids: set[int] = set()  # id() of the parameters whose gradients are reduced as sparse
        #: given the parameters of a bucket whose reduction landed during a backward, steps them
        #: (``step_during_backward``); None: nothing is stepped here
        self.step_bucket: Callable[[list[torch.Tensor]], None] | None = None
        self._sparse: list[int] = []  # their indices in the plan

    def use(self, params: Callable[[], list[torch.Tensor]], labels: Callable[[], list[str]]) -> None:
        """Take the parameters (and their names for messages) from ``params()`` and ``labels()`` from now on."""
        self._params_of, self._labels = params, labels

    # -- the plan ------------------------------------------------------------------------

    def _key(self, params: list[torch.Tensor]) -> tuple:
        return tuple((id(p), p.dtype, p.shape, p.device) for p in params)

    def plan(self, backend: Backend) -> None:
        """Build the buckets for the current parameters (and compare the configuration across ranks)."""
        params = self._params_of()
        key = self._key(params)
        if key == self._plan_key:
            return
        for p in params:
            if p.is_sparse or p.layout != torch.strided:
                raise TypeError(f"{self.caller}: sparse parameters are not supported; use dense tensors")
            if not p.dtype.is_floating_point:
                hint = (
                    " (complex parameters are not reduced: hold them as real ones, torch.view_as_real, and view them "
                    "as complex in the forward)"
                    if p.dtype.is_complex
                    else ""
                )
                raise TypeError(f"{self.caller}: parameter of dtype {p.dtype}; gradients must be floating point{hint}")
        self._agree(backend, params)
        self._ring = transport_for(backend)
        self._build(params)
        self._plan_key = key
        if self._hooked:
            self._hook_params()

    def _build(self, params: list[torch.Tensor]) -> None:
        n = len(params)
        self._sparse = [i for i, p in enumerate(params) if id(p) in self._sparse_ids]
        dense = [i for i in range(n) if id(params[i]) not in self._sparse_ids]
        # The first flat bucket of each wire dtype is smaller (as DDP's first bucket): the last layers'
        # gradients go while backward is still computing the rest.
        groups: list[tuple[bool, tuple[torch.dtype, torch.device] | None, list[int]]] = [
            (alone, None if alone else key, [dense[j] for j in members])
            for alone, key, members in cut_buckets(
                [params[i] for i in dense], self.bucket_bytes, self.comm_dtype, REDUCER_CUT
            )
        ]
        # The header travels in the last bucket sent: the last flat bucket, moved to the end (or a bucket of its own).
        flat_positions = [k for k, g in enumerate(groups) if not g[0]]
        if flat_positions:
            groups.append(groups.pop(flat_positions[-1]))
            head_key = groups[-1][1]
        else:
            head_key = (self.comm_dtype or torch.float32, params[0].device if params else torch.device("cpu"))
            groups.append((False, head_key, []))
        assert head_key is not None
        self._head_dtype = head_key[0]
        self._levels = 4 if head_key[0] in _HALVES else 16
        head = 2 * n + 1 + 3 * len(groups) + 3  # the flags, the changed mark, the sparse marks, the order, the number
        buckets = []
        for k, (direct, key, members) in enumerate(groups):
            if direct:
                buckets.append(_Bucket(members, True))
                continue
            assert key is not None
            extra = head if k == len(groups) - 1 else 0
            flat = torch.zeros(extra + sum(params[i].numel() for i in members), dtype=key[0], device=key[1])
            bucket = _Bucket(members, False, flat, head=extra)
            offset = extra
            for i in members:
                size = params[i].numel()
                part = flat[offset : offset + size]
                offset += size
                bucket.slots.append((i, part, part.view(params[i].shape)))
            buckets.append(bucket)
        self._params = params
        self._buckets = buckets
        self._bucket_of = [-1] * n  # -1: reduced as sparse, after the buckets
        for k, b in enumerate(buckets):
            for i in b.params:
                self._bucket_of[i] = k
        self._index = {id(p): i for i, p in enumerate(params)}

    def _agree(self, backend: Backend, params: list[torch.Tensor]) -> None:
        """Raise ``ValueError`` on every rank unless every rank has the same configuration."""
        settings = (self.op, self.comm_dtype, self.bucket_bytes, self.sparse_as_dense)
        agree_on_settings(backend, self.caller, self._fix, settings, params=params, labels=self._labels)

    # -- reduce now ------------------------------------------------------------------------

    def reduce(self, backend: Backend) -> None:
        """Make every parameter's ``.grad`` the ``op`` of all ranks' gradients now (a sparse one becomes dense)."""
        self._reduce_now(backend)

    # -- during backward -------------------------------------------------------------------

    def attach(self, backend: Backend, *, overlap: bool) -> None:
        """Reduce during every ``backward()`` from now on (hooks on the parameters); ``overlap``: on the thread."""
        self.backend = backend
        self.overlap = overlap
        self._hook_params()

    def _hook_params(self) -> None:
        self._hook_on(self._params if self._plan_key is not None else self._params_of())

    def detach(self) -> None:
        """Stop reducing during backward (removes the hooks)."""
        self._unhook()

    def _skip_this_backward(self) -> bool:
        return self.skip()

    def _begin(self, backend: Backend, *, now: bool) -> bool:
        if now:
            self.plan(backend)
            self._refresh_slots()
            return False
        changed = self._plan_key is not None and self._key(self._params_of()) != self._plan_key
        if self._plan_key is None:
            self.plan(backend)
        self._refresh_slots()
        return changed

    def _refresh_slots(self) -> None:
        """Make each slot's shaped view, which ``.grad`` is made, a view of its bucket again where it stopped being
        one: ``p.grad.data = ...`` or ``p.grad.set_(...)`` moved that tensor's storage out of the bucket (the values
        it holds now are the user's ``.grad``: not a slice of the bucket, it is copied in when the bucket is sent)."""
        for bucket in self._buckets:
            for k, (i, flat, shaped) in enumerate(bucket.slots):
                shape = self._params[i].shape
                # (a parameter of another size than its slot: its .data was replaced, and the round raises)
                if shaped.data_ptr() != flat.data_ptr() and flat.numel() == shape.numel():
                    bucket.slots[k] = (i, flat, flat.view(shape))

    def _reduced_in_backward(self) -> None:
        self.on_reduced()

    def reset(self) -> None:
        """Forget a reduction a failed backward left unfinished (after its sent buckets have gone)."""
        self._reset_round()

    # -- sending ---------------------------------------------------------------------------

    def _fill(self, state: Round, k: int) -> torch.Tensor:
        with torch.no_grad():  # a gradient of backward(create_graph=True) has history: the reduction reads its values
            return self._fill_bucket(state, k)

    def _unplanned(self, i: int, g: torch.Tensor | None) -> bool:
        """Whether parameter ``i`` (or its gradient ``g``) no longer has the shape, dtype or device of the plan (its
        ``.data`` replaced since): the round, whose header says the parameters changed, then sends zeros for it."""
        assert self._plan_key is not None
        _, dtype, shape, device = self._plan_key[i]
        p = self._params[i]
        return any(t is not None and (t.shape != shape or t.dtype != dtype or t.device != device) for t in (p, g))

    def _fill_bucket(self, state: Round, k: int) -> torch.Tensor:
        bucket = self._buckets[k]
        if state.changed and any(self._unplanned(i, self._params[i].grad) for i in bucket.params):
            return self._fill_planned_zeros(state, bucket)
        if bucket.direct:
            i = bucket.params[0]
            p = self._params[i]
            g = p.grad
            state.has[i] = g is not None
            if g is None:
                p.grad = g = torch.zeros_like(p)
                state.allocated.append(i)
            elif g.requires_grad:  # reduced in a copy: its history stays with the original (see _finish)
                sent = g.detach().to_dense().contiguous().clone()
                state.graphs[i] = (g, sent)
                return sent
            elif g.layout != torch.strided:
                self._note_sparse(state, i, g)
                p.grad = g = g.to_dense()
            elif not g.is_contiguous():
                p.grad = g = g.contiguous()
            tensor = g
        else:
            for i, flat, shaped in bucket.slots:
                g = self._params[i].grad
                state.has[i] = g is not None
                if g is None:
                    flat.zero_()
                    continue
                if g.requires_grad:
                    state.graphs[i] = (g, None)
                    g = g.detach()
                if g.layout != torch.strided:
                    self._note_sparse(state, i, g)
                    shaped.copy_(g.to_dense())
                elif not is_slice(g, flat):
                    flat.copy_(g.reshape(-1))
            if bucket.head:
                self._write_head(state, bucket)
            assert bucket.flat is not None
            tensor = bucket.flat
        return tensor

    def _fill_planned_zeros(self, state: Round, bucket: _Bucket) -> torch.Tensor:
        """A bucket holding a parameter whose shape, dtype or device changed since the plan: zeros as the plan laid
        it out, so that every rank makes the same collective (the round then raises on every rank)."""
        for i in bucket.params:
            state.has[i] = False
        if bucket.direct:
            assert self._plan_key is not None
            _, dtype, shape, device = self._plan_key[bucket.params[0]]
            return torch.zeros(shape, dtype=dtype, device=device)
        assert bucket.flat is not None
        bucket.flat[bucket.head :].zero_()
        if bucket.head:
            self._write_head(state, bucket)
        return bucket.flat

    def _landed(self, state: Round, k: int) -> None:
        """During a backward, with ``step_bucket``: step bucket ``k``'s parameters when their reduced gradients are
        final here: every one had a gradient on this rank (else the header, which lands last, says whether any rank
        had one), none has autograd history or a sparse gradient, and no rescaling is due. Otherwise they are left
        to ``step()``. Over gloo, where its allreduce is left in flight, it is stepped once the next bucket's call
        has been posted (that completes it) or at the round's close: the next bucket never waits for a step."""
        if self.step_bucket is None or state.task < 0 or self.scale != 1.0:
            return
        if self._ring is not None and self._ring.in_flight:
            previous, state.landing = state.landing, k
            if previous is not None:
                self._step_landed(state, previous)
            return
        self._step_pending(state)
        self._step_landed(state, k)

    def _step_pending(self, state: Round) -> None:
        """Step the bucket left landing, if any (called with no call in flight: its own has completed)."""
        k, state.landing = state.landing, None
        if k is not None:
            self._step_landed(state, k)

    def _step_landed(self, state: Round, k: int) -> None:
        step = self.step_bucket
        assert step is not None
        bucket = self._buckets[k]
        idx = bucket.params
        if not idx or any(not state.has[i] or i in state.graphs or i in state.sparse_seen for i in idx):
            return
        self._publish(bucket)
        step([self._params[i] for i in idx])

    def _publish(self, bucket: _Bucket, skip: Callable[[int], bool] = lambda i: False) -> None:
        """Each ``.grad`` of a flat bucket (but those of the parameters ``skip`` names) made its reduced slot (cast
        back where the wire was narrower)."""
        for i, flat, shaped in bucket.slots:
            if skip(i):
                continue
            p = self._params[i]
            g = p.grad
            if shaped.dtype != p.dtype:  # compressed on the wire: cast back
                if g is None or g.layout != torch.strided:
                    p.grad = shaped.to(p.dtype, copy=True)
                else:
                    g.copy_(shaped)
            elif g is None or g.layout != torch.strided or not is_slice(g, flat):
                p.grad = shaped  # from now on backward accumulates straight into the bucket

    def _note_sparse(self, state: Round, i: int, g: torch.Tensor) -> None:
        """A sparse gradient in a dense bucket: reduced dense this once; from the next round on as sparse."""
        if g.is_sparse and g.sparse_dim() == 1 and not self.sparse_as_dense and self.op in _SPARSE_OPS:
            state.sparse_seen.add(i)

    def _close(self, backend: Backend, state: Round) -> Callable[[], None] | None:
        """After the buckets: the gloo allreduces left in flight completed (and the bucket left landing stepped),
        then the gradients reduced as sparse (gathered indices and values), in parameter order."""
        if self._ring is None and not self._sparse:
            return None

        def close() -> None:
            self._settle()
            self._step_pending(state)
            if self._sparse:
                self._reduce_sparse(backend, state)

        return close

    def _reduce_sparse(self, backend: Backend, state: Round) -> None:
        params = [self._params[i] for i in self._sparse]
        has = np.array([p.grad is not None for p in params], dtype=np.float64)
        allreduce(backend, has, ReduceOp.MAX)
        for i, p, anyone in zip(self._sparse, params, has, strict=True):
            if not anyone:
                state.sparse[i] = None
                continue
            g = p.grad
            if g is None:  # this rank's share is empty: an embedding's gradient (one sparse dimension)
                g = torch.sparse_coo_tensor(
                    torch.empty(1, 0, dtype=torch.int64, device=p.device),
                    torch.empty(0, *p.shape[1:], dtype=p.dtype, device=p.device),
                    p.shape,
                )
            elif g.layout == torch.strided:
                g = g.detach().to_sparse(sparse_dim=1)
            with self._averages():
                state.sparse[i] = sparse_allreduce(backend, g.detach(), self.op)

    def _averages(self) -> contextlib.AbstractContextManager[None]:
        """Where this reducer's averages divide inside dml.join: by the world size when join rescales them itself
        (``scale``, a DistributedOptimizer's), else by the ranks with data (allreduce_gradients)."""
        return world_average() if self.rescaled else contextlib.nullcontext()

    def _communicate(self, backend: Backend, k: int, tensor: torch.Tensor) -> None:
        bucket = self._buckets[k]
        with self._averages():
            if bucket.head and self._head_op is not self.op:
                _reduce(backend, self._ring, tensor[: bucket.head], self._head_op)
                if tensor.numel() > bucket.head:
                    _reduce(backend, self._ring, tensor[bucket.head :], self.op)
            else:
                _reduce(backend, self._ring, tensor, self.op)

    # -- the header ------------------------------------------------------------------------

    def _write_head(self, state: Round, bucket: _Bucket) -> None:
        """Flags, the changed mark, the sparse marks and each bucket's ready position, at the start of the last
        bucket."""
        n, nb, levels = len(self._params), len(self._buckets), self._levels
        values = np.zeros(bucket.head, dtype=np.float64)
        values[:n] = state.has
        values[n] = 1.0 if state.changed else 0.0
        values[n + 1 + np.fromiter(state.sparse_seen, dtype=np.int64)] = 1.0
        encode_order(values[2 * n + 1 : -3].reshape(nb, 3), state.ready_at, state.task, self._head_op, levels)
        encode_order(values[-3:].reshape(1, 3), [self.identity], 0, self._head_op, levels)
        assert bucket.flat is not None
        bucket.flat[: bucket.head].copy_(torch.from_numpy(values))

    def _finish(self, backend: Backend, state: Round) -> None:
        """After every bucket: gradients in place, None where no rank had one; the header's checks."""
        head_bucket = self._buckets[-1]
        assert head_bucket.flat is not None
        n, nb = len(self._params), len(self._buckets)
        head = head_bucket.flat[: head_bucket.head].double().cpu().numpy()
        if identity_differs(head[-3:], backend.size, self._head_op, self._levels, averaged=self.op is ReduceOp.AVG):
            stepped = self.step_bucket is not None and state.task >= 0  # step_during_backward: buckets were stepped
            raise identity_error(self.caller, self.identity, stepped=stepped)  # first: the rest is not this round's
        if head[n] > 0:  # before any gradient is put back: a changed parameter may no longer fit its slot
            raise RuntimeError(
                f"{self.caller}: the parameters changed after the reduction plan was built (a parameter was "
                "added, removed, replaced, had requires_grad switched or its .data replaced by one of another shape, "
                "dtype or device) on at least one rank; this backward's gradients were not reduced. Create the "
                "wrapper again after changing the model (for DistributedOptimizer, add parameters with its "
                "add_param_group), on every rank"
            )
        somebody = head[:n] > 0
        if self.scale != 1.0:
            self._rescale(state)
        for i in state.allocated:
            if not somebody[i]:
                self._params[i].grad = None
        for i, (local, sent) in state.graphs.items():  # backward(create_graph=True)
            reduced = sent if sent is not None else self._slot(i)
            with torch.enable_grad():
                self._params[i].grad = ReducedValues.apply(local, reduced.to(local.dtype))
        for bucket in self._buckets:
            self._publish(bucket, lambda i: not somebody[i] or i in state.graphs)
        for i, reduced in state.sparse.items():
            self._params[i].grad = reduced if reduced is None or self.scale == 1.0 else reduced * self.scale
        seen = np.flatnonzero(head[n + 1 : 2 * n + 1] > 0)
        if len(seen):  # some rank had a sparse gradient here: sparse again, and reduced as sparse from now on
            for i in seen.tolist():
                p = self._params[i]
                if p.grad is not None:
                    p.grad = p.grad.detach().to_sparse(sparse_dim=1)
                self._sparse_ids.add(id(p))
            self._plan_key = None
        if state.task >= 0:
            self._check_order(backend, head[2 * n + 1 : -3].reshape(nb, 3))

    def _rescale(self, state: Round) -> None:
        """Multiply every reduced gradient by ``scale`` (dml.join: an average over the ranks that had data)."""
        with torch.no_grad():
            for bucket in self._buckets:
                if bucket.direct:
                    i = bucket.params[0]
                    graph = state.graphs.get(i)
                    target = graph[1] if graph is not None else self._params[i].grad
                    if target is not None:
                        target.mul_(self.scale)
                elif bucket.flat is not None:
                    bucket.flat[bucket.head :].mul_(self.scale)

    def _slot(self, i: int) -> torch.Tensor:
        """Parameter ``i``'s slice of its flat bucket, shaped like it."""
        return next(shaped for j, _, shaped in self._buckets[self._bucket_of[i]].slots if j == i)

    def _check_order(self, backend: Backend, order: np.ndarray) -> None:
        """Raise on every rank if the buckets became ready in different orders (every rank's hooks fired)."""
        used = [k for k, b in enumerate(self._buckets) if b.params]  # not the header's own bucket
        differs = order_mismatch(
            order[used], backend.size, self._head_op, self._levels, averaged=self.op is ReduceOp.AVG
        )
        if differs is not None and differs.any():
            k = used[int(np.flatnonzero(differs)[0])]
            labels = self._labels()
            raise order_error(self.caller, k, len(self._buckets), [labels[i] for i in self._buckets[k].params])


class ReducedValues(torch.autograd.Function):
    """The reduced values of a gradient that has autograd history (``backward(create_graph=True)``), with that history:
    the value is ``reduced`` exactly; a backward through it goes into ``local``'s graph (torch DDP's behaviour: the
    graph is this rank's own gradient's)."""

    @staticmethod
    def forward(ctx: Any, local: torch.Tensor, reduced: torch.Tensor) -> torch.Tensor:
        return reduced.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def _reduce(backend: Backend, ring: GlooTransport | None, tensor: torch.Tensor, op: ReduceOp) -> None:
    """One bucket's allreduce: over gloo across hosts (:mod:`distutils_ml.transport`), else the backend. Over gloo
    it is left in flight once the calls before it have landed (its first exchange goes while the one before it
    lands, without a round trip's pause): the next bucket, or the round's close (:meth:`GradientReducer._close`),
    completes it."""
    # Inside dml.join (an observer) an average over the ranks with data goes over the backend, whose averages the
    # join makes so (the gloo transport's divide by the world size).
    over_ring = op is not ReduceOp.AVG or not backend.observed or world_average_requested()
    array = ring_array(ring, tensor, op) if over_ring else None
    if ring is not None and array is not None:
        ring.allreduce(array, op, wait=False)
        ring.settle(keep=1)
        return
    if ring is not None:
        ring.settle()
    allreduce(backend, tensor, op)


def agree_on_settings(
    backend: Backend,
    caller: str,
    fix: str,
    settings: tuple[Any, ...],
    *,
    params: list[torch.Tensor],
    labels: Callable[[], list[str]],
) -> None:
    """Raise ``ValueError`` on every rank unless every rank has the same ``settings`` (op, communication
    dtype, bucket bytes, sparse_as_dense: as many as given, in that order) and parameters (shapes, dtypes,
    device types): one small allgather when they agree."""
    shapes = [f"{tuple(p.shape)} {p.dtype} {p.device.type}" for p in params]
    mine = np.array([digest(repr(v)) for v in (*settings, shapes)], dtype=np.int64)
    every = np.empty((backend.size, mine.size), dtype=np.int64)
    allgather(backend, mine, every)
    if (every == every[0]).all():
        return
    values = allgather_object(backend, (*settings, _describe(params, labels())))
    odd = [r for r, v in enumerate(values) if not _is_settings(v, len(settings))]
    if odd:  # what came is no rank's settings: some rank is in another collective
        raise RuntimeError(
            f"{caller}: comparing the configuration across ranks, {ranks_text(odd)} sent something else "
            f"({type(values[odd[0]]).__name__}): the ranks' collectives are out of step (a rank skipped or added "
            "one). Run with DML_DEBUG=1 to name the call that differs"
        )
    lines = []
    names = (*_SETTINGS[: len(settings)], _SETTINGS[-1])
    for k, name in enumerate(names):
        if (every[:, k] != every[0, k]).any():
            column = [v[k] for v in values]
            lines.append(_parameters_difference(column) if name == "parameters" else _by_rank(name, column))
    raise ValueError(
        f"{caller}: the ranks are configured differently: {'; '.join(lines)}. {fix}, over the "
        "same parameters in the same order (same shapes, dtypes and device types), on every rank"
    )


def _is_settings(value: Any, count: int) -> bool:
    """Whether ``value`` is what :func:`agree_on_settings` sends: ``count`` settings, then the parameters'
    (name, description) pairs."""
    if not (isinstance(value, tuple) and len(value) == count + 1 and isinstance(value[-1], list)):
        return False
    return all(isinstance(p, tuple) and len(p) == 2 and all(isinstance(x, str) for x in p) for p in value[-1])


def _describe(params: list[torch.Tensor], labels: list[str]) -> list[tuple[str, str]]:
    """(name, description) of each parameter, for the message naming a difference."""
    return [(label, f"{tuple(p.shape)} {p.dtype} on {p.device.type}") for p, label in zip(params, labels, strict=True)]


def ranks_text(ranks: list[int]) -> str:
    """'rank 3' or 'ranks [1, 2]'."""
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks}"


def _grouped(column: list[Any]) -> str:
    """``column[r]`` is rank r's value: 'v1 on rank(s) [..], v2 on rank(s) [..]'."""
    groups: dict[str, list[int]] = {}
    for r, v in enumerate(column):
        groups.setdefault(repr(v) if not isinstance(v, str) else v, []).append(r)
    return ", ".join(f"{v} on {ranks_text(rs)}" for v, rs in groups.items())


def _by_rank(name: str, column: list[Any]) -> str:
    return f"{name} is {_grouped(column)}"


def _parameters_difference(column: list[list[tuple[str, str]]]) -> str:
    """Where the parameter lists of the ranks differ: their counts, then the first differing position."""
    parts = []
    counts = [len(c) for c in column]
    if len(set(counts)) > 1:
        parts.append(f"the number of parameters is {_grouped(counts)}")
    differing = [i for i in range(min(counts)) if len({c[i] for c in column}) > 1]
    if differing:
        i = differing[0]
        names = {c[i][0] for c in column}
        shown = [c[i][1] for c in column] if len(names) == 1 else [f"{c[i][0]} {c[i][1]}" for c in column]
        label = f" ({column[0][i][0]})" if len(names) == 1 else ""
        parts.append(f"parameter {i}{label} is {_grouped(shown)} ({len(differing)} position(s) differ in all)")
    return "; ".join(parts)
