"""The bucket machine's rounds (distutils_ml/buckets.py) under what DDP users do: backward(create_graph=True),
gradient penalties, activation checkpointing with and without reentrant backward, sparse embeddings (reduced as
sparse, SparseAdam, sparse_as_dense); on simulated ranks and
under mpiexec with 2 and 3 ranks, both optimizer forms, overlap on and off (tests/habits_bodies.py)."""

from __future__ import annotations

import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import distutils_ml as dml
from distutils_ml.buckets import in_reentrant_backward

import habits_bodies
from mpirun import requires_mpi, run_mpi

pytestmark = pytest.mark.filterwarnings("ignore:Using backward\\(\\) with create_graph=True")


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("overlap", [False, True])
def test_create_graph_accumulates_like_ddp(world: int, overlap: bool) -> None:
    assert dml.LocalBackend.spawn(world, habits_bodies.create_graph_body, overlap, timeout=60) == [3] * world


@settings(max_examples=12, deadline=None)
@given(world=st.integers(1, 3), case=habits_bodies.penalty_cases())
def test_gradient_penalty_matches_one_process(world: int, case: habits_bodies.PenaltyCase) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dml.LocalBackend.spawn(world, habits_bodies.penalty_body, case, timeout=60)


@settings(max_examples=25, deadline=None)
@given(world=st.integers(1, 3), case=habits_bodies.checkpoint_cases())
def test_checkpointed_training_matches_plain(world: int, case: habits_bodies.CheckpointCase) -> None:
    dml.LocalBackend.spawn(world, habits_bodies.checkpoint_body, case, timeout=60)


@pytest.mark.parametrize("form", habits_bodies.FORMS)
@pytest.mark.parametrize("where", ["first", "last", "all"])
def test_every_reentrant_placement_both_forms_and_overlaps(form: str, where: str) -> None:
    for overlap in (False, True):
        case = habits_bodies.CheckpointCase(form, overlap, True, where, None)
        dml.LocalBackend.spawn(2, habits_bodies.checkpoint_body, case, timeout=60)


@pytest.mark.parametrize("form", habits_bodies.FORMS)
@pytest.mark.parametrize("overlap", [False, True])
def test_a_parameter_inside_and_outside_a_reentrant_block(form: str, overlap: bool) -> None:
    got = dml.LocalBackend.spawn(2, habits_bodies.shared_across_body, form, overlap, timeout=60)
    assert got == ["refused" if overlap else "equal"] * 2


@settings(max_examples=25, deadline=None)
@given(world=st.integers(1, 3), case=habits_bodies.sparse_cases())
def test_sparse_embeddings_train_as_one_process(world: int, case: habits_bodies.SparseCase) -> None:
    dml.LocalBackend.spawn(world, habits_bodies.sparse_embedding_body, case, timeout=60)


def test_reentrant_detection() -> None:
    seen = []

    class Probe(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2

        @staticmethod
        def backward(ctx, g):
            seen.append(in_reentrant_backward())
            return g * 2

    x = torch.ones(2, requires_grad=True)
    Probe.apply(x).sum().backward()
    assert seen == [True] and not in_reentrant_backward()


def test_a_second_backward_after_an_interrupted_one_is_still_refused() -> None:
    """Reentrant backward joins the open round; a new top-level backward after one that raised does not."""

    def body(backend: dml.Backend) -> str:
        model = torch.nn.Linear(3, 1)
        opt = dml.DistributedOptimizer(backend, torch.optim.SGD(model.parameters(), lr=0.1), overlap=False)

        class Boom(torch.autograd.Function):
            @staticmethod
            def forward(ctx, x):
                return x.clone()

            @staticmethod
            def backward(ctx, g):
                raise ValueError("boom")

        x = torch.ones(2, 3, requires_grad=True)
        with pytest.raises(ValueError, match="boom"):  # after the parameters' hooks: their round stays open
            model(Boom.apply(x)).sum().backward()
        with pytest.raises(RuntimeError, match="a second backward"):
            model(torch.ones(2, 3)).sum().backward()
        opt.zero_grad()
        model(torch.ones(2, 3)).sum().backward()
        opt.step()
        return "ok"

    assert dml.LocalBackend.spawn(2, body, timeout=60) == ["ok", "ok"]


@requires_mpi
@pytest.mark.parametrize("ranks", [2, 3])
def test_habits_under_mpiexec(ranks: int) -> None:
    job = run_mpi(ranks, ["tests/habits_job.py"], timeout=400)
    assert job.returncode == 0, job.output[-8000:]
    assert "HABITS CHECKS PASSED" in job.output, job.output[-8000:]
