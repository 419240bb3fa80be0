"""Collectives on LocalBackend.spawn: every op, dtype and call form on worlds of 1-5 ranks.

The bodies live in tests/bodies.py; tests/test_mpi.py runs the same bodies under mpiexec.
A deterministic matrix covers every allowed (op, dtype) pair of every collective in
every form; hypothesis adds random shapes, spellings and roots, per collective and dtype
(each with its own seed, so no two draw the same examples), each example on every world size.
"""

from __future__ import annotations

import gc
import threading
import warnings
import weakref
import zlib

import numpy as np
import pytest
import torch
from hypothesis import given, seed, settings

import distutils_ml as dml
from distutils_ml import arrays

from bodies import (
    BODIES,
    DTYPES,
    REDUCTIONS,
    Case,
    bad_calls,
    bad_input_body,
    cases,
    matrix_body,
    matrix_size,
    tensor_views_body,
)
from mpirun import requires_mpi, run_mpi

WORLD_SIZES = range(1, 6)
EXAMPLES = {"allreduce": 6, "reduce": 6, "bcast": 3, "allgather": 3}  # per dtype, each on every world size


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_every_op_dtype_form_and_shape(world: int) -> None:
    assert dml.LocalBackend.spawn(world, matrix_body, timeout=120) == [matrix_size()] * world


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", list(BODIES))
def test_random_calls(name: str, dtype: str) -> None:
    @seed(zlib.crc32(f"{name}/{dtype}".encode()))
    @settings(max_examples=EXAMPLES[name], deadline=None, database=None)
    @given(case=cases(dtype, reduction=name in REDUCTIONS))
    def run(case: Case) -> None:
        for world in WORLD_SIZES:
            results = dml.LocalBackend.spawn(world, BODIES[name], case, timeout=60)
            for r in results[1:] if name == "allreduce" else ():
                np.testing.assert_array_equal(r, results[0], err_msg=f"ranks disagree bitwise on {world} ranks")

    run()


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_bad_input_raises_before_sending(world: int) -> None:
    for culprit in range(world):
        counts = dml.LocalBackend.spawn(world, bad_input_body, culprit, timeout=60)
        assert counts == [len(bad_calls(dml.LocalBackend()))] * world


def test_world_of_one_is_identity() -> None:
    dml.initialize(dml.LocalBackend)
    for b in (dml.get_distributed_backend(dml.LocalBackend), dml.LocalBackend()):
        x = np.arange(5.0)
        for op in dml.ReduceOp:
            assert dml.allreduce(b, x, op) is x
            assert dml.reduce(b, x, op) is x
            np.testing.assert_array_equal(x, np.arange(5.0))
            out = np.full(5, -1.0)
            assert dml.allreduce(b, x, out, op) is out
            np.testing.assert_array_equal(out, x)
            out = np.full(5, -1.0)
            assert dml.reduce(b, x, out, op) is out
            np.testing.assert_array_equal(out, x)
        assert dml.bcast(b, x) is x
        out = np.full(5, -1.0)
        assert dml.bcast(b, x, out) is out
        np.testing.assert_array_equal(out, x)
        out = np.empty((1, 5))
        dml.allgather(b, x, out)
        np.testing.assert_array_equal(out[0], x)
        np.testing.assert_array_equal(x, np.arange(5.0))
        dml.barrier(b)
        # Every op, dtype and form of every collective: the result is the input.
        assert matrix_body(b) == matrix_size()


# -- two threads, debug fingerprints, unusual tensors ----------------------------------------


@pytest.mark.parametrize("world", [1, 2, 3])
def test_a_second_thread_in_a_collective_is_refused_naming_both(world: int) -> None:
    def body(b: dml.Backend) -> str | None:
        inside, release, errors = threading.Event(), threading.Event(), []

        def metrics() -> None:
            inside.wait(10)
            try:
                dml.allreduce(b, np.ones(2), dml.SUM)
            except RuntimeError as err:
                errors.append(str(err))
            release.set()

        helper = threading.Thread(target=metrics, name="metrics-logger")
        helper.start()
        # Hold the backend as a composite call would (synchronize, save...), then let the helper try.
        from distutils_ml.objects import exclusive

        with exclusive(b, "synchronize"):
            inside.set()
            release.wait(10)
            buf = np.ones(3)
            dml.allreduce(b, buf, dml.SUM)  # the owner itself may go on (re-entrant)
        helper.join()
        assert (buf == b.size).all()
        return errors[0] if errors else None

    for text in dml.LocalBackend.spawn(world, body, timeout=60):
        assert text is not None, "the second thread was let in"
        assert "thread 'metrics-logger' called a collective" in text, text
        assert "while thread 'dml-local-rank-" in text or "while thread 'MainThread'" in text, text


@pytest.mark.parametrize("world", [2, 3])
def test_simulated_ranks_compare_the_callers_dtype(world: int) -> None:
    # bfloat16 travels as int16 and bool as uint8: the fingerprint must see what the caller passed.
    def body(b: dml.Backend) -> list[str]:
        texts = []
        first = b.rank == 0
        calls = [
            lambda: dml.bcast(b, torch.zeros(3, dtype=torch.bfloat16 if first else torch.int16), root=0),
            lambda: dml.allreduce(b, np.zeros(3, dtype=np.bool_ if first else np.uint8), dml.MAX),
        ]
        for call in calls:
            with pytest.raises(dml.CollectiveMismatchError) as info:
                call()
            texts.append(str(info.value))
        return texts

    for bf16, flags in dml.LocalBackend.spawn(world, body, timeout=60):
        assert "dtype=bfloat16" in bf16 and "dtype=int16" in bf16, bf16
        assert "dtype=bool" in flags and "dtype=uint8" in flags, flags


@pytest.mark.parametrize("world", [2, 3])
def test_debug_spawn_names_a_branch_only_one_rank_takes(world: int) -> None:
    def body(b: dml.Backend) -> str:
        buf = np.ones(2)
        with pytest.raises(dml.CollectiveMismatchError) as info:
            if b.rank == 0:
                dml.allreduce(b, buf, dml.SUM)  # an extra call only rank 0 makes
            dml.allreduce(b, buf, dml.SUM)
        dml.barrier(b)
        return str(info.value)

    for text in dml.LocalBackend.spawn(world, body, timeout=60, debug=True):
        assert text.count("test_collectives.py:") == 2, text
    # Without debug, the same program is not caught (the same kind, shape and dtype): the docs say so.
    with pytest.raises(BaseException) as info:
        dml.LocalBackend.spawn(2, body, timeout=60, debug=False)
    assert "DID NOT RAISE" in str(info.value)


@pytest.mark.parametrize(
    ("make", "error", "words"),
    [
        (lambda: torch.eye(3).to_sparse(), TypeError, "a sparse_coo tensor is not supported"),
        (lambda: torch.eye(3).to_sparse_csr(), TypeError, "a sparse_csr tensor is not supported"),
        (lambda: torch.nested.nested_tensor([torch.ones(2), torch.ones(3)]), TypeError, "a nested tensor"),
        (lambda: torch._neg_view(torch.ones(3)), ValueError, "negative bit set"),
    ],
)
def test_unusual_tensors_are_named(make, error, words) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # sparse CSR and nested tensors warn that they are beta
        buf = make()

    def body(b: dml.Backend) -> None:
        with pytest.raises(error, match=words):
            dml.allreduce(b, buf, dml.SUM)
        out = np.ones(2)
        dml.allreduce(b, out, dml.SUM)  # nothing was sent
        assert (out == b.size).all()

    dml.LocalBackend.spawn(2, body, timeout=30)


def test_a_negative_view_is_read_as_its_value() -> None:
    out = torch.empty(3)
    dml.allreduce(dml.LocalBackend(), torch._neg_view(torch.ones(3)), out, dml.SUM)
    assert out.tolist() == [-1.0, -1.0, -1.0]


# -- tensors reused across calls (arrays caches their views) ---------------------------------


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_tensors_reused_and_changed_in_place_between_calls(world: int) -> None:
    assert len(set(dml.LocalBackend.spawn(world, tensor_views_body, timeout=60))) == 1


def test_a_tensor_view_is_made_once_holds_no_tensor_and_names_the_dtype_of_the_call() -> None:
    t = torch.ones(1000)
    first, dt = arrays.result_view(t, "buf")
    again, _ = arrays.result_view(t, "buf")
    assert dt == "float32" and arrays.result_view(t, "buf")[0] is again and again is not first
    assert arrays.source_view(t.view(1000), "sendbuf")[0] is again  # another tensor object, the same memory
    again[:] = 2.0
    assert (t == 2.0).all()
    held = weakref.ref(t)
    del t, first
    gc.collect()
    assert held() is None, "the cache keeps the tensor alive"
    half = torch.ones(4, dtype=torch.bfloat16)
    for _ in range(2):
        assert arrays.result_view(half, "buf")[1] == "bfloat16"
        view, dt = arrays.result_view(half.view(torch.int16), "buf")
        assert dt == "int16" and view.dtype == np.int16
        assert arrays.result_view(half, "buf")[1] == "bfloat16"


def test_the_view_cache_is_bounded() -> None:
    many = [torch.ones(1) for _ in range(arrays._VIEWS_MAX + 10)]
    for t in many:
        arrays.result_view(t, "buf")
        assert len(arrays._VIEWS) <= arrays._VIEWS_MAX
    out = torch.empty(1)
    dml.allreduce(dml.LocalBackend(), many[0], out, dml.SUM)  # a view made again after the cache was emptied
    assert out.item() == 1.0


@requires_mpi
def test_past_2_31_elements_under_mpiexec() -> None:
    # bcast, allreduce with segment_bytes=0, allgather of a 2 GiB send and a 2 GiB object on 2 ranks (~12 GiB).
    job = run_mpi(2, ["tests/core_job.py", "big"], timeout=600)
    assert job.returncode == 0, job.output[-8000:]
    assert "CORE JOB PASSED: big on 2 ranks" in job.output, job.output[-8000:]


def test_a_strided_send_within_the_results_bounds_but_sharing_no_element_is_taken() -> None:
    """Only buffers that share an element overlap: a column and a row of one matrix, or every 14th element around
    a block, are reduced and gathered as separate buffers."""

    def body(backend: dml.Backend) -> tuple[list[float], list[list[float]]]:
        m = np.arange(16, dtype=np.float32).reshape(4, 4) + backend.rank
        dml.allreduce(backend, m[0:3, 0], m[1, 1:], dml.SUM)  # column 0's 0, 4, 8 into row 1's 5, 6, 7
        t = np.zeros(30, dtype=np.float32) + backend.rank
        t[::14] = [10 + backend.rank, 20 + backend.rank, 30 + backend.rank]
        dml.allgather(backend, t[::14], t[1:7].reshape(2, 3))
        return m[1, 1:].tolist(), t[1:7].reshape(2, 3).tolist()

    for reduced, gathered in dml.LocalBackend.spawn(2, body, timeout=30):
        assert reduced == [0.0 + 1.0, 4.0 + 5.0, 8.0 + 9.0]
        assert gathered == [[10.0, 20.0, 30.0], [11.0, 21.0, 31.0]]
