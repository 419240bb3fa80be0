"""Run by tests/test_launch.py and tests/test_cluster.py under ``distutils-ml launch``: each rank reports what it got.

With ``--wait DIR`` each rank then writes its process id to ``DIR/rank<r>.pid`` and sleeps,
for the tests that end the launcher and look for surviving ranks.
"""

import os
import sys
import time
from pathlib import Path

import torch
from mpi4py import MPI

comm = MPI.COMM_WORLD
print(
    f"rank {comm.rank} of {comm.size}: threads {torch.get_num_threads()} "
    f"cpus {len(os.sched_getaffinity(0))} args {sys.argv[1:]} host {MPI.Get_processor_name()} "
    f"DML_TIMEOUT {os.environ.get('DML_TIMEOUT')} runner {' '.join(sys.orig_argv[1:3])}",
    flush=True,
)
if "--wait" in sys.argv:
    ready = Path(sys.argv[sys.argv.index("--wait") + 1]) / f"rank{comm.rank}.pid"
    ready.with_suffix(".tmp").write_text(str(os.getpid()))
    ready.with_suffix(".tmp").rename(ready)
    time.sleep(300)
