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
import threading
import warnings
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import numpy as np
import torch

from distutils_ml.backends.base import Backend, ReduceOp, check_backend, resolve_op
from distutils_ml.buckets import BucketBytes, default_bucket_bytes, default_overlap, machine_identity
from distutils_ml.collectives import allgather
from distutils_ml.optimizer_base import DataParallelOptimizer, Phase, check_sparse_as_dense
from distutils_ml.reducer import GradientReducer, ranks_text
from distutils_ml.sharded import ShardedOptimizer
from distutils_ml.sharded_rules import check_steps_per_parameter
from distutils_ml.stepping import BucketStepper, describe_positions, step_optimizer

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
_REDUCERS: weakref.WeakKeyDictionary[Backend, dict[tuple[ReduceOp, BucketBytes, bool], GradientReducer]] = (
    weakref.WeakKeyDictionary()
)
_REDUCERS_LOCK = threading.Lock()


def allreduce_gradients(
    backend: Backend,
    module_or_params: torch.nn.Module | Iterable[torch.Tensor],
    op: Any = ReduceOp.AVG,
    *,
    bucket_bytes: int | None = None,
    sparse_as_dense: bool = False,
) -> None:
    """Average (or ``op``) every parameter's gradient across ranks, in place.

    For training loops that keep their own optimizer. Parameters must be listed in
    the same order on every rank (a module's ``parameters()`` are). The first call, and
    every call whose parameters differ from the previous call's, compares ``op``,
    ``bucket_bytes`` and the parameters' shapes and dtypes across ranks and raises
    ``ValueError`` on every rank on a difference. Sparse gradients are reduced as sparse (the first call
    that meets one reduces it dense once, then it goes as sparse) with ``dml.SUM`` and ``dml.AVG``, and as
    dense tensors with ``sparse_as_dense=True`` or another op.

    Example:
        >>> model = torch.nn.Linear(4, 1)
        >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> model(torch.ones(2, 4)).sum().backward()
        >>> dml.allreduce_gradients(backend, model)  # every .grad is now the average over ranks
        >>> opt.step()
    """
    check_backend(backend, "allreduce_gradients")
    key = (resolve_op(op), default_bucket_bytes(backend, bucket_bytes), check_sparse_as_dense(sparse_as_dense))
    params, labels = _params_of(module_or_params)
    with _REDUCERS_LOCK:
        reducers = _REDUCERS.setdefault(backend, {})
        if key not in reducers:
            reducers[key] = GradientReducer(
                "allreduce_gradients",
                *key[:2],
                None,
                params=list,
                labels=list,
                fix=_FIX_ALLREDUCE,
                identity=_CALL_IDENTITY,  # a call's reduction, ordered by the program like any collective
            )
            reducers[key].sparse_as_dense = sparse_as_dense
        reducer = reducers[key]
    reducer.use(lambda: params, lambda: labels)
    reducer.reduce(backend)


#: The number allreduce_gradients' reducers carry in their headers: not one from buckets.machine_identity, since its
#: cache of reducers (one per setting) may differ across ranks after a call that raised; the headers compare it
#: modulo 16 (4 in half precision), so it stands apart from the first 15 (3) machines made on a backend.
_CALL_IDENTITY = 2**20 - 1

_FIX_ALLREDUCE = "Call allreduce_gradients with the same op, bucket_bytes and sparse_as_dense"
_FIX_OPTIMIZER = "Create DistributedOptimizer with the same op, bucket_bytes and communication_dtype"
_FIX_BACKWARD = "Call reduce_gradients_in_backward with the same op, bucket_bytes and communication_dtype"


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
    sparse_as_dense: bool = False,
) -> BackwardReduction:
    """From now on every ``backward()`` returns with each ``.grad`` averaged (or ``op``) across ranks.

    ``DistributedOptimizer``'s reduction without wrapping an optimizer, for loops that keep
    their own (what ``DistributedDataParallel`` does to a module's gradients). Buckets are
    reduced in a fixed order while backward runs (``overlap``, default: when the ranks span
    ``NCCLBackend``) or all at its end; either way ``.grad`` is final when ``backward()``
    returns, so clipping and AMP unscaling need no extra call. Every rank must run the
    same number of backward passes. Use ``handle.no_sync()`` to accumulate micro-batches.
    Sparse gradients are reduced as sparse unless ``sparse_as_dense`` (see ``DistributedOptimizer``).

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
        identity=machine_identity(backend),
    )
    reducer.sparse_as_dense = check_sparse_as_dense(sparse_as_dense)
    reducer.attach(backend, overlap=default_overlap(backend) if overlap is None else bool(overlap))
    return BackwardReduction(backend, reducer)


class DistributedOptimizer(DataParallelOptimizer):
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

    Sparse gradients (``nn.Embedding(sparse=True)``) are reduced as sparse, as Horovod does by
    default: every rank's indices and values are gathered and summed (``dml.sparse_allreduce``),
    so the bytes follow the rows touched, not the table, and ``.grad`` stays sparse
    (``torch.optim.SparseAdam`` works). The first backward that meets one reduces it dense once (the
    buckets were cut before it was seen) and hands it back sparse. ``sparse_as_dense=True`` reduces
    them as dense tensors instead, as do ops other than ``dml.SUM`` and ``dml.AVG``.

    ``DistributedOptimizer(..., shard_state=True)`` returns a :class:`~distutils_ml.ShardedOptimizer`,
    a sibling over the same base (:mod:`distutils_ml.optimizer_base`), registered as a
    virtual subclass so that ``isinstance(sharded, DistributedOptimizer)`` holds: it is one by
    contract, and inherits nothing of the unsharded form's reduction.

    Args:
        backend: from ``dml.get_distributed_backend``.
        optimizer: any ``torch.optim.Optimizer``.
        op: how gradients combine: ``dml.AVG`` (default) or another reduction.
        bucket_bytes: gradients smaller than this share flat buckets of about this size
            per dtype; larger ones are reduced in place (default: for gradients in host
            memory 256 KiB on one host, 4 MiB when the ranks span several hosts; on a GPU
            25 MiB, DDP's). A number given holds for every device.
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
        sparse_as_dense: reduce sparse gradients as dense tensors (Horovod's option) rather than
            as sparse; with ``shard_state=True`` they are always dense (views of the flat buffer).
        step_during_backward: step each bucket's parameters as soon as its reduction lands, during
            ``backward()`` (on the communication thread with overlap), while later buckets are still on
            the wire; ``step()`` then steps only what is left. Bit-identical to stepping after backward,
            for optimizers that compute each parameter's update from that parameter alone. Nothing may
            change the gradients between ``backward()`` and ``step()`` (clipping, ``GradScaler``): ``step()``
            raises if something did. With ``shard_state=True``: each bucket's shard is stepped and its
            parameters allgathered as its reduce-scatter lands. Default False (:mod:`distutils_ml.stepping`).
        prefetch: with ``shard_state=True`` across hosts, ``step()`` returns before the updated
            parameters have all arrived and each module's forward waits for those it may read (a layer's
            own; a module with submodules, but a plain ``nn.Sequential``, its subtree's; see
            :class:`~distutils_ml.ShardedOptimizer`). Default False.

    Example:
        >>> model = dml.synchronize(backend, torch.nn.Linear(4, 1))
        >>> opt = dml.DistributedOptimizer(backend, torch.optim.Adam(model.parameters()))
        >>> opt = dml.synchronize(backend, opt)
        >>> opt.zero_grad()
        >>> model(torch.ones(2, 4)).sum().backward()
        >>> opt.step()  # the gradients were averaged over all ranks in backward(); this steps
    """

    def __new__(cls, *args: Any, shard_state: bool = False, **kwargs: Any) -> DataParallelOptimizer:
        if not isinstance(shard_state, bool):
            raise TypeError(f"shard_state: got {shard_state!r}; allowed: True or False")
        if shard_state and cls is DistributedOptimizer:
            return ShardedOptimizer(*args, shard_state=True, **kwargs)  # not a subtype: __init__ runs once, here
        return super().__new__(cls)

    def _labels(self) -> list[str]:
        """Names of the parameters for error messages, read once the bucket steps in flight have run (each swaps the
        groups' parameter lists for its own while it runs, on the stepping thread)."""
        stepper = getattr(self, "_stepper", None)
        if stepper is not None:
            stepper.settle()
        return super()._labels()

    def _setup(self, op: Any, bucket_bytes: int | None, communication_dtype: Any, overlap: bool | None) -> None:
        backend = self._backend
        self._reducer = GradientReducer(
            "DistributedOptimizer",
            op,
            default_bucket_bytes(backend, bucket_bytes),
            communication_dtype,
            params=self._params_now,
            labels=self._labels,
            fix=_FIX_OPTIMIZER,
            identity=machine_identity(backend),
        )
        self._reducer.rescaled = True  # dml.join: average_over
        self._op = self._reducer.op
        self._reducer.sparse_as_dense = self._sparse_as_dense
        self._reducer.skip = self._skip_backward
        self._reducer.on_reduced = self._backward_reduced
        if self._prefetch:
            raise TypeError(
                "prefetch=True: only with shard_state=True, whose step() allgathers the updated parameters (here "
                "every rank steps every parameter, so nothing is left to fetch after step())"
            )
        self._stepper: BucketStepper | None = None
        if self._step_during_backward:
            check_steps_per_parameter(self.optimizer)
            threaded = default_overlap(backend) if overlap is None else bool(overlap)
            self._stepper = BucketStepper(self.optimizer, threaded=threaded)
            self._reducer.step_bucket = self._stepper.step
            # GradScaler then hands its inf check to step() (found_inf, grad_scale) instead of unscaling the
            # gradients in place, which no version counter records: step() refuses it.
            self._step_supports_amp_scaling = True
        self._reducer.attach(backend, overlap=default_overlap(backend) if overlap is None else bool(overlap))

    def _check_shard_state(self, shard_state: Any) -> None:
        if shard_state:
            raise TypeError(
                f"shard_state=True: {type(self).__qualname__} subclasses DistributedOptimizer, which shards only as "
                "itself; subclass dml.ShardedOptimizer instead"
            )

    def _check_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        if isinstance(optimizer, torch.optim.SparseAdam) and self._sparse_as_dense:
            raise TypeError(
                "optimizer: got torch.optim.SparseAdam, which needs sparse gradients, with sparse_as_dense=True, "
                "which reduces them as dense tensors and leaves .grad dense. Leave sparse_as_dense=False (sparse "
                "gradients are then reduced as sparse and stay sparse), or use an optimizer that accepts dense "
                "gradients, e.g. torch.optim.Adam"
            )

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a parameter group to the wrapped optimizer (every rank must add the same, in the same order).

        The reduction plan is rebuilt and compared across ranks at once (a collective).
        """
        self.optimizer.add_param_group(param_group)
        self._reducer.plan(self._backend)

    @property
    def overlap(self) -> bool:
        """Whether buckets are reduced on the communication thread while backward runs."""
        return self._reducer.overlap

    @property
    def step_during_backward(self) -> bool:
        """Whether each bucket's parameters are stepped as soon as its reduction lands, during backward."""
        return self._stepper is not None

    def _backward_reduced(self) -> None:
        super()._backward_reduced()
        if self._stepper is not None:
            self._stepper.record()  # re-raises a bucket's failed step
            # on every rank whose backward reduced, whatever it stepped here; not while rescaled (dml.join: the
            # buckets are left to step(), the same on every rank)
            self._stepped_round = self._reducer.scale == 1.0

    def prepare(self) -> None:
        """Build the gradient buckets now and compare the configuration across ranks (a collective on every rank;
        otherwise it happens at the first reduction)."""
        self._reducer.plan(self._backend)

    def average_over(self, count: int) -> None:
        """With ``dml.AVG``: divide the summed gradients by ``count`` ranks instead of the world size, from the next
        reduction on (``dml.join`` passes the number of ranks that still have data; the others send zeros)."""
        size = self._backend.size
        if isinstance(count, bool) or not isinstance(count, int) or not 1 <= count <= size:
            raise ValueError(f"average_over: count: got {count!r}; allowed: an int from 1 to the world size {size}")
        self._reducer.scale = size / count if self._op is ReduceOp.AVG and count != size else 1.0

    def _forget_round(self) -> None:
        self._reducer.reset()
        if self._stepper is not None:
            self._stepper.forget()

    def _clear_grads(self, set_to_none: bool) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    # -- the distributed part ------------------------------------------------------------

    def _reduce(self) -> None:
        self._reducer.reduce(self._backend)
        self._advance("reduce")

    def _late_backward(self) -> bool:
        """After synchronize(): the step agrees on this backward and reduces again."""
        self._advance("late_backward")
        return True

    def _check_reducing_backward(self) -> None:
        if self._stepper is not None and self._stepper.pending:  # kept: step() then refuses (zero_grad() forgets)
            raise RuntimeError(
                "DistributedOptimizer(step_during_backward=True): a second reducing backward() before step(); the "
                "first one already stepped the parameters of its buckets, and this one would step them again. Call "
                "opt.step() after each backward (it steps what is left; a GradScaler that skipped step() on an "
                "inf leaves it uncalled: use step_during_backward=False with a GradScaler), or accumulate "
                "micro-batches inside opt.no_sync() or with backward_passes_per_step=k"
            )
        if self._phase in (Phase.REDUCED, Phase.MIXED) and self._op is not ReduceOp.AVG:
            raise RuntimeError(
                f"DistributedOptimizer: a second backward() since the last step would reduce the gradients again; "
                f"with op={self._op!r} that counts the first backward's gradients "
                f"{self._backend.size} times. Accumulate micro-batches inside opt.no_sync() (or pass "
                "backward_passes_per_step=k), or call opt.zero_grad() between the backward passes"
            )

    def _displaced_by(self) -> str | None:
        return self._reducer.displaced_by

    def _check_reduce_now(self, caller: str) -> None:
        """Gradients that a backward reduced and a backward inside ``no_sync()`` then added to cannot be reduced
        again with an op other than AVG (the first ones would count several times): raise, from ``step()`` and
        ``synchronize()`` alike, with nothing reduced or stepped."""
        if self._phase is Phase.MIXED and self._op is not ReduceOp.AVG:
            self._end_step()
            raise RuntimeError(
                f"DistributedOptimizer.{caller}: gradients reduced by a backward() were then accumulated "
                f"into inside no_sync(); with op={self._op!r} reducing them again would count the "
                "first ones several times, so nothing was reduced or stepped. Run the reducing backward last"
            )

    def _reduce_again(self, caller: str, stacklevel: int) -> bool:
        """After synchronize(): whether any rank ran backward() since, agreed by every rank.

        True (with a RuntimeWarning) means reduce again; with an op other than AVG every rank raises.
        """
        late = np.empty(self._backend.size, dtype=np.int8)
        allgather(self._backend, np.array(self._phase is Phase.LATE, dtype=np.int8), late)
        self._advance("synchronize")
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
        if self._op is not ReduceOp.AVG:
            self._end_step()
            raise RuntimeError(
                f"{where}. With op={self._op!r} reducing them again would count the gradients of before "
                f"synchronize() {self._backend.size} times, so nothing was reduced or stepped. {fix}"
            )
        warnings.warn(
            f"{where}; they were reduced again (exact for dml.AVG, at the cost of a second reduction). {fix}",
            RuntimeWarning,
            stacklevel=stacklevel,
        )
        return True

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Step the wrapped optimizer on the reduced gradients.

        The gradients were reduced during ``backward()``; those no backward reduced (inside
        ``no_sync()``, or set by hand) are reduced here first, unless inside ``no_sync()``.
        With a ``closure`` (``torch.optim.LBFGS``), the loss it returns is reduced with
        ``op`` too, so every rank takes the same decisions.
        """
        return super().step(closure)

    def _step(self, closure: Callable[[], Any] | None) -> Any:
        if self._reducer.unfinished_round():
            self._refuse_unfinished_backward()
        if self._stepper is not None and self._reducer.has_deferred_round():
            self._reduce()  # a reentrant backward left its round open (some buckets perhaps stepped): complete it
        if self._stepper is not None and self._stepper.pending:
            self._finish_stepping(closure)
            return None
        if closure is not None:
            self._end_step()
            return self.optimizer.step(self._reducing(closure))
        if self._phase in (Phase.SYNCHRONIZED, Phase.LATE):
            if self._reduce_again("step()", 5):  # the warning names the caller of step()
                self._reduce()
        elif not self._no_sync and self._unreduced():
            self._check_reduce_now("step()")
            self._reduce()
        self._end_step()
        return step_optimizer(self.optimizer)

    def _finish_stepping(self, closure: Callable[[], Any] | None) -> None:
        """``step()`` after a backward that stepped buckets: step what is left, unless something changed the
        stepped gradients since (then raise: those steps cannot be taken back)."""
        stepper = self._stepper
        assert stepper is not None
        problem = None
        if hasattr(self, "found_inf") or hasattr(self, "grad_scale"):
            self.__dict__.pop("found_inf", None)
            self.__dict__.pop("grad_scale", None)
            problem = "a GradScaler steps it: the steps taken used the scaled gradients, unchecked for infs"
        elif closure is not None:
            problem = "step(closure) was called; a closure computes new gradients, which those steps did not see"
        elif self._phase not in (Phase.REDUCED, Phase.SYNCHRONIZED):
            problem = "backward() accumulated more gradients into them since (inside no_sync(), or after synchronize())"
        else:
            moved = stepper.changed()
            if moved:
                problem = (
                    f"the gradients of {describe_positions(moved, self._labels())} were changed or replaced since "
                    "(torch.nn.utils.clip_grad_norm_, GradScaler.unscale_, or code of yours)"
                )
            elif stepper.hyper_changed():
                problem = (
                    "a parameter group's settings (the learning rate, ...) were changed since backward() returned "
                    "(set them before backward(); an LR scheduler steps after opt.step())"
                )
        self._end_step()
        if problem is None:
            stepper.finish()
            return
        stepper.forget()
        raise RuntimeError(
            f"DistributedOptimizer(step_during_backward=True): backward() stepped the parameters of each bucket as "
            f"its reduction landed, but {problem}; the steps taken did not see that, and nothing more was stepped. "
            "Clipping to a global norm and GradScaler's inf check need the whole gradient before any parameter "
            "moves: use step_during_backward=False for them"
        )

    def _reducing(self, closure: Callable[[], Any]) -> Callable[[], Any]:
        """``closure`` followed by the reduction of the gradients (unless its backward did) and of its loss."""

        def reduced() -> Any:
            self._advance("closure")
            loss = closure()
            if self._no_sync:
                return loss
            if self._unreduced():
                self._reduce()
            self._advance("closure")
            return None if loss is None else self._reduce_loss(loss)

        return reduced


DistributedOptimizer.register(ShardedOptimizer)
