"""``broadcast_buffers``: root's module buffers in every replica before a forward, as DDP does.

``torch.nn.parallel.DistributedDataParallel`` (``broadcast_buffers=True``, its default)
copies rank 0's buffers (BatchNorm's running statistics, ...) into every replica
before a forward pass when the previous forward ran with gradients enabled, or it is
the first one. So within a training loop every forward starts from rank 0's buffers,
and the first forward of an evaluation under ``torch.no_grad()`` syncs once, after
which evaluation runs on the same buffers on every rank. :func:`broadcast_buffers`
gives a module that behaviour, with the buffers fused into one broadcast per dtype.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from distutils_ml.agreement import agree
from distutils_ml.backends.base import Backend, check_backend
from distutils_ml.collectives import check_root
from distutils_ml.fused_broadcast import FusedBroadcast
from distutils_ml.objects import digest, exclusive
from distutils_ml.tree import array_spec, refuse_sync_batchnorm, sync_batchnorm_refused

__all__ = ["BufferBroadcast", "broadcast_buffers"]

_DIFFERS = "hold buffers that differ from"
_FIX = "Every rank must pass the same module (buffer names, shapes, dtypes and device types)"


class BufferBroadcast:
    """The handle :func:`broadcast_buffers` returns: ``remove()`` stops the broadcasts."""

    def __init__(self, backend: Backend, module: torch.nn.Module, root: int) -> None:
        self._backend = backend
        self._module = module
        self._root = root
        # DDP's ``require_forward_param_sync``: True before the first forward, then whether the
        # previous forward ran with gradients enabled.
        self._pending = True
        self._has_buffers = self._sync(send=False)  # agreed on every rank
        self._hooks = [module.register_forward_pre_hook(self._pre_forward), module.register_forward_hook(self._post)]

    @property
    def root(self) -> int:
        """The rank whose buffers are broadcast (``dml.join`` moves it to a rank that still has data)."""
        return self._root

    @root.setter
    def root(self, value: int) -> None:
        self._root = check_root(self._backend, value)

    def remove(self) -> None:
        """Stop broadcasting the module's buffers (removes both forward hooks)."""
        for hook in self._hooks:
            hook.remove()
        self._hooks = []

    def _pre_forward(self, module: torch.nn.Module, args: Any) -> None:
        if self._pending and self._has_buffers:
            self._sync(send=True)

    def _post(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        self._pending = torch.is_grad_enabled()

    def _sync(self, *, send: bool) -> bool:
        """Agree on the buffers across ranks, then (``send``) broadcast root's; return whether there are any."""
        backend = self._backend
        with exclusive(backend, "broadcast_buffers"):
            # rank root's buffers; inside dml.join, once root has joined, a rank with data's
            root = backend.acting_root(self._root)
            is_root = backend.rank == root
            failure: Exception | None = None
            listing: list[tuple[Any, ...]] = []
            buffers: list[torch.Tensor] = []
            try:
                if sync_batchnorm_refused(backend):
                    refuse_sync_batchnorm(self._module, "module", "broadcast_buffers")
                for name, buf in self._module.named_buffers():
                    listing.append((f"module.{name}", *array_spec(buf, f"module.{name}")))
                    buffers.append(buf)
                fused = FusedBroadcast(buffers, [e[0] for e in listing], [e[1:] for e in listing], is_root)
            except Exception as e:  # reported through the agreement: every rank raises
                failure = e
            signature = digest(repr(listing))
            agree(
                backend,
                "broadcast_buffers",
                root,
                failure,
                signature=signature,
                listing=listing,
                differs=_DIFFERS,
                fix=_FIX,
            )
            if send and buffers:
                try:
                    with torch.no_grad(), _preserve_versions(tuple(buffers)):
                        fused.run(backend, root)
                except Exception as e:
                    backend._abort(
                        f"broadcast_buffers: rank {backend.rank} failed after every rank agreed to go on "
                        f"({type(e).__name__}: {e}); the replicas' buffers may now differ"
                    )
        return bool(buffers)


def _preserve_versions(tensors: tuple[torch.Tensor, ...]) -> contextlib.AbstractContextManager[Any]:
    """Hide the in-place writes from autograd's version counters, as DDP does (torch >= 2.2)."""
    preserve = getattr(torch.autograd, "_unsafe_preserve_version_counter", None)
    return contextlib.nullcontext() if preserve is None else preserve(tensors)


def broadcast_buffers(backend: Backend, module: torch.nn.Module, *, root: int = 0) -> BufferBroadcast:
    """Copy root's buffers into every replica of ``module`` before its forward passes, as DDP does.

    Follows ``DistributedDataParallel``'s rule (``broadcast_buffers=True``): the buffers
    (BatchNorm's running statistics, ...) are broadcast from ``root`` before a forward
    when the previous forward ran with gradients enabled, or it is the first one. So
    during training every forward starts from root's buffers, and the first forward of
    an evaluation under ``torch.no_grad()`` syncs once; evaluation then runs on the same
    buffers everywhere, and matches DDP's bit for bit. The buffers travel fused, one
    broadcast per dtype. A module without buffers costs nothing per forward.

    Every rank must call it, and then run the module's forward passes in the same order
    (each sync is a collective). Unlike DDP's ``no_sync()``, gradient accumulation does
    not skip a sync: this hook does not know about it.

    Args:
        backend: from ``dml.get_distributed_backend``.
        module: the model (the same structure on every rank).
        root: the rank whose buffers every rank gets (DDP uses rank 0).

    Returns:
        A handle; ``handle.remove()`` stops the broadcasts.

    Raises:
        TypeError: ``module`` is not a ``torch.nn.Module`` (before any communication),
            or holds a buffer no collective can send (on every rank).
        ValueError: the ranks' buffers differ (names, shapes, dtypes, device types),
            raised on every rank, here and at any later forward that syncs.
        RuntimeError: ``module`` holds a ``torch.nn.SyncBatchNorm`` in a world of several
            ranks without a ``torch.distributed`` process group (on every rank).

    Example:
        >>> model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
        >>> handle = dml.broadcast_buffers(backend, model)
        >>> _ = model(torch.randn(8, 3))  # rank 0's running statistics everywhere first
        >>> handle.remove()
    """
    check_backend(backend, "broadcast_buffers")
    if not isinstance(module, torch.nn.Module):
        raise TypeError(
            f"module: got {type(module).__module__}.{type(module).__qualname__}; allowed: a torch.nn.Module"
        )
    root = check_root(backend, root)
    return BufferBroadcast(backend, module, root)
