"""distutils_ml/sessiondirs.py: the session directories killed Open MPI processes leave, found and removed; and
why (a stale one fails the next mpiexec that gets its process id)."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

from distutils_ml import sessiondirs

from mpirun import mpi_env, mpiexec, requires_mpi


def _dead_pid() -> int:
    """The process id of a process that has exited (and been reaped)."""
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def _left(where: Path, kind: str, pid: int, host: str) -> Path:
    """A session directory as a killed ``mpiexec`` (``ompi``) or daemon (``prted``) leaves it: PMIx's rendezvous
    files as Open MPI 5 writes them (the address of its tool listener), and its job directories."""
    d = where / f"{kind}.{pid}"
    (d / "0" / "0").mkdir(parents=True)
    uri = f"prterun-{host}-{pid}@0.0;tcp4://127.0.0.1:{40000 + pid % 20000}\n5.0.11\n{pid}\n0:0\n{time.ctime()}\n\n"
    for name in (f"pmix.{host}.tool", f"pmix.{host}.tool.{pid}", f"pmix.{host}.tool.prterun-{host}-{pid}@0"):
        (d / name).write_text(uri)
        (d / name).chmod(0o600)
    return d


def test_only_the_directories_of_processes_gone_from_this_host_are_removed(tmp_path: Path) -> None:
    host = socket.gethostname()
    dead = [_dead_pid() for _ in range(6)]
    removed = [_left(tmp_path, "prted", dead[0], host), _left(tmp_path, "ompi", dead[1], host)]
    kept = [
        _left(tmp_path, "prted", os.getpid(), host),  # a live process's
        _left(tmp_path, "prted", dead[2], "another-host"),  # another host's (a container with its own /tmp view)
    ]
    unmarked = tmp_path / f"ompi.{dead[3]}"  # no rendezvous file: not known to be Open MPI's
    unmarked.mkdir()
    kept.append(unmarked)
    target = _left(tmp_path / "elsewhere", "prted", dead[4], host)
    link = tmp_path / f"prted.{dead[4]}"
    link.symlink_to(target)  # a link is never followed
    kept += [link, target]
    afile = tmp_path / f"ompi.{dead[5]}"
    afile.write_text("not a directory")
    kept.append(afile)
    lookalike = _left(tmp_path, "prted", dead[5], host).rename(tmp_path / f"prted.{dead[5]}.old")
    kept.append(lookalike)
    zombie = subprocess.Popen(["true"])  # exited, not yet reaped: a killed daemon whose parent was killed too
    while sessiondirs.running(zombie.pid):
        time.sleep(0.01)
    removed.append(_left(tmp_path, "prted", zombie.pid, host))
    if os.geteuid() == 0:
        other = _left(tmp_path, "ompi", dead[2], host)
        os.chown(other, 65534, 65534)  # another user's
        kept.append(other)
    assert sessiondirs.stale(tmp_path) == sorted(removed)
    assert sessiondirs.remove_stale(tmp_path) == sorted(removed)
    assert not any(p.exists() for p in removed)
    assert all(p.exists() or p.is_symlink() for p in kept), [p for p in kept if not p.exists()]
    assert (target / f"pmix.{host}.tool.{dead[4]}").exists()
    assert sessiondirs.stale(tmp_path, hosts=["another-host"]) == [tmp_path / f"prted.{dead[2]}"]
    assert sessiondirs.stale(tmp_path / "missing") == []
    zombie.wait()


@requires_mpi
def test_a_stale_directory_fails_the_mpiexec_that_gets_its_pid_until_removed(tmp_path: Path) -> None:
    """Open MPI 5 itself: an ``mpiexec`` whose process id has a stale session directory fails at once; once the
    directory is removed it runs. Stale directories are made for the next few hundred process ids."""
    base = Path(os.environ.get("TMPDIR", "/tmp"))
    host = socket.gethostname()
    start = _dead_pid() + 1
    limit = int(Path("/proc/sys/kernel/pid_max").read_text()) if Path("/proc/sys/kernel/pid_max").exists() else 32768
    pids = [p if p < limit else 300 + p - limit for p in range(start, start + 400)]  # pids wrap round to 300
    made = []
    try:
        for pid in pids:
            if not (base / f"ompi.{pid}").exists() and not sessiondirs.running(pid):
                made.append(_left(base, "ompi", pid, host))
        argv = [str(mpiexec()), "-n", "1", "--mca", "btl", "^ofi", "true"]
        failed = subprocess.run(argv, env=mpi_env(), capture_output=True, text=True, timeout=60, check=False)
        assert failed.returncode != 0, (
            "Open MPI no longer fails on a stale session directory of its process id: distutils_ml/sessiondirs.py "
            "may no longer be needed"
        )
        assert "listener thread failed to start" in failed.stdout + failed.stderr, failed.stdout + failed.stderr
        gone = sessiondirs.remove_stale(base)  # the failed mpiexec removed its own on the way out
        assert len(gone) >= len(made) - 1 and not [d for d in made if d.exists()]
        ran = subprocess.run(argv, env=mpi_env(), capture_output=True, text=True, timeout=60, check=False)
        assert ran.returncode == 0, ran.stdout + ran.stderr
    finally:
        for d in made:
            shutil.rmtree(d, ignore_errors=True)


def test_it_runs_as_a_script_without_the_package(tmp_path: Path) -> None:
    """The launcher's probe runs the file's text with ``python -c`` on each node: it needs nothing of the package
    (which may not be importable there), and it says what it removed."""
    host = socket.gethostname()
    stale = _left(tmp_path, "prted", _dead_pid(), host)
    source = Path(sessiondirs.__file__).read_text()
    # -I -S: no site-packages (where the package is installed), no PYTHONPATH, no current directory.
    done = subprocess.run(
        [sys.executable, "-I", "-S", "-c", source],
        env={**os.environ, "TMPDIR": str(tmp_path)},
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout == f"{host}: removed {stale}\n"
    assert not stale.exists()
