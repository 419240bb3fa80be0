"""The transport of gradient buckets across hosts (distutils_ml/transport.py, distutils_ml/gloo.py): the gloo
group, under real mpiexec on one host (``DML_TRANSPORT=gloo``).

Across hosts it is the default for gradient buckets: tests/test_cluster.py's reduction during
backward across nodes runs over it.
"""

from __future__ import annotations

import re
import time

import pytest

import distutils_ml as dml
from distutils_ml.transport import transport_choice, transport_for

from mpirun import requires_mpi, run_mpi


@requires_mpi
@pytest.mark.parametrize("ranks", [2, 3, 4])
def test_gloo_allreduce_reduce_scatter_allgather_and_buckets_under_mpiexec(ranks: int) -> None:
    checks = ["ring", "inflight", "buckets"]
    job = run_mpi(ranks, ["tests/transport_job.py", *checks], envs=[{"DML_TRANSPORT": "gloo"}] * ranks)
    assert job.returncode == 0, job.output[-8000:]
    assert f"TRANSPORT CHECKS PASSED: {' '.join(checks)} on {ranks} ranks" in job.output, job.output[-8000:]


@requires_mpi
@pytest.mark.parametrize("ranks", [2, 3])
def test_a_failed_gloo_call_breaks_the_transport_on_every_rank(ranks: int) -> None:
    # the peers' call fails at gloo's timeout (the stall watchdog, off here, would end the job first)
    envs = [{"DML_TRANSPORT": "gloo", "DML_TIMEOUT": "0", "DML_GLOO_TIMEOUT": "3"}] * ranks
    job = run_mpi(ranks, ["tests/transport_job.py", "broken"], envs=envs, timeout=120)
    assert job.returncode == 0, job.output[-8000:]
    assert job.output.count("every rank raised, twice") == ranks, job.output[-8000:]


@requires_mpi
@pytest.mark.parametrize("ranks", [2, 3])
def test_a_bucket_failing_mid_backward_ends_the_job_before_any_step(ranks: int) -> None:
    envs = [{"DML_TRANSPORT": "gloo", "DML_TIMEOUT": "30"}] * ranks
    job = run_mpi(ranks, ["tests/transport_job.py", "bucket_fails"], envs=envs, timeout=120)
    assert job.returncode != 0, job.output[-8000:]
    assert "STEPPED AFTER A FAILED BUCKET" not in job.output, job.output[-8000:]
    assert "gloo transport" in job.output, job.output[-8000:]


@requires_mpi
def test_closing_100_backends_with_transports_leaks_no_descriptor_or_thread() -> None:
    checks = ["tests/transport_job.py", "close", "collected"]
    job = run_mpi(2, checks, envs=[{"DML_TRANSPORT": "gloo"}] * 2, timeout=180)
    assert job.returncode == 0, job.output[-8000:]
    assert job.output.count("100 backends closed, nothing left open") == 2, job.output[-8000:]
    assert job.output.count("a transport collected unclosed was not taken for a rank that died") == 2, job.output


@requires_mpi
@pytest.mark.parametrize("ranks", [2, 3])
def test_dataloader_workers_do_not_hold_the_transports_sockets(ranks: int) -> None:
    envs = [{"DML_TRANSPORT": "gloo", "DML_TIMEOUT": "0", "DML_GLOO_TIMEOUT": "60"}] * ranks
    job = run_mpi(ranks, ["tests/transport_job.py", "fork"], envs=envs, timeout=120)
    assert job.returncode == 0, job.output[-8000:]
    assert job.output.count("workers hold no transport socket") == ranks, job.output[-8000:]


@requires_mpi
@pytest.mark.parametrize("ranks", [2, 3])
def test_a_rank_killed_between_calls_ends_the_job_at_once_naming_it(ranks: int) -> None:
    # --enable-recovery: mpiexec lets the job go on without the rank (as srun may, for a while), so only the
    # library ends it; the stall watchdog's timeout is far away, and the peers sleep 30 s before their next call.
    envs = [{"DML_TRANSPORT": "gloo", "DML_TIMEOUT": "60"}] * ranks
    job = run_mpi(ranks, ["tests/transport_job.py", "dies"], envs=envs, timeout=120, options=("--enable-recovery",))
    ended = time.time()
    assert job.returncode != 0, job.output[-8000:]
    assert "NOT ENDED" not in job.output, job.output[-8000:]
    named = re.search(r"\[rank 0\] distutils_ml: rank 1 on \S+ ended \(killed or crashed\)", job.output)
    assert named, job.output[-8000:]
    assert job.output.count("ended (killed or crashed)") == 1, job.output[-8000:]  # the ranks that abort say so
    killed = re.search(r"KILLED AT (\S+)", job.output)
    assert killed, job.output[-8000:]
    after = ended - float(killed.group(1))
    assert after < 10, f"the job ended {after:.1f} s after rank 1 was killed:\n{job.output[-8000:]}"


@requires_mpi
def test_gloo_on_an_interface_that_does_not_exist_is_an_error_on_every_rank() -> None:
    envs = [{"DML_TRANSPORT": "gloo", "DML_SOCKET_IFNAME": "nosuch0"}] * 2
    job = run_mpi(2, ["tests/transport_job.py", "fallback"], envs=envs, timeout=120)
    assert job.returncode == 0, job.output[-8000:]
    assert job.output.count("refused") == 2, job.output[-8000:]


@requires_mpi
@pytest.mark.parametrize("ranks", [2, 3])
def test_a_rank_reaching_the_store_after_gloos_timeout_still_joins_the_group(ranks: int) -> None:
    # the stall watchdog (30 s) would name a rank that never came; gloo's own timeout (3 s) must not end a late one
    envs = [{"DML_TRANSPORT": "gloo", "DML_TIMEOUT": "30", "DML_GLOO_TIMEOUT": "3"}] * ranks
    job = run_mpi(ranks, ["tests/transport_job.py", "late"], envs=envs, timeout=120)
    assert job.returncode == 0, job.output[-8000:]
    assert job.output.count("the late rank joined the gloo group") == ranks, job.output[-8000:]


def test_gloo_timeout_is_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    from distutils_ml.gloo import _timeout

    assert _timeout(0.0) == 1800.0 and _timeout(30.0) == 40.0  # after the watchdog's, or gloo's default
    monkeypatch.setenv("DML_GLOO_TIMEOUT", "2.5")
    assert _timeout(30.0) == 2.5
    monkeypatch.setenv("DML_GLOO_TIMEOUT", "soon")
    with pytest.raises(ValueError, match="DML_GLOO_TIMEOUT='soon'; allowed: seconds > 0"):
        _timeout(30.0)


@requires_mpi
@pytest.mark.parametrize("ranks", [2, 3])
def test_debug_mode_compares_gloo_calls_across_ranks(ranks: int) -> None:
    envs = [{"DML_TRANSPORT": "gloo", "DML_DEBUG": "1"}] * ranks
    job = run_mpi(ranks, ["tests/transport_job.py", "debug"], envs=envs, timeout=120)
    assert job.returncode == 0, job.output[-8000:]
    assert job.output.count("caught") == ranks, job.output[-8000:]


@requires_mpi
def test_transport_set_differently_is_an_error_on_every_rank() -> None:
    job = run_mpi(2, ["tests/transport_job.py", "agree"], envs=[{"DML_TRANSPORT": "gloo"}, {"DML_TRANSPORT": "mpi"}])
    assert job.returncode == 0, job.output[-8000:]
    assert job.output.count("check agree passed") == 2, job.output[-8000:]
    assert "'gloo' on rank(s) [0]; 'mpi' on rank(s) [1]" in job.output, job.output[-8000:]


def test_transport_choice_is_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DML_TRANSPORT", "infiniband")
    with pytest.raises(ValueError, match="DML_TRANSPORT='infiniband'; allowed: auto, gloo, mpi"):
        transport_choice()
    monkeypatch.setenv("DML_TRANSPORT", " GLOO ")
    assert transport_choice() == "gloo"
    monkeypatch.setenv("DML_TRANSPORT", "tcp")
    with pytest.warns(DeprecationWarning, match="DML_TRANSPORT=tcp is deprecated.*DML_TRANSPORT=gloo"):
        assert transport_choice() == "gloo"
    monkeypatch.delenv("DML_TRANSPORT")
    assert transport_choice() == "auto"


def test_local_backend_has_no_ring(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DML_TRANSPORT", "gloo")
    assert dml.LocalBackend.spawn(2, transport_for) == [None, None]
