"""dml.sparse_allreduce (distutils_ml/sparse.py) on LocalBackend.spawn (worlds of 1-5 ranks) and under mpiexec
(2 and 3 ranks).

The bodies live in tests/sparse_bodies.py; tests/sparse_job.py runs the same bodies under mpiexec, on the
default MPIBackend, one with 16-byte segments and one in debug mode. A deterministic matrix covers every
layout (1-D, 2-D, hybrid, value rows of no bytes) x dtype x op, with duplicates and an empty rank; hypothesis
adds random layouts, entry counts, spellings and values, each example on every world size.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch
from hypothesis import given, settings

import distutils_ml as dml

import shared
import sparse_bodies as sb
from mpirun import assert_checks_passed, requires_mpi

WORLD_SIZES = range(1, 6)


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_every_layout_dtype_and_op(world: int) -> None:
    assert dml.LocalBackend.spawn(world, sb.matrix_body, timeout=120) == [len(sb.matrix_cases())] * world


@settings(max_examples=80, deadline=None, database=None)
@given(case=sb.sparse_cases())
def test_random_calls_equal_the_sum_of_every_ranks_tensor(case: sb.SparseCase) -> None:
    for world in WORLD_SIZES:
        results = dml.LocalBackend.spawn(world, sb.sparse_body, case, timeout=60)
        assert len(set(results)) == 1, f"ranks disagree bitwise on {world} ranks: {case}"


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_bad_input_raises_on_its_rank_before_sending(world: int) -> None:
    for culprit in range(world):
        counts = dml.LocalBackend.spawn(world, sb.bad_input_body, culprit, timeout=60)
        assert counts == [len(sb.bad_calls(dml.LocalBackend()))] * world


@pytest.mark.parametrize("case", list(sb.MISMATCHES))
@pytest.mark.parametrize("world", [2, 3])
def test_ranks_that_pass_different_tensors_raise_on_every_rank(world: int, case: str) -> None:
    texts = dml.LocalBackend.spawn(world, sb.mismatch_body, case, timeout=60)
    assert len(set(texts)) == 1, texts


@pytest.mark.parametrize("world", [1, 2, 3])
def test_debug_mode(world: int) -> None:
    case = sb.matrix_cases()[5]
    assert dml.LocalBackend.spawn(world, sb.debug_body, case, timeout=60, debug=True) == [True] * world


@pytest.mark.parametrize("world", [1, 3])
def test_embedding_gradients_average_as_their_dense_form(world: int) -> None:
    assert dml.LocalBackend.spawn(world, sb.embedding_body, 3, timeout=60) == [3] * world


def test_a_world_of_one_returns_a_new_coalesced_copy() -> None:
    b = dml.LocalBackend()
    t = torch.sparse_coo_tensor([[2, 0, 2]], [1.0, 2.0, 3.0], (4,), check_invariants=True)
    for op in (dml.SUM, dml.AVG):
        got = dml.sparse_allreduce(b, t, op)
        assert got.is_coalesced() and not t.is_coalesced()
        assert got.indices().tolist() == [[0, 2]] and got.values().tolist() == [2.0, 4.0]
    ready = t.coalesce()
    got = dml.sparse_allreduce(b, ready)
    assert got is not ready and got.values().data_ptr() != ready.values().data_ptr()
    got.values().zero_()
    assert ready.values().tolist() == [2.0, 4.0]


def test_entries_that_cancel_stay_as_explicit_zeros() -> None:
    def body(b: dml.Backend) -> list[float]:
        sign = 1.0 if b.rank == 0 else -1.0
        t = torch.sparse_coo_tensor([[1, 3]], [sign, 2.0], (5,), check_invariants=True)
        got = dml.sparse_allreduce(b, t, dml.SUM)
        assert got.indices().tolist() == [[1, 3]], got
        return got.values().tolist()

    assert dml.LocalBackend.spawn(2, body, timeout=30) == [[0.0, 4.0]] * 2


def test_an_input_that_requires_grad_is_read_as_its_value() -> None:
    t = torch.sparse_coo_tensor([[1]], [3.0], (2,), check_invariants=True).requires_grad_()
    got = dml.sparse_allreduce(dml.LocalBackend(), t, dml.SUM)
    assert not got.requires_grad and got.to_dense().tolist() == [0.0, 3.0]


@pytest.mark.parametrize("world", [1, 2])
def test_a_second_thread_is_refused(world: int) -> None:
    def body(b: dml.Backend) -> str:
        from distutils_ml.objects import exclusive

        errors: list[str] = []

        def other() -> None:
            try:
                dml.sparse_allreduce(b, torch.eye(2).to_sparse())
            except RuntimeError as err:
                errors.append(str(err))

        with exclusive(b, "synchronize"):
            helper = threading.Thread(target=other, name="embedding-thread")
            helper.start()
            helper.join(10)
            out = np.ones(2)
            dml.allreduce(b, out, dml.SUM)  # the owner goes on
        assert (out == b.size).all()
        return errors[0] if errors else ""

    for text in dml.LocalBackend.spawn(world, body, timeout=60):
        assert "sparse_allreduce: thread 'embedding-thread' called a collective" in text, text


SPARSE_JOB = shared.register("sparse", "sparse_job", timeout=180)


@requires_mpi
@pytest.mark.parametrize("ranks", [2, 3])
@pytest.mark.shared_job(SPARSE_JOB)
def test_sparse_job_under_mpiexec(ranks: int) -> None:
    job = shared.job(ranks, SPARSE_JOB)
    assert job.returncode == 0, job.output[-8000:]
    checks = "matrix properties bad_input mismatch debug embedding"
    assert f"SPARSE CHECKS PASSED: {checks} on {ranks} ranks" in job.output, job.output[-8000:]
    assert_checks_passed(job, checks.split(), ranks)
