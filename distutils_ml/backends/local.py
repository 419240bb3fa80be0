"""LocalBackend: one process; a world of one, or N simulated ranks on threads.

``dml.initialize(dml.LocalBackend)`` gives a world of one rank in which every
collective is the identity. ``LocalBackend.spawn(world_size, fn, *args)`` runs
``fn(backend, *args)`` on ``world_size`` threads that share one simulated world: each
collective is a rendezvous where every rank deposits a private copy of its data, and
each rank then computes its own result from those copies, in rank order. No rank
ever reads or writes another rank's buffers.
"""

from __future__ import annotations

import math
import sys
import threading
import time
from collections.abc import Callable
from typing import Any, NoReturn, TypeVar

import numpy as np
import torch

from distutils_ml.backends.base import Backend, ReduceOp
from distutils_ml.watchdog import (
    TIMEOUT_ENV,
    CollectiveMismatchError,
    StallError,
    call_site,
    describe,
    resolve_debug,
    resolve_timeout,
)

__all__ = ["LocalBackend"]

R = TypeVar("R")

_UFUNCS = {
    ReduceOp.SUM: np.add,
    ReduceOp.PROD: np.multiply,
    ReduceOp.MAX: np.maximum,
    ReduceOp.MIN: np.minimum,
}

_current = threading.local()
_MAX_WAIT = 3600.0  # one Condition.wait at most; a huge stall_timeout would overflow it


class RankFailedError(RuntimeError):
    """Raised on ranks that were waiting in a collective when another rank failed or left."""


class _World:
    """The shared state of one simulated world: a reusable rendezvous."""

    def __init__(self, size: int, stall_timeout: float = 0.0, call_sites: bool = False) -> None:
        self.size = size
        self.stall_timeout = stall_timeout
        self.call_sites = call_sites  # debug mode: fingerprints include where each rank called
        self.cond = threading.Condition()
        self.slots: list[Any] = [None] * size
        self.arrived = 0
        self.generation = 0
        self.snapshot: tuple[Any, ...] = ()
        self.failure: tuple[int, BaseException] | None = None
        self.finished: set[int] = set()
        #: ranks inside a collective's own work before their deposit (root producing a broadcast's bytes: slow I/O
        #: or pickling in run_on_root), which the waiting ranks do not count as stalled (as an MPI job's watchdog)
        self.busy: set[int] = set()
        self.busy_ended = 0.0  # time.monotonic() when a rank last stopped being busy
        self.duplicates: list[_World] = []  # worlds of duplicate backends: they learn of failures and exits too

    def _check_alive(self, rank: int, fingerprint: tuple) -> None:
        if self.failure is not None:
            frank, exc = self.failure
            raise RankFailedError(
                f"LocalBackend rank {rank}: left {describe(*fingerprint)} because rank {frank} raised "
                f"{type(exc).__name__}: {exc}"
            )
        if self.finished:
            gone = sorted(self.finished)
            raise RankFailedError(
                f"LocalBackend rank {rank}: {describe(*fingerprint)} can never complete because rank(s) {gone} "
                "already returned from fn; every rank must call the same collectives in the same order"
            )

    def rendezvous(self, rank: int, deposit: Any, fingerprint: tuple) -> tuple[Any, ...]:
        """Deposit this rank's contribution; return every rank's, once all have arrived.

        A rank that waits a quarter of ``stall_timeout`` warns on stderr; at ``stall_timeout``
        it raises ``StallError`` naming the collective and the ranks that never arrived.
        """
        with self.cond:
            self._check_alive(rank, fingerprint)
            self.slots[rank] = deposit
            self.arrived += 1
            gen = self.generation
            if self.arrived == self.size:
                self.arrived = 0
                self.generation += 1
                self.snapshot = tuple(self.slots)
                self.slots = [None] * self.size
                self.cond.notify_all()
                return self.snapshot
            start = time.monotonic()
            warn_at = self.stall_timeout / 4
            while self.generation == gen:
                self._check_alive(rank, fingerprint)
                if not self.stall_timeout:
                    self.cond.wait()
                    continue
                waited = time.monotonic() - start
                # A rank inside this collective producing what it sends (a root's run_on_root: slow I/O) is not
                # missing, as in an MPI job's watchdog: warned about, every stall_timeout, but not a stall; the
                # stall clock starts again once it is done.
                idle = time.monotonic() - max(start, self.busy_ended)
                if idle >= self.stall_timeout and not self.busy:
                    missing = [r for r in range(self.size) if self.slots[r] is None]
                    err = StallError(
                        f"LocalBackend rank {rank}: stall: waited {waited:.1f} s in {describe(*fingerprint)} "
                        f"#{gen + 1}; rank(s) {missing} have not arrived (stall_timeout={self.stall_timeout:g} s)"
                    )
                    self.failure = self.failure or (rank, err)
                    self.cond.notify_all()
                    raise err
                if waited >= warn_at:
                    busy = f"rank(s) {sorted(self.busy)} busy inside it (not a stall)" if self.busy else ""
                    sys.stderr.write(
                        f"LocalBackend rank {rank}: warning: waiting {waited:.1f} s in {describe(*fingerprint)} "
                        f"#{gen + 1}; {busy or f'StallError after {self.stall_timeout:g} s'} "
                        f"(stall_timeout= of LocalBackend.spawn, or {TIMEOUT_ENV})\n"
                    )
                    sys.stderr.flush()
                    warn_at = self.stall_timeout if warn_at < self.stall_timeout else warn_at + self.stall_timeout
                until_stall = _MAX_WAIT if self.busy else self.stall_timeout - idle
                self.cond.wait(max(0.0, min(warn_at - waited, until_stall, _MAX_WAIT)))
            return self.snapshot

    def fail(self, rank: int, exc: BaseException) -> None:
        with self.cond:
            if self.failure is None:
                self.failure = (rank, exc)
            self.cond.notify_all()
            duplicates = list(self.duplicates)
        for world in duplicates:
            world.fail(rank, exc)

    def finish(self, rank: int) -> None:
        with self.cond:
            self.finished.add(rank)
            self.cond.notify_all()
            duplicates = list(self.duplicates)
        for world in duplicates:
            world.finish(rank)

    def duplicate(self) -> _World:
        """A new world of the same size and options, told of this one's failures and exits."""
        world = _World(self.size, self.stall_timeout, self.call_sites)
        with self.cond:
            self.duplicates.append(world)
        return world


def _fingerprint(kind: str, arr: np.ndarray | None, op: ReduceOp | None = None, root: int | None = None) -> tuple:
    if arr is None:
        return (kind, None, None, op, root)
    return (kind, arr.shape, arr.dtype.str, op, root)


class LocalBackend(Backend):
    """A backend inside one process: a world of one, or a simulated world for tests.

    Use ``dml.initialize(dml.LocalBackend)`` for a world of one (every collective is
    the identity), or :meth:`spawn` to run a function on N simulated ranks.

    Simulated ranks always compare a fingerprint of every collective (kind, shape,
    dtype as the caller passed it, op, root) and raise ``CollectiveMismatchError`` on
    every rank when they differ, ``AVG`` included (it is reduced here, not rewritten as
    a sum first). With ``spawn(..., debug=True)`` (or ``DML_DEBUG=1``) the call site
    (file and line of the call) must agree too, as in an MPI job's debug mode.

    Args:
        timeout: accepted and checked like ``MPIBackend``'s, so that
            ``dml.initialize(dml.LocalBackend, timeout=..., debug=...)`` runs code written
            for MPI unchanged; a world of one never waits, so it has no effect. Simulated
            worlds take theirs from ``spawn(..., stall_timeout=)``.
        debug: likewise accepted and checked; a world of one has nothing to compare, and
            simulated ranks always compare.

    Raises:
        TypeError: an option ``LocalBackend`` does not take (``segment_bytes``, ``comm``,
            ...: those belong to ``dml.MPIBackend``), or ``debug`` is not a bool.
        ValueError: ``timeout`` is not a finite number >= 0.
    """

    native_avg = True  # AVG reaches the fingerprint as AVG, so AVG against SUM is a mismatch

    def __init__(
        self,
        *,
        timeout: float | None = None,
        debug: bool | None = None,
        _world: _World | None = None,
        _rank: int = 0,
        **unknown: Any,
    ) -> None:
        super().__init__()
        if unknown:
            raise TypeError(
                f"LocalBackend: got the option(s) {', '.join(sorted(unknown))}; allowed: timeout, debug "
                "(other options belong to dml.MPIBackend or dml.NCCLBackend)"
            )
        if _world is None:
            self.timeout = resolve_timeout(timeout)
            self.debug = resolve_debug(debug)
        else:
            self.timeout, self.debug = _world.stall_timeout, True
        self._world = _world
        self._rank = _rank
        self._call: tuple | None = None  # the public call's fingerprint, set by _check_call

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def size(self) -> int:
        return 1 if self._world is None else self._world.size

    @staticmethod
    def spawn(
        world_size: int,
        fn: Callable[..., R],
        *args: Any,
        timeout: float | None = None,
        stall_timeout: float | None = None,
        debug: bool | None = None,
    ) -> list[R]:
        """Run ``fn(backend, *args)`` on ``world_size`` simulated ranks; return results in rank order.

        Each rank runs on its own thread with its own ``LocalBackend``; inside that
        thread ``dml.get_distributed_backend(dml.LocalBackend)`` returns it too, and
        ``backward()`` runs entirely on that thread, CUDA graphs included
        (``torch.autograd.set_multithreading_enabled(False)``). If any
        rank raises, the ranks waiting in a collective are released at once and the
        first exception is re-raised here (ranks busy outside a collective get one
        second to finish; after that they are left behind as daemon threads, and fail
        at their next collective).

        Args:
            world_size: number of ranks, at least 1.
            fn: called as ``fn(backend, *args)`` on every rank.
            timeout: seconds to wait for all ranks (None: no limit); on expiry a
                ``TimeoutError`` names the ranks still running.
            stall_timeout: seconds a rank may wait in one collective before a
                ``StallError`` names the collective (kind, shape, dtype, op, root) and
                the ranks that never arrived; a waiting rank warns on stderr at a
                quarter of it (default ``DML_TIMEOUT`` or 300; a finite number >= 0,
                0: wait forever).
            debug: also require every rank to make each collective from the same source
                line (default ``DML_DEBUG``), as an MPI job's debug mode does.

        Raises:
            ValueError: ``world_size`` is not an int >= 1, or ``timeout`` / ``stall_timeout``
                is not a finite number (> 0, resp. >= 0); raised before any rank starts.
            TypeError: ``fn`` is not callable, or ``debug`` is not a bool.

        Example:
            >>> dml.LocalBackend.spawn(3, lambda b: dml.local_rank(b))
            [0, 1, 2]
        """
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size: got {world_size!r}; allowed: an int >= 1")
        if not callable(fn):
            raise TypeError(f"fn: got {type(fn).__qualname__}; allowed: a callable taking (backend, *args)")
        if timeout is not None and (
            isinstance(timeout, bool)
            or not isinstance(timeout, (int, float))
            or not math.isfinite(timeout)
            or timeout <= 0
        ):
            raise ValueError(f"timeout: got {timeout!r}; allowed: None (no limit) or a finite number of seconds > 0")
        world = _World(world_size, resolve_timeout(stall_timeout, "stall_timeout"), resolve_debug(debug))
        results: list[Any] = [None] * world_size

        def run(rank: int) -> None:
            backend = LocalBackend(_world=world, _rank=rank)
            _current.backend = backend
            try:
                # CUDA backward passes run on the calling thread, not on autograd's one thread per device,
                # which the simulated ranks would share: a rank's end-of-backward reduction, waiting there for
                # the other ranks, would block their backward passes behind it (a deadlock).
                with torch.autograd.set_multithreading_enabled(False):
                    results[rank] = fn(backend, *args)
            except BaseException as exc:
                world.fail(rank, exc)
            else:
                world.finish(rank)

        threads = [
            threading.Thread(target=run, args=(r,), name=f"dml-local-rank-{r}", daemon=True) for r in range(world_size)
        ]
        for t in threads:
            t.start()
        deadline = None if timeout is None else time.monotonic() + timeout
        grace_end = None  # after a failure, ranks outside collectives get a second to finish
        for t in threads:
            while t.is_alive():
                t.join(0.05)
                now = time.monotonic()
                if world.failure is not None and grace_end is None:
                    grace_end = now + 1.0
                if grace_end is not None and now > grace_end:
                    raise world.failure[1]  # type: ignore[index]
                if deadline is not None and now > deadline:
                    alive = [r for r, th in enumerate(threads) if th.is_alive()]
                    err = TimeoutError(f"LocalBackend.spawn: ranks {alive} still running after {timeout} s")
                    world.fail(alive[0], err)
                    raise err
        if world.failure is not None:
            raise world.failure[1]
        return results

    def duplicate(self) -> LocalBackend:
        """A new ``LocalBackend`` over a world of its own with the same ranks (a collective on every simulated rank)."""
        if self._world is None:
            return LocalBackend(timeout=self.timeout, debug=self.debug)
        self._enter("duplicate")
        try:
            made = self._world.duplicate() if self._rank == 0 else None
            world = self._exchange(made, _fingerprint("duplicate", None))[0]
        finally:
            self._leave()
        return LocalBackend(_world=world, _rank=self._rank)

    # -- primitives ---------------------------------------------------------------

    def _check_call(self, kind: str, shape: Any, dtype: str | None, op: ReduceOp | None, root: int) -> None:
        """Fingerprint the call as the user made it; the next rendezvous compares it across ranks."""
        if self._world is not None:
            site = call_site() if self._world.call_sites else None
            self._call = (kind, None if shape is None else tuple(shape), dtype, op, root if root >= 0 else None, site)

    def _exchange(self, deposit: Any, fingerprint: tuple) -> tuple[Any, ...]:
        world = self._world
        assert world is not None
        if self._call is not None:  # the user-facing call (its dtype, not the wire view's)
            fingerprint, self._call = self._call, None
        snap = world.rendezvous(self._rank, (fingerprint, deposit), fingerprint[:5])
        prints = [s[0] for s in snap]
        if any(p != prints[0] for p in prints):
            groups: dict[str, list[int]] = {}
            for r, p in enumerate(prints):
                site = f" at {p[5]}" if len(p) > 5 and p[5] else ""
                groups.setdefault(describe(*p[:5]) + site, []).append(r)
            detail = "; ".join(f"rank(s) {ranks} called {call}" for call, ranks in groups.items())
            raise CollectiveMismatchError(
                f"LocalBackend rank {self._rank}: collective #{world.generation} differs across ranks: {detail}"
            )
        return tuple(s[1] for s in snap)

    def _allreduce(self, sendbuf: np.ndarray | None, recvbuf: np.ndarray, op: ReduceOp) -> None:
        src = recvbuf if sendbuf is None else sendbuf
        if self._world is None:
            if sendbuf is not None:
                np.copyto(recvbuf, sendbuf)
            return
        parts = self._exchange(src.copy(), _fingerprint("allreduce", src, op))
        _reduce_into(recvbuf, parts, op)

    def _bcast(self, buf: np.ndarray, root: int) -> None:
        if self._world is None:
            return
        mine = buf.copy() if self._rank == root else None
        parts = self._exchange(mine, _fingerprint("bcast", buf, root=root))
        if self._rank != root:
            np.copyto(buf, parts[root])

    def _reduce(self, sendbuf: np.ndarray | None, recvbuf: np.ndarray, op: ReduceOp, root: int) -> None:
        src = recvbuf if sendbuf is None else sendbuf
        if self._world is None:
            if sendbuf is not None:
                np.copyto(recvbuf, sendbuf)
            return
        parts = self._exchange(src.copy(), _fingerprint("reduce", src, op, root))
        if self._rank == root:
            _reduce_into(recvbuf, parts, op)

    def _allgather(self, sendbuf: np.ndarray, recvbuf: np.ndarray) -> None:
        if self._world is None:
            np.copyto(recvbuf[0, ...], sendbuf)
            return
        parts = self._exchange(sendbuf.copy(), _fingerprint("allgather", sendbuf))
        for k, part in enumerate(parts):
            np.copyto(recvbuf[k, ...], part)

    def _reduce_scatter(self, sendbuf: np.ndarray, recvbuf: np.ndarray | None, op: ReduceOp) -> None:
        out = sendbuf[self._rank, ...] if recvbuf is None else recvbuf
        if self._world is None:
            if recvbuf is not None:
                np.copyto(recvbuf, sendbuf[0, ...])
            return
        parts = self._exchange(sendbuf.copy(), _fingerprint("reduce_scatter", sendbuf, op))
        _reduce_into(out, tuple(part[self._rank, ...] for part in parts), op)

    def _barrier(self) -> None:
        if self._world is not None:
            self._exchange(None, _fingerprint("barrier", None))

    def _bcast_bytes(self, data: bytes | None, root: int, make: Callable[[], bytes] | None = None) -> bytes:
        if self._rank == root and make is not None:
            world = self._world
            if world is not None:
                with world.cond:
                    world.busy.add(self._rank)
            try:
                data = make()
            finally:
                if world is not None:
                    with world.cond:
                        world.busy.discard(self._rank)
                        world.busy_ended = time.monotonic()
                        world.cond.notify_all()
        if self._world is None:
            return data  # type: ignore[return-value]
        parts = self._exchange(data if self._rank == root else None, _fingerprint("bcast_object", None, root=root))
        return parts[root]

    def _allgather_bytes(self, data: bytes) -> list[bytes]:
        if self._world is None:
            return [data]
        return list(self._exchange(bytes(data), _fingerprint("allgather_object", None)))

    def _abort(self, message: str) -> NoReturn:
        err = RuntimeError(f"LocalBackend rank {self._rank}: {message}; the simulated world is ended")
        if self._world is not None:
            self._world.fail(self._rank, err)
        raise err


def _reduce_into(out: np.ndarray, parts: tuple[np.ndarray, ...], op: ReduceOp) -> None:
    """``out = parts[0] op parts[1] op ...``, in rank order (the same bits on every rank); AVG sums, then divides."""
    ufunc = _UFUNCS[ReduceOp.SUM if op is ReduceOp.AVG else op]
    np.copyto(out, parts[0])
    for part in parts[1:]:
        ufunc(out, part, out=out)
    if op is ReduceOp.AVG:
        np.divide(out, len(parts), out=out)


def current_spawned_backend() -> LocalBackend | None:
    """The LocalBackend of the simulated rank running on this thread, if any."""
    return getattr(_current, "backend", None)
