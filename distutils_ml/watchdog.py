"""Stall detection and collective fingerprints: a hang or a mismatch gets named.

A *stall* is a rank waiting in a collective longer than the timeout (option
``timeout=`` of ``initialize``, or ``DML_TIMEOUT`` seconds; default 300, 0 turns it
off). At a quarter of the timeout the waiting rank warns; at the timeout it asks every
rank what it is doing. If some rank has not arrived (it is elsewhere, in an earlier or
a different collective, or does not answer) and the collective is still running, it
prints which collective it waits in (kind, shape, dtype, op, root, sequence number)
and which ranks are missing, then ends the job. A collective that every rank has
joined is slow, not stalled (a large transfer, slow unpickling): the rank warns and
keeps waiting, and asks again after another timeout.

*Debug mode* (``debug=True`` or ``DML_DEBUG=1``) compares a fingerprint of every
collective across ranks before any data moves: the kind, shape, dtype (as the caller
passed it), op, root and the call site (the first frame outside this package); on a
mismatch every rank raises a :class:`CollectiveMismatchError` naming which ranks called
what, and where. The comparison is itself watched for stalls.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import math
import os
import signal
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from typing import Any

__all__ = [
    "CollectiveMismatchError",
    "StallError",
    "before_abort",
    "call_site",
    "describe",
    "report_and_abort",
    "resolve_debug",
    "resolve_timeout",
    "site_as",
]

DEFAULT_TIMEOUT = 300.0
#: Seconds a rank gives ``MPI_Abort`` to end it before it ends itself (an abort that cannot
#: reach a lost node can block forever, and the rank must still leave with a failure status).
ABORT_GRACE = 5
TIMEOUT_ENV = "DML_TIMEOUT"
DEBUG_ENV = "DML_DEBUG"
_ALLOWED_TIMEOUT = "a finite number of seconds >= 0 (0 turns stall detection off)"


def abort_job(MPI: Any, code: int = 1) -> None:
    """``MPI_Abort`` the job; if that has not ended this process within ``ABORT_GRACE`` s, end it anyway.

    On a cut network link the abort can block forever (the launcher's daemon cannot reach a
    lost node). mpi4py holds the GIL inside ``Abort``, so no Python thread could act: the
    fallback is the kernel's ``alarm`` with SIGALRM's default action (the process ends, killed
    by SIGALRM: a failure status for any launcher). ``ABORT_GRACE = 0`` turns it off.
    """
    # Open MPI's mpi_abort_delay (the launcher sets 2 s) makes MPI_Abort wait first; < 0: never abort.
    delay = _number(os.environ.get("OMPI_MCA_mpi_abort_delay", "0"))  # noqa: SIM112 - Open MPI's spelling
    if ABORT_GRACE > 0 and delay >= 0 and hasattr(signal, "SIGALRM"):
        with contextlib.suppress(OSError, AttributeError):  # no C library to call: the abort alone
            libc = ctypes.CDLL(None)
            libc.signal.argtypes = [ctypes.c_int, ctypes.c_void_p]
            libc.signal.restype = ctypes.c_void_p
            libc.signal(signal.SIGALRM, None)  # SIG_DFL, process-wide, callable from any thread
            libc.alarm(ABORT_GRACE + math.ceil(delay))
    for callback in list(_BEFORE_ABORT):  # under the alarm too
        with contextlib.suppress(Exception):
            callback()
    MPI.COMM_WORLD.Abort(code)


#: Called by :func:`abort_job` before it aborts (the gloo transports tell their watchers that this rank ends on
#: purpose, so that its peers do not report it as a rank that died).
_BEFORE_ABORT: list[Callable[[], None]] = []


def before_abort(callback: Callable[[], None]) -> None:
    """Have :func:`abort_job` call ``callback()`` before it aborts (errors ignored; keep it short)."""
    _BEFORE_ABORT.append(callback)


def report_and_abort(MPI: Any, rank: int, message: str, grace: float = 0.0) -> None:
    """Print ``message`` with the rank, then, ``grace`` seconds later, :func:`abort_job` (from any thread)."""
    prefix = f"[rank {rank}] distutils_ml:"
    sys.stderr.write(f"{prefix} {message}\n")
    sys.stderr.flush()
    if grace > 0:
        time.sleep(grace)
    sys.stderr.write(f"{prefix} aborting the job\n")
    sys.stderr.flush()
    abort_job(MPI)


def _number(text: str) -> float:
    """``text`` as a number, 0 if it is not one."""
    try:
        return float(text)
    except ValueError:
        return 0.0


class CollectiveMismatchError(RuntimeError):
    """Ranks called different collectives (kind, shape, dtype, op or root) at the same point."""


class StallError(RuntimeError):
    """A collective waited longer than the timeout for ranks that never arrived."""


def resolve_timeout(timeout: float | None, name: str = "timeout") -> float:
    """Seconds before a waiting collective counts as stalled (0: never), from the option or ``DML_TIMEOUT``.

    Raises:
        ValueError: the option or ``DML_TIMEOUT`` is not a finite number >= 0 (NaN and
            infinity included: use 0 to turn stall detection off).
    """
    if timeout is None:
        raw = os.environ.get(TIMEOUT_ENV)
        if raw is None:
            return DEFAULT_TIMEOUT
        try:
            value = float(raw)
        except ValueError:
            value = math.nan
        if not (math.isfinite(value) and value >= 0):
            raise ValueError(f"{TIMEOUT_ENV}: got {raw!r}; allowed: {_ALLOWED_TIMEOUT}")
        return value
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
        raise ValueError(f"{name}: got {timeout!r}; allowed: {_ALLOWED_TIMEOUT}")
    if not (math.isfinite(timeout) and timeout >= 0):
        raise ValueError(f"{name}: got {timeout!r}; allowed: {_ALLOWED_TIMEOUT}")
    return float(timeout)


_DEBUG_WORDS = {"": False, "0": False, "false": False, "no": False, "off": False}
_DEBUG_WORDS.update({"1": True, "true": True, "yes": True, "on": True})


def resolve_debug(debug: bool | None) -> bool:
    """Whether debug mode is on, from the option or ``DML_DEBUG``.

    Raises:
        ValueError: ``DML_DEBUG`` is not one of 1/0, true/false, yes/no, on/off (any case) or empty.
        TypeError: ``debug`` is not a bool.
    """
    if debug is None:
        raw = os.environ.get(DEBUG_ENV, "")
        value = _DEBUG_WORDS.get(raw.strip().lower())
        if value is None:
            raise ValueError(
                f"{DEBUG_ENV}: got {raw!r}; allowed: 1, true, yes, on (debug mode) or 0, false, no, off, empty (off)"
            )
        return value
    if not isinstance(debug, bool):
        raise TypeError(f"debug: got {debug!r}; allowed: True or False")
    return debug


def describe(kind: str, shape: Any = None, dtype: Any = None, op: Any = None, root: int | None = None) -> str:
    """``allreduce(shape=(4,), dtype=float32, op=dml.SUM)``-style text for messages."""
    parts = []
    if shape is not None:
        parts.append(f"shape={tuple(shape)}")
    if dtype is not None:
        text = dtype if isinstance(dtype, str) else str(dtype).removeprefix("torch.")
        parts.append(f"dtype={text}")
    if op is not None:
        parts.append(f"op={op!r}")
    if root is not None and root >= 0:
        parts.append(f"root={root}")
    return f"{kind}({', '.join(parts)})"


_SITE = threading.local()


@contextlib.contextmanager
def thread_setting(local: threading.local, name: str, value: Any) -> Iterator[None]:
    """Inside: ``local``'s attribute ``name`` is ``value`` on this thread; after, what it was (None if unset)."""
    before = getattr(local, name, None)
    setattr(local, name, value)
    try:
        yield
    finally:
        setattr(local, name, before)


def site_as(site: str) -> contextlib.AbstractContextManager[None]:
    """Inside: :func:`call_site` on this thread says ``site`` (a rank that answers another's call, as ``dml.join``'s
    joined ranks do, compares it as made where the other made it)."""
    return thread_setting(_SITE, "site", site)


def call_site() -> str:
    """``file.py:line in function`` of the first frame outside distutils_ml: where the user made the call."""
    given = getattr(_SITE, "site", None)
    if given is not None:
        return given
    frame = sys._getframe(1)
    while frame.f_back is not None and frame.f_globals.get("__name__", "").startswith("distutils_ml"):
        frame = frame.f_back
    code = frame.f_code
    return f"{os.path.basename(code.co_filename)}:{frame.f_lineno} in {code.co_name}"


def _call_text(record: tuple) -> str:
    """``allreduce(shape=..., ...)`` for a watchdog record ``(seq, kind, shape, dtype, op, root, start)``."""
    _, kind, shape, dtype, op, root, _ = record
    return describe(kind, shape, dtype, op, root)


def _describe_inflight(record: tuple | None) -> str:
    if record is None:
        return "not in a collective"
    return f"in {_call_text(record)} #{record[0]}"


def reply_window(timeout: float) -> float:
    """Seconds a stalled rank waits for the other ranks' answers before it reports: ``min(10, max(2, timeout/4))``."""
    return min(10.0, max(2.0, timeout / 4))


_REQUEST, _REPLY = 1, 2
# The watchdogs running (weakly: a closed backend's is collected), stopped at exit by one handler.
_running: weakref.WeakSet[MPIWatchdog] = weakref.WeakSet()
_at_exit: list[bool] = []


def _stop_all() -> None:
    for dog in list(_running):
        dog.stop()


#: A rank's answer: (last started seq, what it is doing, what its collective #N was, what its last one was).
Status = tuple[int, str, str, str]


class MPIWatchdog:
    """A daemon thread that watches this rank's collectives and names stalls.

    The backend shows ``(seq, kind, shape, dtype, op, root, start)`` as ``backend.call_in_flight``
    while a collective runs (``calls_started``, ``recent_calls`` and ``MPI`` are its other members read here).
    The thread answers other ranks' status requests on a private communicator (needs MPI_THREAD_MULTIPLE,
    mpi4py's default).
    """

    def __init__(self, backend: Any, comm: Any, timeout: float) -> None:
        self.backend = backend
        self.comm = comm  # a Dup of the backend's communicator: never mixes with user traffic
        self.timeout = timeout
        self.poll = min(1.0, timeout / 20)
        self._token = 0  # numbers this rank's status requests: late answers to an old one are dropped
        self._sends: list[Any] = []  # requests and replies not known to be delivered yet
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="dml-watchdog", daemon=True)
        self._thread.start()
        _running.add(self)
        if not _at_exit:
            _at_exit.append(True)
            atexit.register(_stop_all)  # runs before mpi4py's MPI_Finalize (registered earlier)

    def stop(self) -> None:
        """Stop watching (at exit, before MPI is finalized, or when the backend is closed)."""
        self._stop.set()
        _running.discard(self)
        if self._thread is not threading.current_thread():
            self._thread.join(self.poll + 1.0)

    def _status(self, seq: int) -> Status:
        """(last started seq, what this rank is doing, what its collective #seq was, what its last one was)."""
        history = self.backend.recent_calls
        call = next((_call_text(r) for r in reversed(history) if r[0] == seq), "")
        last = _call_text(history[-1]) if history else ""
        return self.backend.calls_started, _describe_inflight(self.backend.call_in_flight), call, last

    def _send(self, obj: Any, dest: int, tag: int) -> None:
        """A non-blocking send whose request is kept until it completes (never blocks on a dead rank)."""
        self._sends = [req for req in self._sends if not req.Test()]
        self._sends.append(self.comm.isend(obj, dest=dest, tag=tag))

    def _answer_requests(self) -> None:
        MPI = self.backend.MPI
        st = MPI.Status()
        while self.comm.Iprobe(source=MPI.ANY_SOURCE, tag=_REQUEST, status=st):
            src = st.Get_source()
            token, seq = self.comm.recv(source=src, tag=_REQUEST)
            self._send((token, *self._status(seq)), src, _REPLY)

    def _run(self) -> None:
        warned_seq = -1
        next_check = (-1, self.timeout)  # (seq, seconds waited) at which to ask the other ranks
        try:
            while not self._stop.wait(self.poll):
                self._answer_requests()
                record = self.backend.call_in_flight
                if record is None:
                    continue
                seq, start = record[0], record[-1]
                waited = time.monotonic() - start
                if next_check[0] != seq:
                    next_check = (seq, self.timeout)
                if waited >= next_check[1]:
                    self._check(record, waited)  # aborts the job if some rank is missing
                    next_check = (seq, time.monotonic() - start + self.timeout)
                elif waited >= self.timeout / 4 and warned_seq != seq:
                    warned_seq = seq
                    self._write(
                        f"warning: waiting {waited:.0f} s in {_describe_inflight(record)[3:]}; "
                        f"the job ends after {self.timeout:g} s if a rank is missing "
                        f"(timeout= of initialize, or {TIMEOUT_ENV})"
                    )
        except Exception as exc:
            if not (self._stop.is_set() or self.backend.MPI.Is_finalized()):
                self._write(f"warning: stall detection stopped: the watchdog thread raised {type(exc).__name__}: {exc}")

    def _write(self, text: str) -> None:
        sys.stderr.write(f"[rank {self.backend.rank}] distutils_ml: {text}\n")
        sys.stderr.flush()

    def _collect(self, seq: int) -> dict[int, Status]:
        """Every rank's ``_status(seq)``; ranks that do not answer in time are left out."""
        MPI = self.backend.MPI
        rank, size = self.backend.rank, self.backend.size
        self._token += 1
        for r in range(size):
            if r != rank:
                self._send((self._token, seq), r, _REQUEST)
        replies: dict[int, Status] = {rank: self._status(seq)}
        deadline = time.monotonic() + reply_window(self.timeout)
        st = MPI.Status()
        while len(replies) < size and time.monotonic() < deadline:
            self._answer_requests()
            if self.comm.Iprobe(source=MPI.ANY_SOURCE, tag=_REPLY, status=st):
                src = st.Get_source()
                token, *status = self.comm.recv(source=src, tag=_REPLY)
                if token == self._token:
                    replies[src] = tuple(status)  # type: ignore[assignment]
            else:
                time.sleep(0.01)
        return replies

    def _check(self, record: tuple, waited: float) -> None:
        """Ask every rank where it is; abort the job if some rank is missing and ``record`` still runs."""
        seq = record[0]
        mine = _describe_inflight(record)
        call = _call_text(record)
        replies = self._collect(seq)
        missing, different, lines = [], [], []
        hosts = getattr(self.backend, "hosts", None)  # each rank's host: MPIBackend knows them
        for r in range(self.backend.size):
            on = f" [on {hosts[r]}]" if hosts else ""
            if r not in replies:
                missing.append(r)
                lines.append(f"  rank {r}: no answer (stuck outside Python, exited, dead, or its node is lost){on}")
                continue
            r_seq, what, theirs, last = replies[r]
            note = ""
            if theirs and theirs != call:  # its collective #seq, running or finished, is another one
                different.append(r)
                note = (
                    f" (its #{seq} was {theirs}: a different collective; debug=True or DML_DEBUG=1 checks every call)"
                )
            elif r_seq < seq:
                missing.append(r)
            elif r_seq > seq:
                note = " (done with this one)"
            if not what.startswith("in "):
                note = f" (last started #{r_seq}: {last or 'none'})" + note
            lines.append(f"  rank {r}: {what}{note}{on}")
        if self.backend.call_in_flight is not record:
            return  # the collective ended while the answers came in
        rank = self.backend.rank
        if not missing and not different:
            self._write(
                f"warning: waited {waited:.0f} s {mine}, but every rank has joined it: slow, not stalled; "
                f"still waiting (asking again in {self.timeout:g} s)"
            )
            return
        why = []
        if missing:
            on = f" (on {', '.join(dict.fromkeys(hosts[r] for r in missing))})" if hosts else ""
            why.append(f"rank(s) {missing} have not arrived{on}")
        if different:
            why.append(f"rank(s) {different} called a different collective")
        msg = (
            f"[rank {rank}] distutils_ml: stall: waited {waited:.0f} s (timeout {self.timeout:g} s) "
            f"{mine}; {' and '.join(why)}:\n" + "\n".join(lines) + "\n"
            f"[rank {rank}] distutils_ml: aborting the job (raise the limit with timeout= or {TIMEOUT_ENV}, 0 = off)\n"
        )
        sys.stderr.write(msg)
        sys.stderr.flush()
        abort_job(self.backend.MPI)
