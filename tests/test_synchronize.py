"""synchronize on LocalBackend.spawn: every leaf kind, root != 0, mismatches raise on every rank."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import distutils_ml as dml

from train_bodies import make_model, sync_cases, synchronize_body


@settings(max_examples=25, deadline=None)
@given(case=sync_cases(), world=st.integers(1, 4))
def test_every_leaf_kind_ends_as_roots(case: tuple[int, int], world: int) -> None:
    dml.LocalBackend.spawn(world, synchronize_body, case, timeout=60)


def test_one_broadcast_per_dtype() -> None:
    calls: list[tuple] = []

    def fn(b: dml.Backend) -> None:
        original = b._bcast

        def counting(buf: np.ndarray, root: int) -> None:
            if b.rank == 0:
                calls.append((buf.dtype, buf.size))
            original(buf, root)

        b._bcast = counting  # type: ignore[method-assign]
        model = make_model(b.rank)  # float32 weights + BatchNorm's int64 counter
        dml.synchronize(b, {"m": model, "x": torch.zeros(3, dtype=torch.float64)})

    dml.LocalBackend.spawn(2, fn)
    assert sorted(str(d) for d, _ in calls) == ["float32", "float64", "int64"]


def test_structure_mismatch_raises_on_every_rank_before_sending() -> None:
    def fn(b: dml.Backend) -> str:
        x = {"w": torch.zeros(3 if b.rank != 1 else 4)}
        try:
            dml.synchronize(b, x)
        except ValueError as e:
            msg = str(e)
        else:
            msg = "no error"
        buf = np.ones(2)
        dml.allreduce(b, buf, dml.SUM)  # the world is still usable
        assert (buf == b.size).all()
        return msg

    msgs = dml.LocalBackend.spawn(3, fn, timeout=30)
    assert all("rank(s) [1] hold a structure that differs from root 0's" in m for m in msgs), msgs
    assert "leaf 0 is an array of shape (4,)" in msgs[1]


def test_unpicklable_root_value_raises_everywhere() -> None:
    def fn(b: dml.Backend) -> str:
        try:
            dml.synchronize(b, {"f": (lambda: 0) if b.rank == 0 else None})
        except TypeError as e:
            return str(e)
        return "no error"

    msgs = dml.LocalBackend.spawn(2, fn, timeout=30)
    assert all("cannot be pickled" in m for m in msgs), msgs


def test_bad_arguments() -> None:
    b = dml.LocalBackend()
    with pytest.raises(ValueError, match="root: got 1"):
        dml.synchronize(b, torch.zeros(1), root=1)
    with pytest.raises(TypeError, match="first argument must be a backend"):
        dml.synchronize(torch.zeros(1), b)
