"""A ring allreduce over TCP sockets, for the gradient buckets of ranks on several hosts.

Why not MPI there: Open MPI progresses its TCP transport only while a thread polls it, so
a communication thread waiting in ``MPI_Allreduce`` spins on the core backward computes
on, and while backward holds that core the sockets are not drained and TCP slows down
for far longer than the computation (measured on a 1 Gbit/s, 1 ms link: a 64 MiB
allreduce took 0.58 s alone and 0.94-1.24 s while a 0.15 s matmul ran beside it). A
thread waiting in ``poll()`` on a socket sleeps in the kernel and is woken when bytes
arrive, as gloo's threads are: the same allreduce over this ring took 0.56 s with or
without the matmul (docs/benchmarks/network.md).

Each rank sends to the next rank and receives from the previous one: a reduce-scatter
(W-1 steps, each chunk reduced as its bytes arrive) then an allgather (W-1 steps), so
every rank sends and receives 2(W-1)/W of the buffer, the bandwidth optimum. Every chunk
is reduced once, on one rank, in ring order, and then copied to all: the result is
bit-identical on every rank.

The connections are made once per backend (:func:`ring_for`, a collective), over the
addresses of the hosts' network interfaces (``DML_SOCKET_IFNAME=eth0,eth1`` restricts
them; ranks on one host use the loopback), each checked with a per-job token.
``DML_TRANSPORT`` chooses: ``auto`` (default: this ring when the ranks span several
hosts, MPI on one host, where shared memory is faster), ``tcp`` (always; fails if a
connection cannot be made) or ``mpi`` (never).
"""

from __future__ import annotations

import contextlib
import os
import secrets
import select
import socket
import struct
import threading
import time
import warnings
import weakref
from collections.abc import Iterator
from typing import Any

import numpy as np

from distutils_ml.backends.base import Backend, ReduceOp

__all__ = ["TRANSPORT_ENV", "TcpRing", "ring_for", "transport_choice"]

TRANSPORT_ENV = "DML_TRANSPORT"
IFNAME_ENV = "DML_SOCKET_IFNAME"
_CHOICES = ("auto", "tcp", "mpi")
#: Bytes handed to one ``send``/``recv_into``; received bytes are reduced in pieces of this size.
_PIECE = 1 << 20
_CONNECT_TIMEOUT = 10.0
_MAGIC = b"dmlring1"
_UFUNCS = {ReduceOp.SUM: np.add, ReduceOp.AVG: np.add, ReduceOp.PROD: np.multiply,
           ReduceOp.MAX: np.maximum, ReduceOp.MIN: np.minimum}  # fmt: skip
_KINDS = "fiu"  # float, signed and unsigned integer buffers (MPI handles half precision and bool)


def _split(flat: np.ndarray, parts: int) -> list[np.ndarray]:
    bounds = [flat.size * k // parts for k in range(parts + 1)]
    return [flat[bounds[k] : bounds[k + 1]] for k in range(parts)]


def transport_choice() -> str:
    """``DML_TRANSPORT`` (``auto``, ``tcp`` or ``mpi``; default ``auto``), else ``ValueError``."""
    text = os.environ.get(TRANSPORT_ENV, "auto").strip().lower() or "auto"
    if text not in _CHOICES:
        raise ValueError(f"{TRANSPORT_ENV}={text!r}; allowed: auto, tcp, mpi")
    return text


class TcpRing:
    """Connections to the next and the previous rank, and the ring allreduce over them."""

    def __init__(self, backend: Backend, right: socket.socket, left: socket.socket) -> None:
        self.size = backend.size
        self.rank = backend.rank
        self._backend = backend
        self._right = right
        self._left = left
        self._poll = select.poll()
        self._scratch = np.empty(0, dtype=np.uint8)
        #: Operations this ring has run, by kind ("allreduce", "reduce_scatter", "allgather"): what proves
        #: that a transfer went over the ring rather than the backend.
        self.calls: dict[str, int] = {"allreduce": 0, "reduce_scatter": 0, "allgather": 0}

    def supports(self, array: np.ndarray, op: ReduceOp) -> bool:
        """Whether this ring reduces ``array`` with ``op`` (else use the backend's allreduce)."""
        return (
            array.dtype.kind in _KINDS
            and array.dtype.itemsize >= 4
            and array.flags.c_contiguous
            and (op is not ReduceOp.AVG or array.dtype.kind == "f")
        )

    def allreduce(self, array: np.ndarray, op: ReduceOp) -> None:
        """Reduce ``array`` (contiguous, in place) with ``op`` over every rank; AVG divides the sum."""
        flat = array.reshape(-1)
        if self.size == 1 or flat.size == 0:
            return
        with self._watched("allreduce", array, op):
            chunks = _split(flat, self.size)
            self._reduce_scatter(chunks, chunks, op)
            self._allgather(chunks)

    def reduce_scatter(self, sendbuf: np.ndarray, recvbuf: np.ndarray, op: ReduceOp) -> None:
        """``recvbuf`` = the op over ranks of every rank's ``sendbuf[rank]`` (sendbuf: (W, n), left unchanged).

        ``recvbuf`` may be ``sendbuf[rank]`` itself: that row is read only in the last step, element by element
        into the same element, and the other rows stay unchanged.
        """
        if self.size == 1:
            np.copyto(recvbuf, sendbuf[0])
            return
        if recvbuf.size == 0:
            return
        with self._watched("reduce_scatter", recvbuf, op):
            chunks = list(sendbuf.reshape(self.size, -1))
            out = [None] * self.size
            out[self.rank] = recvbuf.reshape(-1)
            self._reduce_scatter(chunks, out, op)

    def allgather(self, sendbuf: np.ndarray, recvbuf: np.ndarray) -> None:
        """``recvbuf[k]`` = rank k's ``sendbuf`` (recvbuf: (W, n); sendbuf may be ``recvbuf[rank]`` itself)."""
        rows = list(recvbuf.reshape(self.size, -1))
        mine = sendbuf.reshape(-1)
        if mine.ctypes.data != rows[self.rank].ctypes.data:
            np.copyto(rows[self.rank], mine)
        if self.size == 1 or mine.size == 0:
            return
        with self._watched("allgather", sendbuf, None):
            self._allgather(rows)

    @contextlib.contextmanager
    def _watched(self, kind: str, array: np.ndarray, op: ReduceOp | None) -> Iterator[None]:
        """Shown to the backend's stall watchdog as one of its own collectives while it runs; counted in ``calls``."""
        self.calls[kind] += 1
        with self._backend.watched(kind, array, op):
            yield

    def _reduce_scatter(self, chunks: list[np.ndarray], out: list[Any], op: ReduceOp) -> None:
        """Ring reduce-scatter of ``chunks`` (chunk k: this rank's part k); rank r ends with part r in ``out[r]``.

        Partial sums go to ``out[k]`` when ``out`` is ``chunks`` (in place), else to scratch, so the input is
        left as it was. Every part is reduced in ring order, once, on one rank.
        """
        W, r = self.size, self.rank
        ufunc = _UFUNCS[op]
        in_place = out is chunks
        dtype = chunks[0].dtype
        biggest = max(c.size for c in chunks) * dtype.itemsize
        need = biggest * (1 if in_place else 3)
        if self._scratch.nbytes < need:
            self._scratch = np.empty(need, dtype=np.uint8)
        scratch = [self._scratch[i * biggest : (i + 1) * biggest] for i in range(3)]
        partial = chunks[(r - 1) % W]  # what goes first: this rank's own part (r - 1)
        for s in range(W - 1):
            k = (r - 2 - s) % W  # the part arriving from the previous rank, reduced here
            size = chunks[k].size
            tmp = scratch[0][: size * dtype.itemsize].view(dtype)
            if in_place:
                target = chunks[k]
            elif s == W - 2:
                target = out[k]
            else:
                target = scratch[1 + s % 2][: size * dtype.itemsize].view(dtype)
            self._exchange(partial, tmp, chunks[k], target, ufunc)
            partial = target
        if op is ReduceOp.AVG:
            np.divide(partial, W, out=partial)

    def _allgather(self, parts: list[np.ndarray]) -> None:
        """Ring allgather: rank r holds ``parts[r]``; afterwards every rank holds every part."""
        W, r = self.size, self.rank
        for s in range(W - 1):
            self._exchange(parts[(r - s) % W], parts[(r - s - 1) % W], None, None, None)

    def _exchange(
        self, out: np.ndarray, into: np.ndarray, acc: np.ndarray | None, target: np.ndarray | None, ufunc: Any
    ) -> None:
        """Send ``out`` to the next rank while receiving ``into`` from the previous one, sleeping in poll().

        With ``acc``, every received piece is reduced as it arrives: ``target = ufunc(acc, piece)``.
        """
        send = memoryview(out).cast("B") if out.size else memoryview(b"")
        recv = memoryview(into).cast("B") if into.size else memoryview(bytearray())
        itemsize = into.dtype.itemsize
        sent = got = reduced = 0
        right, left, poll = self._right.fileno(), self._left.fileno(), self._poll
        want_out = want_in = False
        while sent < len(send) or got < len(recv):
            if (sent < len(send)) != want_out:
                want_out = not want_out
                if want_out:
                    poll.register(right, select.POLLOUT)
                else:
                    poll.unregister(right)
            if (got < len(recv)) != want_in:
                want_in = not want_in
                if want_in:
                    poll.register(left, select.POLLIN)
                else:
                    poll.unregister(left)
            for fd, events in poll.poll():
                if events & (select.POLLERR | select.POLLHUP | select.POLLNVAL) and not events & select.POLLIN:
                    raise ConnectionError(self._lost(fd))
                if fd == right:
                    with contextlib.suppress(BlockingIOError, InterruptedError):
                        sent += self._right.send(send[sent : sent + _PIECE])
                else:
                    try:
                        k = self._left.recv_into(recv[got : got + _PIECE])
                    except (BlockingIOError, InterruptedError):
                        continue
                    if k == 0:
                        raise ConnectionError(self._lost(fd))
                    got += k
                    if acc is not None and (got - reduced >= _PIECE or got == len(recv)):
                        lo, hi = reduced // itemsize, got // itemsize
                        ufunc(acc[lo:hi], into[lo:hi], out=target[lo:hi])
                        reduced = hi * itemsize
        if want_out:
            poll.unregister(right)
        if want_in:
            poll.unregister(left)

    def _lost(self, fd: int) -> str:
        peer = (self.rank + 1) % self.size if fd == self._right.fileno() else (self.rank - 1) % self.size
        return (
            f"the TCP connection of rank {self.rank} to rank {peer} (gradient buckets, {TRANSPORT_ENV}) closed "
            "mid-reduction: that rank ended or its host is unreachable"
        )

    def close(self) -> None:
        """Close both connections."""
        for s in (self._right, self._left):
            with contextlib.suppress(OSError):
                s.close()


# The ring of each backend (None: it uses none), made once.
_RINGS: weakref.WeakKeyDictionary[Backend, TcpRing | None] = weakref.WeakKeyDictionary()


def ring_for(backend: Backend) -> TcpRing | None:
    """The backend's ring (made at the first call, a collective on every rank), or None to use the backend.

    None on a backend that is not MPI's, in a world of one rank, when ``DML_TRANSPORT`` is
    ``mpi``, and under ``auto`` when every rank runs on one host. Under ``auto`` a ring
    that cannot connect everywhere is a warning (and None, on every rank); under ``tcp``
    it is a ``RuntimeError`` on every rank.
    """
    if backend in _RINGS:
        return _RINGS[backend]
    ring = _RINGS[backend] = _connect(backend)
    return ring


def _connect(backend: Backend) -> TcpRing | None:
    from distutils_ml.objects import allgather_object, bcast_object

    hosts = getattr(backend, "hosts", None)
    if hosts is None or backend.size == 1 or not hasattr(backend, "comm"):
        return None
    choices = allgather_object(backend, _choice_or_error())
    errors = [c for c in choices if c not in _CHOICES]
    if errors:
        raise ValueError(errors[0])
    if len(set(choices)) > 1:
        by = "; ".join(
            f"{c!r} on rank(s) {[r for r, x in enumerate(choices) if x == c]}" for c in dict.fromkeys(choices)
        )
        raise ValueError(f"{TRANSPORT_ENV} differs across ranks ({by}); set it to the same value on every rank")
    choice = choices[0]
    if choice == "mpi" or (choice == "auto" and len(set(hosts)) == 1):
        return None
    W, r = backend.size, backend.rank
    token = bcast_object(backend, secrets.token_bytes(16) if r == 0 else None)
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("0.0.0.0", 0))  # peers on other hosts connect; the token tells who
    listener.listen(8)
    every = allgather_object(backend, (hosts[r], _addresses(), listener.getsockname()[1]))
    accepted: list[Any] = []
    acceptor = threading.Thread(target=_accept, args=(listener, token, (r - 1) % W, r, accepted), daemon=True)
    acceptor.start()
    right, why = _dial(every, (r + 1) % W, r, token, hosts[r])
    acceptor.join(_CONNECT_TIMEOUT * 4)
    listener.close()
    left = accepted[0] if accepted and isinstance(accepted[0], socket.socket) else None
    if left is None:
        why = why or (str(accepted[0]) if accepted else f"rank {(r - 1) % W} did not connect in time")
    outcome = allgather_object(backend, why)
    failed = {k: w for k, w in enumerate(outcome) if w}
    if not failed:
        assert right is not None and left is not None
        for s in (right, left):
            s.setblocking(False)
        return TcpRing(backend, right, left)
    for s in (right, left):
        if s is not None:
            s.close()
    text = "; ".join(f"rank {k}: {w}" for k, w in failed.items())
    if choice == "tcp":
        raise RuntimeError(
            f"{TRANSPORT_ENV}=tcp: the ranks could not connect their TCP ring ({text}). Open the ports between "
            f"the hosts, choose the interfaces with {IFNAME_ENV}, or use {TRANSPORT_ENV}=mpi"
        )
    warnings.warn(
        f"the gradient buckets go over MPI: the TCP ring across hosts could not connect ({text}); set "
        f"{IFNAME_ENV} or {TRANSPORT_ENV}=mpi to choose",
        RuntimeWarning,
        stacklevel=3,
    )
    return None


def _choice_or_error() -> str:
    try:
        return transport_choice()
    except ValueError as e:
        return str(e)


def _addresses() -> list[str]:
    """This host's IPv4 addresses (the interfaces of ``DML_SOCKET_IFNAME`` if set), loopback last."""
    wanted = [x.strip() for x in os.environ.get(IFNAME_ENV, "").split(",") if x.strip()]
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


def _dial(
    every: list[tuple[str, list[str], int]], peer: int, rank: int, token: bytes, host: str
) -> tuple[socket.socket | None, str]:
    """Connect to ``peer``'s listener and prove who we are; (socket, "") or (None, why)."""
    peer_host, addresses, port = every[peer]
    if peer_host == host:
        candidates = ["127.0.0.1", *addresses]
    else:  # addresses no other host has first (a docker0 172.17.0.1 is on every host: last)
        elsewhere = {a for k, (h, addrs, _) in enumerate(every) if h != peer_host for a in addrs}
        candidates = sorted((a for a in addresses if not a.startswith("127.")), key=lambda a: a in elsewhere)
    tried = []
    for address in candidates:
        try:
            s = socket.create_connection((address, port), timeout=_CONNECT_TIMEOUT)
        except OSError as e:
            tried.append(f"{address}:{port} ({e})")
            continue
        try:
            s.settimeout(_CONNECT_TIMEOUT)
            s.sendall(_MAGIC + token + struct.pack("!ii", rank, peer))
            if _recv_exact(s, len(_MAGIC) + 16) == _MAGIC + token:
                s.settimeout(None)
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                return s, ""
            tried.append(f"{address}:{port} (another process answered)")
        except OSError as e:
            tried.append(f"{address}:{port} ({e})")
        s.close()
    return None, f"could not connect to rank {peer} on {peer_host}: tried {', '.join(tried) or 'no address'}"


def _accept(listener: socket.socket, token: bytes, peer: int, rank: int, out: list[Any]) -> None:
    """Accept ``peer``'s connection (strays that do not show the token are closed); its socket into ``out``."""
    deadline = time.monotonic() + _CONNECT_TIMEOUT * 3
    try:
        while True:
            listener.settimeout(max(deadline - time.monotonic(), 0.01))
            s, _ = listener.accept()
            try:
                s.settimeout(_CONNECT_TIMEOUT)
                hello = _recv_exact(s, len(_MAGIC) + 16 + 8)
                if hello[: len(_MAGIC) + 16] == _MAGIC + token and struct.unpack("!ii", hello[-8:]) == (peer, rank):
                    s.sendall(_MAGIC + token)
                    s.settimeout(None)
                    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                    out.append(s)
                    return
            except OSError:
                pass
            s.close()
    except OSError as e:
        out.append(f"rank {peer} did not connect ({e})")


def _recv_exact(s: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        part = s.recv(n - len(data))
        if not part:
            raise ConnectionError("closed during the handshake")
        data += part
    return data
