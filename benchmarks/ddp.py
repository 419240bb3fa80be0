"""Data-parallel training steps: distutils_ml's DistributedOptimizer against torch DDP and hand-written loops.

Run from the repository root, 2 ranks on this 2-core box (one core and one torch thread each)::

    OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_btl=^ofi \\
        .venv/bin/mpiexec -n 2 .venv/bin/python benchmarks/ddp.py [--models mlp2m,deep36,mlp25m]
        [--steps 20] [--warmup 3] [--batch 64] [--threads 1] [--opt sgd|adam] [--lr 0.01]
        [--only a,b] [--dml-buckets 0,64K,1M,4M] [--json results.json]

The single-process reference (no MPI: ONE process, 2 threads, the whole global batch of
``batch x ranks`` = 128 samples), to be compared with the 2-rank contenders::

    .venv/bin/python benchmarks/ddp.py --serial --threads 2

Contenders (every one trains its own copy of the same model, same initial weights, same data):

* ``ideal_local``: forward + backward + optimizer step on this rank's 64 samples, no communication;
  the data-parallel lower bound (its parameters diverge across ranks by design);
* ``ddp_gloo``: ``torch.nn.parallel.DistributedDataParallel`` over gloo, default settings
  (25 MiB buckets, allreduce overlapped with backward);
* ``naive_mpi4py``: after backward, one ``comm.Allreduce(MPI.IN_PLACE, p.grad.numpy(), MPI.SUM)`` per
  parameter, then ``p.grad.div_(n)``; the best peer in shared/bench/RESULTS.md section 4;
* ``gradview_mpi4py_chunk4M``: every ``.grad`` is a view of one flat buffer (backward accumulates into
  it, zero copies), reduced in 4 MiB chunks, then divided;
* ``dml``: ``dml.DistributedOptimizer(backend, opt).step()`` over ``dml.MPIBackend`` (defaults:
  256 KiB bucket threshold, 4 MiB segments); ``--dml-buckets S1,S2`` adds ``dml_bb<S>`` with
  ``bucket_bytes=S``. Its "explicit comm" column is the time inside the optimizer's gradient
  reduction (a timer wrapped around ``dopt._reducer.reduce``; the call path is the user's ``step()``).
* with ``--only``: ``dml_overlap`` / ``dml_end`` (``overlap=True`` / ``False`` forced), ``dml_shard``
  (``DistributedOptimizer(backend, opt, shard_state=True)``: ZeRO-1, reduce-scatter + allgather) and
  ``dml_sdb`` (``step_during_backward=True``: each bucket stepped as its reduction lands),
  ``dml_shard_sdb`` (both: each bucket's shard stepped and allgathered as its reduce-scatter lands) and
  ``zero_gloo`` (DDP over gloo with torch's ``ZeroRedundancyOptimizer``). Each contender's optimizer
  state per rank (bytes of the tensors in the state of the optimizer that steps) is printed and in
  the JSON (``state_bytes_max_rank``).

Method (the one of shared/bench/ddp_peers.py): each step draws one global batch of
``batch x ranks`` samples and rank r takes slice r. The contenders run one step each, in an order
rotated every step, each after a barrier; a step's time is the max over ranks. Per contender:
the median over the timed steps. Ratios (``t/t(ddp_gloo)``, ``t/t(best loop)``) are the MEDIAN
OVER STEPS OF THE WITHIN-STEP RATIO, so machine noise common to one step cancels; the ratio of
medians is in the JSON. ``comm share`` = (t - t(ideal_local)) / t on medians. Correctness:
``maxdiff ranks`` = max |param - rank 0's param| at the end (must be 0 for a data-parallel
contender), ``maxdiff vs ddp_gloo`` = max |param - ddp_gloo's param| on the same rank.
The targets block is reported, never asserted: the script exits 0 when it ran.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/common.py, when run as a script
import common

BASE = "ddp_gloo"
LOOPS = ("naive_mpi4py", "gradview_mpi4py_chunk4M")
CONTENDERS = ("ideal_local", "ddp_gloo", "naive_mpi4py", "gradview_mpi4py_chunk4M", "dml_after", "dml")
# with --only: DistributedOptimizer with overlap=True / False; sharded state (ZeRO-1) against torch's
# ZeroRedundancyOptimizer over DDP-gloo
EXTRA_CONTENDERS = ("dml_overlap", "dml_end", "dml_shard", "dml_sdb", "dml_shard_sdb", "zero_gloo")
# name -> Linear widths, ReLU between (none after the last); the models of shared/bench/ddp_peers.py.
MODELS: dict[str, list[int]] = {
    "mlp2m": [784, 1024, 1024, 10],  # 1.86 M params, 6 tensors
    "deep36": [784] + [256] * 17 + [10],  # 1.26 M params, 36 tensors (18 Linear layers)
    "mlp25m": [784, 4096, 4096, 1024, 10],  # 24.2 M params, 8 tensors
}
# Targets for the default dml contender: (max t/t(ddp_gloo), max t/t(best hand-written loop)).
TARGETS: dict[str, tuple[float, float]] = {"mlp2m": (0.75, 1.05), "deep36": (0.75, 1.05), "mlp25m": (0.90, 1.05)}


# ----------------------------------------------------------------------------- helpers
def short_bytes(n: int) -> str:
    """Bytes as ``"64K"`` / ``"4M"`` where exact (for contender names)."""
    for unit, k in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if n >= k and n % k == 0:
            return f"{n // k}{unit}"
    return str(n)


def fmt_time(s: float | None) -> str:
    """Seconds, human-readable; ``-`` for None."""
    if s is None or np.isnan(s):
        return "-"
    if s < 1e-3:
        return f"{s * 1e6:.0f} us"
    if s < 1:
        return f"{s * 1e3:.2f} ms"
    return f"{s:.3f} s"


def build_model(widths: list[int]) -> Any:
    """Linear layers of the given widths with ReLU between them."""
    import torch

    layers: list[torch.nn.Module] = []
    for i in range(len(widths) - 1):
        layers.append(torch.nn.Linear(widths[i], widths[i + 1]))
        if i < len(widths) - 2:
            layers.append(torch.nn.ReLU())
    return torch.nn.Sequential(*layers)


def flat_params(model: Any) -> np.ndarray:
    """All parameters of ``model`` as one float64 vector."""
    import torch

    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).double().numpy()


# ----------------------------------------------------------------------------- worlds
class World(common.MPIWorld):
    """MPI world (rank, size, barrier, max over ranks), a lazily started gloo group and the dml backend."""

    def __init__(self) -> None:
        super().__init__()
        self._backend: Any = None

    def dml_backend(self) -> tuple[Any, Any]:
        """``(dml, backend)``: the package and its MPIBackend over COMM_WORLD."""
        dml = common.import_dml()
        if self._backend is None:
            dml.initialize(dml.MPIBackend)
            self._backend = dml.get_distributed_backend(dml.MPIBackend)
        return dml, self._backend

    def allmax(self, x: float) -> float:
        """Max of one float over ranks."""
        return self.max_over_ranks([x])[0]


class Solo(World):
    """A world of one process without MPI (the ``--serial`` reference)."""

    def __init__(self) -> None:  # no MPI_Init at all
        self.rank, self.size = 0, 1

    def barrier(self) -> None:
        """Nothing to wait for."""

    def max_over_ranks(self, xs: list[float]) -> list[float]:
        """``xs`` itself."""
        return [float(x) for x in xs]

    def sum_over_ranks(self, x: float) -> float:
        """``x`` itself."""
        return x

    def gather(self, obj: Any) -> Any:
        """``[obj]``."""
        return [obj]

    def finish(self) -> None:
        """Nothing to tear down."""


# ----------------------------------------------------------------------------- contenders
@dataclass
class Batch:
    """One step's data: this rank's slice and the global batch."""

    x_local: Any
    y_local: Any
    x_global: Any
    y_global: Any


@dataclass
class Trainer:
    """One contender: ``step(batch)`` does one optimisation step, optionally returning its explicit comm seconds."""

    step: Callable[[Batch], float | None]
    module: Any
    mode: str = "dp"  # dp: gradients averaged over ranks | local: no communication | serial: one process
    note: str = ""
    #: bytes of optimizer state this rank holds (tensors in the stepping optimizer's state)
    state_bytes: Callable[[], int] | None = None


def state_bytes(opt: Any) -> int:
    """Bytes of the tensors in ``opt.state`` (the optimizer state this rank holds)."""
    import torch

    return sum(t.nbytes for st in opt.state.values() for t in st.values() if isinstance(t, torch.Tensor))


def make_trainer(world: World, name: str, make: Callable[[], tuple[Any, Any]]) -> Trainer:
    """The contender ``name`` on a fresh model + optimizer from ``make()``."""
    import torch
    import torch.nn.functional as F

    clock = time.perf_counter
    model, opt = make()
    params = [p for p in model.parameters() if p.requires_grad]

    def fwd_bwd(x: Any, y: Any) -> None:
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y).backward()

    if name in ("ideal_local", "serial_global"):
        local = name == "ideal_local"

        def step_local(b: Batch) -> None:
            if local:
                fwd_bwd(b.x_local, b.y_local)
            else:
                fwd_bwd(b.x_global, b.y_global)
            opt.step()

        return Trainer(step_local, model, "local" if local else "serial")

    if name == "ddp_gloo":
        from torch.nn.parallel import DistributedDataParallel as DDP

        world.gloo()
        ddp = DDP(model)  # default bucket_cap_mb=25; the allreduce overlaps backward

        def step_ddp(b: Batch) -> None:
            opt.zero_grad(set_to_none=True)
            F.cross_entropy(ddp(b.x_local), b.y_local).backward()
            opt.step()

        return Trainer(step_ddp, model, note="bucket_cap_mb=25 (default)", state_bytes=lambda: state_bytes(opt))

    if name == "zero_gloo":
        from torch.distributed.optim import ZeroRedundancyOptimizer
        from torch.nn.parallel import DistributedDataParallel as DDP

        world.gloo()
        ddp = DDP(model)
        zero = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=type(opt), **opt.defaults)

        def step_zero(b: Batch) -> None:
            zero.zero_grad(set_to_none=True)
            F.cross_entropy(ddp(b.x_local), b.y_local).backward()
            zero.step()

        return Trainer(
            step_zero, model, note="DDP + ZeroRedundancyOptimizer", state_bytes=lambda: state_bytes(zero.optim)
        )

    MPI, comm, n = world.MPI, world.comm, world.size
    if name == "naive_mpi4py":

        def step_naive(b: Batch) -> float:
            fwd_bwd(b.x_local, b.y_local)
            t0 = clock()
            for p in params:
                comm.Allreduce(MPI.IN_PLACE, p.grad.numpy(), op=MPI.SUM)
                p.grad.div_(n)
            t1 = clock()
            opt.step()
            return t1 - t0

        return Trainer(step_naive, model, note=f"{len(params)} Allreduce/step")

    if name == "gradview_mpi4py_chunk4M":
        flat = torch.zeros(sum(p.numel() for p in params))
        off = 0
        for p in params:
            p.grad = flat[off : off + p.numel()].view_as(p)  # backward accumulates into the view in place
            off += p.numel()
        fnp = flat.numpy()
        step_el = (4 << 20) // 4
        chunks = [fnp[i : i + step_el] for i in range(0, fnp.size, step_el)]

        def step_gradview(b: Batch) -> float:
            flat.zero_()  # not zero_grad(set_to_none=True): that would drop the views
            F.cross_entropy(model(b.x_local), b.y_local).backward()
            t0 = clock()
            for c in chunks:
                comm.Allreduce(MPI.IN_PLACE, c, op=MPI.SUM)
            flat.div_(n)
            t1 = clock()
            opt.step()
            return t1 - t0

        return Trainer(step_gradview, model, note=f"{len(chunks)} Allreduce/step")

    if name == "dml_after":  # the reduction after backward, in step (DistributedOptimizer before issue 13)
        dml, backend = world.dml_backend()

        def step_after(b: Batch) -> None:
            fwd_bwd(b.x_local, b.y_local)
            dml.allreduce_gradients(backend, model)
            opt.step()

        return Trainer(step_after, model, note="allreduce_gradients, then step")

    if name in ("dml", "dml_overlap", "dml_end", "dml_shard", "dml_sdb", "dml_shard_sdb") or name.startswith("dml_bb"):
        dml, backend = world.dml_backend()
        kw: dict[str, Any] = {}
        if name.startswith("dml_bb"):
            kw["bucket_bytes"] = common.parse_bytes(name.removeprefix("dml_bb"))
        elif name in ("dml_shard", "dml_sdb", "dml_shard_sdb"):
            kw["shard_state"] = name != "dml_sdb"
            kw["step_during_backward"] = name != "dml_shard"
        elif name != "dml":
            kw["overlap"] = name == "dml_overlap"
        dopt = dml.DistributedOptimizer(backend, opt, **kw)
        spent = [0.0]
        reducer = getattr(dopt, "_reducer", None)  # private: only to time the reduction inside step()
        if reducer is not None:
            reduce = reducer.reduce

            def timed_reduce(*args: Any) -> None:
                t0 = clock()
                reduce(*args)
                spent[0] += clock() - t0

            reducer.reduce = timed_reduce

        def step_dml(b: Batch) -> float | None:
            dopt.zero_grad()
            F.cross_entropy(model(b.x_local), b.y_local).backward()
            spent[0] = 0.0
            dopt.step()
            return spent[0] if reducer is not None else None

        bb = getattr(reducer, "bucket_bytes", getattr(dopt, "_bucket_bytes", None))
        seg = getattr(backend, "segment_bytes", None)
        stepping = getattr(dopt, "shard_optimizer", opt)
        return Trainer(
            step_dml,
            model,
            note=f"bucket_bytes={bb}, segment_bytes={seg}, overlap={dopt.overlap}",
            state_bytes=lambda: state_bytes(stepping),
        )

    raise ValueError(f"unknown contender {name!r}")


# ----------------------------------------------------------------------------- measurement
def run_model(world: World, model_name: str, names: list[str], args: argparse.Namespace) -> dict[str, Any]:
    """Build every contender on ``model_name``, run the interleaved steps, return times and correctness."""
    import torch

    widths = MODELS[model_name]
    torch.manual_seed(args.seed)
    proto = build_model(widths)
    init = copy.deepcopy(proto.state_dict())

    def make() -> tuple[Any, Any]:
        m = build_model(widths)
        m.load_state_dict(init)
        if args.opt == "sgd":
            return m, torch.optim.SGD(m.parameters(), lr=args.lr, momentum=0.9)
        return m, torch.optim.Adam(m.parameters(), lr=args.lr)

    trainers: dict[str, Trainer] = {}
    for name in names:
        world.barrier()
        trainers[name] = make_trainer(world, name, make)

    ranks = args.ranks if isinstance(world, Solo) else world.size
    G = args.batch * ranks
    times: dict[str, list[float]] = {k: [] for k in names}
    comm: dict[str, list[float]] = {k: [] for k in names}
    clock = time.perf_counter
    lo, hi = world.rank * args.batch, (world.rank + 1) * args.batch
    for s in range(args.warmup + args.steps):
        g = torch.Generator().manual_seed(args.seed * 100003 + s)
        xg = torch.randn(G, widths[0], generator=g)
        yg = torch.randint(0, widths[-1], (G,), generator=g)
        b = Batch(xg[lo:hi], yg[lo:hi], xg, yg)
        k = s % len(names)
        for name in names[k:] + names[:k]:  # rotated order: noise hits every contender alike
            step = trainers[name].step
            world.barrier()
            t0 = clock()
            c = step(b)
            dt = clock() - t0
            if s >= args.warmup:
                times[name].append(dt)
                if c is not None:
                    comm[name].append(c)

    out: dict[str, Any] = {
        "model": model_name,
        "widths": widths,
        "nparams": sum(p.numel() for p in proto.parameters()),
        "ntensors": len(list(proto.parameters())),
        "global_batch": G,
        "contenders": {},
    }
    ref = flat_params(trainers[BASE].module) if BASE in trainers else None
    for name in names:
        tr = trainers[name]
        ts = world.max_over_ranks(times[name])
        cs = world.max_over_ranks(comm[name]) if comm[name] else []
        p = flat_params(tr.module)
        r: dict[str, Any] = {"mode": tr.mode, "note": tr.note, "times_s": ts, "comm_s": cs}
        if tr.mode == "dp":
            p0 = p.copy()
            world.comm.Bcast(p0, root=0)
            r["maxdiff_ranks"] = world.allmax(float(np.max(np.abs(p - p0))))
            r[f"maxdiff_vs_{BASE}"] = world.allmax(float(np.max(np.abs(p - ref)))) if ref is not None else None
        r["param_absmax"] = float(np.max(np.abs(p)))
        if tr.state_bytes is not None:
            r["state_bytes_max_rank"] = world.allmax(float(tr.state_bytes()))
        out["contenders"][name] = r
    summarize(out)
    return out


def summarize(res: dict[str, Any]) -> None:
    """Add medians, paired ratios, comm share and the best hand-written loop to a model's result."""
    cs = res["contenders"]
    for r in cs.values():
        ts = r["times_s"]
        r.update(median_s=statistics.median(ts), min_s=min(ts), max_s=max(ts))
        r["comm_median_s"] = statistics.median(r["comm_s"]) if r["comm_s"] else None
    loops = [n for n in LOOPS if n in cs]
    best = min(loops, key=lambda n: cs[n]["median_s"]) if loops else None
    res["best_loop"] = best
    t_ideal = cs["ideal_local"]["median_s"] if "ideal_local" in cs else None
    for r in cs.values():
        t = r["median_s"]
        r["comm_share"] = (t - t_ideal) / t if t_ideal and r["mode"] == "dp" else None
        for key, ref in (("vs_base", BASE), ("vs_best_loop", best)):
            if ref is not None and ref in cs:
                r[key] = common.median_ratio(r["times_s"], cs[ref]["times_s"])
                r[key + "_of_medians"] = t / cs[ref]["median_s"]
            else:
                r[key] = r[key + "_of_medians"] = None


# ----------------------------------------------------------------------------- environment
def environment(world: World, threads: int) -> dict[str, Any]:
    """Versions, CPU, binding and thread counts (gathered to rank 0)."""
    import torch

    versions = {"torch": torch.__version__, "numpy": np.__version__}
    env = common.environment(world, versions, {"threads_requested": threads})
    if not isinstance(world, Solo):
        import mpi4py

        env["mpi4py"] = mpi4py.__version__
        env["mpi_library"] = common.mpi_library(world.MPI)
    return env


# ----------------------------------------------------------------------------- report
def targets(results: dict[str, dict[str, Any]]) -> list[tuple[str, str, bool]]:
    """(target, measured, passed) for the default ``dml`` contender on every measured model."""
    out: list[tuple[str, str, bool]] = []
    for model, res in results.items():
        r = res["contenders"].get("dml")
        if r is None or model not in TARGETS:
            continue
        max_base, max_loop = TARGETS[model]
        if r["vs_base"] is not None:
            out.append((f"{model}: dml <= {max_base:.2f}x ddp_gloo", f"{r['vs_base']:.3f}x", r["vs_base"] <= max_base))
        if r["vs_best_loop"] is not None:
            best = res["best_loop"]
            out.append(
                (
                    f"{model}: dml <= {max_loop:.2f}x best hand-written loop ({best})",
                    f"{r['vs_best_loop']:.3f}x",
                    r["vs_best_loop"] <= max_loop,
                )
            )
        if r.get("maxdiff_ranks") is not None:
            d = r["maxdiff_ranks"]
            out.append((f"{model}: dml ranks bit-identical", f"{d:.1e}", d == 0.0))
    return out


def report_model(res: dict[str, Any], args: argparse.Namespace, ranks: int) -> None:
    """Print one model's table."""
    cs = res["contenders"]
    where = f"in ONE process ({args.threads} threads)" if args.serial else f"on {ranks} ranks"
    print(
        f"\n### {res['model']}: {res['nparams'] / 1e6:.2f} M params in {res['ntensors']} tensors "
        f"({res['nparams'] * 4 / 2**20:.1f} MiB of gradients), global batch {res['global_batch']} "
        f"{where}, {args.steps} steps (+{args.warmup} warm-up), "
        + (f"best hand-written loop: {res['best_loop']}, " if res.get("best_loop") else "")
        + f"other processes' load {100 * res['foreign_load']['foreign_share']:.0f}%\n"
    )
    rows = []
    for name, r in cs.items():
        dp = r["mode"] == "dp"
        rows.append(
            [
                name,
                fmt_time(r["median_s"]),
                f"{fmt_time(r['min_s'])} / {fmt_time(r['max_s'])}",
                f"{r['vs_base']:.3f}" if r["vs_base"] is not None else "-",
                f"{r['vs_best_loop']:.3f}" if r["vs_best_loop"] is not None else "-",
                f"{100 * r['comm_share']:.0f}%" if r["comm_share"] is not None else "-",
                fmt_time(r["comm_median_s"]),
                f"{res['global_batch'] / r['median_s']:.0f}" + ("" if r["mode"] != "local" else "*"),
                f"{r['maxdiff_ranks']:.1e}" if dp else "-",
                f"{r[f'maxdiff_vs_{BASE}']:.1e}" if dp and r.get(f"maxdiff_vs_{BASE}") is not None else "-",
            ]
        )
    headers = [
        "contender",
        "median step",
        "min / max",
        f"t/t({BASE})",
        "t/t(best loop)",
        "comm share",
        "explicit comm",
        "samples/s",
        "maxdiff ranks",
        f"maxdiff vs {BASE}",
    ]
    keep = [0, 1, 2, 7] if args.serial else list(range(len(headers)))  # the serial run has no peers to compare
    print(common.table([headers[i] for i in keep], [[r[i] for i in keep] for r in rows]))
    states = [f"{n} {r['state_bytes_max_rank'] / 2**20:.1f} MiB" for n, r in cs.items() if "state_bytes_max_rank" in r]
    if states:
        print("\noptimizer state per rank (the largest rank's): " + ", ".join(states))
    notes = [f"{n}: {r['note']}" for n, r in cs.items() if r["note"]]
    if notes:
        print("\n" + "; ".join(notes))


# ----------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> int:
    """Parse options, run every model, print tables and targets on rank 0."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="mlp2m,deep36,mlp25m", help=f"comma-separated, from {list(MODELS)}")
    ap.add_argument("--steps", type=int, default=20, help="timed steps per contender and model (default 20)")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps first (default 3)")
    ap.add_argument("--batch", type=int, default=64, help="samples per rank per step (default 64)")
    ap.add_argument("--threads", type=int, default=1, help="torch.set_num_threads per process (default 1)")
    ap.add_argument("--opt", choices=["sgd", "adam"], default="sgd", help="SGD(momentum=0.9) or Adam")
    ap.add_argument("--lr", type=float, default=None, help="learning rate (default 0.01 SGD, 0.001 Adam)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--only", help=f"comma-separated contenders (default: {','.join(CONTENDERS)})")
    ap.add_argument("--dml-buckets", default="", help="add dml_bb<S> contenders with bucket_bytes=S, e.g. 0,64K,1M")
    ap.add_argument(
        "--serial",
        action="store_true",
        help="single-process reference, no MPI: one process trains on the global batch (batch x --ranks)",
    )
    ap.add_argument("--ranks", type=int, default=2, help="with --serial: the global batch is batch x ranks (2)")
    ap.add_argument("--json", metavar="PATH", help="write every result (with per-step times) here")
    args = ap.parse_args(argv)
    if args.steps < 1 or args.warmup < 0 or args.batch < 1 or args.threads < 1:
        ap.error("--steps, --batch and --threads must be >= 1 and --warmup >= 0")
    if args.lr is None:
        args.lr = 0.01 if args.opt == "sgd" else 0.001
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    unknown_models = set(models) - set(MODELS)
    if unknown_models:
        ap.error(f"unknown model(s) {sorted(unknown_models)}; known: {list(MODELS)}")

    t_start = time.perf_counter()
    import torch

    torch.set_num_threads(args.threads)  # explicitly: under mpiexec MKL silently drops to 1, plain python uses all
    if args.serial:
        world: World = Solo()
        names = ["serial_global"]
    else:
        world = World()
        names = list(CONTENDERS)
        if args.only:
            want = [s.strip() for s in args.only.split(",") if s.strip()]
            known = [*CONTENDERS, *EXTRA_CONTENDERS]
            unknown = set(want) - set(known)
            if unknown:
                ap.error(f"unknown contender(s) {sorted(unknown)}; known: {known}")
            names = [n for n in known if n in want]
        names += [f"dml_bb{short_bytes(common.parse_bytes(s))}" for s in args.dml_buckets.split(",") if s.strip()]
    ranks = args.ranks if args.serial else world.size
    env = environment(world, args.threads)
    if world.rank == 0:
        mode = "serial reference, one process" if args.serial else f"{world.size} MPI ranks"
        print(
            f"# ddp: {mode}, {env.get('mpi_library', 'no MPI')}, torch {env['torch']}, "
            f"torch threads/process {env['torch_threads_per_rank']}, affinity {env['affinity_per_rank']}, "
            f"batch {args.batch}/rank x {ranks}, {args.opt} lr {args.lr}, cpu {env['cpu']}, "
            f"load average {env['loadavg_start'][0]:.2f}",
            flush=True,
        )
    if not args.serial and world.size < 2 and world.rank == 0:
        print("note: 1 rank; run under `mpiexec -n 2` for the data-parallel comparison", flush=True)

    meter = common.ForeignLoad(world)
    results: dict[str, dict[str, Any]] = {}
    for m in models:
        model_meter = common.ForeignLoad(world)
        results[m] = run_model(world, m, names, args)
        results[m]["foreign_load"] = model_meter.stop()
        if world.rank == 0:
            report_model(results[m], args, ranks)
    foreign = meter.stop()
    world.finish()
    elapsed = time.perf_counter() - t_start
    env["loadavg_end"] = os.getloadavg()
    if world.rank != 0:
        return 0

    tg = [] if args.serial else targets(results)
    if tg:
        common.print_targets(tg, "median over steps of the within-step ratio")
    if not args.serial:
        print(
            "\nreference: time one process with 2 threads on the whole batch too (`python benchmarks/ddp.py "
            "--serial --threads 2`); on the 2-core box of docs/benchmarks/ddp.md it beat ours on every model."
        )
    print(
        f"\nran in {elapsed:.1f} s; other processes used {foreign['foreign_cpu_s']:.2f} CPU s during the "
        f"{foreign['wall_s']:.1f} s of measurements ({100 * foreign['foreign_share']:.0f}% of the machine; "
        f"above ~5% this run is disturbed); load average at start/end {env['loadavg_start'][0]:.2f}/"
        f"{env['loadavg_end'][0]:.2f}"
    )
    if args.json:
        common.write_json(
            args.json,
            {
                "env": env,
                "args": vars(args),
                "ratio_definition": common.STEP_RATIO_DEFINITION,
                "results": results,
                "targets": [{"target": t, "measured": m, "pass": ok} for t, m, ok in tg],
                "foreign_load": foreign,
                "elapsed_s": elapsed,
            },
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
