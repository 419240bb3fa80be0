"""The MPI job of tests/test_join.py: ``mpiexec -n N python tests/join_job.py``; rank 0 ends with
``JOIN CHECKS PASSED``."""

from __future__ import annotations

import faulthandler
import signal
import sys

from hypothesis import strategies as st

import distutils_ml as dml

import join_bodies
from mpi_main import guarded, hypothesis_check, run_checks


def main(names: list[str]) -> None:
    faulthandler.register(signal.SIGUSR1)  # the test runner asks for stacks before killing a hung job
    dml.initialize(dml.MPIBackend)
    world = dml.get_distributed_backend(dml.MPIBackend)
    checks = {
        "uneven": lambda: hypothesis_check(world, join_bodies.join_body, join_bodies.join_cases(world.size), 12),
        "refusals": lambda: guarded(join_bodies.refusals_body, world),
        "rooted": lambda: hypothesis_check(
            world,
            lambda b, case: join_bodies.rooted_calls_body(b, *case),
            st.tuples(join_bodies.join_uneven_batches(world.size), st.integers(0, world.size - 1)),
            6,
        ),
        "skips": lambda: guarded(
            join_bodies.averages_skips_and_buffers_body, world, (1, 3) if world.size == 2 else (0, 2, 3)
        ),
        "odd": lambda: guarded(
            join_bodies.skips_and_odd_forwards_body, world, (2, 4) if world.size == 2 else (5, 2, 3)
        ),
        "around": lambda: hypothesis_check(
            world,
            lambda b, case: join_bodies.calls_around_the_step_body(b, *case),
            st.tuples(join_bodies.join_uneven_batches(world.size), st.sampled_from(join_bodies.AROUND)),
            6,
        ),
    }
    run_checks(world, names or list(checks), "JOIN CHECKS PASSED", lambda name: checks[name]())


if __name__ == "__main__":
    main(sys.argv[1:])
