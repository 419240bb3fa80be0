"""``dml.ShardedGradScaler`` (distutils_ml/amp.py), and the sharded optimizer's refusal of torch's GradScaler:
LocalBackend.spawn on 1-4 simulated ranks, and mpiexec jobs of 2 and 3 ranks (tests/amp_job.py)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import distutils_ml as dml

import shared
from amp_job import (
    AmpCase,
    agreement_body,
    amp_cases,
    bad_input_body,
    clip_body,
    refusal_body,
    shard_only_body,
    unsharded_body,
)
from mpirun import requires_mpi

pytestmark = pytest.mark.filterwarnings(
    "ignore:overflow encountered in add:RuntimeWarning",  # LocalBackend: the sums that overflow on purpose
    "ignore:invalid value encountered in add:RuntimeWarning",  # inf + -inf
)


@settings(max_examples=100, deadline=None)
@given(case=amp_cases(), world=st.integers(1, 4))
def test_every_rank_skips_the_same_steps_as_the_unsharded_optimizer(case: AmpCase, world: int) -> None:
    """Over which steps and ranks overflow (one element, the whole loss, or only the sum), op, overlap, unscale_
    before step or not, no_sync() accumulation and bucket sizes: the same skips and scales on every rank, the
    unsharded optimizer's under torch's GradScaler, and the same parameters (agreement_body checks them)."""
    seen = dml.LocalBackend.spawn(world, agreement_body, case, timeout=60)
    assert all(s[:2] == seen[0][:2] for s in seen), seen


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("world", [2, 3, 4])
def test_an_overflow_in_another_ranks_shard_skips_every_rank(world: int, overlap: bool) -> None:
    """The sum overflows in one element: only its owner's .grad holds the inf, the other ranks' are finite
    throughout (a local check, as torch's GradScaler makes, would step there); every rank skips that step."""
    seen = dml.LocalBackend.spawn(world, shard_only_body, overlap, timeout=60)
    assert all(s[:2] == seen[0][:2] for s in seen), seen
    assert [finite for _, _, finite in seen].count(False) == 1, seen
    scales = seen[0][1]
    assert scales[1] == scales[0] / 2 and scales[3] == scales[2] * 2, scales  # backoff, then growth (interval 2)


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("world", [1, 2, 3])
def test_unscale_then_clip_grad_norm_then_step(world: int, overlap: bool) -> None:
    norms = dml.LocalBackend.spawn(world, clip_body, overlap, timeout=60)
    assert all(n == norms[0] for n in norms), norms


@pytest.mark.parametrize("unscale_first", [False, True])
@pytest.mark.parametrize("world", [1, 2, 3])
def test_torch_grad_scaler_is_refused_on_every_rank(world: int, unscale_first: bool) -> None:
    messages = dml.LocalBackend.spawn(world, refusal_body, unscale_first, timeout=60)
    assert len(set(messages)) == 1, messages


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("world", [1, 2, 3])
def test_unsharded_and_plain_optimizers_as_torchs_grad_scaler(world: int, overlap: bool) -> None:
    scales = dml.LocalBackend.spawn(world, unsharded_body, overlap, timeout=60)
    assert all(s == scales[0] for s in scales), scales


@pytest.mark.parametrize("world", [1, 2, 3])
def test_bad_input_raises_before_communication(world: int) -> None:
    for culprit in range(world):
        dml.LocalBackend.spawn(world, bad_input_body, culprit, timeout=60)


def test_a_torch_grad_scaler_subclass() -> None:
    """A GradScaler: its state_dict loads into torch's and back; the backend is kept and shown."""
    backend = dml.LocalBackend()
    scaler = dml.ShardedGradScaler(backend, "cpu", init_scale=8.0, growth_interval=3)
    assert isinstance(scaler, torch.amp.GradScaler) and scaler.backend is backend
    theirs = torch.amp.GradScaler("cpu")
    theirs.load_state_dict(scaler.state_dict())
    assert theirs.get_scale() == 8.0 and theirs.get_growth_interval() == 3
    again = dml.ShardedGradScaler(backend, "cpu")
    again.load_state_dict(theirs.state_dict())
    assert again.state_dict() == scaler.state_dict()


AMP_JOB = shared.register("amp", "amp_job", timeout=150)


@requires_mpi
@pytest.mark.parametrize("ranks", [2, 3])
@pytest.mark.shared_job(AMP_JOB)
def test_amp_job_under_mpiexec(ranks: int) -> None:
    job = shared.job(ranks, AMP_JOB)
    assert job.returncode == 0, job.output[-8000:]
    checks = "agreement shard_only clip refusal unsharded bad_input"
    assert f"AMP CHECKS PASSED: {checks} on {ranks} ranks" in job.output, job.output[-8000:]
