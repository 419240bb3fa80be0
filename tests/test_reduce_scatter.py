"""dml.reduce_scatter on LocalBackend.spawn (worlds of 1-5 ranks) and under mpiexec (2 and 3 ranks).

The bodies live in tests/reduce_scatter_bodies.py; tests/reduce_scatter_job.py runs the same
bodies under mpiexec, on the default MPIBackend, one with 16-byte segments (the packed,
segmented path) and one in debug mode.
"""

from __future__ import annotations

import threading
import zlib

import numpy as np
import pytest
import torch
from hypothesis import given, seed, settings

import distutils_ml as dml
from distutils_ml.backends.base import Backend

import shared
from bodies import DTYPES, Case, cases
from mpirun import assert_checks_passed, requires_mpi, run_mpi
from reduce_scatter_bodies import (
    MATRIX,
    MISMATCHES,
    bad_calls,
    bad_input_body,
    matrix_body,
    mismatch_body,
    mixed_forms_body,
    reduce_scatter_body,
    sharding_body,
)

WORLD_SIZES = range(1, 6)


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_every_op_dtype_form_and_shape(world: int) -> None:
    assert dml.LocalBackend.spawn(world, matrix_body, timeout=120) == [len(MATRIX)] * world


@pytest.mark.parametrize("dtype", DTYPES)
def test_random_calls(dtype: str) -> None:
    @seed(zlib.crc32(f"reduce_scatter/{dtype}".encode()))
    @settings(max_examples=6, deadline=None, database=None)
    @given(case=cases(dtype))
    def run(case: Case) -> None:
        for world in WORLD_SIZES:
            dml.LocalBackend.spawn(world, reduce_scatter_body, case, timeout=60)

    run()


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_bad_input_raises_before_sending(world: int) -> None:
    for culprit in range(world):
        counts = dml.LocalBackend.spawn(world, bad_input_body, culprit, timeout=60)
        assert counts == [len(bad_calls(dml.LocalBackend()))] * world


@pytest.mark.parametrize("case", MISMATCHES)
@pytest.mark.parametrize("world", [2, 3])
def test_ranks_that_call_different_collectives_raise_on_every_rank(world: int, case: str) -> None:
    assert dml.LocalBackend.spawn(world, mismatch_body, case, timeout=60) == [True] * world


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_ranks_may_mix_the_in_place_and_two_buffer_forms(world: int) -> None:
    assert dml.LocalBackend.spawn(world, mixed_forms_body, 3, timeout=60) == [8] * world


@pytest.mark.parametrize("n", [1, 5])
@pytest.mark.parametrize("world", WORLD_SIZES)
def test_flat_buffers_shard_through_zero_copy_views(world: int, n: int) -> None:
    assert dml.LocalBackend.spawn(world, sharding_body, n, timeout=60) == [4] * world


def test_world_of_one_is_identity() -> None:
    b = dml.LocalBackend()
    x = torch.arange(6.0).view(1, 6)
    out = torch.full((6,), -1.0)
    for op in dml.ReduceOp:
        assert dml.reduce_scatter(b, x, out, op) is out
        assert torch.equal(out, torch.arange(6.0))
        row = dml.reduce_scatter(b, x, op)
        assert torch.equal(row, torch.arange(6.0)) and row.data_ptr() == x.data_ptr()
    one = np.array([3], dtype=np.int8)
    got = dml.reduce_scatter(b, one, dml.MAX)
    assert got.shape == () and got == 3 and np.shares_memory(got, one)


class _DefaultReduceScatter(dml.LocalBackend):
    """A simulated rank whose reduce_scatter is the Backend default (an allreduce of a copy)."""

    _reduce_scatter = Backend._reduce_scatter


@pytest.mark.parametrize("world", [1, 2, 3])
def test_the_backend_default_is_a_reduce_scatter_too(world: int) -> None:
    def body(b: dml.LocalBackend) -> int:
        return matrix_body(_DefaultReduceScatter(_world=b._world, _rank=b.rank))

    assert dml.LocalBackend.spawn(world, body, timeout=120) == [len(MATRIX)] * world


@pytest.mark.parametrize("world", [1, 2])
def test_a_second_thread_is_refused(world: int) -> None:
    def body(b: dml.Backend) -> str:
        from distutils_ml.objects import exclusive

        errors: list[str] = []

        def other() -> None:
            try:
                dml.reduce_scatter(b, np.ones((b.size, 2)), dml.SUM)
            except RuntimeError as err:
                errors.append(str(err))

        with exclusive(b, "synchronize"):
            helper = threading.Thread(target=other, name="shard-thread")
            helper.start()
            helper.join(10)
            out = dml.reduce_scatter(b, np.ones((b.size, 2)), dml.SUM)  # the owner goes on
        assert (out == b.size).all()
        return errors[0] if errors else ""

    for text in dml.LocalBackend.spawn(world, body, timeout=60):
        assert "reduce_scatter: thread 'shard-thread' called a collective" in text, text


REDUCE_SCATTER_JOB = shared.register("reduce_scatter", "reduce_scatter_job", timeout=180)


@requires_mpi
@pytest.mark.parametrize("ranks", [2, 3])
@pytest.mark.shared_job(REDUCE_SCATTER_JOB)
def test_reduce_scatter_job_under_mpiexec(ranks: int) -> None:
    job = shared.job(ranks, REDUCE_SCATTER_JOB)
    assert job.returncode == 0, job.output[-8000:]
    checks = "matrix properties bad_input debug mixed sharding large"
    assert f"REDUCE_SCATTER CHECKS PASSED: {checks} on {ranks} ranks" in job.output, job.output[-8000:]
    assert_checks_passed(job, checks.split(), ranks)


# Rows of more than 2**31 elements: MPI counts are C ints, so the MPI backend must cut them into pieces,
# each piece landing at its own offset. int8 keeps it to 4 GiB of send buffer per rank (float32 rows of
# that length would need 16 GiB per rank). The values repeat with a prime period, so a piece written at
# the wrong offset shows. Each row is written in place by doubling (the period, then the filled part copied
# after itself, 24 copies in all): np.resize would concatenate a tuple of 8.6 million arrays into a new
# 2 GiB array, then copy that into the row.
_HUGE_ROW = """
import numpy as np
import distutils_ml as dml

dml.initialize(dml.MPIBackend)
b = dml.get_distributed_backend(dml.MPIBackend)
w, r = b.size, b.rank
n = 2**31 + 3
period = np.arange(251, dtype=np.int8) % 50
rows = np.empty((w, n), dtype=np.int8)
for k in range(w):
    row = rows[k]
    row[: period.size] = period + np.int8(r + k)
    done = period.size  # row[:done] holds whole periods: a copy of it to row[done:] goes on the period
    while done < n:
        step = min(done, n - done)
        row[done : done + step] = row[:step]
        done += step
out = dml.reduce_scatter(b, rows, dml.SUM)  # in place: rows[r]
assert out.shape == (n,) and out.ctypes.data == rows[r].ctypes.data
chunk = 251 * 4096
want = np.resize(period * np.int8(w) + np.int8(w * r + w * (w - 1) // 2), chunk)
for lo in range(0, n, chunk):
    piece = out[lo : lo + chunk]
    assert (piece == want[: piece.size]).all(), f"wrong values at [{lo}, {lo + piece.size})"
dml.barrier(b)
if r == 0:
    print(f"HUGE ROW PASSED: {n} int8 elements per row on {w} ranks", flush=True)
"""


@requires_mpi
@pytest.mark.slow
def test_rows_past_two_to_the_31_elements_under_mpiexec() -> None:
    job = run_mpi(2, ["-c", _HUGE_ROW], timeout=240)
    assert job.returncode == 0 and "HUGE ROW PASSED: 2147483651 int8" in job.output, job.output[-6000:]
