"""What saving a TrainState costs a training step: blocks of steps with and without saves, interleaved.

    .venv/bin/mpiexec -n 2 .venv/bin/python benchmarks/trainstate.py [--model mlp25m] [--every 50] [--blocks 3]
        [--steps 100] [--dir /tmp/dml-trainstate-bench] [--json PATH]

Each block runs ``--steps`` training steps (the benchmarks' models, SGD with momentum, 64 samples per rank, one
torch thread per rank); the blocks alternate between no saving and ``TrainState.save_if_due`` every ``--every``
steps, as a run saves: each write goes on in the background while the next ``--every`` steps run (the block's last
step is no save, and its ``wait()``, for a write finished long before, is not timed). Reported: seconds per step
of each kind (median over blocks), the cost of saving as a share of the step, and one save's own parts: the call
(gathering, the host copy) and the background write (its wall time: it yields the core to training).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ddp import MODELS, build_model  # benchmarks/ddp.py: the same models


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="mlp25m", choices=list(MODELS))
    ap.add_argument("--every", type=int, default=50)
    ap.add_argument("--blocks", type=int, default=2, help="blocks of each kind")
    ap.add_argument("--steps", type=int, default=200, help="steps per block (saves at every --every-th but the last)")
    ap.add_argument("--dir", default="/tmp/dml-trainstate-bench")
    ap.add_argument("--json", metavar="PATH")
    args = ap.parse_args()
    torch.set_num_threads(1)
    import distutils_ml as dml
    import distutils_ml.trainstate as ts

    dml.initialize(dml.MPIBackend)
    backend = dml.get_distributed_backend(dml.MPIBackend)
    widths = MODELS[args.model]
    torch.manual_seed(0)
    model = dml.synchronize(backend, build_model(widths))
    opt = dml.DistributedOptimizer(backend, torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9))
    state = dml.TrainState(backend, model=model, optimizer=opt, every_steps=args.every, keep=2, step=0)
    writes: list[float] = []
    write_cpu: list[float] = []
    real = ts.write_atomic

    def timed(obj: object, path: str) -> None:
        start, cpu = time.perf_counter(), time.thread_time()
        real(obj, path)
        writes.append(time.perf_counter() - start)
        write_cpu.append(time.thread_time() - cpu)

    ts.write_atomic = timed
    gen = torch.Generator().manual_seed(backend.rank)
    x = torch.randn(64, widths[0], generator=gen)
    y = torch.randint(0, widths[-1], (64,), generator=gen)

    def step() -> None:
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        state.step += 1

    if backend.rank == 0:
        shutil.rmtree(args.dir, ignore_errors=True)
    for _ in range(5):
        step()
    calls: list[float] = []
    per_step: dict[str, list[float]] = {"plain": [], "saving": []}
    for _block in range(args.blocks):
        for kind in ("plain", "saving"):
            dml.barrier(backend)
            start = time.perf_counter()
            for k in range(args.steps):
                step()
                if kind == "saving" and k + 1 < args.steps:
                    t0 = time.perf_counter()
                    if state.save_if_due(args.dir):
                        calls.append(time.perf_counter() - t0)
            dml.barrier(backend)
            per_step[kind].append((time.perf_counter() - start) / args.steps)
            if kind == "saving":
                state.wait()  # long done: the block's last save was --every steps ago
    plain, saving = (statistics.median(per_step[k]) for k in ("plain", "saving"))
    out = {
        "model": args.model,
        "every": args.every,
        "ranks": backend.size,
        "plain_s": plain,
        "saving_s": saving,
        "cost": saving / plain - 1,
        "call_s": statistics.median(calls) if calls else None,
        "write_s": statistics.median(writes) if writes else None,
        "write_cpu_s": statistics.median(write_cpu) if write_cpu else None,
        "blocks": per_step,
    }
    if backend.rank == 0:
        print(
            f"{args.model}, {backend.size} ranks, a save every {args.every} steps: step {plain * 1e3:.1f} ms without "
            f"saving, {saving * 1e3:.1f} ms with ({out['cost'] * 100:+.1f} %); a save's call (gather and host copy) "
            f"{out['call_s'] * 1e3:.0f} ms on rank 0, its background write {out['write_s'] * 1e3:.0f} ms "
            f"({out['write_cpu_s'] * 1e3:.0f} ms of CPU in its thread)",
            flush=True,
        )
        if args.json:
            Path(args.json).write_text(json.dumps(out, indent=1))
        shutil.rmtree(args.dir, ignore_errors=True)


if __name__ == "__main__":
    main()
