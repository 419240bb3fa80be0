"""Process supervision for the launcher: mpiexec runs, and ends, with the launcher.

SIGINT, SIGTERM and SIGHUP (a closed terminal or SSH session) are passed on to mpiexec,
which ends the ranks; on Linux mpiexec gets SIGTERM when the launcher dies in any other way
(SIGKILL, an out-of-memory kill), through the kernel's parent-death signal. mpiexec's
standard output and error pass through the launcher, which watches them for a node that
Open MPI reports lost and then fails the job, naming that node's ranks, and for a rank's
abort (``MPI_Abort``, or an MPI error): an mpiexec still running some seconds after one is
ended (it can wait for many minutes on a daemon whose node it can no longer reach).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from types import FrameType
from typing import TextIO

__all__ = ["run_supervised"]

# Open MPI 5 (PRRTE) and 4 (ORTE) when the connection to a node's daemon breaks (the node stops answering its
# keepalive, or every process there was killed), and Open MPI 5 when the connection that started a node's daemon
# (ssh) ends while the job runs. Open MPI may exit 0 after either, though the job's ranks were ended.
_LOST_NODE = re.compile(
    rb"[PO]RTE has lost communication with a remote daemon.*?Remote daemon:.*? on node (\S+)(?=\s)"
    rb"|A daemon failed to report back after being spawned.*?Remote host:[ \t]+(\S+)(?=\s)",  # whole names only
    re.S,
)
# What a rank prints when it aborts (Open MPI 4 and 5), before mpi_abort_delay: MPI_Abort, or an MPI error under
# the default error handler (a peer's connection closed).
_ABORTED = re.compile(rb"MPI_ABORT was invoked on rank|\*\*\* MPI_ERRORS_ARE_FATAL \(processes in this communicator")
#: Seconds between the SIGTERM that ends an mpiexec stuck after an abort and the SIGKILL that follows.
END_GRACE = 1.0
#: Seconds mpiexec gets to end the job after the launcher passed it a signal (torchrun's and SLURM's KillWait: 30).
SIGNAL_WAIT = 30.0


def run_supervised(
    argv: list[str],
    env: Mapping[str, str],
    rank_hosts: Path | None = None,
    lost_nodes: list[str] | None = None,
    *,
    abort_wait: float | None = None,
    signal_wait: float | None = SIGNAL_WAIT,
    signals: list[int] | None = None,
) -> int:
    """Run ``argv`` with ``env`` added to this environment, passing SIGINT, SIGTERM and SIGHUP on; its exit status.

    On Linux, the command also gets SIGTERM if this process dies without passing a signal on.
    Its standard output and error pass through this process, which watches them for a node that
    mpiexec reports lost: the job then fails (status 1 if mpiexec said 0, as Open MPI 5 does), and the
    lost node's ranks are named from ``rank_hosts`` (written by rank 0) when that file exists.
    A node counts as lost when mpiexec loses its daemon there: the node stops answering, or every process on it
    was killed. The lost nodes are also appended to ``lost_nodes`` when given (for the restarts).

    ``abort_wait``: when a rank's abort report (``MPI_Abort``, or an MPI error) has come through and mpiexec is
    still running this many seconds later, mpiexec is ended (SIGTERM, then SIGKILL ``END_GRACE`` s later, with what
    it started on this machine) and the status is 1. Open MPI's mpiexec tells every daemon to end its ranks and
    waits for their answers; a daemon whose node was cut off just before never answers, and once that message is
    unacknowledged the out-of-band keepalive no longer applies: TCP retransmits for about 15 minutes. None: no
    limit.

    ``signal_wait``: mpiexec still running this many seconds after the first signal passed on to it is ended the same
    way, for the same reason (its daemon on a node cut off never answers), and the status is 128 + that signal's
    number. None: no limit. The first signal passed on is appended to ``signals`` when given (the restarts stop).
    """
    arm = _die_with_parent()
    # preexec_fn runs between fork and exec; arm only makes four system calls (no imports, no I/O).
    pipe = subprocess.PIPE
    proc = subprocess.Popen(argv, env={**os.environ, **env}, preexec_fn=arm, stdout=pipe, stderr=pipe)  # noqa: PLW1509
    lost: dict[str, None] = {}
    signalled: list[tuple[int, float]] = []  # the first signal passed on, and when

    def forward(signum: int, _frame: FrameType | None) -> None:
        if not signalled:
            signalled.append((signum, time.monotonic()))
        proc.send_signal(signum)

    previous = {sig: signal.signal(sig, forward) for sig in _FORWARDED}
    try:
        code, cut_short = _wait_copying(proc, lost, abort_wait, signalled, signal_wait)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    code = 128 - code if code < 0 else code
    if cut_short:
        after = (
            f"{abort_wait:g} s after a rank aborted the job"
            if cut_short == "abort"
            else f"{signal_wait:g} s after the launcher passed it {signal.Signals(signalled[0][0]).name}"
        )
        print(
            f"distutils-ml launch: mpiexec was still running {after} (it waits for the daemons of every node to end "
            "their ranks, and one it cannot reach, on a node cut off, keeps it waiting); the launcher ended it and its "
            "processes on this machine",
            file=sys.stderr,
            flush=True,
        )
        code = 1 if cut_short == "abort" else 128 + signalled[0][0]
    if signals is not None:
        signals += [signum for signum, _ in signalled]
    if lost_nodes is not None:
        lost_nodes += list(lost)
    if lost:
        hosts = _read_rank_hosts(rank_hosts)
        named = [
            f"{node} (rank(s) {[r for r, h in enumerate(hosts) if h == node]})" if node in hosts else node
            for node in lost
        ]
        said = f"; mpiexec exited with status {code}, but a job that lost a node failed" if code == 0 else ""
        print(f"distutils-ml launch: the job lost node(s) {', '.join(named)}{said}", file=sys.stderr, flush=True)
        code = code or 1
    return code


def _wait_copying(
    proc: subprocess.Popen[bytes],
    lost: dict[str, None],
    abort_wait: float | None = None,
    signalled: list[tuple[int, float]] | None = None,
    signal_wait: float | None = None,
) -> tuple[int, str]:
    """Copy ``proc``'s standard output and error to ours until it ends, noting each node reported lost; its exit
    status, and why it was ended here ("": it was not): "abort", it outlived a rank's abort by ``abort_wait`` s, or
    "signal", the first signal passed on to it (``signalled``: its number and time) by ``signal_wait`` s (see
    :func:`run_supervised`). Open MPI 5 writes one of its reports to standard output, the other to standard error.

    All in this one thread. The kernel sends the parent-death signal each time the thread that
    started mpiexec ends and mpiexec passes to another of this process's threads: a reader thread
    made a killed launcher send SIGTERM twice, and mpiexec takes a second SIGTERM as "abort now",
    leaving the ranks running.
    """
    assert proc.stdout is not None and proc.stderr is not None
    streams = {proc.stdout.fileno(): _Stream(sys.stdout), proc.stderr.fileno(): _Stream(sys.stderr)}
    both = list(streams.values())
    if os.name == "nt":  # no select() on pipes, and no parent-death signal to protect: reader threads
        readers = [threading.Thread(target=_copy_all, args=(fd, s, lost), daemon=True) for fd, s in streams.items()]
        for reader in readers:
            reader.start()
        code = proc.wait()
        for reader in readers:
            reader.join(timeout=2)
        return code, ""
    ended = None
    ending: _Ending | None = None
    why = ""
    # Not until end of file alone: a daemon left on a lost node may hold mpiexec's output open.
    while ended is None or (streams and time.monotonic() - ended < 2):
        if ended is None and proc.poll() is not None:
            ended = time.monotonic()
        for fd in select.select(list(streams), [], [], 0.2)[0]:
            chunk = os.read(fd, 65536)
            if chunk:
                streams[fd].copy(chunk, lost)
            else:
                del streams[fd]
        if ended is None:
            if ending is not None:
                ending.advance()
                continue
            now = time.monotonic()
            aborted = [s.aborted for s in both if s.aborted is not None]
            if abort_wait is not None and aborted and now - min(aborted) > abort_wait:
                why = "abort"
            elif signal_wait is not None and signalled and now - signalled[0][1] > signal_wait:
                why = "signal"
            if why:
                ending = _Ending(proc)
    code = proc.wait()
    if ending is not None:
        ending.finish()
    return code, why


class _Ending:
    """Ending ``proc`` and what it started on this machine: SIGTERM now, SIGKILL ``END_GRACE`` s later."""

    def __init__(self, proc: subprocess.Popen[bytes]) -> None:
        self.proc = proc
        self.family = _descendants(proc.pid)  # before the signal: once it is gone, its children are init's
        self.killed = False
        self.since = time.monotonic()
        proc.terminate()

    def advance(self) -> None:
        """SIGKILL to it and what it started, once ``END_GRACE`` s have passed since the SIGTERM."""
        if not self.killed and time.monotonic() - self.since > END_GRACE:
            self.family.update(_descendants(self.proc.pid))
            self.proc.kill()
            self.finish()
            self.killed = True

    def finish(self) -> None:
        """SIGKILL what it started that is still running (each process the same as when seen, not a reused number)."""
        for pid, started in self.family.items():
            if _started(pid) == started:
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)


def _descendants(pid: int) -> dict[int, str]:
    """``pid``'s descendants on this machine (Linux's /proc; elsewhere none), each with its start time."""
    stats = {int(p.parent.name): fields for p in Path("/proc").glob("[0-9]*/stat") if (fields := _stat(p.parent.name))}
    parents = {p: int(fields[1]) for p, fields in stats.items()}
    found = {pid}
    while grown := {child for child, parent in parents.items() if parent in found} - found:
        found |= grown
    return {p: stats[p][_STARTTIME] for p in found - {pid}}


def _started(pid: int) -> str:
    """When ``pid`` started, in clock ticks since boot (empty when there is no such process): a process's identity,
    as a reused number has another."""
    fields = _stat(str(pid))
    return fields[_STARTTIME] if fields else ""


def _stat(pid: str) -> list[str]:
    """The fields of /proc/PID/stat after the command's name (state, parent, ...; empty when there is none)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return []
    return fields if len(fields) > _STARTTIME else []


_STARTTIME = 19  # in _stat's fields (field 22 of proc(5), counted from 1 with the pid and the name)


class _Stream:
    """One of mpiexec's output streams, copied to ``to`` and watched for lost nodes."""

    def __init__(self, to: TextIO) -> None:
        self.to, self.tail = to, b""
        self.aborted: float | None = None  # when a rank's abort report was first seen (time.monotonic())

    def copy(self, chunk: bytes, lost: dict[str, None]) -> None:
        """Write ``chunk`` on, and note each node it reports lost in ``lost``."""
        out = getattr(self.to, "buffer", None)
        if out is not None:
            out.write(chunk)
            out.flush()
        else:
            self.to.write(chunk.decode(errors="replace"))
            self.to.flush()
        window = self.tail + chunk
        for match in _LOST_NODE.finditer(window):
            lost[(match.group(1) or match.group(2)).decode(errors="replace")] = None
        if self.aborted is None and _ABORTED.search(window):
            self.aborted = time.monotonic()
        self.tail = window[-1024:]  # a report split across two reads is still found (once: lost is a set)


def _copy_all(fd: int, stream: _Stream, lost: dict[str, None]) -> None:
    """Copy ``fd`` on until end of file (see :meth:`_Stream.copy`)."""
    while chunk := os.read(fd, 65536):
        stream.copy(chunk, lost)


def _read_rank_hosts(path: Path | None) -> list[str]:
    """Each rank's host as rank 0 wrote them (empty when it did not: rank 0 ran elsewhere, or never started)."""
    try:
        return path.read_text().split() if path is not None else []
    except OSError:
        return []


# SIGHUP: the terminal or SSH session closed. Windows has none.
_FORWARDED = tuple(getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP") if hasattr(signal, name))
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def _die_with_parent() -> Callable[[], None] | None:
    """A ``preexec_fn`` that has the child sent SIGTERM when this process dies (Linux), else None.

    The kernel's parent-death signal fires when the thread that started the child ends, so
    the launcher runs mpiexec from its main thread. If the launcher died before the child
    armed the signal, the child ends itself at once.
    """
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    prctl.restype = ctypes.c_int
    parent = os.getpid()

    def arm() -> None:  # in the child, between fork and exec
        # Its standard error is a pipe to this process: once this process is dead, a write there must
        # not kill mpiexec (SIGPIPE) before it has ended the ranks.
        signal.signal(signal.SIGPIPE, signal.SIG_IGN)
        prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
        if os.getppid() != parent:
            os.kill(os.getpid(), signal.SIGTERM)

    return arm
