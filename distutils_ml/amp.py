"""``ShardedGradScaler``: torch's ``GradScaler`` for the sharded optimizer, whose ranks agree on skipping a step.

With ``shard_state=True`` each rank holds the reduced gradients of its own shard only; the rest of its ``.grad``
holds its own gradients. An inf or NaN that only the reduction makes (a sum that overflows) lands in one rank's
shard, so a check of ``.grad`` on each rank alone (torch's ``GradScaler``) could skip the step on some ranks and
not on others. Here each rank checks its ``.grad`` (its reduced shard included), and one small allreduce (MAX)
gives every rank the same answer: every rank skips, or every rank steps, and ``update()`` leaves the same scale.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

import numpy as np
import torch
from torch.amp.grad_scaler import OptState

from distutils_ml.backends.base import Backend, ReduceOp, check_backend
from distutils_ml.collectives import allreduce
from distutils_ml.sharded import ShardedOptimizer

__all__ = ["ShardedGradScaler"]


class ShardedGradScaler(torch.amp.GradScaler):
    """``torch.amp.GradScaler`` for ``DistributedOptimizer(..., shard_state=True)``: every rank skips the same steps.

    Use it as torch's ``GradScaler`` (``scale``, ``unscale_``, ``step``, ``update``, ``state_dict``).
    With a sharded optimizer (``dml.ShardedOptimizer``), ``unscale_(opt)`` and ``step(opt)`` are
    **collectives: call them on every rank**, in the same order:

    - ``unscale_(opt)`` first reduces the gradients no backward reduced (as ``opt.synchronize()``
      does: those accumulated inside ``no_sync()``, or set by hand), then unscales every ``.grad``
      (this rank's reduced shard, which the step reads, and its own gradients elsewhere, so what
      you read in ``.grad`` is unscaled) and checks it for inf and NaN. One small allreduce (MAX)
      of the flags makes the verdict the same on every rank: inf/NaN anywhere in any rank's
      ``.grad``. With ``dml.AVG`` or ``dml.SUM`` that is exactly "inf/NaN in the reduced
      gradients": a rank's own inf or NaN makes the reduced element non-finite too, and an
      overflow of the reduction itself lands in the shard of the rank that owns the element,
      which sees it. (With ``dml.MAX`` / ``dml.MIN``, a rank's own inf may be dropped by the
      reduction; the step is then skipped all the same, on every rank.)
    - ``step(opt)`` unscales first if ``unscale_(opt)`` was not called this iteration, then steps
      the optimizer on every rank, or skips it on every rank. Closures are refused, as torch
      refuses them.
    - ``update()`` (no communication) leaves the same scale on every rank, since every rank saw the
      same verdict, if every optimizer stepped through this scaler is sharded or gives the same
      ``.grad`` on every rank (``dml.DistributedOptimizer``).

    With any other optimizer (``dml.DistributedOptimizer`` with ``shard_state=False``, whose
    ``.grad`` is the same on every rank after ``backward()``, or a plain torch optimizer) it is
    torch's ``GradScaler``, unchanged: no communication. Plain ``torch.amp.GradScaler`` is refused
    by the sharded optimizer (``TypeError`` from ``scaler.step(opt)`` on every rank): its check is
    each rank's own.

    As with torch's, the parameters (and so their gradients) stay float32: run the forward in
    ``torch.autocast(device, dtype=torch.float16)``. After a skipped step, clear the gradients with
    ``opt.zero_grad()`` as after any step.

    Args:
        backend: from ``dml.get_distributed_backend``; the one the sharded optimizers reduce over
            (or one with the same ranks, such as its ``duplicate()``).
        device: where the scale lives, as torch's (``"cuda"``, the default, or ``"cpu"``...);
            with ``"cuda"`` where CUDA is not available torch warns and disables scaling.
        init_scale: the first scale, a finite number > 0.
        growth_factor: the scale's factor after ``growth_interval`` steps without inf/NaN, > 1.
        backoff_factor: the scale's factor after a step with inf/NaN, in (0, 1).
        growth_interval: steps without inf/NaN before the scale grows, an int >= 1.
        enabled: False makes ``step`` call ``opt.step()`` and the rest no-ops (no communication).

    Raises:
        TypeError, ValueError: an argument of the wrong type or value (before any communication).

    Example:
        >>> model = torch.nn.Linear(4, 1)
        >>> opt = dml.DistributedOptimizer(backend, torch.optim.SGD(model.parameters(), lr=0.1), shard_state=True)
        >>> scaler = dml.ShardedGradScaler(backend, "cpu")
        >>> opt.zero_grad()
        >>> scaler.scale(model(torch.ones(2, 4)).sum()).backward()
        >>> scaler.unscale_(opt)  # on every rank: the same verdict everywhere
        >>> norm = opt.clip_grad_norm_(1.0)
        >>> scaler.step(opt)  # steps on every rank, or skips on every rank
        >>> scaler.update()  # the same scale on every rank
    """

    def __init__(  # noqa: PLR0917 - mirrors torch.amp.GradScaler's arguments after the backend
        self,
        backend: Backend,
        device: str = "cuda",
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        enabled: bool = True,
    ) -> None:
        check_backend(backend, "ShardedGradScaler")
        _check_device(device)
        _check_number("init_scale", init_scale, "a finite number > 0", lambda x: 0 < x < math.inf, "2.0**16")
        _check_number("growth_factor", growth_factor, "a finite number > 1", lambda x: 1 < x < math.inf, "2.0")
        _check_number("backoff_factor", backoff_factor, "a number in (0, 1)", lambda x: 0 < x < 1, "0.5")
        if isinstance(growth_interval, bool) or not isinstance(growth_interval, int) or growth_interval < 1:
            raise ValueError(
                f"ShardedGradScaler: growth_interval: got {growth_interval!r}; allowed: an int >= 1 (steps without "
                "inf/NaN before the scale grows); pass e.g. growth_interval=2000"
            )
        if not isinstance(enabled, bool):
            raise TypeError(f"ShardedGradScaler: enabled: got {enabled!r}; allowed: True or False")
        super().__init__(
            device,
            init_scale=float(init_scale),
            growth_factor=float(growth_factor),
            backoff_factor=float(backoff_factor),
            growth_interval=growth_interval,
            enabled=enabled,
        )
        self._backend = backend

    @property
    def backend(self) -> Backend:
        """The backend the ranks agree over."""
        return self._backend

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Unscale ``optimizer``'s gradients and check them for inf/NaN (torch's ``unscale_``).

        With a sharded optimizer, a collective: call it on every rank. Gradients no backward
        reduced are reduced first (``opt.synchronize()``); every ``.grad`` is unscaled and checked,
        and one small allreduce gives every rank the same verdict (see the class). Otherwise
        torch's ``unscale_``, unchanged.

        Raises:
            TypeError: ``optimizer`` is not a ``torch.optim.Optimizer`` (before any communication).
            ValueError: a sharded optimizer over other ranks than this scaler's backend, or with
                float16 parameters (before any communication).
            RuntimeError: torch's: ``unscale_`` called twice, or after ``step``, since the last
                ``update()`` (before any communication).
            AssertionError: torch's: no ``scaler.scale(loss)`` before (before any communication).
        """
        sharded = self._sharded(optimizer, "unscale_")
        if not self.is_enabled():
            return
        if not sharded:
            super().unscale_(optimizer)
            return
        scale, _ = self._check_scale_growth_tracker("unscale_")
        state = self._per_optimizer_states[id(optimizer)]
        if state["stage"] is OptState.UNSCALED:
            raise RuntimeError(
                "unscale_() has already been called on this optimizer since the last update(). Call it at most once "
                "per iteration, on every rank, between the step's last backward() and scaler.step(opt)"
            )
        if state["stage"] is OptState.STEPPED:
            raise RuntimeError(
                "unscale_() is being called after step(). Call scaler.unscale_(opt) before scaler.step(opt), or "
                "scaler.update() first to begin the next iteration"
            )
        optimizer.synchronize()
        super().unscale_(optimizer)
        found = state["found_inf_per_device"].values()
        local = float(torch.stack([f.to(scale.device) for f in found]).sum()) if found else 0.0
        flag = np.array([1.0 if local > 0 else 0.0])
        allreduce(self._backend, flag, ReduceOp.MAX)
        agreed = torch.full((), flag[0], dtype=torch.float32, device=scale.device)
        state["found_inf_per_device"] = {scale.device: agreed}

    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        """Step ``optimizer`` unless its gradients hold inf/NaN (torch's ``step``); unscale first if not yet.

        With a sharded optimizer, a collective: call it on every rank; every rank steps, or every
        rank skips (see the class). Otherwise torch's ``step``, unchanged.

        Returns:
            What ``optimizer.step()`` returned, or None for a skipped step.

        Raises:
            TypeError: ``optimizer`` is not a ``torch.optim.Optimizer`` (before any communication).
            RuntimeError: a closure given with a sharded optimizer, or torch's: ``step`` called twice
                since the last ``update()`` (before any communication); and what ``unscale_`` raises.
        """
        sharded = self._sharded(optimizer, "step")
        if not self.is_enabled() or not sharded:
            return super().step(optimizer, *args, **kwargs)
        if args or "closure" in kwargs:
            raise RuntimeError(
                "ShardedGradScaler.step: closure: a closure is not supported while the scaler is enabled (as "
                "torch's GradScaler); run forward and backward before scaler.step(opt), without a closure"
            )
        self._check_scale_growth_tracker("step")
        state = self._per_optimizer_states[id(optimizer)]
        if state["stage"] is OptState.STEPPED:
            raise RuntimeError(
                "step() has already been called since the last update(). Call scaler.step(opt) once per iteration, "
                "then scaler.update()"
            )
        if state["stage"] is OptState.READY:
            self.unscale_(optimizer)
        skip = sum(float(f) for f in state["found_inf_per_device"].values()) > 0
        result = None if skip else optimizer.step(**kwargs)
        state["stage"] = OptState.STEPPED
        return result

    def _sharded(self, optimizer: Any, method: str) -> bool:
        """Whether ``optimizer`` is a sharded optimizer; checked as ``method``'s argument, without communicating."""
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(
                f"ShardedGradScaler.{method}: optimizer: got {type(optimizer).__qualname__}; allowed: a "
                "torch.optim.Optimizer (dml.DistributedOptimizer(..., shard_state=True) for the sharded check); pass "
                "the optimizer that steps the model"
            )
        if not isinstance(optimizer, ShardedOptimizer):
            return False
        if optimizer.step_during_backward and self.is_enabled():
            raise TypeError(
                f"ShardedGradScaler.{method}: optimizer: created with step_during_backward=True, which steps every "
                "shard during backward(), before a scaler can unscale the gradients or check them for infs (the "
                "backward before this call stepped with the scaled gradients). Create it with "
                "step_during_backward=False to scale the loss (a scaler created with enabled=False is accepted)"
            )
        theirs, ours = optimizer.backend, self._backend
        if (theirs.rank, theirs.size) != (ours.rank, ours.size):
            raise ValueError(
                f"ShardedGradScaler.{method}: optimizer: reduces over a backend of {theirs.size} ranks (this is rank "
                f"{theirs.rank}), and the scaler's backend has {ours.size} (this is rank {ours.rank}); allowed: the "
                "same ranks; create the scaler with the optimizer's backend: dml.ShardedGradScaler(opt.backend, ...)"
            )
        for g, group in enumerate(optimizer.param_groups):
            for i, p in enumerate(group["params"]):
                if p.requires_grad and p.dtype == torch.float16:
                    raise ValueError(
                        f"ShardedGradScaler.{method}: optimizer: parameter {i} of group {g} is float16; allowed: "
                        "float32 (or float64) parameters, whose gradients the scaler unscales (torch refuses to "
                        "unscale float16 gradients); keep the model in float32 and run its forward in "
                        "torch.autocast(device, dtype=torch.float16)"
                    )
        return True


def _check_device(device: Any) -> None:
    """Raise unless ``device`` is a device string torch understands."""
    if not isinstance(device, str):
        raise TypeError(
            f"ShardedGradScaler: device: got {type(device).__qualname__} {device!r}; allowed: a str such as 'cuda' or "
            "'cpu' (as torch.amp.GradScaler's); pass device='cuda'"
        )
    try:
        torch.device(device)
    except RuntimeError as e:
        raise ValueError(
            f"ShardedGradScaler: device: got {device!r} ({e}); allowed: a device type such as 'cuda' or 'cpu'"
        ) from e


def _check_number(name: str, value: Any, allowed: str, ok: Any, example: str) -> None:
    """Raise unless ``value`` is a real number (not a bool) for which ``ok`` holds."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(
            f"ShardedGradScaler: {name}: got {type(value).__qualname__} {value!r}; allowed: {allowed}; pass e.g. "
            f"{name}={example}"
        )
    if not ok(float(value)):
        raise ValueError(f"ShardedGradScaler: {name}: got {value!r}; allowed: {allowed}; pass e.g. {name}={example}")
