"""``DistributedOptimizer`` and ``allreduce_gradients``: average gradients, then step.

How gradients travel (chosen by measurement on CPU, see docs/benchmarks): a gradient
of at least ``bucket_bytes`` is reduced in place, zero-copy (the backend cuts it into
cache-sized segments); smaller gradients live in one flat bucket per dtype and device,
reduced in one collective. After a reduction each small parameter's ``.grad`` *is* its
slice of the bucket (as with DDP's ``gradient_as_bucket_view``): when gradients are kept
between steps (``zero_grad(set_to_none=False)``, accumulation) backward adds into the
bucket and nothing is copied; a fresh gradient is copied in once and replaced by its
slice, never copied back. The bucket also carries one flag per parameter telling which
ranks have a gradient, so a parameter whose ``.grad`` is None on some ranks counts as
zeros there (no rank ever waits for a collective the others skip) and one whose
``.grad`` is None on every rank stays None. Extra memory: the small gradients' bucket,
at most one gradient-sized buffer (the gradients it replaces are freed).

Sparse gradients (``nn.Embedding(sparse=True)``) are reduced as dense ones, like
Horovod's ``sparse_as_dense=True``: each becomes a dense ``.grad`` before it travels.

Whenever the reduction plan is built (first reduction, and again when the parameters
change) the ranks compare their configuration (op, communication dtype, bucket size,
parameter shapes, dtypes and device types) in one small allgather and all raise on a
difference; reductions that reuse the plan pay nothing for the check.
"""

from __future__ import annotations

import contextlib
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
from distutils_ml.objects import allgather_object, digest

__all__ = ["DistributedOptimizer", "allreduce_gradients"]

DEFAULT_BUCKET_BYTES = 256 * 1024
_COMM_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_SETTINGS = ("op", "communication_dtype", "bucket_bytes", "parameters")


def _check_bucket_bytes(bucket_bytes: Any) -> int:
    if isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, int) or bucket_bytes < 0:
        raise ValueError(f"bucket_bytes: got {bucket_bytes!r}; allowed: an int >= 0")
    return bucket_bytes


class _GradientReducer:
    """Reduces the gradients of a list of parameters across ranks (the plan is rebuilt when the list changes)."""

    def __init__(self, caller: str, op: Any, bucket_bytes: int, communication_dtype: torch.dtype | None) -> None:
        self.caller = caller
        self.op = resolve_op(op)
        self.bucket_bytes = _check_bucket_bytes(bucket_bytes)
        if communication_dtype is not None and communication_dtype not in _COMM_DTYPES:
            raise ValueError(
                f"communication_dtype: got {communication_dtype!r}; allowed: None, torch.float16, torch.bfloat16, "
                "torch.float32 or torch.float64"
            )
        self.comm_dtype = communication_dtype
        # Flags count ranks holding a gradient: SUM/AVG/MAX keep "somebody has one" > 0.
        self._flags_op = ReduceOp.MAX if self.op in (ReduceOp.PROD, ReduceOp.MIN) else self.op
        self._plan_key: tuple | None = None
        self._large: list[int] = []
        self._buckets: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}
        # (parameter index, its flat slice of a bucket, that slice shaped like the parameter)
        self._slots: list[tuple[int, torch.Tensor, torch.Tensor]] = []

    def _plan(self, backend: Backend, params: list[torch.Tensor], labels: Callable[[], list[str]]) -> None:
        key = tuple((id(p), p.dtype, p.shape, p.device) for p in params)
        if key == self._plan_key:
            return
        for p in params:
            if p.is_sparse or p.layout != torch.strided:
                raise TypeError(f"{self.caller}: sparse parameters are not supported; use dense tensors")
            if not p.dtype.is_floating_point:
                raise TypeError(f"{self.caller}: parameter of dtype {p.dtype}; gradients must be floating point")
        self._agree(backend, params, labels)
        small = [
            i
            for i, p in enumerate(params)
            if p.numel() * p.element_size() < self.bucket_bytes
            or (self.comm_dtype is not None and p.dtype != self.comm_dtype)
        ]
        self._large = sorted(set(range(len(params))) - set(small))
        # One bucket per wire dtype and device; the flags head the first parameter's device's bucket.
        flag_key = (self.comm_dtype or torch.float32, params[0].device if params else torch.device("cpu"))
        sizes: dict[tuple[torch.dtype, torch.device], int] = {flag_key: len(params)}
        for i in small:
            d = self._wire_dtype(params[i])
            sizes[d] = sizes.get(d, 0) + params[i].numel()
        self._buckets = {k: torch.zeros(n, dtype=k[0], device=k[1]) for k, n in sizes.items()}
        offsets = dict.fromkeys(sizes, 0)
        offsets[flag_key] = len(params)
        self._slots = []
        for i in small:
            d, k = self._wire_dtype(params[i]), params[i].numel()
            flat = self._buckets[d][offsets[d] : offsets[d] + k]
            offsets[d] += k
            self._slots.append((i, flat, flat.view(params[i].shape)))
        self._flag_key = flag_key
        self._plan_key = key

    def _settings(self, params: list[torch.Tensor]) -> tuple[str, ...]:
        """This rank's configuration, one text per entry of ``_SETTINGS``."""
        shapes = [f"{tuple(p.shape)} {p.dtype} {p.device.type}" for p in params]
        return repr(self.op), repr(self.comm_dtype), repr(self.bucket_bytes), repr(shapes)

    def _agree(self, backend: Backend, params: list[torch.Tensor], labels: Callable[[], list[str]]) -> None:
        """Raise ``ValueError`` on every rank unless every rank has the same configuration."""
        settings = self._settings(params)
        mine = np.array([digest(s) for s in settings], dtype=np.int64)
        every = np.empty((backend.size, mine.size), dtype=np.int64)
        allgather(backend, mine, every)
        if (every == every[0]).all():
            return
        values = allgather_object(backend, (self.op, self.comm_dtype, self.bucket_bytes, _describe(params, labels())))
        lines = []
        for k, name in enumerate(_SETTINGS):
            if (every[:, k] != every[0, k]).any():
                column = [v[k] for v in values]
                lines.append(_parameters_difference(column) if name == "parameters" else _by_rank(name, column))
        fix = (
            "Create DistributedOptimizer with the same op, bucket_bytes and communication_dtype"
            if self.caller == "DistributedOptimizer"
            else "Call allreduce_gradients with the same op and bucket_bytes"
        )
        raise ValueError(
            f"{self.caller}: the ranks are configured differently: {'; '.join(lines)}. {fix}, over the same "
            "parameters in the same order (same shapes, dtypes and device types), on every rank"
        )

    def _wire_dtype(self, p: torch.Tensor) -> tuple[torch.dtype, torch.device]:
        """The bucket a small gradient travels in: its wire dtype and its device."""
        return self.comm_dtype or p.dtype, p.device

    def reduce(self, backend: Backend, params: list[torch.Tensor], labels: Callable[[], list[str]]) -> None:
        """Make every parameter's ``.grad`` the ``op`` of all ranks' gradients (a sparse one becomes dense)."""
        backend._enter(self.caller)  # one thread at a time: the reduction is several collectives
        try:
            self._plan(backend, params, labels)
            self._reduce(backend, params)
        finally:
            backend._leave()

    def _reduce(self, backend: Backend, params: list[torch.Tensor]) -> None:
        n = len(params)
        # Flags first, at the head of the flag dtype's bucket: 1 where this rank has a gradient.
        flags = self._buckets[self._flag_key][:n]
        flags.copy_(torch.tensor([p.grad is not None for p in params], dtype=self._flag_key[0]))
        for i, flat, shaped in self._slots:
            g = params[i].grad
            if g is None:
                flat.zero_()
            elif g.layout != torch.strided:  # sparse: densify into the slot
                shaped.copy_(g.to_dense())
            elif not _is_slice(g, flat):  # a fresh gradient: copy it in once
                flat.copy_(g.reshape(-1))
        for d, bucket in self._buckets.items():
            if d == self._flag_key and self._flags_op is not self.op:
                allreduce(backend, bucket[:n], self._flags_op)
                if bucket.numel() > n:
                    allreduce(backend, bucket[n:], self.op)
            else:
                allreduce(backend, bucket, self.op)
        somebody = (flags > 0).tolist()
        for i, flat, shaped in self._slots:
            p = params[i]
            if not somebody[i]:
                continue
            g = p.grad
            if shaped.dtype != p.dtype:  # compressed on the wire: cast back
                if g is None or g.layout != torch.strided:
                    p.grad = shaped.to(p.dtype, copy=True)
                else:
                    g.copy_(shaped)
            elif g is None or g.layout != torch.strided or not _is_slice(g, flat):
                p.grad = shaped  # from now on backward accumulates straight into the bucket
        for i in self._large:
            p = params[i]
            if not somebody[i]:
                continue
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            elif p.grad.layout != torch.strided:
                p.grad = p.grad.to_dense()
            g = p.grad
            if g.is_contiguous():
                allreduce(backend, g, self.op)
            else:
                g.copy_(allreduce(backend, g.contiguous(), self.op))


def _describe(params: list[torch.Tensor], labels: list[str]) -> list[tuple[str, str]]:
    """(name, description) of each parameter, for the message naming a difference."""
    return [(label, f"{tuple(p.shape)} {p.dtype} on {p.device.type}") for p, label in zip(params, labels, strict=True)]


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks}"


def _grouped(column: list[Any]) -> str:
    """``column[r]`` is rank r's value: 'v1 on rank(s) [..], v2 on rank(s) [..]'."""
    groups: dict[str, list[int]] = {}
    for r, v in enumerate(column):
        groups.setdefault(repr(v) if not isinstance(v, str) else v, []).append(r)
    return ", ".join(f"{v} on {_ranks(rs)}" for v, rs in groups.items())


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


def _is_slice(grad: torch.Tensor, flat: torch.Tensor) -> bool:
    """Whether ``grad`` is already the bucket slice ``flat`` (then nothing needs copying)."""
    return grad.data_ptr() == flat.data_ptr() and grad.dtype == flat.dtype and grad.is_contiguous()


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
_REDUCERS: weakref.WeakKeyDictionary[Backend, dict[tuple[ReduceOp, int], _GradientReducer]] = (
    weakref.WeakKeyDictionary()
)
_REDUCERS_LOCK = threading.Lock()


def allreduce_gradients(
    backend: Backend,
    module_or_params: torch.nn.Module | Iterable[torch.Tensor],
    op: Any = ReduceOp.AVG,
    *,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
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
    key = (resolve_op(op), _check_bucket_bytes(bucket_bytes))
    params, labels = _params_of(module_or_params)
    with _REDUCERS_LOCK:
        reducers = _REDUCERS.setdefault(backend, {})
        if key not in reducers:
            reducers[key] = _GradientReducer("allreduce_gradients", *key, None)
        reducer = reducers[key]
    reducer.reduce(backend, params, lambda: labels)


class DistributedOptimizer(torch.optim.Optimizer):
    """Wraps a torch optimizer: ``step()`` reduces gradients across ranks, then steps.

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
        bucket_bytes: gradients smaller than this travel together in one flat bucket
            per dtype; larger ones are reduced in place (default 256 KiB).
        communication_dtype: ``torch.bfloat16`` or ``torch.float16`` to send gradients
            in half precision (reduced in float32 where the transport cannot reduce
            halves, then cast back); None keeps each gradient's dtype.

    Example:
        >>> model = dml.synchronize(backend, torch.nn.Linear(4, 1))
        >>> opt = dml.DistributedOptimizer(backend, torch.optim.Adam(model.parameters()))
        >>> opt = dml.synchronize(backend, opt)
        >>> opt.zero_grad()
        >>> model(torch.ones(2, 4)).sum().backward()
        >>> opt.step()  # averages the gradients over all ranks, then steps
    """

    def __init__(
        self,
        backend: Backend,
        optimizer: torch.optim.Optimizer,
        *,
        op: Any = ReduceOp.AVG,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        communication_dtype: torch.dtype | None = None,
    ) -> None:
        check_backend(backend, "DistributedOptimizer")
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(
                f"optimizer: got {type(optimizer).__qualname__}; allowed: a torch.optim.Optimizer, "
                "e.g. dml.DistributedOptimizer(backend, torch.optim.SGD(model.parameters(), lr=0.1))"
            )
        if isinstance(optimizer, DistributedOptimizer):
            raise TypeError("optimizer: already a DistributedOptimizer; wrap the plain optimizer once")
        if isinstance(optimizer, torch.optim.SparseAdam):
            raise TypeError(
                "optimizer: got torch.optim.SparseAdam, which needs sparse gradients; DistributedOptimizer reduces "
                "sparse gradients as dense tensors (like Horovod's sparse_as_dense=True) and leaves .grad dense. "
                "Use an optimizer that accepts dense gradients, e.g. torch.optim.Adam"
            )
        self._backend = backend
        self._reducer = _GradientReducer("DistributedOptimizer", op, bucket_bytes, communication_dtype)
        self.optimizer = optimizer
        self._synchronized = False
        self._no_sync = False
        # While a synchronize()'d step is pending: hooks noticing a backward() that accumulates
        # into the reduced gradients, and whether one did on this rank.
        self._late_hooks: list[Any] = []
        self._late = False
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
        """Add a parameter group to the wrapped optimizer (every rank must add the same)."""
        self.optimizer.add_param_group(param_group)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear gradients (the wrapped optimizer's ``zero_grad``)."""
        self._end_pending_step()
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def __repr__(self) -> str:
        return f"DistributedOptimizer(op={self._reducer.op!r}, optimizer={self.optimizer!r})"

    def __getstate__(self) -> dict[str, Any]:
        raise TypeError("DistributedOptimizer holds a backend and cannot be pickled; save state_dict() instead")

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

    def _reduce(self, params: list[torch.Tensor]) -> None:
        self._reducer.reduce(self._backend, params, self._labels)

    def synchronize(self) -> None:
        """Reduce the gradients now (before clipping or AMP unscaling); ``step()`` then won't reduce again.

        In-place edits of ``.grad`` between ``synchronize()`` and ``step()`` are what it is
        for. A ``backward()`` that accumulates into the gradients in between is noticed:
        with ``dml.AVG`` the gradients are reduced again at the next ``step()`` or
        ``synchronize()`` (exact: the average of avg(g1) + g2 is avg(g1) + avg(g2)) with a
        ``RuntimeWarning``; with another op that would be wrong, so every rank raises
        ``RuntimeError``. Call ``synchronize()`` after the step's last ``backward()``.
        """
        params = self._params()
        if self._synchronized and not self._reduce_again("synchronize()"):
            return
        self._reduce(params)
        self._synchronized = True
        self._late = False
        if not self._late_hooks:
            self._late_hooks = [p.register_post_accumulate_grad_hook(self._late_backward) for p in params]

    def _late_backward(self, param: torch.Tensor) -> None:
        """Autograd hook, armed after synchronize(): a backward accumulated into ``param.grad``."""
        self._late = True

    def _end_pending_step(self) -> None:
        self._synchronized = False
        self._late = False
        for handle in self._late_hooks:
            handle.remove()
        self._late_hooks = []

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
            f"on {_ranks(ranks)}"
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
        """Accumulate gradients locally: inside, ``step()`` does not reduce (like Horovod's
        ``skip_synchronize``). Backward passes inside add up; the next ``step()`` outside
        reduces the sum once.
        """
        previous, self._no_sync = self._no_sync, True
        try:
            yield
        finally:
            self._no_sync = previous

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Reduce gradients across ranks (unless done already or inside ``no_sync``), then step.

        With a ``closure`` (``torch.optim.LBFGS``), the gradients are reduced after every call
        of the closure instead, and the loss it returns is reduced with ``op`` too, so every
        rank takes the same decisions.
        """
        for hook in list(self._optimizer_step_pre_hooks.values()):
            hook(self, (), {})
        if closure is not None:
            self._end_pending_step()
            result = self.optimizer.step(self._reducing(closure))
        else:
            if not self._no_sync and (not self._synchronized or self._reduce_again("step()")):
                self._reduce(self._params())
            self._end_pending_step()
            result = self.optimizer.step()
        for hook in list(self._optimizer_step_post_hooks.values()):
            hook(self, (), {})
        return result

    def _reducing(self, closure: Callable[[], Any]) -> Callable[[], Any]:
        """``closure`` followed by the reduction of the gradients and of the loss it returns."""

        def reduced() -> Any:
            loss = closure()
            if self._no_sync:
                return loss
            self._reduce(self._params())
            if loss is None:
                return None
            if isinstance(loss, torch.Tensor):
                value = loss.detach().clone() if loss.dtype.is_floating_point else loss.detach().double()
                return allreduce(self._backend, value, self._reducer.op)
            return float(allreduce(self._backend, np.array(float(loss)), self._reducer.op))

        return reduced
