"""``ShardedOptimizer.clip_grad_norm_``: torch's ``clip_grad_norm_`` on gradients whose reduced values are sharded.

Each rank holds the reduced gradients of its own pieces only, so the norm is summed from every rank's pieces (one
small allreduce) and each rank scales its own pieces. A mixin of :class:`distutils_ml.sharded.ShardedOptimizer`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch.utils._foreach_utils import _device_has_foreach_support

from distutils_ml.backends.base import ReduceOp
from distutils_ml.collectives import allreduce

__all__ = ["ShardedClipping"]


class ShardedClipping:
    """The clipping of a sharded optimizer (uses its ``_pieces``, ``_params``, ``_backend``, ``_no_sync``,
    ``synchronize``, ``_adopt_replaced``)."""

    _pieces: list[Any]
    _params: list[torch.Tensor]
    _backend: Any
    _no_sync: bool
    synchronize: Callable[[], None]
    _adopt_replaced: Callable[[], None]

    def clip_grad_norm_(
        self,
        max_norm: float,
        norm_type: float = 2.0,
        error_if_nonfinite: bool = False,
        foreach: bool | None = None,
    ) -> torch.Tensor:
        """Clip the gradients by their global norm: ``torch.nn.utils.clip_grad_norm_`` on the reduced gradients.

        The norm is what ``torch.nn.utils.clip_grad_norm_`` returns on one process for the full
        reduced gradients (those of ``shard_state=False`` after ``backward()``), up to rounding
        (each rank sums its pieces' p-th powers in float64; one small allreduce): NaN if any element
        is NaN, inf if one is infinite and none NaN. Each rank scales its shard, the part of ``.grad``
        the step reads, by torch's factor ``min(max_norm / (norm + 1e-6), 1)``, so, as with torch, a
        NaN norm makes every gradient NaN and an infinite one zeroes the finite ones. Call it on every
        rank, after the step's last ``backward()`` and before ``step()``. Gradients no backward
        reduced (accumulated inside ``no_sync()``, or set by hand) are reduce-scattered first, as
        ``synchronize()`` and ``step()`` would; a ``.grad`` replaced after backward (``p.grad = p.grad.clamp(-1, 1)``)
        is measured and clipped as it is, as torch would.

        Args:
            max_norm: the largest norm allowed.
            norm_type: the p of the p-norm, a number > 0 (``float("inf")`` for the largest magnitude).
            error_if_nonfinite: raise torch's ``RuntimeError`` when the norm is NaN or infinite,
                before scaling anything; decided from the reduced norm, so on every rank alike.
            foreach: as torch's: None uses the foreach kernels where the device has them, True
                requires them (``RuntimeError`` where it has none), False loops over the tensors.

        Returns:
            The norm of the gradients before clipping, the same on every rank, as torch returns it: a
            0-d tensor on the device of the first parameter with a gradient, in the gradients' dtype
            (promoted across them); ``tensor(0.)`` on the CPU when no parameter has a gradient.

        Raises:
            ValueError: ``norm_type`` is not a number > 0 (before any communication).
            RuntimeError: the optimizer steps during backward (``step_during_backward=True``), or
                called inside ``no_sync()``, where the gradients are not reduced (before any
                communication); or ``error_if_nonfinite`` and the norm is not finite (on every rank).

        Example:
            >>> model = torch.nn.Linear(4, 1)
            >>> opt = dml.DistributedOptimizer(backend, torch.optim.SGD(model.parameters(), lr=0.1), shard_state=True)
            >>> model(torch.ones(2, 4)).sum().backward()
            >>> norm = opt.clip_grad_norm_(1.0)  # the norm of the averaged gradients, from every rank's shard
            >>> opt.step()
        """
        max_norm, norm_type = float(max_norm), float(norm_type)
        if not norm_type > 0:
            raise ValueError(
                f"ShardedOptimizer.clip_grad_norm_: norm_type: got {norm_type}; allowed: a number > 0, or float('inf')"
            )
        if self._no_sync:
            raise RuntimeError(
                "ShardedOptimizer.clip_grad_norm_: called inside opt.no_sync(), where the gradients are not reduced: "
                "each rank holds its own, so there is no global norm to clip by (DDP would measure each rank's "
                "local gradients here, which a sharded gradient buffer cannot give). Call it on every rank after "
                "the step's reducing backward (the last, outside no_sync()), or after leaving no_sync(): it then "
                "reduces what was accumulated first, as step() would"
            )
        if getattr(self, "_step_during_backward", False):
            raise RuntimeError(
                "ShardedOptimizer.clip_grad_norm_: the optimizer was created with step_during_backward=True, whose "
                "backward() steps every shard as its gradients land, so clipping after it would change nothing that "
                "was stepped (refused before any communication, on every rank). Clipping to a global norm needs the "
                "whole gradient before any parameter moves: use step_during_backward=False to clip"
            )
        self.synchronize()  # reduces only what no backward reduced
        self._adopt_replaced()  # a .grad replaced since (p.grad = p.grad.clamp(...)) is what torch would measure
        inf = norm_type == float("inf")
        pieces: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
        for pc in self._pieces:
            if pc.grad is not None and self._params[pc.index].grad is not None:
                pieces.setdefault((pc.grad.device, pc.grad.dtype), []).append(pc.grad)
        with torch.no_grad():
            local = _local_norm(pieces, norm_type, foreach)
        allreduce(self._backend, local, ReduceOp.MAX if inf else ReduceOp.SUM)
        total = float("nan") if local[1] > 0 else float(local[0]) if inf else float(local[0]) ** (1.0 / norm_type)
        grads = [p.grad for p in self._params if p.grad is not None]
        if not grads:
            return torch.tensor(total)
        dtype = grads[0].dtype
        for g in grads[1:]:
            dtype = torch.promote_types(dtype, g.dtype)
        norm = torch.tensor(total, dtype=dtype)
        if error_if_nonfinite and not np.isfinite(total):
            raise RuntimeError(
                f"The total norm of order {norm_type} for gradients from `parameters` is non-finite, so it cannot be "
                "clipped. To disable this error and scale the gradients by the non-finite norm anyway, set "
                "`error_if_nonfinite=False`"
            )
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)  # as torch computes it, in the norm's dtype
        if coef.item() != 1.0:  # NaN included
            with torch.no_grad():
                for (device, _), tensors in pieces.items():
                    factor = coef.to(device)
                    if _use_foreach(foreach, device):
                        torch._foreach_mul_(tensors, factor)
                    else:
                        for t in tensors:
                            t.mul_(factor)
        return norm.to(grads[0].device)


def _local_norm(
    pieces: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]], norm_type: float, foreach: bool | None
) -> np.ndarray:
    """This rank's part of the ``norm_type``-norm of ``pieces`` (grouped by device and dtype), in float64: the sum
    of their p-th powers (for inf, the largest magnitude) without the NaNs, and how many pieces hold a NaN.

    Kept apart so that a reduction never meets a NaN (MPI's MAX may drop one); one device synchronization per
    device."""
    inf = norm_type == float("inf")
    local = np.zeros(2, dtype=np.float64)
    for (device, _), tensors in pieces.items():
        if _use_foreach(foreach, device):
            norms = torch.stack(torch._foreach_norm(tensors, norm_type, dtype=torch.float64))
        else:
            norms = torch.stack([torch.linalg.vector_norm(t, norm_type, dtype=torch.float64) for t in tensors])
        nan = norms.isnan()
        norms = norms.masked_fill(nan, 0.0)
        part = norms.max() if inf else norms.pow(norm_type).sum()
        value, nans = torch.stack([part, nan.sum().double()]).cpu().tolist()
        local[0] = max(local[0], value) if inf else local[0] + value
        local[1] += nans
    return local


def _use_foreach(foreach: bool | None, device: torch.device) -> bool:
    """Whether torch's clipping would use the foreach kernels for tensors on ``device``, given its ``foreach``
    (None: where the device has them); its ``RuntimeError`` where ``foreach=True`` cannot."""
    supported = _device_has_foreach_support(device)
    if foreach and not supported:
        raise RuntimeError(f"foreach=True was passed, but can't use the foreach API on {device.type} tensors")
    return supported if foreach is None else foreach
