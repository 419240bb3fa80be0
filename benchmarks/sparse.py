"""Sparse gradients: ``dml.sparse_allreduce`` of an embedding table's sparse gradient against ``dml.allreduce`` of
its dense form.

Run from the repository root under MPI, one core per rank (2 ranks on this 2-core box)::

    OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_btl=^ofi \\
        .venv/bin/mpiexec -n 2 .venv/bin/python benchmarks/sparse.py [--rows 1000000] [--dim 64]
        [--density 0.01] [--reps 20] [--warmup 2] [--json results.json]

The table: ``--rows`` x ``--dim`` float32 (an ``nn.Embedding``'s weight); each rank touches ``density * rows``
random rows, different per rank (seeded by rank), and holds their gradient as ``nn.Embedding(sparse=True)``
does: an uncoalesced COO tensor, indices (1, nnz) in lookup order, values (nnz, dim). Values are small integers,
so the average over ranks is exact in float32 and the two paths must agree bitwise.

Contenders, on the same gradient, averaged (``dml.AVG``):

* ``sparse``: ``dml.sparse_allreduce(backend, grad)`` (local coalesce, an allgather of each rank's entry count,
  an allgather of the entries padded to the largest count, coalesce of every rank's entries);
* ``dense``: ``dml.allreduce(backend, dense, out, dml.AVG)`` of the whole ``rows x dim`` gradient (``grad``
  densified once, before timing: what ``nn.Embedding(sparse=False)`` hands over).

(a) Bytes each rank sends and receives, computed from the message sizes, as a bandwidth-optimal algorithm
moves them (the MPI library picks its own, which may move more): an allgather of blocks of B bytes sends and
receives ``(W - 1) * B`` per rank (ring); an allreduce of N bytes ``2 (W - 1) / W * N`` (ring: reduce-scatter,
then allgather).

(b) Time: after ``--warmup`` untimed rounds come ``--reps`` repetitions; in each, both contenders run, in an
order that alternates, each after a barrier. A contender's time in a repetition is the max over ranks.
Reported: the median over repetitions, and the ratio sparse / dense as the MEDIAN OVER REPETITIONS OF THE
WITHIN-REPETITION RATIO (the ratio of medians is in the JSON too). Before timing, the two results are compared
(``sparse.to_dense()`` against ``out``, exactly); the script exits 1 when they differ. About 10 s on 2 cores
(plus 2-3 s to import torch).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/common.py, when run as a script
import common

INDEX_BYTES = 8  # torch's sparse indices are int64
HEADER_BYTES = 16  # sparse_allreduce's first allgather: (entry count, digest of the call) as two int64


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--rows", type=int, default=1_000_000, help="rows of the embedding table")
    p.add_argument("--dim", type=int, default=64, help="float32 values per row")
    p.add_argument("--density", type=float, default=0.01, help="share of the rows each rank touches")
    p.add_argument("--reps", type=int, default=20, help="timed repetitions")
    p.add_argument("--warmup", type=int, default=2, help="untimed rounds of both contenders")
    p.add_argument("--json", metavar="PATH", help="save everything, every repetition's times included")
    return p.parse_args()


def gradient(rows: int, dim: int, touched: int, rank: int) -> Any:
    """This rank's sparse gradient: ``touched`` distinct random rows, uncoalesced, small-integer values."""
    import torch

    rng = np.random.default_rng([2024, rank])
    hit = rng.choice(rows, size=touched, replace=False)  # in lookup order, not sorted
    values = rng.integers(-4, 5, size=(touched, dim)).astype(np.float32)
    return torch.sparse_coo_tensor(
        torch.from_numpy(hit[None, :].astype(np.int64)), torch.from_numpy(values), (rows, dim), check_invariants=False
    )


def traffic(ranks: int, rows: int, dim: int, counts: list[int]) -> dict[str, Any]:
    """Bytes each rank sends and receives per path (see the module docstring), and the ratio dense / sparse."""
    block = max(counts) * (INDEX_BYTES + 4 * dim)  # one rank's entries, padded to the largest count
    sparse = (ranks - 1) * (HEADER_BYTES + block)
    dense = 2 * (ranks - 1) * rows * dim * 4 // ranks if ranks > 1 else 0
    return {
        "sparse_bytes_per_rank_each_way": sparse,
        "sparse_block_bytes": block,
        "dense_bytes_per_rank_each_way": dense,
        "dense_gradient_bytes": rows * dim * 4,
        "dense_over_sparse": dense / sparse if sparse else None,
        "model": "bandwidth-optimal: allgather (W-1)*block each way, allreduce 2(W-1)/W*N each way",
    }


def main() -> int:
    args = parse()
    world = common.MPIWorld()
    dml = common.import_dml()
    import torch

    torch.set_num_threads(1)
    dml.initialize(dml.MPIBackend)
    backend = dml.get_distributed_backend(dml.MPIBackend)
    rank, ranks = world.rank, world.size
    touched = max(1, round(args.density * args.rows))
    grad = gradient(args.rows, args.dim, touched, rank)
    dense = grad.to_dense()
    out = torch.empty_like(dense)

    reduced = dml.sparse_allreduce(backend, grad)
    dml.allreduce(backend, dense, out, dml.AVG)
    same = bool(torch.equal(reduced.to_dense(), out))
    agree = world.max_over_ranks([0.0 if same else 1.0])[0] == 0.0
    world.log(f"check: sparse_allreduce(...).to_dense() == allreduce(dense) exactly on every rank: {agree}")
    if not agree:
        return 1
    result_nnz = int(reduced.values().shape[0])
    del reduced

    contenders = {
        "sparse": lambda: dml.sparse_allreduce(backend, grad),
        "dense": lambda: dml.allreduce(backend, dense, out, dml.AVG),
    }
    meter = common.ForeignLoad(world)
    times: dict[str, list[float]] = {name: [] for name in contenders}
    for rep in range(args.warmup + args.reps):
        order = list(contenders) if rep % 2 == 0 else list(reversed(contenders))
        took = {}
        for name in order:
            world.barrier()
            start = time.perf_counter()
            contenders[name]()
            took[name] = time.perf_counter() - start
        slowest = world.max_over_ranks([took[name] for name in contenders])
        if rep >= args.warmup:
            for name, t in zip(contenders, slowest, strict=True):
                times[name].append(t)
    foreign = meter.stop()

    counts = [int(c) for c in world.comm.allgather(touched)]
    bytes_ = traffic(ranks, args.rows, args.dim, counts)
    ratio = common.median_ratio(times["sparse"], times["dense"])
    medians = {name: statistics.median(ts) for name, ts in times.items()}
    env = common.environment(world, {"torch": torch.__version__, "numpy": np.__version__}, {})
    if rank != 0:
        return 0
    mib = 1 << 20
    print(
        f"\n## sparse_allreduce vs allreduce of the dense gradient: {args.rows} x {args.dim} float32 "
        f"({bytes_['dense_gradient_bytes'] / mib:.0f} MiB), {touched} rows touched per rank "
        f"({100 * args.density:g} %), {ranks} ranks, AVG\n"
    )
    rows = [
        [
            "sparse_allreduce",
            f"{bytes_['sparse_bytes_per_rank_each_way'] / mib:.2f} MiB",
            f"{medians['sparse'] * 1e3:.2f} ms",
            f"{min(times['sparse']) * 1e3:.2f} / {max(times['sparse']) * 1e3:.2f} ms",
            f"{ratio:.3f}",
        ],
        [
            "allreduce (dense)",
            f"{bytes_['dense_bytes_per_rank_each_way'] / mib:.2f} MiB",
            f"{medians['dense'] * 1e3:.2f} ms",
            f"{min(times['dense']) * 1e3:.2f} / {max(times['dense']) * 1e3:.2f} ms",
            "1.000",
        ],
    ]
    headers = ["path", "bytes per rank, each way", "median time", "min / max", "time / dense"]
    print(common.table(headers, rows))
    dense_over_sparse = bytes_["dense_over_sparse"]
    print(
        f"\ndense / sparse: {dense_over_sparse:.1f}x the bytes, {1 / ratio:.1f}x the time "
        f"(median of per-repetition ratios; ratio of medians {medians['dense'] / medians['sparse']:.1f}x). "
        f"Result: {result_nnz} rows. Other processes' load {100 * foreign['foreign_share']:.0f}%"
        if dense_over_sparse
        else f"\none rank: no bytes move; time / dense {ratio:.3f}"
    )
    if args.json:
        common.write_json(
            args.json,
            {
                "env": env,
                "args": vars(args),
                "touched_rows_per_rank": counts,
                "result_rows": result_nnz,
                "checked_equal": agree,
                "traffic": bytes_,
                "ratio_definition": "median over repetitions of t(sparse)/t(dense) within the same repetition",
                "time_sparse_over_dense": ratio,
                "time_ratio_of_medians": medians["sparse"] / medians["dense"],
                "median_s": medians,
                "times_s": times,
                "foreign_load": foreign,
            },
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
