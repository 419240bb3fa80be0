"""In-place float32 SUM allreduce: distutils_ml against raw mpi4py and torch.distributed/gloo.

Run from the repository root under MPI, one core per rank (2 ranks on this 2-core box)::

    OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_btl=^ofi \\
        .venv/bin/mpiexec -n 2 .venv/bin/python benchmarks/allreduce.py [--sizes 4K,64K,1M,16M,64M]
        [--reps 20] [--warmup 3] [--threads 1] [--json results.json] [--segments 1M,2M,4M,8M]

Contenders (all in the same run, on the same sizes):

* ``mpi4py_numpy``: ``comm.Allreduce(MPI.IN_PLACE, ndarray, op=MPI.SUM)``, the baseline (ratio 1.00);
* ``dml_torch``: ``dml.allreduce(backend, tensor, dml.SUM)`` on a CPU float32 tensor;
* ``dml_numpy``: ``dml.allreduce(backend, ndarray, dml.SUM)``;
* ``gloo``: ``torch.distributed.all_reduce`` with the gloo backend;
* with ``--segments S1,S2..``: ``dml_torch_seg<S>`` and ``dml_numpy_seg<S>``, ``dml.allreduce`` over
  ``dml.MPIBackend(segment_bytes=S)`` (to choose the segment size; 0 = one unsegmented call).

Method (the one of shared/bench): for each size every contender first reduces rank-dependent
data and the result is compared exactly with the expected sum; the buffer is then zeroed so
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
import json
import os
import platform
import socket
import statistics
import sys
import time
import timeit
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

BASE = "mpi4py_numpy"
MAIN = ("mpi4py_numpy", "dml_torch", "dml_numpy", "gloo")
DML = ("dml_torch", "dml_numpy")
UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


# ----------------------------------------------------------------------------- helpers
def parse_bytes(tok: str) -> int:
    """``"4K"``, ``"64KiB"``, ``"16M"`` or a plain byte count, as bytes."""
    t = tok.strip().upper().removesuffix("B").removesuffix("I")
    if t and t[-1] in UNITS:
        return int(float(t[:-1]) * UNITS[t[-1]])
    return int(t)


def fmt_bytes(n: int) -> str:
    """Bytes as ``"64 KiB"`` / ``"16 MiB"`` where exact."""
    for unit, k in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= k and n % k == 0:
            return f"{n // k} {unit}"
    return f"{n} B"


def short_bytes(n: int) -> str:
    """Bytes as ``"4M"`` (for contender names)."""
    return fmt_bytes(n).replace(" ", "").replace("iB", "")


def fmt_time(s: float) -> str:
    """Seconds, human-readable."""
    if s < 1e-3:
        return f"{s * 1e6:.1f} us"
    if s < 1:
        return f"{s * 1e3:.2f} ms"
    return f"{s:.3f} s"


def table(headers: list[str], rows: list[list[str]]) -> str:
    """A GitHub-markdown table, padded for the terminal."""
    w = [max([len(h)] + [len(r[i]) for r in rows]) for i, h in enumerate(headers)]

    def line(cells: list[str]) -> str:
        return "| " + " | ".join(c.ljust(w[i]) for i, c in enumerate(cells)) + " |"

    return "\n".join([line(headers), "|" + "|".join("-" * (x + 2) for x in w) + "|", *(line(r) for r in rows)])


def import_dml() -> Any:
    """``distutils_ml``, from the install or from the checkout this file sits in."""
    try:
        import distutils_ml
    except ImportError:
        sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        import distutils_ml
    return distutils_ml


# ----------------------------------------------------------------------------- context
class Ctx:
    """MPI world, the distutils_ml backend(s) and a lazily created gloo process group."""

    def __init__(self, segments: list[int]) -> None:
        from mpi4py import MPI

        self.MPI = MPI
        self.comm = MPI.COMM_WORLD
        self.rank: int = self.comm.Get_rank()
        self.size: int = self.comm.Get_size()
        self.dml = import_dml()
        self.dml.initialize(self.dml.MPIBackend)
        self.backend = self.dml.get_distributed_backend(self.dml.MPIBackend)
        # Built here, in the same order on every rank: the constructor is collective.
        self.seg_backends = {s: self.dml.MPIBackend(segment_bytes=s) for s in segments}
        self._gloo = False

    def gloo(self) -> None:
        """Start torch.distributed with gloo: rank 0 picks a free port and broadcasts it over MPI."""
        if self._gloo:
            return
        import torch.distributed as dist

        port = None
        if self.rank == 0:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]  # small race window until gloo binds it; fine on a private box
        port = self.comm.bcast(port, root=0)
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ["MASTER_PORT"] = str(port)
        dist.init_process_group("gloo", init_method="env://", rank=self.rank, world_size=self.size)
        self._gloo = True

    def finish(self) -> None:
        """Tear down gloo."""
        if self._gloo:
            import torch.distributed as dist

            dist.destroy_process_group()
            self._gloo = False

    def max_over_ranks(self, xs: list[float]) -> list[float]:
        """Element-wise max of ``xs`` over ranks."""
        a = np.asarray(xs, dtype=np.float64)
        out = np.empty_like(a)
        self.comm.Allreduce(a, out, op=self.MPI.MAX)
        return [float(x) for x in out]

    def log(self, *a: Any) -> None:
        """Print on rank 0."""
        if self.rank == 0:
            print(*a, flush=True)


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
        be = ctx.seg_backends[parse_bytes(seg)] if seg else ctx.backend
        if kind == "numpy":
            a = np.zeros(n, np.float32)
            return Case(lambda: dml.allreduce(be, a, dml.SUM), a)
        t = torch.zeros(n, dtype=torch.float32)
        return Case(lambda: dml.allreduce(be, t, dml.SUM), t.numpy())
    if name == "gloo":
        import torch.distributed as dist

        ctx.gloo()
        t = torch.zeros(n, dtype=torch.float32)
        return Case(lambda: dist.all_reduce(t, op=dist.ReduceOp.SUM), t.numpy())
    raise ValueError(f"unknown contender {name!r}")


# ----------------------------------------------------------------------------- measurement
def median_ratio(ts: list[float], base: list[float]) -> float:
    """Median over repetitions of the within-repetition ratio ts[i] / base[i]."""
    return statistics.median(t / b for t, b in zip(ts, base, strict=True))


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
        ok = bool(np.array_equal(c.buf, expect))
        verified[name] = bool(ctx.comm.allreduce(ok, op=ctx.MPI.LAND))
        if not verified[name]:
            ctx.log(f"!! {name} at {fmt_bytes(nbytes)}: WRONG RESULT")
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
            "ratio": median_ratio(ts, base),
            "ratio_of_medians": med / statistics.median(base),
            "diff_us": statistics.median((t - b) * 1e6 for t, b in zip(ts, base, strict=True)),
            "vs_gloo": median_ratio(ts, times["gloo"]) if "gloo" in times else None,
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


def machine_busy_s() -> float:
    """CPU seconds all processes have used on this machine since boot (``/proc/stat``); nan elsewhere."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return float("nan")
    idle = fields[3] + fields[4]  # idle + iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


class ForeignLoad:
    """CPU time used by OTHER processes while the benchmark runs: the noise this run was exposed to.

    Machine busy time (``/proc/stat``) minus what our ranks used (``os.times``), summed over ranks.
    """

    def __init__(self, ctx: Ctx) -> None:
        self.ctx = ctx
        ctx.comm.Barrier()
        self.t0, self.busy0, self.own0 = time.perf_counter(), machine_busy_s(), self._own()

    @staticmethod
    def _own() -> float:
        t = os.times()
        return t.user + t.system

    def stop(self) -> dict[str, float]:
        """Wall seconds, foreign CPU seconds and foreign share of the machine's cores."""
        own = self.ctx.comm.allreduce(self._own() - self.own0)
        wall = time.perf_counter() - self.t0
        foreign = max(0.0, machine_busy_s() - self.busy0 - own)
        cores = os.cpu_count() or 1
        return {"wall_s": wall, "foreign_cpu_s": foreign, "foreign_share": foreign / (wall * cores)}


def environment(ctx: Ctx) -> dict[str, Any]:
    """Versions, CPU, binding and thread counts (gathered to rank 0)."""
    import mpi4py
    import torch

    cpu = "?"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), "?")
    except OSError:
        pass
    return {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "cpu": cpu,
        "nproc": os.cpu_count(),
        "torch": torch.__version__,
        "mpi4py": mpi4py.__version__,
        "numpy": np.__version__,
        "mpi_library": ctx.MPI.Get_library_version().replace("\x00", "").strip().splitlines()[0],
        "world_size": ctx.size,
        "affinity_per_rank": ctx.comm.gather(sorted(os.sched_getaffinity(0)), root=0),
        "torch_threads_per_rank": ctx.comm.gather(torch.get_num_threads(), root=0),
        "segment_bytes": ctx.backend.segment_bytes,
        "loadavg_start": os.getloadavg(),
        "mca_env": {k: v for k, v in os.environ.items() if k.startswith(("OMPI_MCA", "DML_", "OMP_"))},
    }


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
            out.append((f"{name} within 1.10x of raw at {fmt_bytes(s)}", f"{r:.2f}x", r <= 1.10))
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
                out.append((f"{name} faster than gloo at {fmt_bytes(s)}", f"{g:.3f}x gloo", g < 1.0))
    return out


def report(res: dict[int, dict[str, Any]], names: list[str], args: argparse.Namespace) -> list[tuple[str, str, bool]]:
    """Print one markdown table per size, then the targets block; return the targets."""
    for nbytes, cases in res.items():
        inner = cases[BASE]["inner"]
        print(f"\n### {fmt_bytes(nbytes)} ({args.reps} reps x {inner} op{'s' if inner > 1 else ''})\n")
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
            table(
                ["contender", "median", "min / max", "busbw GB/s", f"t/t({BASE})", "diff vs raw (us)", "check"],
                rows,
            )
        )
    tg = targets(res)
    print("\n### targets (reported, not asserted; ratios = median of within-repetition ratios)\n")
    print(table(["target", "measured", "result"], [[t, m, "PASS" if ok else "MISS"] for t, m, ok in tg]))
    print(f"\n{sum(ok for *_, ok in tg)}/{len(tg)} targets PASS")
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
        "--min-rep-bytes", type=parse_bytes, default=1 << 20, help="small sizes loop up to this many bytes per rep"
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
    segments = [parse_bytes(s) for s in args.segments.split(",") if s.strip()]
    ctx = Ctx(segments)
    names = list(MAIN) + [f"dml_{k}_seg{short_bytes(s)}" for k in ("torch", "numpy") for s in segments]
    if args.only:
        want = {s.strip() for s in args.only.split(",")} | {BASE}
        unknown = want - set(names)
        if unknown:
            ap.error(f"unknown contender(s) {sorted(unknown)}; known: {names}")
        names = [n for n in names if n in want or "_seg" in n]  # --segments contenders are always kept
    sizes = [parse_bytes(s) for s in args.sizes.split(",") if s.strip()]
    env = environment(ctx)
    ctx.log(
        f"# allreduce: {ctx.size} ranks, {env['mpi_library']}, torch {env['torch']}, mpi4py {env['mpi4py']}, "
        f"numpy {env['numpy']}, torch threads/rank {env['torch_threads_per_rank']}, "
        f"affinity {env['affinity_per_rank']}, dml segment_bytes {env['segment_bytes']}, cpu {env['cpu']}, "
        f"load average {env['loadavg_start'][0]:.2f}"
    )

    meter = ForeignLoad(ctx)
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
                table(
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
            with open(args.json, "w") as f:
                json.dump(
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
                    f,
                    indent=1,
                )
            print(f"saved {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
