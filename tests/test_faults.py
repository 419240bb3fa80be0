"""A rank that dies mid-training ends the whole MPI job quickly, with a non-zero exit.

tests/fault_job.py trains with a DistributedOptimizer on 2 ranks; rank 1 fails while
rank 0 waits in the next gradient allreduce. Without the launcher's and the fail-fast
hook's help rank 0 would wait forever; the tests check that the job ends non-zero,
within 60 s of its start, and report how long it took after the fault.
"""

from __future__ import annotations

import re
import socket
import time

from mpirun import Job, requires_mpi, run_mpi

pytestmark = requires_mpi

LIMIT_S = 60


def run_fault(mode: str, runner: tuple[str, ...] = ()) -> tuple[Job, float]:
    """Run fault_job.py MODE on 2 ranks; return the job and the seconds from the fault to its end."""
    job = run_mpi(2, ["tests/fault_job.py", mode], timeout=120, runner=runner)
    end = time.time()
    found = re.search(r"FAULT AT (\d+\.\d+)", job.output)
    assert found, f"the fault never happened:\n{job.output[-8000:]}"
    after_fault = end - float(found.group(1))
    print(f"{mode}: job ended with {job.returncode} after {job.seconds:.1f} s, {after_fault:.2f} s after the fault")
    return job, after_fault


def test_sigkilled_rank_ends_the_job() -> None:
    # Rank 1 dies without a word (SIGKILL: no handler, no MPI_Abort); mpiexec notices and kills rank 0.
    job, after_fault = run_fault("sigkill")
    assert job.returncode != 0, job.output[-8000:]
    assert job.seconds < LIMIT_S and after_fault < LIMIT_S, f"took {job.seconds:.1f} s ({after_fault:.1f} s after)"
    assert "NOT ABORTED" not in job.output, job.output[-8000:]
    assert "[1/2" in job.output and "step 2 done" in job.output, "rank 1 died after its third step"
    assert "step 3 done" not in job.output, "rank 0 cannot finish a step without rank 1"
    assert re.search(r"rank 1 .*exited on\s+signal 9", job.output), job.output[-8000:]


def test_dataloader_worker_error_ends_the_job() -> None:
    # The worker's exception reaches rank 1's main process, whose fail-fast hook aborts the world.
    job, after_fault = run_fault("worker-error")
    assert job.returncode != 0, job.output[-8000:]
    assert job.seconds < LIMIT_S and after_fault < LIMIT_S, f"took {job.seconds:.1f} s ({after_fault:.1f} s after)"
    assert "NOT ABORTED" not in job.output, job.output[-8000:]
    head = f"[rank 1] distutils_ml: uncaught exception on rank 1 of 2 (on {socket.gethostname()}); aborting the MPI job"
    assert head in job.output, job.output
    assert "[rank 1] ValueError: Caught ValueError in DataLoader worker process 0." in job.output, job.output
    assert "[rank 1] ValueError: corrupt sample 21: cannot decode" in job.output, job.output
    assert "MPI_ABORT was invoked on rank 1" in job.output, job.output[-8000:]


def test_sys_exit_on_one_rank_ends_the_launched_job() -> None:
    # No exception hook sees SystemExit; the launcher's runner (python -m mpi4py) aborts the world.
    job, after_fault = run_fault("sys-exit", runner=("-m", "mpi4py"))
    assert job.returncode != 0, job.output[-8000:]
    assert job.seconds < LIMIT_S and after_fault < LIMIT_S, f"took {job.seconds:.1f} s ({after_fault:.1f} s after)"
    assert "NOT ABORTED" not in job.output and "step 3 done" not in job.output, job.output[-8000:]


def test_uncaught_exception_aborts_even_when_another_library_replaced_the_hook() -> None:
    # Under plain `mpiexec python` (no launcher), after a rich/sentry-style sys.excepthook replaced ours
    # without chaining, rank 1 raises while rank 0 waits in an allreduce (stall timeout: the default 300 s).
    job = run_mpi(2, ["tests/core_job.py", "hook_replaced"], timeout=120)
    assert job.returncode != 0, job.output[-8000:]
    assert job.seconds < 30, f"took {job.seconds:.1f} s: the abort waited for the stall timeout"
    assert "OTHER HOOK: RuntimeError: deliberate failure on rank 1" in job.output, job.output[-8000:]
    head = f"[rank 1] distutils_ml: uncaught exception on rank 1 of 2 (on {socket.gethostname()}) (sys.excepthook was"
    assert head in job.output
    assert "[rank 1] RuntimeError: deliberate failure on rank 1" in job.output, job.output[-8000:]
