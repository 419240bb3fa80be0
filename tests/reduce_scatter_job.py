"""The MPI job of tests/test_reduce_scatter.py: ``mpiexec -n N python tests/reduce_scatter_job.py [CHECK...]``.

Every rank runs the bodies of tests/reduce_scatter_bodies.py that LocalBackend runs too, on the
default MPIBackend, on one with 16-byte segments (every call packed and segmented) and on one
in debug mode. Rank 0 ends with ``REDUCE_SCATTER CHECKS PASSED``.
"""

from __future__ import annotations

import faulthandler
import signal
import sys
import zlib

from hypothesis import given, seed, settings

import distutils_ml as dml

import bodies
import reduce_scatter_bodies as rsb
from mpi_main import EXAMPLE_FACTOR, RUN_SEED, SETTINGS, guarded, run_checks


def properties(backends: dict[str, dml.Backend], examples: int) -> int:
    """``examples`` random calls per dtype and backend (more under the dev profile); the seed names dtype and
    backend (and under dev the job's DML_HYPOTHESIS_SEED: the same on every rank)."""
    count = 0

    def check(label: str, backend: dml.Backend, dtype: str) -> None:
        @seed(zlib.crc32(f"reduce_scatter/{dtype}/{label}".encode()) ^ RUN_SEED)
        @settings(SETTINGS, max_examples=examples * EXAMPLE_FACTOR)
        @given(case=bodies.cases(dtype))
        def run(case: bodies.Case) -> None:
            nonlocal count
            guarded(rsb.reduce_scatter_body, backend, case)
            count += 1

        run()

    for label, backend in backends.items():
        for dtype in bodies.DTYPES:
            check(label, backend, dtype)
    return count


def main(names: list[str]) -> None:
    faulthandler.register(signal.SIGUSR1)  # the test runner asks for stacks before killing a hung job
    dml.initialize(dml.MPIBackend)
    world = dml.get_distributed_backend(dml.MPIBackend)
    tiny = dml.MPIBackend(segment_bytes=16)
    checker = dml.MPIBackend(debug=True)
    three = {"default": world, "segment16": tiny, "debug": checker}
    size = world.size
    mib = 1 << 20

    def large() -> int:
        runs = 0
        small = dml.MPIBackend(segment_bytes=1000)
        # Rows across segment boundaries: 1000-byte segments, and 4 MiB ones (the default) past 4 MiB in all.
        for backend, n in ((small, 1001), (small, 83), (world, mib // size + 3), (world, mib + 1)):
            if n > 4096:  # 4 MiB segments: the paths that differ (one piece or several, AVG per piece, bool)
                combos = [("float32", "sum"), ("float32", "avg"), ("uint8", "max")]
            else:
                combos = [
                    (d, o) for d in ("float32", "float64", "int32", "uint8") for o in ("sum", "max", "min", "avg")
                ]
            for dtype, op in combos:
                if op == "avg" and not dtype.startswith("float"):
                    continue
                guarded(rsb.large_body, backend, n, dtype, op, runs % 2 == 0)
                runs += 1
        return runs

    checks = {
        "matrix": lambda: {label: guarded(rsb.matrix_body, b) for label, b in three.items()},
        "properties": lambda: properties({"default": world, "segment16": tiny}, 4),
        "bad_input": lambda: [
            guarded(rsb.bad_input_body, b, culprit) for b in (checker, world) for culprit in range(size)
        ],
        "debug": lambda: [guarded(rsb.mismatch_body, checker, case) for case in rsb.MISMATCHES],
        "mixed": lambda: [guarded(rsb.mixed_forms_body, b, 11) for b in three.values()],
        "sharding": lambda: [guarded(rsb.sharding_body, b, n) for b in (world, tiny) for n in (1, 5)],
        "large": large,
    }
    run_checks(world, names or list(checks), "REDUCE_SCATTER CHECKS PASSED", lambda name: checks[name]())


if __name__ == "__main__":
    main(sys.argv[1:])
