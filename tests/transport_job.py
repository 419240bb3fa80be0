"""The MPI job of tests/test_transport.py: ``mpiexec -n N python tests/transport_job.py CHECK...``, with
``DML_TRANSPORT=gloo``.

``ring``: the gloo transport's allreduce, reduce-scatter and allgather against the op over every rank's
buffer (hypothesis: sizes, dtypes, ops), bit-identical on every rank; ``inflight``: calls left in flight and
completed at different points on different ranks; ``buckets``: the gradient buckets of a
model going over it. ``agree``: ``DML_TRANSPORT`` set differently on the ranks is a ValueError on every
rank. ``broken``: a failed call breaks the transport on every rank. ``bucket_fails`` (must end the job): a
rank's bucket fails mid-backward. ``late``: a rank reaches the group's store after gloo's timeout. ``dies``
(must end the job): a rank killed while its peers are in no call. Rank 0 ends with ``TRANSPORT CHECKS PASSED``.
"""

from __future__ import annotations

import contextlib
import faulthandler
import gc
import os
import signal
import sys
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from hypothesis import strategies as st

import distutils_ml as dml
from distutils_ml.backends.base import ReduceOp
from distutils_ml.transport import transport_for

from mpi_main import hypothesis_check, run_checks

DTYPES = (np.float32, np.float64, np.int32, np.int64, np.uint32, np.uint64)
# Floats are whole multiples of 2**-8 below 2**(bits - 8): the sum of up to 8 of them is exact in that dtype (and
# not in a narrower one), so a ring that reduced in float32, or dropped a rank, cannot match bit for bit.
_FLOAT_BITS = {np.dtype(np.float32): 12, np.dtype(np.float64): 40}
REFERENCE = {
    ReduceOp.SUM: lambda a: a.sum(0),
    ReduceOp.AVG: lambda a: a.sum(0) / a.shape[0],
    ReduceOp.PROD: lambda a: a.prod(0),
    ReduceOp.MAX: lambda a: a.max(0),
    ReduceOp.MIN: lambda a: a.min(0),
}


@dataclass(frozen=True)
class RingCase:
    shape: tuple[int, ...]
    dtype: type
    op: ReduceOp
    seed: int


@st.composite
def ring_cases(draw: st.DrawFn) -> RingCase:
    dtype = draw(st.sampled_from(DTYPES))
    ops = [op for op in REFERENCE if op is not ReduceOp.AVG or np.dtype(dtype).kind == "f"]
    n = draw(st.one_of(st.integers(0, 9), st.integers(10, 5000), st.integers(1 << 20, (3 << 20) + 5)))
    shape = draw(st.sampled_from([(n,), (1, n), (n, 1)]))
    return RingCase(shape, dtype, draw(st.sampled_from(ops)), draw(st.integers(0, 2**31 - 1)))


def ring_body(world: dml.Backend, case: RingCase) -> None:
    ring = transport_for(world)
    assert ring is not None, "DML_TRANSPORT=gloo must give a transport"
    assert world.size <= 8, "the values are exact for sums of up to 8 ranks"
    rng = np.random.default_rng(case.seed)
    every = _values(rng, (world.size, *case.shape), case.dtype, case.op)
    x = every[world.rank].copy()
    if not ring.supports(x, case.op):  # gloo: float32/64, int32/64 (the unsigned go over the backend)
        assert x.dtype.kind == "u", (x.dtype, case.op)
        return
    before = ring.calls["allreduce"]
    ring.allreduce(x, case.op)
    assert ring.calls["allreduce"] == before + (x.size > 0), "the allreduce did not run on the ring"
    _same(x, REFERENCE[case.op](every).astype(case.dtype), case.op, "allreduce")
    gathered = np.empty((world.size, x.nbytes), np.uint8)
    dml.allgather(world, x.view(np.uint8).reshape(-1), gathered)
    assert (gathered == gathered[0]).all(), "the ring's result differs across ranks, bit for bit"
    # reduce_scatter: rank r's sendbuf is sends[r] (W rows); it receives the op over ranks of row r; input unchanged.
    m = int(np.prod(case.shape)) // 2
    sends = _values(rng, (world.size, world.size, m), case.dtype, case.op)
    mine = sends[world.rank].copy()
    out = np.full(m, 7, dtype=case.dtype)
    ring.reduce_scatter(mine, out, case.op)
    np.testing.assert_array_equal(mine.view(np.uint8), sends[world.rank].view(np.uint8))
    _same(out, REFERENCE[case.op](sends[:, world.rank]).astype(case.dtype), case.op, "reduce_scatter")
    # allgather into a flat buffer viewed (W, m), from a separate buffer and from the own row
    flat = np.zeros(world.size * m, dtype=case.dtype)
    ring.allgather(sends[world.rank, 0], flat.reshape(world.size, m))
    np.testing.assert_array_equal(flat.reshape(world.size, m), sends[:, 0])
    rows = sends[:, 1].copy()
    rows[np.arange(world.size) != world.rank] = 0
    ring.allgather(rows[world.rank], rows)
    np.testing.assert_array_equal(rows, sends[:, 1])


@dataclass(frozen=True)
class FlightCase:
    calls: tuple[tuple[str, int, type, ReduceOp], ...]  # (kind, elements per row, dtype, op)
    seed: int


@st.composite
def flight_cases(draw: st.DrawFn) -> FlightCase:
    calls = []
    for _ in range(draw(st.integers(1, 6))):
        dtype = draw(st.sampled_from((np.float32, np.float64, np.int32, np.int64)))
        ops = [op for op in REFERENCE if op is not ReduceOp.AVG or np.dtype(dtype).kind == "f"]
        n = draw(st.one_of(st.integers(0, 5), st.integers(6, 3000), st.integers(1 << 17, (1 << 17) + 3)))
        calls.append((draw(st.sampled_from(["allreduce", "reduce_scatter", "allgather"])), n, dtype,
                      draw(st.sampled_from(ops))))  # fmt: skip
    return FlightCase(tuple(calls), draw(st.integers(0, 2**31 - 1)))


def inflight_body(world: dml.Backend, case: FlightCase) -> None:
    """Calls left in flight (``wait=False``), each rank completing them at points of its own (``settle(keep)``
    drawn per rank after each call, or not at all until the end): every result is the op over every rank's
    buffer, bit for bit; each ``done`` is told once, of success; nothing is left in flight."""
    ring = transport_for(world)
    assert ring is not None
    W, r = world.size, world.rank
    rng = np.random.default_rng(case.seed)
    mine = np.random.default_rng([case.seed, r])  # this rank's own settling points
    checks, told = [], []
    for k, (kind, n, dtype, op) in enumerate(case.calls):
        if kind == "allreduce":
            every = _values(rng, (W, n), dtype, op)
            x = every[r].copy()
            ring.allreduce(x, op, wait=False)
            checks.append((x, REFERENCE[op](every).astype(dtype), op, f"call {k}: allreduce"))
        elif kind == "reduce_scatter":
            sends = _values(rng, (W, W, n), dtype, op)
            rows = sends[r].copy()
            ring.reduce_scatter(rows, rows[r], op, wait=False, done=told.append)  # in place, as the buckets do
            checks.append((rows[r], REFERENCE[op](sends[:, r]).astype(dtype), op, f"call {k}: reduce_scatter"))
        else:
            every = _values(rng, (W, n), dtype, op)
            rows = np.zeros((W, n), dtype)
            rows[r] = every[r]
            ring.allgather(rows[r], rows, wait=False, done=told.append)
            checks.append((rows, every, ReduceOp.SUM, f"call {k}: allgather"))
        keep = int(mine.integers(0, 4))
        if keep < 3:
            ring.settle(keep=keep)
            assert ring.in_flight <= keep, (ring.in_flight, keep)
    ring.settle()
    assert ring.in_flight == 0
    for got, want, op, what in checks:
        _same(got, want, op, what)
    assert told == [None] * sum(kind != "allreduce" for kind, *_ in case.calls), told


def _values(rng: np.random.Generator, shape: tuple[int, ...], dtype: type, op: ReduceOp) -> np.ndarray:
    """Values whose reduction over up to 8 ranks is exact in ``dtype`` in any order (see ``_FLOAT_BITS``)."""
    kind = np.dtype(dtype).kind
    if kind == "u":
        return rng.integers(0, 7, size=shape).astype(dtype)
    if kind == "i" or op in (ReduceOp.PROD, ReduceOp.MAX, ReduceOp.MIN):
        return rng.integers(-3, 4, size=shape).astype(dtype)
    bits = _FLOAT_BITS[np.dtype(dtype)]
    return (rng.integers(-(2**bits), 2**bits, size=shape) * 2.0**-8).astype(dtype)


def _same(got: np.ndarray, want: np.ndarray, op: ReduceOp, what: str) -> None:
    """Bit for bit, where the docs claim it; MAX and MIN by value (of +0.0 and -0.0 either may win)."""
    if op in (ReduceOp.MAX, ReduceOp.MIN):
        np.testing.assert_array_equal(got, want, err_msg=what)
    else:
        np.testing.assert_array_equal(got.view(np.uint8), want.view(np.uint8), err_msg=f"{what}: bits differ")


def buckets_body(world: dml.Backend) -> None:
    """A model's gradients go over the ring during backward: .grad is the average, replicas stay identical."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 512), torch.nn.ReLU(), torch.nn.Linear(512, 8))
    model = dml.synchronize(world, model)
    opt = dml.DistributedOptimizer(world, torch.optim.SGD(model.parameters(), lr=0.1), bucket_bytes=64 << 10)
    assert opt.overlap, "DML_TRANSPORT=gloo turns overlap on by default"
    g = torch.Generator().manual_seed(1)
    xs, ys = torch.randn(world.size * 16, 64, generator=g), torch.randint(0, 8, (world.size * 16,), generator=g)
    mine = slice(world.rank * 16, (world.rank + 1) * 16)
    ring = transport_for(world)
    assert ring is not None
    before = ring.calls["allreduce"]
    torch.nn.functional.cross_entropy(model(xs[mine]), ys[mine]).backward()
    sent = ring.calls["allreduce"] - before
    assert sent >= 2, f"the gradient buckets did not go over the ring ({sent} ring allreduce(s) in backward)"
    for p, mean in zip(model.parameters(), _mean_grads(world, model, xs, ys), strict=True):
        torch.testing.assert_close(p.grad, mean, rtol=1e-5, atol=1e-6)
    opt.step()
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    every = torch.empty(world.size, flat.numel())
    dml.allgather(world, flat, every)
    assert (every == every[0]).all(), "parameters differ across ranks"


def _mean_grads(world: dml.Backend, model: torch.nn.Module, xs: torch.Tensor, ys: torch.Tensor) -> list[torch.Tensor]:
    import copy

    local = copy.deepcopy(model)
    per_rank = []
    for r in range(world.size):
        local.zero_grad()
        part = slice(r * 16, (r + 1) * 16)
        torch.nn.functional.cross_entropy(local(xs[part]), ys[part]).backward()
        per_rank.append([p.grad.clone() for p in local.parameters()])
    return [sum(gs) / world.size for gs in zip(*per_rank, strict=True)]


def agree_body(world: dml.Backend) -> str:
    try:
        transport_for(world)
    except ValueError as e:
        assert "DML_TRANSPORT differs across ranks" in str(e), e
        return str(e)
    raise AssertionError("DML_TRANSPORT set differently on the ranks was accepted")


def broken_body(world: dml.Backend) -> str:
    """gloo: a call that fails marks the transport broken on that rank, and every later call there raises naming
    the first failure; the peers' call fails too (their peer is gone) instead of pairing with a later bucket."""
    from distutils_ml.gloo import GlooTransportError

    ring = transport_for(world)
    assert ring is not None and type(ring).__name__ == "GlooTransport", ring
    x = np.ones(8, np.float32)
    ring.allreduce(x, ReduceOp.SUM)
    assert (x == world.size).all(), x
    closing = world.rank == world.size - 1
    if closing:
        ring.close()  # this rank's transport ends: its next call fails here, its peers' fail with it
    told: list[Any] = []
    for _ in range(2):  # left in flight: each fails on every rank (the closed rank posts nothing), and says so once
        with contextlib.suppress(GlooTransportError):
            ring.allgather(np.ones(4, np.float32), np.zeros((world.size, 4), np.float32), wait=False, done=told.append)
    with contextlib.suppress(GlooTransportError):
        ring.settle()
    assert [type(e) for e in told] == [GlooTransportError, GlooTransportError], told
    assert ring.in_flight == 0, ring.in_flight
    outcomes = []
    for _ in range(2):
        try:
            ring.allreduce(np.ones(8, np.float32), ReduceOp.SUM)
            outcomes.append("no error")
        except GlooTransportError as e:
            outcomes.append(str(e))
    every = dml.allgather_object(world, outcomes)
    for rank, (first, second) in enumerate(every):
        assert first != "no error" and second != "no error", (rank, first, second)
        assert "broken by an earlier failure" in second, (rank, second)
    return "every rank raised, twice"


def bucket_fails_body(world: dml.Backend) -> None:
    """One rank's gradient bucket fails mid-backward (its transport closed): no rank may step (the job ends)."""
    model = dml.synchronize(
        world, torch.nn.Sequential(torch.nn.Linear(64, 512), torch.nn.ReLU(), torch.nn.Linear(512, 8))
    )
    opt = dml.DistributedOptimizer(world, torch.optim.SGD(model.parameters(), lr=0.1), bucket_bytes=64 << 10)
    model(torch.ones(4, 64)).sum().backward()
    opt.step()
    ring = transport_for(world)
    assert ring is not None
    if world.rank == world.size - 1:
        ring.close()
    opt.zero_grad()
    model(torch.ones(4, 64)).sum().backward()  # raises on every rank (fail-fast ends the job)
    opt.step()
    print(f"[rank {world.rank}] STEPPED AFTER A FAILED BUCKET", flush=True)


def fallback_body(world: dml.Backend) -> str:
    """No interface named by DML_SOCKET_IFNAME: under gloo every rank raises; under auto across hosts every rank
    warns, the buckets go over MPI with overlap off, and training works."""
    import warnings

    from distutils_ml.transport import transport_choice

    if transport_choice() == "gloo":
        try:
            transport_for(world)
        except RuntimeError as e:
            assert "could not make their gloo group" in str(e) and "no IPv4 address" in str(e), e
            return "refused"
        raise AssertionError("an unusable interface was not refused")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        model = dml.synchronize(world, torch.nn.Linear(8, 2))
        opt = dml.DistributedOptimizer(world, torch.optim.SGD(model.parameters(), lr=0.1))
    assert transport_for(world) is None and not opt.overlap, (transport_for(world), opt.overlap)
    assert any("the gradient buckets go over MPI, with overlap off" in str(w.message) for w in seen), seen
    model(torch.ones(2, 8)).sum().backward()
    opt.step()
    return "fell back to MPI"


def late_body(world: dml.Backend) -> str:
    """The last rank reaches the gloo group's store late, after gloo's timeout (``DML_GLOO_TIMEOUT``) has passed
    on the others (a slow start, a loaded host): every rank still joins the group, and a bucket goes over it."""
    import time

    late = world.size - 1
    real = torch.distributed.TCPStore

    def late_client(*args: Any, **kwargs: Any) -> Any:
        if world.rank == late:
            time.sleep(float(os.environ["DML_GLOO_TIMEOUT"]) + 2)
        return real(*args, **kwargs)

    torch.distributed.TCPStore = late_client  # type: ignore[misc]
    try:
        ring = transport_for(world)
    finally:
        torch.distributed.TCPStore = real  # type: ignore[misc]
    assert ring is not None, "the late rank did not join the gloo group"
    model = dml.synchronize(world, torch.nn.Linear(8, 2))
    opt = dml.DistributedOptimizer(world, torch.optim.SGD(model.parameters(), lr=0.1))
    assert opt.overlap, "the gloo group joined, but overlap is off"
    model(torch.full((2, 8), float(world.rank))).sum().backward()
    want = torch.full((2, 8), (world.size - 1) / 2).sum(0)  # the mean over ranks of each rank's input sum
    assert torch.equal(model.weight.grad[0], want), (model.weight.grad, want)
    opt.step()
    return "the late rank joined the gloo group"


def debug_body(world: dml.Backend) -> str:
    """Debug mode compares every gloo call across ranks first: calls that differ raise on every rank, and the
    transport goes on working."""
    ring = transport_for(world)
    assert ring is not None and world.debug
    n = 8 if world.rank == 0 else 9  # a bucket of another size on the other ranks
    try:
        ring.allreduce(np.ones(n, np.float32), ReduceOp.SUM)
    except dml.CollectiveMismatchError as e:
        assert "differs across ranks" in str(e), e
    else:
        raise AssertionError("a gloo call that differs across ranks was not caught in debug mode")
    x = np.ones(8, np.float32)
    ring.allreduce(x, ReduceOp.SUM)
    assert (x == world.size).all(), x
    return "caught"


def _counts() -> tuple[int, int]:
    """(open file descriptors, threads: the kernel's, so gloo's C++ threads count) of this process."""
    gc.collect()
    return len(os.listdir("/proc/self/fd")), len(os.listdir("/proc/self/task"))


def close_body(world: dml.Backend, loops: int = 100) -> str:
    """Backends (duplicates of the world's communicator) with a gloo transport, their communication thread and
    stall watchdog, made, used and closed in a loop: no descriptor or thread is left behind; a closed backend
    and its transport refuse every later call."""
    from distutils_ml.gloo import GlooTransportError

    def once() -> None:
        backend = world.duplicate()
        ring = transport_for(backend)
        assert ring is not None and ring.sockets, ring
        x = np.ones(1000, np.float32)
        ring.allreduce(x, ReduceOp.SUM)
        assert (x == world.size).all(), x
        backend.comm_thread().submit(lambda: ring.allreduce(x, ReduceOp.SUM))
        y = dml.allreduce(backend, np.ones(4), dml.SUM)  # waits for the job queued on the communication thread
        assert (y == world.size).all() and (x == world.size**2).all(), (y, x)
        backend.close()
        backend.close()  # a second close does nothing
        for call in (lambda: dml.allreduce(backend, np.ones(4), dml.SUM), lambda: dml.barrier(backend)):
            try:
                call()
            except RuntimeError as e:
                assert "was closed" in str(e), e
            else:
                raise AssertionError("a closed backend made a collective")
        try:
            ring.allreduce(x, ReduceOp.SUM)
        except GlooTransportError as e:
            assert "closed" in str(e), e
        else:
            raise AssertionError("a closed transport made a call")

    # Descriptors opened after the transport (they take the lowest free numbers) survive its close: it closes
    # only what it owns.
    backend = world.duplicate()
    assert transport_for(backend) is not None
    files = [open(os.devnull) for _ in range(8)]  # noqa: SIM115 - closed below
    backend.close()
    for f in files:
        os.fstat(f.fileno())  # OSError (EBADF) if closing the transport closed a number it no longer owned
        f.close()
    once()
    once()  # warm: what is made once per process (MPI's and torch's own threads) exists now
    before = _counts()
    for _ in range(loops):
        once()
    dml.barrier(world)
    after = _counts()
    assert after == before, f"(fds, threads) before {before}, after {loops} backends made and closed {after}"
    return f"{loops} backends closed, nothing left open"


def collected_body(world: dml.Backend) -> str:
    """A transport dropped unclosed on rank 1 alone (forgotten by its backend, as when a backend is collected) is
    collected and tells its watcher first, so its peers, in no call for a while, do not take it for a rank that died
    (the watcher would end the job at once)."""
    import time
    import weakref

    from distutils_ml import transport

    backend = world.duplicate()
    ring = weakref.ref(transport_for(backend))
    assert ring() is not None
    dml.barrier(world)
    if world.rank == 1:
        transport._TRANSPORTS.pop(backend)
        gc.collect()
        assert ring() is None, "the dropped transport was not collected"
    time.sleep(3)
    dml.barrier(world)
    return "a transport collected unclosed was not taken for a rank that died"


def _inherited_sockets(_: int) -> list[str]:
    """In a DataLoader worker: the sockets this process holds."""
    found = []
    for name in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue
        if target.startswith("socket:"):
            found.append(target)
    return found


def fork_body(world: dml.Backend) -> str:
    """A forked DataLoader worker does not hold the transport's sockets (a socket of the rank's own does reach it:
    the check sees inherited sockets), so when a rank's transport ends while its workers live, its peers learn it
    at once rather than at gloo's timeout."""
    import socket
    import time

    from distutils_ml.gloo import GlooTransportError

    backend = world.duplicate()
    ring = transport_for(backend)
    assert ring is not None
    mine = socket.socket()  # a socket of the rank's, not the transport's: workers inherit it
    loader = torch.utils.data.DataLoader(
        list(range(4)), batch_size=1, num_workers=2, persistent_workers=True, collate_fn=_inherited_sockets
    )
    seen = {s for batch in loader for s in batch}
    owned = set(ring.sockets.values())
    assert owned and f"socket:[{os.fstat(mine.fileno()).st_ino}]" in seen, (owned, seen)
    assert not owned & seen, f"DataLoader workers hold the transport's sockets {sorted(owned & seen)}"
    dml.barrier(world)
    last = world.size - 1
    if world.rank == last:
        ring.close()  # its workers are alive: what they hold would keep the connections open
    else:
        start = time.monotonic()
        try:
            ring.allreduce(np.ones(8, np.float32), ReduceOp.SUM)
        except GlooTransportError:
            waited = time.monotonic() - start
            assert waited < 10, f"the peers learned that rank {last}'s transport ended after {waited:.1f} s"
        else:
            raise AssertionError("a call with a closed peer succeeded")
    mine.close()
    del loader
    backend.close()
    return "workers hold no transport socket"


def dies_body(world: dml.Backend) -> None:
    """Rank 1 is killed between two steps, its DataLoader worker alive, while its peers are in no call (asleep):
    they end the job at once, naming it, not at their next call (the job runs under ``--enable-recovery``, so
    mpiexec does not end it itself)."""
    import time

    model = dml.synchronize(world, torch.nn.Linear(8, 2))
    opt = dml.DistributedOptimizer(world, torch.optim.SGD(model.parameters(), lr=0.1))
    assert transport_for(world) is not None
    loader = torch.utils.data.DataLoader(list(range(4)), batch_size=1, num_workers=1, persistent_workers=True)
    batches = iter(loader)
    next(batches)
    model(torch.ones(2, 8)).sum().backward()
    opt.step()
    dml.barrier(world)
    if world.rank == 1:
        print(f"[rank 1] KILLED AT {time.time():.3f}", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(30)
    print(f"[rank {world.rank}] NOT ENDED 30 s after rank 1 died", flush=True)


def main(names: list[str]) -> None:
    faulthandler.register(signal.SIGUSR1)  # the test runner asks for stacks before killing a hung job
    dml.initialize(dml.MPIBackend)
    world = dml.get_distributed_backend(dml.MPIBackend)
    checks = {
        "ring": lambda: hypothesis_check(world, ring_body, ring_cases(), 40),
        "inflight": lambda: hypothesis_check(world, inflight_body, flight_cases(), 12),
        "buckets": lambda: buckets_body(world),
        "agree": lambda: agree_body(world),
        "broken": lambda: broken_body(world),
        "debug": lambda: dml.print(world, debug_body(world)),
        "bucket_fails": lambda: bucket_fails_body(world),
        "fallback": lambda: dml.print(world, fallback_body(world)),
        "late": lambda: dml.print(world, late_body(world)),
        "close": lambda: dml.print(world, close_body(world)),
        "fork": lambda: dml.print(world, fork_body(world)),
        "dies": lambda: dies_body(world),
        "collected": lambda: collected_body(world),
    }
    run_checks(world, names, "TRANSPORT CHECKS PASSED", lambda name: checks[name]())


if __name__ == "__main__":
    main(sys.argv[1:])
