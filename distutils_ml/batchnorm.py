"""``SyncBatchNorm``: batch normalization over the batches of every rank, and the allreduce it needs.

``torch.nn.SyncBatchNorm`` reduces its statistics over a ``torch.distributed`` process
group. :class:`SyncBatchNorm` does the same over a backend, as torch does: each rank
computes its per-channel element count, mean and variance (``torch.var_mean``, a
numerically stable pass over its batch), one ``allgather`` brings every rank's triple
to every rank, and each rank combines the same table with Chan et al.'s parallel
formula (global mean ``sum(n_r m_r) / N``, variance ``sum(n_r (v_r + (m_r - mean)^2)) / N``),
so every rank gets the same bits. Sums of ``x`` and ``x * x`` would lose the variance to
cancellation when a channel's mean is large next to its spread. The combination is a
``torch.autograd.Function`` whose backward makes one allreduce of the ranks' gradients of
the global statistics (:func:`allreduce_autograd`, differentiable itself); autograd
derives the rest of the backward pass, to any order.
"""

from __future__ import annotations

import copy
from typing import Any

import torch

from distutils_ml.backends.base import Backend, ReduceOp, check_backend, resolve_op
from distutils_ml.collectives import allgather, allreduce
from distutils_ml.joined import joined_ranks_send_zeros
from distutils_ml.objects import allgather_object

__all__ = ["SyncBatchNorm", "allreduce_autograd", "convert_sync_batchnorm"]


#: The numbers before a rank's statistics in the allgathered table: its count, a failure flag, their dtype (1 float32,
#: 2 float64; 0 from a rank that has joined, dml.join).
_HEAD = 3
_HALVES = (torch.float16, torch.bfloat16)


class _AllReduce(torch.autograd.Function):
    """``allreduce`` of a copy of the input; its backward is the same reduction of the gradient."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, backend: Backend, op: ReduceOp) -> torch.Tensor:
        ctx.backend, ctx.op = backend, op
        return allreduce(backend, tensor.detach().clone(memory_format=torch.contiguous_format), op)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        # d(sum_s y_s)/dx_r summed over every rank's loss: the same reduction of the incoming gradients.
        # Applied through the Function again, so a double backward differentiates it too.
        return _AllReduce.apply(grad, ctx.backend, ctx.op), None, None


def allreduce_autograd(backend: Backend, tensor: torch.Tensor, op: Any = ReduceOp.SUM) -> torch.Tensor:
    """An ``allreduce`` that autograd differentiates: returns the reduction of ``tensor`` over the ranks.

    The input is not modified: the result is a new tensor, on the input's device. Its gradient is the same
    reduction of the incoming gradients, made during ``backward()``, so every rank must
    run a backward pass through the result, in the same order as the forward calls.
    With a loss that is the sum of the ranks' losses, ``SUM``'s gradient is exact;
    ``AVG`` is ``SUM`` divided by the number of ranks, forward and backward.

    Args:
        backend: from ``dml.get_distributed_backend``.
        tensor: a torch tensor (CPU or CUDA) of the same shape and dtype on every rank.
        op: ``dml.SUM`` or ``dml.AVG`` (or ``"sum"``, ``"avg"``, ``operator.add``).

    Returns:
        The reduced tensor, attached to ``tensor``'s autograd graph.

    Raises:
        TypeError: ``backend`` is not a backend instance or ``tensor`` not a torch tensor.
        ValueError: ``op`` is not a sum or an average (before any communication).

    Example:
        >>> x = torch.tensor([1.0, 2.0], requires_grad=True)
        >>> y = dml.allreduce_autograd(backend, x, dml.SUM)  # in a world of one: a copy
        >>> y.mul(3).sum().backward()
        >>> x.grad
        tensor([3., 3.])
    """
    check_backend(backend, "allreduce_autograd")
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(
            f"allreduce_autograd: tensor: got {type(tensor).__module__}.{type(tensor).__qualname__}; "
            "allowed: a torch.Tensor (use dml.allreduce for NumPy or CuPy arrays)"
        )
    resolved = resolve_op(op)
    if resolved not in (ReduceOp.SUM, ReduceOp.AVG):
        raise ValueError(
            f"allreduce_autograd: op: got {op!r}; allowed: dml.SUM or dml.AVG (a reduction whose gradient is "
            "the same reduction of the gradients); use dml.allreduce outside autograd for the others"
        )
    if tensor.device.type == "cpu" or backend.takes_device_buffers:
        return _AllReduce.apply(tensor, backend, resolved)
    # The backend stages device buffers through the host anyway: stage them in the graph, so the
    # backward collective runs on the thread that called backward(), not on autograd's device thread
    # (which every LocalBackend rank of the process shares: a collective blocking it would deadlock).
    return _AllReduce.apply(tensor.cpu(), backend, resolved).to(tensor.device)


class _GlobalMoments(torch.autograd.Function):
    """The global batch's mean and biased variance per channel, from every rank's (count, mean, variance)."""

    @staticmethod
    def forward(  # noqa: PLR0917 - private; autograd passes the inputs positionally
        ctx: Any, mean: torch.Tensor, var: torch.Tensor, table: torch.Tensor, count: int, total: int, backend: Backend
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # table: every rank's row [count, failure flag, float64?, mean, variance], the same on every rank (this
        # rank's row holds mean and var). Only the table enters the result, so every rank computes the same bits.
        c = mean.numel()
        counts, means, variances = table[:, :1], table[:, _HEAD : _HEAD + c], table[:, _HEAD + c :]
        glob = (counts * means).sum(0) / total
        glob_var = (counts * (variances + (means - glob) ** 2)).sum(0) / total
        ctx.save_for_backward(mean, glob)
        ctx.backend, ctx.share = backend, count / total
        return glob, glob_var

    @staticmethod
    def backward(ctx: Any, grad_mean: torch.Tensor, grad_var: torch.Tensor) -> tuple[Any, ...]:
        # Every rank's loss depends on this rank's (mean, var) through the global statistics only, whose
        # derivatives with respect to this rank's row are the same on every rank: sum the ranks' gradients
        # of the global statistics (one allreduce, differentiable for a double backward), then apply them:
        # d glob / d mean = share, d glob_var / d mean = 2 share (mean - glob), d glob_var / d var = share.
        mean, glob = ctx.saved_tensors
        g_mean, g_var = allreduce_autograd(ctx.backend, torch.cat([grad_mean, grad_var]), ReduceOp.SUM).chunk(2)
        return ctx.share * (g_mean + 2 * (mean - glob) * g_var), ctx.share * g_var, None, None, None, None


class SyncBatchNorm(torch.nn.modules.batchnorm._BatchNorm):
    """Batch normalization whose batch statistics cover every rank's batch.

    In training (and whenever running statistics are not tracked), the mean and
    variance per channel are those of the global batch: the concatenation of every
    rank's input along dimension 0. Each forward makes one allgather of
    ``2 * num_features + 3`` float64 numbers per rank (the rank's element count, a failure flag,
    the statistics' dtype, its per-channel means and variances, which every rank combines with Chan et al.'s
    parallel formula: accurate for channel means far from zero too), and its backward
    pass one allreduce of ``2 * num_features``; the ranks may hold batches of different
    sizes, 0 included. ``running_mean``, ``running_var`` and
    ``num_batches_tracked`` change as ``torch.nn.BatchNorm`` would on the global batch
    (unbiased variance, ``momentum=None`` for a cumulative average). In eval mode with
    running statistics it is plain BatchNorm: no communication. In a world of one it
    is ``torch.nn.BatchNorm`` itself.

    Every rank must call every forward that synchronizes, and run a backward pass
    through its output, in the same order (they are collectives). Inputs of
    ``(N, C)``, ``(N, C, L)``, ``(N, C, H, W)`` or ``(N, C, D, H, W)``; statistics are
    computed in float32 at least (float64 inputs in float64), the output has the
    input's dtype. As ``torch.nn.BatchNorm``, a layer with parameters or buffers takes inputs of their
    dtype, or float16 / bfloat16 inputs with float32 ones (a layer with neither takes any floating
    dtype, the same on every rank). A bad input on one rank (dimensions, channels, dtype, device) makes
    every rank raise, with the running statistics unchanged.

    Prefer :func:`convert_sync_batchnorm` to convert an existing model. A model holding
    one deep-copies (the copy shares the backend) but cannot be pickled: save its
    ``state_dict()``, which is a BatchNorm's.

    Args:
        backend: from ``dml.get_distributed_backend``.
        num_features: the number of channels ``C`` (dimension 1 of the input).
        eps: as ``torch.nn.BatchNorm2d``.
        momentum: as ``torch.nn.BatchNorm2d`` (None: cumulative average).
        affine: as ``torch.nn.BatchNorm2d``.
        track_running_stats: as ``torch.nn.BatchNorm2d``.
        device: as ``torch.nn.BatchNorm2d``.
        dtype: as ``torch.nn.BatchNorm2d``.
        bias: whether an affine layer has a bias (as ``torch.nn.BatchNorm2d(bias=...)``).

    Raises:
        TypeError: ``backend`` is not a backend instance.

    Example:
        >>> bn = dml.SyncBatchNorm(backend, 3)
        >>> bn(torch.tensor([[0.0, 1.0, 2.0], [2.0, 3.0, 6.0]]))
        tensor([[-1.0000, -1.0000, -1.0000],
                [ 1.0000,  1.0000,  1.0000]], grad_fn=<NativeBatchNormBackward0>)
        >>> bn.running_mean
        tensor([0.1000, 0.2000, 0.4000])
    """

    def __init__(  # noqa: PLR0917 - mirrors torch.nn.BatchNorm's arguments after the backend
        self,
        backend: Backend,
        num_features: int,
        eps: float = 1e-5,
        momentum: float | None = 0.1,
        affine: bool = True,
        track_running_stats: bool = True,
        device: Any = None,
        dtype: torch.dtype | None = None,
        *,
        bias: bool = True,
    ) -> None:
        check_backend(backend, "SyncBatchNorm")
        super().__init__(num_features, eps, momentum, affine, track_running_stats, device=device, dtype=dtype)
        if affine and not bias:
            self.bias = None
        self.backend = backend

    def _check_input_dim(self, x: torch.Tensor) -> None:
        if x.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {x.dim()}D input)")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Normalize ``x`` by the statistics of the global batch (training) or the running ones (eval)."""
        batch_stats = self.training or (self.running_mean is None and self.running_var is None)
        if not batch_stats or self.backend.size == 1:
            return super().forward(x)
        return self._synchronized(x)

    def _synchronized(self, x: torch.Tensor) -> torch.Tensor:
        c = self.num_features
        failure = self._local_failure(x)
        if failure is None:
            work = x.to(torch.float64 if x.dtype == torch.float64 else torch.float32)
            dims = [0, *range(2, x.dim())]
            shape = [1, c] + [1] * (x.dim() - 2)
            count = x.numel() // c
            if count:  # torch's own numerically stable pass: deviations from this rank's mean
                var, mean = torch.var_mean(work, dims, correction=0)
            else:  # zeros in the graph, so that this rank takes part in the backward's collective too
                var = mean = work.sum(dims)
            # float64 on every rank (exact for float32 statistics), the statistics' dtype in the header
            wide = work.double() if work.dtype != torch.float64 else work
            head = [count, 0, 2.0 if work.dtype == torch.float64 else 1.0]  # 0: a joined rank's zeros (dml.join)
            row = torch.cat([wide.new_tensor(head), mean.detach().double(), var.detach().double()])
        else:  # a raised flag: every rank learns that some rank failed, and raises
            device, _ = self._reference()
            if device is None:  # no parameters nor buffers: where the other ranks' (valid) inputs are
                device = self._backend_device() or (x.device if isinstance(x, torch.Tensor) else torch.device("cpu"))
            row = torch.zeros(2 * c + _HEAD, device=device, dtype=torch.float64)
            row[1] = 1
        # A backend that stages device buffers through the host gets host tensors here, so that the backward's
        # collective runs on the thread that called backward() (as allreduce_autograd does).
        staged = row.device.type != "cpu" and not self.backend.takes_device_buffers
        if staged:
            row = row.cpu()
        with joined_ranks_send_zeros():  # dml.join: a rank without data contributes a count of zero
            table = allgather(self.backend, row, row.new_empty(self.backend.size, 2 * c + _HEAD))
        head = table[:, :_HEAD].tolist()
        n = sum(int(k) for k, _, _ in head)
        if any(flag for _, flag, _ in head):
            _raise_on_every_rank(self.backend, failure)
        if len({wide for _, _, wide in head if wide}) > 1:  # a layer without parameters or buffers takes any dtype
            kinds = ", ".join(f"rank {r}: {'float64' if w > 1 else 'float32'}" for r, (_, _, w) in enumerate(head) if w)
            raise TypeError(
                f"SyncBatchNorm: the ranks' inputs give statistics of different dtypes ({kinds}); every rank must "
                "pass inputs of the same dtype (float64, or float32 / float16 / bfloat16)"
            )
        table = table.to(work.dtype)

        if self.training and self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
        if n == 1:
            raise ValueError(
                f"Expected more than 1 value per channel when training, got 1 over all {self.backend.size} ranks "
                f"(this rank's input size {list(x.shape)})"
            )
        if staged:
            glob, glob_var = _GlobalMoments.apply(mean.cpu(), var.cpu(), table, count, max(n, 1), self.backend)
            glob, glob_var = glob.to(work.device), glob_var.to(work.device)
        else:
            glob, glob_var = _GlobalMoments.apply(mean, var, table, count, max(n, 1), self.backend)
        y = (work - glob.view(shape)) * torch.rsqrt(glob_var + self.eps).view(shape)
        if self.weight is not None:
            y = y * self.weight.view(shape)
        if self.bias is not None:
            y = y + self.bias.view(shape)
        if self.training and self.track_running_stats and n > 0:
            self._update_running_stats(glob.detach(), glob_var.detach() * (n / (n - 1)))
        return y.to(x.dtype)

    def _local_failure(self, x: Any) -> Exception | None:
        """Why this rank cannot contribute ``x``'s statistics, or None (reported to every rank, then raised)."""
        if not isinstance(x, torch.Tensor):
            return TypeError(f"input: got {type(x).__module__}.{type(x).__qualname__}; allowed: a torch.Tensor")
        if not x.is_floating_point():
            return TypeError(f"input: dtype {x.dtype}; allowed: a floating-point tensor")
        if x.dim() < 2:
            return ValueError(f"expected at least 2D input (got {x.dim()}D input)")
        if x.shape[1] != self.num_features:
            return ValueError(
                f"input of shape {list(x.shape)} has {x.shape[1]} channels (dimension 1); "
                f"this SyncBatchNorm has num_features={self.num_features}"
            )
        held = self._held_dtype()
        if held is not None and x.dtype != held and not (held == torch.float32 and x.dtype in _HALVES):
            return TypeError(
                f"input: dtype {x.dtype}; this SyncBatchNorm's parameters and buffers are {held} (as "
                "torch.nn.BatchNorm, it takes inputs of their dtype, or float16 / bfloat16 inputs with float32 "
                "parameters)"
            )
        if self.training and self.eps <= 0:
            return ValueError(f"batch_norm eps must be positive during training, but got {self.eps}")
        device, _ = self._reference()
        if device is not None and x.device != device:
            return ValueError(f"input is on {x.device}, this SyncBatchNorm's parameters and buffers on {device}")
        gpu = self._backend_device() if device is None else None
        if gpu is not None and x.device != gpu:  # every rank's statistics must travel the same way (NCCL)
            return ValueError(f"input is on {x.device}; this SyncBatchNorm's backend works on {gpu}")
        return None

    def _held_dtype(self) -> torch.dtype | None:
        """The dtype of the parameters, else of the running statistics (None: it has neither)."""
        for t in (self.weight, self.running_mean):
            if t is not None:
                return t.dtype
        return None

    def _reference(self) -> tuple[torch.device | None, torch.dtype]:
        """The device of the parameters and buffers (None: it has none; then the input must be on the backend's GPU
        where it has one, else anywhere), and the dtype statistics of such an input use."""
        for t in (self.weight, self.running_mean):
            if t is not None:
                return t.device, torch.float64 if t.dtype == torch.float64 else torch.float32
        return None, torch.float32

    def _backend_device(self) -> torch.device | None:
        """The GPU of a backend that sends device buffers its own way (NCCL: host buffers go through MPI), else
        None (every buffer goes the same way, or through the host)."""
        gpu = getattr(self.backend, "device", None) if self.backend.takes_device_buffers else None
        return torch.device("cuda", gpu) if isinstance(gpu, int) and not isinstance(gpu, bool) else None

    def _update_running_stats(self, mean: torch.Tensor, unbiased_var: torch.Tensor) -> None:
        if self.running_mean is None or self.running_var is None:
            return
        # momentum None: a cumulative moving average, as torch.nn.BatchNorm
        factor = 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum
        with torch.no_grad():
            self.running_mean.mul_(1 - factor).add_(mean.to(self.running_mean.dtype), alpha=factor)
            self.running_var.mul_(1 - factor).add_(unbiased_var.to(self.running_var.dtype), alpha=factor)

    def __deepcopy__(self, memo: dict[int, Any]) -> SyncBatchNorm:
        memo[id(self.backend)] = self.backend  # the copy shares the backend: a communicator is not copied
        new = type(self).__new__(type(self))
        memo[id(self)] = new
        new.__dict__.update(copy.deepcopy(self.__dict__, memo))
        return new

    def __getstate__(self) -> dict[str, Any]:
        raise TypeError(
            "dml.SyncBatchNorm cannot be pickled (nor copied with copy.copy): it holds a backend, which is "
            "bound to this process's communicator. Save the model's state_dict() instead (the same keys as "
            "torch.nn.BatchNorm's), or copy.deepcopy the model (the copy shares the backend)"
        )


def _raise_on_every_rank(backend: Backend, failure: Exception | None) -> None:
    """Every rank learns which ranks failed and why (one object allgather), and raises."""
    reports = allgather_object(backend, None if failure is None else (type(failure).__name__, str(failure)))
    bad = [(rank, report) for rank, report in enumerate(reports) if report is not None]
    detail = "; ".join(f"rank {rank}: {kind}: {text}" for rank, (kind, text) in bad)
    cls = TypeError if bad[0][1][0] == "TypeError" else ValueError
    raise cls(
        f"SyncBatchNorm: rank(s) {[rank for rank, _ in bad]} cannot normalize their input, so every rank "
        f"raises (running statistics unchanged): {detail}"
    )


def convert_sync_batchnorm(backend: Backend, module: torch.nn.Module) -> torch.nn.Module:
    """Replace every BatchNorm layer of ``module`` by a :class:`SyncBatchNorm` over ``backend``.

    Like ``torch.nn.SyncBatchNorm.convert_sync_batchnorm``: every
    ``torch.nn.BatchNorm1d/2d/3d`` and ``torch.nn.SyncBatchNorm`` (any subclass of
    ``torch.nn.modules.batchnorm._BatchNorm``) becomes a ``dml.SyncBatchNorm`` holding
    the same ``weight`` and ``bias`` Parameters (the same objects, so an optimizer made
    before still steps them), the same buffers, ``eps``, ``momentum``, ``affine``,
    ``track_running_stats`` and training flag. A ``dml.SyncBatchNorm`` over this backend
    is kept as it is. Submodules are replaced in place; call it before creating the
    optimizer or ``broadcast_buffers`` handles, as with torch.

    Args:
        backend: from ``dml.get_distributed_backend``.
        module: the model.

    Returns:
        ``module`` with its BatchNorm layers replaced, or a new ``dml.SyncBatchNorm``
        if ``module`` itself is a BatchNorm layer.

    Raises:
        TypeError: ``backend`` is not a backend instance, or ``module`` not a
            ``torch.nn.Module`` (before any communication).

    Example:
        >>> model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.BatchNorm2d(8), torch.nn.ReLU())
        >>> weight = model[1].weight
        >>> model = dml.convert_sync_batchnorm(backend, model)
        >>> type(model[1]).__name__, model[1].weight is weight
        ('SyncBatchNorm', True)
    """
    check_backend(backend, "convert_sync_batchnorm")
    if not isinstance(module, torch.nn.Module):
        raise TypeError(
            f"convert_sync_batchnorm: module: got {type(module).__module__}.{type(module).__qualname__}; "
            "allowed: a torch.nn.Module"
        )
    return _convert(backend, module)


def _convert(backend: Backend, module: torch.nn.Module) -> torch.nn.Module:
    out = module
    if isinstance(module, torch.nn.modules.batchnorm._BatchNorm) and not (
        isinstance(module, SyncBatchNorm) and module.backend is backend
    ):
        out = SyncBatchNorm(
            backend, module.num_features, module.eps, module.momentum, module.affine, module.track_running_stats
        )
        if module.affine:
            out.weight = module.weight
            out.bias = module.bias
        out.running_mean = module.running_mean
        out.running_var = module.running_var
        out.num_batches_tracked = module.num_batches_tracked
        out.training = module.training
        if hasattr(module, "qconfig"):
            out.qconfig = module.qconfig
    for name, child in module.named_children():
        out.add_module(name, _convert(backend, child))
    return out
