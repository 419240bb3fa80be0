"""Gradient buckets across hosts over torch's gloo (``torch.distributed.ProcessGroupGloo``), made per backend.

The engine DDP uses on CPUs, in every torch wheel: its own I/O threads, which sleep until bytes arrive (so a
communication thread waiting on it does not spin on the core backward computes on, as a polled MPI transport
does), timeouts, and no socket code of ours. The group is made without ``torch.distributed.init_process_group``
(nothing global): rank 0 opens a ``TCPStore`` whose listener it binds itself, to the chosen interface's address
(``DML_SOCKET_IFNAME``, else the address its host name resolves to; 127.0.0.1 when every rank is on one host),
and broadcasts that address and port over the backend; gloo's pairs use the same interface. Its timeout is the
backend's stall timeout (``DML_TIMEOUT``) plus 10 s (``DML_GLOO_TIMEOUT`` sets it): the stall watchdog, which sees
every call, names a missing rank and its host first, and gloo's own timeout ends the call if the watchdog cannot.

The transport offers what the bucket machine needs (:func:`distutils_ml.buckets.ring_array` hands it NumPy views):

- ``allreduce``: a reduce-scatter then an allgather around a ring over gloo's ``send``/``recv`` (every element
  reduced once, on one rank, then copied, so the result is bit-identical everywhere). gloo's own allreduce took
  1.2-1.7x as long on a 10 Gbit/s, 0.1 ms link (4 KiB-64 MiB) and the same on a 1 Gbit/s, 1 ms one. Two ranks
  swap the whole array in one exchange instead (the same bytes each way, one latency instead of two; in pieces
  of 4 MiB or more, each reduced as it lands) and both reduce it in the same order, rank 0's operand first
  (bit-identical on both);
- ``reduce_scatter``: a ring over gloo's ``send``/``recv`` (gloo's own reduce-scatter costs about one allreduce
  per rank): W-1 steps, each rank sends and receives one W-th of the bucket per step, (W-1)/W in all;
- ``allgather``: a ring over the same calls, W-1 steps, each passing on the row received last. gloo's own
  allgather took 1.6-1.8x the link's time for 32 MiB per rank on a 1 Gbit/s, 1 ms link, and the calls after it
  ran at half the link's rate; the ring moves the same bytes at the link's rate.

Its sockets are this process's only: a forked child (a DataLoader worker) has them replaced by ``/dev/null`` at the
fork, so a rank that dies closes its connections at once, not when its workers end. Every rank watches the next one's
connection (``_Watch``): a receive on a tag of its own, posted at setup, that a thread waits for. A transport that ends
on purpose (closed, failed, or collected) first completes its watcher's receive; a rank that dies fails it at once
(gloo sees the connection close), and the watcher names that rank and its host and ends the job, whatever its own
ranks are doing (between two steps, say: no call of theirs would fail until the next one, and a launcher such as
SLURM may end the job first, naming nobody). Any set of ranks short of all has a watcher left.
:meth:`GlooTransport.close` (called by :meth:`Backend.close`, and at exit) ends the group, its threads and sockets.

Calls may be left in flight (``wait=False``): their first exchange is posted and the call returns; :meth:`settle`
completes them, oldest first, posting each one's later ring steps as the earlier land (the reduction of a step runs
when its bytes have arrived; a call of one exchange, as every call between two ranks is, goes on alone). A call
made while others are in flight posts its first exchange before they are waited for, so its bytes follow theirs on
the link without the pause of a round trip between them (on a 1 Gbit/s, 1 ms link each call waited for alone costs
about a millisecond of idle link). Each call takes a block of tags in
the order calls are made, the same on every rank, one per ring step: an exchange pairs with the same call's step on
its peers, whenever each rank settles its calls.

A call that fails (a timeout, a peer gone) marks the transport broken on that rank: every later call raises,
naming the first failure, so no later bucket can pair with another bucket of a peer. Every call is shown to the
backend's stall watchdog (:meth:`Backend.watched`) and counted in ``calls``; in debug mode (``DML_DEBUG``) it is
compared across ranks first, as the public collectives are (``CollectiveMismatchError`` on every rank).
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import datetime
import os
import re
import socket
import struct
import threading
import uuid
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch

from distutils_ml.backends.base import Backend, ReduceOp
from distutils_ml.watchdog import before_abort, report_and_abort

__all__ = ["GlooTransport", "GlooTransportError", "connect_gloo", "interface_addresses"]

_DTYPES = (np.dtype(np.float32), np.dtype(np.float64), np.dtype(np.int32), np.dtype(np.int64))
_NO_TIMEOUT_S = 1800.0  # the stall timeout turned off (0): gloo's default
_AFTER_WATCHDOG_S = 10.0
TIMEOUT_ENV = "DML_GLOO_TIMEOUT"

# The watch's tags: above every call's block (_next_tag keeps those below 2**30).
_WATCH_TAG = 1 << 30
_WATCH_WAIT = datetime.timedelta(days=3650)  # never, in effect (the default would be gloo's timeout)
_GOODBYE_WAIT = datetime.timedelta(seconds=5)
_ABORT_GOODBYE_WAIT = datetime.timedelta(seconds=1)
_REPORT_GRACE_S = 1.0  # from a watcher's report to its abort
_LOCAL_TIMEOUT = "Application timeout"  # gloo's word for a pending receive failed by this group's own timeout


class GlooTransportError(RuntimeError):
    """A transport call failed, or an earlier one did on this rank (the transport is then broken)."""


class GlooTransport:
    """A gloo process group over a backend's ranks, for gradient buckets (the module's docstring)."""

    def __init__(
        self,
        backend: Backend,
        group: Any,
        where: str,
        store: Any,
        sockets: dict[int, str],
        *,
        peers: dict[str, str],
        watched: str,
    ) -> None:
        self.size = backend.size
        self.rank = backend.rank
        self._backend = weakref.proxy(backend)  # the backend keeps its transport (transport_for), not the reverse
        self._group = group
        # Watch the next rank's connection (a thread, ended with the group); the finalizer ends the group, even for
        # a transport collected unclosed (its watcher is told first, so it is not taken for a rank that died).
        self._watch = _Watch(group, self.rank, self.size, watched, backend.MPI)
        self._ender = weakref.finalize(self, _end, group, self._watch)
        self._ender.atexit = False  # at exit _close_all closes it, before MPI is finalized
        self._store = store  # the rendezvous store lives as long as the group
        #: The group's and the store's sockets in this process: descriptor -> ``socket:[inode]``.
        self.sockets = sockets
        #: Where this rank's gloo device listens ("address" of the chosen interface).
        self.where = where
        #: Every rank's gloo address -> its ranks and host ("rank(s) [2, 3] on node-b"), to name a failed peer.
        self.peers = peers
        self._broken: str | None = None
        self._free: list[np.ndarray] = []  # scratch buffers no call in flight holds
        self._flying: collections.deque[_Flight] = collections.deque()  # calls posted, oldest first
        self._answering = False  # inside answering(): calls another rank announced (dml.join)
        self._tag = 0
        #: Operations run, by kind: what proves that a transfer went over gloo rather than the backend.
        self.calls: dict[str, int] = {"allreduce": 0, "reduce_scatter": 0, "allgather": 0}

    def supports(self, array: np.ndarray, op: ReduceOp) -> bool:
        """Whether this transport reduces ``array`` with ``op`` (else the backend's collective is used)."""
        return (
            array.dtype in _DTYPES and array.flags.c_contiguous and (op is not ReduceOp.AVG or array.dtype.kind == "f")
        )

    # -- the calls ----------------------------------------------------------------------------------------------

    def allreduce(self, array: np.ndarray, op: ReduceOp, *, wait: bool = True) -> None:
        """Reduce ``array`` (contiguous, in place) with ``op`` over every rank; AVG divides the sum.

        ``wait=False`` leaves it in flight (its first exchange posted; :meth:`settle` completes it)."""
        flat = array.reshape(-1)
        if self.size == 1 or flat.size == 0:
            return
        flight = _Flight("allreduce", array, op, None)
        self._start(flight, self._ring_allreduce(flight, flat, op), wait)

    def reduce_scatter(
        self,
        sendbuf: np.ndarray,
        recvbuf: np.ndarray,
        op: ReduceOp,
        *,
        wait: bool = True,
        done: Callable[[BaseException | None], None] | None = None,
    ) -> None:
        """``recvbuf`` = the op over ranks of every rank's ``sendbuf[rank]`` (sendbuf: (W, n), left unchanged
        but for ``recvbuf``, which may be ``sendbuf[rank]`` itself). ``wait=False``: left in flight; ``done`` is
        called when it has completed (None) or failed (the error)."""
        if self.size == 1:
            np.copyto(recvbuf, sendbuf[0])
        elif recvbuf.size:
            flight = _Flight("reduce_scatter", recvbuf, op, done)
            rows = sendbuf.reshape(self.size, -1)
            self._start(flight, self._ring_reduce_scatter(flight, rows, recvbuf.reshape(-1), op), wait)
            return
        if done is not None:
            done(None)

    def allgather(
        self,
        sendbuf: np.ndarray,
        recvbuf: np.ndarray,
        *,
        wait: bool = True,
        done: Callable[[BaseException | None], None] | None = None,
    ) -> None:
        """``recvbuf[k]`` = rank k's ``sendbuf`` (recvbuf: (W, n); sendbuf may be ``recvbuf[rank]`` itself).
        ``wait=False``: left in flight; ``done`` is called when it has completed (None) or failed (the error)."""
        rows = recvbuf.reshape(self.size, -1)
        mine = sendbuf.reshape(-1)
        if self.size == 1 or mine.size == 0:
            if mine.ctypes.data != rows[self.rank].ctypes.data:
                np.copyto(rows[self.rank], mine)
            if done is not None:
                done(None)
            return
        flight = _Flight("allgather", sendbuf, None, done)
        self._start(flight, self._ring_allgather(flight, mine, rows), wait)

    def settle(self, keep: int = 0) -> None:
        """Complete the calls in flight, oldest first, until ``keep`` are left (the newest ones)."""
        while len(self._flying) > keep:
            flight = self._flying[0]
            try:
                with self._backend.watched(flight.kind, flight.array, flight.op):
                    while flight.works is not None:
                        for work in flight.works:
                            work.wait()
                        flight.works = next(flight.steps, None)  # reduces what arrived, posts the next step
            except BaseException as e:
                raise self._fail(flight.kind, flight.array, e) from e
            if not self._flying or self._flying[0] is not flight:  # abandoned meanwhile: closed from another thread
                raise GlooTransportError(f"rank {self.rank}: {self._broken} while a {flight.kind} was in flight")
            self._flying.popleft()
            self._release(flight)
            if flight.done is not None:
                flight.done(None)

    @contextlib.contextmanager
    def answering(self) -> Iterator[None]:
        """Calls made inside answer ones another rank announced (``dml.join``'s joined ranks): their debug-mode
        comparison was announced and answered on its own, so they make none."""
        self._answering = True
        try:
            yield
        finally:
            self._answering = False

    @property
    def in_flight(self) -> int:
        """How many calls are in flight (posted, not completed)."""
        return len(self._flying)

    def close(self) -> None:
        """End the group (its threads and sockets) and the store; later calls raise. Called at exit for every
        transport, before MPI is finalized: gloo's threads then end while the interpreter is whole, not in its
        teardown (where a thread torn down inside C++ aborts the process)."""
        if self._broken is None:
            self._broken = "the transport was closed"
        self._abandon(GlooTransportError(f"rank {self.rank}: the gloo transport was closed"))
        _open.discard(self)
        self._end_group()
        self._store, self.sockets, self._free = None, {}, []

    def _end_group(self) -> None:
        """Shut the group down: its threads and connections end, and no exchange still posted lands later (in
        buffers that calls abandoned with it held); peers in a call with this rank learn it at once."""
        self._group = None
        self._ender()

    # -- machinery ----------------------------------------------------------------------------------------------

    def _start(self, flight: _Flight, steps: Iterator[list[Any]], wait: bool) -> None:
        """Post the first exchange of a call (``steps``, a generator over its ring steps), queue it, and with
        ``wait`` complete every call in flight."""
        flight.steps = steps
        flight.tag = self._next_tag()
        try:
            self._post(flight)
        except BaseException as e:
            if flight.done is not None:
                flight.done(e)
            raise
        self._flying.append(flight)
        if wait or self._backend.observed:  # observed (dml.join): a rank that has run out of data makes each
            self.settle()  # announced call whole before the next primitive, so none is left in flight here

    def _post(self, flight: _Flight) -> None:
        """Check the call (the transport whole; in debug mode, the same call on every rank) and post its first
        exchange, as a primitive of the backend (``dml.join`` sees it); nothing waits here (:meth:`settle` does)."""
        kind, array, op = flight.kind, flight.array, flight.op
        if self._broken is not None:
            raise GlooTransportError(
                f"rank {self.rank}: the gloo transport of the gradient buckets is broken by an earlier failure "
                f"({self._broken}); no bucket is sent after it. Restart the job (from a checkpoint)"
            )
        self.calls[kind] += 1
        # Debug mode: compared across ranks first, as the public collectives are (a mismatch raises on every rank
        # before anything is sent: the transport stays whole).
        if self._backend.debug and not self._answering:
            self._backend._check_call(kind, tuple(array.shape), str(array.dtype), op, -1)
        try:
            flight.works = self._backend._transport_call(kind, array, op, lambda: next(flight.steps, None))
        except BaseException as e:
            raise self._fail(kind, array, e) from e

    def _fail(self, kind: str, array: np.ndarray, e: BaseException) -> GlooTransportError:
        """Mark the transport broken by ``e`` (in ``kind``), abandon the calls in flight; the error to raise."""
        if self._broken is None:
            self._broken = f"{kind} of {array.size} {array.dtype} on rank {self.rank}: {type(e).__name__}: {e}"
        error = GlooTransportError(
            f"rank {self.rank}: the gloo transport of the gradient buckets failed in {kind} "
            f"({type(e).__name__}: {e}){self._named(str(e))}; every later bucket on this rank raises. A peer may "
            "have ended or be unreachable"
        )
        self._abandon(error)
        self._end_group()
        return error

    def _abandon(self, error: BaseException) -> None:
        """Drop every call in flight (the transport is broken or closed): each one's ``done`` learns ``error``."""
        flying, self._flying = list(self._flying), collections.deque()
        for flight in flying:
            flight.steps.close()
            done, flight.done = flight.done, None  # told once
            if done is not None:
                with contextlib.suppress(Exception):
                    done(error)

    def _scratch(self, nbytes: int) -> np.ndarray:
        """A scratch buffer of ``nbytes`` that no call in flight holds (kept for reuse: fresh memory is slow to
        touch); :meth:`_release` gives it back."""
        fits = [k for k, b in enumerate(self._free) if b.nbytes >= nbytes]
        if fits:
            k = min(fits, key=lambda k: self._free[k].nbytes)
            return self._free.pop(k)
        if self._free:  # too small: replaced by a larger one
            self._free.pop(max(range(len(self._free)), key=lambda k: self._free[k].nbytes))
        return np.empty(nbytes, dtype=np.uint8)

    def _release(self, flight: _Flight) -> None:
        if flight.scratch is not None:
            self._free.append(flight.scratch)
            flight.scratch = None

    def _named(self, error: str) -> str:
        """The ranks and hosts of the peer addresses ``error`` mentions (gloo names a peer by its address only)."""
        found = [a for a in dict.fromkeys(re.findall(r"\d+\.\d+\.\d+\.\d+", error)) if a in self.peers]
        return f" ({'; '.join(f'{a} is {self.peers[a]}' for a in found)})" if found else ""

    def _ring_reduce_scatter(
        self, flight: _Flight, rows: np.ndarray, out: np.ndarray, op: ReduceOp
    ) -> Iterator[list[Any]]:
        """W-1 steps: send a partial of part (r-s-1) to the next rank, receive one of part (r-s-2) from the previous,
        add this rank's own; after the last step the part received is this rank's, fully reduced into ``out``.
        Two scratch rows alternate: one is sent while the other receives. A generator: it yields each step's
        posted exchange, and goes on once that has landed."""
        W, r = self.size, self.rank
        n = rows.shape[1]
        flight.scratch = self._scratch(2 * n * rows.dtype.itemsize)
        bufs = flight.scratch[: 2 * n * rows.dtype.itemsize].view(rows.dtype).reshape(2, n)
        ufunc = _UFUNCS[op]
        right, left = (r + 1) % W, (r - 1) % W
        sending = rows[(r - 1) % W]
        for s in range(W - 1):
            got = bufs[s % 2]
            yield self._exchange(sending, right, got, left, flight.tag + s)
            own = rows[(r - s - 2) % W]
            if s == W - 2:
                ufunc(got, own, out=out)  # out may be own (this rank's row): element by element, in place
            else:
                ufunc(got, own, out=got)
                sending = got
        if op is ReduceOp.AVG:
            np.divide(out, W, out=out)

    def _ring_allreduce(self, flight: _Flight, flat: np.ndarray, op: ReduceOp) -> Iterator[list[Any]]:
        """A reduce-scatter then an allgather around the ring, in place, over W parts of ``flat`` (sizes differ by
        at most one element): 2(W-1)/W of it sent and received per rank. Each part is reduced once, in ring order,
        on one rank, then copied to the others: every rank gets the same bits. A generator, as above.

        Two ranks instead swap the whole array in one exchange (the same bytes each way) and both reduce it, rank 0's
        operand first: one latency instead of two, and a call left in flight needs no ring step posted by
        :meth:`settle` to go on."""
        W, r = self.size, self.rank
        ufunc = _UFUNCS[op]
        if W == 2:  # one exchange of the whole array each way (the ring's bytes, one latency, nothing to drive)
            flight.scratch = self._scratch(flat.nbytes)
            got = flight.scratch[: flat.nbytes].view(flat.dtype)
            # In pieces, every one posted now, receives first: each piece is added as it lands, while the next ones
            # are on the wire (added at the end, 64 MiB took 10-20 % longer than the ring at 10 Gbit/s).
            step = max(_PIECE_BYTES // flat.itemsize, -(-flat.size // _PIECES))
            pieces = [slice(a, a + step) for a in range(0, flat.size, step)]
            peer, group = 1 - r, self._group
            recvs = [group.recv([torch.from_numpy(got[p])], peer, flight.tag + j) for j, p in enumerate(pieces)]
            sends = [group.send([torch.from_numpy(flat[p])], peer, flight.tag + j) for j, p in enumerate(pieces)]
            for p, recv, sent in zip(pieces, recvs, sends, strict=True):
                yield [recv, sent]
                mine, theirs = flat[p], got[p]
                ufunc(*((mine, theirs) if r == 0 else (theirs, mine)), out=mine)  # rank 0's operand first: same bits
                if op is ReduceOp.AVG:
                    np.divide(mine, W, out=mine)
            return
        n = flat.size
        bounds = [k * n // W for k in range(W + 1)]
        part = [flat[bounds[k] : bounds[k + 1]] for k in range(W)]
        scratch = flight.scratch = self._scratch(max(bounds[k + 1] - bounds[k] for k in range(W)) * flat.itemsize)
        right, left = (r + 1) % W, (r - 1) % W
        for s in range(W - 1):  # reduce-scatter: part (r-s-1) goes right, part (r-s-2) comes from the left
            mine = part[(r - s - 2) % W]
            got = scratch[: mine.nbytes].view(flat.dtype)
            yield self._exchange(part[(r - s - 1) % W], right, got, left, flight.tag + s)
            ufunc(got, mine, out=mine)  # the partial sum this rank sends on next
        if op is ReduceOp.AVG:
            np.divide(part[r], W, out=part[r])
        for s in range(W - 1):  # allgather: the reduced parts go once around the ring
            yield self._exchange(part[(r - s) % W], right, part[(r - s - 1) % W], left, flight.tag + W - 1 + s)

    def _ring_allgather(self, flight: _Flight, mine: np.ndarray, rows: np.ndarray) -> Iterator[list[Any]]:
        """W-1 steps, each passing on the row received last: every row goes once around the ring."""
        W, r = self.size, self.rank
        if mine.ctypes.data != rows[r].ctypes.data:
            np.copyto(rows[r], mine)
        for s in range(W - 1):
            yield self._exchange(rows[(r - s) % W], (r + 1) % W, rows[(r - s - 1) % W], (r - 1) % W, flight.tag + s)

    def _exchange(self, send: np.ndarray, to: int, into: np.ndarray, source: int, tag: int) -> list[Any]:
        """Post: send ``send`` to rank ``to`` while receiving ``into`` from rank ``source``; the two works to wait
        for. The receive is posted first: data that reaches gloo before its receive is posted takes a slow path
        (measured on a 1 Gbit/s, 1 ms link: 32 MiB each way took 0.56 s with the send posted first, 0.28 s, the
        link's rate, with the receive first)."""
        recv = self._group.recv([torch.from_numpy(into)], source, tag)
        sent = self._group.send([torch.from_numpy(send)], to, tag)
        return [recv, sent]

    def _next_tag(self) -> int:
        """The first tag of the next call: each call has its own block, one tag per ring step (2(W-1) at most; with
        two ranks, one per piece of an allreduce, ``_PIECES`` at most), in the order calls are made, the same on every
        rank. An exchange's tag so pairs it with the same call's step on its peers whatever the calls were settled in
        between (ranks may complete calls at different points)."""
        span = _PIECES if self.size == 2 else 2 * max(self.size - 1, 1)
        self._tag = (self._tag + span) % ((1 << 30) - (1 << 30) % span)
        return self._tag


def _end(group: Any, watch: _Watch) -> None:
    """End a transport's group (once: its finalizer): its watcher told, its own watch released, then shut down."""
    watch.end(group)
    with contextlib.suppress(Exception):
        group.shutdown()
    with contextlib.suppress(Exception):
        group.abort()


class _Watch:
    """This rank's watch on the next rank's connection (the module's docstring).

    A receive from the next rank on ``_WATCH_TAG``, posted at setup; a thread waits for it. The next rank completes
    it when its transport ends on purpose (:meth:`end`); gloo fails it as soon as that rank's connections close
    otherwise, and the thread prints who ended and aborts the job. gloo's own timeout does not apply (a timed-out
    receive would break the group), and a failure this rank's own group made (a call's timeout breaks every pending
    receive of the group) is left to the call that timed out."""

    def __init__(self, group: Any, rank: int, size: int, named: str, MPI: Any) -> None:
        self.rank, self.ending = rank, False
        self.watched, self.watcher = (rank + 1) % size, (rank - 1) % size
        work = group.recv([torch.zeros(1)], self.watched, _WATCH_TAG)
        self._thread = threading.Thread(
            target=self._wait, args=(work, named, MPI), name=f"dml-gloo-watch-{rank}", daemon=True
        )
        self._thread.start()

    def _wait(self, work: Any, named: str, MPI: Any) -> None:
        try:
            work.wait(_WATCH_WAIT)  # completed: the next rank's transport ended on purpose
        except Exception as e:
            if self.ending or _LOCAL_TIMEOUT in str(e):
                return
            # Said at once (a launcher may end the job any moment now), the abort a moment later: a rank whose own
            # gloo call timed out closes its connections too, and says why in that moment.
            report_and_abort(
                MPI,
                self.rank,
                f"{named} ended (killed or crashed), lost its link, or failed in a gloo call of its own: its gloo "
                f"connection closed while its transport was open ({type(e).__name__}: {e}). Look at that rank's "
                "output and its host's log",
                grace=_REPORT_GRACE_S,
            )

    def tell(self, group: Any, wait: datetime.timedelta = _GOODBYE_WAIT) -> None:
        """Tell this rank's watcher that this rank's transport ends on purpose (once)."""
        if not self.ending:
            self.ending = True
            with contextlib.suppress(Exception):  # the watcher's transport may have ended already: nothing to tell
                group.send([torch.zeros(1)], self.watcher, _WATCH_TAG).wait(wait)

    def end(self, group: Any) -> None:
        """Tell this rank's watcher (:meth:`tell`), release this rank's own watch, and wait for its thread."""
        self.tell(group)
        if self._thread.is_alive():  # a receive timed out fails every pending one of the group, the watch's too
            with contextlib.suppress(Exception):
                group.recv([torch.zeros(1)], self.watched, _WATCH_TAG + 1).wait(datetime.timedelta(milliseconds=1))
        if threading.current_thread() is not self._thread:
            self._thread.join()


class _Flight:
    """A call in flight: ``steps`` posts each ring step's exchange and yields its ``works`` (None once done);
    ``scratch``, the buffer it holds; ``done``, told when it completes (None) or fails (the error)."""

    def __init__(
        self, kind: str, array: np.ndarray, op: ReduceOp | None, done: Callable[[BaseException | None], None] | None
    ) -> None:
        self.kind, self.array, self.op, self.done = kind, array, op, done
        self.steps: Iterator[list[Any]] = iter(())
        self.works: list[Any] | None = None
        self.scratch: np.ndarray | None = None
        self.tag = 0  # its first exchange's


# Two ranks' allreduce goes in pieces of at least _PIECE_BYTES, _PIECES at most (each piece takes a tag).
_PIECE_BYTES = 4 << 20
_PIECES = 64

_UFUNCS = {
    ReduceOp.SUM: np.add,
    ReduceOp.AVG: np.add,
    ReduceOp.PROD: np.multiply,
    ReduceOp.MAX: np.maximum,
    ReduceOp.MIN: np.minimum,
}


def connect_gloo(backend: Backend, hosts: list[str], ifname_env: str) -> tuple[GlooTransport | None, str]:
    """Make the backend's gloo group (a collective on every rank); (transport, "") or (None, why) on this rank."""
    from distutils_ml.objects import allgather_object, bcast_object

    W, r = backend.size, backend.rank
    one_host = len(set(hosts)) == 1
    address, why = _my_address(ifname_env, one_host)
    timeout_s = _timeout(float(getattr(backend, "timeout", 0.0) or 0.0))
    timeout = datetime.timedelta(seconds=timeout_s)
    store, port = None, 0
    before = _sockets()
    if r == 0 and not why:
        fd = -1
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as listener:
                listener.bind((address, 0))  # only the chosen interface listens
                listener.listen(max(W, 8))
                port = listener.getsockname()[1]
                fd = listener.detach()  # the store takes the descriptor itself and closes it when it ends
            store = torch.distributed.TCPStore(
                address, port, W, True, timeout, wait_for_workers=False, master_listen_fd=fd
            )
        except Exception as e:  # reported through the broadcast: every rank fails alike
            if fd >= 0 and store is None:
                with contextlib.suppress(OSError):
                    os.close(fd)
            why = f"rank 0 could not open the rendezvous store on {address}: {type(e).__name__}: {e}"
    where = bcast_object(backend, (address, port, uuid.uuid4().hex, why) if r == 0 else None)
    if where[3]:
        return None, where[3]
    group, problem = None, why
    if store is None and not problem:
        try:
            store = torch.distributed.TCPStore(where[0], where[1], W, False, timeout)
        except Exception as e:
            problem = f"could not reach the rendezvous store on {where[0]}:{where[1]}: {type(e).__name__}: {e}"
    # Every rank holds the store before any makes its group: gloo's timeout then runs from one moment on every rank,
    # and a rank that came late (a slow start, a loaded host) is waited for by this collective, under the stall
    # watchdog, which names it; not by gloo's timeout, which would fail the group on the punctual ranks alone.
    reached = allgather_object(backend, problem)
    if any(reached):
        return None, "; ".join(f"rank {k}: {w}" for k, w in enumerate(reached) if w)
    try:
        options = torch.distributed.ProcessGroupGloo._Options()
        options._devices = [torch.distributed.ProcessGroupGloo.create_device(hostname=address)]
        options._timeout = timeout
        group = torch.distributed.ProcessGroupGloo(
            torch.distributed.PrefixStore(f"dml/{where[2]}", store), r, W, options
        )
    except Exception as e:
        problem = f"{type(e).__name__}: {e}"
    outcome = allgather_object(backend, (problem, address))
    failed = {k: w for k, (w, _) in enumerate(outcome) if w}
    if failed:
        if group is not None:
            with contextlib.suppress(Exception):
                group.abort()
        return None, "; ".join(f"rank {k}: {w}" for k, w in failed.items())
    mine = {fd: what for fd, what in _sockets().items() if fd not in before}
    at: dict[str, list[int]] = {}
    for k, (_, a) in enumerate(outcome):
        at.setdefault(a, []).append(k)
    peers = {a: f"rank(s) {ks} on {', '.join(dict.fromkeys(hosts[k] for k in ks))}" for a, ks in at.items()}
    watched = f"rank {(r + 1) % W} on {hosts[(r + 1) % W]}"
    transport = GlooTransport(backend, group, address, store, mine, peers=peers, watched=watched)
    _open.add(transport)
    if not _hooks:  # once per process
        _hooks.append(True)
        atexit.register(_close_all)  # after mpi4py's finalizer was registered: runs before it
        before_abort(_tell_watchers)
        os.register_at_fork(after_in_child=_drop_in_child)
    return transport, ""


# The transports not closed yet (weakly: one dropped unclosed is still collected).
_open: weakref.WeakSet[GlooTransport] = weakref.WeakSet()
_hooks: list[bool] = []


def _close_all() -> None:
    """At exit: close every transport while the interpreter is whole."""
    for transport in list(_open):
        transport.close()


def _tell_watchers() -> None:
    """Before this rank aborts the job: every open transport tells its watcher, which then does not report this
    rank as one that died (the rank that aborts has said why)."""
    for transport in list(_open):
        group = transport._group
        if group is not None:
            transport._watch.tell(group, _ABORT_GOODBYE_WAIT)


def _sockets() -> dict[int, str]:
    """This process's socket descriptors: fd -> ``socket:[inode]`` (empty where /proc is missing)."""
    found: dict[int, str] = {}
    with contextlib.suppress(OSError):
        for name in os.listdir("/proc/self/fd"):
            with contextlib.suppress(OSError):
                target = os.readlink(f"/proc/self/fd/{name}")
                if target.startswith("socket:"):
                    found[int(name)] = target
    return found


def _drop_in_child() -> None:
    """In a forked child: point every transport's socket descriptors at /dev/null (the numbers stay taken, so
    nothing the child opens is closed by a stray close), so only the rank itself holds its connections."""
    transports = list(_open)
    if not transports:
        return
    null = os.open(os.devnull, os.O_RDWR)
    try:
        for transport in transports:
            for fd, what in transport.sockets.items():
                with contextlib.suppress(OSError):
                    if os.readlink(f"/proc/self/fd/{fd}") == what:  # still the transport's (not a reused number)
                        os.dup2(null, fd)
    finally:
        os.close(null)


def _timeout(stall: float) -> float:
    """gloo's timeout: ``DML_GLOO_TIMEOUT`` if set, else a little after the stall watchdog's (whose report names the
    missing rank and its host), else gloo's default where stall detection is off."""
    text = os.environ.get(TIMEOUT_ENV, "").strip()
    if text:
        try:
            value = float(text)
        except ValueError:
            value = -1.0
        if not value > 0:
            raise ValueError(f"{TIMEOUT_ENV}={text!r}; allowed: seconds > 0")
        return value
    return stall + _AFTER_WATCHDOG_S if stall else _NO_TIMEOUT_S


def _my_address(ifname_env: str, one_host: bool) -> tuple[str, str]:
    """(this rank's address for the store and gloo, "") or ("", why)."""
    wanted = [x.strip() for x in os.environ.get(ifname_env, "").split(",") if x.strip()]
    if one_host and not wanted:
        return "127.0.0.1", ""
    if wanted:
        found = interface_addresses(wanted)
        if not found:
            return "", f"{ifname_env}={','.join(wanted)}: no IPv4 address on those interfaces here"
        return found[0], ""
    try:
        return socket.gethostbyname(socket.gethostname()), ""
    except OSError as e:
        return "", f"the host name {socket.gethostname()!r} does not resolve ({e}); set {ifname_env}"


def interface_addresses(wanted: list[str] | None = None) -> list[str]:
    """This host's IPv4 addresses (of the interfaces named in ``wanted``, if given), loopback last."""
    found: list[str] = []
    try:
        import fcntl

        names = [name for _, name in socket.if_nameindex()]
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            for name in names:
                if wanted and name not in wanted:
                    continue
                with contextlib.suppress(OSError):
                    packed = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name[:15].encode()))  # SIOCGIFADDR
                    found.append(socket.inet_ntoa(packed[20:24]))
    except (ImportError, OSError, AttributeError):  # not Linux: what the host name resolves to
        with contextlib.suppress(OSError):
            found = socket.gethostbyname_ex(socket.gethostname())[2]
    return sorted(dict.fromkeys(found), key=lambda a: a.startswith("127."))
