"""Run by tests/test_launch.py under ``distutils-ml launch``: each rank reports what it got."""

import os
import sys

import torch
from mpi4py import MPI

comm = MPI.COMM_WORLD
print(
    f"rank {comm.rank} of {comm.size}: threads {torch.get_num_threads()} "
    f"cpus {len(os.sched_getaffinity(0))} args {sys.argv[1:]}",
    flush=True,
)
