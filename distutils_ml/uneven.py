"""``dml.join``: training on ranks with different numbers of batches (torch DDP's ``Join``, Horovod's ``join()``).

Inside the context every rank trains as usual. Each iteration (from one ``step()`` of the given optimizers to
the next) begins, at its first collective, with one small allgather in which every rank says whether it still
has data and how many steps it took. A rank that has run out of batches leaves the ``with`` block and, in
``__exit__``, *shadows* the others' iterations until every rank is done:

- while every rank has data, that allgather is the only extra message per iteration;
- once a rank has joined, the lowest active rank announces each primitive of the iteration before it sends
  it (one small broadcast: kind, shapes, dtypes, op, root) and the joined ranks take part in it with a
  neutral contribution: zeros for a sum or an average (SyncBatchNorm's counts included, so its statistics
  are over the ranks with data), the op's identity for MAX / MIN / PROD; in a gather, the announcer's own buffer
  (so that agreement checks pass as if the joined rank said the same) or, for data the library gathers (sparse
  gradients, SyncBatchNorm's statistics: :func:`joined_ranks_send_zeros`), zeros. A
  broadcast or reduce rooted at a joined rank is rooted at the announcer instead (``broadcast_buffers``
  handles passed to ``join`` move their root likewise), so a joined rank never sends as root;
- the optimizers' averaged gradients are divided by the number of ranks that had data, not the world size
  (:meth:`DistributedOptimizer.average_over`), as DDP's ``Join`` does;
- when no rank has data left, every rank takes the parameters, buffers and optimizer state of a rank that
  took the most steps (``dml.synchronize``), so that all end equal.

Without the context, a rank that runs out of data leaves the others waiting, and the stall report names it.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from distutils_ml.backends.base import Backend, ReduceOp, check_backend
from distutils_ml.buffers import BufferBroadcast
from distutils_ml.joined import joined_ranks_send_zeros, world_average_requested, zeros_requested
from distutils_ml.optimizer import DistributedOptimizer
from distutils_ml.sharded import ShardedOptimizer
from distutils_ml.synchronize import synchronize
from distutils_ml.watchdog import call_site, site_as

__all__ = ["Join", "join", "joined_ranks_send_zeros"]

_END = "end of iteration"
#: Where the root is among a primitive's arguments.
_ROOT_ARG = {"_bcast": 1, "_bcast_bytes": 1, "_reduce": 3, "_device_collective": 4}
#: Where the reduction op is among a primitive's arguments (dml.AVG over the ranks with data).
_OP_ARG = {"_allreduce": 2, "_reduce": 2, "_reduce_scatter": 2, "_device_collective": 3}


class Join:
    """The context ``dml.join`` returns (see there)."""

    def __init__(self, backend: Backend, joinables: tuple[Any, ...]) -> None:
        check_backend(backend, "join")
        optimizers, modules, buffers, states = [], [], [], []
        for k, obj in enumerate(joinables):
            if isinstance(obj, ShardedOptimizer):
                raise TypeError(
                    f"join: joinables[{k}] is a DistributedOptimizer with shard_state=True; a rank that has run out "
                    "of data would have to step its shard of the state with the others' gradients, which join does "
                    "not do. Use shard_state=False inside dml.join, or give every rank the same number of batches "
                    "(DistributedDataContainer pads the data; dml.split_iterable(..., drop_remainder=True) for streams)"
                )
            if isinstance(obj, DistributedOptimizer) and obj.step_during_backward:
                raise TypeError(
                    f"join: joinables[{k}] is a DistributedOptimizer with step_during_backward=True, which join does "
                    "not support (it rescales the averages of the ranks that still have data after they land). "
                    "Leave step_during_backward=False inside dml.join"
                )
            if isinstance(obj, DistributedOptimizer):
                optimizers.append(obj)
            elif isinstance(obj, BufferBroadcast):
                buffers.append(obj)
            elif isinstance(obj, torch.nn.Module):
                modules.append(obj)
            elif not isinstance(obj, torch.optim.Optimizer) and all(
                callable(getattr(obj, m, None)) for m in ("state_dict", "load_state_dict")
            ):
                states.append(obj)
            else:
                raise TypeError(
                    f"join: joinables[{k}]: got {type(obj).__qualname__}; allowed: the dml.DistributedOptimizer of "
                    "the loop (one or more), the torch.nn.Module(s) it trains, the handles of "
                    "dml.broadcast_buffers, and LR schedulers and GradScalers (objects with state_dict and "
                    "load_state_dict), which every rank takes from the one that got furthest at the end"
                )
        if not optimizers:
            raise TypeError(
                "join: pass the loop's dml.DistributedOptimizer (its step() ends each iteration), e.g. "
                "with dml.join(backend, opt, model): ..."
            )
        self.backend = backend
        self._optimizers = optimizers
        self._modules = modules
        self._buffers = buffers
        self._states = states
        self._roots = [b.root for b in buffers]
        self._steps = 0
        self._flagged = False  # this iteration's allgather of who still has data is done
        # That allgather was made by a primitive after the last step (a loss averaged after opt.step(), say), not by
        # the forward: a rank may still leave after such calls, so the first forward opens the iteration anew.
        self._tail = False
        self._flag_call = 0  # Backend.calls_entered when the flag was made
        self._flag_rounds = 0  # the optimizers' reduced backward passes then
        self._forwards = 0  # training forwards of the joined modules (with the steps: how far this rank got)
        self._announcer: int | None = None  # the rank announcing each primitive (None: every rank has data)
        self._depth = 0  # primitives inside a primitive are the outer one's business
        self._hooks: list[Any] = []
        self._entered = False
        self._active: set[int] = set()

    # -- the active side --------------------------------------------------------------------------------------

    def __enter__(self) -> Join:
        if self._entered:
            raise RuntimeError("join: this context is already in use; make one per loop (with dml.join(...): ...)")
        if self.backend.observed:
            raise RuntimeError(
                "join: a dml.join (or another observer) is already open on this backend; one join covers the whole "
                "loop: open it once, around the outermost loop whose ranks may run out of data"
            )
        self._entered = True
        for opt in self._optimizers:
            opt.prepare()  # the buckets and their agreement, now: a rank without data has them too
        self._hooks = [opt.register_step_post_hook(self._after_step) for opt in self._optimizers]
        # The iteration's flag before the first forward's hooks (broadcast_buffers reads its root there).
        self._hooks += [m.register_forward_pre_hook(self._before_forward, prepend=True) for m in self._modules]
        self.backend.observe(self._observe, self._root_now, self._count_now)
        return self

    def _observe(self, name: str, original: Callable[..., Any], *args: Any) -> Any:
        if self._depth:
            return original(*args)
        self._depth += 1
        try:
            self._current()
            if self._announcer is None:
                return original(*args)
            args = self._to_active_root(name, args)
            averaged = name in _OP_ARG and args[_OP_ARG[name]] is ReduceOp.AVG and not world_average_requested()
            if averaged:  # summed here, then divided by the ranks with data (the joined ones add zeros)
                where = _OP_ARG[name]
                args = (*args[:where], ReduceOp.SUM, *args[where + 1 :])
            self._send_announcement((name, _describe(name, args)))
            result = original(*args)
            if averaged:
                _divide_result(name, args, len(self._active), self.backend.rank)
            return result
        finally:
            self._depth -= 1

    def _to_active_root(self, name: str, args: tuple[Any, ...]) -> tuple[Any, ...]:
        """A broadcast or reduce whose root has joined goes from (or to) the announcer instead: a rank with data
        (as DDP's Join makes an active rank the buffers' authority)."""
        where = _ROOT_ARG.get(name)
        if where is None or (name == "_device_collective" and args[0] not in ("bcast", "reduce")):
            return args
        if args[where] in self._active:
            return args
        return (*args[:where], self._announcer, *args[where + 1 :])

    def _root_now(self, root: int) -> int:
        """The rank acting as ``root`` in a rooted call made now (``Backend.acting_root``): the announcer once
        ``root`` has joined. Makes the iteration's flag first, as its first primitive would."""
        self._now()
        return root if self._announcer is None or root in self._active else self._announcer

    def _count_now(self) -> int:
        """How many ranks a ``dml.AVG`` made now divides by (``Backend.averaging_count``): those with data, unless
        the caller rescales itself (:func:`world_average`)."""
        self._now()
        averaged = self._announcer is not None and not world_average_requested()
        return len(self._active) if averaged else self.backend.size

    def _now(self) -> None:
        """:meth:`_current`, from outside a primitive (inside one, :meth:`_observe` has made it)."""
        if self._depth:
            return
        self.backend._enter("join")  # inside the caller's collective: counts as part of it
        try:
            self._current()
        finally:
            self.backend._leave()

    def _current(self) -> None:
        """Make sure the flag (who has data) is current for a call made now.

        The first call after a step makes it. Where a rank may have left the loop since it was made, each new call
        asks again: after the step (calls of the user's before the next training forward), and after a backward
        whose step may have been skipped (a GradScaler's): nothing tells a call of the iteration from one of the
        next there. Where no rank can have left (between a training forward and its backward), nothing is sent.
        """
        if not self._flagged:
            self._flag(active=True)
            self._tail = True
        elif (self._tail and self.backend.calls_entered != self._flag_call) or self._reduced() != self._flag_rounds:
            self._reflag(tail=True)

    def _reflag(self, *, tail: bool) -> None:
        """Close the announced part of the iteration (if any) and ask again who has data."""
        self._end_announced()
        self._flag(active=True)
        self._tail = tail

    def _before_forward(self, module: torch.nn.Module, *_: Any) -> None:
        if not (torch.is_grad_enabled() and module.training) or self.backend.in_collective():
            return  # an evaluation (collectives inside it count as calls), or a forward inside a collective
        self._forwards += 1
        fresh = (
            self._flagged
            and not self._tail
            and self.backend.calls_entered == self._flag_call
            and self._reduced() == self._flag_rounds
        )
        if fresh:
            return  # a second forward of the same iteration, nothing sent since the first
        self.backend._enter("join")
        try:
            # Calls after the last step (or since this iteration's forward: a skip agreed by the user's own
            # collective), or a skipped step (a GradScaler's, after gradients were reduced): a rank may have left.
            if self._flagged:
                self._reflag(tail=False)
            else:
                self._flag(active=True)
                self._tail = False
        finally:
            self.backend._leave()

    def _reduced(self) -> int:
        """The backward passes the optimizers reduced so far."""
        return sum(opt.rounds_reduced for opt in self._optimizers)

    def _end_announced(self) -> None:
        """Close an iteration whose primitives were announced (some rank had joined): the joined ranks stop
        shadowing it. Every rank with data takes part, as in :meth:`_after_step`."""
        if self._announcer is not None:
            self._send_announcement(_END)

    def _after_step(self, *_: Any) -> None:
        self._steps += 1
        if self._flagged and self._announcer is not None:
            self.backend._enter("join")
            try:
                self._send_announcement(_END)
            finally:
                self.backend._leave()
        self._flagged = False

    def _flag(self, *, active: bool) -> np.ndarray:
        """This iteration's allgather: (has data, steps taken, training forwards) of every rank; sets the announcer
        and the average."""
        backend = self.backend
        every = np.empty((backend.size, 3), dtype=np.int64)
        type(backend)._allgather(backend, np.array([int(active), self._steps, self._forwards], dtype=np.int64), every)
        have = np.flatnonzero(every[:, 0])
        self._active = {int(r) for r in have}
        self._flagged = True
        self._flag_call, self._flag_rounds = backend.calls_entered, self._reduced()
        self._announcer = int(have[0]) if 0 < len(have) < backend.size else None
        if len(have):
            for opt in self._optimizers:
                opt.average_over(len(have))
            for handle in self._buffers:  # buffers come from a rank with data (DDP's authoritative rank)
                if handle.root not in self._active:
                    handle.root = int(have[0])
        return every

    def _send_announcement(self, what: Any) -> None:
        backend, root = self.backend, self._announcer
        assert root is not None
        data = pickle.dumps(what) if backend.rank == root else None
        type(backend)._bcast_bytes(backend, data, root)

    # -- the joined side --------------------------------------------------------------------------------------

    def __exit__(self, kind: Any, value: Any, tb: Any) -> None:
        backend = self.backend
        backend.observe(None)
        for handle in self._hooks:
            handle.remove()
        if kind is not None:  # an error inside the loop: no shadowing (the others' stall report names this rank)
            self._reset()
            return
        backend._enter("join")
        try:
            if self._flagged:  # left after calls that followed the last step (or a skipped step): they are done
                self._end_announced()
            while True:
                every = self._flag(active=False)
                if not every[:, 0].any():
                    break
                self._shadow_iteration()
        finally:
            backend._leave()
        self._reset()
        self._final_sync(every)

    def _shadow_iteration(self) -> None:
        """Take part in the active ranks' primitives of one iteration, as they announce them, with neutral data."""
        backend, root = self.backend, self._announcer
        assert root is not None
        while True:
            what = pickle.loads(type(backend)._bcast_bytes(backend, None, root))
            if what == _END:
                return
            name, spec = what
            self._neutral(name, spec)

    def _neutral(self, name: str, spec: tuple[Any, ...]) -> None:
        backend = self.backend
        cls = type(backend)
        if name == "_check_call":  # compared as made where the announcer made it (debug mode compares call sites)
            *call, site = spec
            with site_as(site):
                cls._check_call(backend, *call)
        elif name == "_barrier":
            cls._barrier(backend)
        elif name == "_allreduce":
            (shape, dtype), op = spec
            cls._allreduce(backend, None, _identity(shape, dtype, op), op)
        elif name == "_reduce":
            (shape, dtype), op, root = spec
            cls._reduce(backend, None, _identity(shape, dtype, op), op, root)
        elif name == "_reduce_scatter":
            (shape, dtype), op = spec
            cls._reduce_scatter(backend, _identity(shape, dtype, op), None, op)
        elif name == "_allgather":
            (shape, dtype), (rshape, _), payload = spec
            mine = np.zeros(shape, dtype) if payload is None else np.frombuffer(payload, dtype).reshape(shape).copy()
            cls._allgather(backend, mine, np.empty(rshape, dtype))
        elif name == "_bcast":
            (shape, dtype), root = spec  # never rooted here (see _to_active_root)
            cls._bcast(backend, np.zeros(shape, dtype), root)
        elif name == "_bcast_bytes":  # never rooted here: a joined root is replaced by the announcer
            (root,) = spec
            cls._bcast_bytes(backend, None, root)
        elif name == "_allgather_bytes":  # objects (agreement reports): the announcer's, as if this rank said the same
            (data,) = spec
            cls._allgather_bytes(backend, data)
        elif name == "_device_collective":
            self._neutral_device(spec)
        elif name == "_transport_call":
            self._neutral_transport(*spec)
        else:  # pragma: no cover - OBSERVED and this list name the same calls
            raise RuntimeError(f"join: no neutral form of {name}")

    def _neutral_transport(self, kind: str, spec: tuple[tuple[int, ...], str], op: ReduceOp | None) -> None:
        """The gradient buckets' gloo call (ranks on several hosts) an active rank announced, with neutral data."""
        from distutils_ml.transport import transport_for

        backend = self.backend
        ring = transport_for(backend)
        if ring is None:  # pragma: no cover - every rank made the same transport (a collective)
            raise RuntimeError("join: an active rank sent a bucket over gloo, and this rank has no gloo transport")
        (shape, dtype), W = spec, backend.size
        with ring.answering():  # the announcer's debug-mode comparison came as an announcement of its own
            if kind == "allreduce":
                assert op is not None
                ring.allreduce(_identity(shape, dtype, op), op)
            elif kind == "reduce_scatter":
                assert op is not None
                rows = _identity((W, *shape), dtype, op)
                ring.reduce_scatter(rows, rows[backend.rank], op)
            else:  # allgather: zeros from this rank (join refuses the sharded optimizer, whose parameters these are)
                ring.allgather(np.zeros(shape, dtype), np.empty((W, *shape), dtype))

    def _neutral_device(self, spec: tuple[Any, ...]) -> None:
        kind, send, recv, op, root = spec
        device = torch.device(
            "cuda", torch.cuda.current_device() if self.backend.device is None else self.backend.device
        )

        def make(shape_dtype: Any) -> Any:
            if shape_dtype is None:
                return None
            shape, name = shape_dtype
            return _torch_identity(shape, getattr(torch, name.removeprefix("torch.")), op, device)

        type(self.backend)._device_collective(self.backend, kind, make(send), make(recv), op, root)

    def _reset(self) -> None:
        for opt in self._optimizers:
            opt.average_over(self.backend.size)
        for handle, root in zip(self._buffers, self._roots, strict=True):
            handle.root = root

    def _final_sync(self, every: np.ndarray) -> None:
        """Every rank takes the state of a rank that took the most steps (the joined ones stopped stepping)."""
        progress = [(int(steps), int(forwards)) for steps, forwards in every[:, 1:]]
        root = max(range(len(progress)), key=lambda r: (progress[r], -r))  # the most steps, then training forwards
        if all(p == progress[root] for p in progress):
            return  # every rank took every step and forward: nothing is stale
        backend = self.backend
        for module in self._modules:
            synchronize(backend, module, root)
        for opt in self._optimizers:
            synchronize(backend, [p for g in opt.param_groups for p in g["params"]], root)
            synchronize(backend, opt, root)
        for obj in self._states:  # LR schedulers, GradScalers: stepped as often as that rank stepped
            obj.load_state_dict(synchronize(backend, obj.state_dict(), root))


def _divide_result(name: str, args: tuple[Any, ...], count: int, rank: int) -> None:
    """Divide what primitive ``name`` (called with ``args``, a sum) left on this rank by ``count``: an average."""
    if name == "_allreduce":
        target = args[1]
    elif name == "_reduce":
        target = args[1] if args[3] == rank else None
    elif name == "_reduce_scatter":
        send, recv, _ = args
        target = send[rank, ...] if recv is None else recv
    else:  # _device_collective: torch tensors on the device, as the NCCL backend lays them out
        kind, send, recv, _, root = args
        if kind == "reduce_scatter":
            target = recv[rank] if send is None else recv
        else:
            target = recv if kind == "allreduce" or rank == root else None
    if target is None:
        return
    if isinstance(target, np.ndarray):
        np.divide(target, count, out=target)
    else:
        target.div_(count)


def _describe(name: str, args: tuple[Any, ...]) -> tuple[Any, ...]:
    """What a joined rank needs to take part in primitive ``name`` called with ``args``: shapes, dtypes, op, root."""

    def spec(buf: Any) -> tuple[tuple[int, ...], str] | None:
        return None if buf is None else (tuple(buf.shape), str(buf.dtype))

    if name == "_check_call":
        return (*args, call_site())
    if name == "_barrier":
        return ()
    if name == "_allreduce":
        send, recv, op = args
        return spec(recv), op
    if name == "_reduce":
        send, recv, op, root = args
        return spec(recv), op, root
    if name == "_reduce_scatter":
        send, _recv, op = args
        return spec(send), op
    if name == "_allgather":  # the announcer's own buffer, unless the caller asked joined ranks for zeros
        send, recv = args
        return spec(send), spec(recv), None if zeros_requested() else send.tobytes()
    if name == "_bcast":
        buf, root = args
        return spec(buf), root
    if name == "_bcast_bytes":
        return (args[1],)
    if name == "_allgather_bytes":
        return (args[0],)
    if name == "_transport_call":
        kind, array, op, _post = args
        return kind, spec(array), op
    kind, send, recv, op, root = args  # _device_collective
    return kind, spec(send), spec(recv), op, root


def _identity(shape: tuple[int, ...], dtype: str, op: ReduceOp) -> np.ndarray:
    """A buffer that leaves ``op``'s result unchanged: zeros for SUM / AVG, ones for PROD, the extreme for MAX / MIN."""
    dt = np.dtype(dtype)
    if op in (ReduceOp.SUM, ReduceOp.AVG):
        return np.zeros(shape, dt)
    if op is ReduceOp.PROD:
        return np.ones(shape, dt)
    if dt == np.bool_:
        return np.full(shape, op is ReduceOp.MIN, dt)
    info = np.finfo(dt) if dt.kind == "f" else np.iinfo(dt)
    low = -np.inf if dt.kind == "f" else info.min
    high = np.inf if dt.kind == "f" else info.max
    return np.full(shape, low if op is ReduceOp.MAX else high, dt)


def _torch_identity(shape: tuple[int, ...], dtype: torch.dtype, op: ReduceOp | None, device: torch.device) -> Any:
    if op is None or op in (ReduceOp.SUM, ReduceOp.AVG):
        return torch.zeros(shape, dtype=dtype, device=device)
    if op is ReduceOp.PROD:
        return torch.ones(shape, dtype=dtype, device=device)
    if dtype == torch.bool:
        return torch.full(shape, op is ReduceOp.MIN, dtype=dtype, device=device)
    if dtype.is_floating_point:
        value: float = -float("inf") if op is ReduceOp.MAX else float("inf")
    else:
        info = torch.iinfo(dtype)
        value = info.min if op is ReduceOp.MAX else info.max
    return torch.full(shape, value, dtype=dtype, device=device)


def join(backend: Backend, *joinables: Any) -> Join:
    """A context in which ranks may run different numbers of iterations (uneven inputs), as torch DDP's ``Join``.

    Put the training loop inside it; each iteration ends with ``opt.step()`` of a given optimizer. A rank that
    runs out of batches leaves the block and keeps answering the others' collectives (gradient buckets with
    zeros, SyncBatchNorm statistics with a count of zero, buffer broadcasts) until every rank is done; the
    averaged gradients are averaged over the ranks that had data. At the end every rank takes the parameters,
    buffers and optimizer state of a rank that took the most steps. Every rank enters and leaves it.

    Each iteration must make the same collectives on every rank that has data, as a training step does (log or
    evaluate after the block). With ``shard_state=True`` it is refused (see the error).

    Args:
        backend: from ``dml.get_distributed_backend``.
        joinables: the loop's ``dml.DistributedOptimizer`` (at least one; its ``step()`` ends an iteration), and
            the ``torch.nn.Module`` (s) it trains, whose buffers the last ranks to finish hand to the others.

    Returns:
        The context manager.

    Raises:
        TypeError: no optimizer, a sharded optimizer, or another object given (before any communication).

    Example:
        >>> model = dml.synchronize(backend, torch.nn.Linear(4, 1))
        >>> opt = dml.DistributedOptimizer(backend, torch.optim.SGD(model.parameters(), lr=0.1))
        >>> batches = [torch.ones(2, 4)] * (3 + dml.local_rank(backend))  # ranks with different counts
        >>> with dml.join(backend, opt, model):
        ...     for x in batches:
        ...         opt.zero_grad()
        ...         model(x).sum().backward()
        ...         opt.step()
    """
    return Join(backend, joinables)
