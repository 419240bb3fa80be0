"""One job for two tests of tests/test_cluster.py: ``mpiexec ... python tests/cluster_job.py CHECK... -- CHECK...``.

Runs the checks before ``--`` as tests/mpi_main.py does (its ``main``: rank 0 ends with ``MPI CHECKS PASSED``), then
those after it as tests/reducer_job.py does (rank 0 ends with ``REDUCER CHECKS PASSED``), in the same ranks: the
start of a job across the cluster's nodes (every rank importing torch, on two cores) is paid once per layout. A
failing check aborts the job as it does in either script, so the second part runs only if the first passed.
"""

from __future__ import annotations

import sys

import reducer_job

import mpi_main


def main(argv: list[str]) -> None:
    split = argv.index("--")
    mpi_main.main(argv[:split])
    reducer_job.main(argv[split + 1 :])  # dml.initialize again does nothing: the same world


if __name__ == "__main__":
    main(sys.argv[1:])
