"""dml.join (distutils_ml/uneven.py): ranks with different numbers of batches train to the result of one process that
averages, at each iteration, the ranks that still have data; with SyncBatchNorm and buffer broadcasts, overlap on
and off; on 1-4 simulated ranks and under mpiexec with 2 and 3 ranks. Without the context the stall report stays."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import distutils_ml as dml
from distutils_ml.backends.local import RankFailedError

import join_bodies
import shared
from mpirun import assert_checks_passed, requires_mpi, run_mpi


@settings(max_examples=40, deadline=None)
@given(case=join_bodies.join_cases())
def test_uneven_inputs_train_as_one_process(case: join_bodies.JoinCase) -> None:
    dml.LocalBackend.spawn(len(case.batches), join_bodies.join_body, case, timeout=60)


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("batchnorm", [False, True])
def test_a_rank_without_any_batch(overlap: bool, batchnorm: bool) -> None:
    case = join_bodies.JoinCase((0, 3, 1), overlap, batchnorm, None)
    dml.LocalBackend.spawn(3, join_bodies.join_body, case, timeout=60)


@pytest.mark.parametrize("world", [1, 2, 3])
def test_refusals(world: int) -> None:
    dml.LocalBackend.spawn(world, join_bodies.refusals_body, timeout=60)


def test_without_join_the_stall_is_reported() -> None:
    def body(backend: dml.Backend) -> None:
        model = torch.nn.Linear(2, 1)
        opt = dml.DistributedOptimizer(backend, torch.optim.SGD(model.parameters(), lr=0.1))
        for _ in range(1 + backend.rank):
            opt.zero_grad()
            model(torch.ones(1, 2)).sum().backward()
            opt.step()

    with pytest.raises(RankFailedError, match=r"rank\(s\) \[0\] already returned from fn"):
        dml.LocalBackend.spawn(2, body, timeout=60)


JOIN_JOB = shared.register("join", "join_job", timeout=300)


@requires_mpi
@pytest.mark.parametrize(
    ("ranks", "transport", "debug"),
    [
        pytest.param(2, "mpi", "0", marks=pytest.mark.shared_job(JOIN_JOB)),  # one host's defaults
        (3, "mpi", "1"),
        (2, "gloo", "0"),
        (3, "gloo", "1"),
    ],
)
def test_join_under_mpiexec(ranks: int, transport: str, debug: str) -> None:
    # gloo: the gradient buckets go over the transport of ranks on several hosts (forced here on one), whose calls
    # a rank that has run out of data must answer too (they stalled the job before). Debug mode: a joined rank's
    # answer is compared as made where the announcer made it (it was a mismatch of call sites before), and its
    # gloo answer makes no comparison of its own (the announcer's comes as an announcement)
    env = {"DML_TRANSPORT": transport, "DML_DEBUG": debug}
    if (transport, debug) == ("mpi", "0"):  # the shared job's environment
        job = shared.job(ranks, JOIN_JOB)
    else:
        job = run_mpi(ranks, ["tests/join_job.py"], timeout=300, envs=[env] * ranks)
    assert job.returncode == 0, job.output[-8000:]
    assert f"JOIN CHECKS PASSED: uneven refusals rooted skips odd around on {ranks} ranks" in job.output, job.output[
        -8000:
    ]
    assert_checks_passed(job, ["uneven", "refusals", "rooted", "skips", "odd", "around"], ranks)


@pytest.mark.parametrize("sparse_as_dense", [False, True], ids=["sparse", "as_dense"])
@pytest.mark.parametrize("batches", [(1, 2), (2, 0), (1, 1, 3), (0, 2, 1), (3, 1, 2, 0)])
def test_sparse_gradients_average_over_the_ranks_with_data(batches: tuple[int, ...], sparse_as_dense: bool) -> None:
    """A joined rank adds no entries to a sparse gradient (it used to send the announcer's: counted W times)."""
    dml.LocalBackend.spawn(len(batches), join_bodies.sparse_join_body, batches, sparse_as_dense, timeout=60)


@settings(max_examples=25, deadline=None)
@given(batches=join_bodies.join_uneven_batches(), root=st.integers(0, 3))
def test_rooted_calls_come_from_a_rank_with_data_once_their_root_has_joined(
    batches: tuple[int, ...], root: int
) -> None:
    dml.LocalBackend.spawn(len(batches), join_bodies.rooted_calls_body, batches, root % len(batches), timeout=60)


@settings(max_examples=25, deadline=None)
@given(batches=join_bodies.join_uneven_batches(), where=st.sampled_from(join_bodies.AROUND))
def test_collectives_before_the_forward_after_the_step_or_both(batches: tuple[int, ...], where: str) -> None:
    dml.LocalBackend.spawn(len(batches), join_bodies.calls_around_the_step_body, batches, where, timeout=60)


@pytest.mark.parametrize("batches", [(1, 3), (3, 1), (2, 3, 3), (0, 2, 3), (3, 2, 0, 1)])
def test_averages_skipped_steps_and_buffers_from_a_handle_not_given(batches: tuple[int, ...]) -> None:
    dml.LocalBackend.spawn(len(batches), join_bodies.averages_skips_and_buffers_body, batches, timeout=60)


@pytest.mark.parametrize("batches", [(2, 4), (3, 1), (5, 2, 3), (0, 3, 2), (4, 2, 0, 1)])
def test_skipped_steps_lone_forwards_and_other_averages(batches: tuple[int, ...]) -> None:
    dml.LocalBackend.spawn(len(batches), join_bodies.skips_and_odd_forwards_body, batches, timeout=60)
