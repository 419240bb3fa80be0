"""The MPI side of the exact-evaluation tests: ``mpiexec -n N python tests/data_job.py``.

Runs the bodies of tests/data_bodies.py on every rank: gather_unpadded against the
single-process evaluation (hypothesis, derandomized, so every rank draws the same
cases; and every small size with every kind of values), and each misuse by each rank,
on the world backend and on a debug-mode one (a stray message of a refused call would
then fail the next collective's fingerprint check). A failing body prints its rank,
case and traceback and aborts the job. Rank 0 ends with ``DATA JOB PASSED`` when all
passed.
"""

from __future__ import annotations

import faulthandler
import signal
import time

from hypothesis import given, settings

import distutils_ml as dml

import data_bodies
from mpi_main import EXAMPLE_FACTOR, SETTINGS, fresh_in_dev, guarded


def gather_checks(backend: dml.Backend, examples: int) -> int:
    count = 0

    @fresh_in_dev
    @settings(SETTINGS, max_examples=examples * EXAMPLE_FACTOR)
    @given(case=data_bodies.gather_cases())
    def run(case: data_bodies.GatherCase) -> None:
        nonlocal count
        guarded(data_bodies.gather_body, backend, case)
        count += 1

    run()
    return count


def small_checks(backend: dml.Backend) -> int:
    cases = [case for values in data_bodies.GATHER_VALUES for case in data_bodies.small_gather_cases(values)]
    for case in cases:
        guarded(data_bodies.gather_body, backend, case)
    return len(cases)


def misuse_checks(backend: dml.Backend) -> int:
    count = 0
    for misuse in data_bodies.GATHER_MISUSES:
        for culprit in range(backend.size):
            error = guarded(data_bodies.gather_misuse_body, backend, misuse, culprit)
            errors = dml.allgather_object(backend, error)
            guarded(data_bodies.check_misuse, misuse, culprit, backend.size, errors)
            count += 1
    return count


def main() -> None:
    faulthandler.register(signal.SIGUSR1)  # the test runner asks for stacks before killing a hung job
    dml.initialize(dml.MPIBackend)
    world = dml.get_distributed_backend(dml.MPIBackend)
    checker = dml.MPIBackend(debug=True)
    start = time.perf_counter()
    detail = {
        "gather": gather_checks(world, 200),
        "small": small_checks(world),
        "gather_debug": gather_checks(checker, 30),
        "misuse": misuse_checks(world),
        "misuse_debug": misuse_checks(checker),
    }
    dml.print(world, f"data checks passed in {time.perf_counter() - start:.1f}s: {detail}")
    dml.barrier(world)
    if world.rank == 0:
        print(f"DATA JOB PASSED on {world.size} ranks", flush=True)


if __name__ == "__main__":
    main()
