"""Process supervision for the launcher: mpiexec runs, and ends, with the launcher.

SIGINT, SIGTERM and SIGHUP (a closed terminal or SSH session) are passed on to mpiexec,
which ends the ranks; on Linux mpiexec gets SIGTERM when the launcher dies in any other way
(SIGKILL, an out-of-memory kill), through the kernel's parent-death signal. mpiexec's
standard error passes through the launcher, which watches it for a node that Open MPI
reports lost and then fails the job, naming that node's ranks.
"""

from __future__ import annotations

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

__all__ = ["run_supervised"]

# Open MPI 5 (PRRTE) and 4 (ORTE) when a node stops answering; Open MPI may still exit 0 after it.
_LOST_NODE = re.compile(rb"[PO]RTE has lost communication with a remote daemon.*?Remote daemon:.*? on node (\S+)", re.S)


def run_supervised(argv: list[str], env: Mapping[str, str], rank_hosts: Path | None = None) -> int:
    """Run ``argv`` with ``env`` added to this environment, passing SIGINT, SIGTERM and SIGHUP on; its exit status.

    On Linux, the command also gets SIGTERM if this process dies without passing a signal on.
    Its standard error passes through this process, which watches it for a node that mpiexec
    reports lost: the job then fails (status 1 if mpiexec said 0, as Open MPI 5 does), and the
    lost node's ranks are named from ``rank_hosts`` (written by rank 0) when that file exists.
    """
    arm = _die_with_parent()
    # preexec_fn runs between fork and exec; arm only makes four system calls (no imports, no I/O).
    proc = subprocess.Popen(argv, env={**os.environ, **env}, preexec_fn=arm, stderr=subprocess.PIPE)  # noqa: PLW1509
    lost: dict[str, None] = {}

    def forward(signum: int, _frame: FrameType | None) -> None:
        proc.send_signal(signum)

    previous = {sig: signal.signal(sig, forward) for sig in _FORWARDED}
    try:
        code = _wait_copying_stderr(proc, lost)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    code = 128 - code if code < 0 else code
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


def _wait_copying_stderr(proc: subprocess.Popen[bytes], lost: dict[str, None]) -> int:
    """Copy ``proc``'s standard error to ours until it ends, noting each node reported lost; its exit status.

    All in this one thread. The kernel sends the parent-death signal each time the thread that
    started mpiexec ends and mpiexec passes to another of this process's threads: a reader thread
    made a killed launcher send SIGTERM twice, and mpiexec takes a second SIGTERM as "abort now",
    leaving the ranks running.
    """
    assert proc.stderr is not None
    if os.name == "nt":  # no select() on pipes, and no parent-death signal to protect: a reader thread
        reader = threading.Thread(target=_copy_all, args=(proc.stderr.fileno(), lost), daemon=True)
        reader.start()
        code = proc.wait()
        reader.join(timeout=2)
        return code
    fd, tail, ended = proc.stderr.fileno(), b"", None
    # Not until end of file alone: a daemon left on a lost node may hold mpiexec's standard error open.
    while ended is None or time.monotonic() - ended < 2:
        if ended is None and proc.poll() is not None:
            ended = time.monotonic()
        if select.select([fd], [], [], 0.2)[0]:
            chunk = os.read(fd, 65536)
            if not chunk:
                break
            tail = _copy_chunk(chunk, tail, lost)
    return proc.wait()


def _copy_all(fd: int, lost: dict[str, None]) -> None:
    """Copy ``fd`` to our standard error until end of file (see :func:`_copy_chunk`)."""
    tail = b""
    while chunk := os.read(fd, 65536):
        tail = _copy_chunk(chunk, tail, lost)


def _copy_chunk(chunk: bytes, tail: bytes, lost: dict[str, None]) -> bytes:
    """Write ``chunk`` to our standard error, note each node it reports lost in ``lost``; the new tail."""
    out = sys.stderr.buffer if hasattr(sys.stderr, "buffer") else None
    if out is not None:
        out.write(chunk)
        out.flush()
    else:
        sys.stderr.write(chunk.decode(errors="replace"))
    window = tail + chunk
    for match in _LOST_NODE.finditer(window):
        lost[match.group(1).decode(errors="replace")] = None
    return window[-1024:]  # a report split across two reads is still found (once: lost is a set)


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
