"""LocalBackend: the simulated world's semantics, failure handling and isolation."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch

import distutils_ml as dml
from distutils_ml.backends.local import RankFailedError
from distutils_ml.objects import run_on_root

from bodies import MISMATCHES, mismatch_body


def test_spawn_returns_results_in_rank_order() -> None:
    def fn(b: dml.Backend, offset: int) -> tuple[int, int]:
        time.sleep(0.01 * (3 - dml.local_rank(b)))  # finish in reverse order
        return dml.local_rank(b) + offset, dml.total_workers(b)

    assert dml.LocalBackend.spawn(4, fn, 10) == [(10, 4), (11, 4), (12, 4), (13, 4)]


@pytest.mark.parametrize("culprit", [0, 1, 2])
def test_exception_releases_waiting_ranks_and_is_reraised(culprit: int) -> None:
    def fn(b: dml.Backend) -> None:
        if dml.local_rank(b) == culprit:
            time.sleep(0.2)
            raise KeyError(f"boom on {culprit}")
        dml.allreduce(b, np.ones(3), dml.SUM)

    start = time.monotonic()
    with pytest.raises(KeyError, match=f"boom on {culprit}"):
        dml.LocalBackend.spawn(3, fn, timeout=30)
    assert time.monotonic() - start < 1.5


def test_rank_that_returns_early_fails_the_waiters() -> None:
    def fn(b: dml.Backend) -> None:
        if dml.local_rank(b) != 0:
            dml.barrier(b)

    with pytest.raises(RankFailedError, match=r"rank\(s\) \[0\] already returned"):
        dml.LocalBackend.spawn(3, fn, timeout=30)


@pytest.mark.parametrize("case", MISMATCHES)
@pytest.mark.parametrize("world", [2, 3])
def test_mismatched_collectives_raise_on_every_rank(case: str, world: int) -> None:
    assert dml.LocalBackend.spawn(world, mismatch_body, case, timeout=30) == [True] * world


def test_stall_names_the_missing_rank() -> None:
    release = threading.Event()

    def fn(b: dml.Backend) -> None:
        if dml.local_rank(b) == 2:
            release.wait(10)  # never joins the allreduce
            return
        dml.allreduce(b, np.ones(2), dml.SUM)

    start = time.monotonic()
    stalled = r"in allreduce\(shape=\(2,\), dtype=float64, op=dml.SUM\) #1; rank\(s\) \[2\] have not arrived"
    with pytest.raises(dml.StallError, match=stalled):
        dml.LocalBackend.spawn(3, fn, timeout=30, stall_timeout=0.5)
    assert time.monotonic() - start < 5
    release.set()


def test_ranks_never_alias_each_others_buffers() -> None:
    def fn(b: dml.Backend) -> list:
        r = dml.local_rank(b)
        a = torch.full((4,), float(r))
        dml.allreduce(b, a, dml.SUM)
        c = np.full(4, r)
        dml.bcast(b, c, root=1)
        g = np.empty((3, 4))
        dml.allgather(b, c.astype(float), g)
        return [a, c, g]

    out = dml.LocalBackend.spawn(3, fn, timeout=30)
    arrays = [np.asarray(x) for rank in out for x in rank]
    for i, x in enumerate(arrays):
        for y in arrays[i + 1 :]:
            assert not np.shares_memory(x, y)
    out[0][0].add_(100)  # a later write on one rank is invisible to the others
    assert out[1][0].tolist() == [3.0] * 4


def test_get_distributed_backend_inside_spawn_is_the_ranks_backend() -> None:
    def fn(b: dml.Backend) -> bool:
        dml.initialize(dml.LocalBackend)  # a no-op inside a simulated rank
        return dml.initialized(dml.LocalBackend) and dml.get_distributed_backend(dml.LocalBackend) is b

    assert dml.LocalBackend.spawn(3, fn) == [True] * 3


def test_spawn_timeout_names_the_stuck_ranks() -> None:
    release = threading.Event()

    def fn(b: dml.Backend) -> None:
        if dml.local_rank(b) == 1:
            release.wait(10)

    with pytest.raises(TimeoutError, match=r"ranks \[1\] still running"):
        dml.LocalBackend.spawn(2, fn, timeout=0.3)
    release.set()


@pytest.mark.parametrize("size", [0, -1, 1.5, True, "2"])
def test_spawn_rejects_bad_world_size(size) -> None:
    with pytest.raises(ValueError, match="world_size"):
        dml.LocalBackend.spawn(size, lambda b: None)


def test_spawn_rejects_non_callable() -> None:
    with pytest.raises(TypeError, match="fn: got int"):
        dml.LocalBackend.spawn(2, 3)


def test_object_broadcast_returns_roots_object() -> None:
    def fn(b: dml.Backend):
        return b._bcast_object({"rank": dml.local_rank(b), "s": "x" * dml.local_rank(b)}, root=2)

    assert dml.LocalBackend.spawn(3, fn) == [{"rank": 2, "s": "xx"}] * 3


def test_close_ends_the_communication_thread_runs_callbacks_and_refuses_later_calls() -> None:
    order: list[tuple[int, str]] = []

    def body(backend: dml.Backend) -> tuple[bool, bool]:
        ran = []
        worker = backend.comm_thread()
        worker.submit(lambda: ran.append(dml.allreduce(backend, np.ones(2), dml.SUM)))
        backend.on_close(lambda: order.append((backend.rank, "first registered")))
        backend.on_close(lambda: order.append((backend.rank, "last registered")))
        backend.close()  # after the queued job: it ran
        backend.close()  # nothing more
        assert ran and (ran[0] == 2).all(), ran
        for call in (lambda: dml.allreduce(backend, np.ones(2), dml.SUM), lambda: dml.barrier(backend)):
            with pytest.raises(RuntimeError, match="was closed"):
                call()
        with pytest.raises(RuntimeError, match="is closed"):
            backend.comm_thread()
        with pytest.raises(RuntimeError, match="is closed"):
            backend.on_close(lambda: None)
        return backend.closed, any(t.ident == worker.ident for t in threading.enumerate())

    assert dml.LocalBackend.spawn(2, body) == [(True, False), (True, False)]
    for rank in range(2):
        assert [what for r, what in order if r == rank] == ["last registered", "first registered"], order


def test_a_root_busy_producing_a_broadcast_is_warned_about_not_taken_for_a_stall(
    capfd: pytest.CaptureFixture[str],
) -> None:
    """run_on_root's function runs inside the collective: the waiting ranks warn that it is slow, every
    stall_timeout, and raise nothing; once it is done, the stall clock starts again."""

    def body(backend: dml.Backend) -> int:
        return run_on_root(backend, lambda: time.sleep(1.2) or 7, what="slow")

    assert dml.LocalBackend.spawn(2, body, stall_timeout=0.4, timeout=30) == [7, 7]
    err = capfd.readouterr().err
    assert "rank(s) [0] busy inside it (not a stall)" in err, err
