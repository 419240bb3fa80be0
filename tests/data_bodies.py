"""Test bodies of the data container: each takes ``(backend, case)`` and asserts.

A body runs on every rank and reads its rank and world size from the backend, so the
same bodies run on ``LocalBackend.spawn`` (tests/test_data.py) and inside real
``mpiexec`` jobs. Data are rebuilt on every rank from the case, as a user's script
would load them.
"""

from __future__ import annotations

from collections import namedtuple
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from hypothesis import strategies as st
from torch.utils.data import DistributedSampler

import distutils_ml as dml
from distutils_ml.data import DistributedDataContainer, getobs, numobs

Pair = namedtuple("Pair", ["x", "y"])


# -- the partition ----------------------------------------------------------------------


@dataclass(frozen=True)
class PartitionCase:
    """One drawn container: the number of observations and the sampler's settings."""

    n: int
    shuffle: bool
    drop_last: bool
    seed: int
    epoch: int


@st.composite
def partition_cases(draw: st.DrawFn, max_n: int = 60) -> PartitionCase:
    """A random partition: N in 0..max_n, shuffle, drop_last, seed, epoch."""
    return PartitionCase(
        n=draw(st.integers(0, max_n)),
        shuffle=draw(st.booleans()),
        drop_last=draw(st.booleans()),
        seed=draw(st.integers(0, 2**32)),
        epoch=draw(st.integers(0, 1000)),
    )


def partition_body(backend: dml.Backend, case: PartitionCase) -> list[int]:
    """This rank's share equals DistributedSampler's; shares pad only at their ends; returns the share.

    Besides the local checks, the ranks allgather their shares (which have equal
    lengths) and check on every rank that the unpadded parts together hold each
    observation exactly once (with ``drop_last``: at most once).
    """
    rank, world = dml.local_rank(backend), dml.total_workers(backend)
    data = 3 + 7 * np.arange(case.n)  # observation g is 3 + 7 g
    ddc = DistributedDataContainer(backend, data, shuffle=case.shuffle, seed=case.seed, drop_last=case.drop_last)
    ddc.set_epoch(case.epoch)
    sampler = DistributedSampler(
        range(case.n),
        num_replicas=world,
        rank=rank,
        shuffle=case.shuffle,
        seed=case.seed,
        drop_last=case.drop_last,
    )
    sampler.set_epoch(case.epoch)
    expected = list(sampler)
    share = ddc.indices.tolist()
    assert share == expected, (rank, share, expected)
    assert len(ddc) == len(sampler) == len(expected)
    assert ddc.epoch == case.epoch
    assert ddc.indices.dtype == np.int64 and ddc.indices.ndim == 1

    # The observations are those of the share, one by one, negative indices and batches alike.
    values = [3 + 7 * g for g in share]
    assert [int(ddc[i]) for i in range(len(ddc))] == values
    assert [int(ddc[i - len(ddc)]) for i in range(len(ddc))] == values
    assert ddc[:].tolist() == values
    assert ddc[list(range(len(ddc)))[::-1]].tolist() == values[::-1]

    # Padding: positions >= N of the padded index list; this rank's are its last ones.
    padded = [k for k in range(len(ddc)) if rank + k * world >= case.n]
    assert ddc.num_padded == len(padded) <= 1, (ddc.num_padded, padded)
    assert padded == list(range(len(ddc) - ddc.num_padded, len(ddc)))
    if case.drop_last:
        assert ddc.num_padded == 0

    # Across ranks: equal lengths, and the unpadded parts hold every observation once.
    counts = np.empty((world, 2), dtype=np.int64)
    dml.allgather(backend, np.array([len(ddc), ddc.num_padded], dtype=np.int64), counts)
    assert (counts[:, 0] == len(ddc)).all(), counts
    shares = np.empty((world, len(ddc)), dtype=np.int64)
    dml.allgather(backend, ddc.indices.copy(), shares)
    kept = np.concatenate([shares[r, : len(ddc) - counts[r, 1]] for r in range(world)])
    assert len(np.unique(kept)) == len(kept), kept
    assert set(kept.tolist()) <= set(range(case.n))
    if not case.drop_last:
        assert sorted(kept.tolist()) == list(range(case.n)), kept
    return share


def check_shares(case: PartitionCase, world: int, shares: list[list[int]]) -> None:
    """Cross-rank properties of every rank's share (``partition_body``'s results, in rank order)."""
    n = case.n
    length = len(shares[0])
    assert all(len(s) == length for s in shares), [len(s) for s in shares]
    # Interleave back into DistributedSampler's padded index list.
    full = [shares[k % world][k // world] for k in range(length * world)]
    if case.drop_last:
        assert len(full) == n - n % world
        assert len(set(full)) == len(full) and set(full) <= set(range(n))
    else:
        assert len(full) == -(-n // world) * world
        assert sorted(full[:n]) == list(range(n))
        assert full[n:] == [full[k % n] for k in range(n, len(full))]  # padding repeats the start


# -- observations and batches ----------------------------------------------------------


class Squares(torch.utils.data.Dataset):
    """A map-style dataset of ``(tensor([g, g*g]), str(g))`` that counts how it is read."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.item_calls = 0
        self.batch_calls = 0

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, g: int) -> tuple[torch.Tensor, str]:
        if not 0 <= g < self.n:
            raise IndexError(g)
        self.item_calls += 1
        return torch.tensor([g, g * g]), str(g)


class BatchedSquares(Squares):
    """``Squares`` that also reads batches with ``__getitems__``, as torch's DataLoader calls it."""

    def __getitems__(self, gs: list[int]) -> list[tuple[torch.Tensor, str]]:
        assert all(type(g) is int and 0 <= g < self.n for g in gs), gs
        self.batch_calls += 1
        return [(torch.tensor([g, g * g]), str(g)) for g in gs]


KINDS = ("numpy", "torch", "list", "dataset", "batched_dataset", "tuple", "namedtuple", "dict", "nested")


def make_data(kind: str, n: int, seed: int) -> Any:
    """Data of ``kind`` with ``n`` observations; every member's observation g tells g."""
    rng = np.random.default_rng(seed)
    x = np.arange(n, dtype=np.float64)[:, None] + rng.random((n, 3))  # row g starts with g + [0, 1)
    y = torch.arange(n) * 10
    z = [f"z{g}" for g in range(n)]
    return {
        "numpy": x,
        "torch": torch.from_numpy(x[:, :2].copy()).reshape(n, 2, 1),
        "list": z,
        "dataset": Squares(n),
        "batched_dataset": BatchedSquares(n),
        "tuple": (x, y, z),
        "namedtuple": Pair(x, y),
        "dict": {"x": x, "s": BatchedSquares(n)},
        "nested": (y, {"a": x.astype(np.float32), "b": (z, Squares(n))}),
    }[kind]


def direct(data: Any, g: int) -> Any:
    """Observation ``g`` of ``data``, read member by member (the oracle for ``getobs``)."""
    if isinstance(data, Pair):
        return Pair(direct(data.x, g), direct(data.y, g))
    if isinstance(data, tuple):
        return tuple(direct(m, g) for m in data)
    if isinstance(data, dict):
        return {k: direct(m, g) for k, m in data.items()}
    return data[g]


def select(batch: Any, k: int) -> Any:
    """The ``k``-th observation of a batch in ``getobs``'s layout."""
    if isinstance(batch, Pair):
        return Pair(select(batch.x, k), select(batch.y, k))
    if isinstance(batch, tuple):
        return tuple(select(m, k) for m in batch)
    if isinstance(batch, dict):
        return {key: select(m, k) for key, m in batch.items()}
    return batch[k]


def assert_obs_equal(a: Any, b: Any) -> None:
    """``a`` and ``b`` are the same observation (or batch): same types, same values."""
    assert type(a) is type(b), (type(a), type(b))
    if isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and a.shape == b.shape
        np.testing.assert_array_equal(a, b)
    elif isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), (a, b)
    elif isinstance(a, (tuple, list)):
        assert len(a) == len(b)
        for u, v in zip(a, b, strict=True):
            assert_obs_equal(u, v)
    elif isinstance(a, dict):
        assert list(a) == list(b)
        for key in a:
            assert_obs_equal(a[key], b[key])
    else:
        assert a == b, (a, b)


def as_torch(obs: Any) -> Any:
    """``obs`` with its NumPy arrays and scalars as tensors (``default_convert``'s rule)."""
    if isinstance(obs, (np.ndarray, np.generic)):
        return torch.as_tensor(obs)
    if isinstance(obs, Pair):
        return Pair(as_torch(obs.x), as_torch(obs.y))
    if isinstance(obs, tuple):
        return tuple(as_torch(m) for m in obs)
    if isinstance(obs, dict):
        return {k: as_torch(m) for k, m in obs.items()}
    return obs


def datasets(data: Any) -> list[Squares]:
    """The ``Squares`` members of ``data``."""
    if isinstance(data, Squares):
        return [data]
    if isinstance(data, tuple):
        return [s for m in data for s in datasets(m)]
    if isinstance(data, dict):
        return [s for m in data.values() for s in datasets(m)]
    return []


@dataclass(frozen=True)
class AccessCase:
    """One drawn container over one kind of data, and the positions to read."""

    kind: str
    n: int
    shuffle: bool
    seed: int
    positions: tuple[int, ...]  # taken modulo len, the sign kept (negative counts from the end)
    index_kind: str  # how the batch of positions is passed: list, numpy, torch or range


@st.composite
def access_cases(draw: st.DrawFn) -> AccessCase:
    """A random data kind, size and batch of positions to read."""
    return AccessCase(
        kind=draw(st.sampled_from(KINDS)),
        n=draw(st.integers(0, 30)),
        shuffle=draw(st.booleans()),
        seed=draw(st.integers(0, 2**31 - 1)),
        positions=tuple(draw(st.lists(st.integers(-40, 40), max_size=12))),
        index_kind=draw(st.sampled_from(["list", "numpy", "torch", "range"])),
    )


def access_body(backend: dml.Backend, case: AccessCase) -> int:
    """Items, batches, ``__getitems__`` and ``getobs`` agree with direct indexing; returns ``len``.

    A batch is read with one call per member: a dataset with ``__getitems__`` is
    called once, never item by item.
    """
    data = make_data(case.kind, case.n, case.seed)
    assert numobs(data) == case.n
    ddc = DistributedDataContainer(backend, data, shuffle=case.shuffle, seed=case.seed)
    size = len(ddc)
    for i in range(size):
        assert_obs_equal(ddc[i], direct(data, int(ddc.indices[i])))
        assert_obs_equal(ddc[i - size], ddc[i])
    if size == 0:
        positions: list[int] = []
    elif case.index_kind == "range":
        positions = list(range(size))[:: 1 + case.positions[0] % 3] if case.positions else []
    else:
        positions = [p % size if p >= 0 else -1 - (-1 - p) % size for p in case.positions]
    index: Any = {
        "list": positions,
        "numpy": np.array(positions, dtype=np.int64),
        "torch": torch.tensor(positions, dtype=torch.int64),
        "range": range(0, size, 1 + case.positions[0] % 3) if case.positions else range(0),
    }[case.index_kind]
    items = [ddc[p] for p in positions]

    for s in datasets(data):
        s.item_calls = s.batch_calls = 0
    batch = ddc[index]
    for s in datasets(data):
        if isinstance(s, BatchedSquares):
            assert (s.item_calls, s.batch_calls) == (0, 1), (s.item_calls, s.batch_calls)
        else:
            assert s.item_calls == len(positions)
    assert numobs(batch) == len(positions)
    for k, item in enumerate(items):
        assert_obs_equal(select(batch, k), item)

    # What torch's DataLoader calls: a list of observations, fetched as one batch,
    # with NumPy numbers as the tensors the default collate would make of them.
    rows = ddc.__getitems__(positions)
    assert isinstance(rows, list) and len(rows) == len(positions)
    for row, item in zip(rows, items, strict=True):
        assert_obs_equal(row, as_torch(item))

    # getobs on the global indices gives the same batch.
    glob = [int(ddc.indices[p]) for p in positions]
    assert_obs_equal(getobs(data, glob), batch)
    return size
