"""Reduction during backward (distutils_ml/reducer.py, commthread.py): LocalBackend.spawn and mpiexec."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import distutils_ml as dml

import shared
from mpirun import assert_checks_passed, requires_mpi
from reducer_bodies import (
    TWO_OPTIMIZER_CASES,
    GradCase,
    buffers_body,
    collective_in_backward_body,
    errors_body,
    grad_cases,
    grads_ready_body,
    two_optimizers_body,
)
from train_bodies import TrainCase, grad_storage_moved_body, train_cases, train_overlap_body, unused_parameters_body


@settings(max_examples=40, deadline=None)
@given(case=grad_cases(), world=st.integers(1, 5))
def test_grad_is_reduced_when_backward_returns(case: GradCase, world: int) -> None:
    dml.LocalBackend.spawn(world, grads_ready_body, case, timeout=60)


@settings(max_examples=15, deadline=None)
@given(case=train_cases(), world=st.integers(1, 5))
def test_training_with_overlap_equals_the_big_batch(case: TrainCase, world: int) -> None:
    dml.LocalBackend.spawn(world, train_overlap_body, case, timeout=60)


@pytest.mark.parametrize("world", [1, 2, 3])
def test_unused_parameters_never_hang_with_overlap(world: int) -> None:
    dml.LocalBackend.spawn(world, unused_parameters_body, 2, True, timeout=60)


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("world", [1, 2, 3])
def test_errors_are_raised_on_every_rank(world: int, overlap: bool) -> None:
    seen = dml.LocalBackend.spawn(world, errors_body, overlap, timeout=60)
    assert all(s == seen[0] for s in seen) and len(seen[0]) == (3 if world > 1 else 2), seen


@pytest.mark.parametrize("how", TWO_OPTIMIZER_CASES)
@pytest.mark.parametrize("shard", [False, True], ids=["unsharded", "sharded"])
@pytest.mark.parametrize("world", [2, 3])
def test_two_optimizers_reached_in_another_order_raise_instead_of_mixing(world: int, shard: bool, how: str) -> None:
    """Without overlap every reduction waits for the end of backward (or step()): the rounds pair in the order they
    happen, and a pairing of the two optimizers' rounds raises on every rank (it mixed their gradients silently)."""
    seen = dml.LocalBackend.spawn(world, two_optimizers_body, False, shard, how, timeout=60)
    assert all(s == seen[0] for s in seen), seen
    if how != "unused_first":  # the last rank's second optimizer reduces first there: paired with the first's
        assert seen[0] == ["RuntimeError"], seen


@pytest.mark.parametrize("set_to_none", [True, False], ids=["to_none", "to_zeros"])
@pytest.mark.parametrize("how", ["data", "set_"])
@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("shard", [False, True], ids=["unsharded", "sharded"])
def test_a_grad_whose_storage_was_moved_trains_as_one_process(
    shard: bool, overlap: bool, how: str, set_to_none: bool
) -> None:
    for world in (1, 2):
        dml.LocalBackend.spawn(world, grad_storage_moved_body, shard, overlap, how, set_to_none, timeout=60)


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("world", [1, 2, 3])
def test_a_collective_in_backward_is_ordered_with_the_buckets(world: int, overlap: bool) -> None:
    dml.LocalBackend.spawn(world, collective_in_backward_body, overlap, timeout=60)


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("world", [1, 2, 3])
def test_buffers_are_broadcast_with_reduction_in_backward(world: int, overlap: bool) -> None:
    dml.LocalBackend.spawn(world, buffers_body, overlap, timeout=60)


def test_one_thread_per_backend_and_hooks_stay_one_per_parameter() -> None:
    def fn(b: dml.Backend) -> int:
        model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
        opt = dml.DistributedOptimizer(b, torch.optim.SGD(model.parameters(), lr=0.1), overlap=True)
        other = dml.reduce_gradients_in_backward(b, torch.nn.Linear(2, 2), overlap=True)
        for _ in range(3):
            opt.zero_grad()
            model(torch.ones(1, 3)).sum().backward()
            opt.step()
        assert all(len(p._post_accumulate_grad_hooks) == 1 for p in model.parameters())
        other.remove()
        return id(b._comm)

    ids = dml.LocalBackend.spawn(2, fn)
    assert len(set(ids)) == 2  # one per rank's backend, shared by the wrappers of that backend


def test_bad_arguments_raise_before_communication() -> None:
    b = dml.LocalBackend()
    model = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match="backward_passes_per_step"):
        dml.DistributedOptimizer(b, torch.optim.SGD(model.parameters(), lr=0.1), backward_passes_per_step=0)
    with pytest.raises(TypeError, match="first argument must be a backend"):
        dml.reduce_gradients_in_backward(model, model)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="communication_dtype"):
        dml.reduce_gradients_in_backward(b, model, communication_dtype=torch.int8)


REDUCER_JOB = shared.register("reducer", "reducer_job", timeout=300)


@requires_mpi
@pytest.mark.parametrize("ranks", [2, 3])
@pytest.mark.shared_job(REDUCER_JOB)
def test_reducer_job_under_mpiexec(ranks: int) -> None:
    job = shared.job(ranks, REDUCER_JOB)
    assert job.returncode == 0, job.output[-8000:]
    checks = "grads_ready errors collective_in_backward buffers train_overlap unused_overlap two_optimizers"
    assert f"REDUCER CHECKS PASSED: {checks} on {ranks} ranks" in job.output, job.output[-8000:]
    assert_checks_passed(job, checks.split(), ranks)


def test_settings_compared_against_another_collective_are_an_error_not_a_crash() -> None:
    """A rank out of step (in another allgather, then another allgather_object) while the others compare their
    configuration: they raise a RuntimeError saying so, not an IndexError from the message."""
    import numpy as np

    from distutils_ml.reducer import agree_on_settings

    def body(world: dml.Backend) -> str:
        params = [torch.zeros(3)]
        if world.rank == 1:
            dml.allgather(world, np.full(2, 7, dtype=np.int64), np.empty((world.size, 2), dtype=np.int64))
            dml.allgather_object(world, ("stray", "call"))
            return "out of step"
        try:
            agree_on_settings(world, "Caller", "fix", ("avg",), params=params, labels=lambda: ["w"])
        except RuntimeError as e:
            return str(e)
        return "no error"

    seen = dml.LocalBackend.spawn(2, body, timeout=60)
    assert seen[1] == "out of step"
    assert "rank 1 sent something else (tuple): the ranks' collectives are out of step" in seen[0], seen[0]
    assert "DML_DEBUG=1" in seen[0], seen[0]
