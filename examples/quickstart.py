"""Quickstart: data-parallel training of an MLP fitting y = x².

Each rank trains a replica on its own shard of every batch; gradients are averaged
with ``dml.allreduce`` so all replicas stay identical.

    python examples/quickstart.py            # 2 simulated ranks on LocalBackend (threads)
    python examples/quickstart.py --ranks 4
"""

from __future__ import annotations

import argparse

import torch
from torch import nn

import distutils_ml as dml


def train(backend: dml.Backend, steps: int = 300, batch: int = 128) -> float:
    rank, world = dml.local_rank(backend), dml.total_workers(backend)
    model = nn.Sequential(
        nn.Linear(1, 256), nn.Tanh(), nn.Linear(256, 512), nn.Tanh(), nn.Linear(512, 256), nn.Tanh(), nn.Linear(256, 1)
    )
    for p in model.parameters():  # every replica starts from rank 0's weights
        dml.bcast(backend, p.data, root=0)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(0)  # the same global batches on every rank
    loss = torch.tensor(0.0)
    for step in range(steps):
        x = torch.rand(batch, 1, generator=gen) * 4 - 2
        xs = x[rank::world]  # this rank's shard of the global batch
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(xs), xs**2)
        loss.backward()
        for p in model.parameters():
            dml.allreduce(backend, p.grad, dml.AVG)
        opt.step()
        if step % 50 == 0 or step == steps - 1:
            dml.allreduce(backend, loss.detach(), dml.AVG)
            dml.print(backend, f"step {step:4d}  loss {loss.item():.5f}", all_ranks=False)
    return loss.item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=2, help="simulated ranks (LocalBackend.spawn)")
    parser.add_argument("--steps", type=int, default=300)
    args = parser.parse_args()
    torch.set_num_threads(1)  # ranks are threads here: one intra-op thread each
    losses = dml.LocalBackend.spawn(args.ranks, train, args.steps)
    assert len(set(losses)) == 1, f"replicas disagree: {losses}"
    print(f"final loss {losses[0]:.5f} on {args.ranks} ranks")


if __name__ == "__main__":
    main()
