"""Every documented error of the public API: its type, its message, and a usable world after it.

Local errors (raised on the calling rank before anything is sent) run on 2 simulated
ranks with the bad call on one rank only, rank 0 or rank 1; then every rank runs a good
allreduce and checks its result. Had the bad call sent anything, that allreduce would
meet it and fail (LocalBackend compares every collective's fingerprint) or hang (the
spawn timeout). Collective errors (known only to rank 0, raised on every rank) are
called by every rank. The collectives' own table lives in tests/bodies.py (it also runs
under mpiexec).
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

import distutils_ml as dml
from distutils_ml import launch

from bodies import bad_calls, bad_input_body
from mpirun import requires_mpi


def _model() -> torch.nn.Module:
    return torch.nn.Linear(2, 1)


def _container(b: dml.Backend) -> dml.DistributedDataContainer:
    return dml.DistributedDataContainer(b, [1, 2, 3, 4])


def _sparse_step(b: dml.Backend) -> None:
    param = torch.zeros(3).to_sparse().requires_grad_()
    dml.DistributedOptimizer(b, torch.optim.SGD([param], lr=1)).step()


class _Fresh(dml.LocalBackend):
    """A backend type that no test initializes successfully (every call here fails)."""


NAN = float("nan")

# (name, exception type, message fragment, call taking the backend): raised before any communication
LOCAL_CASES: list[tuple[str, type[Exception], str, Callable[[dml.Backend], Any]]] = [
    # setup
    ("initialize instance", TypeError, "pass the class instead", lambda b: dml.initialize(dml.LocalBackend())),
    ("initialize non-backend", TypeError, "allowed: a backend class", lambda b: dml.initialize(dict)),
    ("initialize timeout -1", ValueError, "timeout: got -1; allowed: a finite number of seconds >= 0", lambda b: dml.initialize(_Fresh, timeout=-1)),
    ("initialize timeout nan", ValueError, "timeout: got nan; allowed: a finite number", lambda b: dml.initialize(_Fresh, timeout=NAN)),
    ("initialize timeout inf", ValueError, "timeout: got inf; allowed: a finite number", lambda b: dml.initialize(_Fresh, timeout=math.inf)),
    ("initialize debug", TypeError, "debug: got 'yes'; allowed: True or False", lambda b: dml.initialize(_Fresh, debug="yes")),
    ("initialize MPI-only option", TypeError, "got the option(s) segment_bytes; allowed: timeout, debug", lambda b: dml.initialize(_Fresh, segment_bytes=4)),
    ("get before initialize", RuntimeError, "call dml.initialize(dml.MPIBackend) first", lambda b: dml.get_distributed_backend(dml.MPIBackend)),
    ("local_rank of a class", TypeError, "the class LocalBackend", lambda b: dml.local_rank(dml.LocalBackend)),
    ("total_workers of None", TypeError, "first argument must be a backend", lambda b: dml.total_workers(None)),
    ("print without backend", TypeError, "first argument must be a backend", lambda b: dml.print("hello")),
    ("spawn world size", ValueError, "world_size: got 0", lambda b: dml.LocalBackend.spawn(0, print)),
    ("spawn stall_timeout -1", ValueError, "stall_timeout: got -1", lambda b: dml.LocalBackend.spawn(1, print, stall_timeout=-1)),
    ("spawn stall_timeout nan", ValueError, "stall_timeout: got nan", lambda b: dml.LocalBackend.spawn(1, print, stall_timeout=NAN)),
    # synchronize
    ("synchronize root", ValueError, "root: got 2", lambda b: dml.synchronize(b, torch.zeros(2), root=2)),
    ("synchronize backend", TypeError, "first argument must be a backend", lambda b: dml.synchronize(torch.zeros(2), b)),
    # data container
    ("container backend", TypeError, "first argument must be a backend", lambda b: dml.DistributedDataContainer(None, [1, 2])),
    ("container data", TypeError, "DistributedDataContainer: data: got", lambda b: dml.DistributedDataContainer(b, 42)),
    ("container text", TypeError, "text rather than data", lambda b: dml.DistributedDataContainer(b, "abc")),
    ("container members", ValueError, "members hold different numbers of observations", lambda b: dml.DistributedDataContainer(b, (np.zeros(3), np.zeros(4)))),
    ("container seed", TypeError, "seed: got", lambda b: dml.DistributedDataContainer(b, [1, 2], seed="0")),
    ("container shuffle", TypeError, "DistributedDataContainer: shuffle: got str 'yes'; allowed: True or False", lambda b: dml.DistributedDataContainer(b, [1, 2], shuffle="yes")),
    ("container drop_last", TypeError, "DistributedDataContainer: drop_last: got int 1; allowed: True or False", lambda b: dml.DistributedDataContainer(b, [1, 2], drop_last=1)),
    ("container index", IndexError, "index 10 is out of range for this rank's 2 observations (allowed: -2 .. 1)", lambda b: _container(b)[10]),
    ("set_epoch str", TypeError, "set_epoch: epoch: got str '1'; allowed: an int", lambda b: _container(b).set_epoch("1")),
    ("set_epoch float", TypeError, "set_epoch: epoch: got float 1.5; allowed: an int", lambda b: _container(b).set_epoch(1.5)),
    ("set_epoch range", ValueError, f"set_epoch: epoch: got {2**63}; allowed: an int in", lambda b: _container(b).set_epoch(2**63)),
    ("numobs scalar", TypeError, "no observation axis", lambda b: dml.numobs(np.zeros(()))),
    # optimizer
    ("optimizer backend", TypeError, "first argument must be a backend", lambda b: dml.DistributedOptimizer(torch.optim.SGD(_model().parameters(), lr=1), b)),
    ("optimizer type", TypeError, "optimizer: got Linear", lambda b: dml.DistributedOptimizer(b, _model())),
    ("optimizer twice", TypeError, "already a DistributedOptimizer", lambda b: dml.DistributedOptimizer(b, dml.DistributedOptimizer(b, torch.optim.SGD(_model().parameters(), lr=1)))),
    ("optimizer op", ValueError, "op: got 'mean'", lambda b: dml.DistributedOptimizer(b, torch.optim.SGD(_model().parameters(), lr=1), op="mean")),
    ("optimizer bucket", ValueError, "bucket_bytes: got -5", lambda b: dml.DistributedOptimizer(b, torch.optim.SGD(_model().parameters(), lr=1), bucket_bytes=-5)),
    ("optimizer wire dtype", ValueError, "communication_dtype", lambda b: dml.DistributedOptimizer(b, torch.optim.SGD(_model().parameters(), lr=1), communication_dtype=torch.int32)),
    ("optimizer sparse parameter", TypeError, "sparse parameters are not supported; use dense tensors", _sparse_step),
    ("gradients of junk", TypeError, "module_or_params: got int", lambda b: dml.allreduce_gradients(b, 3)),
    ("gradients of a list of junk", TypeError, "module_or_params: contains str", lambda b: dml.allreduce_gradients(b, ["w"])),
    ("gradients of an integer tensor", TypeError, "parameter of dtype torch.int64; gradients must be floating point", lambda b: dml.allreduce_gradients(b, torch.zeros(2, dtype=torch.int64))),
    # checkpoints
    ("save path type", TypeError, "save: path: got int", lambda b: dml.save(b, {"x": 1}, 42)),
    ("load backend", TypeError, "first argument must be a backend", lambda b: dml.load("ckpt.pt", b)),
]  # fmt: skip

# Errors that only rank 0 can see (it reads and writes checkpoints): every rank calls, every rank raises.
COLLECTIVE_CASES: list[tuple[str, type[Exception], str, Callable[[dml.Backend], Any]]] = [
    ("synchronize complex leaf", TypeError, "complex64", lambda b: dml.synchronize(b, {"x": torch.zeros(2, dtype=torch.complex64)})),
    ("load missing file", FileNotFoundError, "load: could not read the checkpoint '/nonexistent/ckpt.pt': rank 0: FileNotFoundError", lambda b: dml.load(b, "/nonexistent/ckpt.pt")),
    ("save missing directory", FileNotFoundError, "'/nonexistent' of '/nonexistent/ckpt.pt' does not exist", lambda b: dml.save(b, {"x": 1}, "/nonexistent/ckpt.pt")),
    ("save a plain DataLoader", TypeError, "a torch.utils.data.DataLoader has no state to save", lambda b: dml.save(b, {"loader": torch.utils.data.DataLoader(_container(b))}, "/nonexistent/ckpt.pt")),
]  # fmt: skip


def _good_allreduce(backend: dml.Backend, after: str) -> None:
    rank, size = dml.local_rank(backend), dml.total_workers(backend)
    buf = np.full(2, float(rank + 1))
    dml.allreduce(backend, buf, dml.SUM)  # the world is still usable
    assert (buf == size * (size + 1) / 2).all(), f"after {after}: {buf}"


def _expect(case: tuple) -> None:
    name, exc_type, fragment, call = case
    with pytest.raises(exc_type) as info:
        call(dml.get_distributed_backend(dml.LocalBackend))
    assert fragment in str(info.value), f"{name}: {info.value!s} lacks {fragment!r}"


def _local_case(backend: dml.Backend, case: tuple, culprit: int) -> bool:
    if dml.local_rank(backend) == culprit:
        _expect(case)
    _good_allreduce(backend, case[0])
    return True


def _collective_case(backend: dml.Backend, case: tuple) -> bool:
    _expect(case)
    _good_allreduce(backend, case[0])
    return True


@pytest.mark.parametrize("culprit", [0, 1])
@pytest.mark.parametrize("case", LOCAL_CASES, ids=[c[0] for c in LOCAL_CASES])
def test_local_error_on_one_rank(case: tuple, culprit: int) -> None:
    assert dml.LocalBackend.spawn(2, _local_case, case, culprit, timeout=30) == [True, True]


@pytest.mark.parametrize("case", COLLECTIVE_CASES, ids=[c[0] for c in COLLECTIVE_CASES])
def test_collective_error_on_every_rank(case: tuple) -> None:
    assert dml.LocalBackend.spawn(2, _collective_case, case, timeout=30) == [True, True]


def test_every_collective_error_and_then_a_good_collective() -> None:
    assert dml.LocalBackend.spawn(2, bad_input_body, 1, timeout=60) == [len(bad_calls(dml.LocalBackend()))] * 2


@pytest.mark.parametrize(
    ("options", "error", "fragment"),
    [
        ({"timeout": -1}, ValueError, "timeout: got -1; allowed: a finite number of seconds >= 0"),
        ({"timeout": NAN}, ValueError, "timeout: got nan"),
        ({"timeout": math.inf}, ValueError, "timeout: got inf"),
        ({"timeout": "60"}, ValueError, "timeout: got '60'"),
        ({"debug": "yes"}, TypeError, "debug: got 'yes'; allowed: True or False"),
    ],
)
@pytest.mark.parametrize("how", ["constructor", "initialize"])
def test_mpi_backend_option_errors(options: dict, error: type, fragment: str, how: str) -> None:
    # Checked before MPI starts: no mpi4py needed.
    with pytest.raises(error) as info:
        dml.MPIBackend(**options) if how == "constructor" else dml.initialize(dml.MPIBackend, **options)
    assert fragment in str(info.value)
    assert not dml.initialized(dml.MPIBackend)


@requires_mpi
@pytest.mark.parametrize(
    ("segment_bytes", "error", "fragment"),
    [
        ("4", TypeError, "segment_bytes: got '4'"),
        (True, TypeError, "segment_bytes: got True"),
        (16.5, TypeError, "segment_bytes: got 16.5"),
        (-1, ValueError, "segment_bytes: got -1"),
    ],
)
def test_mpi_backend_segment_bytes_errors(segment_bytes: Any, error: type, fragment: str) -> None:
    with pytest.raises(error) as info:
        dml.MPIBackend(segment_bytes=segment_bytes, fail_fast=False, timeout=0)
    assert fragment in str(info.value)


@pytest.mark.parametrize(
    ("argv", "fragment"),
    [
        (["launch", "script.py"], "give the number of ranks with -n N"),
        (["launch", "-n", "two", "script.py"], "takes a positive whole number"),
        (["launch", "-n", "2"], "script"),
        (["run", "-n", "2", "x.py"], "unknown command 'run'"),
        (
            ["launch", "-n", "2", "--threads-per-rank", "0", "x.py"],
            "--threads-per-rank takes a positive whole number, got '0'",
        ),
        (
            ["launch", "-n", "2", "--threads-per-rank=two", "x.py"],
            "--threads-per-rank takes a positive whole number, got 'two'",
        ),
        (["launch", "-n", "2", "--threads-per-rank"], "--threads-per-rank needs a number after it"),
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
