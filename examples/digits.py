"""Digits: a data-parallel classifier on scikit-learn's bundled 8x8 digits (no download).

Each rank reads its share of the training set through a DistributedDataContainer and
a DataLoader; DistributedOptimizer averages gradients. Evaluation is exact: each rank
scores its share of the test set without the padding observations, and the counts
are summed across ranks. Rank 0 alone shows a progress bar, logs and writes the
checkpoint.

    distutils-ml launch -n 2 examples/digits.py      # 2 MPI processes
    python examples/digits.py                         # 2 simulated ranks (LocalBackend.spawn)
"""

from __future__ import annotations

import argparse
import os

import numpy as np
import torch
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch import nn
from torch.utils.data import DataLoader
from tqdm import tqdm

import distutils_ml as dml


def load() -> tuple[tuple[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]:
    x, y = load_digits(return_X_y=True)
    x = (x / 16.0).astype(np.float32)
    x_train, x_test, y_train, y_test = train_test_split(x, y, test_size=0.25, random_state=0, stratify=y)
    return (x_train, y_train.astype(np.int64)), (x_test, y_test.astype(np.int64))


def evaluate(backend: dml.Backend, model: nn.Module, test: tuple[np.ndarray, np.ndarray]) -> float:
    """Exact accuracy on the whole test set: each rank scores its share without the padding, then
    ``gather_unpadded`` puts every observation's result on every rank, once, in dataset order."""
    share = dml.DistributedDataContainer(backend, test)
    model.eval()
    hits = []
    with torch.no_grad():
        for x, y in DataLoader(share.unpadded(), batch_size=256):
            hits.append(model(x).argmax(1) == y)
    model.train()
    every = dml.gather_unpadded(backend, torch.cat(hits), share)
    assert len(every) == len(test[1]), "every test observation is scored exactly once"
    return float(every.float().mean())


def train(backend: dml.Backend, epochs: int = 30, batch: int = 32, checkpoint: str = "digits.pt") -> float:
    rank = dml.local_rank(backend)
    train_set, test_set = load()
    model = dml.synchronize(backend, nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10)))
    opt = dml.DistributedOptimizer(backend, torch.optim.Adam(model.parameters(), lr=3e-3))
    opt = dml.synchronize(backend, opt)
    data = dml.DistributedDataContainer(backend, train_set, shuffle=True, seed=42)
    # The container shuffles per epoch; the loader's own generator keeps starting an epoch from
    # drawing on the global RNG (dropout's), so a run resumed from a checkpoint is exact.
    loader = DataLoader(data, batch_size=batch, shuffle=False, generator=torch.Generator())
    bar = tqdm(range(epochs), desc="digits", disable=rank != 0, leave=False)
    for epoch in bar:
        data.set_epoch(epoch)
        for x, y in loader:
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
        if epoch % 10 == 9 or epoch == epochs - 1:
            acc = evaluate(backend, model, test_set)
            bar.set_postfix(test_accuracy=f"{acc:.3f}")
            dml.print(backend, f"epoch {epoch + 1:3d}  test accuracy {acc:.4f}", all_ranks=False)
    acc = evaluate(backend, model, test_set)
    # Written by rank 0 alone, atomically; live objects are saved as their state_dict(), with every
    # rank's random streams (restore them with dml.set_rng_state_all(backend, ckpt["rng"])).
    state = {"model": model, "optimizer": opt, "data": data, "epochs": epochs, "rng": dml.rng_state_all(backend)}
    dml.save(backend, state, checkpoint)
    return acc


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=2, help="simulated ranks when not launched by MPI")
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--checkpoint", default="digits.pt")
    args = parser.parse_args()
    if "OMPI_COMM_WORLD_SIZE" in os.environ or "PMI_SIZE" in os.environ:  # started by mpiexec
        dml.initialize(dml.MPIBackend)
        backend = dml.get_distributed_backend(dml.MPIBackend)
        acc = train(backend, args.epochs, checkpoint=args.checkpoint)
        dml.print(backend, f"final test accuracy {acc:.4f}; checkpoint {args.checkpoint}", all_ranks=False)
    else:
        torch.set_num_threads(1)
        acc = dml.LocalBackend.spawn(args.ranks, train, args.epochs, 32, args.checkpoint)[0]
        print(f"final test accuracy {acc:.4f} on {args.ranks} simulated ranks; checkpoint {args.checkpoint}")
    if acc < 0.95:
        raise SystemExit(f"test accuracy {acc:.4f} is below 0.95")


if __name__ == "__main__":
    main()
