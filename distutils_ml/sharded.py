"""``ShardedOptimizer`` (``DistributedOptimizer(..., shard_state=True)``): optimizer state sharded over ranks (ZeRO-1).

Layout. The parameters of the wrapped optimizer that require gradients move into one
flat buffer per (dtype, device): each parameter's ``.data`` becomes a view of it, and
its ``.grad`` a view of a flat gradient buffer laid out alike (gradient-as-bucket-view).
Each flat buffer is cut into buckets in reverse parameter order by
:func:`distutils_ml.buckets.cut_buckets` (a parameter of at least ``bucket_bytes`` is a
bucket of its own, smaller ones share buckets of about ``bucket_bytes``, the first at most
1 MiB; unlike the reducer's cut, ``SHARDED_CUT``: grouped by parameter dtype, no place for
zero-element parameters), each bucket padded to a multiple of W, the number of ranks.
Rank r owns piece r of every bucket: its shard, a W-th of the elements (elements, not whole
parameters, are sharded).

Backward. A bucket is reduce-scattered as soon as all its gradients are accumulated
(the rounds of :class:`distutils_ml.buckets.BucketMachine`: post-accumulate-grad hooks, on the
backend's communication thread with ``overlap``, else from the autograd engine's final
callback), in a fixed order identical on every rank. The
reduced piece lands in place, in this rank's piece of the flat gradient buffer; the rest
of ``.grad`` keeps this rank's own gradients. A small header (which ranks have a gradient
for each parameter, whether the parameters changed, the order in which buckets became
ready) goes last, in one small reduce-scatter of its own.

Stepping during backward (``step_during_backward=True``). Each bucket's ``_landed`` steps this
rank's pieces of it when every parameter of the bucket had a gradient here, then allgathers it, on
every rank and in every round: the collectives go reduce-scatter, allgather, bucket by bucket, then
the header, alike everywhere. The header also carries, written on the communication thread after
the buckets, which buckets each rank stepped and whether a step raised: at the end of the round
every rank raises if one did; otherwise the buckets not stepped on every rank are stepped where
they were not (gradients nobody had are None) and allgathered again
(:meth:`ShardedOptimizer._step_rest`).

Step. A twin of the wrapped optimizer (same class and hyper-parameters) holds one
tensor per (parameter, piece) overlap, views of the flat parameter buffer, so its state
is this rank's share. It steps them on the reduced gradients; then every bucket's
pieces are allgathered back into the flat parameter buffer, which the model's
parameters are views of. ``state_dict(to=0)`` consolidates the full state on one rank, on
the CPU, one entry (state key and flat buffer) at a time (collectives); ``load_state_dict()``
cuts this rank's pieces out of a full state, for any world size, and moves only them to the
device. The layout is built in :mod:`distutils_ml.sharded_layout`, the state consolidated and
loaded in :mod:`distutils_ml.sharded_state`.
"""

from __future__ import annotations

import functools
import inspect
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch

from distutils_ml.backends.base import Backend, ReduceOp, resolve_op
from distutils_ml.buckets import (
    SHARDED_CUT,
    BucketMachine,
    Round,
    check_communication_dtype,
    cut_buckets,
    default_bucket_bytes,
    default_overlap,
    encode_order,
    identity_differs,
    identity_error,
    is_slice,
    machine_identity,
    order_error,
    order_mismatch,
    ring_array,
)
from distutils_ml.collectives import allgather, allreduce, reduce_scatter
from distutils_ml.gloo import GlooTransport
from distutils_ml.objects import exclusive
from distutils_ml.optimizer_base import DataParallelOptimizer, Phase
from distutils_ml.reducer import agree_on_settings
from distutils_ml.sharded_clip import ShardedClipping
from distutils_ml.sharded_layout import Bucket, Piece, build_layout
from distutils_ml.sharded_rules import check_group, check_shardable, register_elementwise
from distutils_ml.sharded_state import ShardedState
from distutils_ml.stepping import (
    describe_positions,
    grad_mark,
    hyper_parameters,
    same_hyper_parameters,
    step_groups,
    step_optimizer,
)
from distutils_ml.transport import transport_for

__all__ = ["ShardedOptimizer"]

_FIX = (
    "Create DistributedOptimizer with shard_state=True and the same op, bucket_bytes, communication_dtype, "
    "step_during_backward and prefetch"
)


class ShardedOptimizer(DataParallelOptimizer, BucketMachine, ShardedState, ShardedClipping):
    """``DistributedOptimizer`` whose optimizer state is sharded over the ranks (ZeRO-1).

    Create it as ``dml.DistributedOptimizer(backend, optimizer, shard_state=True)``
    (or by this name). Each rank keeps the optimizer state of a W-th of the parameters'
    elements: gradients are reduce-scattered during ``backward()`` (each rank receives
    the reduced gradients of its shard), ``step()`` steps this rank's shard, and the
    updated parameters are allgathered — the traffic of one allreduce, with 1/W of the
    optimizer state per rank. The model's parameters become views of one flat buffer
    per dtype and device, their gradients views of a flat gradient buffer.

    What differs from ``shard_state=False``:

    - After ``backward()`` only this rank's shard of each ``.grad`` is the reduced one;
      the rest holds this rank's own gradients. Clip with :meth:`clip_grad_norm_`, not
      ``torch.nn.utils.clip_grad_norm_``. Scale fp16 losses with ``dml.ShardedGradScaler``
      (``torch.amp.GradScaler`` is refused: its inf/NaN check is each rank's own).
    - ``state_dict(to=0)`` is a collective (every rank calls it): rank ``to`` gets the full,
      unsharded state in torch's format, on the CPU, loadable by any world size and by the
      unsharded optimizer; the other ranks get None (``to=None``: every rank gets it).
      ``load_state_dict`` takes such a full state on every rank and keeps its slices.
      ``opt.state`` is empty: this rank's share is in ``opt.shard_optimizer.state``.
    - Gradients reduced by a backward are cleared with ``opt.zero_grad()`` before the
      next backward: accumulating into them raises ``RuntimeError``.
    - Only optimizers known to be elementwise: exactly ``torch.optim.SGD``, ``Adam``, ``AdamW``,
      ``RMSprop``, ``Adagrad``, ``Adamax``, ``NAdam``, ``RAdam``, ``ASGD``, ``Adadelta``, ``Rprop``
      (a subclass is refused: it may compute per-tensor quantities), and classes declared with
      :meth:`register_elementwise`; not ``differentiable=True``.

    Args:
        backend: from ``dml.get_distributed_backend``.
        optimizer: an elementwise optimizer over the model's parameters (see above).
        op: how gradients combine: ``dml.AVG`` (default) or another reduction.
        bucket_bytes: about how many bytes of gradients each reduce-scatter carries
            (default: as ``DistributedOptimizer``).
        communication_dtype: ``torch.bfloat16`` or ``torch.float16`` to reduce gradients
            in half precision; None keeps each gradient's dtype.
        overlap: reduce-scatter buckets on the communication thread while backward
            computes (True) or all at the end of backward (False); default as
            ``DistributedOptimizer``.
        prefetch: across hosts (gloo, with overlap), ``step()`` returns before the updated
            parameters have all arrived: their allgathers go in forward order, and each module's
            forward waits only for the buckets of the parameters it may read (a forward pre-hook: a
            module without submodules and a plain ``nn.Sequential`` their own, any other module its
            subtree's), as FSDP prefetches. Until then read or write parameters only through a
            module's forward, a collective, this optimizer's methods or after
            :meth:`wait_for_parameters`. Default False.
        step_during_backward: step this rank's shard of each bucket, and allgather the bucket's
            updated parameters, as soon as its reduce-scatter lands, during ``backward()``
            (buckets for which some rank had no gradient: at the end of backward); ``step()``
            then sends nothing. Bit-identical to stepping after backward; nothing may change the
            gradients or the groups' settings (learning rate) in between (``step()`` raises), so no
            clipping or loss scaling. Not with ``prefetch``. Default False.
        backward_passes_per_step: reduce only every k-th backward (accumulate locally before).
        shard_state: must be True (the argument ``DistributedOptimizer`` dispatches on).

    Example:
        >>> model = dml.synchronize(backend, torch.nn.Linear(4, 1))
        >>> opt = dml.DistributedOptimizer(backend, torch.optim.Adam(model.parameters()), shard_state=True)
        >>> opt.zero_grad()
        >>> model(torch.ones(2, 4)).sum().backward()
        >>> opt.step()  # this rank's shard stepped, the parameters allgathered
    """

    # torch.amp.GradScaler then calls step() whatever it found, and step() refuses it on every rank alike;
    # dml.ShardedGradScaler never takes that path (it decides across ranks, then calls step() or not).
    _step_supports_amp_scaling = True
    _form = "ShardedOptimizer"
    caller = "DistributedOptimizer"

    _shards = True
    _example = "dml.DistributedOptimizer(backend, torch.optim.Adam(model.parameters()), shard_state=True)"

    def _setup(self, op: Any, bucket_bytes: int | None, communication_dtype: Any, overlap: bool | None) -> None:
        if self._step_during_backward and self._prefetch:
            raise TypeError(
                "step_during_backward=True with prefetch=True: the first allgathers each bucket's updated parameters "
                "during backward, as soon as its shard is stepped; the second leaves them all to the next forward. "
                "Choose one (step_during_backward keeps step() free of communication; prefetch overlaps the "
                "allgathers with forward)"
            )
        backend = self._backend
        self._identity = machine_identity(backend)  # carried by every round's header
        self._op = resolve_op(op)
        self._wire = check_communication_dtype(communication_dtype)
        self._bucket_bytes = default_bucket_bytes(backend, bucket_bytes)
        params = self._params_now()
        seen: dict[int, int] = {}
        for k, p in enumerate(params):
            if id(p) in seen:  # a tied weight listed twice: it would take two places in the layout
                raise ValueError(
                    f"DistributedOptimizer(shard_state=True): {self._labels()[k]} is the same tensor as "
                    f"{self._labels()[seen[id(p)]]} (a tied weight listed twice); list each parameter once, e.g. "
                    "torch.optim.Adam(model.parameters()), which gives a tied weight once"
                )
            seen[id(p)] = k
        for p in params:
            if p.layout != torch.strided:
                raise TypeError("DistributedOptimizer: sparse parameters are not supported; use dense tensors")
            if not p.dtype.is_floating_point:  # complex included: its flat buffers and collectives are real
                raise TypeError(
                    f"DistributedOptimizer(shard_state=True): a parameter of dtype {p.dtype} (shape "
                    f"{list(p.shape)}); gradients must be real floating point (for complex parameters, keep "
                    "torch.view_as_real(p) as the parameter)"
                )
        self._overlap = default_overlap(backend) if overlap is None else bool(overlap)
        self._stale = False  # the gradient buffers hold a reduction: zero_grad() comes before the next backward
        self._init_rounds()
        self._agreed = False
        self._ring: GlooTransport | None = None
        self._scratch: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}
        # prefetch: each parameter's allgather (its bucket's event) while one is in flight after step()
        self._arriving: dict[int, threading.Event] = {}
        self._last_arrival: threading.Event | None = None
        self._arrival_error: BaseException | None = None
        self._arrival_hook: Any = None
        # step_during_backward: the buckets stepped here in this backward; whether a backward stepped and step()
        # has not come yet; each gradient (tensor, version) when that backward returned
        self._stepped_here: set[int] = set()
        self._stepped_pending = False
        self._seen: list[tuple[torch.Tensor, torch.Tensor | None, tuple[int, int]]] = []
        self._step_failure: BaseException | None = None  # a step on the communication thread raised (this round)
        self._hyper: list[dict[str, Any]] = []  # the groups' settings the shards are stepped with
        self._build(params)

    def _check_shard_state(self, shard_state: Any) -> None:
        if shard_state is not True:
            raise ValueError(
                f"shard_state: got {shard_state!r}; ShardedOptimizer always shards (use dml.DistributedOptimizer "
                "for shard_state=False)"
            )

    def _check_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        check_shardable(optimizer)

    # -- layout ----------------------------------------------------------------------------

    def _build(self, params: list[torch.Tensor]) -> None:
        """Flat buffers, buckets, this rank's pieces and the shard optimizer over them; hooks on ``params``."""
        self.wait_for_parameters()
        self._quiesce_owners(params)  # an earlier optimizer over them lands its allgathers first
        layout = build_layout(params, self._bucket_members(params), self._backend.size, self._backend.rank)
        self._params = params
        self._names = self._labels()
        self._index = {id(p): i for i, p in enumerate(params)}
        self._offset, self._flats, self._buckets, self._bucket_of, self._views, self._values, self._pieces = layout
        # the same places of the flat gradients, never handed out: what _views[i] must stay a view of
        self._anchors = [None if v is None else v.view(v.shape) for v in self._views]
        # per parameter, the changed mark, 3 per bucket (ready order), 1 per bucket (stepped during backward), 3 for
        # the machine's number (buckets.machine_identity), failed
        nb = len(layout.buckets)
        self._head = torch.zeros(self._backend.size, len(params) + 5 + 4 * nb, dtype=torch.float64)
        self._scratch.clear()
        self._inner = self._shard_optimizer(layout.pieces)
        # per bucket, then one entry for parameters without elements: (this rank's pieces, their tensors per group)
        self._pieces_by_bucket: list[tuple[list[Piece], list[list[torch.Tensor]]]] | None = None
        self._scatter_state()
        self._hook_on(params)  # taken over once built: a construction that raised leaves an earlier one working

    def _node_prehook(self) -> Callable[[Any], None] | None:
        return self._before_accumulate

    def _displaced_by(self) -> str | None:
        return self.displaced_by

    def _quiesce(self) -> None:
        self.wait_for_parameters()

    def _unhook(self) -> None:
        self.wait_for_parameters()
        super()._unhook()
        if self._arrival_hook is not None:
            self._arrival_hook.remove()
            self._arrival_hook = None

    def _bucket_members(self, params: list[torch.Tensor]) -> list[tuple[tuple[torch.dtype, torch.device], list[int]]]:
        """Parameter indices per bucket, in the order buckets are sent (reverse parameter order)."""
        cut = cut_buckets(params, self._bucket_bytes, self._wire, SHARDED_CUT)
        return [(key, members) for _, key, members in cut]

    def _shard_optimizer(self, pieces: list[Piece]) -> torch.optim.Optimizer:
        """An optimizer of the wrapped one's class over ``pieces``, one group per wrapped group."""
        group_of = {id(p): g for g, group in enumerate(self.optimizer.param_groups) for p in group["params"]}
        members: list[list[torch.Tensor]] = [[] for _ in self.optimizer.param_groups]
        for pc in pieces:
            pc.tensor.grad = pc.grad
            members[group_of[id(self._params[pc.index])]].append(pc.tensor)
        groups = [
            {**{k: v for k, v in group.items() if k != "params"}, "params": m}
            for group, m in zip(self.optimizer.param_groups, members, strict=True)
        ]
        cls = type(self.optimizer)
        accepted = inspect.signature(cls.__init__).parameters
        kwargs = {k: v for k, v in self.optimizer.defaults.items() if k in accepted}
        try:
            return cls(groups, **kwargs)
        except (TypeError, ValueError) as e:
            raise TypeError(
                f"optimizer: could not create a second {cls.__qualname__} over this rank's shard as "
                f"{cls.__qualname__}(param_groups, **defaults) ({type(e).__name__}: {e}); shard_state=True needs "
                "the optimizer's class to accept its own defaults as keyword arguments. Use shard_state=False"
            ) from e

    def _sync_hyper(self) -> None:
        """The wrapped optimizer's hyper-parameters (an LR scheduler changes those) into the shard optimizer."""
        for outer, inner in zip(self.optimizer.param_groups, self._inner.param_groups, strict=True):
            for k, v in outer.items():
                if k != "params":
                    inner[k] = v

    @classmethod
    def register_elementwise(cls, optimizer_class: type[torch.optim.Optimizer]) -> type[torch.optim.Optimizer]:
        """Declare ``optimizer_class`` elementwise, so that ``shard_state=True`` accepts it.

        Only the classes known to be elementwise are sharded: exactly ``torch.optim.SGD``, ``Adam``,
        ``AdamW``, ``RMSprop``, ``Adagrad``, ``Adamax``, ``NAdam``, ``RAdam``, ``ASGD``, ``Adadelta`` and
        ``Rprop``, not their subclasses, which may compute per-tensor quantities (LARS's or LAMB's trust
        ratio ``||w|| / ||update||``) that a shard would compute on its pieces. Register a class whose update
        of each element depends only on that element's gradient and state, on every rank (where the class
        is defined). It covers that class alone, not its subclasses; registering again changes nothing.
        The class must accept its own ``defaults`` as keyword arguments (the shard optimizer is created as
        ``optimizer_class(param_groups, **defaults)``).

        Args:
            optimizer_class: a subclass of ``torch.optim.Optimizer`` (not one of ``LBFGS``, ``SparseAdam``,
                ``Adafactor``, ``Muon``, which need whole tensors, or a subclass of them).

        Returns:
            ``optimizer_class`` (so it also works as a class decorator).

        Raises:
            TypeError: ``optimizer_class`` is not an optimizer class, or derives from a whole-tensor one.

        Example:
            >>> @dml.ShardedOptimizer.register_elementwise
            ... class SignSGD(torch.optim.SGD):  # each element steps by the sign of its own gradient
            ...     @torch.no_grad()
            ...     def step(self, closure=None):
            ...         for group in self.param_groups:
            ...             for p in group["params"]:
            ...                 if p.grad is not None:
            ...                     p.add_(p.grad.sign(), alpha=-group["lr"])
            >>> model = torch.nn.Linear(4, 1)
            >>> opt = dml.DistributedOptimizer(backend, SignSGD(model.parameters(), lr=0.01), shard_state=True)
        """
        return register_elementwise(optimizer_class)

    @property
    def shard_optimizer(self) -> torch.optim.Optimizer:
        """The optimizer that steps this rank's shard: the wrapped one's class over 1-D pieces of the parameters.

        Its ``state`` is this rank's share of the optimizer state (read it to measure memory).
        """
        return self._inner

    @property
    def overlap(self) -> bool:
        """Whether buckets are reduce-scattered on the communication thread while backward runs."""
        return self._overlap

    @property
    def step_during_backward(self) -> bool:
        """Whether each bucket's shard is stepped, and its parameters allgathered, as soon as its reduce-scatter
        lands, during backward."""
        return self._step_during_backward

    # -- agreement ---------------------------------------------------------------------------

    def _agree(self) -> None:
        """Raise ``ValueError`` on every rank unless every rank shards alike (one small allgather)."""
        backend = self._backend
        named = (("step_during_backward", self._step_during_backward), ("prefetch", self._prefetch))
        forms = "".join(f", {name}=True" for name, on in named if on)  # when the allgathers go: ranks must agree
        settings = (f"{self._op!r} with shard_state=True{forms}", self._wire, self._bucket_bytes)
        agree_on_settings(
            backend, "DistributedOptimizer", _FIX, settings, params=self._params, labels=lambda: self._names
        )
        self._ring = transport_for(backend)
        self._agreed = True

    def _changed(self) -> bool:
        """Whether the wrapped optimizer's parameters, or where they live, changed since the layout was built."""
        current = self._params_now()
        if len(current) != len(self._params) or any(p is not q for p, q in zip(current, self._params, strict=True)):
            return True
        return any(
            v is not None and (p.data_ptr() != v.data_ptr() or p.shape != v.shape)
            for p, v in zip(self._params, self._values, strict=True)
        )

    # -- reduction during backward -------------------------------------------------------------

    def _adopt(self, param: torch.Tensor) -> None:
        """Make ``param.grad`` its view of the flat gradient buffer, copying a fresh gradient in."""
        i = self._index.get(id(param))
        if i is None or self._params[i] is not param:
            return
        view, g = self._views[i], param.grad
        if view is None or g is None or _is_view(g, view) or not _fits(param, view) or not _fits(g, view):
            return  # (a parameter whose .data was replaced since the layout was built: the round raises)
        if g.requires_grad:
            self._reset_round()
            raise RuntimeError(
                "DistributedOptimizer(shard_state=True): the gradient of a parameter has autograd history "
                "(backward(create_graph=True)); with shard_state=True each rank holds the reduced gradient of its "
                "own shard only, so a graph through the averaged gradient cannot be given. For a gradient penalty, "
                "compute it with torch.autograd.grad(loss, params, create_graph=True) and call an ordinary "
                "backward() on the total loss (that works with either form); or use shard_state=False, whose "
                "gradients keep their history"
            )
        with torch.no_grad():
            view.copy_(g.to_dense() if g.layout != torch.strided else g)
        param.grad = view

    def _before_accumulate(self, grad_outputs: Any) -> None:
        """Pre-hook of a parameter's AccumulateGrad node: a backward is about to add a gradient to its ``.grad``
        (not called by ``torch.autograd.grad``, which adds nothing)."""
        if self._stale:
            self._check_stale()

    def _check_stale(self) -> None:
        """Raise if the gradient buffers still hold a reduction that a backward would add to.

        Cleared gradients are fine: set to None or replaced (``zero_grad()``), or zeroed in place
        (``zero_grad(set_to_none=False)``: adding to zeros is a fresh start). Anything else, nothing done or
        only some zeroed or the reduction scaled (``clip_grad_norm_``), raises. Checked before the first
        gradient of a backward is added (``_before_accumulate``), so the buffers still hold what the user left.
        """
        if not self._stale:
            return
        views = [v for p, v in self._view_pairs() if v is not None and p.grad is not None and _is_view(p.grad, v)]
        if not _any_nonzero(views):
            self._stale = False
            return
        raise RuntimeError(
            "DistributedOptimizer(shard_state=True): a backward() would add to gradients that were already "
            "reduce-scattered (only this rank's shard of them holds the reduced values, so a second reduction "
            "would be wrong). Clear them after each step: opt.zero_grad() or model.zero_grad() (to None or to "
            "zeros, every gradient); accumulate micro-batches inside opt.no_sync() (or with "
            "backward_passes_per_step) before the reducing backward, and call opt.synchronize() only after the "
            "step's last backward"
        )

    def _view_pairs(self) -> Iterator[tuple[torch.Tensor, torch.Tensor | None]]:
        return zip(self._params, self._views, strict=True)

    def _skip_this_backward(self) -> bool:
        return self._skip_backward()

    def _begin(self, backend: Backend, *, now: bool) -> bool:
        """Agree on the layout across ranks (once); whether the parameters changed since it was built."""
        if not self._agreed:
            self._agree()
        if self._step_during_backward:  # the buckets may be stepped on the communication thread: read them now
            self._sync_hyper()
            self._hyper = hyper_parameters(self.optimizer)
        self._refresh_views()
        return self._changed()

    def _reduced_in_backward(self) -> None:
        self._backward_reduced()
        self._record_seen()

    def _record_seen(self) -> None:
        """After a round that stepped (``step_during_backward``): each gradient as it is, which ``step()`` checks."""
        if self._stepped_pending:
            self._seen = [(p, p.grad, grad_mark(p.grad)) for p in self._params]

    def _check_reducing_backward(self) -> None:
        if self._stepped_pending:  # kept: step() then refuses too (zero_grad() forgets)
            raise RuntimeError(
                "DistributedOptimizer(shard_state=True, step_during_backward=True): a second reducing backward() "
                "before step(); the first one already stepped the shards of its buckets, and this one would step "
                "them again. Call opt.step() after each backward, or accumulate micro-batches inside opt.no_sync() "
                "or with backward_passes_per_step=k"
            )

    def _landed(self, state: Round, k: int) -> None:
        """With ``step_during_backward``: step this rank's pieces of bucket ``k`` now if their reduced gradients are
        final (every parameter of the bucket had a gradient here, so none is left None on every rank by the header,
        which lands last), then allgather the bucket. On every rank and in every round (a backward's, or one
        ``step()`` runs), whatever happened here: the collectives go in the same order everywhere, each bucket's
        reduce-scatter, then its allgather. A step that raises is recorded (the header tells every rank); a bucket
        not stepped on every rank is stepped where it was not, and allgathered again, once the header has landed
        (:meth:`_step_rest`). Over gloo the bucket is stepped as soon as its reduce-scatter has landed, before the
        next bucket's is posted: stepped once the next one had been posted, as the unsharded form does, its
        allgather waited for the next bucket's gradients, and the 24 M-parameter model's step took 2-12 % longer
        on the shaped links (docs/benchmarks/network.md)."""
        if not self._step_during_backward:
            return
        bucket = self._buckets[k]
        self._settle()  # its reduce-scatter, if left in flight
        if self._step_failure is None and not state.changed and all(state.has[i] for i in bucket.params):
            pieces, members = self._by_bucket()[k]
            self._point_grads(pieces)
            try:
                if any(members):
                    step_groups(self._inner, members)
                self._stepped_here.add(k)
            except Exception as e:  # still allgathered below: the other ranks wait for this bucket
                self._step_failure = e
        self._allgather(bucket, pipelined=True)

    def _fill(self, state: Round, k: int) -> torch.Tensor:
        """Bucket ``k``'s gradients in place in the flat gradient buffer (zeros for the missing ones)."""
        bucket = self._buckets[k]
        with torch.no_grad():
            for i in bucket.params:
                p, view = self._params[i], self._views[i]
                assert view is not None
                state.has[i] = p.grad is not None
                if not _fits(p, view) or (p.grad is not None and not _fits(p.grad, view)):
                    state.has[i] = False  # .data replaced since the layout was built: zeros, and the round raises
                    view.zero_()
                elif p.grad is None:  # zeros here (the header says whether any rank had a gradient)
                    view.zero_()
                    p.grad = view
                else:
                    self._adopt(p)
        return bucket.grads

    def _communicate(self, backend: Backend, k: int, tensor: torch.Tensor) -> None:
        self._reduce_bucket(self._buckets[k], pipelined=True)

    def _close(self, backend: Backend, state: Round) -> Callable[[], None]:
        """The header, reduce-scattered after the buckets (the gradient buffers then hold a reduction). Across
        hosts its exchange is posted while the last bucket's is still in flight, then both are completed."""
        self._write_head(state)
        head = self._head
        self._stale = True

        def header() -> None:  # after every bucket's job: what was stepped here is known
            if self._step_during_backward:
                at = self._tail_at()
                stepped = torch.tensor([k in self._stepped_here for k in range(len(self._buckets))], dtype=head.dtype)
                head[:, at : at + len(self._buckets)] = stepped
                head[:, -1] = 1.0 if self._step_failure is not None else 0.0
            self._reduce_scatter(head, ReduceOp.SUM)

        return header

    def _reduce_bucket(self, bucket: Bucket, *, pipelined: bool = False) -> None:
        """Reduce-scatter one bucket in place: this rank's piece of the flat gradients becomes the reduced one
        (``pipelined``: across hosts it may be left in flight, as :meth:`_reduce_scatter` says)."""
        grads = bucket.grads
        if self._wire is None or self._wire == grads.dtype:
            self._reduce_scatter(grads, self._op, pipelined=pipelined)
            return
        wire = self._scratch_for(self._wire, grads.device, grads.numel()).view(grads.shape)
        wire.copy_(grads)
        self._reduce_scatter(wire, self._op)
        rank = self._backend.rank
        grads[rank].copy_(wire[rank])

    def _reduce_scatter(self, rows: torch.Tensor, op: ReduceOp, *, pipelined: bool = False) -> None:
        """In place: ``rows[rank]`` becomes the op over ranks of their ``rows[rank]``; the other rows stay.

        Over gloo where the reducer uses it (ranks on several hosts, :mod:`distutils_ml.transport`). There,
        ``pipelined`` leaves it in flight and completes the calls before it (the next call, or :meth:`_settle`,
        completes it): its exchange is on the link while the one before it lands, without a round trip's pause.
        Otherwise every call in flight is completed before this returns.
        """
        ring, rank = self._ring, self._backend.rank
        array = ring_array(ring, rows, op)
        if ring is not None and array is not None:
            ring.reduce_scatter(array, array[rank], op, wait=not pipelined)  # in place: the other rows stay
            ring.settle(keep=1 if pipelined else 0)
            return
        self._settle()
        reduce_scatter(self._backend, rows, op)

    def _allgather(
        self, bucket: Bucket, *, pipelined: bool = False, done: Callable[[BaseException | None], None] | None = None
    ) -> None:
        """Every rank's piece of ``bucket`` into every rank's flat parameter buffer (over gloo across hosts, where
        ``pipelined`` leaves it in flight as :meth:`_reduce_scatter` says); ``done`` is told when it has landed
        (None) or failed (the error)."""
        rows, rank, ring = bucket.values, self._backend.rank, self._ring
        array = ring_array(ring, rows, ReduceOp.SUM)
        if ring is not None and array is not None:
            ring.allgather(array[rank], array, wait=not pipelined, done=done)
            ring.settle(keep=1 if pipelined else 0)
            return
        try:
            self._settle()
            piece = self._scratch_for(rows.dtype, rows.device, bucket.piece)
            piece.copy_(rows[rank])
            allgather(self._backend, piece, rows)
        except BaseException as e:
            if done is not None:
                done(e)
            raise
        if done is not None:
            done(None)

    def _scratch_for(self, dtype: torch.dtype, device: torch.device, numel: int) -> torch.Tensor:
        """A reused buffer of at least ``numel`` elements (the largest bucket's, at most)."""
        key = (dtype, device)
        have = self._scratch.get(key)
        if have is None or have.numel() < numel:
            largest = max((b.grads.numel() for b in self._buckets if b.grads.device == device), default=0)
            have = self._scratch[key] = torch.empty(max(largest, numel), dtype=dtype, device=device)
        return have[:numel]

    def _tail_at(self) -> int:
        """Where the header's tail starts (after a column per parameter, the changed mark and 3 per bucket): per
        bucket on how many ranks it was stepped during the round, then the machine's number (3), then whether a step
        raised."""
        return len(self._params) + 1 + 3 * len(self._buckets)

    def _write_head(self, state: Round) -> None:
        """Every row: which parameters have a gradient here, the changed mark, each bucket's ready position."""
        n, nb = len(self._params), len(self._buckets)
        row = np.zeros(self._head.shape[1], dtype=np.float64)
        for i, p in enumerate(self._params):
            row[i] = 1.0 if (state.has[i] if self._bucket_of[i] >= 0 else p.grad is not None) else 0.0
        row[n] = 1.0 if state.changed else 0.0
        encode_order(row[n + 1 : self._tail_at()].reshape(nb, 3), state.ready_at, state.task, ReduceOp.SUM, None)
        encode_order(row[-4:-1].reshape(1, 3), [self._identity], 0, ReduceOp.SUM, None)
        self._head.copy_(torch.from_numpy(row).expand_as(self._head))

    def _finish(self, backend: Backend, state: Round) -> None:
        """After every bucket: ``.grad`` None where no rank had one; the header's checks."""
        size, n, nb = self._backend.size, len(self._params), len(self._buckets)
        row = self._head[self._backend.rank].numpy()
        if self._step_during_backward:  # on every rank, whatever follows: step() then finishes or refuses
            self._stepped_pending = True
        if identity_differs(row[-4:-1], size, ReduceOp.SUM, None, averaged=False):
            # first: nothing else in this header is this round's
            raise identity_error(self.caller, self._identity, stepped=self._step_during_backward)
        somebody = row[:n] > 0
        for i, p in enumerate(self._params):
            if not somebody[i] and self._views[i] is not None:
                p.grad = None
        if row[n] > 0:
            raise RuntimeError(
                "DistributedOptimizer: the parameters changed after the sharded layout was built (a parameter "
                "was added, removed, replaced or had requires_grad switched, or its .data was replaced, e.g. by "
                "model.to()) on at least one rank; this backward reduced the old parameters only. Create the "
                "optimizer again after changing the model (or add parameters with its add_param_group), on every "
                "rank, and move the state over: its state lives in the shards, not in the torch optimizer, so take "
                "state = opt.state_dict(to=None) before and new_opt.load_state_dict(state) after (else Adam's moments "
                "start from zero)"
            )
        if state.task >= 0 and nb:
            order = row[n + 1 : self._tail_at()].reshape(nb, 3)
            differs = order_mismatch(order, size, ReduceOp.SUM, None, averaged=False)
            if differs is not None and differs.any():
                k = int(np.flatnonzero(differs)[0])
                raise order_error(self.caller, k, nb, [self._names[i] for i in self._buckets[k].params])
        if self._step_during_backward:
            self._step_rest(row[self._tail_at() :], size)
            self._stepped_round = True  # the round ended well, on every rank alike (its header says so)

    def _step_rest(self, tail: np.ndarray, size: int) -> None:
        """End of a round with ``step_during_backward``: the header's tail says, the same on every rank, on how many
        ranks each bucket was stepped when it landed, and whether a step raised on any rank (then every rank raises,
        after the same collectives). A bucket not stepped on every rank (some rank lacked one of its gradients) is
        stepped now where it was not (a gradient no rank had is None, and skipped, as in ``step()``), and every rank
        allgathers it again. Parameters without elements are stepped here too."""
        nb = len(self._buckets)
        stepped_on, failed_on = tail[:nb], round(float(tail[-1]))
        mine, self._step_failure = self._step_failure, None
        here, self._stepped_here = self._stepped_here, set()
        if failed_on:
            raise RuntimeError(
                f"DistributedOptimizer(shard_state=True, step_during_backward=True): stepping a shard as its bucket "
                f"landed raised on {failed_on} rank(s){f' (here: {type(mine).__name__}: {mine})' if mine else ''}; "
                "the buckets were allgathered on every rank all the same, so the replicas agree, but the step is "
                "incomplete: step() refuses it. Mend the cause and restore the last checkpoint"
            ) from mine
        unsettled = [k for k in range(nb) if stepped_on[k] < size]
        by_bucket = self._by_bucket()
        members: list[list[torch.Tensor]] = [[] for _ in self._inner.param_groups]
        for k in [*(k for k in unsettled if k not in here), nb]:
            pieces, tensors = by_bucket[k]
            self._point_grads(pieces)
            for into, ts in zip(members, tensors, strict=True):
                into.extend(ts)
        failure = None
        try:
            if any(members):
                step_groups(self._inner, members)
        except Exception as e:  # still allgathered below: the other ranks wait for these buckets
            failure = e
        # Parameters without elements are rank 0's, but every rank knows there are some: the same test everywhere.
        if not (unsettled or any(k < 0 for k in self._bucket_of)) or size == 1:  # nothing stepped on any rank
            if failure is not None:
                raise failure
            return
        flag = np.array([0.0 if failure is None else 1.0])
        with exclusive(self._backend, "DistributedOptimizer backward"):
            for k in unsettled:
                self._allgather(self._buckets[k])
            allreduce(self._backend, flag, ReduceOp.MAX)  # every rank learns of a failure here
        if flag[0] > 0:
            raise RuntimeError(
                "DistributedOptimizer(shard_state=True, step_during_backward=True): stepping the shards of the "
                f"buckets left to the end of backward raised on some rank{f' (here: {failure})' if failure else ''}; "
                "the replicas agree, but the step is incomplete: step() refuses it. Mend the cause and restore the "
                "last checkpoint"
            ) from failure

    def _point_grads(self, pieces: list[Piece]) -> None:
        """Each piece's ``.grad``: its view of the flat gradients, None where its parameter has none (skipped by
        the step); a parameter outside the buffers (no elements) lends its own."""
        for pc in pieces:
            grad = self._params[pc.index].grad
            pc.tensor.grad = grad if pc.grad is None or grad is None else pc.grad

    def _by_bucket(self) -> list[tuple[list[Piece], list[list[torch.Tensor]]]]:
        """Per bucket, then one last entry for the parameters without elements (rank 0's): this rank's pieces, and
        their tensors per group of the shard optimizer."""
        if self._pieces_by_bucket is None:
            index = {id(t): g for g, group in enumerate(self._inner.param_groups) for t in group["params"]}
            groups = len(self._inner.param_groups)
            of_bucket: list[tuple[list[Piece], list[list[torch.Tensor]]]] = [
                ([], [[] for _ in range(groups)]) for _ in range(len(self._buckets) + 1)
            ]
            for pc in self._pieces:
                k = self._bucket_of[pc.index]
                pieces, tensors = of_bucket[k if k >= 0 else len(self._buckets)]
                pieces.append(pc)
                tensors[index[id(pc.tensor)]].append(pc.tensor)
            self._pieces_by_bucket = of_bucket
        return self._pieces_by_bucket

    # -- reduce now ----------------------------------------------------------------------------

    def _reduce(self) -> None:
        """Reduce-scatter every bucket now (gradients accumulated inside no_sync(), or set by hand); with
        ``step_during_backward`` that round steps too (on every rank alike), and ``step()`` then checks that nothing
        changed the gradients since, as after a backward."""
        self._check_stale()
        self._reduce_now(self._backend)
        self._advance("reduce")
        self._record_seen()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the gradients: ``.grad`` becomes None (or zeros with ``set_to_none=False``), ready for a backward.

        With ``set_to_none=True`` the next backward's gradients are copied into the flat gradient
        buffer as they arrive; with False backward adds into the zeroed buffer.
        """
        super().zero_grad(set_to_none)

    def _forget_round(self) -> None:
        if self._round is not None or not self._arriving:  # prefetch: step()'s allgathers go on (they settle alone)
            self._reset_round()
        self._forget_stepping()

    def _forget_stepping(self) -> None:
        self._stepped_here, self._stepped_pending, self._seen, self._step_failure = set(), False, [], None

    def _clear_grads(self, set_to_none: bool) -> None:
        self._stale = False
        if not set_to_none:
            for flat in self._flats:
                flat.grads.zero_()
        for p, view in self._view_pairs():
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                if view is None:
                    p.grad.zero_()
                else:
                    p.grad = view

    # -- the step ------------------------------------------------------------------------------

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Step this rank's shard on its reduced gradients, then allgather the updated parameters.

        Gradients no backward reduced (inside ``no_sync()``, or set by hand) are reduce-scattered
        first, unless inside ``no_sync()``. With a ``closure``, it runs first (with gradients
        enabled) and the loss it returns is reduced with ``op``, as ``shard_state=False`` does.
        """
        if hasattr(self, "found_inf") or hasattr(self, "grad_scale"):
            self.__dict__.pop("found_inf", None)
            self.__dict__.pop("grad_scale", None)
            raise TypeError(
                "DistributedOptimizer(shard_state=True): torch.amp.GradScaler is not supported: its inf/NaN check "
                "reads every .grad on each rank, and with sharded state only this rank's shard of .grad is reduced, "
                "so ranks could disagree about skipping a step. Use dml.ShardedGradScaler(backend, ...) in its place "
                "(every rank then skips the same steps), train with bfloat16 autocast (no scaler needed), or use "
                "shard_state=False"
            )
        return super().step(closure)

    def _step(self, closure: Callable[[], Any] | None) -> Any:
        if self.unfinished_round() or (self._round is None and self._stepped_here):
            self._refuse_unfinished_backward()  # (stepped here: a round an error already reset, after some steps)
        if self._step_during_backward and (self._stepped_pending or not self._no_sync):
            reduced_now = closure is None and not self._stepped_pending and self._unreduced()
            if reduced_now:  # nothing reduced yet (accumulated in no_sync(), set by hand, a reentrant backward's
                self._reduce()  # open round): one round now, which steps and allgathers every bucket as backward's do
            self._finish_stepping(closure, reduced_now)
            return None
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if not self._no_sync and self._unreduced():
            self._reduce()
        self._end_step()
        self._step_shard()
        if loss is not None and not self._no_sync:
            loss = self._reduce_loss(loss)
        return loss

    def _finish_stepping(self, closure: Callable[[], Any] | None, reduced_now: bool) -> None:
        """``step()`` with ``step_during_backward``, after the round that stepped every shard (a backward's, or
        ``reduced_now`` by this step): nothing left to step or send; raise if something changed the gradients or the
        groups' settings since the round (those steps cannot be taken back), or if it did not finish."""
        problem = None
        if closure is not None:
            problem = "step(closure) was called; a closure computes new gradients, which those steps would not see"
        elif not self._stepped_pending:
            problem = "no round stepped them"
        elif not reduced_now and self._phase not in (Phase.REDUCED, Phase.SYNCHRONIZED):
            problem = "that backward did not finish (it raised), or more gradients were accumulated since"
        elif not same_hyper_parameters(self._hyper, hyper_parameters(self.optimizer)):
            problem = (
                "a parameter group's settings (the learning rate, ...) were changed since backward() began (set "
                "them before backward(); an LR scheduler steps after opt.step())"
            )
        else:
            replaced = [k for k, (p, g, _) in enumerate(self._seen) if p.grad is not g]
            if replaced:
                names = describe_positions(replaced, self._names)
                problem = f"the gradients of {names} were replaced or cleared since (code of yours)"
            elif any(grad_mark(g) != mark for _, g, mark in self._seen):
                problem = "the gradients were changed in place since (clipping, unscaling, or code of yours)"
        self._end_step()
        self._forget_stepping()
        if problem is not None:
            raise RuntimeError(
                "DistributedOptimizer(shard_state=True, step_during_backward=True): backward() steps the shard "
                f"of each bucket as its reduce-scatter lands and allgathers the parameters, but {problem}; the "
                "steps taken did not see that, and nothing more was stepped. Clipping to a global norm and a "
                "GradScaler's inf check need the whole gradient before any parameter moves: use "
                "step_during_backward=False for them"
            )

    def _refresh_views(self) -> None:
        """Make each parameter's view of the flat gradients, which ``.grad`` is made, a view of it again where it
        stopped being one: ``p.grad.data = ...`` or ``p.grad.set_(...)`` moved that tensor's storage out of the
        buffer (it then holds the user's gradient, which :meth:`_adopt` copies in like any replaced one)."""
        for i, (view, anchor) in enumerate(zip(self._views, self._anchors, strict=True)):
            if (
                view is not None
                and anchor is not None
                and (view.data_ptr() != anchor.data_ptr() or view.shape != anchor.shape)
            ):
                self._views[i] = anchor.view(anchor.shape)

    def _adopt_replaced(self) -> None:
        """Copy into the flat gradient buffer each ``.grad`` replaced since the reduction (``p.grad = g.clamp(...)``,
        or set by hand): what the step and the clipping read there is then what ``.grad`` holds."""
        self._refresh_views()
        for p, view in self._view_pairs():
            if view is not None and p.grad is not None and not _is_view(p.grad, view):
                self._adopt(p)

    def _step_shard(self) -> None:
        """The shard optimizer's step (pieces of parameters without gradient skipped), then the allgather."""
        self.wait_for_parameters()
        self._adopt_replaced()
        self._point_grads(self._pieces)
        self._sync_hyper()
        if self._backend.size == 1:
            step_optimizer(self._inner)
            return
        if self._ring is not None and self._overlap:
            self._step_and_allgather_by_bucket()
            return
        step_optimizer(self._inner)
        with exclusive(self._backend, "DistributedOptimizer.step"):
            for b in self._buckets:
                self._allgather(b, pipelined=True)
            self._settle()

    def _step_and_allgather_by_bucket(self) -> None:
        """Across hosts (gloo, whose waits sleep): step bucket k's pieces, then allgather bucket k on the
        communication thread while the next bucket's pieces are stepped. The shard optimizer is elementwise, so
        stepping its pieces bucket by bucket computes what one step over all of them does, bit for bit."""
        by_bucket = self._by_bucket()
        worker = self._backend.comm_thread()
        _, elementless = by_bucket[-1]
        if any(elementless):  # parameters without elements: nothing to allgather
            step_groups(self._inner, elementless)
        order = range(len(self._buckets))
        if self._prefetch:  # forward order (buckets go in reverse parameter order): the first layers' first
            order = reversed(order)
        try:
            for k in order:
                bucket, members = self._buckets[k], by_bucket[k][1]
                if any(members):
                    step_groups(self._inner, members)
                if self._prefetch:
                    arrived = threading.Event()
                    for i in bucket.params:
                        self._arriving[id(self._params[i])] = arrived
                    self._last_arrival = arrived
                    worker.submit(functools.partial(self._allgather_then_set, bucket, arrived))
                else:
                    worker.submit(functools.partial(self._allgather, bucket, pipelined=True))
        finally:  # a step that raised too: the allgathers submitted land (their events are set)
            worker.submit(self._settle)  # the last allgather, left in flight
        if self._prefetch and self._arriving:
            if self._arrival_hook is None:
                self._arrival_hook = torch.nn.modules.module.register_module_forward_pre_hook(
                    _await_hook(weakref.ref(self))
                )
            return
        self._backend.wait_for_comm_thread()

    def _allgather_then_set(self, bucket: Bucket, arrived: threading.Event) -> None:
        """Allgather ``bucket`` (left in flight), then set ``arrived`` when it has landed or failed."""

        def done(error: BaseException | None) -> None:
            if error is not None and not arrived.is_set():
                self._arrival_error = error
            arrived.set()

        try:
            self._allgather(bucket, pipelined=True, done=done)
        except BaseException as e:  # whatever raised, the forward waiting for this bucket learns it
            done(e)
            raise

    def _await(self, params: Iterator[torch.Tensor]) -> None:
        """Wait for the allgathers of ``params``' buckets (prefetch); once every one has arrived, stop watching."""
        arriving = self._arriving
        for p in params:
            event = arriving.get(id(p))
            if event is not None:
                event.wait()
        error = self._arrival_error
        if error is not None:
            self._arrival_error = None
            self._stop_watching()
            raise RuntimeError(
                f"DistributedOptimizer(shard_state=True, prefetch=True): the allgather of the updated parameters "
                f"failed ({type(error).__name__}: {error}); the parameters are not the stepped ones"
            ) from error
        last = self._last_arrival
        if last is None or last.is_set():
            self._stop_watching()

    def _stop_watching(self) -> None:
        self._arriving, self._last_arrival = {}, None
        hook, self._arrival_hook = self._arrival_hook, None
        if hook is not None:
            hook.remove()

    def wait_for_parameters(self) -> None:
        """With ``prefetch=True``: return once every parameter updated by the last ``step()`` has arrived (at once
        otherwise). A module's forward, collectives and this optimizer's methods wait by themselves."""
        if self._arriving:
            self._await(p for p in self._params if id(p) in self._arriving)

    # -- state ---------------------------------------------------------------------------------

    def state_dict(self, to: int | None = 0) -> dict[str, Any] | None:
        """The full, unsharded state in torch's format, on rank ``to``, on the CPU (a collective: every rank calls it).

        Exactly what ``shard_state=False`` (or the plain optimizer) would return, every tensor
        on the CPU: state keyed by parameter index, tensors shaped like the parameters. Loads
        into any world size, sharded or not. It is consolidated entry by entry (state key and
        flat buffer) through host memory: each rank copies its shard of an entry to the CPU, the
        shards are allgathered there, and rank ``to`` cuts the parameters' entries out. No GPU
        holds more than its shard; rank ``to`` ends with the full state in host memory, the other
        ranks hold at most one entry's gathered buffer at a time.

        Args:
            to: the rank that receives the full state (default 0, the rank ``dml.save`` writes
                from), the same on every rank; None gives it to every rank.

        Returns:
            The full state on rank ``to`` (on every rank with ``to=None``); None on the other ranks.

        Raises:
            TypeError, ValueError: ``to`` is not a rank of this job or None (before any communication).
            ValueError: the ranks passed different values of ``to`` (raised on every rank).
            RuntimeError: called on one rank alone, inside another collective.

        Example:
            >>> model = torch.nn.Linear(4, 1)
            >>> opt = dml.DistributedOptimizer(backend, torch.optim.Adam(model.parameters()), shard_state=True)
            >>> model(torch.ones(2, 4)).sum().backward()
            >>> opt.step()
            >>> full = opt.state_dict()  # on rank 0; None on the other ranks
            >>> full["state"][0]["exp_avg"].shape, full["state"][0]["exp_avg"].device
            (torch.Size([1, 4]), device(type='cpu'))
        """
        return self._full_state_dict(to)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a full state (from ``state_dict()`` of any world size, sharded or not); keep this rank's share.

        No communication: every rank is given the same full state and keeps its own slices. They
        are cut out where the given tensors are (the CPU, for a checkpoint from ``dml.load``), and
        only they move to the parameters' device, cast as torch's ``load_state_dict`` casts them
        (floating entries to the parameter's dtype, ``step`` as torch leaves it): the GPU holds no
        more of the state than this rank's shard, and no reference to the given tensors is kept.

        Args:
            state_dict: the full state in torch's format: what ``state_dict()`` returned on rank 0
                (saved by ``dml.save``; ``dml.load`` returns it on every rank), or
                ``state_dict(to=None)``, or the state of the unsharded optimizer.

        Raises:
            TypeError: ``state_dict`` is not a dict (None, say: ``state_dict()`` returns the state
                on one rank only).
            ValueError: it has no ``"state"`` or ``"param_groups"``, or its parameter groups differ in
                number or size from this optimizer's. Nothing is changed.
            RuntimeError: with ``step_during_backward``, between a ``backward()`` whose round ended well
                (it stepped the shards) and ``step()``. Nothing is changed. After a round whose step raised,
                it loads (a checkpoint's restore).

        Example:
            >>> model = torch.nn.Linear(4, 1)
            >>> opt = dml.DistributedOptimizer(backend, torch.optim.Adam(model.parameters()), shard_state=True)
            >>> model(torch.ones(2, 4)).sum().backward()
            >>> opt.step()
            >>> opt.load_state_dict(opt.state_dict(to=None))  # every rank keeps its slices of the full state
        """
        self._refuse_load_after_stepping()
        self.wait_for_parameters()
        self._load_full(state_dict)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a parameter group (every rank the same, in the same order): the layout is built again.

        A collective: the state is consolidated on every rank, on the CPU (as by
        ``state_dict(to=None)``), the flat buffers rebuilt over all parameters, and each rank's
        new pieces cut out of it and placed where their state was (the parameters' device, or the
        CPU for entries such as Adam's ``step``).
        """
        check_group(param_group, "the added parameter group")
        kept = self._keep_state()
        self.optimizer.add_param_group(param_group)
        self._reset_round()
        self._agreed = False
        self._build(self._params_now())
        self._restore_state(kept)


def _reads_only_its_own(module: torch.nn.Module) -> bool:
    """Whether ``module``'s forward reads no parameter of its submodules but through their own forwards: a module
    without submodules, or an ``nn.Sequential`` whose forward is Sequential's (it calls its children in turn)."""
    if isinstance(module, torch.nn.Sequential):
        return type(module).forward is torch.nn.Sequential.forward
    return next(module.children(), None) is None


def _await_hook(ref: weakref.ref[ShardedOptimizer]) -> Callable[[torch.nn.Module, Any], None]:
    """A global forward pre-hook (prefetch): a module's forward waits for the allgathers of the parameters it may
    read. A module without submodules (``Linear``) and a plain ``nn.Sequential`` read only their own; any other
    module waits for its whole subtree's, as an FSDP unit gathers its subtree: its forward may read a submodule's
    parameter without calling it (``nn.MultiheadAttention`` passes ``out_proj.weight`` to a function; a parent may
    use a child's weight). Waiting only for its own parameters gave such modules stale ones."""

    @torch.compiler.disable
    def hook(module: torch.nn.Module, args: Any) -> None:
        opt = ref()
        if opt is not None and opt._arriving:
            opt._await(module.parameters(recurse=not _reads_only_its_own(module)))

    return hook


def _fits(t: torch.Tensor, view: torch.Tensor) -> bool:
    """Whether ``t`` (a parameter or its gradient) has ``view``'s shape, dtype and device: its place in the layout."""
    return t.shape == view.shape and t.dtype == view.dtype and t.device == view.device


def _is_view(grad: torch.Tensor, view: torch.Tensor) -> bool:
    """Whether ``grad`` is already ``view``, its place in the flat gradient buffer (a sparse gradient never is)."""
    return grad.layout == torch.strided and is_slice(grad, view)


def _any_nonzero(tensors: list[torch.Tensor]) -> bool:
    """Whether any element of ``tensors`` is not zero (NaN included); one device synchronization per device."""
    found: dict[torch.device, list[torch.Tensor]] = {}
    for t in tensors:
        found.setdefault(t.device, []).append(t.any())
    return any(bool(torch.stack(flags).any()) for flags in found.values())
