"""The MPI side of the SyncBatchNorm tests: ``mpiexec -n N python tests/batchnorm_job.py KIND``.

KIND ``cpu``: the bodies of tests/batchnorm_bodies.py on the world backend (the
properties of batchnorm_body and shifted_body with hypothesis derandomized, so every
rank draws the same cases; every body; every misuse by every rank), then the first
property and the misuses again on a debug-mode backend, which compares every
collective's call site across ranks. KIND ``staged`` (MPIBackend) and ``nccl``
(NCCLBackend): the bodies that take CUDA tensors. A failing body prints its rank,
arguments and traceback and aborts the job. Rank 0 ends with
``BATCHNORM JOB PASSED: KIND on N ranks`` when all passed.
"""

from __future__ import annotations

import faulthandler
import signal
import sys
import time

import torch
from hypothesis import given, settings

import distutils_ml as dml

import batchnorm_bodies as bodies
from mpi_main import EXAMPLE_FACTOR, SETTINGS, fresh_in_dev, guarded


def property_checks(backend: dml.Backend, examples: int, device: str, shifted: bool = False) -> int:
    """``examples`` drawn cases of batchnorm_body, or of shifted_body (large channel means)."""
    count = 0
    body, strategy = (bodies.shifted_body, bodies.shifted_cases) if shifted else (bodies.batchnorm_body, bodies.cases)

    @fresh_in_dev
    @settings(SETTINGS, max_examples=examples * EXAMPLE_FACTOR)
    @given(case=strategy(backend.size))
    def run(case: bodies.Case | bodies.Shifted) -> None:
        nonlocal count
        guarded(body, backend, case, device)
        count += 1

    run()
    return count


def misuse_checks(backend: dml.Backend) -> int:
    count = 0
    for misuse in bodies.MISUSES:
        for culprit in range(backend.size):
            for stateless in (False, True):
                guarded(bodies.bad_input_body, backend, misuse, culprit, stateless)
                count += 1
    for culprit in range(backend.size):
        for stateless in (False, True):
            guarded(bodies.mixed_dtype_body, backend, culprit, stateless)
            count += 1
    return count


def main(kind: str) -> None:
    faulthandler.register(signal.SIGUSR1)  # the test runner asks for stacks before killing a hung job
    start = time.perf_counter()
    if kind == "nccl":
        dml.initialize(dml.NCCLBackend)
        world = dml.get_distributed_backend(dml.NCCLBackend)
    else:
        dml.initialize(dml.MPIBackend)
        world = dml.get_distributed_backend(dml.MPIBackend)
        if kind == "staged":
            torch.cuda.set_device(world.node_local_rank % torch.cuda.device_count())
    if kind == "cpu":
        checker = dml.MPIBackend(debug=True)
        detail = {
            "property": property_checks(world, 80, "cpu"),
            "shifted": property_checks(world, 40, "cpu", shifted=True),
            "misuse": misuse_checks(world),
            "property_debug": property_checks(checker, 15, "cpu"),
            "misuse_debug": misuse_checks(checker),
        }
        for body in bodies.BODIES:
            guarded(body, world)
        detail["bodies"] = len(bodies.BODIES)
    else:
        detail = {
            "property": property_checks(world, 10, "cuda"),
            "shifted": property_checks(world, 10, "cuda", shifted=True),
        }
        for body in (bodies.allreduce_autograd_body, bodies.half_body, bodies.second_order_body):
            guarded(body, world, "cuda")
    dml.print(world, f"batchnorm checks passed in {time.perf_counter() - start:.1f}s: {detail}")
    dml.barrier(world)
    if world.rank == 0:
        print(f"BATCHNORM JOB PASSED: {kind} on {world.size} ranks", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
