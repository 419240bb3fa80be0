"""Helpers shared by the benchmark scripts (``allreduce.py``, ``ddp.py``, ``plot.py``).

Not a package: each script puts its own folder first on ``sys.path`` and imports ``common``, so
they still run as ``python benchmarks/<script>.py`` from the repository root. Only the standard
library is imported at module level (``plot.py`` must import without NumPy, torch or MPI).
"""

from __future__ import annotations

import json
import os
import platform
import socket
import statistics
import sys
import time
from typing import Any

UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


# ----------------------------------------------------------------------------- formatting
def parse_bytes(tok: str) -> int:
    """``"4K"``, ``"64KiB"``, ``"16M"``, ``"4MiB"`` or a plain byte count, as bytes."""
    t = tok.strip().upper().removesuffix("B").removesuffix("I")
    if t and t[-1] in UNITS:
        return int(float(t[:-1]) * UNITS[t[-1]])
    return int(t)


def fmt_bytes(n: int) -> str:
    """Bytes as ``"64 KiB"`` / ``"16 MiB"`` where exact (``4096`` -> ``"4 KiB"``)."""
    for unit, k in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= k and n % k == 0:
            return f"{n // k} {unit}"
    return f"{n} B"


def table(headers: list[str], rows: list[list[str]]) -> str:
    """A GitHub-markdown table, padded for the terminal."""
    w = [max([len(h)] + [len(r[i]) for r in rows]) for i, h in enumerate(headers)]  # rows may be empty

    def line(cells: list[str]) -> str:
        return "| " + " | ".join(c.ljust(w[i]) for i, c in enumerate(cells)) + " |"

    return "\n".join([line(headers), "|" + "|".join("-" * (x + 2) for x in w) + "|", *(line(r) for r in rows)])


def print_targets(tg: list[tuple[str, str, bool]], ratios: str) -> None:
    """The targets block: a heading naming how ``ratios`` are taken, the table and the PASS count."""
    print(f"\n### targets (reported, not asserted; ratios = {ratios})\n")
    print(table(["target", "measured", "result"], [[t, m, "PASS" if ok else "MISS"] for t, m, ok in tg]))
    print(f"\n{sum(ok for *_, ok in tg)}/{len(tg)} targets PASS")


#: How the per-step benchmarks (ddp.py, gpu_step.py) compute a ratio, as written into their JSON.
STEP_RATIO_DEFINITION = "median over steps of t(contender)/t(reference) within the same step"


def write_json(path: str, data: dict[str, Any]) -> None:
    """Write a run's results to ``path`` (``--json``) and say so."""
    with open(path, "w") as f:
        json.dump(data, f, indent=1)
    print(f"saved {path}")


# ----------------------------------------------------------------------------- measurement
def median_ratio(ts: list[float], base: list[float]) -> float:
    """Median over repetitions (steps) of the within-repetition ratio ts[i] / base[i]."""
    return statistics.median(t / b for t, b in zip(ts, base, strict=True))


def import_dml() -> Any:
    """``distutils_ml``, from the install or from the checkout this file sits in."""
    try:
        import distutils_ml
    except ImportError:
        sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        import distutils_ml
    return distutils_ml


# ----------------------------------------------------------------------------- MPI world
class MPIWorld:
    """MPI world (rank, size, barrier, gather, max and sum over ranks) and a lazily started gloo group."""

    def __init__(self) -> None:
        from mpi4py import MPI

        self.MPI = MPI
        self.comm = MPI.COMM_WORLD
        self.rank: int = self.comm.Get_rank()
        self.size: int = self.comm.Get_size()
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

    def barrier(self) -> None:
        """MPI barrier."""
        self.comm.Barrier()

    def max_over_ranks(self, xs: list[float]) -> list[float]:
        """Element-wise max of ``xs`` over ranks."""
        import numpy as np

        a = np.asarray(xs, dtype=np.float64)
        out = np.empty_like(a)
        self.comm.Allreduce(a, out, op=self.MPI.MAX)
        return [float(x) for x in out]

    def sum_over_ranks(self, x: float) -> float:
        """Sum of one float over ranks (on every rank)."""
        return self.comm.allreduce(x)

    def gather(self, obj: Any) -> Any:
        """Objects of every rank, on rank 0 (None elsewhere)."""
        return self.comm.gather(obj, root=0)

    def log(self, *a: Any) -> None:
        """Print on rank 0."""
        if self.rank == 0:
            print(*a, flush=True)


# ----------------------------------------------------------------------------- noise meter
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

    def __init__(self, world: MPIWorld) -> None:
        self.world = world
        world.barrier()
        self.t0, self.busy0, self.own0 = time.perf_counter(), machine_busy_s(), self._own()

    @staticmethod
    def _own() -> float:
        t = os.times()
        return t.user + t.system

    def stop(self) -> dict[str, float]:
        """Wall seconds, foreign CPU seconds and foreign share of the machine's cores."""
        own = self.world.sum_over_ranks(self._own() - self.own0)
        wall = time.perf_counter() - self.t0
        foreign = max(0.0, machine_busy_s() - self.busy0 - own)
        cores = os.cpu_count() or 1
        return {"wall_s": wall, "foreign_cpu_s": foreign, "foreign_share": foreign / (wall * cores)}


# ----------------------------------------------------------------------------- environment
def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``), ``?`` where unknown."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), "?")
    except OSError:
        return "?"


def machine() -> dict[str, Any]:
    """Python, platform, CPU model and core count: the first keys of a run's ``env``."""
    return {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "cpu": cpu_model(),
        "nproc": os.cpu_count(),
    }


def mpi_library(MPI: Any) -> str:
    """The first line of the MPI library's version string."""
    return MPI.Get_library_version().replace("\x00", "").strip().splitlines()[0]


def rank_layout(world: MPIWorld) -> dict[str, Any]:
    """World size, CPU affinity and torch threads of every rank (gathered to rank 0)."""
    import torch

    return {
        "world_size": world.size,
        "affinity_per_rank": world.gather(sorted(os.sched_getaffinity(0))),
        "torch_threads_per_rank": world.gather(torch.get_num_threads()),
    }


def run_conditions() -> dict[str, Any]:
    """Load average at start and the MPI/dml/OpenMP environment variables: the last keys of ``env``."""
    return {
        "loadavg_start": os.getloadavg(),
        "mca_env": {k: v for k, v in os.environ.items() if k.startswith(("OMPI_MCA", "DML_", "OMP_"))},
    }


def environment(world: MPIWorld, versions: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    """A run's ``env``: machine, ``versions``, the ranks' layout, ``extra``, then load and environment variables."""
    return {**machine(), **versions, **rank_layout(world), **extra, **run_conditions()}
