"""The jobs of tests/test_slurm.py, run under ``srun``/``sbatch`` and under ``mpiexec`` alike.

``python tests/slurm_job.py MODE [PATH]`` where MODE is

- ``train OUT``: a short seeded training run (DistributedDataContainer, DistributedOptimizer); rank 0 writes
  the final parameters to ``OUT`` (``.npy``);
- ``info OUT``: rank 0 writes every rank's view to ``OUT`` (JSON): host, ``node_local_rank``, ``node_size``, the
  SLURM variables it was given, the backend's stall timeout, and the GPU it would pick
  (:func:`distutils_ml.backends.nccl.choose_devices`, with the GPUs it sees: those of ``CUDA_VISIBLE_DEVICES``,
  else the node's 2, named ``<host>/gpu<k>``);
- ``checkpoint PATH``: trains a 16 MiB model and saves a checkpoint to ``PATH`` after every step, forever,
  printing ``saved <k>``;
- ``steps``: trains forever, 0.2 s a step, printing ``step <k> done`` (for a node to die meanwhile).
"""

from __future__ import annotations

import faulthandler
import json
import os
import signal
import sys
import time

import numpy as np
import torch

import distutils_ml as dml
from distutils_ml.backends.nccl import choose_devices

GPUS_PER_NODE = 2


def train(backend: dml.Backend, out: str) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    model = dml.synchronize(backend, model)
    opt = dml.DistributedOptimizer(backend, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9))
    g = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(torch.randn(96, 8, generator=g), torch.randn(96, 1, generator=g))
    ddc = dml.DistributedDataContainer(backend, data)
    for _epoch in range(3):
        for xb, yb in torch.utils.data.DataLoader(ddc, batch_size=4):
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(xb), yb).backward()
            opt.step()
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy()
    if backend.rank == 0:
        np.save(out, flat)
    dml.print(backend, f"trained on {backend.size} ranks")


def info(backend: dml.Backend, out: str) -> None:
    host = os.uname().nodename
    seen = os.environ.get("CUDA_VISIBLE_DEVICES")
    gpus = [f"{host}/gpu{k}" for k in (seen.split(",") if seen else range(GPUS_PER_NODE))]
    mine = {
        "rank": backend.rank,
        "host": host,
        "node_local_rank": backend.node_local_rank,
        "node_size": backend.node_size,
        "timeout": backend.timeout,
        "visible": gpus,
        **{k: v for k, v in os.environ.items() if k.startswith("SLURM_") or k == "CUDA_VISIBLE_DEVICES"},
    }
    every = dml.allgather_object(backend, mine)
    picks = choose_devices(None, [r["visible"] for r in every], [r["host"] for r in every],
                           [r["node_local_rank"] for r in every])  # fmt: skip
    for r, pick in zip(every, picks, strict=True):
        r["gpu"] = r["visible"][pick] if isinstance(pick, int) else pick
    if backend.rank == 0:
        with open(out, "w") as f:
            json.dump(every, f)
    dml.print(backend, f"info of {backend.size} ranks written")


def checkpoint(backend: dml.Backend, path: str) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(2048, 2048)  # 16 MiB of parameters: a save takes a while
    opt = dml.DistributedOptimizer(backend, torch.optim.SGD(model.parameters(), lr=0.01))
    k = 0
    while True:
        opt.zero_grad()
        model(torch.randn(4, 2048)).square().mean().backward()
        opt.step()
        dml.save(backend, {"model": model, "step": k}, path)
        dml.print(backend, f"saved {k}")
        k += 1


def steps(backend: dml.Backend) -> None:
    model = torch.nn.Linear(8, 1)
    opt = dml.DistributedOptimizer(backend, torch.optim.SGD(model.parameters(), lr=0.1))
    k = 0
    while True:
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(torch.randn(4, 8)), torch.randn(4, 1)).backward()
        opt.step()
        dml.print(backend, f"step {k} done")
        time.sleep(0.2)
        k += 1


def main(mode: str, path: str = "") -> None:
    faulthandler.register(signal.SIGUSR1)
    torch.set_num_threads(1)
    dml.initialize(dml.MPIBackend)
    backend = dml.get_distributed_backend(dml.MPIBackend)
    if mode == "train":
        train(backend, path)
    elif mode == "info":
        info(backend, path)
    elif mode == "checkpoint":
        checkpoint(backend, path)
    elif mode == "steps":
        steps(backend)
    else:
        raise SystemExit(f"unknown mode {mode!r}; allowed: train, info, checkpoint, steps")


if __name__ == "__main__":
    main(*sys.argv[1:])
