"""MPI jobs for the core's promises: ``mpiexec -n N python tests/core_job.py MODE...``.

Modes that must pass (rank 0 ends with ``CORE JOB PASSED``):

- ``objects``: the object-collective bodies of tests/object_bodies.py;
- ``threads``: a second thread entering a collective while the main thread is inside
  one is refused, naming both threads, and the main thread's collective is intact;
- ``debug``: debug mode names a branch only one rank takes (an extra allreduce), a
  bfloat16 against an int16 broadcast, a bool MAX against a uint8 one, and the world
  goes on;
- ``big``: collectives past 2**31 elements, an object over 2 GiB, the synchronize of a model of more
  than 2**31 elements and a checkpoint over 2 GiB (2 ranks).

``options`` (alone; launched with different ``DML_*`` variables per rank): making the backend
raises ValueError on every rank, naming the options and the ranks; each rank prints ``REFUSED``.

Modes that must end the job (each alone): ``debug_stall`` (debug mode, the last rank
never joins: the stall is reported), ``other_call`` (rank 0 finishes a different
collective with the same number, then stops communicating), ``hook_replaced`` (another
library replaced ``sys.excepthook``; rank 1 raises).
"""

from __future__ import annotations

import faulthandler
import gc
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable

import numpy as np
import torch
from mpi4py import MPI

import distutils_ml as dml

import object_bodies


def threads(backend: dml.Backend) -> None:
    rank = backend.rank
    errors: list[BaseException] = []

    def metrics() -> None:
        time.sleep(0.3)  # the main thread is inside its allreduce by now (rank 1 joins it after 1 s)
        try:
            dml.allreduce(backend, np.ones(3), dml.SUM)
        except RuntimeError as err:
            errors.append(err)

    helper = threading.Thread(target=metrics, name="metrics-logger") if rank == 0 else None
    if helper is not None:
        helper.start()
    if rank == 1:
        time.sleep(1.0)
    buf = np.full(4, float(rank + 1))
    dml.allreduce(backend, buf, dml.SUM)
    assert (buf == sum(range(1, backend.size + 1))).all(), buf
    if helper is not None:
        helper.join()
        assert len(errors) == 1, errors
        text = str(errors[0])
        assert "thread 'metrics-logger' called a collective" in text and "thread 'MainThread' is inside one" in text
    dml.barrier(backend)


def _mismatch(call: Callable[[], object]) -> str:
    try:
        call()
    except dml.CollectiveMismatchError as err:
        return str(err)
    raise AssertionError("no CollectiveMismatchError")


def debug(backend: dml.Backend) -> None:
    rank = backend.rank
    checker = dml.MPIBackend(debug=True, timeout=60)
    # A branch only rank 0 takes: its extra allreduce meets the others' next one (same shape and dtype).
    buf = np.ones(2)
    if rank == 0:
        text = _mismatch(lambda: dml.allreduce(checker, buf, dml.SUM))  # the extra call
    else:
        text = _mismatch(lambda: dml.allreduce(checker, buf, dml.SUM))  # the next call
    assert "differs across ranks" in text and "core_job.py:" in text, text
    dml.barrier(checker)
    # bfloat16 against int16 (the same bits on the wire), bool MAX against uint8 MAX.
    half = torch.zeros(3, dtype=torch.bfloat16 if rank == 0 else torch.int16)
    text = _mismatch(lambda: dml.bcast(checker, half, root=0))
    assert "dtype=bfloat16" in text and "dtype=int16" in text, text
    flags = np.zeros(3, dtype=np.bool_ if rank == 0 else np.uint8)
    text = _mismatch(lambda: dml.allreduce(checker, flags, dml.MAX))
    assert "dtype=bool" in text and "dtype=uint8" in text, text
    good = np.ones(2)
    dml.allreduce(checker, good, dml.SUM)
    assert (good == backend.size).all()


def big(backend: dml.Backend) -> None:
    n = 2**31 + 5  # more elements than a C int counts
    rank, size = backend.rank, backend.size
    # One 2 GiB buffer for the bcast, the allreduce (as int8), the allgather's send and the synchronized state:
    # its pages are made once, here, by this rank (the kernel makes them 4x slower while another process writes
    # them through CMA). Each use writes all of it again before its collective.
    buf = np.empty(n, dtype=np.uint8)
    buf.fill(0)
    if rank == 0:
        buf[::4096] = 7
        buf[-1] = 9
    dml.bcast(backend, buf, root=0)
    assert buf[-1] == 9 and int(buf[::4096].sum()) == 7 * len(buf[::4096]) and buf[1] == 0
    unsegmented = dml.MPIBackend(segment_bytes=0, timeout=0)
    acc = buf.view(np.int8)
    acc.fill(1)
    acc[-1] = rank
    dml.allreduce(unsegmented, acc, dml.SUM)
    assert acc[0] == size and acc[-1] == sum(range(size)) and acc[n // 2] == size
    del acc
    send = buf
    send.fill(rank + 1)
    recv = np.empty((size, n), dtype=np.uint8)
    for k in range(size):  # as above: the rows the other ranks send (allgather copies this rank's row itself)
        if k != rank:
            recv[k].fill(0)  # 12 s instead of 1 when left to the other ranks' writes
    dml.allgather(backend, send, recv)
    del send
    for k in range(size):
        assert recv[k, 0] == k + 1 and recv[k, -1] == k + 1 and recv[k, n // 3] == k + 1
    del recv  # freed here (NumPy arrays hold no reference cycles)
    # A model state of more than 2**31 elements: synchronize's fused broadcast, then a checkpoint over 2 GiB.
    weights = torch.from_numpy(buf.view(np.int8))
    del buf
    weights.fill_(rank)
    state = {"w": weights, "b": torch.full((3,), float(rank))}
    del weights
    dml.synchronize(backend, state, root=0)
    assert int(state["w"][-1]) == 0 and int(state["w"][n // 2]) == 0 and state["b"].tolist() == [0.0] * 3
    state["w"][-1] = 5
    # In memory where there is room (/dev/shm): what is tested is the size, not the disk (from which dml.load reads
    # a 2 GiB file that dml.save wrote past the page cache in about 15 s here).
    shm = "/dev/shm" if os.path.isdir("/dev/shm") and shutil.disk_usage("/dev/shm").free > 3 * 2**30 else None
    path = os.path.join(shm or tempfile.gettempdir(), f"dml-big-{os.getpid() if rank == 0 else 0}.pt")
    path = dml.bcast_object(backend, path)
    try:
        dml.save(backend, state, path)
        del state
        gc.collect()
        loaded = dml.load(backend, path)
    finally:
        if rank == 0:
            os.unlink(path)
    assert loaded["w"].numel() == n and int(loaded["w"][-1]) == 5 and int(loaded["w"][7]) == 0
    del loaded
    gc.collect()
    # Last, when no 2 GiB buffer is left: an object over 2 GiB.
    blob = bytes(range(256)) * (n // 256 + 1) if rank == 0 else None
    got = dml.bcast_object(backend, blob, root=0)
    assert len(got) == 256 * (n // 256 + 1) and got[-3:] == bytes([253, 254, 255]) and got[256:258] == b"\x00\x01"


def debug_stall(backend: dml.Backend) -> None:
    checker = dml.MPIBackend(debug=True, timeout=3)
    dml.allreduce(checker, np.ones(2), dml.SUM)
    if backend.rank == backend.size - 1:
        time.sleep(120)
    dml.allreduce(checker, np.ones(4, dtype=np.float32), dml.SUM)


def other_call(backend: dml.Backend) -> None:
    watched = dml.MPIBackend(timeout=3)
    dml.allreduce(watched, np.ones(2), dml.SUM)
    if watched.rank == 0:
        watched._bcast_object({"step": 1}, 0)  # e.g. `if rank == 0: dml.save(...)`: root finishes it alone
        time.sleep(120)
    dml.allreduce(watched, np.ones(4, dtype=np.float32), dml.SUM)


def hook_replaced(backend: dml.Backend) -> None:
    def other_hook(exc_type: type[BaseException], exc: BaseException, tb: object) -> None:
        sys.stderr.write(f"OTHER HOOK: {exc_type.__name__}: {exc}\n")  # as rich / sentry do: never chains

    sys.excepthook = other_hook
    if backend.rank == 1:
        time.sleep(0.5)
        raise RuntimeError("deliberate failure on rank 1")
    dml.allreduce(backend, np.ones(4), dml.SUM)  # the others wait here until the abort


def options() -> None:
    """Ranks started with different DML_* variables: initialize raises on every rank, before any collective."""
    rank = MPI.COMM_WORLD.Get_rank()
    try:
        dml.initialize(dml.MPIBackend)
    except ValueError as e:
        print(f"[rank {rank}] REFUSED: {e}", flush=True)
        # The same through keyword options: segment sizes that differ per rank.
        try:
            dml.MPIBackend(segment_bytes=1024 * (rank + 1), timeout=0, debug=False)
        except ValueError as again:
            print(f"[rank {rank}] REFUSED AGAIN: {again}", flush=True)
        return
    backend = dml.get_distributed_backend(dml.MPIBackend)
    print(f"[rank {rank}] ACCEPTED", flush=True)
    dml.allreduce(backend, np.ones(3), dml.SUM)  # debug on some ranks only: would hang here


def main(modes: list[str]) -> None:
    faulthandler.register(signal.SIGUSR1)  # the test runner asks for stacks before killing a hung job
    if modes == ["options"]:
        options()
        return
    dml.initialize(dml.MPIBackend)
    backend = dml.get_distributed_backend(dml.MPIBackend)
    for mode in modes:
        start = time.perf_counter()
        try:
            if mode == "objects":
                for body in object_bodies.BODIES:
                    body(backend)
            elif mode in ("threads", "debug", "big", "debug_stall", "other_call", "hook_replaced"):
                globals()[mode](backend)
            else:
                raise SystemExit(f"unknown mode {mode!r}")
        except BaseException:
            if mode == "hook_replaced":
                raise
            sys.stderr.write(f"[rank {backend.rank}] CHECK FAILED: {mode}\n{traceback.format_exc()}")
            sys.stderr.flush()
            MPI.COMM_WORLD.Abort(3)
        dml.print(backend, f"check {mode} passed in {time.perf_counter() - start:.1f}s")
    dml.barrier(backend)
    if backend.rank == 0:
        print(f"CORE JOB PASSED: {' '.join(modes)} on {backend.size} ranks", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
