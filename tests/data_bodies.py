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
from torch.utils.data import DataLoader, DistributedSampler, default_collate

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


# -- exact evaluation: the unpadded view and gather_unpadded ------------------------------

GATHER_DATA = ("tensor_dataset", "tuple", "dict", "dataset")
GATHER_VALUES = ("tensor", "array", "list", "tuple", "dict", "object", "odd_dtypes")


@dataclass(frozen=True)
class GatherCase:
    """One drawn evaluation: data, partition, epochs, and what each rank passes to gather_unpadded."""

    data: str
    values: str
    n: int
    shuffle: bool
    drop_last: bool
    seed: int
    epochs: tuple[int, ...]
    padded_ranks: int  # bit r set: rank r evaluates its whole share (padding included), else the unpadded view
    pass_view: int  # bit r set: rank r passes share.unpadded() as the share argument
    batch_size: int


@st.composite
def gather_cases(draw: st.DrawFn, max_n: int = 40) -> GatherCase:
    """A random dataset size, partition, epochs and values kind."""
    return GatherCase(
        data=draw(st.sampled_from(GATHER_DATA)),
        values=draw(st.sampled_from(GATHER_VALUES)),
        n=draw(st.one_of(st.integers(0, 6), st.integers(0, max_n))),  # often fewer than the ranks
        shuffle=draw(st.booleans()),
        drop_last=draw(st.booleans()),
        seed=draw(st.integers(0, 2**32)),
        epochs=tuple(draw(st.lists(st.integers(0, 50), min_size=1, max_size=3))),
        padded_ranks=draw(st.integers(0, 31)),
        pass_view=draw(st.integers(0, 31)),
        batch_size=draw(st.integers(1, 7)),
    )


def small_gather_cases(values: str) -> list[GatherCase]:
    """Every size up to 5 with and without drop_last, alternate ranks passing padded results (for 2-4 ranks)."""
    return [
        GatherCase("tuple", values, n, True, drop_last, 7, (0, 1), padded_ranks, padded_ranks, 2)
        for n in range(6)
        for drop_last in (False, True)
        for padded_ranks in (0b0101, 0b1010)
    ]


def gather_data(kind: str, n: int, seed: int) -> Any:
    """An evaluation dataset of ``kind`` whose observation g tells g."""
    rng = np.random.default_rng(seed)
    x = np.arange(n, dtype=np.float64)[:, None] + rng.random((n, 3))  # row g starts with g + [0, 1)
    return {
        "tensor_dataset": torch.utils.data.TensorDataset(torch.from_numpy(x), torch.arange(n) * 10),
        "tuple": (x, torch.arange(n) * 10, [f"z{g}" for g in range(n)]),
        "dict": {"x": x, "z": [f"z{g}" for g in range(n)]},
        "dataset": Squares(n),
    }[kind]


def evaluate(kind: str, batch: Any) -> tuple[torch.Tensor, torch.Tensor, list[str]]:
    """A "model" on a collated batch: a float score, an int label and a name per observation."""
    if kind == "tensor_dataset":
        x, y = batch
        return x[:, 0] * 2 + x[:, 1], y, [f"y{v}" for v in y.tolist()]
    if kind == "tuple":
        x, y, z = batch
        return x[:, 0] * 2 + x[:, 1], y, list(z)
    if kind == "dict":
        x = batch["x"]
        return x[:, 0] * 2 + x[:, 2], x[:, 0].long(), list(batch["z"])
    t, s = batch
    return t[:, 1].double() / 3, t[:, 0], list(s)


def evaluate_all(kind: str, batches: Any) -> tuple[torch.Tensor, torch.Tensor, list[str]]:
    """``evaluate`` over every batch, concatenated (empty results for no batch)."""
    scores, labels, names = [torch.empty(0, dtype=torch.float64)], [torch.empty(0, dtype=torch.int64)], []
    for batch in batches:
        score, label, name = evaluate(kind, batch)
        scores.append(score)
        labels.append(label)
        names += name
    return torch.cat(scores), torch.cat(labels), names


def as_values(kind: str, score: torch.Tensor, label: torch.Tensor, names: list[str]) -> Any:
    """What a rank passes to gather_unpadded (and what it gets back, for the whole dataset)."""
    if kind == "tensor":
        return score
    if kind == "array":
        return np.stack([score.numpy(), label.numpy().astype(np.float64)], axis=1)[:, :, None]
    if kind == "list":
        return names
    if kind == "tuple":
        return Pair(score, (label, names))
    if kind == "dict":
        return {"score": score.numpy(), "names": names}
    if kind == "object":
        out = np.empty(len(names), dtype=object)
        for i, name in enumerate(names):
            out[i] = (name, len(name))
        return out
    # dtypes the collectives cannot reduce travel as bytes all the same
    return (
        score.to(torch.bfloat16),
        label % 20 == 0,
        label.numpy().astype(np.complex64) * 1j,
        np.array(names, dtype=str),
    )


def gather_body(backend: dml.Backend, case: GatherCase) -> int:
    """gather_unpadded gives, on every rank, the single-process evaluation of the whole dataset; returns epochs done.

    Each rank evaluates its share through a DataLoader, over the whole share (padding
    included) or over ``share.unpadded()`` as the case says, and passes the container or
    its view. The oracle evaluates the kept observations (every one, or with drop_last
    those DistributedSampler hands out) in index order in one batch.
    """
    rank, world = dml.local_rank(backend), dml.total_workers(backend)
    data = gather_data(case.data, case.n, case.seed)
    share = DistributedDataContainer(backend, data, shuffle=case.shuffle, seed=case.seed, drop_last=case.drop_last)
    view = share.unpadded()
    assert len(view) == len(share) - share.num_padded
    for epoch in case.epochs:
        share.set_epoch(epoch)
        assert view.indices.tolist() == share.indices[: len(view)].tolist()
        padded = bool(case.padded_ranks >> rank & 1)
        loader = DataLoader(share if padded else view, batch_size=case.batch_size)
        values = as_values(case.values, *evaluate_all(case.data, loader))
        given = view if case.pass_view >> rank & 1 else share
        got = dml.gather_unpadded(backend, values, given)

        kept: set[int] = set()
        for r in range(world):
            sampler = DistributedSampler(
                range(case.n),
                num_replicas=world,
                rank=r,
                shuffle=case.shuffle,
                seed=case.seed,
                drop_last=case.drop_last,
            )
            sampler.set_epoch(epoch)
            kept.update(sampler)
        rows = [direct(data, g) for g in sorted(kept)]
        expected = as_values(case.values, *evaluate_all(case.data, [default_collate(rows)] if rows else []))
        assert_obs_equal(got, expected)
    return len(case.epochs)


GATHER_MISUSES = (
    "too_long",
    "too_short",
    "kind",
    "dtype",
    "rows",
    "structure",
    "epoch",
    "start",
    "share",
    "values_type",
    "masked",
)


def gather_misuse_body(backend: dml.Backend, misuse: str, culprit: int) -> tuple[str, str]:
    """Rank ``culprit`` misuses gather_unpadded; returns the error this rank got (every rank must get it).

    Afterwards an allgather must see fresh data: nothing of the refused call was sent.
    """
    rank, world = dml.local_rank(backend), dml.total_workers(backend)
    n = 3 * world + 1  # every rank but rank 0 has one padded observation
    x = torch.arange(n, dtype=torch.float64)
    share = DistributedDataContainer(backend, (x,), shuffle=True)
    culprit_here = rank == culprit
    share.set_epoch(1 if misuse == "epoch" and culprit_here else 0, world if misuse == "start" and culprit_here else 0)
    values: Any = x[torch.from_numpy(share.indices.copy())]
    given: Any = share
    if rank == culprit:
        values = {
            "too_long": torch.cat([values, values[:1]]),
            "too_short": values[: len(share.unpadded()) - 1],
            "kind": values.numpy(),
            "dtype": values.float(),
            "rows": values[:, None],
            "structure": (values,),
            "values_type": set(values.tolist()),
            "masked": np.ma.masked_array(values.numpy(), mask=values.numpy() > 2),
        }.get(misuse, values)
        given = (x,) if misuse == "share" else share
    try:
        dml.gather_unpadded(backend, values, given)
    except (TypeError, ValueError) as e:
        error = (type(e).__name__, str(e))
    else:
        error = ("", "no error")
    out = np.empty(world, dtype=np.int64)
    dml.allgather(backend, np.array(rank + 100), out)
    assert out.tolist() == [r + 100 for r in range(world)], out
    return error


MISUSE_ERRORS = {
    "too_long": ("ValueError", r"rank {c}: values: got {m1} observations; allowed: {m}"),
    "too_short": ("ValueError", r"rank {c}: values: got {u1} observations"),
    "kind": ("TypeError", r"values: rank {c} passes kind 'array', rank 0 'tensor'"),
    "dtype": ("TypeError", r"values: rank {c} passes dtype torch.float32, rank 0 torch.float64"),
    "rows": ("TypeError", r"values: rank {c} passes row shape \(1,\), rank 0 \(\)"),
    "structure": ("TypeError", r"values: rank {c} passes a different structure than rank 0"),
    "epoch": ("ValueError", r"share: the ranks' containers differ in epoch \(.*rank {c}: 1[,)]"),
    "start": ("ValueError", r"share: the ranks' containers differ in set_epoch's start \(.*rank {c}: {w}[,)]"),
    "share": ("TypeError", r"rank {c}: share: got tuple .*; allowed: the DistributedDataContainer"),
    "masked": ("TypeError", r"rank {c}: values: got .*MaskedArray.*a subclass of numpy.ndarray"),
    "values_type": ("TypeError", r"rank {c}: values: got set .*; allowed: a torch.Tensor or NumPy array"),
}


def check_misuse(misuse: str, culprit: int, world: int, errors: list[tuple[str, str]]) -> None:
    """Every rank raised the same error, of the expected class, naming the culprit."""
    import re

    n = 3 * world + 1
    m = -(-n // world)
    kind, pattern = MISUSE_ERRORS[misuse]
    if misuse == "structure" and culprit == 0:
        pattern = r"values: rank \d passes a different structure than rank 0"
    elif misuse in ("kind", "dtype", "rows") and culprit == 0:  # then every other rank differs from rank 0
        pattern = {"kind": r"rank 1 passes kind 'tensor', rank 0 'array'", "dtype": "rank 1 passes dtype"}.get(
            misuse, r"rank 1 passes row shape \(\), rank 0 \(1,\)"
        )
    unpadded = m - (1 if culprit > 0 else 0)
    pattern = pattern.format(c=culprit, m=m, m1=m + 1, u1=unpadded - 1, w=world)
    assert len(set(errors)) == 1, errors
    got_kind, message = errors[0]
    assert got_kind == kind, errors
    assert message.startswith("gather_unpadded: ") and re.search(pattern, message), (pattern, message)
