"""``split_iterable``'s rank bodies, and their MPI run: ``mpiexec -n N python tests/streams_job.py``.

Each body takes ``(backend, case)``, reads its rank and world size from the backend,
gathers every rank's items with ``allgather_object`` (after the split: the split itself
communicates nothing) and asserts on every rank, so the same bodies run on
``LocalBackend.spawn`` (tests/test_streams.py) and under real ``mpiexec`` here. MPI is
imported only by ``main``. A failing body prints its rank, case and traceback and aborts
the job; rank 0 ends with ``STREAMS JOB PASSED`` when all passed.
"""

from __future__ import annotations

import faulthandler
import signal
from dataclasses import dataclass
from typing import Any

import torch
from hypothesis import strategies as st
from torch.utils.data import DataLoader, IterableDataset

import distutils_ml as dml

# -- streams --------------------------------------------------------------------------------


class Numbered(IterableDataset):
    """The stream ``0, 1, ..., n-1``: each item is its position. No ``len()``."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self) -> Any:
        return iter(range(self.n))


class SizedNumbered(Numbered):
    """``Numbered`` with ``len()``."""

    def __len__(self) -> int:
        return self.n


class Shuffled(IterableDataset):
    """``0 .. n-1`` in the order ``torch.randperm`` gives for the epoch set last (``set_epoch``)."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def order(self, epoch: int) -> list[int]:
        return torch.randperm(self.n, generator=torch.Generator().manual_seed(epoch)).tolist()

    def __iter__(self) -> Any:
        return iter(self.order(self.epoch))


def expected(n: int, world: int, rank: int, workers: int, worker: int, *, drop_remainder: bool) -> list[int]:
    """The positions worker ``worker`` of ``workers`` on rank ``rank`` of ``world`` keeps: the rule, written out."""
    group = world * workers
    kept = n // group * group if drop_remainder else n
    return [i for i in range(kept) if i % group == rank * workers + worker]


# -- the partition --------------------------------------------------------------------------


@dataclass(frozen=True)
class StreamCase:
    """One drawn stream: its length, the DataLoader workers per rank, the split's option, whether it has len()."""

    n: int
    workers: int
    drop_remainder: bool
    sized: bool


def stream_cases() -> st.SearchStrategy[StreamCase]:
    # Lengths from 0 through several groups (a group is W*K <= 20 items): empty, shorter than a group, ragged.
    return st.builds(
        StreamCase, n=st.integers(0, 70), workers=st.integers(1, 4), drop_remainder=st.booleans(), sized=st.booleans()
    )


def stream_body(backend: dml.Backend, case: StreamCase) -> None:
    """Every rank splits the stream and reads every worker's items; all ranks' items are checked on each."""
    data = SizedNumbered(case.n) if case.sized else Numbered(case.n)
    share = dml.split_iterable(backend, data, drop_remainder=case.drop_remainder)
    per_worker = [list(share.worker_items(k, case.workers)) for k in range(case.workers)]
    alone = list(share)  # outside a DataLoader worker: one worker
    length = len(share) if hasattr(share, "__len__") else None
    everyone = dml.allgather_object(backend, (per_worker, alone, length))
    check_partition(case, backend.size, everyone)


def check_partition(
    case: StreamCase, world: int, everyone: list[tuple[list[list[int]], list[int], int | None]]
) -> None:
    n, workers, drop = case.n, case.workers, case.drop_remainder
    group = world * workers
    lists = [items for per_worker, _, _ in everyone for items in per_worker]  # rank-major, then worker
    assert len(lists) == group
    kept = sorted(i for items in lists for i in items)
    if drop:
        # Equal counts, only the last incomplete group dropped.
        assert all(len(items) == n // group for items in lists), [len(items) for items in lists]
        assert kept == list(range(n // group * group)), kept
        assert 0 <= n - len(kept) < group
    else:
        # Every item exactly once; counts differ by at most one.
        assert kept == list(range(n)), kept
        assert max(map(len, lists)) - min(map(len, lists)) <= 1
    for rank, (per_worker, alone, length) in enumerate(everyone):
        for worker, items in enumerate(per_worker):
            assert items == sorted(items), items  # stream order
            assert items == expected(n, world, rank, workers, worker, drop_remainder=drop), (rank, worker, items)
        assert alone == expected(n, world, rank, 1, 0, drop_remainder=drop), (rank, alone)
        assert length == (len(alone) if case.sized else None), (rank, length, len(alone))


# -- a training loop over a real DataLoader -------------------------------------------------


@dataclass(frozen=True)
class LoaderCase:
    """A DataLoader over the split: stream length, worker processes, batch size, the split's option."""

    n: int
    workers: int
    batch_size: int
    drop_remainder: bool = True


def loader_body(backend: dml.Backend, case: LoaderCase) -> list[list[int]]:
    """Train-shaped: one allreduce per batch (it would hang if a rank had more batches); returns this rank's batches."""
    share = dml.split_iterable(backend, SizedNumbered(case.n), drop_remainder=case.drop_remainder)
    loader = DataLoader(share, batch_size=case.batch_size, num_workers=case.workers)
    batches = []
    for batch in loader:
        if case.drop_remainder:  # ranks agree on the number of steps: a collective per step is safe
            step = torch.tensor([float(len(batch))])
            dml.allreduce(backend, step, dml.SUM)
        batches.append(batch.tolist())
    everyone = dml.allgather_object(backend, batches)
    world, k = backend.size, max(case.workers, 1)
    if case.drop_remainder:
        assert len({len(b) for b in everyone}) == 1, [len(b) for b in everyone]  # the same number of steps
    kept = sorted(i for batches in everyone for batch in batches for i in batch)
    group = world * k
    assert kept == list(range(case.n // group * group if case.drop_remainder else case.n)), kept
    for rank, rank_batches in enumerate(everyone):
        mine = sorted(i for batch in rank_batches for i in batch)
        theirs = [expected(case.n, world, rank, k, w, drop_remainder=case.drop_remainder) for w in range(k)]
        assert mine == sorted(i for items in theirs for i in items), (rank, mine)
    return batches


LOADER_CASES = [LoaderCase(23, 2, 2), LoaderCase(23, 2, 3, drop_remainder=False), LoaderCase(3, 2, 2)]


# -- no communication -----------------------------------------------------------------------


def silent_body(world: Any) -> None:
    """The split and its iteration start no collective (``calls_started``: MPIBackend's count)."""
    before = world.calls_started
    share = dml.split_iterable(world, SizedNumbered(10))
    read = (list(share), list(share.worker_items(1, 2)), len(share))
    assert read[2] == 10 // world.size, read
    assert world.calls_started == before, (before, world.calls_started)


def main() -> None:
    from mpi_main import guarded, hypothesis_check

    faulthandler.register(signal.SIGUSR1)  # the test runner asks for stacks before killing a hung job
    dml.initialize(dml.MPIBackend)
    world = dml.get_distributed_backend(dml.MPIBackend)
    guarded(silent_body, world)
    count = hypothesis_check(world, stream_body, stream_cases(), 60)
    for case in LOADER_CASES:
        guarded(loader_body, world, case)
    dml.print(world, f"streams checks passed: {count} streams, {len(LOADER_CASES)} loaders")
    dml.barrier(world)
    if world.rank == 0:
        print(f"STREAMS JOB PASSED on {world.size} ranks", flush=True)


if __name__ == "__main__":
    main()
