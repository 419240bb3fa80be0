"""One mpiexec job for the plain MPI jobs of many test modules: ``python tests/shared_job.py PARTS_JSON``.

PARTS_JSON is a list of ``[name, module, args]`` (tests/shared.py makes it). Each part's ``main`` runs in this process,
in turn, as its own job would run it: the same checks, the same banner. Rank 0 prints ``SHARED PART <name> BEGINS``
before each part and ``SHARED PART <name> ENDS`` once every rank has passed a barrier after it. The check lines of
tests/mpi_main.py's ``run_checks`` carry the part's name (``<name>: check X passed``), so each test counts its own.

A failing check aborts the job, as it does in its own script: the parts after it do not begin. Every rank starts
once instead of once per part (why: tests/shared.py).
"""

from __future__ import annotations

import importlib
import inspect
import json
import sys
from typing import Any

from mpi4py import MPI

import mpi_main


def run_part(module: Any, args: list[str]) -> None:
    """The part's ``main``, called as its script's ``if __name__ == "__main__"`` calls it."""
    params = list(inspect.signature(module.main).parameters.values())
    if not params:
        assert not args, (module.__name__, args)
        module.main()
    elif params[0].annotation in (str, "str"):
        module.main(*args)
    else:
        module.main(args)


def main(parts: list[tuple[str, str, list[str]]]) -> None:
    rank = MPI.COMM_WORLD.Get_rank()
    for name, module_name, args in parts:
        if rank == 0:
            print(f"SHARED PART {name} BEGINS", flush=True)
        mpi_main.PART = name
        run_part(importlib.import_module(module_name), args)
        mpi_main.PART = ""
        sys.stdout.flush()
        MPI.COMM_WORLD.Barrier()
        if rank == 0:
            print(f"SHARED PART {name} ENDS", flush=True)


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
