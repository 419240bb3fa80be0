"""Collectives on LocalBackend.spawn: every op, dtype and call form on worlds of 1-5 ranks.

The bodies live in tests/bodies.py; tests/test_mpi.py runs the same bodies under mpiexec.
A deterministic matrix covers every allowed (op, dtype) pair of every collective in
every form; hypothesis adds random shapes, spellings and roots, per collective and dtype
(each with its own seed, so no two draw the same examples), each example on every world size.
"""

from __future__ import annotations

import zlib

import numpy as np
import pytest
from hypothesis import given, seed, settings

import distutils_ml as dml

from bodies import BODIES, DTYPES, REDUCTIONS, Case, bad_calls, bad_input_body, cases, matrix_body, matrix_size

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
