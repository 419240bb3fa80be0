"""Open MPI's session directories left behind by killed processes, found and removed.

Open MPI 5 keeps a session directory for each process of its runtime in the temporary directory: ``ompi.<pid>``
for ``mpiexec`` and ``prted.<pid>`` for the daemon on each other node. A process removes its own when it exits, but
not when it is killed (SIGKILL, the out-of-memory killer, a node's processes killed by a scheduler or an admin).
A later ``mpiexec`` or daemon that gets the same process id finds the old directory, cannot start its PMIx
server, and the job fails at once with "A daemon failed to report back ... Daemon exit status: 213" (a remote
daemon) or "The PMIx server's listener thread failed to start" (``mpiexec``). With Linux's default ``pid_max`` of
32768, process ids come round within hours on a busy node, so a node whose processes were killed once fails a job
now and then, long after.

A directory is stale, and removed, only if all of these hold: its name is ``ompi.<pid>`` or ``prted.<pid>``; it is
a directory (not a link) owned by this user; no process ``<pid>`` runs (there is none, or a zombie); and it holds
PMIx's rendezvous file ``pmix.<host>.tool.<pid>`` written by that process on this host (so a directory that another
host or container with its own hostname shares through ``/tmp`` is left alone).

``distutils-ml launch --restarts`` runs this file on every node before it starts a failed job again
(docs/failures.md). It imports nothing of this package, so it runs as ``python -c "<this file's text>"``.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import sys
import tempfile
from collections.abc import Iterable
from pathlib import Path

__all__ = ["remove_stale", "running", "stale"]

_NAME = re.compile(r"(?:ompi|prted)\.(\d+)")


def stale(tmpdir: str | os.PathLike[str] | None = None, hosts: Iterable[str] | None = None) -> list[Path]:
    """The stale session directories in ``tmpdir`` (default: the temporary directory), sorted.

    Args:
        tmpdir: where Open MPI keeps them (``TMPDIR``, else ``/tmp``).
        hosts: the hostnames whose directories count; default this host's name and its short form.
    """
    if not hasattr(os, "geteuid"):
        return []  # not POSIX: Open MPI 5 does not run there
    base = Path(tmpdir or tempfile.gettempdir())
    if hosts is None:
        name = socket.gethostname()
        hosts = {name, name.split(".")[0]}
    names = set(hosts)
    found = []
    try:
        entries = list(base.iterdir())
    except OSError:
        return []
    for entry in entries:
        match = _NAME.fullmatch(entry.name)
        if match is None:
            continue
        pid = int(match.group(1))
        try:
            info = entry.lstat()
        except OSError:
            continue
        if not entry.is_dir() or entry.is_symlink() or info.st_uid != os.geteuid() or running(pid):
            continue
        if any((entry / f"pmix.{host}.tool.{pid}").exists() for host in names):
            found.append(entry)
    return sorted(found)


def remove_stale(tmpdir: str | os.PathLike[str] | None = None, hosts: Iterable[str] | None = None) -> list[Path]:
    """Remove the directories :func:`stale` finds; those removed."""
    removed = []
    for entry in stale(tmpdir, hosts):
        shutil.rmtree(entry, ignore_errors=True)
        if not entry.exists():
            removed.append(entry)
    return removed


def running(pid: int) -> bool:
    """Whether process ``pid`` runs. A zombie does not: a killed daemon whose parent was killed too stays one until
    init reaps it, which can take seconds."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True  # no /proc to ask: it exists
    return state not in {"Z", "X"}


if __name__ == "__main__":
    # Run on a node by the launcher's probe: one line per directory removed, prefixed with this host's name.
    for path in remove_stale():
        print(f"{socket.gethostname()}: removed {path}")
    sys.exit(0)
