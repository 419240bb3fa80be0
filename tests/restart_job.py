"""The job of tests/test_restarts.py: ``distutils-ml launch --restarts R ... tests/restart_job.py FAULT DIR``.

Trains with a :class:`distutils_ml.TrainState` saved to ``DIR/ckpt`` every 4 steps, resuming from it when there is
one (it prints ``STARTED AT <time>`` once MPI is up, ``RESUMED AT <time> step <s> on <W> ranks`` once the checkpoint
is loaded, then ``FIRST STEP AFTER RESUME AT <time>``). The first
attempt (not resumed) meets FAULT at step 10 on its last rank:

- ``none``: nothing; ``kill-rank``: the rank kills itself (SIGKILL) after ``FAULT AT <time>``;
- ``cut``: every rank prints ``CUT ME`` (the test then cuts the last node's cable) and goes on slowly;
- ``kill-node``: every rank prints ``KILL MY NODE`` (the test then kills every process on the last node) and goes
  on slowly;
- ``bug``: the rank raises at step 10, in every attempt (resumed from step 8 each time).

At the end rank 0 writes the parameters to ``DIR/final.npy`` and prints ``FINISHED at step <s> on <W> ranks``.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import sys
import time

import numpy as np
import torch

import distutils_ml as dml

FAULT_STEP = 10


def main(fault: str, directory: str) -> None:
    faulthandler.register(signal.SIGUSR1)
    torch.set_num_threads(1)
    dml.initialize(dml.MPIBackend)
    backend = dml.get_distributed_backend(dml.MPIBackend)
    dml.print(backend, f"STARTED AT {time.time():.3f}", all_ranks=False)
    victim = backend.rank == backend.size - 1
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Dropout(0.2), torch.nn.Linear(16, 1))
    model = dml.synchronize(backend, model)
    opt = dml.DistributedOptimizer(backend, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9))
    g = torch.Generator().manual_seed(1)
    data = dml.DistributedDataContainer(backend, (torch.randn(192, 8, generator=g), torch.randn(192, 1, generator=g)),
                                        shuffle=True)  # fmt: skip
    loader = torch.utils.data.DataLoader(data, batch_size=4, generator=torch.Generator())
    state = dml.TrainState(backend, model=model, optimizer=opt, data=data, every_steps=4, step=0)
    torch.manual_seed(100 + backend.rank)
    where = os.path.join(directory, "ckpt")
    resumed = state.resume(where)
    if resumed:
        dml.print(backend, f"RESUMED AT {time.time():.3f} step {state.step} on {backend.size} ranks", all_ranks=False)
    first = resumed
    slow = False
    for _epoch in state.epochs(2):
        for xb, yb in state.batches(loader):
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(xb), yb).backward()
            opt.step()
            state.step += 1
            if first:
                dml.print(backend, f"FIRST STEP AFTER RESUME AT {time.time():.3f}", all_ranks=False)
                first = False
            state.save_if_due(where)
            if state.step == FAULT_STEP and (not resumed or fault == "bug"):
                if fault in ("cut", "kill-node"):
                    dml.print(backend, "CUT ME" if fault == "cut" else "KILL MY NODE", all_ranks=False)
                    slow = True
                elif victim and fault == "kill-rank":
                    print(f"FAULT AT {time.time():.3f}", flush=True)
                    os.kill(os.getpid(), signal.SIGKILL)
                elif victim and fault == "bug":
                    raise RuntimeError("a bug at step 10")
            if slow:
                time.sleep(0.2)
    state.wait()
    if backend.rank == 0:
        np.save(os.path.join(directory, "final.npy"), torch.cat([p.detach().reshape(-1) for p in model.parameters()]))
    dml.print(backend, f"FINISHED at step {state.step} on {backend.size} ranks", all_ranks=False)


if __name__ == "__main__":
    main(*sys.argv[1:])
