"""NCCL allreduce bandwidth: ``dml.allreduce`` against the raw CuPy NCCL call, on CUDA tensors (GPU machines).

Run from the repository root, one GPU per rank (about 15 s plus start-up on one H100)::

    mpiexec -n 1 python benchmarks/nccl.py [--sizes 1M,4M,16M,64M,256M,1G] [--reps 20] [--json nccl.json]
    mpiexec -n 2 python benchmarks/nccl.py          # two GPUs

    mpiexec -n 1 python benchmarks/nccl.py --device cpu --sizes 4K,1M   # this script's check without a GPU

Contenders, both reducing the same float32 CUDA tensor in place (SUM) on torch's current stream:

* ``raw_cupy_nccl``: ``backend.nccl_comm.allReduce(ptr, ptr, count, 7, 0, stream)`` (7 = float32, 0 = sum);
* ``dml``: ``dml.allreduce(backend, t, dml.SUM)`` over ``dml.NCCLBackend``.

With ``--device cpu`` (no GPU, no CuPy: checks the measurement, checks and report of this script)
they are ``comm.Allreduce(MPI.IN_PLACE, t.numpy(), MPI.SUM)`` and ``dml.allreduce`` over
``dml.MPIBackend`` on CPU tensors, timed by the wall clock.

Method: per size, each contender's result is first checked exactly (every rank fills the tensor
with rank + 1, the sum is n(n+1)/2), then the tensor is zeroed so repeated in-place sums cannot
overflow. Then ``--warmup`` untimed repetitions and the timed ones; in each the contenders
alternate their order (interleaved: drift hits both alike), each after a barrier, ``inner`` calls
back to back between two CUDA events (``inner`` = 16 MiB / size, 1 to 100), then the end event is
waited for. A repetition's time per call is the max over ranks divided by ``inner``. Big sizes get
fewer repetitions: ``--reps`` up to 64 MiB, ``--reps`` x 64 MiB / size above (at least
``--min-reps``), and never more than fit in about ``--budget-s`` seconds per size.

Columns: the median time per call; algorithm bandwidth ``algbw = bytes / t``; bus bandwidth
``busbw = algbw x 2(n-1)/n`` (NCCL-tests' definition: the bytes each rank's link carries); the ratio
dml / raw, the MEDIAN OVER REPETITIONS OF THE WITHIN-REPETITION RATIO (the ratio of medians is in the
JSON); dml - raw in microseconds (median of per-repetition differences). GB/s are 1e9 bytes per
second. With ONE rank the busbw factor 2(n-1)/n is 0, so busbw is 0 by definition: nothing crosses a
link, and NCCL's in-place allreduce on one rank does no GPU work, so the time is each call's launch
cost and algbw is not a memory bandwidth; the number to read is dml / raw (and dml - raw).

The target (dml / raw <= 1.05) is reported, never asserted. The script exits non-zero when a result
check fails or a time is not positive and finite.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/common.py, when run as a script
import common

TARGET = 1.05  # dml / raw
BIG = 64 << 20  # above this size, fewer repetitions
INNER_BYTES = 16 << 20  # small sizes repeat the call up to this many bytes per repetition
GB = 1e9


# ----------------------------------------------------------------------------- clocks
class CudaClock:
    """Times the GPU work between ``start()`` and ``stop()`` with CUDA events (seconds)."""

    def __init__(self, torch: Any) -> None:
        self.torch = torch
        self.begin = torch.cuda.Event(enable_timing=True)
        self.end = torch.cuda.Event(enable_timing=True)

    def sync(self) -> None:
        """Wait for the device."""
        self.torch.cuda.synchronize()

    def start(self) -> None:
        """Record the start event on the current stream."""
        self.begin.record()

    def stop(self) -> float:
        """Record the end event, wait for it, return the seconds between the events."""
        self.end.record()
        self.end.synchronize()
        return self.begin.elapsed_time(self.end) / 1e3


class WallClock:
    """Wall-clock time between ``start()`` and ``stop()`` (the ``--device cpu`` check)."""

    def sync(self) -> None:
        """Nothing runs asynchronously."""

    def start(self) -> None:
        """Take the start time."""
        self.t0 = time.perf_counter()

    def stop(self) -> float:
        """Seconds since ``start()``."""
        return time.perf_counter() - self.t0


# ----------------------------------------------------------------------------- measurement
def reps_for(size: int, reps: int, min_reps: int) -> int:
    """Repetitions for ``size`` bytes before the time budget: ``reps`` up to 64 MiB, proportionally fewer above."""
    return reps if size <= BIG else max(min_reps, reps * BIG // size)


def inner_for(size: int) -> int:
    """Calls per repetition: 16 MiB worth, 1 to 100."""
    return max(1, min(100, INNER_BYTES // size))


def measure(
    contenders: dict[str, Callable[[], None]],
    clock: Any,
    barrier: Callable[[], None],
    max_over_ranks: Callable[[list[float]], list[float]],
    *,
    size: int,
    reps: int,
    warmup: int,
    min_reps: int,
    budget_s: float,
) -> dict[str, Any]:
    """Interleaved repetitions of every contender; per-call seconds of each repetition (max over ranks).

    The contenders alternate their order every repetition. The last warm-up repetition (``warmup`` >= 1)
    sets how many timed repetitions fit in ``budget_s`` (at least ``min_reps``, at most ``reps``).
    """
    names = list(contenders)
    inner = inner_for(size)
    last: dict[str, float] = {}

    def one_rep(rep: int) -> dict[str, float]:
        out = {}
        for name in names[:: 1 if rep % 2 else -1]:
            fn = contenders[name]
            barrier()
            clock.start()
            for _ in range(inner):
                fn()
            out[name] = clock.stop() / inner
        return out

    clock.sync()
    for rep in range(warmup):
        last = one_rep(rep)
    slowest = max_over_ranks([max(last.values())])[0]  # the last warm-up repetition's slower contender
    fit = math.floor(budget_s / (len(names) * inner * slowest)) if slowest > 0 else reps
    n_reps = max(min_reps, min(reps, fit))
    local: dict[str, list[float]] = {n: [] for n in names}
    for rep in range(n_reps):
        for name, t in one_rep(rep).items():
            local[name].append(t)
    times = {n: max_over_ranks(ts) for n, ts in local.items()}
    bad = {n: [t for t in ts if not (math.isfinite(t) and t > 0)] for n, ts in times.items()}
    bad = {n: b for n, b in bad.items() if b}
    if bad:
        raise RuntimeError(f"size {common.fmt_bytes(size)}: times that are not positive and finite: {bad}")
    return {"inner": inner, "reps": n_reps, "times_s": times}


def summarize(size: int, ranks: int, raw: str, res: dict[str, Any]) -> dict[str, Any]:
    """Medians, algbw, busbw, the ratio dml / raw and dml - raw of one size's measurement."""
    factor = 2 * (ranks - 1) / ranks
    times = res["times_s"]
    per: dict[str, Any] = {}
    for name, ts in times.items():
        med = statistics.median(ts)
        algbw = size / med / GB
        per[name] = {
            "median_s": med,
            "min_s": min(ts),
            "max_s": max(ts),
            "algbw_GBps": algbw,
            "busbw_GBps": algbw * factor,
        }
    return {
        "size": size,
        "inner": res["inner"],
        "reps": res["reps"],
        "busbw_factor": factor,
        "contenders": per,
        "times_s": times,
        "dml_over_raw": common.median_ratio(times["dml"], times[raw]),
        "dml_over_raw_of_medians": per["dml"]["median_s"] / per[raw]["median_s"],
        "dml_minus_raw_us": statistics.median(d - r for d, r in zip(times["dml"], times[raw], strict=True)) * 1e6,
    }


def report(rows: list[dict[str, Any]], ranks: int, raw: str) -> str:
    """The results table (one row per size) and how to read it."""

    def us(s: float) -> str:
        return f"{s * 1e6:.1f}"

    one = ranks == 1
    headers = [
        "size",
        "inner x reps",
        f"{raw} us",
        "dml us",
        f"{raw} algbw GB/s",
        "dml algbw GB/s",
        f"{raw} busbw GB/s",
        "dml busbw GB/s",
        "dml / raw",
        "dml - raw us",
        "target",
    ]
    body = []
    for r in rows:
        c = r["contenders"]
        body.append(
            [
                common.fmt_bytes(r["size"]),
                f"{r['inner']} x {r['reps']}",
                us(c[raw]["median_s"]),
                us(c["dml"]["median_s"]),
                f"{c[raw]['algbw_GBps']:.1f}",
                f"{c['dml']['algbw_GBps']:.1f}",
                "0 (n=1)" if one else f"{c[raw]['busbw_GBps']:.1f}",
                "0 (n=1)" if one else f"{c['dml']['busbw_GBps']:.1f}",
                f"{r['dml_over_raw']:.3f}",
                f"{r['dml_minus_raw_us']:+.1f}",
                f"{'PASS' if r['dml_over_raw'] <= TARGET else 'MISS'} (<= {TARGET})",
            ]
        )
    notes = [
        "times: median per call; algbw = bytes / time; busbw = algbw x 2(n-1)/n; GB/s = 1e9 B/s; dml / raw = median "
        "over repetitions of the within-repetition ratio; dml - raw = median of per-repetition differences; targets "
        "are reported, not asserted"
    ]
    if one:
        nop = (
            "NCCL's in-place allreduce on one rank launches no GPU work"
            if raw == "raw_cupy_nccl"
            else "an in-place allreduce on one rank moves no data"
        )
        notes.append(
            f"1 rank: the busbw factor 2(n-1)/n is 0, so busbw is 0 by definition (no link is crossed); {nop}, so the "
            "times are the calls' own costs and algbw is not a bandwidth: read dml / raw and dml - raw (our per-call "
            "overhead)"
        )
    return common.table(headers, body) + "\n\n" + "\n".join(notes)


# ----------------------------------------------------------------------------- setup
def setup(device: str) -> tuple[Any, Any, str, Any, dict[str, Any]]:
    """``(dml, backend, raw contender's name, clock, versions)`` for ``device`` (cuda: NCCL, cpu: MPI)."""
    import torch

    dml = common.import_dml()
    versions: dict[str, Any] = {"torch": torch.__version__}
    if device == "cpu":
        dml.initialize(dml.MPIBackend)
        return dml, dml.get_distributed_backend(dml.MPIBackend), "raw_mpi4py", WallClock(), versions
    dml.initialize(dml.NCCLBackend)
    backend = dml.get_distributed_backend(dml.NCCLBackend)
    import cupy

    versions.update(
        torch_cuda=torch.version.cuda,
        cupy=cupy.__version__,
        nccl=backend.nccl_version,
        gpu=torch.cuda.get_device_name(backend.device),
    )
    return dml, backend, "raw_cupy_nccl", CudaClock(torch), versions


def make_contenders(dml: Any, backend: Any, raw: str, t: Any) -> dict[str, Callable[[], None]]:
    """The raw call and ``dml.allreduce`` on tensor ``t``, in place, as argument-less callables."""
    if raw == "raw_mpi4py":
        from mpi4py import MPI

        comm, arr = backend.comm, t.numpy()

        def raw_call() -> None:
            comm.Allreduce(MPI.IN_PLACE, arr, op=MPI.SUM)

    else:
        import torch

        comm, ptr, count = backend.nccl_comm, t.data_ptr(), t.numel()
        stream = torch.cuda.current_stream(t.device).cuda_stream

        def raw_call() -> None:
            comm.allReduce(ptr, ptr, count, 7, 0, stream)  # 7: ncclFloat32, 0: ncclSum

    def dml_call() -> None:
        dml.allreduce(backend, t, dml.SUM)

    return {raw: raw_call, "dml": dml_call}


def check_results(
    dml: Any, backend: Any, contenders: dict[str, Callable[[], None]], *, t: Any, clock: Any, size: int
) -> None:
    """One call of each contender on a tensor of rank + 1 must give n(n+1)/2 everywhere, on every rank.

    Leaves the tensor zeroed, so that repeated in-place sums cannot overflow. Raises on every rank.
    """
    import numpy as np

    n, rank = dml.total_workers(backend), dml.local_rank(backend)
    want = n * (n + 1) / 2
    for name, fn in contenders.items():
        t.fill_(rank + 1)
        fn()
        clock.sync()
        lo, hi = float(t.min()), float(t.max())
        ok = dml.allreduce(backend, np.array([lo == want == hi], dtype=np.int32), dml.MIN)
        if not ok[0]:
            raise RuntimeError(
                f"{name} at {common.fmt_bytes(size)}: the allreduce of rank + 1 over {n} ranks is wrong on some "
                f"rank (this rank {rank}: values in [{lo}, {hi}]); expected {want} everywhere on every rank"
            )
    t.zero_()
    clock.sync()


# ----------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> int:
    """Parse options, measure every size, print the table on rank 0."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="1M,4M,16M,64M,256M,1G", help="message sizes, bytes or K/M/G suffix")
    ap.add_argument("--reps", type=int, default=20, help="timed repetitions up to 64 MiB (default 20)")
    ap.add_argument("--min-reps", type=int, default=5, help="fewest timed repetitions at any size (default 5)")
    ap.add_argument("--warmup", type=int, default=3, help="untimed repetitions per size (default 3)")
    ap.add_argument("--budget-s", type=float, default=4.0, help="about this many seconds per size at most (4)")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda", help="cpu: this script's check on MPI")
    ap.add_argument("--json", metavar="PATH", help="write every result (with per-repetition times) here")
    args = ap.parse_args(argv)
    if args.reps < 1 or args.min_reps < 1 or args.warmup < 1 or args.budget_s <= 0:
        ap.error("--reps, --min-reps and --warmup must be >= 1 and --budget-s > 0")
    sizes = [common.parse_bytes(s) for s in args.sizes.split(",") if s.strip()]
    if not sizes or any(s < 4 or s % 4 for s in sizes):
        ap.error(f"--sizes: got {args.sizes!r}; give sizes that are positive multiples of 4 bytes (float32)")

    t_start = time.perf_counter()
    import numpy as np
    import torch

    dml, backend, raw, clock, versions = setup(args.device)
    rank, ranks = dml.local_rank(backend), dml.total_workers(backend)

    def max_over_ranks(xs: list[float]) -> list[float]:
        return [float(x) for x in dml.allreduce(backend, np.asarray(xs, dtype=np.float64), dml.MAX)]

    if rank == 0:
        print(f"# nccl: {ranks} rank(s), device {args.device}, " + ", ".join(f"{k} {v}" for k, v in versions.items()))
    rows = []
    for size in sizes:
        t = torch.empty(size // 4, dtype=torch.float32, device=args.device)
        contenders = make_contenders(dml, backend, raw, t)
        check_results(dml, backend, contenders, t=t, clock=clock, size=size)
        res = measure(
            contenders,
            clock,
            lambda: dml.barrier(backend),
            max_over_ranks,
            size=size,
            reps=reps_for(size, args.reps, args.min_reps),
            warmup=args.warmup,
            min_reps=args.min_reps,
            budget_s=args.budget_s,
        )
        check_results(dml, backend, contenders, t=t, clock=clock, size=size)  # the timed calls broke nothing
        rows.append(summarize(size, ranks, raw, res))
        del contenders, t
    elapsed = time.perf_counter() - t_start
    if rank != 0:
        return 0
    print(report(rows, ranks, raw))
    print(f"\nran in {elapsed:.1f} s")
    if args.json:
        env = {**common.machine(), **versions, "world_size": ranks, "device": args.device}
        common.write_json(args.json, {"env": env, "args": vars(args), "results": rows, "elapsed_s": elapsed})
    return 0


if __name__ == "__main__":
    sys.exit(main())
