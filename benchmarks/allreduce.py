"""In-place float32 SUM (and AVG) allreduce: distutils_ml against raw mpi4py and torch.distributed/gloo.

Run from the repository root under MPI, one core per rank (2 ranks on this 2-core box)::

    OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_btl=^ofi \\
        .venv/bin/mpiexec -n 2 .venv/bin/python benchmarks/allreduce.py [--sizes 4K,64K,1M,16M,64M]
        [--reps 20] [--warmup 3] [--threads 1] [--json results.json] [--segments 1M,2M,4M,8M]

Contenders (all in the same run, on the same sizes):

* ``mpi4py_numpy``: ``comm.Allreduce(MPI.IN_PLACE, ndarray, op=MPI.SUM)``, the baseline (ratio 1.00);
* ``dml_torch``: ``dml.allreduce(backend, tensor, dml.SUM)`` on a CPU float32 tensor;
* ``dml_numpy``: ``dml.allreduce(backend, ndarray, dml.SUM)``;
* ``dml_torch_avg``: ``dml.allreduce(backend, tensor, dml.AVG)``, against the same raw SUM (AVG is
  the sum, then one division by the number of ranks);
* ``gloo``: ``torch.distributed.all_reduce`` with the gloo backend;
* with ``--segments S1,S2..``: ``dml_torch_seg<S>`` and ``dml_numpy_seg<S>``, ``dml.allreduce`` over
  ``dml.MPIBackend(segment_bytes=S)`` (to choose the segment size; 0 = one unsegmented call).

Method (the one of shared/bench): for each size every contender first reduces rank-dependent
data and the result is compared exactly with the expected sum (divided by the number of ranks
for AVG, in float32); the buffer is then zeroed so
repeated in-place sums neither overflow nor go denormal. After ``--warmup`` ops come ``--reps``
repetitions; in each one the contenders run in a rotated order, each after a barrier, doing
``inner`` back-to-back ops (``inner`` = 1 MiB / size, 1..100, for small messages). The time of
a repetition is the max over ranks, divided by ``inner``. Reported: the median over
repetitions, and the ratio to ``mpi4py_numpy`` as the MEDIAN OVER REPETITIONS OF THE
WITHIN-REPETITION RATIO (the ratio of medians is in the JSON). The targets block is
reported, never asserted: the script exits 0 when it ran.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import timeit
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/common.py, when run as a script
import common

BASE = "mpi4py_numpy"
MAIN = ("mpi4py_numpy", "dml_torch", "dml_numpy", "dml_torch_avg", "gloo")
DML = ("dml_torch", "dml_numpy", "dml_torch_avg")


# ----------------------------------------------------------------------------- helpers
def short_bytes(n: int) -> str:
    """Bytes as ``"4M"`` (for contender names)."""
    return common.fmt_bytes(n).replace(" ", "").replace("iB", "")


def fmt_time(s: float) -> str:
    """Seconds, human-readable."""
    if s < 1e-3:
        return f"{s * 1e6:.1f} us"
    if s < 1:
        return f"{s * 1e3:.2f} ms"
    return f"{s:.3f} s"


# ----------------------------------------------------------------------------- context
class Ctx(common.MPIWorld):
    """MPI world, the distutils_ml backend(s) and a lazily created gloo process group."""

    def __init__(self, segments: list[int]) -> None:
        super().__init__()
        self.dml = common.import_dml()
        self.dml.initialize(self.dml.MPIBackend)
        self.backend = self.dml.get_distributed_backend(self.dml.MPIBackend)
        # Built here, in the same order on every rank: the constructor is collective.
        self.seg_backends = {s: self.dml.MPIBackend(segment_bytes=s) for s in segments}


# ----------------------------------------------------------------------------- contenders
@dataclass
class Case:
    """One contender at one size: ``op`` reduces the buffer in place; ``buf`` is a NumPy view of it."""

    op: Callable[[], object]
    buf: np.ndarray


def make_case(ctx: Ctx, name: str, n: int) -> Case:
    """The contender ``name`` on a fresh buffer of ``n`` float32."""
    import torch

    MPI, comm, dml = ctx.MPI, ctx.comm, ctx.dml
    if name == "mpi4py_numpy":
        a = np.zeros(n, np.float32)
        return Case(lambda: comm.Allreduce(MPI.IN_PLACE, a, op=MPI.SUM), a)
    if name.startswith(("dml_numpy", "dml_torch")):
        kind, _, seg = name.removeprefix("dml_").partition("_seg")
        be = ctx.seg_backends[common.parse_bytes(seg)] if seg else ctx.backend
        if kind == "numpy":
            a = np.zeros(n, np.float32)
            return Case(lambda: dml.allreduce(be, a, dml.SUM), a)
        t = torch.zeros(n, dtype=torch.float32)
        op = dml.AVG if kind == "torch_avg" else dml.SUM
        return Case(lambda: dml.allreduce(be, t, op), t.numpy())
    if name == "gloo":
        import torch.distributed as dist

        ctx.gloo()
        t = torch.zeros(n, dtype=torch.float32)
        return Case(lambda: dist.all_reduce(t, op=dist.ReduceOp.SUM), t.numpy())
    raise ValueError(f"unknown contender {name!r}")


# ----------------------------------------------------------------------------- measurement
def run_size(ctx: Ctx, names: list[str], nbytes: int, args: argparse.Namespace) -> dict[str, Any]:
    """Verify, warm up and time every contender at one size; per-contender stats (same on all ranks)."""
    n = nbytes // 4
    inner = max(1, min(100, args.min_rep_bytes // nbytes))
    cases = {name: make_case(ctx, name, n) for name in names}
    # Verification: rank r contributes r + 1 + i % 7, so the float32 sum is exact.
    pattern = (np.arange(n) % 7).astype(np.float32)
    expect = sum(r + 1 + pattern for r in range(ctx.size))
    verified: dict[str, bool] = {}
    for name, c in cases.items():
        c.buf[...] = ctx.rank + 1 + pattern
        c.op()
        ok = bool(np.array_equal(c.buf, expect / np.float32(ctx.size) if name.endswith("_avg") else expect))
        verified[name] = bool(ctx.comm.allreduce(ok, op=ctx.MPI.LAND))
        if not verified[name]:
            ctx.log(f"!! {name} at {common.fmt_bytes(nbytes)}: WRONG RESULT")
        c.buf[...] = 0  # zeros stay zeros: no overflow or denormals while timing
    for c in cases.values():
        for _ in range(args.warmup):
            c.op()
    per: dict[str, list[float]] = {name: [] for name in names}
    barrier = ctx.comm.Barrier
    clock = time.perf_counter
    for rep in range(args.reps):
        k = rep % len(names)
        for name in names[k:] + names[:k]:  # rotated order: noise hits every contender alike
            op = cases[name].op
            barrier()
            t0 = clock()
            for _ in range(inner):
                op()
            per[name].append((clock() - t0) / inner)
    busf = 2 * (ctx.size - 1) / ctx.size if ctx.size > 1 else 1.0
    times = {name: ctx.max_over_ranks(per[name]) for name in names}
    base = times[BASE]
    out: dict[str, Any] = {}
    for name in names:
        ts = times[name]
        med = statistics.median(ts)
        out[name] = {
            "verified": verified[name],
            "inner": inner,
            "median_s": med,
            "min_s": min(ts),
            "max_s": max(ts),
            "busbw_GBps": busf * nbytes / med / 1e9,
            "ratio": common.median_ratio(ts, base),
            "ratio_of_medians": med / statistics.median(base),
            "diff_us": statistics.median((t - b) * 1e6 for t, b in zip(ts, base, strict=True)),
            "vs_gloo": common.median_ratio(ts, times["gloo"]) if "gloo" in times else None,
            "times_s": ts,
        }
    return out


def call_overhead(ctx: Ctx, number: int = 2000) -> dict[str, float]:
    """Per-call cost (us) of each API on a 4 KiB buffer over a 1-rank communicator (COMM_SELF).

    With one rank the reduction moves no data, so this is the Python + mpi4py call path alone.
    """
    import torch

    MPI, dml = ctx.MPI, ctx.dml
    be = dml.MPIBackend(comm=MPI.COMM_SELF)
    a = np.zeros(1024, np.float32)
    t = torch.zeros(1024, dtype=torch.float32)
    self_comm = MPI.COMM_SELF
    calls: dict[str, Callable[[], object]] = {
        "mpi4py_numpy": lambda: self_comm.Allreduce(MPI.IN_PLACE, a, op=MPI.SUM),
        "mpi4py_torch_numpyview": lambda: self_comm.Allreduce(MPI.IN_PLACE, t.numpy(), op=MPI.SUM),
        "dml_numpy": lambda: dml.allreduce(be, a, dml.SUM),
        "dml_torch": lambda: dml.allreduce(be, t, dml.SUM),
    }
    out = {}
    for name, fn in calls.items():
        fn()
        out[name] = min(timeit.repeat(fn, number=number, repeat=5)) / number * 1e6
    return out


def environment(ctx: Ctx) -> dict[str, Any]:
    """Versions, CPU, binding and thread counts (gathered to rank 0)."""
    import mpi4py
    import torch

    versions = {
        "torch": torch.__version__,
        "mpi4py": mpi4py.__version__,
        "numpy": np.__version__,
        "mpi_library": common.mpi_library(ctx.MPI),
    }
    return common.environment(ctx, versions, {"segment_bytes": ctx.backend.segment_bytes})


# ----------------------------------------------------------------------------- report
def targets(res: dict[int, dict[str, Any]]) -> list[tuple[str, str, bool]]:
    """(target, measured, passed) for each target that the measured sizes cover."""
    out: list[tuple[str, str, bool]] = []
    mid = [s for s in res if (64 << 10) <= s <= (16 << 20)]
    for name in DML:
        if not all(name in res[s] for s in res):
            continue
        for s in mid:
            r = res[s][name]["ratio"]
            out.append((f"{name} within 1.10x of raw at {common.fmt_bytes(s)}", f"{r:.2f}x", r <= 1.10))
        if 4 << 10 in res:
            d = res[4 << 10][name]["diff_us"]
            out.append((f"{name} within 3 us of raw at 4 KiB", f"{d:+.2f} us", d <= 3.0))
        if 64 << 20 in res:
            r = res[64 << 20][name]["ratio"]
            out.append(
                (f"{name} at 64 MiB >= 2x faster than one raw call", f"{r:.2f}x (= {1 / r:.2f}x faster)", r <= 0.5)
            )
        for s in res:
            g = res[s][name]["vs_gloo"]
            if g is not None:
                out.append((f"{name} faster than gloo at {common.fmt_bytes(s)}", f"{g:.3f}x gloo", g < 1.0))
    return out


def report(res: dict[int, dict[str, Any]], names: list[str], args: argparse.Namespace) -> list[tuple[str, str, bool]]:
    """Print one markdown table per size, then the targets block; return the targets."""
    for nbytes, cases in res.items():
        inner = cases[BASE]["inner"]
        print(f"\n### {common.fmt_bytes(nbytes)} ({args.reps} reps x {inner} op{'s' if inner > 1 else ''})\n")
        rows = []
        for name in names:
            r = cases[name]
            rows.append(
                [
                    name,
                    fmt_time(r["median_s"]),
                    f"{fmt_time(r['min_s'])} / {fmt_time(r['max_s'])}",
                    f"{r['busbw_GBps']:.2f}",
                    f"{r['ratio']:.2f}",
                    f"{r['diff_us']:+.1f}",
                    "ok" if r["verified"] else "WRONG",
                ]
            )
        print(
            common.table(
                ["contender", "median", "min / max", "busbw GB/s", f"t/t({BASE})", "diff vs raw (us)", "check"],
                rows,
            )
        )
    tg = targets(res)
    common.print_targets(tg, "median of within-repetition ratios")
    return tg


# ----------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> int:
    """Parse options, run every size, print the tables and targets on rank 0."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="4K,64K,1M,16M,64M", help="comma-separated message sizes (bytes, K, M)")
    ap.add_argument("--reps", type=int, default=20, help="timed repetitions per size (default 20)")
    ap.add_argument("--warmup", type=int, default=3, help="untimed ops per contender and size (default 3)")
    ap.add_argument("--threads", type=int, default=1, help="torch.set_num_threads per rank (default 1)")
    ap.add_argument(
        "--min-rep-bytes",
        type=common.parse_bytes,
        default=1 << 20,
        help="small sizes loop up to this many bytes per rep",
    )
    ap.add_argument("--only", help=f"comma-separated contenders ({BASE} and --segments ones are always kept)")
    ap.add_argument("--segments", default="", help="add dml_{torch,numpy}_seg<S> contenders, e.g. 1M,2M,4M,8M")
    ap.add_argument("--no-overhead", action="store_true", help="skip the COMM_SELF per-call overhead probe")
    ap.add_argument("--json", metavar="PATH", help="write every result (with per-repetition times) here")
    args = ap.parse_args(argv)
    if args.reps < 1 or args.warmup < 0:
        ap.error("--reps must be >= 1 and --warmup >= 0")

    t_start = time.perf_counter()
    import torch

    torch.set_num_threads(args.threads)
    segments = [common.parse_bytes(s) for s in args.segments.split(",") if s.strip()]
    ctx = Ctx(segments)
    names = list(MAIN) + [f"dml_{k}_seg{short_bytes(s)}" for k in ("torch", "numpy") for s in segments]
    if args.only:
        want = {s.strip() for s in args.only.split(",")} | {BASE}
        unknown = want - set(names)
        if unknown:
            ap.error(f"unknown contender(s) {sorted(unknown)}; known: {names}")
        names = [n for n in names if n in want or "_seg" in n]  # --segments contenders are always kept
    sizes = [common.parse_bytes(s) for s in args.sizes.split(",") if s.strip()]
    env = environment(ctx)
    ctx.log(
        f"# allreduce: {ctx.size} ranks, {env['mpi_library']}, torch {env['torch']}, mpi4py {env['mpi4py']}, "
        f"numpy {env['numpy']}, torch threads/rank {env['torch_threads_per_rank']}, "
        f"affinity {env['affinity_per_rank']}, dml segment_bytes {env['segment_bytes']}, cpu {env['cpu']}, "
        f"load average {env['loadavg_start'][0]:.2f}"
    )

    meter = common.ForeignLoad(ctx)
    res: dict[int, dict[str, Any]] = {}
    for nbytes in sizes:
        res[nbytes] = run_size(ctx, names, nbytes, args)
    foreign = meter.stop()
    overhead = {} if args.no_overhead else call_overhead(ctx)
    ctx.finish()
    elapsed = time.perf_counter() - t_start
    env["loadavg_end"] = os.getloadavg()

    if ctx.rank == 0:
        tg = report(res, names, args)
        if overhead:
            base = overhead["mpi4py_numpy"]
            print("\n### per-call cost on a 1-rank communicator (COMM_SELF, 4 KiB, best of 5 x 2000 calls)\n")
            print(
                common.table(
                    ["call", "us per call", "over raw (us)"],
                    [[k, f"{v:.2f}", f"{v - base:+.2f}"] for k, v in overhead.items()],
                )
            )
        load = ", ".join(f"{x:.2f}" for x in env["loadavg_start"] + env["loadavg_end"][:1])
        print(
            f"\nran in {elapsed:.1f} s (after interpreter start); "
            f"load average 1/5/15 min at start, 1 min at end: {load}"
        )
        print(
            f"other processes used {foreign['foreign_cpu_s']:.2f} CPU s during the {foreign['wall_s']:.1f} s of "
            f"measurements ({100 * foreign['foreign_share']:.0f}% of the machine; "
            "above ~5% the numbers of this run are disturbed)"
        )
        if args.json:
            common.write_json(
                args.json,
                {
                    "env": env,
                    "args": vars(args),
                    "ratio_definition": "median over repetitions of t(contender)/t(mpi4py_numpy) in that rep",
                    "results": {str(s): v for s, v in res.items()},
                    "targets": [{"target": t, "measured": m, "pass": ok} for t, m, ok in tg],
                    "call_overhead_us": overhead,
                    "foreign_load": foreign,
                    "elapsed_s": elapsed,
                },
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
