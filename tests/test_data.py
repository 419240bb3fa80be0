"""The data container, numobs and getobs: partition properties on LocalBackend.spawn, loaders, errors.

The rank bodies live in tests/data_bodies.py, so the same bodies can run under mpiexec.
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
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler, SequentialSampler, TensorDataset

import distutils_ml as dml
from distutils_ml.data import DistributedDataContainer, getobs, numobs

import shared
from data_bodies import (
    GATHER_MISUSES,
    GATHER_VALUES,
    AccessCase,
    BatchedSquares,
    GatherCase,
    Pair,
    PartitionCase,
    Squares,
    access_body,
    access_cases,
    assert_obs_equal,
    check_misuse,
    check_shares,
    gather_body,
    gather_cases,
    gather_misuse_body,
    partition_body,
    partition_cases,
    small_gather_cases,
)
from mpirun import requires_mpi

WORLDS = st.integers(1, 5)


def shares_of(world: int, data: Any, **options: Any) -> list[DistributedDataContainer]:
    """Every rank's container, built on simulated ranks and handed back (they keep no backend)."""
    return dml.LocalBackend.spawn(world, lambda b: DistributedDataContainer(b, data, **options), timeout=60)


# -- the partition ------------------------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(case=partition_cases(), world=WORLDS)
def test_partition_is_distributed_samplers(case: PartitionCase, world: int) -> None:
    shares = dml.LocalBackend.spawn(world, partition_body, case, timeout=60)
    check_shares(case, world, shares)


@pytest.mark.parametrize(
    ("n", "world", "drop_last", "expected", "padded"),
    [
        # python-anchors.md §0's worked example.
        (10, 4, False, [[0, 4, 8], [1, 5, 9], [2, 6, 0], [3, 7, 1]], [0, 0, 1, 1]),
        (10, 4, True, [[0, 4], [1, 5], [2, 6], [3, 7]], [0, 0, 0, 0]),
        # Fewer observations than ranks: Lux's split has no share for ranks 2-4; here padding cycles.
        (2, 5, False, [[0], [1], [0], [1], [0]], [0, 0, 1, 1, 1]),
        (2, 5, True, [[], [], [], [], []], [0, 0, 0, 0, 0]),
        (0, 3, False, [[], [], []], [0, 0, 0]),
        (9, 4, False, [[0, 4, 8], [1, 5, 0], [2, 6, 1], [3, 7, 2]], [0, 1, 1, 1]),
    ],
)
def test_worked_examples(n: int, world: int, drop_last: bool, expected: list[list[int]], padded: list[int]) -> None:
    shares = shares_of(world, list(range(n)), drop_last=drop_last)
    assert [d.indices.tolist() for d in shares] == expected
    assert [d.num_padded for d in shares] == padded
    assert [d[:] for d in shares] == expected  # a list's batch is a list


def test_set_epoch_reshuffles_like_the_sampler() -> None:
    (ddc,) = shares_of(1, np.arange(50), shuffle=True, seed=7)
    sampler = DistributedSampler(range(50), num_replicas=1, rank=0, shuffle=True, seed=7)
    orders = []
    for epoch in (0, 1, 0, 5):
        ddc.set_epoch(epoch)
        sampler.set_epoch(epoch)
        assert ddc.epoch == epoch
        assert ddc.indices.tolist() == list(sampler)
        orders.append(ddc.indices.tolist())
    assert orders[0] == orders[2] != orders[1]
    with pytest.raises(ValueError, match="read-only"):
        ddc.indices[0] = 1
    for name in ("data", "shuffle", "seed", "drop_last", "num_padded", "epoch", "indices"):
        with pytest.raises(AttributeError):
            setattr(ddc, name, None)  # settings are fixed at construction; epochs change by set_epoch


def test_world_of_one_initialized_backend() -> None:
    dml.initialize(dml.LocalBackend)
    backend = dml.get_distributed_backend(dml.LocalBackend)
    ddc = DistributedDataContainer(backend, np.arange(5.0))
    assert len(ddc) == 5 and ddc.num_padded == 0
    np.testing.assert_array_equal(ddc[:], np.arange(5.0))


# -- observations and batches ---------------------------------------------------------------


@settings(max_examples=150, deadline=None)
@given(case=access_cases(), world=WORLDS)
def test_items_and_batches(case: AccessCase, world: int) -> None:
    sizes = dml.LocalBackend.spawn(world, access_body, case, timeout=60)
    assert len(set(sizes)) == 1


def test_numobs() -> None:
    x, y = np.zeros((6, 3)), torch.zeros(6, 2)
    assert numobs(x) == 6
    assert numobs(y) == 6
    assert numobs(list("abcdef")) == 6
    assert numobs(Squares(6)) == 6
    assert numobs((x, y)) == 6
    assert numobs({"x": x, "nested": (y, list(range(6)))}) == 6
    assert numobs(Pair(x, y)) == 6
    assert numobs(np.zeros((0, 4))) == 0
    assert numobs(TensorDataset(y)) == 6


def test_getobs() -> None:
    x = np.arange(12).reshape(6, 2)
    y = torch.arange(6) * 10
    z = [f"z{g}" for g in range(6)]
    assert_obs_equal(getobs(x, 2), x[2])
    assert_obs_equal(getobs(x, [2, 0]), x[[2, 0]])
    assert_obs_equal(getobs(y, np.array([5, 1])), y[torch.tensor([5, 1])])
    assert_obs_equal(getobs(y, torch.tensor([5, 1])), y[torch.tensor([5, 1])])
    assert_obs_equal(getobs(z, slice(1, 4)), ["z1", "z2", "z3"])
    assert_obs_equal(getobs(z, range(0, 6, 2)), ["z0", "z2", "z4"])
    assert_obs_equal(getobs((x, y, z), 3), (x[3], y[3], "z3"))
    assert_obs_equal(getobs((x, y, z), [3, 4]), (x[[3, 4]], y[torch.tensor([3, 4])], ["z3", "z4"]))
    assert_obs_equal(getobs({"x": x, "z": z}, np.int64(1)), {"x": x[1], "z": "z1"})
    assert_obs_equal(getobs(Pair(x, y), [0]), Pair(x[[0]], y[torch.tensor([0])]))
    assert_obs_equal(getobs(x, []), x[np.array([], dtype=np.int64)])
    assert_obs_equal(getobs(x, np.array(4)), x[4])  # a 0-d index is one observation
    data = BatchedSquares(6)
    assert_obs_equal(getobs(data, [4, 2]), [data[4], data[2]])
    assert data.batch_calls == 1
    ds = TensorDataset(torch.arange(6.0), y)  # a torch Dataset without __getitems__
    assert_obs_equal(getobs(ds, [1, 2]), [ds[1], ds[2]])


def test_mismatched_members_are_a_value_error() -> None:
    with pytest.raises(ValueError, match=r"data\[0\] has 5, data\[1\] has 4"):
        numobs((np.zeros(5), list(range(4))))
    with pytest.raises(ValueError, match=r"data\['y'\]\[1\] has 3"):
        numobs({"x": np.zeros(4), "y": (np.zeros(4), torch.zeros(3))})
    with pytest.raises(ValueError, match=r"DistributedDataContainer: data: .*data\[0\] has 5, data\[1\] has 4"):
        DistributedDataContainer(dml.LocalBackend(), (np.zeros(5), np.zeros(4)))
    with pytest.raises(ValueError, match="at least one member"):
        numobs(())


class NoLen(torch.utils.data.Dataset):
    def __getitem__(self, i: int) -> int:
        return i


class Stream(torch.utils.data.IterableDataset):
    def __iter__(self) -> Any:
        return iter(range(3))


@pytest.mark.parametrize(
    ("data", "match"),
    [
        ({1, 2, 3}, "set .* has no __getitem__"),
        ((i for i in range(3)), "generator .* has no __len__ or __getitem__"),
        (5, "int 5, which has no __len__ or __getitem__"),
        ("data.npy", r"str 'data.npy', text rather than data \(load it first\)"),
        (np.float64(1.0), "has no __len__"),
        (np.array(3.0), "0-d numpy.ndarray .* no observation axis"),
        (torch.tensor(3.0), "0-d torch.Tensor .* no observation axis"),
        (NoLen(), "NoLen .* has no __len__"),
        (Stream(), "IterableDataset Stream, which has no random access"),
        ((np.zeros(3), {1, 2, 3}), r"data\[1\]: got set"),
    ],
)
def test_bad_data_is_a_type_error(data: Any, match: str) -> None:
    with pytest.raises(TypeError, match=match) as info:
        DistributedDataContainer(dml.LocalBackend(), data)
    assert "allowed: a NumPy array or torch.Tensor" in str(info.value)
    assert str(info.value).startswith("DistributedDataContainer: data")


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"seed": "1"}, TypeError, "seed: got str '1'; allowed: an int"),
        ({"seed": 1.5}, TypeError, "seed: got float 1.5; allowed: an int"),
        ({"seed": True}, TypeError, "seed: got bool True; allowed: an int"),
        ({"seed": 2**64}, ValueError, "seed: got 18446744073709551616; allowed: an int in"),
        ({"shuffle": "yes"}, TypeError, "shuffle: got str 'yes'; allowed: True or False"),
        ({"drop_last": 1}, TypeError, "drop_last: got int 1; allowed: True or False"),
    ],
)
def test_bad_options(kwargs: dict[str, Any], error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        DistributedDataContainer(dml.LocalBackend(), np.zeros(3), **kwargs)


def test_seed_may_be_a_numpy_int() -> None:
    ddc = DistributedDataContainer(dml.LocalBackend(), np.zeros(3), shuffle=True, seed=np.int64(3))
    assert ddc.seed == 3 and type(ddc.seed) is int


@pytest.mark.parametrize("backend", [dml.LocalBackend, None, "mpi"])
def test_backend_must_be_an_instance(backend: Any) -> None:
    with pytest.raises(TypeError, match="DistributedDataContainer: the first argument must be a backend instance"):
        DistributedDataContainer(backend, np.zeros(3))


def test_bad_epoch() -> None:
    ddc = DistributedDataContainer(dml.LocalBackend(), np.zeros(3), shuffle=True, seed=2**64 - 1)
    with pytest.raises(TypeError, match=r"set_epoch: epoch: got float 1\.0; allowed: an int"):
        ddc.set_epoch(1.0)
    with pytest.raises(ValueError, match="seed \\+ epoch = 18446744073709551616 must lie in"):
        ddc.set_epoch(1)
    assert ddc.epoch == 0


def test_bad_indices() -> None:
    ddc = DistributedDataContainer(dml.LocalBackend(), np.arange(4))
    for bad in (4, -5, [0, 4], np.array([-5]), torch.tensor([9])):
        with pytest.raises(IndexError, match="out of range for this rank's 4 observations"):
            ddc[bad]
    for bad in (1.5, "0", True, (0, 1), np.array([1.0]), np.array([[0]]), [True]):
        with pytest.raises(TypeError, match="DistributedDataContainer: index: got"):
            ddc[bad]
    with pytest.raises(TypeError, match="getobs: idx: got"):
        getobs(np.arange(4), None)


def test_empty_data() -> None:
    ddc = DistributedDataContainer(dml.LocalBackend(), (np.zeros((0, 3)), []), shuffle=True)
    assert len(ddc) == 0 and ddc.num_padded == 0 and ddc.indices.shape == (0,)
    with pytest.raises(IndexError):
        ddc[0]
    x, z = ddc[[]]
    assert x.shape == (0, 3) and z == []
    assert ddc.__getitems__([]) == []
    assert list(DataLoader(ddc, batch_size=4)) == []


# -- loaders and pickling -------------------------------------------------------------------


def loader_data(n: int) -> tuple[np.ndarray, torch.Tensor]:
    return np.arange(3 * n, dtype=np.float32).reshape(n, 3), torch.arange(n) * 10


def expected_epoch(ddc: DistributedDataContainer) -> tuple[np.ndarray, torch.Tensor]:
    x, y = ddc.data
    return x[ddc.indices], y[torch.from_numpy(ddc.indices.copy())]


def loaded(loader: Any) -> tuple[np.ndarray, torch.Tensor]:
    xs, ys = zip(*loader, strict=True)
    return torch.cat(xs).numpy(), torch.cat(ys)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_dataloader(num_workers: int) -> None:
    for ddc in shares_of(3, loader_data(41), shuffle=True, seed=1):
        loader = DataLoader(ddc, batch_size=4, num_workers=num_workers)
        assert len(loader) == 4  # 14 observations a rank
        for epoch in (0, 1):
            ddc.set_epoch(epoch)
            x, y = loaded(loader)
            ex, ey = expected_epoch(ddc)
            np.testing.assert_array_equal(x, ex)
            assert torch.equal(y, ey)


def test_persistent_workers_follow_set_epoch() -> None:
    (ddc,) = shares_of(1, loader_data(40), shuffle=True, seed=3)
    loader = DataLoader(ddc, batch_size=8, num_workers=2, persistent_workers=True)
    seen = []
    for epoch in (0, 1, 2):
        ddc.set_epoch(epoch)
        y = loaded(loader)[1]
        assert torch.equal(y, expected_epoch(ddc)[1]), epoch
        seen.append(y.tolist())
    assert seen[0] != seen[1] != seen[2]


def test_persistent_workers_index_one_by_one_after_a_resumed_epoch() -> None:
    """A worker's copy checks an integer position against the current epoch's length, not the one before."""

    class Backwards(torch.utils.data.Sampler):
        def __init__(self, share: DistributedDataContainer) -> None:
            self.share = share

        def __len__(self) -> int:
            return len(self.share)

        def __iter__(self) -> Any:
            return iter(range(len(self.share) - 1, -1, -1))

    (ddc,) = shares_of(1, torch.arange(10))
    loader = DataLoader(ddc, batch_size=None, sampler=Backwards(ddc), num_workers=1, persistent_workers=True)
    for epoch, start in ((0, 6), (1, 0), (2, 3)):
        ddc.set_epoch(epoch, start)
        assert [int(x) for x in loader] == list(range(9, start - 1, -1)), (epoch, start)


def test_workers_that_unpickle_share_the_epoch() -> None:
    """Spawn and forkserver workers (the default from Python 3.14 on) get the container pickled.

    multiprocessing pickles a worker's arguments with ForkingPickler, under which torch
    (its import registers the reductions) passes shared memory by handle: the copy
    follows ``set_epoch`` like a forked one.
    """
    (ddc,) = shares_of(1, loader_data(24), shuffle=True, seed=3)
    copy = ForkingPickler.loads(ForkingPickler.dumps(ddc))
    for epoch in (4, 5):
        ddc.set_epoch(epoch)
        assert copy.epoch == epoch
        assert copy.indices.tolist() == ddc.indices.tolist()
        assert_obs_equal(copy[:], ddc[:])


def test_batched_loading_with_batch_size_none() -> None:
    """The fastest path: the loader's sampler yields whole batches, read with one call each."""
    (ddc,) = shares_of(1, loader_data(30), shuffle=True)
    sampler = BatchSampler(SequentialSampler(range(len(ddc))), batch_size=8, drop_last=False)
    x, y = loaded(DataLoader(ddc, batch_size=None, sampler=sampler))
    ex, ey = expected_epoch(ddc)
    np.testing.assert_array_equal(x, ex)
    assert torch.equal(y, ey)


def test_pickles_without_the_backend() -> None:
    def build(backend: dml.Backend) -> tuple[bool, DistributedDataContainer]:
        try:
            pickle.dumps(backend)
        except Exception:
            return False, DistributedDataContainer(backend, loader_data(10), shuffle=True, seed=9)
        return True, DistributedDataContainer(backend, loader_data(10), shuffle=True, seed=9)

    for picklable, ddc in dml.LocalBackend.spawn(3, build, timeout=60):
        assert not picklable  # a simulated rank's backend holds its world's locks
        ddc.set_epoch(2)
        copy = pickle.loads(pickle.dumps(ddc))
        assert copy.epoch == 2 and copy.indices.tolist() == ddc.indices.tolist()
        assert copy.num_padded == ddc.num_padded and len(copy) == len(ddc)
        assert_obs_equal(copy[:], ddc[:])
        copy.set_epoch(3)  # a pickled copy is independent
        assert ddc.epoch == 2


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.filterwarnings("ignore:'set_vital' is deprecated")
def test_stateful_dataloader_resumes_at_the_next_batch(num_workers: int) -> None:
    stateful = pytest.importorskip("torchdata.stateful_dataloader")

    def fresh() -> Any:
        (ddc,) = shares_of(2, loader_data(45), shuffle=True, seed=11)[1:]
        ddc.set_epoch(3)
        return stateful.StatefulDataLoader(ddc, batch_size=4, num_workers=num_workers)

    reference = [y for _, y in fresh()]
    assert len(reference) == 6  # 23 observations on rank 1
    loader = fresh()
    it = iter(loader)
    for k in range(4):
        assert torch.equal(next(it)[1], reference[k])
    state = loader.state_dict()
    resumed = fresh()
    resumed.load_state_dict(state)
    rest = [y for _, y in resumed]
    assert len(rest) == 2
    for got, want in zip(rest, reference[4:], strict=True):
        assert torch.equal(got, want)


def test_getitems_collates_like_a_tensor_dataset() -> None:
    x, y = loader_data(20)
    ddc = DistributedDataContainer(dml.LocalBackend(), (torch.from_numpy(x), y))
    plain = TensorDataset(torch.from_numpy(x), y)
    for got, want in zip(DataLoader(ddc, batch_size=6), DataLoader(plain, batch_size=6), strict=True):
        assert_obs_equal(got, want)


# -- exact evaluation: the unpadded view and gather_unpadded ------------------------------


@settings(max_examples=150, deadline=None)
@given(case=gather_cases(), world=WORLDS)
def test_gather_unpadded_is_the_single_process_evaluation(case: GatherCase, world: int) -> None:
    assert dml.LocalBackend.spawn(world, gather_body, case, timeout=60) == [len(case.epochs)] * world


@pytest.mark.parametrize("values", GATHER_VALUES)
def test_gather_unpadded_small_shares(values: str) -> None:
    """Every small size on 2-4 ranks: empty shares, all-padding ranks, mixed padded and unpadded results."""
    for world in (2, 3, 4):
        for case in small_gather_cases(values):
            assert dml.LocalBackend.spawn(world, gather_body, case, timeout=60) == [2] * world


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("misuse", GATHER_MISUSES)
def test_gather_unpadded_refuses_misuse_on_every_rank(misuse: str, world: int) -> None:
    for culprit in range(world):
        errors = dml.LocalBackend.spawn(world, gather_misuse_body, misuse, culprit, timeout=60)
        check_misuse(misuse, culprit, world, errors)


def test_tensor_dataset_evaluation_is_exact() -> None:
    """The issue's case: a TensorDataset, 10 observations on 4 ranks (two of them padded)."""
    data = TensorDataset(torch.arange(10.0)[:, None] * 2, torch.arange(10))

    def body(backend: dml.Backend) -> tuple[int, torch.Tensor, torch.Tensor]:
        share = DistributedDataContainer(backend, data)
        preds, labels = [], []
        for xb, yb in DataLoader(share.unpadded(), batch_size=2):
            preds.append(xb[:, 0] + 1)
            labels.append(yb)
        preds_all, labels_all = dml.gather_unpadded(backend, (torch.cat(preds), torch.cat(labels)), share)
        return len(share.unpadded()), preds_all, labels_all

    results = dml.LocalBackend.spawn(4, body)
    assert [n for n, _, _ in results] == [3, 3, 2, 2]
    for _, preds, labels in results:
        assert torch.equal(labels, torch.arange(10)) and torch.equal(preds, torch.arange(10.0) * 2 + 1)


def test_unpadded_view_indexes_like_the_container() -> None:
    (share,) = shares_of(3, list(range(10)), shuffle=True, seed=4)[2:]  # 4 observations, the last one padding
    view = share.unpadded()
    assert isinstance(view, dml.UnpaddedShare) and view.container is share
    assert len(view) == 3 and share.num_padded == 1
    assert view.indices.tolist() == share.indices[:3].tolist()
    assert [view[i] for i in range(3)] == [share[i] for i in range(3)] == [view[i - 3] for i in range(3)]
    assert view[:] == share[:3] and view[::-1] == share[2::-1]
    assert view[[2, -3]] == share[[2, 0]] == view[np.array([2, 0])] == view[torch.tensor([2, 0])]
    assert view.__getitems__([1, -1]) == [share[1], share[2]]
    for bad in (3, -4, [0, 3], np.array([-4])):
        with pytest.raises(IndexError, match=r"UnpaddedShare: index -?\d is out of range for this rank's 3"):
            view[bad]
    with pytest.raises(TypeError, match="UnpaddedShare: index: got"):
        view[1.0]
    share.set_epoch(5)  # the view follows the container's epoch
    assert view.indices.tolist() == share.indices[:3].tolist()
    assert pickle.loads(pickle.dumps(view))[:] == view[:]
    with pytest.raises(TypeError, match="allowed: a DistributedDataContainer"):
        dml.UnpaddedShare(list(range(3)))


def test_unpadded_view_with_persistent_workers() -> None:
    (share,) = shares_of(2, loader_data(21), shuffle=True, seed=2)[1:]  # 11 a rank, rank 1's last one padding
    view = share.unpadded()
    loader = DataLoader(view, batch_size=4, num_workers=2, persistent_workers=True)
    for epoch in (0, 1):
        share.set_epoch(epoch)
        assert torch.equal(loaded(loader)[1], expected_epoch(share)[1][:10])


def test_gather_unpadded_text_arrays_of_different_widths() -> None:
    def body(backend: dml.Backend) -> np.ndarray:
        share = DistributedDataContainer(backend, ["a", "bbbb", "cc"])
        return dml.gather_unpadded(backend, np.array(share[:]), share)

    for got in dml.LocalBackend.spawn(2, body):
        assert got.dtype == np.dtype("<U4") and got.tolist() == ["a", "bbbb", "cc"]


def test_gather_unpadded_lazy_views_travel_as_their_values() -> None:
    """A conjugate or negative view (its bit set, not its values) is gathered as what it holds, on any rank."""

    def body(backend: dml.Backend, lazy_rank: int) -> torch.Tensor:
        share = DistributedDataContainer(backend, np.arange(7))
        i = torch.as_tensor(share.indices.copy()).to(torch.complex64)
        values = i * (1 + 2j)
        if lazy_rank in (backend.rank, -1):  # -1: every rank
            values = (i * (1 - 2j)).conj() if backend.rank % 2 == 0 else torch._neg_view(-values)
        return dml.gather_unpadded(backend, values, share)

    expected = torch.arange(7).to(torch.complex64) * (1 + 2j)
    for lazy_rank in (0, 1, -1):
        for got in dml.LocalBackend.spawn(3, body, lazy_rank, timeout=30):
            assert torch.equal(got, expected) and not got.is_conj() and not got.is_neg()


def test_gather_unpadded_bad_backend() -> None:
    with pytest.raises(TypeError, match="gather_unpadded: the first argument must be a backend instance"):
        dml.gather_unpadded(dml.LocalBackend, [], None)


DATA_JOB = shared.register("data", "data_job")


@requires_mpi
@pytest.mark.parametrize("ranks", [2, 3])
@pytest.mark.shared_job(DATA_JOB)
def test_gather_unpadded_under_mpi(ranks: int) -> None:
    job = shared.job(ranks, DATA_JOB)
    assert job.returncode == 0 and f"DATA JOB PASSED on {ranks} ranks" in job.output, job.output[-12000:]
