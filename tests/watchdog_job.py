"""The MPI jobs of tests/test_watchdog.py: stall detection as a user turns it on.

Run: ``mpiexec -n 3 python tests/watchdog_job.py MODE`` where MODE is

- ``stall``: the backend comes from ``dml.initialize(dml.MPIBackend)``, its timeout
  from the environment (``DML_TIMEOUT``); rank 2 sleeps instead of joining the second
  allreduce, so the others' watchdogs must warn at a quarter of the timeout, name the
  collective and rank 2, and end the job;
- ``slow``: ``dml.initialize(dml.MPIBackend, timeout=2)``; every rank joins an object
  broadcast whose root takes 3 s to pickle its object, longer than the timeout. Nobody
  is missing, so the job must not be ended: the waiting ranks warn and go on. Then a
  debug-mode backend checks that ``AVG`` on one rank against ``SUM`` on the others is
  named as a mismatch.

A job that gets past its stall prints ``NOT ABORTED``.
"""

from __future__ import annotations

import faulthandler
import signal
import sys
import time
from typing import Any

import numpy as np

import distutils_ml as dml

SLOW_S = 3.0


class SlowToPickle:
    """An object whose pickling takes ``SLOW_S`` seconds (on the root, inside the broadcast)."""

    def __init__(self, value: int) -> None:
        self.value = value

    def __getstate__(self) -> dict[str, Any]:
        time.sleep(SLOW_S)
        return self.__dict__


def stall(backend: dml.MPIBackend) -> None:
    dml.allreduce(backend, np.ones(2), dml.SUM)
    if dml.local_rank(backend) == 2:
        time.sleep(120)
    dml.allreduce(backend, np.ones(4, dtype=np.float32), dml.SUM)
    dml.print(backend, "NOT ABORTED")


def slow(backend: dml.MPIBackend) -> None:
    rank = dml.local_rank(backend)
    dml.barrier(backend)  # #1: every rank then enters the broadcast at once, however slowly it started
    got = backend._bcast_object(SlowToPickle(7) if rank == 0 else None, 0)
    assert got.value == 7, got
    dml.barrier(backend)
    checker = dml.MPIBackend(debug=True, timeout=0)
    try:
        dml.allreduce(checker, np.ones(2), dml.AVG if rank == 0 else dml.SUM)
    except dml.CollectiveMismatchError as err:
        dml.print(backend, f"mismatch: {err}")
    else:
        raise AssertionError("AVG against SUM was not named")
    dml.barrier(backend)
    dml.print(backend, "NOT ABORTED")


def main(mode: str) -> None:
    faulthandler.register(signal.SIGUSR1)  # the test runner asks for stacks before killing a hung job
    if mode == "stall":
        dml.initialize(dml.MPIBackend)
    elif mode == "slow":
        dml.initialize(dml.MPIBackend, timeout=2)
    else:
        raise SystemExit(f"unknown mode {mode!r}; allowed: stall, slow")
    backend = dml.get_distributed_backend(dml.MPIBackend)
    dml.print(backend, f"timeout={backend.timeout:g}")
    stall(backend) if mode == "stall" else slow(backend)


if __name__ == "__main__":
    main(*sys.argv[1:])
