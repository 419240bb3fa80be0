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
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from distutils_ml.backends.base import Backend, ReduceOp, check_backend, resolve_op
from distutils_ml.collectives import allreduce

__all__ = ["DistributedOptimizer", "allreduce_gradients"]

DEFAULT_BUCKET_BYTES = 256 * 1024
_COMM_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


class _GradientReducer:
    """Reduces the gradients of a fixed list of parameters across ranks."""

    def __init__(self, backend: Backend, op: Any, bucket_bytes: int, communication_dtype: torch.dtype | None) -> None:
        check_backend(backend, "DistributedOptimizer")
        self.backend = backend
        self.op = resolve_op(op)
        if isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, int) or bucket_bytes < 0:
            raise ValueError(f"bucket_bytes: got {bucket_bytes!r}; allowed: an int >= 0")
        self.bucket_bytes = bucket_bytes
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

    def _plan(self, params: list[torch.Tensor]) -> None:
        key = tuple((id(p), p.dtype, p.shape) for p in params)
        if key == self._plan_key:
            return
        for p in params:
            if p.is_sparse or p.layout != torch.strided:
                raise TypeError("DistributedOptimizer: sparse parameters are not supported; use dense tensors")
            if not p.dtype.is_floating_point:
                raise TypeError(f"DistributedOptimizer: parameter of dtype {p.dtype}; gradients must be floating point")
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

    def _wire_dtype(self, p: torch.Tensor) -> tuple[torch.dtype, torch.device]:
        """The bucket a small gradient travels in: its wire dtype and its device."""
        return self.comm_dtype or p.dtype, p.device

    def reduce(self, params: list[torch.Tensor]) -> None:
        """Make every parameter's ``.grad`` the ``op`` of all ranks' gradients."""
        self._plan(params)
        n = len(params)
        # Flags first, at the head of the flag dtype's bucket: 1 where this rank has a gradient.
        flags = self._buckets[self._flag_key][:n]
        flags.copy_(torch.tensor([p.grad is not None for p in params], dtype=self._flag_key[0]))
        for i, flat, _ in self._slots:
            g = params[i].grad
            if g is None:
                flat.zero_()
            elif not _is_slice(g, flat):  # a fresh gradient: copy it in once
                flat.copy_(g.reshape(-1))
        for d, bucket in self._buckets.items():
            if d == self._flag_key and self._flags_op is not self.op:
                allreduce(self.backend, bucket[:n], self._flags_op)
                if bucket.numel() > n:
                    allreduce(self.backend, bucket[n:], self.op)
            else:
                allreduce(self.backend, bucket, self.op)
        somebody = (flags > 0).tolist()
        for i, flat, shaped in self._slots:
            p = params[i]
            if not somebody[i]:
                continue
            if shaped.dtype != p.dtype:  # compressed on the wire: cast back
                if p.grad is None:
                    p.grad = shaped.to(p.dtype, copy=True)
                else:
                    p.grad.copy_(shaped)
            elif p.grad is None or not _is_slice(p.grad, flat):
                p.grad = shaped  # from now on backward accumulates straight into the bucket
        for i in self._large:
            p = params[i]
            if not somebody[i]:
                continue
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            g = p.grad
            if g.is_contiguous():
                allreduce(self.backend, g, self.op)
            else:
                g.copy_(allreduce(self.backend, g.contiguous(), self.op))


def _is_slice(grad: torch.Tensor, flat: torch.Tensor) -> bool:
    """Whether ``grad`` is already the bucket slice ``flat`` (then nothing needs copying)."""
    return grad.data_ptr() == flat.data_ptr() and grad.dtype == flat.dtype and grad.is_contiguous()


def _params_of(module_or_params: torch.nn.Module | Iterable[torch.Tensor]) -> list[torch.Tensor]:
    if isinstance(module_or_params, torch.nn.Module):
        return [p for p in module_or_params.parameters() if p.requires_grad]
    if isinstance(module_or_params, torch.Tensor):
        return [module_or_params]
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
    return [p for p in params if p.requires_grad]


def allreduce_gradients(
    backend: Backend,
    module_or_params: torch.nn.Module | Iterable[torch.Tensor],
    op: Any = ReduceOp.AVG,
    *,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
) -> None:
    """Average (or ``op``) every parameter's gradient across ranks, in place.

    For training loops that keep their own optimizer. Parameters must be listed in
    the same order on every rank (a module's ``parameters()`` are).

    Example:
        >>> model = torch.nn.Linear(4, 1)
        >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> model(torch.ones(2, 4)).sum().backward()
        >>> dml.allreduce_gradients(backend, model)  # every .grad is now the average over ranks
        >>> opt.step()
    """
    params = _params_of(module_or_params)
    _GradientReducer(backend, op, bucket_bytes, None).reduce(params)


class DistributedOptimizer(torch.optim.Optimizer):
    """Wraps a torch optimizer: ``step()`` reduces gradients across ranks, then steps.

    It is a ``torch.optim.Optimizer`` itself (LR schedulers and ``isinstance`` accept
    it) and forwards ``zero_grad``, ``param_groups``, ``state``, ``state_dict``,
    ``load_state_dict`` and ``add_param_group`` to the wrapped optimizer.

    Args:
        backend: from ``dml.get_distributed_backend``.
        optimizer: any ``torch.optim.Optimizer``.
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
        self._reducer = _GradientReducer(backend, op, bucket_bytes, communication_dtype)
        self.optimizer = optimizer
        self._synchronized = False
        self._no_sync = False
        # Hook tables of torch.optim.Optimizer, so register_step_pre_hook / register_step_post_hook
        # work on the wrapper (its state_dict hooks are forwarded to the wrapped optimizer, below).
        self._optimizer_step_pre_hooks: OrderedDict[int, Callable] = OrderedDict()
        self._optimizer_step_post_hooks: OrderedDict[int, Callable] = OrderedDict()

    @property
    def backend(self) -> Backend:
        """The backend gradients are reduced over."""
        return self._reducer.backend

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
        self._synchronized = False
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def __repr__(self) -> str:
        return f"DistributedOptimizer(op={self._reducer.op!r}, optimizer={self.optimizer!r})"

    def __getstate__(self) -> dict[str, Any]:
        raise TypeError("DistributedOptimizer holds a backend and cannot be pickled; save state_dict() instead")

    # -- the distributed part ------------------------------------------------------------

    def _params(self) -> list[torch.Tensor]:
        return [p for g in self.optimizer.param_groups for p in g["params"] if p.requires_grad]

    def synchronize(self) -> None:
        """Reduce the gradients now (before clipping or AMP unscaling); ``step()`` then won't reduce again."""
        self._reducer.reduce(self._params())
        self._synchronized = True

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

    def step(self, closure: Callable[[], float] | None = None) -> Any:
        """Reduce gradients across ranks (unless done already or inside ``no_sync``), then step."""
        for hook in list(self._optimizer_step_pre_hooks.values()):
            hook(self, (), {})
        if not (self._synchronized or self._no_sync):
            self._reducer.reduce(self._params())
        self._synchronized = False
        result = self.optimizer.step(closure) if closure is not None else self.optimizer.step()
        for hook in list(self._optimizer_step_post_hooks.values()):
            hook(self, (), {})
        return result
