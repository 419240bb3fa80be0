"""Every documented error of the public API: its type, its message, and a usable world after it.

Each backend-taking case runs on 2 simulated ranks; after the bad call every rank runs a
good allreduce, which would mismatch (and fail) had the bad call sent anything. The
collectives' own table lives in tests/bodies.py (it also runs under mpiexec).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

import distutils_ml as dml
from distutils_ml import launch

from bodies import bad_calls, bad_input_body


def _model() -> torch.nn.Module:
    return torch.nn.Linear(2, 1)


# (name, exception type, message fragment, call taking the backend)
CASES: list[tuple[str, type[Exception], str, Callable[[dml.Backend], Any]]] = [
    # setup
    ("initialize instance", TypeError, "pass the class instead", lambda b: dml.initialize(dml.LocalBackend())),
    ("initialize non-backend", TypeError, "allowed: a backend class", lambda b: dml.initialize(dict)),
    ("get before initialize", RuntimeError, "call dml.initialize(dml.MPIBackend) first", lambda b: dml.get_distributed_backend(dml.MPIBackend)),
    ("local_rank of a class", TypeError, "the class LocalBackend", lambda b: dml.local_rank(dml.LocalBackend)),
    ("total_workers of None", TypeError, "first argument must be a backend", lambda b: dml.total_workers(None)),
    ("print without backend", TypeError, "first argument must be a backend", lambda b: dml.print("hello")),
    ("spawn world size", ValueError, "world_size: got 0", lambda b: dml.LocalBackend.spawn(0, print)),
    ("bad timeout", ValueError, "timeout: got -1", lambda b: dml.LocalBackend.spawn(1, print, stall_timeout=-1)),
    # synchronize
    ("synchronize root", ValueError, "root: got 2", lambda b: dml.synchronize(b, torch.zeros(2), root=2)),
    ("synchronize backend", TypeError, "first argument must be a backend", lambda b: dml.synchronize(torch.zeros(2), b)),
    ("synchronize complex leaf", TypeError, "complex64", lambda b: dml.synchronize(b, {"x": torch.zeros(2, dtype=torch.complex64)})),
    # data container
    ("container backend", TypeError, "first argument must be a backend", lambda b: dml.DistributedDataContainer(None, [1, 2])),
    ("container data", TypeError, "DistributedDataContainer: data: got", lambda b: dml.DistributedDataContainer(b, 42)),
    ("container text", TypeError, "text rather than data", lambda b: dml.DistributedDataContainer(b, "abc")),
    ("container members", ValueError, "members hold different numbers of observations", lambda b: dml.DistributedDataContainer(b, (np.zeros(3), np.zeros(4)))),
    ("container seed", TypeError, "seed: got", lambda b: dml.DistributedDataContainer(b, [1, 2], seed="0")),
    ("container index", IndexError, "", lambda b: dml.DistributedDataContainer(b, [1, 2, 3, 4])[10]),
    ("numobs scalar", TypeError, "no observation axis", lambda b: dml.numobs(np.zeros(()))),
    # optimizer
    ("optimizer backend", TypeError, "first argument must be a backend", lambda b: dml.DistributedOptimizer(torch.optim.SGD(_model().parameters(), lr=1), b)),
    ("optimizer type", TypeError, "optimizer: got Linear", lambda b: dml.DistributedOptimizer(b, _model())),
    ("optimizer twice", TypeError, "already a DistributedOptimizer", lambda b: dml.DistributedOptimizer(b, dml.DistributedOptimizer(b, torch.optim.SGD(_model().parameters(), lr=1)))),
    ("optimizer op", ValueError, "op: got 'mean'", lambda b: dml.DistributedOptimizer(b, torch.optim.SGD(_model().parameters(), lr=1), op="mean")),
    ("optimizer bucket", ValueError, "bucket_bytes: got -5", lambda b: dml.DistributedOptimizer(b, torch.optim.SGD(_model().parameters(), lr=1), bucket_bytes=-5)),
    ("optimizer wire dtype", ValueError, "communication_dtype", lambda b: dml.DistributedOptimizer(b, torch.optim.SGD(_model().parameters(), lr=1), communication_dtype=torch.int32)),
    ("gradients of junk", TypeError, "module_or_params: got int", lambda b: dml.allreduce_gradients(b, 3)),
    # checkpoints
    ("save path type", TypeError, "save: path: got int", lambda b: dml.save(b, {"x": 1}, 42)),
    ("load missing file", FileNotFoundError, "/nonexistent/ckpt.pt", lambda b: dml.load(b, "/nonexistent/ckpt.pt")),
    ("load backend", TypeError, "first argument must be a backend", lambda b: dml.load("ckpt.pt", b)),
    ("gradients of a list of junk", TypeError, "module_or_params: contains str", lambda b: dml.allreduce_gradients(b, ["w"])),
]  # fmt: skip


def _run_case(backend: dml.Backend, case: tuple) -> bool:
    name, exc_type, fragment, call = case
    with pytest.raises(exc_type) as info:
        call(backend)
    assert fragment in str(info.value), f"{name}: {info.value!s} lacks {fragment!r}"
    buf = np.full(2, float(dml.local_rank(backend) + 1))
    dml.allreduce(backend, buf, dml.SUM)  # the world is still usable
    assert (buf == 3.0).all(), f"after {name}: {buf}"
    return True


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_documented_error(case: tuple) -> None:
    assert dml.LocalBackend.spawn(2, _run_case, case, timeout=30) == [True, True]


def test_every_collective_error_and_then_a_good_collective() -> None:
    assert dml.LocalBackend.spawn(2, bad_input_body, 1, timeout=60) == [len(bad_calls(dml.LocalBackend()))] * 2


def test_mpi_backend_option_errors() -> None:
    with pytest.raises(ValueError, match="timeout: got -1"):
        dml.MPIBackend(timeout=-1)
    with pytest.raises(TypeError, match="debug: got 'yes'"):
        dml.MPIBackend(debug="yes")


@pytest.mark.parametrize(
    ("argv", "fragment"),
    [
        (["launch", "script.py"], "give the number of ranks with -n N"),
        (["launch", "-n", "two", "script.py"], "takes a positive whole number"),
        (["launch", "-n", "2"], "script"),
        (["run", "-n", "2", "x.py"], "unknown command 'run'"),
    ],
)
def test_launcher_errors(argv: list[str], fragment: str, capsys) -> None:
    assert launch.main(argv) == 2
    assert fragment in capsys.readouterr().err


@pytest.mark.skipif(os.geteuid() != 0, reason="the root refusal only applies to root")
def test_launcher_refuses_root_without_permission(monkeypatch, capsys) -> None:
    for var in ("OMPI_ALLOW_RUN_AS_ROOT", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM"):
        monkeypatch.delenv(var, raising=False)
    if launch.find_mpiexec(None) is None:
        pytest.skip("no mpiexec")
    assert launch.main(["launch", "-n", "2", "--dry-run", "x.py"]) == 2
    assert "--allow-run-as-root" in capsys.readouterr().err
