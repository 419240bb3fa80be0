"""What the two forms of the distributed optimizer share, and the states a step goes through.

``DistributedOptimizer`` (:mod:`distutils_ml.optimizer`: gradients allreduced, state whole) and
``ShardedOptimizer`` (:mod:`distutils_ml.sharded`: gradients reduce-scattered, state sharded) are
siblings over :class:`DataParallelOptimizer`, which holds what both do: forwarding to the wrapped
optimizer, the step hooks, pass counting (``backward_passes_per_step``), ``no_sync()``,
``synchronize()`` and the reduction of a closure's loss.

The step's state. Between two steps the gradients go through these phases (``_phase``). Each change
of phase is one entry of ``_NEXT`` below, made by :meth:`DataParallelOptimizer._advance` on one of
these events:

- ``accumulate``: a backward added to the gradients without reducing them (inside ``no_sync()``, or
  one of the first k-1 backward passes of ``backward_passes_per_step=k``);
- ``backward_reduced``: a backward reduced the gradients (the end of its reduction);
- ``late_backward``: a backward after ``synchronize()`` that ``DistributedOptimizer`` leaves
  unreduced until the next ``step()`` / ``synchronize()`` agrees on it across ranks (the sharded
  form has no such event: its gradient buffers refuse a backward onto reduced gradients);
- ``reduce``: a reduction now, of gradients no backward reduced (``step()``, ``synchronize()``);
- ``synchronize``: ``synchronize()`` made the gradients final for this step;
- ``closure``: a closure of ``step(closure)`` starts or ends (its own backward decides afresh);
- ``step``: ``step()`` or ``zero_grad()`` (the next step begins; the pass count restarts).

::

    phase \\ event   accumulate    backward_reduced  late_backward  reduce        synchronize   closure      step
    CLEAN           ACCUMULATED   REDUCED           -              CLEAN         SYNCHRONIZED  CLEAN        CLEAN
    ACCUMULATED     ACCUMULATED   REDUCED           -              CLEAN         SYNCHRONIZED  ACCUMULATED  CLEAN
    REDUCED         MIXED         REDUCED           -              REDUCED       SYNCHRONIZED  CLEAN        CLEAN
    MIXED           MIXED         REDUCED           -              REDUCED       SYNCHRONIZED  ACCUMULATED  CLEAN
    SYNCHRONIZED    SYNCHRONIZED  SYNCHRONIZED      LATE           SYNCHRONIZED  SYNCHRONIZED  SYNCHRONIZED CLEAN
    LATE            LATE          LATE              LATE           LATE          SYNCHRONIZED  LATE         CLEAN

CLEAN: nothing since the last step (or only gradients set by hand); ACCUMULATED: backward passes
accumulated that no reduction covers; REDUCED: the last backward reduced them; MIXED: a backward
reduced them, then others accumulated (inside ``no_sync()``); SYNCHRONIZED: ``synchronize()`` made
them final; LATE: a backward accumulated after that. ``step()`` and ``synchronize()`` reduce in
CLEAN, ACCUMULATED and MIXED (outside ``no_sync()``); in LATE, ``DistributedOptimizer`` reduces
again (``dml.AVG``) or raises on every rank. ``-``: cannot happen (``late_backward`` comes only after
``synchronize()``); the entry keeps the phase.
"""

from __future__ import annotations

import abc
import contextlib
import enum
from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch

from distutils_ml.backends.base import Backend, ReduceOp, check_backend
from distutils_ml.collectives import allreduce

__all__ = ["DataParallelOptimizer", "Phase", "check_sparse_as_dense", "check_wrapped"]


class Phase(enum.Enum):
    """Where the gradients of the current step stand (the module's table)."""

    CLEAN = "clean"
    ACCUMULATED = "accumulated"
    REDUCED = "reduced"
    MIXED = "mixed"
    SYNCHRONIZED = "synchronized"
    LATE = "late"


_P = Phase
_EVENTS = ("accumulate", "backward_reduced", "late_backward", "reduce", "synchronize", "closure", "step")
_ROWS = {
    _P.CLEAN: (_P.ACCUMULATED, _P.REDUCED, _P.CLEAN, _P.CLEAN, _P.SYNCHRONIZED, _P.CLEAN),
    _P.ACCUMULATED: (_P.ACCUMULATED, _P.REDUCED, _P.ACCUMULATED, _P.CLEAN, _P.SYNCHRONIZED, _P.ACCUMULATED),
    _P.REDUCED: (_P.MIXED, _P.REDUCED, _P.REDUCED, _P.REDUCED, _P.SYNCHRONIZED, _P.CLEAN),
    _P.MIXED: (_P.MIXED, _P.REDUCED, _P.MIXED, _P.REDUCED, _P.SYNCHRONIZED, _P.ACCUMULATED),
    _P.SYNCHRONIZED: (_P.SYNCHRONIZED, _P.SYNCHRONIZED, _P.LATE, _P.SYNCHRONIZED, _P.SYNCHRONIZED, _P.SYNCHRONIZED),
    _P.LATE: (_P.LATE, _P.LATE, _P.LATE, _P.LATE, _P.SYNCHRONIZED, _P.LATE),
}
#: (phase, event) -> the next phase; "step" leads to CLEAN from every phase.
_NEXT = {
    **{(p, e): row[k] for p, row in _ROWS.items() for k, e in enumerate(_EVENTS[:-1])},
    **{(p, "step"): _P.CLEAN for p in Phase},
}
#: Phases whose gradients a step must still reduce (unless inside no_sync()).
_UNREDUCED = (_P.CLEAN, _P.ACCUMULATED, _P.MIXED)


def check_sparse_as_dense(value: Any) -> bool:
    """``value`` if it is a bool (``sparse_as_dense`` of the optimizer and the reductions), else ``TypeError``."""
    if not isinstance(value, bool):
        raise TypeError(f"sparse_as_dense: got {value!r}; allowed: True or False")
    return value


def check_wrapped(optimizer: Any, backward_passes_per_step: Any, example: str) -> None:
    """The checks of the arguments both optimizer forms take: raise before anything moves."""
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
    if isinstance(optimizer, DataParallelOptimizer):
        raise TypeError("optimizer: already a DistributedOptimizer; wrap the plain optimizer once")


class DataParallelOptimizer(torch.optim.Optimizer, metaclass=abc.ABCMeta):
    """A torch optimizer that reduces gradients across ranks and steps a wrapped one (the two forms' base).

    It is a ``torch.optim.Optimizer`` by type (LR schedulers and ``isinstance`` accept it) whose
    ``param_groups``, ``state`` and ``defaults`` are the wrapped optimizer's; torch's
    ``Optimizer.__init__`` is not run (it would build a second set of groups), the step-hook tables
    it would make are made here.
    """

    #: The name in ``repr``.
    _form = "DistributedOptimizer"
    #: ``shard_state`` of this form, and how to create it (for error messages)
    _shards = False
    _example = "dml.DistributedOptimizer(backend, torch.optim.SGD(model.parameters(), lr=0.1))"
    #: how gradients combine (set by each form, which checks it in its own order)
    _op: ReduceOp

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
        shard_state: Any = ...,
        sparse_as_dense: bool = False,
        step_during_backward: bool = False,
        prefetch: bool = False,
    ) -> None:
        """The arguments of ``DistributedOptimizer``; ``shard_state`` left out (``...``): this form's."""
        check_backend(backend, "DistributedOptimizer")
        self._sparse_as_dense = check_sparse_as_dense(sparse_as_dense)
        if not isinstance(step_during_backward, bool):
            raise TypeError(f"step_during_backward: got {step_during_backward!r}; allowed: True or False")
        self._step_during_backward = step_during_backward
        if not isinstance(prefetch, bool):
            raise TypeError(f"prefetch: got {prefetch!r}; allowed: True or False")
        self._prefetch = prefetch
        self._check_shard_state(self._shards if shard_state is ... else shard_state)
        check_wrapped(optimizer, backward_passes_per_step, self._example)
        self._check_optimizer(optimizer)
        self._backend = backend
        self.optimizer = optimizer
        self._passes_per_step = backward_passes_per_step
        self._passes = 0  # backward passes of this step that reached the pass count
        self._phase = Phase.CLEAN
        self._rounds = 0  # backward passes whose gradients were reduced (rounds_reduced)
        # a round that stepped parameters (step_during_backward) ended well, and step() has not run since:
        # load_state_dict() refuses (the same on every rank that reduced, whatever each stepped itself)
        self._stepped_round = False
        self._no_sync = False
        # Hook tables of torch.optim.Optimizer, so register_step_pre_hook / register_step_post_hook
        # work on the wrapper (its state_dict hooks are forwarded to the wrapped optimizer, below).
        self._optimizer_step_pre_hooks: OrderedDict[int, Callable] = OrderedDict()
        self._optimizer_step_post_hooks: OrderedDict[int, Callable] = OrderedDict()
        self._setup(op, bucket_bytes, communication_dtype, overlap)

    # -- what each form decides ------------------------------------------------------------

    @abc.abstractmethod
    def _check_shard_state(self, shard_state: Any) -> None:
        """Raise unless this form is the one ``shard_state`` asks for."""

    @abc.abstractmethod
    def _check_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Raise unless this form can wrap ``optimizer``."""

    @abc.abstractmethod
    def _setup(self, op: Any, bucket_bytes: int | None, communication_dtype: Any, overlap: bool | None) -> None:
        """The form's own part of ``__init__``: its reduction, from the remaining arguments."""

    @abc.abstractmethod
    def _reduce(self) -> None:
        """Reduce now the gradients no backward reduced (then ``_advance("reduce")``)."""

    @abc.abstractmethod
    def _step(self, closure: Callable[[], Any] | None) -> Any:
        """``step()`` between its pre- and post-hooks."""

    @abc.abstractmethod
    def _forget_round(self) -> None:
        """Forget a reduction a failed backward left unfinished."""

    @abc.abstractmethod
    def _clear_grads(self, set_to_none: bool) -> None:
        """``zero_grad``'s clearing of the gradients."""

    @property
    @abc.abstractmethod
    def overlap(self) -> bool:
        """Whether buckets are reduced on the communication thread while backward runs."""

    def _late_backward(self) -> bool:
        """A backward after ``synchronize()``: True leaves it unreduced (after ``_advance("late_backward")``).

        The default reduces it as any other backward.
        """
        return False

    def _reduce_again(self, caller: str, stacklevel: int) -> bool:
        """After ``synchronize()``: whether to reduce again (a late backward; a warning ``stacklevel`` frames up
        names the caller). The default: never."""
        return False

    def _check_reducing_backward(self) -> None:
        """Raise if this backward may not reduce (the default lets it)."""

    @abc.abstractmethod
    def _displaced_by(self) -> str | None:
        """What took over the reduction of this optimizer's parameters since it was created (None: nothing)."""

    def _check_in_charge(self, caller: str) -> None:
        """Raise if another optimizer (or reduction) created later over some of these parameters took them over:
        its hooks replaced this one's, and stepping this one would step on gradients it no longer reduces."""
        by = self._displaced_by()
        if by is not None:
            raise RuntimeError(
                f"{self._form}.{caller}: a {by} created later over some of the same parameters took over their "
                "gradient reduction (its hooks replaced this optimizer's, which no longer reduces anything). "
                "Use the newer one, or create this one again to take them back"
            )

    def _check_reduce_now(self, caller: str) -> None:
        """Raise if the gradients may not be reduced now, by ``step()`` or ``synchronize()`` (the default lets them)."""

    # -- the step's state ------------------------------------------------------------------

    def _advance(self, event: str) -> None:
        """Move to the phase ``event`` leads to (the module's table)."""
        self._phase = _NEXT[self._phase, event]

    def _unreduced(self) -> bool:
        """Whether a step must reduce the gradients first (when outside ``no_sync()``)."""
        return self._phase in _UNREDUCED

    def _end_step(self) -> None:
        """The next step begins: phase CLEAN, the pass count restarts."""
        self._advance("step")
        self._passes = 0

    def _refuse_unfinished_backward(self) -> None:
        """``step()`` after a backward that raised part way, after sending buckets: forget it and raise."""
        self._forget_round()
        self._end_step()
        raise RuntimeError(
            "DistributedOptimizer: the last backward() raised part way, after some of its buckets were reduced (and, "
            "with step_during_backward, stepped); its gradients are not final, so nothing was stepped. Call "
            "opt.zero_grad() and go on from a consistent state (the last checkpoint)"
        )

    def _skip_backward(self) -> bool:
        """Asked at the first gradient of each backward: True leaves this backward's gradients unreduced."""
        if self._phase in (Phase.SYNCHRONIZED, Phase.LATE) and self._late_backward():
            return True
        if not self._no_sync:
            self._passes += 1
        if self._no_sync or self._passes % self._passes_per_step:
            self._advance("accumulate")
            return True
        self._check_reducing_backward()
        return False

    def _backward_reduced(self) -> None:
        self._advance("backward_reduced")
        self._rounds += 1

    @property
    def rounds_reduced(self) -> int:
        """How many backward passes had their gradients reduced so far (``dml.join`` tells a training forward of
        the next iteration from a second one of the same by it, when a step was skipped: a ``GradScaler``'s)."""
        return self._rounds

    # -- forwarded state -------------------------------------------------------------------

    @property
    def backend(self) -> Backend:
        """The backend gradients are reduced over."""
        return self._backend

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
        """Load into the wrapped optimizer.

        Raises:
            RuntimeError: with ``step_during_backward``, between a ``backward()`` whose reduction ended well (its
                buckets stepped, on this rank or others) and ``step()``; nothing is loaded. After a backward whose
                step raised, it loads (a checkpoint's restore).
        """
        self._refuse_load_after_stepping()
        self.optimizer.load_state_dict(state_dict)

    def _refuse_load_after_stepping(self) -> None:
        """``load_state_dict()`` between a backward that stepped and ``step()``: the loaded state would replace the
        state those steps produced, and ``step()`` would not step again. Nothing is loaded."""
        if self._stepped_round:
            raise RuntimeError(
                "DistributedOptimizer(step_during_backward=True): load_state_dict() after a backward() that already "
                "stepped the parameters, before step(); the loaded state would replace what those steps produced "
                "and would not be used for them. Nothing was loaded. Load the state before backward() (after "
                "opt.zero_grad()) or after opt.step()"
            )

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

    def __repr__(self) -> str:
        return f"{self._form}(op={self._op!r}, optimizer={self.optimizer!r})"

    def __getstate__(self) -> dict[str, Any]:
        raise TypeError("DistributedOptimizer holds a backend and cannot be pickled; save state_dict() instead")

    def _params_now(self) -> list[torch.Tensor]:
        """The wrapped optimizer's parameters that take gradients, group by group."""
        return [p for g in self.optimizer.param_groups for p in g["params"] if p.requires_grad]

    def _labels(self) -> list[str]:
        """Names of ``_params_now()`` for error messages."""
        return [
            f"param_groups[{g}]['params'][{j}]"
            for g, group in enumerate(self.optimizer.param_groups)
            for j, p in enumerate(group["params"])
            if p.requires_grad
        ]

    # -- the step --------------------------------------------------------------------------

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear gradients (the wrapped optimizer's ``zero_grad``); the next step begins.

        Raises:
            RuntimeError: with ``step_during_backward``, the last backward already stepped parameters and
                ``step()`` was not called: clearing its gradients would not undo those steps.
        """
        if self._stepped_round:
            self._stepped_round = False
            raise RuntimeError(
                "DistributedOptimizer(step_during_backward=True): zero_grad() after a backward that already stepped "
                "its buckets, with no step() after it: the parameters have moved, and clearing the gradients does "
                "not undo it (a loop that discards a backward, for an input gradient (FGSM) or a GAN generator's "
                "pass through the discriminator, would step twice). Call step() after each such backward, or use "
                "step_during_backward=False for loops with backward passes that do not step"
            )
        self._end_step()
        self._forget_round()
        self._clear_grads(set_to_none)

    def synchronize(self) -> None:
        """Make sure the gradients are reduced now; ``step()`` then won't reduce again.

        After a ``backward()`` (outside ``no_sync()``) they already are, and this only
        marks the step. Gradients accumulated inside ``no_sync()``, or set by hand, are
        reduced here. A ``backward()`` between ``synchronize()`` and ``step()`` is noticed:
        with ``dml.AVG`` the gradients are reduced again at the next ``step()`` or
        ``synchronize()`` (exact: the average of avg(g1) + g2 is avg(g1) + avg(g2)) with a
        ``RuntimeWarning``; with another op that would be wrong, so every rank raises
        ``RuntimeError``. (With ``shard_state=True`` such a backward raises at once: see
        ``ShardedOptimizer``.)
        """
        self._check_in_charge("synchronize()")
        if self._phase in (Phase.SYNCHRONIZED, Phase.LATE):
            if not self._reduce_again("synchronize()", 3):
                return
        elif not self._unreduced():
            self._advance("synchronize")
            return
        self._check_reduce_now("synchronize()")
        self._reduce()
        self._advance("synchronize")

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
        """Step the wrapped optimizer on the reduced gradients (between the step hooks)."""
        self._check_in_charge("step()")
        for hook in list(self._optimizer_step_pre_hooks.values()):
            hook(self, (), {})
        try:
            result = self._step(closure)
        finally:  # ended, or refused: the stepped round is step()'s to judge, and a checkpoint may be loaded
            self._stepped_round = False
        for hook in list(self._optimizer_step_post_hooks.values()):
            hook(self, (), {})
        return result

    def _reduce_loss(self, loss: Any) -> Any:
        """A closure's loss reduced with ``op`` across ranks, so every rank takes the same decisions."""
        if isinstance(loss, torch.Tensor):
            value = loss.detach().clone() if loss.dtype.is_floating_point else loss.detach().double()
            return allreduce(self._backend, value, self._op)
        return float(allreduce(self._backend, np.array(float(loss)), self._op))
