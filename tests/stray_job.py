"""The job of tests/test_cluster.py's stray-client test: ``mpiexec ... python tests/stray_job.py CHECK...``, with
``DML_TRANSPORT=gloo``.

tests/transport_job.py's bodies: ``ring``, the gloo transport's allreduce, reduce-scatter and allgather bit for bit
against the op over every rank's buffer, on RING_EXAMPLES examples of its strategy (derandomized: the same on every
run and every rank); ``buckets``, a model's gradient buckets over gloo during backward. The stray
client needs exact results over every kind of call to compare, not tests/test_transport.py's 40 examples (the test
runs this job twice: alone, then with the stray client): 12 examples, drawn as there, which include every op,
arrays of a few elements and of millions, and unsigned integers (those go over the backend). Rank 0 ends with
``TRANSPORT CHECKS PASSED``.
"""

from __future__ import annotations

import faulthandler
import signal
import sys

import distutils_ml as dml

import transport_job
from mpi_main import hypothesis_check, run_checks

RING_EXAMPLES = 12


def main(names: list[str]) -> None:
    faulthandler.register(signal.SIGUSR1)  # the test runner asks for stacks before killing a hung job
    dml.initialize(dml.MPIBackend)
    world = dml.get_distributed_backend(dml.MPIBackend)
    checks = {
        "ring": lambda: hypothesis_check(world, transport_job.ring_body, transport_job.ring_cases(), RING_EXAMPLES),
        "buckets": lambda: transport_job.buckets_body(world),
    }
    run_checks(world, names, "TRANSPORT CHECKS PASSED", lambda name: checks[name]())


if __name__ == "__main__":
    main(sys.argv[1:])
