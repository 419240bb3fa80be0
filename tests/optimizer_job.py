"""The MPI job of tests/test_optimizer.py: ``mpiexec -n N python tests/optimizer_job.py [CHECK...]``.

Every rank runs the bodies of tests/train_bodies.py that LocalBackend runs too: a
backward() after synchronize() (reduced again with a warning, or refused on every rank),
configurations that differ on one random rank (hypothesis, derandomized so every rank
draws the same cases), sparse gradients, and step(closure); all of them unless CHECKs
are named. A failing body prints its rank and traceback and aborts the job. Rank 0 ends
with ``OPTIMIZER CHECKS PASSED``.
"""

from __future__ import annotations

import faulthandler
import signal
import sys
import warnings

import distutils_ml as dml

import train_bodies
from mpi_main import guarded, hypothesis_check, run_checks


def late_backward(backend: dml.Backend) -> int:
    with warnings.catch_warnings(record=True) as recorded:
        warnings.simplefilter("always")
        expected = train_bodies.late_backward_body(backend, 3)
    train_bodies.check_warnings(expected, recorded)
    return len(expected)


def main(names: list[str]) -> None:
    faulthandler.register(signal.SIGUSR1)  # the test runner asks for stacks before killing a hung job
    dml.initialize(dml.MPIBackend)
    world = dml.get_distributed_backend(dml.MPIBackend)
    checks = {
        "late_backward": lambda: guarded(late_backward, world),
        "config": lambda: hypothesis_check(world, train_bodies.config_mismatch_body, train_bodies.config_cases(), 40),
        "sparse": lambda: guarded(train_bodies.sparse_gradient_body, world, 4),
        "closure": lambda: guarded(train_bodies.closure_body, world, 5),
    }
    run_checks(world, names or list(checks), "OPTIMIZER CHECKS PASSED", lambda name: checks[name]())


if __name__ == "__main__":
    main(sys.argv[1:])
