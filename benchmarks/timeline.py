"""Where a training step's time goes across hosts: a timeline of DistributedOptimizer steps over the gloo transport.

Run under mpiexec (``benchmarks/network.py --timeline MODELS`` runs it on the shaped two-node link)::

    mpiexec -n 2 python benchmarks/timeline.py --models mlp25m [--steps 6] [--batch 64] [--opt sgd] [--shard]

For each model it runs the steps back to back, as a training loop does, and times on rank 0 (ms from the start of
the step, after 2 warm-up steps): the end of forward, each transport call (made on the communication thread: its
kind, bytes, start and end; with ``prefetch`` some land during the next step), the return of ``backward()`` and of
``step()``, and the start of the next step, which ends this one. It also times the same step with no communication
(``compute``: forward, backward, optimizer step) and one transport allreduce of all the gradients' bytes
(``comm``), and reports the step against ``max(compute, comm)``. Medians over the timed steps; the timeline
printed is the step whose length is the median. ``--json PATH`` writes everything.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ddp import MODELS, build_model  # benchmarks/ddp.py: the same models


def instrument(calls: list[tuple[str, int, float, float]]) -> None:
    """Record every transport call (kind, bytes, start, end) into ``calls``: from its post to its completion (a call
    left in flight completes when the transport settles it). Bytes as the caller's buffer: a reduce-scatter's whole
    bucket, an allgather's own part."""
    from distutils_ml.gloo import GlooTransport

    original = GlooTransport._start

    def timed(self: Any, flight: Any, *args: Any, **kwargs: Any) -> None:
        kind, start = flight.kind, time.perf_counter()
        nbytes = int(flight.array.nbytes) * (self.size if kind == "reduce_scatter" else 1)

        def landed(error: BaseException | None, _done: Any = flight.done) -> None:
            calls.append((kind, nbytes, start, time.perf_counter()))
            if _done is not None:
                _done(error)

        flight.done = landed
        original(self, flight, *args, **kwargs)

    GlooTransport._start = timed


def run_model(name: str, args: argparse.Namespace) -> dict[str, Any]:
    import torch

    import distutils_ml as dml
    from distutils_ml.transport import transport_for

    backend = dml.get_distributed_backend(dml.MPIBackend)
    torch.manual_seed(0)
    widths = MODELS[name]
    model = dml.synchronize(backend, build_model(widths))
    make = (lambda ps: torch.optim.Adam(ps, lr=1e-3)) if args.opt == "adam" else (
        lambda ps: torch.optim.SGD(ps, lr=0.01, momentum=0.9)
    )  # fmt: skip
    opt = dml.DistributedOptimizer(
        backend, make(model.parameters()), shard_state=args.shard or args.prefetch,
        step_during_backward=args.step_during_backward, prefetch=args.prefetch,
    )  # fmt: skip
    local = build_model(widths)
    local.load_state_dict(model.state_dict())
    local_opt = make(local.parameters())
    gen = torch.Generator().manual_seed(1 + backend.rank)
    x = torch.randn(args.batch, widths[0], generator=gen)
    y = torch.randint(0, widths[-1], (args.batch,), generator=gen)
    loss_fn = torch.nn.CrossEntropyLoss()
    calls: list[tuple[str, int, float, float]] = []
    instrument(calls)
    ring = transport_for(backend)
    steps, compute, comm = [], [], []
    grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    # The training steps back to back, as a training loop runs them (a barrier between them would wait for what a
    # step leaves in flight, the allgathers of prefetch=True): a step lasts until the next one starts.
    dml.barrier(backend)
    starts, records = [], []
    for _ in range(2 + args.steps + 1):
        t0 = time.perf_counter()
        starts.append(t0)
        calls_before = len(calls)
        opt.zero_grad()
        loss = loss_fn(model(x), y)
        t_fwd = time.perf_counter()
        loss.backward()
        t_bwd = time.perf_counter()
        opt.step()
        records.append((t0, t_fwd, t_bwd, time.perf_counter(), calls_before))
    dml.barrier(backend)
    for i in range(2, 2 + args.steps):
        t0, t_fwd, t_bwd, t_end, first = records[i]
        last = records[i + 1][4]
        steps.append(
            {
                "forward": t_fwd - t0,
                "backward_returns": t_bwd - t0,
                "step_returns": t_end - t0,
                "step_ends": starts[i + 1] - t0,
                "calls": [(k, b, s - t0, e - t0) for k, b, s, e in calls[first:last]],
            }
        )
    for _ in range(2 + args.steps):
        dml.barrier(backend)
        t1 = time.perf_counter()
        local_opt.zero_grad()
        loss_fn(local(x), y).backward()
        local_opt.step()
        compute.append(time.perf_counter() - t1)
        dml.barrier(backend)
        flat = np.ones(grad_bytes // 4, np.float32)
        t2 = time.perf_counter()
        if ring is not None:
            ring.allreduce(flat, dml.SUM)
        else:
            dml.allreduce(backend, flat, dml.SUM)
        comm.append(time.perf_counter() - t2)
    compute, comm = compute[2:], comm[2:]
    lengths = [s["step_ends"] for s in steps]
    median = sorted(range(len(steps)), key=lambda k: lengths[k])[len(steps) // 2]
    step, comp, com = statistics.median(lengths), statistics.median(compute), statistics.median(comm)
    return {
        "model": name,
        "params": sum(p.numel() for p in model.parameters()),
        "grad_bytes": grad_bytes,
        "transport": "gloo" if ring is not None else "backend",
        "overlap": opt.overlap,
        "sharded": args.shard or args.prefetch,
        "prefetch": args.prefetch,
        "step_during_backward": args.step_during_backward,
        "step_s": step,
        "compute_s": comp,
        "comm_s": com,
        "step_over_max": step / max(comp, com),
        "median_step": steps[median],
        "steps": steps,
    }


def describe(res: dict[str, Any]) -> str:
    ms = lambda s: f"{s * 1e3:.0f}"  # noqa: E731
    tl = res["median_step"]
    parts = [f"forward ends {ms(tl['forward'])}"]
    for kind, nbytes, start, end in tl["calls"]:
        parts.append(f"{kind} {nbytes / 2**20:.2f} MiB {ms(start)}-{ms(end)}")
    parts += [f"backward returns {ms(tl['backward_returns'])}", f"step returns {ms(tl['step_returns'])}"]
    parts.append(f"next step starts {ms(tl['step_ends'])}")
    busy = sum(end - start for _, _, start, end in tl["calls"])
    return (
        f"{res['model']} ({res['params'] / 1e6:.1f} M, {res['grad_bytes'] / 2**20:.1f} MiB of gradients, "
        f"{'sharded' if res['sharded'] else 'unsharded'}"
        f"{', stepped during backward' if res.get('step_during_backward') else ''}"
        f"{', prefetch' if res.get('prefetch') else ''}, "
        f"transport {res['transport']}, overlap {res['overlap']}): "
        f"step {ms(res['step_s'])} ms, compute {ms(res['compute_s'])} ms, comm {ms(res['comm_s'])} ms, "
        f"step / max(compute, comm) = {res['step_over_max']:.2f}; in transport calls {ms(busy)} ms\n"
        f"  {' | '.join(parts)}"
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="mlp2m,deep36,mlp25m")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--opt", choices=["sgd", "adam"], default="sgd")
    ap.add_argument("--shard", action="store_true", help="shard_state=True")
    ap.add_argument("--step-during-backward", action="store_true", help="step_during_backward=True")
    ap.add_argument("--prefetch", action="store_true", help="shard_state=True, prefetch=True")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", metavar="PATH")
    args = ap.parse_args(argv)
    import torch

    import distutils_ml as dml

    torch.set_num_threads(args.threads)
    dml.initialize(dml.MPIBackend)
    backend = dml.get_distributed_backend(dml.MPIBackend)
    results = [run_model(name, args) for name in args.models.split(",")]
    if backend.rank == 0:
        for res in results:
            print(describe(res), flush=True)
        if args.json:
            Path(args.json).write_text(json.dumps({"args": vars(args), "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
