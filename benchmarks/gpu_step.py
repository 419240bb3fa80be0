"""One training step on CUDA: ``dml.DistributedOptimizer`` over ``dml.NCCLBackend`` against torch DDP over NCCL.

Run from the repository root on a GPU machine (a world of one; about 10-20 s plus start-up)::

    mpiexec -n 1 python benchmarks/gpu_step.py [--models mlp2m,deep36,mlp25m] [--opt sgd|adam]
        [--batch 256] [--steps 100] [--warmup 10] [--only a,b] [--json gpu_step.json]

    mpiexec -n 1 python benchmarks/gpu_step.py --device cpu --steps 5   # this script's check without a GPU

Contenders (each trains its own copy of the same model, from the same initial weights, on the same
batches, with the same optimizer: SGD with momentum 0.9, or Adam with ``--opt adam``):

* ``ideal_local``: forward, backward and optimizer step, no communication: the floor;
* ``ddp_nccl``: ``DistributedDataParallel(model, device_ids=[dev])`` over a ``torch.distributed``
  NCCL group (its store a ``FileStore`` in a temporary folder: no network), default settings
  (25 MiB buckets, allreduce overlapped with backward). The reference of the ratios;
* ``dml``: ``dml.DistributedOptimizer(backend, opt)`` over ``dml.NCCLBackend`` with its defaults
  (on NCCL: buckets reduced on a stream of their own while backward runs);
* ``dml_shard``: ``dml.DistributedOptimizer(backend, opt, shard_state=True)`` (ZeRO-1 sharded state).

With ``--device cpu`` (no GPU, no CuPy) the same runs on CPU tensors: ``dml`` over ``dml.MPIBackend``
and DDP over gloo (``ddp_gloo``); it checks this script's steps, timing, parameter agreement and report.

Method: every step draws one global batch (``--batch`` x ranks samples; rank r takes slice r) and
each contender runs one step on it, in an order rotated every step (interleaved: drift hits every
contender alike). Each step is timed on the wall clock between ``torch.cuda.synchronize()`` calls
(after a barrier), so the time includes the GPU work; a step's time is the max over ranks. After
``--warmup`` untimed steps come ``--steps`` timed ones. Per contender: the median step time;
``t/t(ddp)`` and ``t/t(ideal)`` are the MEDIAN OVER STEPS OF THE WITHIN-STEP RATIO (ratios of
medians are in the JSON).

Correctness, after the timed steps: ``maxdiff vs ddp`` = max |param - DDP's param| on the same
rank (in a world of one ``ideal_local`` does the same arithmetic, so it is compared too), and
``moved`` = max |param - initial param|, the scale a missed or doubled step would show on. The
table is printed first; then the script exits 1 if a contender raised, a parameter is not finite,
a difference exceeds ``--tol`` or a contender moved less than 10 x ``--tol``.
"""

from __future__ import annotations

import argparse
import copy
import os
import shutil
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/common.py and ddp.py, when run as a script
import common
from ddp import MODELS, build_model, fmt_time

CONTENDERS = ("ideal_local", "ddp", "dml", "dml_shard")  # "ddp" is named ddp_nccl / ddp_gloo in the output
IDEAL = "ideal_local"


# ----------------------------------------------------------------------------- world
class World:
    """This job's ranks: the dml backend, a torch.distributed group on the same ranks, the device."""

    def __init__(self, device: str) -> None:
        import torch
        import torch.distributed as dist

        self.dml = dml = common.import_dml()
        kind = dml.NCCLBackend if device == "cuda" else dml.MPIBackend
        dml.initialize(kind)
        self.backend = dml.get_distributed_backend(kind)
        self.rank, self.size = dml.local_rank(self.backend), dml.total_workers(self.backend)
        self.cuda = device == "cuda"
        self.device = torch.device("cuda", self.backend.device) if self.cuda else torch.device("cpu")
        self.pg = "nccl" if self.cuda else "gloo"
        self.base = f"ddp_{self.pg}"
        # The group's store: a file in rank 0's temporary folder (one host, no network).
        self.tmp = tempfile.mkdtemp(prefix="dml-gpu-step-") if self.rank == 0 else None
        path = dml.bcast_object(self.backend, None if self.tmp is None else os.path.join(self.tmp, "store"))
        store = dist.FileStore(path, self.size)
        dist.init_process_group(self.pg, store=store, rank=self.rank, world_size=self.size)

    def sync(self) -> None:
        """Wait for this rank's GPU (nothing on CPU)."""
        if self.cuda:
            import torch

            torch.cuda.synchronize(self.device)

    def barrier(self) -> None:
        """All ranks here (MPI)."""
        self.dml.barrier(self.backend)

    def max_over_ranks(self, xs: list[float]) -> list[float]:
        """Element-wise max of ``xs`` over ranks."""
        import numpy as np

        return [float(x) for x in self.dml.allreduce(self.backend, np.asarray(xs, dtype=np.float64), self.dml.MAX)]

    def finish(self) -> None:
        """Destroy the torch.distributed group and remove the store's folder."""
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
        if self.tmp is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)


# ----------------------------------------------------------------------------- contenders
@dataclass
class Trainer:
    """One contender: ``step(x, y)`` does one optimisation step of ``model``."""

    step: Callable[[Any, Any], None]
    model: Any
    note: str = ""
    local: bool = False  # no communication: its parameters diverge across ranks when there are several


def make_trainer(world: World, name: str, model: Any, opt: Any) -> Trainer:
    """The contender ``name`` training ``model`` with ``opt``."""
    import torch.nn.functional as F

    if name == IDEAL:

        def step_local(x: Any, y: Any) -> None:
            opt.zero_grad(set_to_none=True)
            F.cross_entropy(model(x), y).backward()
            opt.step()

        return Trainer(step_local, model, "no communication", local=True)

    if name == world.base:
        from torch.nn.parallel import DistributedDataParallel as DDP

        ddp = DDP(model, device_ids=[world.device.index] if world.cuda else None)

        def step_ddp(x: Any, y: Any) -> None:
            opt.zero_grad(set_to_none=True)
            F.cross_entropy(ddp(x), y).backward()
            opt.step()

        return Trainer(step_ddp, model, "bucket_cap_mb=25 (default)")

    if name in ("dml", "dml_shard"):
        dml = world.dml
        dopt = dml.DistributedOptimizer(world.backend, opt, shard_state=name == "dml_shard")

        def step_dml(x: Any, y: Any) -> None:
            dopt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            dopt.step()

        kind = type(world.backend).__name__
        return Trainer(
            step_dml, model, f"{kind}, overlap={dopt.overlap}" + (", shard_state" if "shard" in name else "")
        )

    raise ValueError(f"unknown contender {name!r}")


def max_abs_diff(a: list[Any], b: list[Any]) -> float:
    """max |a_i - b_i| over two lists of tensors of the same shapes."""
    return max(float((x.detach() - y.detach()).abs().max()) for x, y in zip(a, b, strict=True))


# ----------------------------------------------------------------------------- measurement
def run_model(world: World, model_name: str, names: list[str], args: argparse.Namespace) -> dict[str, Any]:
    """Build every contender on ``model_name``, run the interleaved steps, return times, checks and failures."""
    import torch

    widths = MODELS[model_name]
    torch.manual_seed(args.seed)
    proto = build_model(widths)
    initial = [p.detach().to(world.device) for p in proto.parameters()]
    errors: dict[str, str] = {}

    def failed(name: str, exc: Exception) -> None:
        if world.size > 1:  # the other ranks would wait in a collective: end the job
            raise exc
        errors[name] = traceback.format_exc()
        print(f"{model_name}: {name} raised; dropped from the run:\n{errors[name]}", file=sys.stderr, flush=True)

    trainers: dict[str, Trainer] = {}
    for name in names:
        model = copy.deepcopy(proto).to(world.device)
        if args.opt == "sgd":
            opt: Any = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
        else:
            opt = torch.optim.Adam(model.parameters(), lr=args.lr)
        world.barrier()
        try:
            trainers[name] = make_trainer(world, name, model, opt)
        except Exception as e:
            failed(name, e)

    G = args.batch * world.size
    lo, hi = world.rank * args.batch, (world.rank + 1) * args.batch
    times: dict[str, list[float]] = {n: [] for n in trainers}
    clock = time.perf_counter
    for s in range(args.warmup + args.steps):
        g = torch.Generator().manual_seed(args.seed * 100003 + s)
        xg = torch.randn(G, widths[0], generator=g)
        yg = torch.randint(0, widths[-1], (G,), generator=g)
        x, y = xg[lo:hi].to(world.device), yg[lo:hi].to(world.device)
        live = [n for n in times if n not in errors]
        k = s % len(live) if live else 0
        for name in live[k:] + live[:k]:  # rotated order: drift hits every contender alike
            world.sync()
            world.barrier()
            t0 = clock()
            try:
                trainers[name].step(x, y)
                world.sync()
            except Exception as e:
                failed(name, e)
                continue
            dt = clock() - t0
            if s >= args.warmup:
                times[name].append(dt)

    res: dict[str, Any] = {
        "model": model_name,
        "widths": widths,
        "nparams": sum(p.numel() for p in proto.parameters()),
        "ntensors": len(initial),
        "global_batch": G,
        "errors": errors,
        "contenders": {},
    }
    failures = [f"{model_name}: {n} raised {e.strip().splitlines()[-1]}" for n, e in errors.items()]
    base = world.base
    ref = [p for p in trainers[base].model.parameters()] if base in trainers and base not in errors else None
    if ref is None:
        failures.append(f"{model_name}: no {base} result to compare the parameters with")
    for name, tr in trainers.items():
        if name in errors:
            continue
        params = list(tr.model.parameters())
        compared = ref is not None and not (tr.local and world.size > 1)
        finite = all(bool(torch.isfinite(p).all()) for p in params)
        local = [max_abs_diff(params, ref) if compared else 0.0, max_abs_diff(params, initial), 0.0 if finite else 1.0]
        diff, moved, not_finite = world.max_over_ranks(local)
        res["contenders"][name] = {
            "note": tr.note,
            "times_s": world.max_over_ranks(times[name]),
            f"maxdiff_vs_{base}": diff if compared else None,
            "moved": moved,
            "finite": not not_finite,
        }
        if not_finite:
            failures.append(f"{model_name}: {name} has parameters that are not finite")
        if compared and not diff <= args.tol:
            failures.append(f"{model_name}: {name} differs from {base} by {diff:.3e} > --tol {args.tol:g}")
        if not moved >= 10 * args.tol:
            failures.append(
                f"{model_name}: {name} moved its parameters by at most {moved:.3e} (< 10 x --tol): the agreement "
                "check cannot tell a step from none; raise --lr or --steps"
            )
    summarize(res, base)
    res["failures"] = failures
    return res


def summarize(res: dict[str, Any], base: str) -> None:
    """Add medians and the within-step ratios against ``base`` and ``ideal_local`` to a model's result."""
    cs = res["contenders"]
    for r in cs.values():
        ts = r["times_s"]
        r.update(median_s=statistics.median(ts), min_s=min(ts), max_s=max(ts))
    for r in cs.values():
        for key, ref in (("vs_ddp", base), ("vs_ideal", IDEAL)):
            if ref in cs:
                r[key] = common.median_ratio(r["times_s"], cs[ref]["times_s"])
                r[key + "_of_medians"] = r["median_s"] / cs[ref]["median_s"]
            else:
                r[key] = r[key + "_of_medians"] = None


# ----------------------------------------------------------------------------- report
def report_model(res: dict[str, Any], args: argparse.Namespace, world: World) -> None:
    """Print one model's table and notes."""
    cs = res["contenders"]
    base = world.base
    print(
        f"\n### {res['model']}: {res['nparams'] / 1e6:.2f} M params in {res['ntensors']} tensors "
        f"({res['nparams'] * 4 / 2**20:.1f} MiB of float32 gradients), global batch {res['global_batch']} "
        f"on {world.size} rank(s), {args.opt} lr {args.lr}, {args.steps} steps (+{args.warmup} warm-up)\n"
    )

    def ratio(x: float | None) -> str:
        return "-" if x is None else f"{x:.3f}"

    rows = [
        [
            name,
            fmt_time(r["median_s"]),
            f"{fmt_time(r['min_s'])} / {fmt_time(r['max_s'])}",
            ratio(r["vs_ddp"]),
            ratio(r["vs_ideal"]),
            f"{res['global_batch'] / r['median_s']:.0f}",
            "-" if r[f"maxdiff_vs_{base}"] is None else f"{r[f'maxdiff_vs_{base}']:.1e}",
            f"{r['moved']:.1e}",
        ]
        for name, r in cs.items()
    ]
    headers = [
        "contender",
        "median step",
        "min / max",
        "t/t(ddp)",
        "t/t(ideal)",
        "samples/s",
        "maxdiff vs ddp",
        "moved",
    ]
    print(common.table(headers, rows))
    print("\n" + "; ".join(f"{n}: {r['note']}" for n, r in cs.items()))
    for name in res["errors"]:
        print(f"{name}: RAISED (traceback on stderr)")


def environment(world: World) -> dict[str, Any]:
    """Machine, versions and the device."""
    import torch

    env: dict[str, Any] = {**common.machine(), "torch": torch.__version__, "world_size": world.size}
    env["device"] = str(world.device)
    if world.cuda:
        import cupy

        env.update(
            torch_cuda=torch.version.cuda,
            gpu=torch.cuda.get_device_name(world.device),
            torch_nccl=str(torch.cuda.nccl.version()),
            cupy=cupy.__version__,
            cupy_nccl=world.backend.nccl_version,
        )
    return env


# ----------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> int:
    """Parse options, run every model, print the tables on rank 0; 1 when a check failed."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="mlp2m,deep36,mlp25m", help=f"comma-separated, from {list(MODELS)}")
    ap.add_argument("--steps", type=int, default=100, help="timed steps per contender and model (default 100)")
    ap.add_argument("--warmup", type=int, default=10, help="untimed steps first (default 10)")
    ap.add_argument("--batch", type=int, default=256, help="samples per rank per step (default 256)")
    ap.add_argument("--opt", choices=["sgd", "adam"], default="sgd", help="SGD(momentum=0.9) or Adam")
    ap.add_argument("--lr", type=float, default=None, help="learning rate (default 0.01 SGD, 0.001 Adam)")
    ap.add_argument("--tol", type=float, default=1e-5, help="largest |param - DDP's param| accepted (1e-5)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--only", help=f"comma-separated contenders (default: all of {','.join(CONTENDERS)})")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda", help="cpu: this script's check, MPI + gloo")
    ap.add_argument("--json", metavar="PATH", help="write every result (with per-step times) here")
    args = ap.parse_args(argv)
    if args.steps < 1 or args.warmup < 0 or args.batch < 1 or args.tol <= 0:
        ap.error("--steps and --batch must be >= 1, --warmup >= 0 and --tol > 0")
    if args.lr is None:
        args.lr = 0.01 if args.opt == "sgd" else 0.001
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = set(models) - set(MODELS)
    if unknown or not models:
        ap.error(f"--models: unknown {sorted(unknown)} or none given; known: {list(MODELS)}")
    want = [s.strip() for s in (args.only or ",".join(CONTENDERS)).split(",") if s.strip()]
    unknown = set(want) - set(CONTENDERS)
    if unknown:
        ap.error(f"--only: unknown contender(s) {sorted(unknown)}; known: {list(CONTENDERS)}")

    t_start = time.perf_counter()
    world = World(args.device)
    try:
        names = [world.base if n == "ddp" else n for n in CONTENDERS if n in want or n == "ddp"]  # DDP: the reference
        env = environment(world)
        if world.rank == 0:
            print("# gpu_step: " + ", ".join(f"{k} {v}" for k, v in env.items() if k not in ("platform", "python")))
        results = {}
        for m in models:
            results[m] = run_model(world, m, names, args)
            if world.rank == 0:
                report_model(results[m], args, world)
    finally:
        world.finish()
    elapsed = time.perf_counter() - t_start
    if world.rank != 0:
        return 0
    print("\n" + ", ".join(f"{m}: dml / {world.base} {fmt_ratio(r, 'dml')}" for m, r in results.items()))
    print(f"ran in {elapsed:.1f} s")
    failures = [f for r in results.values() for f in r["failures"]]
    if args.json:
        common.write_json(
            args.json,
            {
                "env": env,
                "args": vars(args),
                "ratio_definition": common.STEP_RATIO_DEFINITION,
                "results": results,
                "failures": failures,
                "elapsed_s": elapsed,
            },
        )
    if failures:
        print("\nFAILED:\n" + "\n".join(failures), file=sys.stderr)
        return 1
    return 0


def fmt_ratio(res: dict[str, Any], name: str) -> str:
    """``name``'s median within-step ratio to DDP in a model's result, ``-`` when it did not run."""
    r = res["contenders"].get(name)
    return "-" if r is None or r["vs_ddp"] is None else f"{r['vs_ddp']:.3f}"


if __name__ == "__main__":
    sys.exit(main())
