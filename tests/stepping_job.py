"""The MPI job of tests/test_stepping.py: ``mpiexec -n N python tests/stepping_job.py [CHECK...]``.

Runs the bodies of tests/stepping_bodies.py that LocalBackend runs too: ``equivalence`` (hypothesis) and
``errors``. Under ``DML_TRANSPORT=gloo`` with overlap the buckets go over gloo and are stepped on the communication
thread. Rank 0 ends with ``STEPPING CHECKS PASSED``.
"""

from __future__ import annotations

import faulthandler
import signal
import sys

import distutils_ml as dml

import stepping_bodies as sb
from mpi_main import guarded, hypothesis_check, run_checks


def main(names: list[str]) -> None:
    faulthandler.register(signal.SIGUSR1)  # the test runner asks for stacks before killing a hung job
    dml.initialize(dml.MPIBackend)
    world = dml.get_distributed_backend(dml.MPIBackend)
    checks = {
        "equivalence": lambda: hypothesis_check(world, sb.equivalence_body, sb.step_cases(), 25),
        "errors": lambda: (
            [guarded(sb.errors_body, world, what) for what in ("clip", "scaler", "replaced", "twice", "lr")]
            + [guarded(sb.errors_body, world, what, True) for what in ("clip", "scaler", "in_place", "twice", "lr")]
            + [guarded(sb.no_hook_body, world, shard, True) for shard in (False, True)]
            + [
                guarded(sb.load_between_body, world, shard, True, side)
                for shard in (False, True)
                for side in (True, False)
            ]
            + [guarded(sb.load_after_failed_round_body, world, shard) for shard in (False, True)]
            + [guarded(sb.failing_step_body, world, True), guarded(sb.failing_rest_body, world)]
            + [guarded(sb.unfinished_backward_body, world, shard, shard) for shard in (True, False)]
            + [guarded(sb.landing_body, world)]
            + [guarded(sb.synchronize_body, world)]
            + [guarded(sb.sharded_agreement_body, world, s) for s in ("step_during_backward", "prefetch")]
        ),
    }
    run_checks(world, names or list(checks), "STEPPING CHECKS PASSED", lambda name: checks[name]())


if __name__ == "__main__":
    main(sys.argv[1:])
