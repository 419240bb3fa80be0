"""The MPI job of tests/test_faults.py: a training loop in which rank 1 fails.

Run: ``mpiexec -n N python tests/fault_job.py MODE [VICTIM]`` (the failing rank, default 1) where MODE is

- ``sigkill``: rank 1 kills itself with SIGKILL after 3 steps; rank 0 goes on into the
  next step's gradient allreduce, which can never complete;
- ``sys-exit``: rank 1 calls ``sys.exit(3)`` after 3 steps (no exception hook sees it; the
  ranks run under ``python -m mpi4py`` as the launcher starts them, which aborts the job);
- ``raise``: rank 1 raises RuntimeError after 3 steps;
- ``hang``: rank 1 stops communicating (sleeps) after 3 steps: the others' stall report ends the job;
- ``cut``: nothing fails here: rank 1 prints ``CUT ME`` after 3 steps and every rank goes on
  slowly (0.2 s a step), so the test can pull the victim's cable meanwhile;
- ``worker-error``: a DataLoader worker (``num_workers=1``) raises in ``__getitem__``
  at a sample that only rank 1 holds; rank 0 waits in the allreduce of that step.

The failing rank prints ``FAULT AT <unix time>`` just before the fault, so the test
can measure how long the job takes to end after it. A job that gets past its fault
prints ``NOT ABORTED``.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import sys
import time

import torch

import distutils_ml as dml

STEPS = 40
KILL_AFTER = 3
BAD_SAMPLE = 21  # odd: with 2 ranks and no shuffle, only rank 1 holds it (its 11th sample, batch 2)


class CorruptAt(torch.utils.data.Dataset):
    """64 samples ``(x, y)``; reading sample ``bad`` raises, as a corrupt file would."""

    def __init__(self, bad: int) -> None:
        self.bad = bad

    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if i == self.bad:
            print(f"FAULT AT {time.time():.3f}", flush=True)
            raise ValueError(f"corrupt sample {i}: cannot decode")
        return torch.full((8,), float(i) / 64), torch.tensor([float(i % 3)])


def _raise() -> None:
    raise RuntimeError("deliberate failure in training")


def step(model: torch.nn.Module, opt: dml.DistributedOptimizer, xb: torch.Tensor, yb: torch.Tensor) -> None:
    opt.zero_grad()
    torch.nn.functional.mse_loss(model(xb), yb).backward()
    opt.step()


def main(mode: str, victim: str = "1") -> None:
    faulthandler.register(signal.SIGUSR1)  # the test runner asks for stacks before killing a hung job
    dml.initialize(dml.MPIBackend)
    backend = dml.get_distributed_backend(dml.MPIBackend)
    rank = dml.local_rank(backend)
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1)
    opt = dml.DistributedOptimizer(backend, torch.optim.SGD(model.parameters(), lr=0.1))
    faults = {
        "sigkill": lambda: os.kill(os.getpid(), signal.SIGKILL),
        "sys-exit": lambda: sys.exit(3),
        "raise": _raise,
        "cut": lambda: print("CUT ME", flush=True),
        "hang": lambda: time.sleep(600),
    }
    if mode in faults:
        for k in range(STEPS):
            step(model, opt, torch.randn(4, 8), torch.randn(4, 1))
            dml.print(backend, f"step {k} done")
            if mode == "cut":
                time.sleep(0.2)
            if rank == int(victim) and k + 1 == KILL_AFTER:
                print(f"FAULT AT {time.time():.3f}", flush=True)
                faults[mode]()
    elif mode == "worker-error":
        ddc = dml.DistributedDataContainer(backend, CorruptAt(BAD_SAMPLE))
        loader = torch.utils.data.DataLoader(ddc, batch_size=4, num_workers=1)
        for k, (xb, yb) in enumerate(loader):
            step(model, opt, xb, yb)
            dml.print(backend, f"step {k} done")
    else:
        raise SystemExit(f"unknown mode {mode!r}; allowed: {', '.join(faults)}, worker-error")
    dml.print(backend, "NOT ABORTED")


if __name__ == "__main__":
    main(*sys.argv[1:])
