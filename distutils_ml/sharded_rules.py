"""Which optimizers a sharded step is right for: those whose update of each element depends only on that element's
gradient and state (``ShardedOptimizer`` steps each rank's W-th of every parameter's elements as 1-D pieces).

Known elementwise: exactly the torch classes of ``ELEMENTWISE`` and the classes registered with
:func:`register_elementwise` (``dml.ShardedOptimizer.register_elementwise``). Subclasses are refused: they may
compute per-tensor quantities (LARS's or LAMB's trust ratio), which a shard would compute on its pieces.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["ELEMENTWISE", "check_group", "check_shardable", "check_steps_per_parameter", "register_elementwise"]

#: Optimizers whose update of each element depends only on that element's gradient and state (these exact
#: classes: a subclass may compute per-tensor quantities, see ``check_shardable``).
ELEMENTWISE: tuple[type[torch.optim.Optimizer], ...] = (
    torch.optim.SGD,
    torch.optim.Adam,
    torch.optim.AdamW,
    torch.optim.RMSprop,
    torch.optim.Adagrad,
    torch.optim.Adamax,
    torch.optim.NAdam,
    torch.optim.RAdam,
    torch.optim.ASGD,
    torch.optim.Adadelta,
    torch.optim.Rprop,
)
# Classes registered with ShardedOptimizer.register_elementwise, exactly (not their subclasses).
_REGISTERED: set[type[torch.optim.Optimizer]] = set()
# Optimizers whose math needs each parameter whole, and why.
_WHOLE_TENSOR = {
    "LBFGS": "whose line search uses the norms and dot products of all gradients together",
    "SparseAdam": "which needs sparse gradients",
    "Adafactor": "whose factored second moments are the row and column means of each matrix",
    "Muon": "which orthogonalizes each parameter matrix whole",
}
_NAMES = ", ".join(c.__name__ for c in ELEMENTWISE)


def whole_tensor(cls: type) -> tuple[str, str] | None:
    """(name, why) of the whole-tensor torch optimizer ``cls`` is or derives from, else None."""
    for name, why in _WHOLE_TENSOR.items():
        known = getattr(torch.optim, name, None)
        if known is not None and issubclass(cls, known):
            return name, why
    return None


def check_shardable(optimizer: torch.optim.Optimizer) -> None:
    """``TypeError`` unless ``optimizer`` is of a class known to be elementwise (each element's update depends
    only on that element's gradient and state), exactly: one of ``ELEMENTWISE`` or a registered class, not a
    subclass of one; and none of its parameter groups asks for ``differentiable=True``."""
    cls = type(optimizer)
    name = cls.__qualname__
    whole = whole_tensor(cls)
    if whole is not None:
        raise TypeError(
            f"optimizer: got {name} (torch.optim.{whole[0]}, {whole[1]}); with shard_state=True every rank steps "
            "its own W-th of each parameter's elements, which only elementwise optimizers allow. Use "
            f"shard_state=False with it, or an elementwise optimizer ({_NAMES})"
        )
    if cls not in ELEMENTWISE and cls not in _REGISTERED:
        known = next((c for c in cls.__mro__[1:] if c in ELEMENTWISE or c in _REGISTERED), None)
        where = "torch.optim." if known in ELEMENTWISE else ""
        what = f"a subclass of {where}{known.__qualname__}" if known is not None else "not known to be elementwise"
        raise TypeError(
            f"optimizer: got {name}, {what}; shard_state=True steps each rank's W-th of every parameter's elements "
            "as 1-D pieces of a flat buffer, which is right only when each element's update depends on nothing but "
            "its own gradient and state. A subclass may compute per-tensor quantities (a norm, a trust ratio "
            "||w|| / ||update|| as in LARS or LAMB), which would be computed on each piece instead of the whole "
            f"parameter: wrong steps, no error. Accepted: exactly torch.optim.{_NAMES}, and classes registered as "
            f"elementwise. Use shard_state=False with {name}; or, if every element's update of {name} depends only "
            f"on that element's gradient and state, register it on every rank: "
            f"dml.ShardedOptimizer.register_elementwise({name})"
        )
    for g, group in enumerate(optimizer.param_groups):
        check_group(group, f"parameter group {g}")


def check_group(group: dict[str, Any], which: str) -> None:
    """``TypeError`` if parameter group ``group`` asks for what a sharded step cannot give."""
    if group.get("differentiable"):
        raise TypeError(
            f"optimizer: {which} has differentiable=True; with shard_state=True the step updates pieces of a flat "
            "buffer and allgathers them, which autograd does not follow, so the step would not be differentiable. "
            "Use differentiable=False, or shard_state=False"
        )


def register_elementwise(optimizer_class: type[torch.optim.Optimizer]) -> type[torch.optim.Optimizer]:
    """Declare ``optimizer_class`` elementwise (what ``dml.ShardedOptimizer.register_elementwise`` does; see there).

    Raises:
        TypeError: ``optimizer_class`` is not an optimizer class, or derives from a whole-tensor one.
    """
    if not isinstance(optimizer_class, type) or not issubclass(optimizer_class, torch.optim.Optimizer):
        given = (
            f"an instance of {type(optimizer_class).__qualname__}"
            if not isinstance(optimizer_class, type)
            else optimizer_class.__qualname__
        )
        raise TypeError(
            f"ShardedOptimizer.register_elementwise: optimizer_class: got {given}; allowed: a subclass of "
            "torch.optim.Optimizer, the class itself (register_elementwise(MyOptimizer), not an instance)"
        )
    whole = whole_tensor(optimizer_class)
    if whole is not None:
        raise TypeError(
            f"ShardedOptimizer.register_elementwise: optimizer_class: got {optimizer_class.__qualname__}, "
            f"derived from torch.optim.{whole[0]}, {whole[1]}: not elementwise. Use shard_state=False with it"
        )
    _REGISTERED.add(optimizer_class)
    return optimizer_class


# Torch optimizers that compute each parameter's update from that parameter alone, though not elementwise.
_PER_PARAMETER = ("SparseAdam", "Adafactor", "Muon")


def check_steps_per_parameter(optimizer: torch.optim.Optimizer) -> None:
    """``TypeError`` unless stepping some of ``optimizer``'s parameters computes, for those, exactly what one step
    over all of them does (``step_during_backward=True`` steps each bucket's parameters as it lands): the exact
    classes of ``ELEMENTWISE``, registered ones, and torch's per-parameter ones (SparseAdam, Adafactor, Muon)."""
    cls = type(optimizer)
    known = [getattr(torch.optim, name) for name in _PER_PARAMETER if hasattr(torch.optim, name)]
    if cls in ELEMENTWISE or cls in _REGISTERED or cls in known:
        return
    raise TypeError(
        f"step_during_backward=True: got {cls.__qualname__}, not known to compute each parameter's update from that "
        "parameter alone; stepping the parameters bucket by bucket would then differ from one step over all of them "
        f"(LBFGS's line search, say, uses every gradient together). Accepted: exactly torch.optim.{_NAMES}, "
        f"{', '.join(c.__name__ for c in known)}, and classes registered with "
        "dml.ShardedOptimizer.register_elementwise. Leave step_during_backward=False with it"
    )
