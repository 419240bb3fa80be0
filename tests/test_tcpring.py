"""The TCP ring of distutils_ml.tcpring, under real mpiexec on one host (``DML_TRANSPORT=tcp``).

Across hosts it is the default for gradient buckets: tests/test_cluster.py's reduction during
backward across nodes runs over it.
"""

from __future__ import annotations

import pytest

import distutils_ml as dml
from distutils_ml.tcpring import ring_for, transport_choice

from mpirun import requires_mpi, run_mpi


@requires_mpi
@pytest.mark.parametrize("ranks", [2, 3, 4])
def test_ring_allreduce_and_buckets_under_mpiexec(ranks: int) -> None:
    job = run_mpi(ranks, ["tests/tcpring_job.py", "ring", "buckets"], envs=[{"DML_TRANSPORT": "tcp"}] * ranks)
    assert job.returncode == 0, job.output[-8000:]
    assert f"TCPRING CHECKS PASSED: ring buckets on {ranks} ranks" in job.output, job.output[-8000:]


@requires_mpi
def test_transport_set_differently_is_an_error_on_every_rank() -> None:
    job = run_mpi(2, ["tests/tcpring_job.py", "agree"], envs=[{"DML_TRANSPORT": "tcp"}, {"DML_TRANSPORT": "mpi"}])
    assert job.returncode == 0, job.output[-8000:]
    assert job.output.count("check agree passed") == 2, job.output[-8000:]
    assert "'tcp' on rank(s) [0]; 'mpi' on rank(s) [1]" in job.output, job.output[-8000:]


def test_transport_choice_is_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DML_TRANSPORT", "infiniband")
    with pytest.raises(ValueError, match="DML_TRANSPORT='infiniband'; allowed: auto, tcp, mpi"):
        transport_choice()
    monkeypatch.setenv("DML_TRANSPORT", " TCP ")
    assert transport_choice() == "tcp"
    monkeypatch.delenv("DML_TRANSPORT")
    assert transport_choice() == "auto"


def test_local_backend_has_no_ring(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DML_TRANSPORT", "tcp")
    assert dml.LocalBackend.spawn(2, ring_for) == [None, None]
