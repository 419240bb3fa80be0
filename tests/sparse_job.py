"""The MPI job of tests/test_sparse.py: ``mpiexec -n N python tests/sparse_job.py [CHECK...]``.

Every rank runs the bodies of tests/sparse_bodies.py that LocalBackend runs too, on the default
MPIBackend, on one with 16-byte segments (every message cut into pieces) and on one in debug mode,
all in one job (importing torch costs about 2 s a process). Rank 0 ends with ``SPARSE CHECKS PASSED``.
"""

from __future__ import annotations

import faulthandler
import signal
import sys
import zlib

from hypothesis import given, seed, settings

import distutils_ml as dml

import sparse_bodies as sb
from mpi_main import EXAMPLE_FACTOR, RUN_SEED, SETTINGS, guarded, run_checks

EXAMPLES = 40  # random calls per backend (the dev profile draws more)


def properties(backends: dict[str, dml.Backend]) -> int:
    """``EXAMPLES`` random calls per backend; the seed names the backend (and under the dev profile the job's
    DML_HYPOTHESIS_SEED, the same on every rank)."""
    count = 0

    def check(label: str, backend: dml.Backend) -> None:
        @seed(zlib.crc32(f"sparse/{label}".encode()) ^ RUN_SEED)
        @settings(SETTINGS, max_examples=EXAMPLES * EXAMPLE_FACTOR)
        @given(case=sb.sparse_cases())
        def run(case: sb.SparseCase) -> None:
            nonlocal count
            guarded(sb.sparse_body, backend, case)
            count += 1

        run()

    for label, backend in backends.items():
        check(label, backend)
    return count


def main(names: list[str]) -> None:
    faulthandler.register(signal.SIGUSR1)  # the test runner asks for stacks before killing a hung job
    dml.initialize(dml.MPIBackend)
    world = dml.get_distributed_backend(dml.MPIBackend)
    tiny = dml.MPIBackend(segment_bytes=16)
    checker = dml.MPIBackend(debug=True)
    three = {"default": world, "segment16": tiny, "debug": checker}
    size = world.size

    checks = {
        "matrix": lambda: {label: guarded(sb.matrix_body, b) for label, b in three.items()},
        "properties": lambda: properties(three),
        "bad_input": lambda: [guarded(sb.bad_input_body, b, c) for b in (world, checker) for c in range(size)],
        "mismatch": lambda: len([guarded(sb.mismatch_body, world, case) for case in sb.MISMATCHES]),
        "debug": lambda: guarded(sb.debug_body, checker, sb.matrix_cases()[5]),
        "embedding": lambda: guarded(sb.embedding_body, world, 3),
    }
    run_checks(world, names or list(checks), "SPARSE CHECKS PASSED", lambda name: checks[name]())


if __name__ == "__main__":
    main(sys.argv[1:])
