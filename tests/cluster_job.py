"""One job for two tests of tests/test_cluster.py: ``mpiexec ... python tests/cluster_job.py CHECK,... CHECK,...``.

Runs the first argument's checks (comma-separated) as tests/mpi_main.py does (its ``main``: rank 0 ends with ``MPI
CHECKS PASSED``), then the second's as tests/reducer_job.py does (rank 0 ends with ``REDUCER CHECKS PASSED``), in the
same ranks: the start of a job across the cluster's nodes (every rank importing torch, on two cores) is paid once per
layout. A failing check aborts the job as it does in either script, so the second part runs only if the first passed.
"""

from __future__ import annotations

import sys

import reducer_job

import mpi_main


def main(mpi_checks: str, reducer_checks: str) -> None:
    mpi_main.main(mpi_checks.split(","))
    reducer_job.main(reducer_checks.split(","))  # dml.initialize again does nothing: the same world


if __name__ == "__main__":
    main(*sys.argv[1:])
