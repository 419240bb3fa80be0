"""Stepping during backward: ``DistributedOptimizer(..., step_during_backward=True)``.

Each bucket's parameters are stepped as soon as its reduction lands (on the communication thread with overlap),
while later buckets are still on the wire; ``step()`` then steps only what is left: the parameters of buckets
whose gradients were not final when they landed (a parameter without a gradient on this rank, which the header,
the last bucket, settles; autograd history; a sparse gradient; ``dml.join``'s rescaling) and those reduced after
the buckets (sparse). The wrapped optimizer must compute each parameter's update from that parameter alone
(:func:`distutils_ml.sharded_rules.check_steps_per_parameter`): stepping it bucket by bucket is then bit-identical
to one step after backward.

What cannot be exact is refused: a step needs the whole gradient before any parameter moves when the gradients
are clipped to a global norm or checked for infs (``GradScaler``). So ``step()`` compares each stepped gradient
with what it was when backward returned (the tensor and its version counter) and raises if anything changed it in
between, naming the parameters; a second reducing backward before ``step()`` raises too (it would step again).
"""

from __future__ import annotations

import contextlib
import sys
import threading
import weakref
from typing import Any

import torch

from distutils_ml.commthread import CommThread

__all__ = [
    "BucketStepper",
    "describe_positions",
    "grad_mark",
    "hyper_parameters",
    "same_hyper_parameters",
    "step_groups",
    "step_optimizer",
]


def grad_mark(grad: torch.Tensor | None) -> tuple[int, int]:
    """What a gradient's values are known by: its version counter (bumped by in-place ops) and its storage's
    address (changed by ``grad.data = ...``); ``(-1, 0)`` for None. A write through ``grad.data`` (a tensor with a
    counter of its own) moves neither: torch cannot tell it, so neither can this."""
    return (-1, 0) if grad is None else (grad._version, grad.data_ptr())


class BucketStepper:
    """Steps a torch optimizer's parameters in subsets and remembers which were stepped since the last ``finish``."""

    def __init__(self, optimizer: torch.optim.Optimizer, *, threaded: bool) -> None:
        self.optimizer = optimizer
        self._stepped: dict[int, torch.Tensor] = {}
        self._seen: list[tuple[torch.Tensor, torch.Tensor, tuple[int, int]]] = []
        self._hyper: list[dict[str, Any]] = []
        self._subsets: dict[tuple, list[list[torch.Tensor]]] = {}
        # threaded: the steps run on a thread of their own, so that the communication thread, which hands them
        # over, goes on to the next bucket at once (stepping there would leave the link idle meanwhile)
        self._worker: CommThread | None = None
        if threaded:
            self._worker = CommThread(threading.RLock(), name="dml-step")
            weakref.finalize(self, self._worker.close)

    @property
    def pending(self) -> bool:
        """Whether parameters were stepped since the last :meth:`finish`."""
        return bool(self._stepped)

    def step(self, params: list[torch.Tensor]) -> None:
        """Step ``params`` (of the optimizer's groups): one step of the optimizer over them alone, now or (threaded)
        on the stepping thread, after the steps handed to it before."""
        for p in params:
            self._stepped[id(p)] = p
        if self._worker is None:
            self._step_subset(params)
        else:
            self._worker.submit(lambda: self._step_subset(params))

    def wait(self) -> None:
        """Return once every step handed over has run; re-raise the first error one raised."""
        if self._worker is not None:
            self._worker.wait()

    def settle(self) -> None:
        """Return once every step handed over has run, keeping an error for :meth:`wait` (a step swaps the groups'
        parameter lists for its subset while it runs: read ``param_groups`` after this)."""
        if self._worker is not None:
            self._worker.wait(errors=False)

    def record(self) -> None:
        """After the backward's reduction, once its steps have run: what each stepped parameter's gradient is now
        (checked by ``finish``)."""
        self.wait()
        self._seen = [(p, p.grad, grad_mark(p.grad)) for p in self._stepped.values() if p.grad is not None]
        self._hyper = hyper_parameters(self.optimizer)

    def hyper_changed(self) -> bool:
        """Whether a parameter group's settings (the learning rate...) changed since :meth:`record`."""
        return not same_hyper_parameters(self._hyper, hyper_parameters(self.optimizer))

    def changed(self) -> list[int]:
        """Positions (among the optimizer's parameters that take gradients) of stepped parameters whose gradient
        changed since :meth:`record`."""
        moved = {id(p) for p, g, mark in self._seen if p.grad is not g or grad_mark(g) != mark}
        every = [p for group in self.optimizer.param_groups for p in group["params"] if p.requires_grad]
        return [k for k, p in enumerate(every) if id(p) in moved]

    def finish(self) -> None:
        """Step every parameter not stepped yet (one step over them), and start over."""
        stepped, self._stepped, self._seen = self._stepped, {}, []
        rest = [p for group in self.optimizer.param_groups for p in group["params"] if id(p) not in stepped]
        if rest:
            self._step_subset(rest)

    def forget(self) -> None:
        """Start over without stepping more (after an error; steps already handed over run first)."""
        if self._worker is not None:
            self._worker.wait(errors=False)
        self._stepped, self._seen = {}, []

    def _step_subset(self, params: list[torch.Tensor]) -> None:
        every = [group["params"] for group in self.optimizer.param_groups]
        key = (tuple(map(id, params)), tuple(map(id, every)), tuple(map(len, every)))
        subset = self._subsets.get(key)
        if subset is None:
            wanted = {id(p) for p in params}
            subset = [[p for p in ps if id(p) in wanted] for ps in every]
            if len(self._subsets) > 256:  # parameters were replaced many times: start the cache over
                self._subsets.clear()
            self._subsets[key] = subset
        step_groups(self.optimizer, subset)


def step_groups(optimizer: torch.optim.Optimizer, members: list[list[torch.Tensor]]) -> None:
    """One step of ``optimizer`` over ``members[g]`` of each parameter group ``g`` alone; the groups' parameter lists
    are put back after it (for an optimizer whose update of each parameter depends on that parameter alone, this is
    what one step over all of them computes for those)."""
    groups = optimizer.param_groups
    every = [group["params"] for group in groups]
    try:
        for group, ps in zip(groups, members, strict=True):
            group["params"] = ps
        step_optimizer(optimizer)
    finally:
        for group, ps in zip(groups, every, strict=True):
            group["params"] = ps


def step_optimizer(optimizer: torch.optim.Optimizer) -> Any:
    """``optimizer.step()``, never while Dynamo compiles on another thread of this process.

    ``torch.compiler.is_compiling()`` is one flag for the whole process, set while any thread compiles, and
    ``torch.optim`` reads it to choose its arithmetic (AdamW's bias corrections from the step count as a float32
    tensor, not a Python float): a step taken meanwhile differs in the last bits from the same step taken at any
    other time. So a rank whose step met a compilation (of its own main thread while the stepping thread steps,
    or of another simulated rank on ``LocalBackend``) would end with a replica that differs from the others'.
    The step holds Dynamo's compile lock, which every compilation holds. Not for a step with a closure: the
    closure runs forward and backward, and communicates.
    """
    lock = _compile_lock()
    with lock:
        return optimizer.step()


def _compile_lock() -> contextlib.AbstractContextManager[Any]:
    """The lock that Dynamo holds while it compiles (a private name of torch: nothing to hold without it)."""
    convert_frame = sys.modules.get("torch._dynamo.convert_frame")  # loaded by torch.compiler.disable, or unused
    lock = getattr(convert_frame, "compile_lock", None)
    return lock if lock is not None else contextlib.nullcontext()


def hyper_parameters(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """Each parameter group's settings but its parameters (tensors copied): what a step reads besides gradients."""
    return [
        {k: v.detach().clone() if isinstance(v, torch.Tensor) else v for k, v in group.items() if k != "params"}
        for group in optimizer.param_groups
    ]


def same_hyper_parameters(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> bool:
    """Whether two :func:`hyper_parameters` snapshots are equal (tensors by value)."""
    if len(a) != len(b):
        return False
    for x, y in zip(a, b, strict=True):
        if x.keys() != y.keys():
            return False
        for k, u in x.items():
            v = y[k]
            if isinstance(u, torch.Tensor) or isinstance(v, torch.Tensor):
                same = isinstance(u, torch.Tensor) and isinstance(v, torch.Tensor) and u.shape == v.shape
                if not (same and u.device == v.device and torch.equal(u, v)):  # compared where they are
                    return False
                continue
            try:
                if u is not v and not bool(u == v):
                    return False
            except Exception:  # values that do not compare: counted as changed
                return False
    return True


def describe_positions(positions: list[int], labels: list[str]) -> str:
    """``name, name, ...`` of the parameters at ``positions`` (at most 5 named)."""
    names = [labels[k] if k < len(labels) else f"parameter {k}" for k in positions]
    more = f" and {len(names) - 5} more" if len(names) > 5 else ""
    return ", ".join(names[:5]) + more
