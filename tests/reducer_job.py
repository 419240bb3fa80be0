"""The MPI job of tests/test_reducer.py: ``mpiexec -n N python tests/reducer_job.py [CHECK...]``.

Every rank runs the bodies of tests/reducer_bodies.py that LocalBackend runs too, with the
buckets reduced during backward on the communication thread (overlap) and at its end.
Rank 0 ends with ``REDUCER CHECKS PASSED``.
"""

from __future__ import annotations

import faulthandler
import signal
import sys

import distutils_ml as dml

import reducer_bodies
import train_bodies
from mpi_main import guarded, hypothesis_check, run_checks


def main(names: list[str]) -> None:
    faulthandler.register(signal.SIGUSR1)  # the test runner asks for stacks before killing a hung job
    dml.initialize(dml.MPIBackend)
    world = dml.get_distributed_backend(dml.MPIBackend)
    checks = {
        "grads_ready": lambda: hypothesis_check(
            world, reducer_bodies.grads_ready_body, reducer_bodies.grad_cases(), 25
        ),
        "errors": lambda: [guarded(reducer_bodies.errors_body, world, overlap) for overlap in (False, True)],
        "collective_in_backward": lambda: [
            guarded(reducer_bodies.collective_in_backward_body, world, overlap) for overlap in (False, True)
        ],
        "buffers": lambda: [guarded(reducer_bodies.buffers_body, world, overlap) for overlap in (False, True)],
        "train_overlap": lambda: hypothesis_check(
            world, train_bodies.train_overlap_body, train_bodies.train_cases(), 15
        ),
        "unused_overlap": lambda: guarded(train_bodies.unused_parameters_body, world, 2, True),
        "two_optimizers": lambda: [
            guarded(reducer_bodies.two_optimizers_body, world, False, shard, how)
            for shard in (False, True)
            for how in reducer_bodies.TWO_OPTIMIZER_CASES
        ],
    }
    run_checks(world, names or list(checks), "REDUCER CHECKS PASSED", lambda name: checks[name]())


if __name__ == "__main__":
    main(sys.argv[1:])
