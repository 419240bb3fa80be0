"""The MPI side of the tests: run with ``mpiexec -n N python tests/mpi_main.py CHECK...``.

Each CHECK runs on every rank. Property checks use the bodies of tests/bodies.py with
hypothesis derandomized, so every rank draws the same examples; a failing body prints
its rank, case and traceback and aborts the job at once (no shrinking: the other
ranks could not follow it). Rank 0 ends with ``MPI CHECKS PASSED`` when all passed.

``HYPOTHESIS_PROFILE`` (set by tests/mpirun.py to the pytest run's profile): under "dev", every
check draws DEV_EXAMPLES times its examples, from ``DML_HYPOTHESIS_SEED`` (fresh per job, the same
on every rank; rank 0 prints it: set it to replay the job's examples) instead of a fixed seed.
"""

from __future__ import annotations

import contextlib
import faulthandler
import gc
import os
import signal
import sys
import time
import traceback
import zlib
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch
from hypothesis import HealthCheck, Phase, given, seed, settings
from mpi4py import MPI

import distutils_ml as dml

import bodies
import data_bodies
import train_bodies

EXAMPLES = 5  # per collective, dtype and backend; the "matrix" check covers every combination
SETTINGS = settings(
    derandomize=True,
    database=None,
    deadline=None,
    phases=[Phase.generate],
    suppress_health_check=list(HealthCheck),
)
PROFILE = os.environ.get("HYPOTHESIS_PROFILE", "ci")
if PROFILE not in ("ci", "dev"):
    raise SystemExit(f"HYPOTHESIS_PROFILE: got {PROFILE!r}; allowed: 'ci' (the default) or 'dev'")
DEV_EXAMPLES = 4  # dev: this many times each check's examples (the jobs must still end within their timeouts)
EXAMPLE_FACTOR = DEV_EXAMPLES if PROFILE == "dev" else 1
RUN_SEED = int(os.environ.get("DML_HYPOTHESIS_SEED", "0")) if PROFILE == "dev" else 0
if PROFILE == "dev" and MPI.COMM_WORLD.Get_rank() == 0:
    print(f"hypothesis profile dev: DML_HYPOTHESIS_SEED={RUN_SEED} draws these examples again", flush=True)


def fresh_in_dev(test: Any) -> Any:
    """A hypothesis test seeded with this job's DML_HYPOTHESIS_SEED under the dev profile, the same on
    every rank; as it is otherwise (derandomized by SETTINGS)."""
    return seed(RUN_SEED)(test) if PROFILE == "dev" else test


def guarded(fn: Any, *args: Any) -> Any:
    """Run ``fn``; on any failure print rank, arguments and traceback, then abort the job."""
    try:
        return fn(*args)
    except BaseException:
        rank = MPI.COMM_WORLD.Get_rank()
        sys.stderr.write(f"[rank {rank}] CHECK FAILED: {fn.__name__}{args[1:]!r}\n{traceback.format_exc()}")
        sys.stderr.flush()
        MPI.COMM_WORLD.Abort(3)


def property_check(backend: dml.Backend, name: str, label: str, examples: int) -> int:
    """``examples`` random calls of collective ``name`` per dtype; the seed names collective, dtype and backend."""
    count = 0
    for dtype in bodies.DTYPES:

        @seed(zlib.crc32(f"{name}/{dtype}/{label}".encode()) ^ RUN_SEED)
        @settings(SETTINGS, max_examples=examples * EXAMPLE_FACTOR)
        @given(case=bodies.cases(dtype, reduction=name in bodies.REDUCTIONS))
        def run(case: bodies.Case) -> None:
            nonlocal count
            guarded(bodies.BODIES[name], backend, case)
            count += 1

        run()
    return count


def hypothesis_check(backend: dml.Backend, body: Any, strategy: Any, examples: int) -> int:
    count = 0

    @fresh_in_dev
    @settings(SETTINGS, max_examples=examples * EXAMPLE_FACTOR)
    @given(case=strategy)
    def run(case: Any) -> None:
        nonlocal count
        guarded(body, backend, case)
        count += 1

    run()
    return count


@contextlib.contextmanager
def gloo_group(backend: dml.Backend) -> Iterator[list[Any]]:
    """A torch.distributed gloo group over ``backend``'s ranks, torn down with care on leaving.

    Yields a list: append every DDP wrapper (or other holder of the group) to it and keep no
    other reference past the block (the bodies below hold theirs as locals of a function
    called inside it). The list's entries are freed while the group is still alive.
    """
    import datetime

    import torch.distributed as dist

    rank, size = backend.rank, backend.size
    # Rank 0's store binds a free port itself (no probe-then-bind race); the port travels over MPI.
    timeout = datetime.timedelta(seconds=60)
    store = (
        dist.TCPStore("127.0.0.1", 0, size, is_master=True, timeout=timeout, wait_for_workers=False)
        if rank == 0
        else None
    )
    port = backend._bcast_object(store.port if store else None, 0)
    if store is None:
        store = dist.TCPStore("127.0.0.1", port, size, is_master=False, timeout=timeout)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=size, timeout=timeout)
    keep: list[Any] = []  # what holds the group (DDP wrappers), freed in order below
    try:
        yield keep
    except BaseException as e:
        # The failed frames' locals (a body's wrapper, DDP's own ``self``) would outlive the group.
        traceback.clear_frames(e.__traceback__)
        raise
    finally:
        # gloo's teardown can hang (a worker thread blocked in a receive, pytorch#75097) when a
        # rank frees its process group while the other still uses it: finish every gloo operation
        # on both ranks, free the DDP wrappers (their reducers hold the group) while the group is
        # still alive, destroy it on both ranks, and keep rank 0's store up until all are done.
        dist.barrier()
        keep.clear()
        gc.collect()
        dist.destroy_process_group()
        backend._barrier()


def ddp_body(backend: dml.Backend, keep: list[Any], steps: int) -> float:
    """ddp_check's comparison, inside ``gloo_group``; ``keep`` gets the DDP reference models."""
    import torch

    rank, size = backend.rank, backend.size
    worst = 0.0
    # bucket_bytes=0 reduces every gradient in place; the default bucket holds these small ones as views.
    for kind, bucket_bytes in (("sgd", 0), ("adam", 0), ("sgd", 1 << 20), ("adam", 1 << 20)):
        base = train_bodies.make_model(11, hidden=64, bn=False)
        ours = train_bodies.make_model(11, hidden=64, bn=False)
        ddp = torch.nn.parallel.DistributedDataParallel(base)
        keep.append(ddp)
        opt_ddp = train_bodies._optimizer(kind, ddp.parameters())
        opt = dml.DistributedOptimizer(
            backend, train_bodies._optimizer(kind, ours.parameters()), bucket_bytes=bucket_bytes
        )
        g = torch.Generator().manual_seed(5)
        for _ in range(steps):
            x, y = torch.randn(16 * size, 3, generator=g), torch.randn(16 * size, 2, generator=g)
            xs, ys = x[rank::size], y[rank::size]
            for model, o in ((ddp, opt_ddp), (ours, opt)):
                o.zero_grad()
                torch.nn.functional.mse_loss(model(xs), ys).backward()
                o.step()
        for p, q in zip(ours.parameters(), base.parameters(), strict=True):
            worst = max(worst, float((p - q).detach().abs().max()))
    assert worst == 0.0, f"parameters differ from DDP's by up to {worst}"
    return worst


def ddp_check(backend: dml.Backend, steps: int = 5) -> float:
    """Bitwise-identical parameters to torch DistributedDataParallel (gloo) on the same data."""
    with gloo_group(backend) as keep:
        return ddp_body(backend, keep, steps)


def topology_check(world: dml.Backend) -> dict[str, Any]:
    """node_local_rank / node_size agree with the hosts the ranks run on (what GPU placement relies on)."""
    rank = dml.local_rank(world)
    host = MPI.Get_processor_name()
    every = world.comm.allgather((host, world.node_local_rank, world.node_size))
    hosts = [h for h, _, _ in every]
    for r, (h, local, node_size) in enumerate(every):
        peers = [q for q in range(world.size) if hosts[q] == h]
        assert node_size == len(peers), (r, every)
        assert local == peers.index(r), (r, every)  # the ranks of a node, numbered by world rank
    # The default segments: 4 MiB within one node's shared memory, 16 MiB across a network.
    from distutils_ml.backends.mpi import DEFAULT_SEGMENT_BYTES, NETWORK_SEGMENT_BYTES

    one_node = len(set(hosts)) == 1
    assert world.segment_bytes == (DEFAULT_SEGMENT_BYTES if one_node else NETWORK_SEGMENT_BYTES), world.segment_bytes
    # Gradient buckets on CPU: at the end of backward over MPI on one node, 256 KiB; across nodes during backward
    # (overlap) over the TCP ring, 4 MiB (unless DML_OVERLAP / DML_TRANSPORT say otherwise).
    import os

    import torch

    opt = dml.DistributedOptimizer(world, torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1))
    if "DML_OVERLAP" not in os.environ and "DML_TRANSPORT" not in os.environ:
        assert opt.overlap is (not one_node), (opt.overlap, hosts)
        opt._reducer.plan(world)
        assert (opt._reducer._ring is None) is one_node, (opt._reducer._ring, hosts)
    assert opt._reducer.bucket_bytes.host == (256 << 10 if one_node else 4 << 20), opt._reducer.bucket_bytes
    if rank == 0:
        print("TOPOLOGY " + " ".join(f"{r}:{h}:{local}/{n}" for r, (h, local, n) in enumerate(every)), flush=True)
    return {"host": host, "node_local_rank": world.node_local_rank, "node_size": world.node_size}


#: The part of tests/shared_job.py now running ("" in a job of its own): it names the check lines of ``run_checks``.
PART = ""


def run_checks(world: dml.Backend, checks: list[str], banner: str, run_check: Callable[[str], Any]) -> None:
    """``run_check(check)`` for each check, on every rank, with its time and result; rank 0 ends with ``banner``."""
    for check in checks:
        start = time.perf_counter()
        detail = run_check(check)
        named = f"{PART}: " if PART else ""
        dml.print(world, f"{named}check {check} passed in {time.perf_counter() - start:.1f}s: {detail}")
    dml.barrier(world)
    if dml.local_rank(world) == 0:
        print(f"{banner}: {' '.join(checks)} on {world.size} ranks", flush=True)


def main(checks: list[str]) -> None:
    faulthandler.register(signal.SIGUSR1)  # the test runner asks for stacks before killing a hung job
    dml.initialize(dml.MPIBackend)
    world = dml.get_distributed_backend(dml.MPIBackend)
    # The same bodies on a backend with tiny segments exercise the segmented paths.
    tiny = dml.MPIBackend(segment_bytes=16)
    rank = dml.local_rank(world)

    def run_check(check: str) -> Any:
        if check == "properties":
            return {
                f"{name}@{label}": property_check(b, name, label, EXAMPLES)
                for name in bodies.BODIES
                for label, b in (("default", world), ("segment16", tiny))
            }
        elif check == "matrix":
            detail = {label: guarded(bodies.matrix_body, b) for label, b in (("default", world), ("segment16", tiny))}
            assert detail == {"default": bodies.matrix_size(), "segment16": bodies.matrix_size()}, detail
            return detail
        elif check == "synchronize":
            return hypothesis_check(world, train_bodies.synchronize_body, train_bodies.sync_cases(), 15)
        elif check == "train":
            detail = {
                "train": hypothesis_check(world, train_bodies.train_identical_body, train_bodies.train_cases(), 20),
                "unused": guarded(
                    train_bodies.replicas_identical, world, train_bodies.unused_parameters_body(world, 5)
                ),
            }
            guarded(train_bodies.accumulation_body, world, 3)
            guarded(train_bodies.compression_body, world, 1)
            return detail
        elif check == "data":
            return {
                "partition": hypothesis_check(world, data_bodies.partition_body, data_bodies.partition_cases(), 60),
                "access": hypothesis_check(world, data_bodies.access_body, data_bodies.access_cases(), 30),
            }
        elif check == "ddp":
            return guarded(ddp_check, world)
        elif check == "bad_input":
            # First on a debug backend: a stray send from a bad call meets the next good
            # collective's fingerprint exchange and fails at once as CollectiveMismatchError
            # (on the plain backend it would more likely hang until the runner's timeout).
            checker = dml.MPIBackend(debug=True)
            return [
                guarded(bodies.bad_input_body, b, culprit) for b in (checker, world) for culprit in range(world.size)
            ]
        elif check == "large":
            mib = 1024 * 1024
            sizes = [1, 3, 4 * mib // 4 - 1, 4 * mib // 4 + 1, 16 * mib // 8 + 3, 64 * mib // 4 + 5]
            runs = 0
            for n in sizes:
                big = n > 4 * mib  # the 64 MiB case: the ops whose paths differ
                for dtype in ["float32"] if big else ["float32", "float64", "int32", "uint8"]:
                    for op in ("sum", "avg") if big else ("sum", "prod", "max", "min", "avg"):
                        if op == "avg" and not dtype.startswith("float"):
                            continue
                        guarded(bodies.large_body, world, n, dtype, op, runs % 2 == 0)
                        runs += 1
            return runs
        elif check == "tensor_views":
            return {
                label: guarded(bodies.tensor_views_body, b) for label, b in (("default", world), ("segment16", tiny))
            }
        elif check == "segmented":  # 64 MiB: 16 segments of 4 MiB, a NumPy array and a torch tensor
            n = 64 * 1024 * 1024 // 4 + 5
            for op, in_place in (("sum", True), ("avg", False)):
                guarded(bodies.large_body, world, n, "float32", op, in_place)
            tensor = torch.from_numpy(bodies.large_input(n, "float32", "sum", rank))
            dml.allreduce(world, tensor, dml.SUM)
            expected = sum(bodies.large_input(n, "float64", "sum", r) for r in range(world.size))
            np.testing.assert_array_equal(tensor.numpy(), expected)
            return n
        elif check == "subcomm":
            sub = MPI.COMM_WORLD.Split(color=rank % 2, key=rank)
            half = dml.MPIBackend(comm=sub)
            buf = np.array([float(rank)])
            dml.allreduce(half, buf, dml.SUM)
            expected = sum(r for r in range(world.size) if r % 2 == rank % 2)
            assert buf[0] == expected, (buf, expected)
            assert dml.total_workers(half) == sub.Get_size()
            return {"sub_size": half.size}
        elif check == "topology":
            return topology_check(world)
        elif check == "gradients":
            return hypothesis_check(world, train_bodies.gradients_body, train_bodies.train_cases(), 10)
        elif check == "objects":
            got = world._bcast_object({"rank": rank, "x": [1, "two", None, 3.5]} if rank == 1 else None, 1)
            assert got == {"rank": 1, "x": [1, "two", None, 3.5]}, got
            return "ok"
        elif check == "debug":
            checker = dml.MPIBackend(debug=True)
            return [guarded(bodies.mismatch_body, checker, case) for case in bodies.MISMATCHES]
        elif check == "stall":  # the last rank never joins the second allreduce
            watched = dml.MPIBackend(timeout=3)
            dml.allreduce(watched, np.ones(2), dml.SUM)
            if rank == world.size - 1:
                time.sleep(120)
            dml.allreduce(watched, np.ones(4, dtype=np.float32), dml.SUM)
            return "not aborted"
        elif check.startswith("raise_on_rank"):
            culprit = int(check.removeprefix("raise_on_rank"))
            if rank == culprit:
                time.sleep(0.5)
                raise RuntimeError(f"deliberate failure on rank {rank}")
            dml.allreduce(world, np.ones(4), dml.SUM)  # the others wait here until the abort
            return "not aborted"
        raise SystemExit(f"unknown check {check!r}")

    run_checks(world, checks, "MPI CHECKS PASSED", run_check)


if __name__ == "__main__":
    main(sys.argv[1:])
