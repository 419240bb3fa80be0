"""Object collectives on values that hold tensors and arrays: ``dml.bcast_object`` and ``dml.allgather_object``
against mpi4py's pickle-based ``comm.bcast`` / ``comm.allgather`` and its ``pkl5`` ones (pickle protocol 5, NumPy
buffers out of band), interleaved in a rotated order in one job::

    OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_btl=^ofi \\
        .venv/bin/mpiexec -n 2 .venv/bin/python benchmarks/objects.py [--mib 256] [--reps 3] [--json PATH]

Values: ``tensors`` (one CPU float32 tensor of ``--mib`` MiB and 200 small ones, as a checkpoint holds) and
``arrays`` (the same as NumPy arrays). A broadcast sends rank 0's value; an allgather, every rank's of
``--mib`` / size MiB. Every contender's result is checked against the value sent. Prints the median time of
each (on the slowest rank: the table, and ``table_s`` in the JSON) and its ratio to mpi4py's pickle.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import torch
from mpi4py import MPI
from mpi4py.util import pkl5

import distutils_ml as dml


def value(kind: str, mib: float, seed: int) -> dict[str, Any]:
    big = torch.full((int(mib * 2**20) // 4,), float(seed))
    small = [torch.full((64,), float(seed + k)) for k in range(200)]
    if kind == "arrays":
        return {"big": big.numpy(), "small": [s.numpy() for s in small], "seed": seed}
    return {"big": big, "small": small, "seed": seed}


def check(got: dict[str, Any], seed: int) -> None:
    assert got["seed"] == seed and float(got["big"][-1]) == seed and float(got["small"][-1][0]) == seed + 199


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=float, default=256)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    dml.initialize(dml.MPIBackend)
    backend = dml.get_distributed_backend(dml.MPIBackend)
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    comm5 = pkl5.Intracomm(comm)
    bcasts = {
        "mpi4py_pickle": lambda v: comm.bcast(v, root=0),
        "mpi4py_pkl5": lambda v: comm5.bcast(v, root=0),
        "dml": lambda v: dml.bcast_object(backend, v, root=0),
    }
    gathers = {
        "mpi4py_pickle": comm.allgather,
        "mpi4py_pkl5": comm5.allgather,
        "dml": lambda v: dml.allgather_object(backend, v),
    }
    times: dict[str, list[float]] = {}
    for rep in range(args.reps):
        for kind in ("tensors", "arrays"):
            names = list(bcasts)
            names = names[rep % len(names) :] + names[: rep % len(names)]  # rotated: each goes first in turn
            for name in names:
                mine = value(kind, args.mib, 7) if rank == 0 else None
                comm.Barrier()
                t0 = time.perf_counter()
                got = bcasts[name](mine)
                times.setdefault(f"bcast {kind} {name}", []).append(time.perf_counter() - t0)
                check(got, 7)
                del got, mine
                mine = value(kind, args.mib / size, rank)
                comm.Barrier()
                t0 = time.perf_counter()
                every = gathers[name](mine)
                times.setdefault(f"allgather {kind} {name}", []).append(time.perf_counter() - t0)
                for r, got in enumerate(every):
                    check(got, r)
                del every, mine
    slowest = {k: max(comm.allgather(statistics.median(v))) for k, v in times.items()}  # the last rank to finish
    if rank == 0:
        print(f"{size} ranks, {args.mib:g} MiB per broadcast and per allgather in all, median of {args.reps}")
        print("| call | value | mpi4py pickle | mpi4py pkl5 | dml | dml / pickle | dml / pkl5 |")
        print("|---|---|---|---|---|---|---|")
        for call in ("bcast", "allgather"):
            for kind in ("tensors", "arrays"):
                p, p5, d = (slowest[f"{call} {kind} {n}"] for n in ("mpi4py_pickle", "mpi4py_pkl5", "dml"))
                print(f"| {call} | {kind} | {p:.3f} s | {p5:.3f} s | {d:.3f} s | {d / p:.2f} | {d / p5:.2f} |")
        if args.json:
            with open(args.json, "w", encoding="utf-8") as f:
                out = {"ranks": size, "mib": args.mib, "reps": args.reps, "rank0_times_s": times, "table_s": slowest}
                json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
