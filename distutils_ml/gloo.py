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
  1.2-1.7x as long on a 10 Gbit/s, 0.1 ms link (4 KiB-64 MiB) and the same on a 1 Gbit/s, 1 ms one;
- ``reduce_scatter``: a ring over gloo's ``send``/``recv`` (gloo's own reduce-scatter costs about one allreduce
  per rank): W-1 steps, each rank sends and receives one W-th of the bucket per step, (W-1)/W in all;
- ``allgather``: a ring over the same calls, W-1 steps, each passing on the row received last. gloo's own
  allgather took 1.6-1.8x the link's time for 32 MiB per rank on a 1 Gbit/s, 1 ms link, and the calls after it
  ran at half the link's rate; the ring moves the same bytes at the link's rate.

Its sockets are this process's only: a forked child (a DataLoader worker) has them replaced by ``/dev/null`` at the
fork, so a rank that dies closes its connections at once and its peers learn it then, not when its workers end.
:meth:`GlooTransport.close` (called by :meth:`Backend.close`, and at exit) ends the group, its threads and sockets.

A call that fails (a timeout, a peer gone) marks the transport broken on that rank: every later call raises,
naming the first failure, so no later bucket can pair with another bucket of a peer. Every call is shown to the
backend's stall watchdog (:meth:`Backend.watched`) and counted in ``calls``; in debug mode (``DML_DEBUG``) it is
compared across ranks first, as the public collectives are (``CollectiveMismatchError`` on every rank).
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import os
import re
import socket
import struct
import uuid
import weakref
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from distutils_ml.backends.base import Backend, ReduceOp

__all__ = ["GlooTransport", "GlooTransportError", "connect_gloo", "interface_addresses"]

_DTYPES = (np.dtype(np.float32), np.dtype(np.float64), np.dtype(np.int32), np.dtype(np.int64))
_NO_TIMEOUT_S = 1800.0  # the stall timeout turned off (0): gloo's default
_AFTER_WATCHDOG_S = 10.0
TIMEOUT_ENV = "DML_GLOO_TIMEOUT"


class GlooTransportError(RuntimeError):
    """A transport call failed, or an earlier one did on this rank (the transport is then broken)."""


class GlooTransport:
    """A gloo process group over a backend's ranks, for gradient buckets (the module's docstring)."""

    def __init__(
        self, backend: Backend, group: Any, where: str, store: Any, sockets: dict[int, str], *, peers: dict[str, str]
    ) -> None:
        self.size = backend.size
        self.rank = backend.rank
        self._backend = weakref.proxy(backend)  # the backend keeps its transport (transport_for), not the reverse
        self._group = group
        self._store = store  # the rendezvous store lives as long as the group
        #: The group's and the store's sockets in this process: descriptor -> ``socket:[inode]``.
        self.sockets = sockets
        #: Where this rank's gloo device listens ("address" of the chosen interface).
        self.where = where
        #: Every rank's gloo address -> its ranks and host ("rank(s) [2, 3] on node-b"), to name a failed peer.
        self.peers = peers
        self._broken: str | None = None
        self._scratch = np.empty(0, dtype=np.uint8)
        self._tag = 0
        #: Operations run, by kind: what proves that a transfer went over gloo rather than the backend.
        self.calls: dict[str, int] = {"allreduce": 0, "reduce_scatter": 0, "allgather": 0}

    def supports(self, array: np.ndarray, op: ReduceOp) -> bool:
        """Whether this transport reduces ``array`` with ``op`` (else the backend's collective is used)."""
        return (
            array.dtype in _DTYPES and array.flags.c_contiguous and (op is not ReduceOp.AVG or array.dtype.kind == "f")
        )

    # -- the calls ----------------------------------------------------------------------------------------------

    def allreduce(self, array: np.ndarray, op: ReduceOp) -> None:
        """Reduce ``array`` (contiguous, in place) with ``op`` over every rank; AVG divides the sum."""
        flat = array.reshape(-1)
        if self.size == 1 or flat.size == 0:
            return
        with self._call("allreduce", array, op):
            self._ring_allreduce(flat, op)

    def reduce_scatter(self, sendbuf: np.ndarray, recvbuf: np.ndarray, op: ReduceOp) -> None:
        """``recvbuf`` = the op over ranks of every rank's ``sendbuf[rank]`` (sendbuf: (W, n), left unchanged;
        ``recvbuf`` may be ``sendbuf[rank]`` itself)."""
        if self.size == 1:
            np.copyto(recvbuf, sendbuf[0])
            return
        if recvbuf.size == 0:
            return
        with self._call("reduce_scatter", recvbuf, op):
            self._ring_reduce_scatter(sendbuf.reshape(self.size, -1), recvbuf.reshape(-1), op)

    def allgather(self, sendbuf: np.ndarray, recvbuf: np.ndarray) -> None:
        """``recvbuf[k]`` = rank k's ``sendbuf`` (recvbuf: (W, n); sendbuf may be ``recvbuf[rank]`` itself)."""
        rows = recvbuf.reshape(self.size, -1)
        mine = sendbuf.reshape(-1)
        if self.size == 1 or mine.size == 0:
            if mine.ctypes.data != rows[self.rank].ctypes.data:
                np.copyto(rows[self.rank], mine)
            return
        with self._call("allgather", sendbuf, None):
            if mine.ctypes.data != rows[self.rank].ctypes.data:
                np.copyto(rows[self.rank], mine)
            W, r = self.size, self.rank
            for s in range(W - 1):  # pass along the row received last: every row goes once around the ring
                self._exchange(rows[(r - s) % W], (r + 1) % W, rows[(r - s - 1) % W], (r - 1) % W)

    def close(self) -> None:
        """End the group (its threads and sockets) and the store; later calls raise. Called at exit for every
        transport, before MPI is finalized: gloo's threads then end while the interpreter is whole, not in its
        teardown (where a thread torn down inside C++ aborts the process)."""
        if self._broken is None:
            self._broken = "the transport was closed"
        _open.discard(self)
        group, self._group = self._group, None
        self._store, self.sockets = None, {}
        if group is not None:
            with contextlib.suppress(Exception):
                group.shutdown()
            with contextlib.suppress(Exception):
                group.abort()
            del group

    # -- machinery ----------------------------------------------------------------------------------------------

    @contextlib.contextmanager
    def _call(self, kind: str, array: np.ndarray, op: ReduceOp | None) -> Iterator[None]:
        if self._broken is not None:
            raise GlooTransportError(
                f"rank {self.rank}: the gloo transport of the gradient buckets is broken by an earlier failure "
                f"({self._broken}); no bucket is sent after it. Restart the job (from a checkpoint)"
            )
        self.calls[kind] += 1
        if self._backend.debug:  # debug mode: compared across ranks first, as the public collectives are
            self._backend._check_call(kind, tuple(array.shape), str(array.dtype), op, -1)
        try:
            with self._backend.watched(kind, array, op):
                yield
        except BaseException as e:
            self._broken = f"{kind} of {array.size} {array.dtype} on rank {self.rank}: {type(e).__name__}: {e}"
            raise GlooTransportError(
                f"rank {self.rank}: the gloo transport of the gradient buckets failed in {kind} "
                f"({type(e).__name__}: {e}){self._named(str(e))}; every later bucket on this rank raises. A peer may "
                "have ended or be unreachable"
            ) from e

    def _named(self, error: str) -> str:
        """The ranks and hosts of the peer addresses ``error`` mentions (gloo names a peer by its address only)."""
        found = [a for a in dict.fromkeys(re.findall(r"\d+\.\d+\.\d+\.\d+", error)) if a in self.peers]
        return f" ({'; '.join(f'{a} is {self.peers[a]}' for a in found)})" if found else ""

    def _ring_reduce_scatter(self, rows: np.ndarray, out: np.ndarray, op: ReduceOp) -> None:
        """W-1 steps: send a partial of part (r-s-1) to the next rank, receive one of part (r-s-2) from the previous,
        add this rank's own; after the last step the part received is this rank's, fully reduced into ``out``.
        Two scratch rows alternate: one is sent while the other receives."""
        W, r = self.size, self.rank
        n = rows.shape[1]
        need = 2 * n * rows.dtype.itemsize
        if self._scratch.nbytes < need:
            self._scratch = np.empty(need, dtype=np.uint8)
        bufs = self._scratch[:need].view(rows.dtype).reshape(2, n)
        ufunc = _UFUNCS[op]
        right, left = (r + 1) % W, (r - 1) % W
        sending = rows[(r - 1) % W]
        for s in range(W - 1):
            got = bufs[s % 2]
            self._exchange(sending, right, got, left)
            own = rows[(r - s - 2) % W]
            if s == W - 2:
                ufunc(got, own, out=out)  # out may be own (this rank's row): element by element, in place
            else:
                ufunc(got, own, out=got)
                sending = got
        if op is ReduceOp.AVG:
            np.divide(out, W, out=out)

    def _ring_allreduce(self, flat: np.ndarray, op: ReduceOp) -> None:
        """A reduce-scatter then an allgather around the ring, in place, over W parts of ``flat`` (sizes differ by
        at most one element): 2(W-1)/W of it sent and received per rank. Each part is reduced once, in ring order,
        on one rank, then copied to the others: every rank gets the same bits."""
        W, r = self.size, self.rank
        n = flat.size
        bounds = [k * n // W for k in range(W + 1)]
        part = [flat[bounds[k] : bounds[k + 1]] for k in range(W)]
        widest = max(bounds[k + 1] - bounds[k] for k in range(W)) * flat.itemsize
        if self._scratch.nbytes < widest:
            self._scratch = np.empty(widest, dtype=np.uint8)
        ufunc = _UFUNCS[op]
        right, left = (r + 1) % W, (r - 1) % W
        for s in range(W - 1):  # reduce-scatter: part (r-s-1) goes right, part (r-s-2) comes from the left
            mine = part[(r - s - 2) % W]
            got = self._scratch[: mine.nbytes].view(flat.dtype)
            self._exchange(part[(r - s - 1) % W], right, got, left)
            ufunc(got, mine, out=mine)  # the partial sum this rank sends on next
        if op is ReduceOp.AVG:
            np.divide(part[r], W, out=part[r])
        for s in range(W - 1):  # allgather: the reduced parts go once around the ring
            self._exchange(part[(r - s) % W], right, part[(r - s - 1) % W], left)

    def _exchange(self, send: np.ndarray, to: int, into: np.ndarray, source: int) -> None:
        """Send ``send`` to rank ``to`` while receiving ``into`` from rank ``source``. The receive is posted first:
        data that reaches gloo before its receive is posted takes a slow path (measured on a 1 Gbit/s, 1 ms link:
        32 MiB each way took 0.56 s with the send posted first, 0.28 s, the link's rate, with the receive first)."""
        tag = self._next_tag()
        recv = self._group.recv([torch.from_numpy(into)], source, tag)
        sent = self._group.send([torch.from_numpy(send)], to, tag)
        recv.wait()
        sent.wait()

    def _next_tag(self) -> int:
        self._tag = (self._tag + 1) % (1 << 30)
        return self._tag


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
    if not problem:
        try:
            if store is None:
                store = torch.distributed.TCPStore(where[0], where[1], W, False, timeout)
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
    transport = GlooTransport(backend, group, address, store, mine, peers=peers)
    _open.add(transport)
    if not _hooks:  # once per process
        _hooks.append(True)
        atexit.register(_close_all)  # after mpi4py's finalizer was registered: runs before it
        os.register_at_fork(after_in_child=_drop_in_child)
    return transport, ""


# The transports not closed yet (weakly: one dropped unclosed is still collected).
_open: weakref.WeakSet[GlooTransport] = weakref.WeakSet()
_hooks: list[bool] = []


def _close_all() -> None:
    """At exit: close every transport while the interpreter is whole."""
    for transport in list(_open):
        transport.close()


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
