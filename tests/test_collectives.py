"""Collectives on LocalBackend.spawn: property tests over world sizes 1-5.

The bodies live in tests/bodies.py; tests/test_mpi.py runs the same bodies under mpiexec.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import distutils_ml as dml

from bodies import BODIES, Case, bad_calls, bad_input_body, cases

WORLDS = st.integers(1, 5)


@pytest.mark.parametrize("name", ["allreduce", "reduce"])
@settings(max_examples=150, deadline=None)
@given(case=cases(reduction=True), world=WORLDS)
def test_reductions(name: str, case: Case, world: int) -> None:
    results = dml.LocalBackend.spawn(world, BODIES[name], case, timeout=60)
    if name == "allreduce":
        for r in results[1:]:
            np.testing.assert_array_equal(r, results[0], err_msg="ranks disagree bitwise")


@pytest.mark.parametrize("name", ["bcast", "allgather"])
@settings(max_examples=100, deadline=None)
@given(case=cases(reduction=False), world=WORLDS)
def test_data_movement(name: str, case: Case, world: int) -> None:
    dml.LocalBackend.spawn(world, BODIES[name], case, timeout=60)


@settings(max_examples=10, deadline=None)
@given(world=WORLDS, culprit=st.integers(0, 4))
def test_bad_input_raises_before_sending(world: int, culprit: int) -> None:
    counts = dml.LocalBackend.spawn(world, bad_input_body, culprit, timeout=60)
    assert counts == [len(bad_calls(dml.LocalBackend()))] * world


def test_world_of_one_is_identity() -> None:
    dml.initialize(dml.LocalBackend)
    b = dml.get_distributed_backend(dml.LocalBackend)
    x = np.arange(5.0)
    for op in dml.ReduceOp:
        assert dml.allreduce(b, x, op) is x
        np.testing.assert_array_equal(x, np.arange(5.0))
    out = np.empty((1, 5))
    dml.allgather(b, x, out)
    np.testing.assert_array_equal(out[0], x)
    dml.barrier(b)
