"""``DistributedOptimizer``, ``reduce_gradients_in_backward`` and ``allreduce_gradients``.

``DistributedOptimizer`` and ``reduce_gradients_in_backward`` reduce gradients *during*
``backward()``: hooks on the parameters hand each bucket to the reduction as soon as
its gradients are accumulated, and ``backward()`` returns only once every ``.grad`` is
the reduced one, as with torch DDP (:mod:`distutils_ml.reducer` says how buckets are
formed and ordered). ``allreduce_gradients`` reduces when it is called, after backward.

Whenever the reduction plan is built (first reduction, and again when the parameters
change through the wrapper) the ranks compare their configuration (op, communication
dtype, bucket size, parameter shapes, dtypes and device types) in one small allgather
and all raise on a difference; reductions that reuse the plan pay nothing for the check.
"""

from __future__ import annotations

import contextlib
import os
import threading
import warnings
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import numpy as np
import torch

from distutils_ml.backends.base import Backend, ReduceOp, check_backend, resolve_op
from distutils_ml.collectives import allgather, allreduce
from distutils_ml.reducer import DEFAULT_BUCKET_BYTES, GradientReducer, check_bucket_bytes, ranks_text
from distutils_ml.tcpring import transport_choice

__all__ = ["BackwardReduction", "DistributedOptimizer", "allreduce_gradients", "reduce_gradients_in_backward"]


def _params_of(module_or_params: torch.nn.Module | Iterable[torch.Tensor]) -> tuple[list[torch.Tensor], list[str]]:
    """The parameters that take gradients, and their names (for error messages)."""
    if isinstance(module_or_params, torch.nn.Module):
        named = [(n, p) for n, p in module_or_params.named_parameters() if p.requires_grad]
        return [p for _, p in named], [n for n, _ in named]
    if isinstance(module_or_params, torch.Tensor):
        return [module_or_params], ["module_or_params"]
    try:
        params = list(module_or_params)
    except TypeError:
        raise TypeError(
            f"module_or_params: got {type(module_or_params).__qualname__}; "
            "allowed: a torch.nn.Module or an iterable of tensors"
        ) from None
    for p in params:
        if not isinstance(p, torch.Tensor):
            raise TypeError(f"module_or_params: contains {type(p).__qualname__}; allowed: tensors")
    kept = [(f"module_or_params[{i}]", p) for i, p in enumerate(params) if p.requires_grad]
    return [p for _, p in kept], [n for n, _ in kept]


# allreduce_gradients keeps one reducer per backend, op and bucket size, so its plan (and the
# configuration check that comes with building one) is reused while the parameters stay the same.
_REDUCERS: weakref.WeakKeyDictionary[Backend, dict[tuple[ReduceOp, int], GradientReducer]] = weakref.WeakKeyDictionary()
_REDUCERS_LOCK = threading.Lock()


def allreduce_gradients(
    backend: Backend,
    module_or_params: torch.nn.Module | Iterable[torch.Tensor],
    op: Any = ReduceOp.AVG,
    *,
    bucket_bytes: int | None = None,
) -> None:
    """Average (or ``op``) every parameter's gradient across ranks, in place.

    For training loops that keep their own optimizer. Parameters must be listed in
    the same order on every rank (a module's ``parameters()`` are). The first call, and
    every call whose parameters differ from the previous call's, compares ``op``,
    ``bucket_bytes`` and the parameters' shapes and dtypes across ranks and raises
    ``ValueError`` on every rank on a difference. A sparse gradient becomes dense.

    Example:
        >>> model = torch.nn.Linear(4, 1)
        >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> model(torch.ones(2, 4)).sum().backward()
        >>> dml.allreduce_gradients(backend, model)  # every .grad is now the average over ranks
        >>> opt.step()
    """
    check_backend(backend, "allreduce_gradients")
    key = (resolve_op(op), default_bucket_bytes(backend, bucket_bytes))
    params, labels = _params_of(module_or_params)
    with _REDUCERS_LOCK:
        reducers = _REDUCERS.setdefault(backend, {})
        if key not in reducers:
            reducers[key] = GradientReducer(
                "allreduce_gradients", *key, None, params=list, labels=list, fix=_FIX_ALLREDUCE
            )
        reducer = reducers[key]
    reducer._params_of, reducer._labels = (lambda: params), (lambda: labels)
    reducer.reduce(backend)


_FIX_ALLREDUCE = "Call allreduce_gradients with the same op and bucket_bytes"
_FIX_OPTIMIZER = "Create DistributedOptimizer with the same op, bucket_bytes and communication_dtype"
_FIX_BACKWARD = "Call reduce_gradients_in_backward with the same op, bucket_bytes and communication_dtype"


def default_overlap(backend: Backend) -> bool:
    """Whether buckets go on the communication thread by default: ``DML_OVERLAP`` (1/0) if set, else on
    NCCLBackend, and on MPIBackend when its buckets go over the TCP ring (ranks on several hosts).

    A thread waiting in an MPI collective polls (Open MPI progresses by spinning), so on one
    host's CPUs it takes the core backward computes on. NCCL reduces on the GPU, and across
    hosts the buckets go over :mod:`distutils_ml.tcpring`, whose thread sleeps in ``poll()``
    until bytes arrive (docs/benchmarks/network.md).
    """
    forced = os.environ.get("DML_OVERLAP", "").strip().lower()
    if forced in ("1", "true", "yes", "on"):
        return True
    if forced in ("0", "false", "no", "off"):
        return False
    from distutils_ml.backends.nccl import NCCLBackend

    if isinstance(backend, NCCLBackend):
        return True
    choice = transport_choice()
    return choice == "tcp" or (choice == "auto" and spans_hosts(backend))


def spans_hosts(backend: Backend) -> bool:
    """Whether the backend's ranks run on several hosts (MPI and NCCL backends know; LocalBackend: no)."""
    hosts = getattr(backend, "hosts", None)
    if hosts is None:
        inner = getattr(backend, "mpi", None)
        hosts = getattr(inner, "hosts", None)
    return bool(hosts) and len(set(hosts)) > 1


def default_bucket_bytes(backend: Backend, bucket_bytes: int | None) -> int:
    """``bucket_bytes``, or its default: 256 KiB on one host, 4 MiB across hosts.

    Every bucket costs a network round trip: across hosts, gradients under 4 MiB share
    buckets of about 4 MiB (fewer, larger messages, as DDP's 25 MiB buckets); on one host
    256 KiB measured best (larger gradients reduced in place, never copied).
    """
    if bucket_bytes is not None:
        return check_bucket_bytes(bucket_bytes)
    return NETWORK_BUCKET_BYTES if spans_hosts(backend) else DEFAULT_BUCKET_BYTES


NETWORK_BUCKET_BYTES = 4 << 20


class BackwardReduction:
    """What :func:`reduce_gradients_in_backward` returns: ``no_sync()``, ``reset()``, ``remove()``.

    Like DDP it does not know when the optimizer steps: with an op other than ``dml.AVG``,
    clear the gradients between backward passes (or accumulate inside ``no_sync()``), or
    the gradients of the first pass are reduced again.
    """

    def __init__(self, backend: Backend, reducer: GradientReducer) -> None:
        self._backend = backend
        self._reducer = reducer
        self._no_sync = False
        reducer.skip = lambda: self._no_sync

    @property
    def overlap(self) -> bool:
        """Whether buckets are reduced on the communication thread while backward runs."""
        return self._reducer.overlap

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside only accumulate locally; the next one outside reduces the sum once."""
        previous, self._no_sync = self._no_sync, True
        try:
            yield
        finally:
            self._no_sync = previous

    def remove(self) -> None:
        """Stop reducing during backward (removes the hooks)."""
        self._reducer.detach()

    def reset(self) -> None:
        """Forget the reduction of a backward that raised midway (call with ``zero_grad()`` before the next)."""
        self._reducer.reset()


def reduce_gradients_in_backward(
    backend: Backend,
    module_or_params: torch.nn.Module | Iterable[torch.Tensor],
    op: Any = ReduceOp.AVG,
    *,
    bucket_bytes: int | None = None,
    communication_dtype: torch.dtype | None = None,
    overlap: bool | None = None,
) -> BackwardReduction:
    """From now on every ``backward()`` returns with each ``.grad`` averaged (or ``op``) across ranks.

    ``DistributedOptimizer``'s reduction without wrapping an optimizer, for loops that keep
    their own (what ``DistributedDataParallel`` does to a module's gradients). Buckets are
    reduced in a fixed order while backward runs (``overlap``, default: when the ranks span
    ``NCCLBackend``) or all at its end; either way ``.grad`` is final when ``backward()``
    returns, so clipping and AMP unscaling need no extra call. Every rank must run the
    same number of backward passes. Use ``handle.no_sync()`` to accumulate micro-batches.

    Example:
        >>> model = torch.nn.Linear(4, 1)
        >>> handle = dml.reduce_gradients_in_backward(backend, model)
        >>> model(torch.ones(2, 4)).sum().backward()  # .grad is now the average over ranks
        >>> handle.remove()
    """
    check_backend(backend, "reduce_gradients_in_backward")
    params, labels = _params_of(module_or_params)
    if isinstance(module_or_params, torch.nn.Module):  # looked up again at each backward: changes are noticed
        module = module_or_params
        current: Callable[[], list[torch.Tensor]] = lambda: _params_of(module)[0]  # noqa: E731
        names: Callable[[], list[str]] = lambda: _params_of(module)[1]  # noqa: E731
    else:
        current, names = (lambda: params), (lambda: labels)
    reducer = GradientReducer(
        "reduce_gradients_in_backward",
        op,
        default_bucket_bytes(backend, bucket_bytes),
        communication_dtype,
        params=current,
        labels=names,
        fix=_FIX_BACKWARD,
    )
    reducer.attach(backend, overlap=default_overlap(backend) if overlap is None else bool(overlap))
    return BackwardReduction(backend, reducer)


def check_wrapped(optimizer: Any, backward_passes_per_step: Any, example: str) -> None:
    """The checks of ``DistributedOptimizer``'s arguments common to its sharded form: raise before anything moves."""
    if (
        isinstance(backward_passes_per_step, bool)
        or not isinstance(backward_passes_per_step, int)
        or backward_passes_per_step < 1
    ):
        raise ValueError(f"backward_passes_per_step: got {backward_passes_per_step!r}; allowed: an int >= 1")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            f"optimizer: got {type(optimizer).__qualname__}; allowed: a torch.optim.Optimizer, e.g. {example}"
        )
    if isinstance(optimizer, DistributedOptimizer):
        raise TypeError("optimizer: already a DistributedOptimizer; wrap the plain optimizer once")


class DistributedOptimizer(torch.optim.Optimizer):
    """Wraps a torch optimizer: gradients are reduced across ranks during ``backward()``, then ``step()`` steps.

    When ``backward()`` returns, every ``.grad`` is already the average (or ``op``) over
    ranks, as with torch DDP: clipping, AMP unscaling and gradient-norm logging need no
    extra call, and ``step()`` only steps. Buckets are reduced in a fixed order, on a
    communication thread while backward runs (``overlap``) or all at its end. Every rank
    must run the same number of backward passes per step (as with DDP). Gradients that no
    backward reduced (set by hand, or accumulated inside ``no_sync()``) are reduced by
    ``step()`` or ``synchronize()``.

    It is a ``torch.optim.Optimizer`` itself (LR schedulers and ``isinstance`` accept
    it) and forwards ``zero_grad``, ``param_groups``, ``state``, ``state_dict``,
    ``load_state_dict`` and ``add_param_group`` to the wrapped optimizer.

    At the first reduction (and whenever the parameters change) the ranks compare ``op``,
    ``bucket_bytes``, ``communication_dtype`` and the parameters' shapes, dtypes and
    device types, and all raise ``ValueError`` naming the ranks that differ.

    Sparse gradients (``nn.Embedding(sparse=True)``) are reduced as dense tensors, like
    Horovod's ``sparse_as_dense``, and stay dense: optimizers that accept dense gradients
    work (``torch.optim.SparseAdam``, which needs sparse ones, is refused).

    Args:
        backend: from ``dml.get_distributed_backend``.
        optimizer: any ``torch.optim.Optimizer`` that accepts dense gradients.
        op: how gradients combine: ``dml.AVG`` (default) or another reduction.
        bucket_bytes: gradients smaller than this share flat buckets of about this size
            per dtype; larger ones are reduced in place (default 256 KiB on one host,
            4 MiB when the ranks span several hosts).
        communication_dtype: ``torch.bfloat16`` or ``torch.float16`` to send gradients
            in half precision (reduced in float32 where the transport cannot reduce
            halves, then cast back); None keeps each gradient's dtype.
        overlap: reduce buckets on the communication thread while backward computes
            (True), or all at the end of backward (False). Default: True on NCCLBackend,
            else False (a thread waiting in an MPI collective spins on the core backward
            computes on); ``DML_OVERLAP=1/0`` changes the default.
        backward_passes_per_step: reduce only every k-th backward (Horovod's option):
            k backward passes accumulate locally, the k-th reduces their sum once.
        shard_state: True shards the optimizer state over the ranks (ZeRO-1): the result
            is a :class:`~distutils_ml.ShardedOptimizer`, with 1/W of the state per rank
            (elementwise optimizers only; see its documentation for what differs).

    Example:
        >>> model = dml.synchronize(backend, torch.nn.Linear(4, 1))
        >>> opt = dml.DistributedOptimizer(backend, torch.optim.Adam(model.parameters()))
        >>> opt = dml.synchronize(backend, opt)
        >>> opt.zero_grad()
        >>> model(torch.ones(2, 4)).sum().backward()
        >>> opt.step()  # the gradients were averaged over all ranks in backward(); this steps
    """

    def __new__(cls, *args: Any, shard_state: bool = False, **kwargs: Any) -> DistributedOptimizer:
        if not isinstance(shard_state, bool):
            raise TypeError(f"shard_state: got {shard_state!r}; allowed: True or False")
        if shard_state and cls is DistributedOptimizer:
            from distutils_ml.sharded import ShardedOptimizer

            return super().__new__(ShardedOptimizer)
        return super().__new__(cls)

    def __init__(
        self,
        backend: Backend,
        optimizer: torch.optim.Optimizer,
        *,
        op: Any = ReduceOp.AVG,
        bucket_bytes: int | None = None,
        communication_dtype: torch.dtype | None = None,
        overlap: bool | None = None,
        backward_passes_per_step: int = 1,
        shard_state: bool = False,
    ) -> None:
        check_backend(backend, "DistributedOptimizer")
        if shard_state:
            raise TypeError(
                f"shard_state=True: {type(self).__qualname__} subclasses DistributedOptimizer, which shards only as "
                "itself; subclass dml.ShardedOptimizer instead"
            )
        check_wrapped(
            optimizer,
            backward_passes_per_step,
            "dml.DistributedOptimizer(backend, torch.optim.SGD(model.parameters(), lr=0.1))",
        )
        if isinstance(optimizer, torch.optim.SparseAdam):
            raise TypeError(
                "optimizer: got torch.optim.SparseAdam, which needs sparse gradients; DistributedOptimizer reduces "
                "sparse gradients as dense tensors (like Horovod's sparse_as_dense=True) and leaves .grad dense. "
                "Use an optimizer that accepts dense gradients, e.g. torch.optim.Adam"
            )
        self._backend = backend
        self.optimizer = optimizer
        self._reducer = GradientReducer(
            "DistributedOptimizer",
            op,
            default_bucket_bytes(backend, bucket_bytes),
            communication_dtype,
            params=self._params,
            labels=self._labels,
            fix=_FIX_OPTIMIZER,
        )
        self._passes_per_step = backward_passes_per_step
        self._passes = 0
        self._synchronized = False  # synchronize() was called; the step has not come yet
        self._no_sync = False
        self._late = False  # a backward accumulated into the gradients after synchronize()
        self._dirty = False  # a backward accumulated gradients no reduction has covered
        self._reduced = False  # a backward reduced the gradients since the last step / zero_grad
        self._reducer.skip = self._skip_backward
        self._reducer.on_reduced = self._backward_reduced
        self._reducer.attach(backend, overlap=default_overlap(backend) if overlap is None else bool(overlap))
        # Hook tables of torch.optim.Optimizer, so register_step_pre_hook / register_step_post_hook
        # work on the wrapper (its state_dict hooks are forwarded to the wrapped optimizer, below).
        self._optimizer_step_pre_hooks: OrderedDict[int, Callable] = OrderedDict()
        self._optimizer_step_post_hooks: OrderedDict[int, Callable] = OrderedDict()

    @property
    def backend(self) -> Backend:
        """The backend gradients are reduced over."""
        return self._backend

    # -- forwarded state ----------------------------------------------------------------

    @property  # type: ignore[override]
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self.optimizer.param_groups = value

    @property  # type: ignore[override]
    def state(self) -> Any:
        return self.optimizer.state

    @state.setter
    def state(self, value: Any) -> None:
        self.optimizer.state = value

    @property  # type: ignore[override]
    def defaults(self) -> dict[str, Any]:
        return self.optimizer.defaults

    @defaults.setter
    def defaults(self, value: dict[str, Any]) -> None:
        self.optimizer.defaults = value

    def state_dict(self) -> dict[str, Any]:
        """The wrapped optimizer's ``state_dict()``."""
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load into the wrapped optimizer."""
        self.optimizer.load_state_dict(state_dict)

    def register_state_dict_pre_hook(self, hook: Callable, prepend: bool = False) -> Any:
        """Register on the wrapped optimizer, whose ``state_dict`` this one returns."""
        return self.optimizer.register_state_dict_pre_hook(hook, prepend)

    def register_state_dict_post_hook(self, hook: Callable, prepend: bool = False) -> Any:
        """Register on the wrapped optimizer, whose ``state_dict`` this one returns."""
        return self.optimizer.register_state_dict_post_hook(hook, prepend)

    def register_load_state_dict_pre_hook(self, hook: Callable, prepend: bool = False) -> Any:
        """Register on the wrapped optimizer, into which ``load_state_dict`` loads."""
        return self.optimizer.register_load_state_dict_pre_hook(hook, prepend)

    def register_load_state_dict_post_hook(self, hook: Callable, prepend: bool = False) -> Any:
        """Register on the wrapped optimizer, into which ``load_state_dict`` loads."""
        return self.optimizer.register_load_state_dict_post_hook(hook, prepend)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a parameter group to the wrapped optimizer (every rank must add the same, in the same order).

        The reduction plan is rebuilt and compared across ranks at once (a collective).
        """
        self.optimizer.add_param_group(param_group)
        self._reducer.plan(self._backend)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear gradients (the wrapped optimizer's ``zero_grad``)."""
        self._end_pending_step()
        self._reducer.reset()
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def __repr__(self) -> str:
        return f"DistributedOptimizer(op={self._reducer.op!r}, optimizer={self.optimizer!r})"

    def __getstate__(self) -> dict[str, Any]:
        raise TypeError("DistributedOptimizer holds a backend and cannot be pickled; save state_dict() instead")

    @property
    def overlap(self) -> bool:
        """Whether buckets are reduced on the communication thread while backward runs."""
        return self._reducer.overlap

    # -- the distributed part ------------------------------------------------------------

    def _params(self) -> list[torch.Tensor]:
        return [p for g in self.optimizer.param_groups for p in g["params"] if p.requires_grad]

    def _labels(self) -> list[str]:
        """Names of ``_params()`` for error messages."""
        return [
            f"param_groups[{g}]['params'][{j}]"
            for g, group in enumerate(self.optimizer.param_groups)
            for j, p in enumerate(group["params"])
            if p.requires_grad
        ]

    def _reduce(self) -> None:
        self._reducer.reduce(self._backend)
        self._dirty = False

    def _skip_backward(self) -> bool:
        """Asked at the first gradient of each backward: True leaves this backward's gradients unreduced."""
        if self._synchronized:  # after synchronize(): the step agrees on it and reduces again
            self._late = True
            return True
        if self._no_sync:
            self._dirty = True
            return True
        self._passes += 1
        if self._passes % self._passes_per_step:
            self._dirty = True
            return True
        if self._reduced and self._reducer.op is not ReduceOp.AVG:
            raise RuntimeError(
                f"DistributedOptimizer: a second backward() since the last step would reduce the gradients again; "
                f"with op={self._reducer.op!r} that counts the first backward's gradients "
                f"{self._backend.size} times. Accumulate micro-batches inside opt.no_sync() (or pass "
                "backward_passes_per_step=k), or call opt.zero_grad() between the backward passes"
            )
        return False

    def _backward_reduced(self) -> None:
        self._reduced = True
        self._dirty = False

    def synchronize(self) -> None:
        """Make sure the gradients are reduced now; ``step()`` then won't reduce again.

        After a ``backward()`` (outside ``no_sync()``) they already are, and this only
        marks the step. Gradients accumulated inside ``no_sync()``, or set by hand, are
        reduced here. A ``backward()`` between ``synchronize()`` and ``step()`` is noticed:
        with ``dml.AVG`` the gradients are reduced again at the next ``step()`` or
        ``synchronize()`` (exact: the average of avg(g1) + g2 is avg(g1) + avg(g2)) with a
        ``RuntimeWarning``; with another op that would be wrong, so every rank raises
        ``RuntimeError``.
        """
        if self._synchronized:
            if not self._reduce_again("synchronize()"):
                return
        elif self._reduced and not self._dirty:
            self._synchronized = True
            return
        self._reduce()
        self._synchronized = True
        self._late = False

    def _end_pending_step(self) -> None:
        self._synchronized = False
        self._late = False
        self._reduced = False
        self._passes = 0

    def _reduce_again(self, caller: str) -> bool:
        """After synchronize(): whether any rank ran backward() since, agreed by every rank.

        True (with a RuntimeWarning) means reduce again; with an op other than AVG every rank raises.
        """
        late = np.empty(self._backend.size, dtype=np.int8)
        allgather(self._backend, np.array(self._late, dtype=np.int8), late)
        self._late = False
        ranks = np.flatnonzero(late).tolist()
        if not ranks:
            return False
        where = (
            f"DistributedOptimizer.{caller}: backward() accumulated into the gradients after synchronize() "
            f"on {ranks_text(ranks)}"
        )
        fix = (
            "Call opt.synchronize() once per step, after the step's last backward() (accumulate micro-batches "
            "before it, or inside opt.no_sync()), and clear gradients with opt.zero_grad()"
        )
        if self._reducer.op is not ReduceOp.AVG:
            self._end_pending_step()
            raise RuntimeError(
                f"{where}. With op={self._reducer.op!r} reducing them again would count the gradients of before "
                f"synchronize() {self._backend.size} times, so nothing was reduced or stepped. {fix}"
            )
        warnings.warn(
            f"{where}; they were reduced again (exact for dml.AVG, at the cost of a second reduction). {fix}",
            RuntimeWarning,
            stacklevel=3,
        )
        return True

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally: backward passes inside are not reduced (DDP's ``no_sync``).

        The next backward outside reduces the sum once; or, without one, ``step()`` or
        ``synchronize()`` outside does.
        """
        previous, self._no_sync = self._no_sync, True
        try:
            yield
        finally:
            self._no_sync = previous

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Step the wrapped optimizer on the reduced gradients.

        The gradients were reduced during ``backward()``; those no backward reduced (inside
        ``no_sync()``, or set by hand) are reduced here first, unless inside ``no_sync()``.
        With a ``closure`` (``torch.optim.LBFGS``), the loss it returns is reduced with
        ``op`` too, so every rank takes the same decisions.
        """
        for hook in list(self._optimizer_step_pre_hooks.values()):
            hook(self, (), {})
        if closure is not None:
            self._end_pending_step()
            result = self.optimizer.step(self._reducing(closure))
        else:
            if self._synchronized:
                if self._reduce_again("step()"):
                    self._reduce()
            elif not self._no_sync and (self._dirty or not self._reduced):
                if self._reduced and self._reducer.op is not ReduceOp.AVG:
                    self._end_pending_step()
                    raise RuntimeError(
                        f"DistributedOptimizer.step(): gradients reduced by a backward() were then accumulated "
                        f"into inside no_sync(); with op={self._reducer.op!r} reducing them again would count the "
                        "first ones several times, so nothing was stepped. Run the reducing backward last"
                    )
                self._reduce()
            self._end_pending_step()
            result = self.optimizer.step()
        for hook in list(self._optimizer_step_post_hooks.values()):
            hook(self, (), {})
        return result

    def _reducing(self, closure: Callable[[], Any]) -> Callable[[], Any]:
        """``closure`` followed by the reduction of the gradients (unless its backward did) and of its loss."""

        def reduced() -> Any:
            self._reduced = False
            loss = closure()
            if self._no_sync:
                return loss
            if self._dirty or not self._reduced:
                self._reduce()
            self._reduced = False
            if loss is None:
                return None
            if isinstance(loss, torch.Tensor):
                value = loss.detach().clone() if loss.dtype.is_floating_point else loss.detach().double()
                return allreduce(self._backend, value, self._reducer.op)
            return float(allreduce(self._backend, np.array(float(loss)), self._reducer.op))

        return reduced
