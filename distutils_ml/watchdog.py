"""Stall detection and collective fingerprints: a hang or a mismatch gets named.

A *stall* is a rank waiting in a collective longer than the timeout (option
``timeout=`` of ``initialize``, or ``DML_TIMEOUT`` seconds; default 300, 0 turns it
off). At a quarter of the timeout the waiting rank warns; at the timeout it asks every
rank what it is doing, prints which collective it waits in (kind, shape, dtype, op,
root, sequence number) and which ranks have not arrived, then ends the job.

*Debug mode* (``debug=True`` or ``DML_DEBUG=1``) compares a fingerprint of every
collective across ranks before any data moves; on a mismatch every rank raises a
:class:`CollectiveMismatchError` naming which ranks called what.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
import time
from typing import Any

import numpy as np

__all__ = [
    "CollectiveMismatchError",
    "StallError",
    "describe",
    "resolve_debug",
    "resolve_timeout",
]

DEFAULT_TIMEOUT = 300.0
TIMEOUT_ENV = "DML_TIMEOUT"
DEBUG_ENV = "DML_DEBUG"


class CollectiveMismatchError(RuntimeError):
    """Ranks called different collectives (kind, shape, dtype, op or root) at the same point."""


class StallError(RuntimeError):
    """A collective waited longer than the timeout for ranks that never arrived."""


def resolve_timeout(timeout: float | None) -> float:
    """Seconds before a waiting collective counts as stalled (0: never), from the option or ``DML_TIMEOUT``."""
    if timeout is None:
        raw = os.environ.get(TIMEOUT_ENV)
        if raw is None:
            return DEFAULT_TIMEOUT
        try:
            timeout = float(raw)
        except ValueError:
            raise ValueError(
                f"{TIMEOUT_ENV}: got {raw!r}; allowed: seconds as a number, 0 to turn stall detection off"
            ) from None
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout < 0:
        raise ValueError(f"timeout: got {timeout!r}; allowed: seconds >= 0 (0 turns stall detection off)")
    return float(timeout)


def resolve_debug(debug: bool | None) -> bool:
    """Whether debug mode is on, from the option or ``DML_DEBUG``."""
    if debug is None:
        return os.environ.get(DEBUG_ENV, "").lower() in ("1", "true", "yes", "on")
    if not isinstance(debug, bool):
        raise TypeError(f"debug: got {debug!r}; allowed: True or False")
    return debug


def describe(kind: str, shape: Any = None, dtype: Any = None, op: Any = None, root: int | None = None) -> str:
    """``allreduce(shape=(4,), dtype=float32, op=dml.SUM)``-style text for messages."""
    parts = []
    if shape is not None:
        parts.append(f"shape={tuple(shape)}")
    if dtype is not None:
        text = np.dtype(dtype) if isinstance(dtype, (np.dtype, str)) else str(dtype).removeprefix("torch.")
        parts.append(f"dtype={text}")
    if op is not None:
        parts.append(f"op={op!r}")
    if root is not None and root >= 0:
        parts.append(f"root={root}")
    return f"{kind}({', '.join(parts)})"


def _describe_inflight(record: tuple | None) -> str:
    if record is None:
        return "not in a collective"
    seq, kind, arr, op, root, _ = record
    return (
        f"in {describe(kind, None if arr is None else arr.shape, None if arr is None else arr.dtype, op, root)} #{seq}"
    )


_REQUEST, _REPLY = 1, 2


class MPIWatchdog:
    """A daemon thread that watches this rank's collectives and names stalls.

    The backend stores ``(seq, kind, array, op, root, start)`` in ``backend._inflight``
    while a collective runs. The thread answers other ranks' status requests on a
    private communicator (needs MPI_THREAD_MULTIPLE, mpi4py's default).
    """

    def __init__(self, backend: Any, comm: Any, timeout: float) -> None:
        self.backend = backend
        self.comm = comm  # a Dup of the backend's communicator: never mixes with user traffic
        self.timeout = timeout
        self.poll = min(1.0, timeout / 20)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="dml-watchdog", daemon=True)
        self._thread.start()
        atexit.register(self.stop)  # runs before mpi4py's MPI_Finalize (registered earlier)

    def stop(self) -> None:
        """Stop watching (at exit, before MPI is finalized)."""
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(self.poll + 1.0)

    def _status(self) -> tuple[int, str]:
        record = self.backend._inflight
        return self.backend._seq, _describe_inflight(record)

    def _answer_requests(self) -> None:
        MPI = self.backend._MPI
        st = MPI.Status()
        while self.comm.Iprobe(source=MPI.ANY_SOURCE, tag=_REQUEST, status=st):
            src = st.Get_source()
            self.comm.recv(source=src, tag=_REQUEST)
            self.comm.send(self._status(), dest=src, tag=_REPLY)

    def _run(self) -> None:
        warned_seq = -1
        while not self._stop.wait(self.poll):
            try:
                self._answer_requests()
            except Exception:  # MPI finalized at exit: stop watching
                return
            record = self.backend._inflight
            if record is None:
                continue
            seq, start = record[0], record[5]
            waited = time.monotonic() - start
            if waited >= self.timeout:
                self._report_and_abort(record, waited)
                return
            if waited >= self.timeout / 4 and warned_seq != seq:
                warned_seq = seq
                rank = self.backend.rank
                sys.stderr.write(
                    f"[rank {rank}] distutils_ml: warning: waiting {waited:.0f} s in {_describe_inflight(record)[3:]}; "
                    f"the job ends after {self.timeout:.0f} s (timeout= of initialize, or {TIMEOUT_ENV})\n"
                )
                sys.stderr.flush()

    def _report_and_abort(self, record: tuple, waited: float) -> None:
        MPI = self.backend._MPI
        rank, size = self.backend.rank, self.backend.size
        seq = record[0]
        for r in range(size):
            if r != rank:
                self.comm.isend(None, dest=r, tag=_REQUEST)
        replies: dict[int, tuple[int, str]] = {rank: self._status()}
        deadline = time.monotonic() + min(10.0, max(2.0, self.timeout / 4))
        st = MPI.Status()
        while len(replies) < size and time.monotonic() < deadline:
            self._answer_requests()
            if self.comm.Iprobe(source=MPI.ANY_SOURCE, tag=_REPLY, status=st):
                src = st.Get_source()
                replies[src] = self.comm.recv(source=src, tag=_REPLY)
            else:
                time.sleep(0.01)
        missing = []
        lines = []
        for r in range(size):
            if r not in replies:
                missing.append(r)
                lines.append(f"  rank {r}: no answer (stuck outside Python, or dead)")
                continue
            r_seq, what = replies[r]
            arrived = what.startswith("in ") and what.endswith(f"#{seq}")
            if not arrived:
                missing.append(r)
            lines.append(f"  rank {r}: {what}{'' if what.startswith('in ') else f' (last started #{r_seq})'}")
        msg = (
            f"[rank {rank}] distutils_ml: stall: waited {waited:.0f} s (timeout {self.timeout:.0f} s) "
            f"{_describe_inflight(record)}; rank(s) {missing} have not arrived:\n" + "\n".join(lines) + "\n"
            f"[rank {rank}] distutils_ml: aborting the job (raise the limit with timeout= or {TIMEOUT_ENV}, 0 = off)\n"
        )
        sys.stderr.write(msg)
        sys.stderr.flush()
        MPI.COMM_WORLD.Abort(1)
