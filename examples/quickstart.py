"""Quickstart: data-parallel training of an MLP fitting y = x².

Each rank trains a replica on its own shard of every batch; DistributedOptimizer
averages the gradients, so all replicas stay identical.

    distutils-ml launch -n 2 examples/quickstart.py   # 2 MPI processes
    python examples/quickstart.py                      # 2 simulated ranks (LocalBackend.spawn)
    python examples/quickstart.py --ranks 4
    distutils-ml launch -n 2 examples/quickstart.py --device cuda --backend nccl   # GPUs
"""

from __future__ import annotations

import argparse
import os

import torch
from torch import nn

import distutils_ml as dml


def train(backend: dml.Backend, steps: int = 300, batch: int = 128, device: str = "cpu") -> float:
    rank, world = dml.local_rank(backend), dml.total_workers(backend)
    model = nn.Sequential(
        nn.Linear(1, 256), nn.Tanh(), nn.Linear(256, 512), nn.Tanh(), nn.Linear(512, 256), nn.Tanh(), nn.Linear(256, 1)
    ).to(device)
    model = dml.synchronize(backend, model)  # every replica starts from rank 0's weights
    opt = dml.DistributedOptimizer(backend, torch.optim.Adam(model.parameters(), lr=1e-3))
    opt = dml.synchronize(backend, opt)
    gen = torch.Generator().manual_seed(0)  # the same global batches on every rank
    loss = torch.zeros(())
    for step in range(steps):
        x = torch.rand(batch, 1, generator=gen) * 4 - 2
        xs = x[rank::world].to(device)  # this rank's shard of the global batch
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
    parser.add_argument("--device", default="cpu", help="cpu, or cuda (each process uses its GPU)")
    parser.add_argument("--backend", choices=["mpi", "nccl"], default="mpi", help="under mpiexec; nccl needs GPUs")
    args = parser.parse_args()
    if "OMPI_COMM_WORLD_SIZE" in os.environ or "PMI_SIZE" in os.environ:  # started by mpiexec
        backend_type = dml.NCCLBackend if args.backend == "nccl" else dml.MPIBackend
        dml.initialize(backend_type)
        backend = dml.get_distributed_backend(backend_type)
        if args.device == "cuda" and backend_type is dml.MPIBackend:  # NCCLBackend picks the GPU itself
            torch.cuda.set_device(backend.node_local_rank % torch.cuda.device_count())
        loss = train(backend, args.steps, device=args.device)
        dml.print(backend, f"final loss {loss:.5f}", all_ranks=False)
    else:
        torch.set_num_threads(1)  # ranks are threads here: one intra-op thread each
        losses = dml.LocalBackend.spawn(args.ranks, train, args.steps, 128, args.device)
        print(f"final loss {losses[0]:.5f} on {args.ranks} simulated ranks")


if __name__ == "__main__":
    main()
