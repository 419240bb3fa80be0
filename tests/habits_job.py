"""The MPI job of tests/test_buckets.py: ``mpiexec -n N python tests/habits_job.py [CHECK...]``.

Every rank runs the bodies of tests/habits_bodies.py that LocalBackend runs too. Rank 0 ends with
``HABITS CHECKS PASSED``.
"""

from __future__ import annotations

import faulthandler
import signal
import sys
import warnings

import distutils_ml as dml

import habits_bodies
from mpi_main import guarded, hypothesis_check, run_checks


def main(names: list[str]) -> None:
    faulthandler.register(signal.SIGUSR1)  # the test runner asks for stacks before killing a hung job
    warnings.filterwarnings("ignore", message="Using backward\\(\\) with create_graph=True")
    dml.initialize(dml.MPIBackend)
    world = dml.get_distributed_backend(dml.MPIBackend)
    checks = {
        "create_graph": lambda: [guarded(habits_bodies.create_graph_body, world, o) for o in (False, True)],
        "penalty": lambda: hypothesis_check(world, habits_bodies.penalty_body, habits_bodies.penalty_cases(), 8),
        "shared": lambda: [
            guarded(habits_bodies.shared_across_body, world, form, o) for form in habits_bodies.FORMS for o in (0, 1)
        ],
        "sparse": lambda: hypothesis_check(
            world, habits_bodies.sparse_embedding_body, habits_bodies.sparse_cases(), 10
        ),
        "hooks": lambda: [
            guarded(habits_bodies.user_hook_body, world, way, o, r)
            for way in habits_bodies.HOOK_WAYS
            for o in (False, True)
            for r in (False, True)
        ],
        "again": lambda: [
            guarded(habits_bodies.created_again_body, world, first, second, op)
            for first, second in habits_bodies.AGAIN
            for op in ("avg", "sum")
        ],
        "changed": lambda: [
            guarded(habits_bodies.changed_data_body, world, way, o, how, only)
            for way in ("optimizer", "sharded", "sharded_sdb")
            for o in (False, True)
            for how in ("shape", "dtype")
            for only in (False, True)
        ],
        "converted": lambda: [
            guarded(habits_bodies.converted_body, world, way, o)
            for way in ("optimizer", "sharded", "reduce_in_backward")
            for o in (False, True)
        ],
        "checkpoint": lambda: hypothesis_check(
            world, habits_bodies.checkpoint_body, habits_bodies.checkpoint_cases(), 16
        ),
    }
    run_checks(world, names or list(checks), "HABITS CHECKS PASSED", lambda name: checks[name]())


if __name__ == "__main__":
    main(sys.argv[1:])
