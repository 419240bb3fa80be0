"""The backend contract: the primitives every communication backend implements.

Public collectives (``dml.allreduce`` and friends in :mod:`distutils_ml.collectives`)
validate and adapt their arguments, then call the primitives below with plain,
contiguous, same-shaped NumPy arrays (host buffers). A backend therefore only moves
and reduces bytes; it never sees a bad argument.
"""

from __future__ import annotations

import abc
import contextlib
import enum
import functools
import operator
import pickle
import re
import threading
from collections.abc import Callable, Iterator
from typing import Any, NoReturn

import numpy as np

__all__ = ["OBSERVED", "Backend", "ReduceOp", "busy", "check_backend", "resolve_op"]


class ReduceOp(enum.Enum):
    """Reduction operators of ``allreduce`` and ``reduce``.

    ``AVG`` is the sum divided by the number of ranks (floating-point buffers only).
    """

    SUM = "sum"
    PROD = "prod"
    MAX = "max"
    MIN = "min"
    AVG = "avg"

    # Members are singletons compared by identity: hash them by identity too (C speed;
    # Enum's default hashes the name in Python, which costs on every collective).
    __hash__ = object.__hash__

    def __repr__(self) -> str:
        return f"dml.{self.name}"


_OPS: dict[Any, ReduceOp] = {op: op for op in ReduceOp}
_OPS.update({op.value: op for op in ReduceOp})
_OPS.update({op.name: op for op in ReduceOp})
_OPS.update({operator.add: ReduceOp.SUM, operator.mul: ReduceOp.PROD, max: ReduceOp.MAX, min: ReduceOp.MIN})

_ALLOWED_OPS = (
    "dml.SUM, dml.PROD, dml.MAX, dml.MIN, dml.AVG, their lower-case names ('sum', ...), "
    "operator.add, operator.mul, max or min"
)


def resolve_op(op: Any) -> ReduceOp:
    """Return the :class:`ReduceOp` that ``op`` names.

    Args:
        op: a ``ReduceOp``, its lower-case name, ``operator.add``, ``operator.mul``, ``max`` or ``min``.

    Raises:
        ValueError: ``op`` names no reduction.
    """
    try:
        return _OPS[op]
    except (KeyError, TypeError):
        raise ValueError(f"op: got {op!r}; allowed: {_ALLOWED_OPS}") from None


class Backend(abc.ABC):
    """A communication backend: one process's (or simulated rank's) view of a world.

    Users never construct the world-wide instance themselves: call
    ``dml.initialize(BackendType)`` once, then ``dml.get_distributed_backend(BackendType)``.

    Subclasses implement the primitives (``_allreduce``, ``_bcast``, ``_reduce``,
    ``_allgather``, ``_barrier``, ``_bcast_bytes``, ``_allgather_bytes``, ``_abort``;
    ``_reduce_scatter`` has a default built on ``_allreduce``).
    They receive C-contiguous NumPy arrays that were validated by
    :mod:`distutils_ml.collectives`: matching shapes and dtypes on this rank, a known op,
    a root in range. ``AVG`` and half-precision reductions are handled by the caller
    unless the backend says it reduces them natively. Subclasses call ``super().__init__()``.
    """

    #: True where the transport reduces float16/bfloat16 itself (NCCL); otherwise the
    #: collectives layer reduces them in float32 and writes the result back.
    native_half_reductions: bool = False
    #: True where the backend takes CUDA buffers itself (NCCL, CUDA-aware MPI) through
    #: ``_device_collective``; otherwise they are staged through pinned host memory.
    takes_device_buffers: bool = False
    #: True where the transport averages itself (NCCL's ncclAvg); otherwise AVG is SUM, then divide.
    native_avg: bool = False
    #: Debug mode: the public functions call ``_check_call`` before every collective.
    debug: bool = False
    #: The CUDA device index whose buffers ``_device_collective`` takes (NCCL's communicator is bound
    #: to one GPU); None: buffers on any GPU.
    device: int | None = None
    _held = 0  # the depth of _enter calls of the thread holding the backend
    _entered = 0  # outermost _enter calls so far (calls_entered)
    _root_map: Callable[[int], int] | None = None  # observe(roots=): acting_root
    _counts: Callable[[], int] | None = None  # observe(counts=): averaging_count

    def __init__(self) -> None:
        # Held by the thread inside a public collective (re-entrant: composite calls nest).
        self._entry = threading.RLock()
        # The communication thread (distutils_ml.commthread.CommThread), started at the first comm_thread().
        self._comm: Any = None
        # What close() runs (on_close), last registered first; None once closed.
        self._closers: list[Callable[[], Any]] | None = []

    def _enter(self, caller: str) -> None:
        """Claim this backend for the calling thread, or raise if another thread is inside a collective.

        Two threads calling collectives on one backend would have their messages paired up
        differently on different ranks (silent corruption), so the second one is refused
        before it sends anything. The communication thread is the exception: a collective
        waits for the jobs queued on it (gradient buckets), so it leaves after them, as the
        program ordered it on every rank. Pair every successful call with :meth:`_leave`.
        """
        comm = self._comm
        if comm is not None and comm.pending and threading.get_ident() != comm.ident:
            comm.wait(errors=False)
        if not self._entry.acquire(False):
            if comm is None or not comm.holds:
                raise busy(self, caller)
            self._entry.acquire()
        self._held += 1  # only the holder of the lock counts
        if self._held == 1:
            self._entered += 1

    def _leave(self) -> None:
        self._held -= 1
        self._entry.release()

    def averaging_count(self) -> int:
        """How many ranks a ``dml.AVG`` made now divides by: the world size, except inside ``dml.join`` once a rank
        has joined (then the ranks with data). Composite reductions that divide themselves ask it; like
        :meth:`acting_root`, inside ``dml.join`` it is a collective."""
        return self.size if self._counts is None else self._counts()

    @property
    def calls_entered(self) -> int:
        """How many outermost collectives (public calls) were entered on this backend so far: calls nested in
        another (a composite call's parts) do not count. ``dml.join`` tells one call of the user's from the next
        by it."""
        return self._entered

    def in_collective(self) -> bool:
        """Whether the calling thread is inside one of this backend's collectives now."""
        return _owner(self._entry) == threading.get_ident()

    def comm_thread(self) -> Any:
        """This backend's communication thread (a :class:`distutils_ml.commthread.CommThread`), started at the
        first call: jobs submitted to it run one after another, each holding the backend as a collective does."""
        comm = self._comm
        if comm is None:
            if self._closers is None:
                raise RuntimeError(f"{self!r} is closed: it has no communication thread")
            with _COMM_LOCK:
                comm = self._comm
                if comm is None:
                    from distutils_ml.commthread import CommThread

                    comm = self._comm = CommThread(self._entry, name=f"dml-comm-{self.rank}")
        return comm

    def wait_for_comm_thread(self, *, errors: bool = True) -> None:
        """Return once every job queued on this backend's communication thread has run (at once if none was
        started); re-raise the first error a job raised (``errors``)."""
        if self._comm is not None:
            self._comm.wait(errors=errors)

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return self._closers is None

    def on_close(self, callback: Callable[[], Any]) -> None:
        """Have :meth:`close` call ``callback()`` (a layer's resources tied to this backend: a transport, say);
        callbacks run last registered first, each once."""
        if self._closers is None:
            raise RuntimeError(f"{self!r} is closed")
        self._closers.append(callback)

    def close(self) -> None:
        """Release this backend: its communication thread (after the jobs queued on it), what was registered with
        :meth:`on_close` (its gloo transport), then the backend's own resources (the stall watchdog's thread and
        communicator; a communicator it made itself, as :meth:`duplicate`'s). A collective on every rank, in the
        same order everywhere, like the backend's other calls; a second call does nothing. Every later collective
        on it raises ``RuntimeError`` before it sends anything. Close the world backend only at the end of the job
        (``dml.initialize`` does not make another)."""
        closers = self._closers
        if closers is None:
            return
        self._closers = None
        comm = self._comm
        try:
            if comm is not None:
                comm.wait(errors=False)
                comm.close()
                self._comm = None
            for callback in reversed(closers):
                callback()
            self._release()
        finally:
            for name in OBSERVED:  # instance attributes: the hot path pays nothing for this check
                setattr(self, name, functools.partial(_closed, self, name))

    def _release(self) -> None:  # noqa: B027 - optional: backends without resources of their own keep this no-op
        """Free what this backend holds itself (:meth:`close`, after its callbacks)."""

    @contextlib.contextmanager
    def watched(self, kind: str, array: np.ndarray, op: ReduceOp | None) -> Iterator[None]:
        """Show a collective this backend does not make itself (one over a TCP ring, say) to its stall watchdog
        as one of its own while it runs (backends without a watchdog: nothing)."""
        yield

    def observe(
        self,
        observer: Callable[..., Any] | None,
        roots: Callable[[int], int] | None = None,
        counts: Callable[[], int] | None = None,
    ) -> None:
        """Route this backend's primitive calls through ``observer(name, original, *args)`` (None: stop).

        ``name`` is the primitive (``"_allreduce"``, ..., and ``"_check_call"``, the debug-mode comparison),
        ``original`` the bound primitive, which ``observer`` calls (or not) and whose result it returns. For
        layers that must see every message this backend sends in order (``dml.join``); one observer at a time.
        ``roots``, with an observer that reroutes rooted primitives: the rank acting as a given root now
        (:meth:`acting_root` answers with it); ``counts``: how many ranks an average divides by now
        (:meth:`averaging_count`).
        """
        if self._closers is None:
            raise RuntimeError(f"{self!r} is closed")
        self._observer = observer
        self._root_map = roots if observer is not None else None
        self._counts = counts if observer is not None else None
        for name in OBSERVED:
            if observer is None:
                self.__dict__.pop(name, None)
            else:
                original = getattr(type(self), name).__get__(self)
                setattr(self, name, functools.partial(observer, name, original))

    def duplicate(self) -> Backend:
        """A new backend of this kind over a duplicate of this one's communicator: the same ranks, its own message
        space (a collective on every rank, in the same order everywhere).

        For a second thread that makes collectives of its own, or a transport's setup: its calls never pair up
        with this backend's. Options (timeout, debug, segments, device) are this backend's.
        """
        raise NotImplementedError(f"{type(self).__name__} cannot duplicate its communicator")

    def _check_call(  # noqa: B027 - optional: backends without a debug mode keep this no-op
        self, kind: str, shape: Any, dtype: str | None, op: ReduceOp | None, root: int
    ) -> None:
        """Debug mode: compare this collective (as the user called it, and where) across ranks first."""

    @property
    @abc.abstractmethod
    def rank(self) -> int:
        """This process's rank, ``0 .. size-1``."""

    @property
    @abc.abstractmethod
    def size(self) -> int:
        """The number of ranks in the world."""

    @abc.abstractmethod
    def _allreduce(self, sendbuf: np.ndarray | None, recvbuf: np.ndarray, op: ReduceOp) -> None:
        """Reduce across ranks into ``recvbuf`` on every rank (``sendbuf`` None: in place).

        ``op`` is ``AVG`` only where ``native_avg`` is True: otherwise the caller sums and divides.
        """

    @abc.abstractmethod
    def _bcast(self, buf: np.ndarray, root: int) -> None:
        """Overwrite ``buf`` on every rank with root's ``buf``."""

    @abc.abstractmethod
    def _reduce(self, sendbuf: np.ndarray | None, recvbuf: np.ndarray, op: ReduceOp, root: int) -> None:
        """Reduce across ranks into root's ``recvbuf``; other ranks' ``recvbuf`` stay untouched.

        ``sendbuf`` None means ``recvbuf`` holds this rank's contribution (in place).
        """

    @abc.abstractmethod
    def _allgather(self, sendbuf: np.ndarray, recvbuf: np.ndarray) -> None:
        """Write rank k's ``sendbuf`` into ``recvbuf[k]`` on every rank."""

    def _reduce_scatter(self, sendbuf: np.ndarray, recvbuf: np.ndarray | None, op: ReduceOp) -> None:
        """Write the op over ranks of every rank's ``sendbuf[rank]`` into ``recvbuf`` (``recvbuf`` None: in place).

        ``sendbuf`` has a leading axis of ``size``; ``recvbuf`` is shaped like ``sendbuf[0]``. In place,
        the result lands in ``sendbuf[rank]`` and the other rows stay unchanged. ``op`` is ``AVG``
        only where ``native_avg`` is True. This default allreduces a copy of the whole buffer (W
        times the traffic of a real reduce-scatter); backends override it.
        """
        work = sendbuf.copy()
        self._allreduce(None, work, op)
        np.copyto(sendbuf[self.rank, ...] if recvbuf is None else recvbuf, work[self.rank, ...])

    @abc.abstractmethod
    def _barrier(self) -> None:
        """Return once every rank has entered the barrier."""

    @abc.abstractmethod
    def _bcast_bytes(self, data: bytes | None, root: int, make: Callable[[], bytes] | None = None) -> bytes:
        """Return root's bytes on every rank, of any length.

        With ``make``, root calls it *inside* the collective to produce its bytes (so slow
        work on root counts as being in the collective); ``make`` must not raise.
        """

    @abc.abstractmethod
    def _allgather_bytes(self, data: bytes) -> list[bytes]:
        """Return every rank's bytes (any lengths), in rank order, on every rank."""

    @abc.abstractmethod
    def _abort(self, message: str) -> NoReturn:
        """End the whole world with ``message``: for a failure after the ranks agreed to go on."""

    def _bcast_object(self, obj: Any, root: int) -> Any:
        """Return root's ``obj`` (a picklable Python object) on every rank; root pickles it inside the collective."""
        make = (lambda: pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)) if self.rank == root else None
        data = self._bcast_bytes(None, root, make)
        return obj if self.rank == root else pickle.loads(data)

    def _device_collective(
        self, kind: str, send: Any, recv: Any, op: ReduceOp | None, root: int
    ) -> None:  # pragma: no cover - only backends with takes_device_buffers are called
        """Run collective ``kind`` on contiguous CUDA tensors (``send`` None: in place), on the current stream."""
        raise NotImplementedError(f"{type(self).__name__} does not take CUDA buffers")

    def acting_root(self, root: int) -> int:
        """The rank that acts as ``root`` in a rooted collective made now: ``root`` itself, except inside
        ``dml.join`` once ``root`` has joined (then the lowest rank that still has data; see ``dml.join``).

        Rooted calls (``bcast``, ``reduce``, ``bcast_object``, ``run_on_root``, ``synchronize``) ask it before
        they decide which rank sends; code that prepares root's data itself (``x if backend.rank == root else
        None``) asks it too. Inside ``dml.join`` the first call of an iteration makes the iteration's small
        allgather (which ranks have data): call it on every rank with data at the same point, as a collective.
        """
        return root if self._root_map is None else self._root_map(root)

    @property
    def observed(self) -> bool:
        """Whether an observer (:meth:`observe`) sees this backend's primitives now."""
        return getattr(self, "_observer", None) is not None

    def _transport_call(self, kind: str, array: np.ndarray, op: ReduceOp | None, post: Callable[[], Any]) -> Any:
        """A call of a transport over this backend's ranks (the gloo group of the gradient buckets,
        :mod:`distutils_ml.gloo`), about to be posted: ``post()`` posts it and its result is returned. A primitive
        of its own so that :meth:`observe` sees it in order with the others: ``dml.join`` announces it, and a rank
        that has run out of data makes the same call with neutral data."""
        return post()

    def __repr__(self) -> str:
        return f"{type(self).__name__}(rank={self.rank}, size={self.size})"


_COMM_LOCK = threading.Lock()

#: The calls :meth:`Backend.observe` routes: every primitive that sends, and the debug-mode comparison.
OBSERVED = (
    "_allreduce",
    "_bcast",
    "_reduce",
    "_allgather",
    "_reduce_scatter",
    "_barrier",
    "_bcast_bytes",
    "_allgather_bytes",
    "_device_collective",
    "_transport_call",
    "_check_call",
)


def _closed(backend: Backend, name: str, *args: Any, **kwargs: Any) -> NoReturn:
    raise RuntimeError(
        f"{backend!r} was closed (Backend.close()); its {name.lstrip('_')} cannot run. Make collectives on an open "
        "backend: close one only when the job is done with it"
    )


def busy(backend: Backend, caller: str) -> RuntimeError:
    """The error for a thread that enters a collective while another thread is inside one on ``backend``."""
    owner = _owner(backend._entry)
    names = {t.ident: t.name for t in threading.enumerate()}
    me = threading.current_thread().name
    return RuntimeError(
        f"{caller}: thread {me!r} called a collective on {backend!r} while thread "
        f"{names.get(owner, 'another thread')!r} is inside one. A backend's collectives must be called from one "
        "thread at a time: ranks would pair up the two threads' messages differently and corrupt both. Make "
        "every collective from one thread, or give the other thread a backend of its own over its own "
        "communicator, e.g. dml.MPIBackend(comm=MPI.COMM_WORLD.Dup()), created on every rank in the same order"
    )


def _owner(lock: Any) -> int:
    """The ident of the thread holding RLock ``lock`` (0: none), from CPython's repr, which names it."""
    found = re.search(r"owner=(\d+)", repr(lock))
    return int(found.group(1)) if found else 0


def check_backend(backend: Any, caller: str) -> None:
    """Raise ``TypeError`` unless ``backend`` is a backend instance (functions take it first)."""
    if Backend in type(backend).__mro__:  # isinstance without the ABC machinery: this runs on every call
        return
    if not isinstance(backend, Backend):
        what = f"the class {backend.__name__}" if isinstance(backend, type) else type(backend).__qualname__
        raise TypeError(
            f"{caller}: the first argument must be a backend instance, got {what}; "
            "pass backend = dml.get_distributed_backend(dml.MPIBackend) (or your backend type) first"
        )
