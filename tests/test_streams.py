"""``split_iterable``: the stream partition on LocalBackend.spawn and under mpiexec, DataLoader workers, errors.

The rank bodies live in tests/streams_job.py, which also runs them under mpiexec.
"""

from __future__ import annotations

import pickle
from multiprocessing.reduction import ForkingPickler
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader, TensorDataset

import distutils_ml as dml
from distutils_ml.streams import IterableShare, SizedIterableShare

import shared
from mpirun import requires_mpi
from streams_job import (
    LOADER_CASES,
    LoaderCase,
    Numbered,
    Shuffled,
    SizedNumbered,
    StreamCase,
    expected,
    loader_body,
    stream_body,
    stream_cases,
)

WORLDS = st.integers(1, 5)


# -- the partition ------------------------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(case=stream_cases(), world=WORLDS)
def test_partition(case: StreamCase, world: int) -> None:
    """Each kept item once, in stream order, by the rank and worker the rule names; equal counts when dropping."""
    dml.LocalBackend.spawn(world, stream_body, case, timeout=60)


@pytest.mark.parametrize("drop_remainder", [True, False])
def test_every_short_stream(drop_remainder: bool) -> None:
    """Every length from 0 to two groups past a group, for small worlds and worker counts (empty, < W*K, ragged)."""
    for world in (1, 2, 3):
        for workers in (1, 2, 3):
            for n in range(2 * world * workers + 2):
                case = StreamCase(n, workers, drop_remainder, sized=n % 2 == 0)
                dml.LocalBackend.spawn(world, stream_body, case, timeout=60)


def test_worked_example() -> None:
    """10 items on 4 ranks: rank r keeps r and r + 4; 8 and 9 (an incomplete group) are dropped."""
    kept = dml.LocalBackend.spawn(4, lambda b: list(dml.split_iterable(b, Numbered(10))))
    assert kept == [[0, 4], [1, 5], [2, 6], [3, 7]]
    every = dml.LocalBackend.spawn(4, lambda b: list(dml.split_iterable(b, Numbered(10), drop_remainder=False)))
    assert every == [[0, 4, 8], [1, 5, 9], [2, 6], [3, 7]]
    workers = dml.LocalBackend.spawn(
        2, lambda b: [list(dml.split_iterable(b, Numbered(10)).worker_items(k, 2)) for k in (0, 1)]
    )
    assert workers == [[[0, 4], [1, 5]], [[2, 6], [3, 7]]]


def test_items_are_the_streams_own() -> None:
    """Any iterable: the items are passed through untouched (a list of dicts, tuples of tensors)."""
    rows = [{"x": torch.full((2,), float(i)), "id": f"row{i}"} for i in range(7)]
    shares = dml.LocalBackend.spawn(3, lambda b: list(dml.split_iterable(b, rows)))
    assert [[r["id"] for r in mine] for mine in shares] == [["row0", "row3"], ["row1", "row4"], ["row2", "row5"]]
    assert shares[1][0] is rows[1]


def test_no_collective() -> None:
    """Only rank 1 of 3 splits and reads: a collective inside would wait for ranks that never come."""

    def body(backend: dml.Backend) -> list[int] | None:
        if backend.rank != 1:
            return None
        share = dml.split_iterable(backend, SizedNumbered(9))
        return [*share, *share.worker_items(1, 2), len(share)]

    assert dml.LocalBackend.spawn(3, body, timeout=20, stall_timeout=5) == [None, [1, 4, 7, 3, 3], None]


def test_len_only_with_a_sized_stream() -> None:
    backend = dml.LocalBackend()
    share = dml.split_iterable(backend, Numbered(5))
    assert type(share) is IterableShare and not hasattr(share, "__len__")
    with pytest.raises(TypeError):
        len(share)  # type: ignore[arg-type]
    sized = dml.split_iterable(backend, SizedNumbered(5))
    assert type(sized) is SizedIterableShare and len(sized) == 5
    assert isinstance(sized, torch.utils.data.IterableDataset)
    lengths = dml.LocalBackend.spawn(
        3, lambda b: [len(dml.split_iterable(b, SizedNumbered(8), drop_remainder=d)) for d in (True, False)]
    )
    assert lengths == [[2, 3], [2, 3], [2, 2]]
    assert len(DataLoader(sized, batch_size=2)) == 3


def test_properties_and_repr() -> None:
    share = dml.LocalBackend.spawn(3, lambda b: dml.split_iterable(b, Numbered(4), drop_remainder=False))[2]
    assert (share.rank, share.world_size, share.drop_remainder) == (2, 3, False)
    assert isinstance(share.dataset, Numbered)
    assert repr(share).startswith("IterableShare(rank=2 of 3, drop_remainder=False, dataset=Numbered")


# -- DataLoader workers and training loops --------------------------------------------------


@pytest.mark.parametrize("case", LOADER_CASES, ids=str)
@pytest.mark.parametrize("world", [1, 3])
def test_dataloader_workers(case: LoaderCase, world: int) -> None:
    """Real fork workers (num_workers=2): each takes its own items; with a collective per batch no rank waits."""
    dml.LocalBackend.spawn(world, loader_body, case, timeout=60, stall_timeout=20)


def test_training_loop_steps_agree() -> None:
    """A model trained on the split: every rank takes the same number of optimizer steps and ends equal."""

    def train(backend: dml.Backend) -> tuple[int, list[float]]:
        torch.manual_seed(0)
        model = dml.synchronize(backend, torch.nn.Linear(1, 1))
        opt = dml.DistributedOptimizer(backend, torch.optim.SGD(model.parameters(), lr=0.01))
        data = [(torch.tensor([float(i)]), torch.tensor([2.0 * i])) for i in range(29)]
        steps = 0
        for epoch in range(2):
            share = dml.split_iterable(backend, data)
            share.set_epoch(epoch)
            for x, y in DataLoader(share, batch_size=3):
                opt.zero_grad()
                torch.nn.functional.mse_loss(model(x), y).backward()
                opt.step()
                steps += 1
        return steps, [p.item() for p in model.parameters()]

    results = dml.LocalBackend.spawn(4, train, timeout=60, stall_timeout=20)
    assert [steps for steps, _ in results] == [6] * 4  # 28 items kept: 7 a rank, batches of 3, 3, 1; two epochs
    assert all(params == results[0][1] for _, params in results)


def test_set_epoch_reaches_the_stream_and_persistent_workers() -> None:
    def epochs(backend: dml.Backend) -> list[list[int]]:
        stream = Shuffled(24)
        share = dml.split_iterable(backend, stream)
        loader = DataLoader(share, batch_size=4, num_workers=2, persistent_workers=True)
        seen = []
        for epoch in (3, 4):
            share.set_epoch(epoch)
            assert stream.epoch == epoch  # this process's stream at once
            order = stream.order(epoch)
            items = sorted(i for batch in loader for i in batch.tolist())
            positions = [p for k in (0, 1) for p in expected(24, backend.size, backend.rank, 2, k, drop_remainder=True)]
            assert items == sorted(order[p] for p in positions), epoch  # the workers' copies follow
            seen.append(items)
        return seen

    ranks = dml.LocalBackend.spawn(2, epochs, timeout=60)
    for epoch in (0, 1):
        assert sorted(ranks[0][epoch] + ranks[1][epoch]) == list(range(24))
    assert ranks[0][0] != ranks[0][1]


def test_set_epoch_without_a_streams_set_epoch_is_harmless() -> None:
    share = dml.split_iterable(dml.LocalBackend(), [1, 2, 3])
    share.set_epoch(np.int64(2))
    assert list(share) == [1, 2, 3]


def test_pickles_without_the_backend() -> None:
    share = dml.LocalBackend.spawn(2, lambda b: dml.split_iterable(b, Shuffled(10)))[1]
    share.set_epoch(5)
    positions = expected(10, 2, 1, 1, 0, drop_remainder=True)
    copy = pickle.loads(pickle.dumps(share))
    assert list(copy) == list(share) == [Shuffled(10).order(5)[p] for p in positions]
    shared = ForkingPickler.loads(ForkingPickler.dumps(share))  # spawn / forkserver workers' copies
    share.set_epoch(6)
    assert list(shared) == list(share) == [Shuffled(10).order(6)[p] for p in positions]


# -- misuse ---------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", [dml.LocalBackend, None, "mpi"])
def test_backend_must_be_an_instance(backend: Any) -> None:
    with pytest.raises(TypeError, match="split_iterable: the first argument must be a backend instance"):
        dml.split_iterable(backend, Numbered(3))


@pytest.mark.parametrize(
    ("dataset", "match"),
    [
        (5, "dataset: got int 5, which has no __iter__; allowed: an iterable"),
        ((i for i in range(3)), "dataset: got the iterator generator, which can be read only once"),
        (iter([1, 2]), "dataset: got the iterator list_iterator, which can be read only once"),
        ("lines.txt", "dataset: got str 'lines.txt', text rather than data"),
        (
            TensorDataset(torch.zeros(3)),
            r"dataset: got TensorDataset .* has no __iter__.*dml\.DistributedDataContainer\(backend, dataset\)",
        ),
    ],
)
def test_bad_dataset(dataset: Any, match: str) -> None:
    with pytest.raises(TypeError, match=match) as info:
        dml.split_iterable(dml.LocalBackend(), dataset)
    assert str(info.value).startswith("split_iterable: dataset: got")


@pytest.mark.parametrize("bad", [1, "yes", None, 0.0])
def test_bad_drop_remainder(bad: Any) -> None:
    with pytest.raises(TypeError, match=r"split_iterable: drop_remainder: got .*; allowed: True .* or False"):
        dml.split_iterable(dml.LocalBackend(), Numbered(3), drop_remainder=bad)


def test_numpy_bool_drop_remainder() -> None:
    share = dml.split_iterable(dml.LocalBackend(), Numbered(3), drop_remainder=np.bool_(False))
    assert share.drop_remainder is False


def test_bad_epoch_and_workers() -> None:
    share = dml.split_iterable(dml.LocalBackend(), Shuffled(3))
    with pytest.raises(TypeError, match=r"set_epoch: epoch: got float 1\.0; allowed: an int"):
        share.set_epoch(1.0)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="set_epoch: epoch: got bool True; allowed: an int"):
        share.set_epoch(True)
    with pytest.raises(ValueError, match="worker_items: num_workers: got 0; allowed: an int in"):
        share.worker_items(0, 0)
    with pytest.raises(ValueError, match=r"worker_items: worker: got 2; allowed: an int in \[0, 1\]"):
        share.worker_items(2, 2)
    with pytest.raises(TypeError, match="worker_items: worker: got str '0'; allowed: an int"):
        share.worker_items("0", 2)  # type: ignore[arg-type]


def test_the_container_refuses_a_stream_with_the_recipe() -> None:
    with pytest.raises(TypeError, match="IterableDataset Numbered, which has no random access") as info:
        dml.DistributedDataContainer(dml.LocalBackend(), Numbered(5))
    message = str(info.value)
    assert "dml.split_iterable(backend, dataset)" in message and "DataLoader(share" in message


# -- under mpiexec --------------------------------------------------------------------------


STREAMS_JOB = shared.register("streams", "streams_job", timeout=120)


@requires_mpi
@pytest.mark.parametrize("ranks", [2, 3])
@pytest.mark.shared_job(STREAMS_JOB)
def test_under_mpi(ranks: int) -> None:
    job = shared.job(ranks, STREAMS_JOB)
    assert job.returncode == 0 and f"STREAMS JOB PASSED on {ranks} ranks" in job.output, job.output[-12000:]
