"""Quickstart: data-parallel training of an MLP fitting y = x².

Each rank trains a replica on its own shard of every batch; DistributedOptimizer
averages the gradients, so all replicas stay identical.

    distutils-ml launch -n 2 examples/quickstart.py   # 2 MPI processes
    python examples/quickstart.py                      # 2 simulated ranks (LocalBackend.spawn)
    python examples/quickstart.py --ranks 4
"""

from __future__ import annotations

import argparse
import os

import torch
from torch import nn

import distutils_ml as dml


def train(backend: dml.Backend, steps: int = 300, batch: int = 128) -> float:
    rank, world = dml.local_rank(backend), dml.total_workers(backend)
    model = nn.Sequential(
        nn.Linear(1, 256), nn.Tanh(), nn.Linear(256, 512), nn.Tanh(), nn.Linear(512, 256), nn.Tanh(), nn.Linear(256, 1)
    )
    model = dml.synchronize(backend, model)  # every replica starts from rank 0's weights
    opt = dml.DistributedOptimizer(backend, torch.optim.Adam(model.parameters(), lr=1e-3))
    opt = dml.synchronize(backend, opt)
    gen = torch.Generator().manual_seed(0)  # the same global batches on every rank
    loss = torch.zeros(())
    for step in range(steps):
        x = torch.rand(batch, 1, generator=gen) * 4 - 2
        xs = x[rank::world]  # this rank's shard of the global batch
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(xs), xs**2)
        loss.backward()
        opt.step()
        if step % 50 == 0 or step == steps - 1:
            global_loss = dml.allreduce(backend, loss.detach().clone(), dml.AVG)
            dml.print(backend, f"step {step:4d}  loss {global_loss.item():.5f}", all_ranks=False)
    return dml.allreduce(backend, loss.detach().clone(), dml.AVG).item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=2, help="simulated ranks when not launched by MPI")
    parser.add_argument("--steps", type=int, default=300)
    args = parser.parse_args()
    if "OMPI_COMM_WORLD_SIZE" in os.environ or "PMI_SIZE" in os.environ:  # started by mpiexec
        dml.initialize(dml.MPIBackend)
        loss = train(dml.get_distributed_backend(dml.MPIBackend), args.steps)
        dml.print(dml.get_distributed_backend(dml.MPIBackend), f"final loss {loss:.5f}", all_ranks=False)
    else:
        torch.set_num_threads(1)  # ranks are threads here: one intra-op thread each
        losses = dml.LocalBackend.spawn(args.ranks, train, args.steps)
        print(f"final loss {losses[0]:.5f} on {args.ranks} simulated ranks")


if __name__ == "__main__":
    main()
