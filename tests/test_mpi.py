"""MPIBackend under real ``mpiexec`` jobs with 2 and 3 ranks.

Each job runs many checks (tests/mpi_main.py) to pay MPI and torch start-up once:
the property bodies of tests/bodies.py (the same ones LocalBackend runs), random and
the deterministic matrix of every op, dtype and form, every bad input followed by a good
collective (also on a debug-mode backend), odd sizes up to 64 MiB, sub-communicators,
object broadcast, and fail-fast on an uncaught exception.
"""

from __future__ import annotations

import re
import subprocess
import sys

import numpy as np
import pytest

from distutils_ml.backends.mpi import _average

import shared
from mpirun import assert_checks_passed, mpi_env, requires_mpi, run_mpi

pytestmark = requires_mpi

CHECKS = [
    "topology",
    "objects",
    "subcomm",
    "gradients",
    "bad_input",
    "properties",
    "matrix",
    "tensor_views",
    "synchronize",
    "train",
    "data",
    "debug",
]


EXTRA = {2: ["large", "ddp"], 3: []}
MPI_JOB = shared.register("mpi", "mpi_main", lambda ranks: CHECKS + EXTRA[ranks])


@pytest.mark.parametrize(("ranks", "extra"), EXTRA.items())
@pytest.mark.shared_job(MPI_JOB)
def test_collectives_under_mpiexec(ranks: int, extra: list[str]) -> None:
    job = shared.job(ranks, MPI_JOB)
    assert job.returncode == 0, job.output[-8000:]
    assert f"MPI CHECKS PASSED: {' '.join(CHECKS + extra)} on {ranks} ranks" in job.output, job.output[-8000:]
    assert_checks_passed(job, CHECKS + extra, ranks)
    host = " ".join(f"{r}:[^: ]+:{r}/{ranks}" for r in range(ranks))  # one machine: one node of every rank
    assert re.search(f"TOPOLOGY {host}", job.output), job.output[-8000:]


def test_uncaught_exception_aborts_the_whole_job_fast() -> None:
    # Rank 1 raises while ranks 0 and 2 wait in an allreduce: without fail-fast they would hang.
    job = run_mpi(3, ["tests/mpi_main.py", "raise_on_rank1"], timeout=90)
    assert job.returncode != 0, job.output
    assert job.seconds < 60, f"took {job.seconds:.1f} s"
    assert "RuntimeError: deliberate failure on rank 1" in job.output, job.output
    assert "[rank 1] distutils_ml: uncaught exception on rank 1 of 3" in job.output, job.output
    assert "not aborted" not in job.output


def test_stall_is_named_and_ends_the_job() -> None:
    # Rank 2 sleeps instead of joining an allreduce; the others' watchdog (timeout 3 s) reports and aborts.
    job = run_mpi(3, ["tests/mpi_main.py", "stall"], timeout=120)
    assert job.returncode != 0, job.output
    assert job.seconds < 3 + 30, f"took {job.seconds:.1f} s"
    assert "stall: waited" in job.output, job.output
    assert "in allreduce(shape=(4,), dtype=float32, op=dml.SUM) #2; rank(s) [2] have not arrived" in job.output
    assert "rank 2: not in a collective" in job.output
    assert "not aborted" not in job.output


@pytest.mark.parametrize(
    ("envs", "names"),
    [
        # DML_TIMEOUT=20 reached the first node only (Open MPI does not forward the environment to others).
        ([{"DML_TIMEOUT": "20"}, {"DML_TIMEOUT": "20"}, {}], ["timeout"]),
        # Debug mode on one rank would hang its first collective; different segments would pass silently.
        ([{}, {"DML_DEBUG": "1", "DML_MPI_SEGMENT_BYTES": "65536"}, {}], ["debug", "segment_bytes"]),
    ],
)
def test_ranks_with_different_options_are_refused_on_every_rank(envs: list[dict[str, str]], names: list[str]) -> None:
    job = run_mpi(3, ["tests/core_job.py", "options"], timeout=90, envs=envs)
    assert "ACCEPTED" not in job.output, job.output[-8000:]
    for rank in range(3):
        refused = [line for line in job.output.splitlines() if line.startswith(f"[rank {rank}] REFUSED: ")]
        assert len(refused) == 1, job.output[-8000:]
        for name in names:
            assert f"{name} (" in refused[0], refused[0]
        assert "rank(s) [" in refused[0] and "distutils-ml launch" in refused[0], refused[0]
        assert f"[rank {rank}] REFUSED AGAIN: " in job.output and "segment_bytes (" in job.output, job.output[-8000:]
    if names == ["timeout"]:
        assert "timeout (timeout= or DML_TIMEOUT): 20.0 on rank(s) [0, 1] on " in job.output, job.output[-4000:]
        assert "; 300.0 on rank(s) [2] on " in job.output, job.output[-4000:]
    assert job.returncode == 0, job.output[-8000:]


LAUNCHED_SIZE_VARIABLES = ["SLURM_STEP_NUM_TASKS", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE"]

# Started with VARIABLE=4 in its environment, as its launcher would set it: initialize must refuse; then, with
# VARIABLE=1 (a launcher that started one process), the same process initializes and trains alone.
_ALONE = """
import os, sys
import distutils_ml as dml

name = sys.argv[1]
try:
    dml.initialize(dml.MPIBackend)
except RuntimeError as e:
    print(f"REFUSED: {e}", file=sys.stderr, flush=True)
else:
    print(f"TRAINS ALONE with {name}=4", flush=True)
    sys.exit(1)
assert not dml.initialized(dml.MPIBackend), "a refused initialize left its backend behind"
os.environ[name] = "1"
dml.initialize(dml.MPIBackend)
print("TRAINS ALONE", flush=True)
"""


@pytest.fixture(scope="module")
def worlds_of_one() -> dict[str, tuple[int, str, str]]:
    """(exit status, stdout, stderr) of ``_ALONE`` per variable: the three processes run at once (each pays
    Python's, torch's and MPI's start alone, about 1.5 s, which the 2 cores then share)."""
    procs = {
        variable: subprocess.Popen(
            [sys.executable, "-c", _ALONE, variable],
            env={**mpi_env(), variable: "4"},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for variable in LAUNCHED_SIZE_VARIABLES
    }
    done = {}
    try:
        for variable, proc in procs.items():
            out, err = proc.communicate(timeout=90)
            done[variable] = (proc.returncode, out, err)
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return done


@pytest.mark.parametrize("variable", LAUNCHED_SIZE_VARIABLES)
def test_a_world_of_one_whose_launcher_started_several_is_refused(
    variable: str, worlds_of_one: dict[str, tuple[int, str, str]]
) -> None:
    # srun without --mpi=pmix, or another MPI's mpiexec: every process is its own world of one.
    returncode, stdout, stderr = worlds_of_one[variable]
    assert f"TRAINS ALONE with {variable}=4" not in stdout, stdout + stderr
    assert "REFUSED: " in stderr, stdout + stderr
    if variable == "SLURM_STEP_NUM_TASKS":  # srun: what to type (tests/test_slurm.py runs the real srun)
        assert "srun started 4 tasks" in stderr and "srun --mpi=pmix python train.py" in stderr, stderr
    else:
        assert f"world of one, but {variable}=4 says its launcher started 4 processes" in stderr, stderr
    assert returncode == 0 and "TRAINS ALONE" in stdout.splitlines(), stdout + stderr


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_avg_divides_bitwise_as_numpy_on_any_number_of_ranks(dtype: type) -> None:
    # A power of two multiplies by the inverse: the same bits as the division, subnormals included.
    info = np.finfo(dtype)
    rng = np.random.default_rng(7)
    x = np.concatenate(
        [
            rng.standard_normal(4096) * (info.max / 8),
            rng.standard_normal(4096) * info.smallest_normal * 4,  # subnormal quotients
            rng.standard_normal(4096),
            np.array([0.0, -0.0, np.inf, -np.inf, np.nan, info.max, info.smallest_subnormal, -info.smallest_normal]),
        ]
    ).astype(dtype)
    for size in [1, 2, 3, 4, 5, 6, 7, 8, 12, 16, 64, 100, 1024]:
        got = x.copy()
        _average(got, size)
        expect = np.divide(x, size)
        assert expect.dtype == dtype
        bits = np.dtype(f"u{x.itemsize}")
        np.testing.assert_array_equal(got.view(bits), expect.view(bits), err_msg=f"{size} ranks, {dtype.__name__}")
