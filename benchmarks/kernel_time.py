"""Where a slow training step's time goes: when each gradient is ready, and the kernel time spent until then.

Run as root from the repository root; it brings up the 2-node cluster of ``benchmarks/network.py`` (one rank
per node, one core each) on a shaped link and runs this script's job there::

    .venv/bin/python benchmarks/kernel_time.py [--link 1gbit:1] [--thp 1] [--order rotation] [--steps 12]

The job trains the 24 M-parameter MLP of ``benchmarks/ddp.py`` with two ``DistributedOptimizer``\\ s, unsharded
(``dml``) and ``shard_state=True`` (``dml_shard``), on their own copies of the model: their steps alternate
(``--order rotation``, as in ``benchmarks/ddp.py``) or run back to back (``--order back-to-back``). For each step
every rank records the moment each weight's gradient is accumulated (a post-accumulate-grad hook) with its
main thread's user and system CPU time and page faults since the step began; rank 0 also the end of forward,
every transport call (kind, bytes, start, end) and the step's end. ``--thp`` sets the ranks' ``THP_MEM_ALLOC_ENABLE``
(``distutils-ml launch`` gives 1). Prints one line per step and writes ``--json``.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "benchmarks"))


def _usage() -> tuple[float, float, int]:
    r = resource.getrusage(resource.RUSAGE_THREAD)
    return r.ru_utime, r.ru_stime, r.ru_minflt


def job(args: argparse.Namespace) -> None:
    """The MPI job: both optimizers' steps, timed on rank 0."""
    import torch
    import torch.nn.functional as F
    from ddp import MODELS, build_model
    from timeline import instrument

    import distutils_ml as dml

    torch.set_num_threads(1)
    dml.initialize(dml.MPIBackend)
    backend = dml.get_distributed_backend(dml.MPIBackend)
    widths = MODELS["mlp25m"]
    marks: list[tuple[str, float, tuple[float, float, int]]] = []
    calls: list[tuple[str, int, float, float]] = []
    instrument(calls)  # every transport call: (kind, bytes, start, end)

    def make(shard: bool) -> tuple[torch.nn.Module, dml.DistributedOptimizer]:
        torch.manual_seed(0)
        model = dml.synchronize(backend, build_model(widths))
        opt = dml.DistributedOptimizer(backend, torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9),
                                       shard_state=shard)  # fmt: skip
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.register_post_accumulate_grad_hook(
                    lambda _p, name=name: marks.append((name, time.perf_counter(), _usage()))
                )
        return model, opt

    x, y = torch.randn(64, widths[0]), torch.randint(0, widths[-1], (64,))
    trainers = {"dml": make(False), "dml_shard": make(True)}

    def step(name: str) -> dict[str, Any]:
        model, opt = trainers[name]
        marks.clear()
        calls.clear()
        t0, u0 = time.perf_counter(), _usage()
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        forward = time.perf_counter() - t0
        loss.backward()
        backward = time.perf_counter() - t0
        opt.step()
        return {
            "form": name, "forward_s": forward, "backward_returns_s": backward, "step_s": time.perf_counter() - t0,
            "grads": [{"param": n, "at_s": t - t0, "user_s": u[0] - u0[0], "system_s": u[1] - u0[1],
                       "faults": u[2] - u0[2]} for n, t, u in marks],
            "calls": [(k, b, s - t0, e - t0) for k, b, s, e in calls],
        }  # fmt: skip

    order = [n for _ in range(args.steps + 2) for n in trainers] if args.order == "rotation" else [
        n for n in trainers for _ in range(args.steps + 2)
    ]  # fmt: skip
    seen: dict[str, int] = {}
    steps = []
    for name in order:
        seen[name] = seen.get(name, 0) + 1
        result = step(name)
        if seen[name] > 2:  # warm-up: the first two steps of each
            steps.append(result)
    every = dml.allgather_object(backend, [[g for g in s["grads"]] for s in steps])  # each rank's gradients
    for i, s in enumerate(steps):
        s["grads_by_rank"] = [ranks[i] for ranks in every]
    if backend.rank == 0:
        for s in steps:
            grads = " / ".join(
                " ".join(f"{g['param'].split('.')[0]}@{g['at_s'] * 1e3:.0f}(sys {g['system_s'] * 1e3:.0f})" for g in gs)
                for gs in s["grads_by_rank"]
            )
            calls_text = " ".join(f"{k}:{b / 2**20:.0f}M {a * 1e3:.0f}-{e * 1e3:.0f}" for k, b, a, e in s["calls"])
            head = f"{s['form']:9s} step {s['step_s'] * 1e3:5.0f} ms | forward {s['forward_s'] * 1e3:.0f}"
            print(
                f"{head} | gradients {grads} | backward returns {s['backward_returns_s'] * 1e3:.0f}\n    {calls_text}"
            )
        Path(args.json).write_text(json.dumps({"args": vars(args), "steps": steps}, indent=1))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--link", default="1gbit:1", help="RATE:DELAY_MS, one way (default 1gbit:1)")
    ap.add_argument("--thp", choices=["0", "1"], default="1", help="the ranks' THP_MEM_ALLOC_ENABLE (default 1)")
    ap.add_argument("--order", choices=["rotation", "back-to-back"], default="rotation")
    ap.add_argument("--steps", type=int, default=12, help="timed steps per optimizer (default 12, after 2 warm-up)")
    ap.add_argument("--json", default="kernel_time.json", metavar="PATH")
    ap.add_argument("--job", action="store_true", help=argparse.SUPPRESS)  # inside mpiexec
    args = ap.parse_args(argv)
    if args.job:
        job(args)
        return 0
    from network import mpi_job, parse_link

    import cluster
    import delayline

    reason = cluster.unavailable() or delayline.missing_requirements(need_tc=True)
    if reason:
        print(f"kernel_time: {reason}", file=sys.stderr)
        return 2
    _, rate, delay = parse_link(args.link)
    forwarded = ["--job", "--thp", args.thp, "--order", args.order, "--steps", str(args.steps)]
    with cluster.cluster(2, 1, link=(rate, delay)) as c:
        mpi_job(c, Path(__file__).name, forwarded, Path(args.json).resolve(), timeout=900, thp=args.thp)
    print(f"(every step above, and the rest, in {args.json})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
