"""The MPI job of tests/test_checkpoint.py: 10 steps straight, or 5 steps, a checkpoint, and 5 more.

Run: ``mpiexec -n N python tests/checkpoint_job.py MODE CHECKPOINT OUT`` where MODE is

- ``straight``: train 10 steps;
- ``first-half``: train 5 steps, then ``save`` everything to CHECKPOINT;
- ``second-half``: build everything anew, ``load`` CHECKPOINT, restore, train the last 5 steps.

The training touches every piece of state a resume must restore: Adam's moments
(inside a DistributedOptimizer), a shuffled DistributedDataContainer read by a
StatefulDataLoader (the checkpoint falls mid-epoch, the resumed run crosses into the
next epoch), and three random streams that differ across ranks (torch: dropout;
NumPy: input noise; Python's random: a loss scale). Rank 0 writes OUT: the model's and
optimizer's state and the losses of this job's steps, for the test to compare bitwise.
"""

from __future__ import annotations

import random
import sys
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from torchdata.stateful_dataloader import StatefulDataLoader

import distutils_ml as dml
from distutils_ml.checkpoint import load, rng_state, save, set_rng_state

STEPS = 10
HALF = 5


def build(backend: dml.Backend) -> tuple[torch.nn.Module, dml.DistributedOptimizer, Any, StatefulDataLoader]:
    """Model, optimizer, data and loader, built the same way by every job."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 16), torch.nn.ReLU(), torch.nn.Dropout(0.3), torch.nn.Linear(16, 2))
    model = dml.synchronize(backend, model)
    opt = dml.DistributedOptimizer(backend, torch.optim.Adam(model.parameters(), lr=0.01))
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(64, 3, generator=g), torch.randn(64, 2, generator=g)
    ddc = dml.DistributedDataContainer(backend, (x, y), shuffle=True, seed=7)  # 32 per rank: 8 batches an epoch
    # The loader's own generator: starting an epoch then draws nothing from the global RNG.
    loader = StatefulDataLoader(ddc, batch_size=4, generator=torch.Generator())
    rank = dml.local_rank(backend)
    torch.manual_seed(1000 + rank)
    np.random.seed(2000 + rank)
    random.seed(3000 + rank)
    return model, opt, ddc, loader


def batches(ddc: Any, loader: StatefulDataLoader) -> Iterator[Any]:
    """Batches forever, epoch after epoch, from the container's current epoch on."""
    epoch = ddc.epoch
    while True:
        ddc.set_epoch(epoch)
        yield from loader
        epoch += 1


def main(mode: str, checkpoint: str, out: str) -> None:
    dml.initialize(dml.MPIBackend)
    backend = dml.get_distributed_backend(dml.MPIBackend)
    rank, size = dml.local_rank(backend), dml.total_workers(backend)
    model, opt, ddc, loader = build(backend)
    step, stop = 0, {"straight": STEPS, "first-half": HALF, "second-half": STEPS}[mode]
    if mode == "second-half":
        ckpt = load(backend, checkpoint)
        model.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["opt"])
        ddc.set_epoch(ckpt["data"]["epoch"])
        loader.load_state_dict(ckpt["loader"])
        step = ckpt["step"]
        set_rng_state(ckpt["rng"][rank])
    model.train()
    losses = []
    stream = batches(ddc, loader)
    while step < stop:
        xb, yb = next(stream)
        xb = xb + 0.01 * torch.from_numpy(np.random.standard_normal(tuple(xb.shape))).float()
        loss = torch.nn.functional.mse_loss(model(xb), yb) * random.uniform(0.9, 1.1)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
        step += 1
    if mode == "first-half":
        # Every rank's random streams: rank r's own state, gathered by a broadcast from r.
        rngs = [dml.synchronize(backend, rng_state(), root=r) for r in range(size)]
        save(
            backend, {"model": model, "opt": opt, "data": ddc, "loader": loader, "step": step, "rng": rngs}, checkpoint
        )
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    every = torch.empty(size, flat.numel())
    dml.allgather(backend, flat, every)
    assert bool((every == every[0]).all()), "replicas differ"
    save(backend, {"model": model, "opt": opt, "losses": losses, "epoch": ddc.epoch}, out)
    dml.print(backend, f"{mode}: {len(losses)} steps, now at step {step} of epoch {ddc.epoch}", all_ranks=False)


if __name__ == "__main__":
    main(*sys.argv[1:])
