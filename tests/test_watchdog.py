"""Stall detection, debug-mode fingerprints and their options (distutils_ml/watchdog.py).

On LocalBackend: the stall report names the collective, the early warning comes at a
quarter of the timeout, AVG against SUM is a mismatch, and bad timeouts are refused.
The MPI watchdog's verdict (abort, or keep waiting) is checked against canned answers
from the other ranks, and in two real mpiexec jobs (tests/watchdog_job.py): a stall
under ``DML_TIMEOUT``, and a slow collective that every rank has joined.
"""

from __future__ import annotations

import math
import re
import signal
import subprocess
import sys
import threading
import time
import warnings
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

import distutils_ml as dml
from distutils_ml import watchdog
from distutils_ml.watchdog import MPIWatchdog, reply_window, resolve_debug, resolve_timeout

from mpirun import requires_mpi, run_mpi

# -- debug fingerprints: AVG is an op of its own -------------------------------------------


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("kind", ["allreduce", "reduce"])
def test_avg_against_sum_is_a_mismatch(world: int, kind: str) -> None:
    def body(b: dml.Backend) -> str:
        op = dml.AVG if dml.local_rank(b) == 0 else dml.SUM
        buf = np.ones(2)
        with pytest.raises(dml.CollectiveMismatchError) as info:
            dml.allreduce(b, buf, op) if kind == "allreduce" else dml.reduce(b, buf, op, root=0)
        good = np.ones(2)
        dml.allreduce(b, good, dml.SUM)  # the world is still usable
        assert (good == world).all()
        return str(info.value)

    for message in dml.LocalBackend.spawn(world, body, timeout=30):
        assert f"rank(s) [0] called {kind}(shape=(2,), dtype=float64, op=dml.AVG" in message, message
        assert f"called {kind}(shape=(2,), dtype=float64, op=dml.SUM" in message, message


@pytest.mark.parametrize("dtype", [np.float64, np.float32, np.float16, torch.bfloat16])
def test_avg_still_averages(dtype: Any) -> None:
    def body(b: dml.Backend) -> tuple[list[float], list[float]]:
        r = dml.local_rank(b)
        if dtype is torch.bfloat16:
            x, y = torch.full((3,), float(r), dtype=dtype), torch.full((3,), float(r), dtype=dtype)
        else:
            x, y = np.full(3, r, dtype=dtype), np.full(3, r, dtype=dtype)
        dml.allreduce(b, x, dml.AVG)
        dml.reduce(b, y, dml.AVG, root=1)
        return [float(v) for v in x], [float(v) for v in y]

    results = dml.LocalBackend.spawn(4, body, timeout=30)
    assert [xs for xs, _ in results] == [[1.5] * 3] * 4
    assert results[1][1] == [1.5] * 3
    assert results[0][1] == [0.0] * 3, "reduce leaves non-root buffers alone"
    one = dml.LocalBackend()
    assert dml.allreduce(one, np.array([2.5]), dml.AVG).tolist() == [2.5]


# -- LocalBackend stalls ------------------------------------------------------------------


def _one_rank_never_comes(release: threading.Event) -> Any:
    def fn(b: dml.Backend) -> None:
        if dml.local_rank(b) == 2:
            release.wait(20)  # never joins the allreduce
            return
        dml.allreduce(b, np.ones(2, dtype=np.float32), dml.MAX)

    return fn


def test_local_stall_names_the_collective_and_warns_at_a_quarter(capsys: pytest.CaptureFixture[str]) -> None:
    release = threading.Event()
    start = time.monotonic()
    with pytest.raises(dml.StallError) as info:
        dml.LocalBackend.spawn(3, _one_rank_never_comes(release), timeout=30, stall_timeout=1.0)
    took = time.monotonic() - start
    release.set()
    assert "in allreduce(shape=(2,), dtype=float32, op=dml.MAX) #1; rank(s) [2] have not arrived" in str(info.value)
    assert 1.0 <= took < 5, took
    err = capsys.readouterr().err
    for rank in (0, 1):
        found = re.search(
            rf"LocalBackend rank {rank}: warning: waiting (\d+\.\d) s in allreduce\(shape=\(2,\), dtype=float32, "
            r"op=dml\.MAX\) #1; StallError after 1 s \(stall_timeout= of LocalBackend\.spawn, or DML_TIMEOUT\)",
            err,
        )
        assert found, err
        assert 0.2 <= float(found.group(1)) < 1.0, "the warning comes at a quarter of the timeout, before the error"


def test_a_huge_timeout_waits_without_overflow(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DML_TIMEOUT", "1e300")

    def fn(b: dml.Backend) -> float:
        if dml.local_rank(b) == 1:
            time.sleep(0.2)  # rank 0 waits in the allreduce meanwhile
        return float(dml.allreduce(b, np.ones(1), dml.SUM)[0])

    assert dml.LocalBackend.spawn(2, fn, timeout=30) == [2.0, 2.0]


@pytest.mark.parametrize("raw", ["nan", "inf", "-inf", "-1", "soon", "1e400"])
def test_dml_timeout_must_be_a_finite_number(monkeypatch: pytest.MonkeyPatch, raw: str) -> None:
    monkeypatch.setenv("DML_TIMEOUT", raw)
    with pytest.raises(ValueError, match=rf"DML_TIMEOUT: got '{re.escape(raw)}'; allowed: a finite number of seconds"):
        dml.LocalBackend.spawn(2, lambda b: None)
    with pytest.raises(ValueError, match="DML_TIMEOUT"):
        dml.MPIBackend()  # refused before MPI starts


@pytest.mark.parametrize("timeout", [math.nan, math.inf, -math.inf, -0.5])
def test_timeout_option_must_be_a_finite_number(timeout: float) -> None:
    with pytest.raises(ValueError, match=r"stall_timeout: got .*; allowed: a finite number of seconds >= 0"):
        dml.LocalBackend.spawn(2, lambda b: None, stall_timeout=timeout)
    with pytest.raises(ValueError, match=r"^timeout: got .*; allowed: a finite number of seconds >= 0"):
        dml.MPIBackend(timeout=timeout)


@pytest.mark.parametrize("raw", ["2", "y", "garbage", "debug", "-1", "ja"])
def test_dml_debug_refuses_unknown_values(monkeypatch: pytest.MonkeyPatch, raw: str) -> None:
    monkeypatch.setenv("DML_DEBUG", raw)
    with pytest.raises(ValueError, match=rf"DML_DEBUG: got '{re.escape(raw)}'; allowed: 1, true, yes, on"):
        dml.LocalBackend.spawn(2, lambda b: None)
    with pytest.raises(ValueError, match="DML_DEBUG"):
        dml.MPIBackend()  # refused before MPI starts


@pytest.mark.parametrize(("raw", "on"), [("1", True), ("TRUE", True), (" on ", True), ("0", False), ("off", False)])
def test_dml_debug_words(monkeypatch: pytest.MonkeyPatch, raw: str, on: bool) -> None:
    monkeypatch.setenv("DML_DEBUG", raw)
    assert resolve_debug(None) is on
    monkeypatch.setenv("DML_DEBUG", "")
    assert resolve_debug(None) is False


@pytest.mark.parametrize("timeout", [math.nan, math.inf, -1, 0, "10", True])
def test_spawn_timeout_is_checked_before_any_rank_starts(timeout: object) -> None:
    started = []
    with pytest.raises(ValueError, match=r"^timeout: got .*; allowed: None \(no limit\) or a finite number"):
        dml.LocalBackend.spawn(2, lambda b: started.append(b.rank), timeout=timeout)
    assert started == []


def test_zero_turns_stall_detection_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DML_TIMEOUT", "0")
    assert resolve_timeout(None) == 0.0
    monkeypatch.setenv("DML_TIMEOUT", " 2.5 ")
    assert resolve_timeout(None) == 2.5
    assert reply_window(3) == 2.0 and reply_window(20) == 5.0 and reply_window(300) == 10.0


# -- LocalBackend options and repeated initialize -------------------------------------------


def test_local_backend_takes_mpi_style_timeout_and_debug() -> None:
    class Options(dml.LocalBackend):
        pass

    dml.initialize(Options, timeout=5, debug=True)
    backend = dml.get_distributed_backend(Options)
    assert (backend.timeout, backend.debug) == (5.0, True)
    assert dml.allreduce(backend, np.ones(2), dml.SUM).tolist() == [1.0, 1.0]  # a world of one never waits
    assert dml.LocalBackend.spawn(2, lambda b: (b.timeout, b.debug), stall_timeout=7) == [(7.0, True)] * 2
    with pytest.raises(TypeError, match=r"got the option\(s\) comm, segment_bytes; allowed: timeout, debug"):
        dml.LocalBackend(segment_bytes=4, comm=None)


def test_second_initialize_with_other_options_warns() -> None:
    class Twice(dml.LocalBackend):
        pass

    dml.initialize(Twice, timeout=60)
    first = dml.get_distributed_backend(Twice)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        dml.initialize(Twice)  # no options: nothing to ignore
        dml.initialize(Twice, timeout=60)  # the same options
    with pytest.warns(RuntimeWarning, match=r"already initialized with options \{'timeout': 60\}; .*\{'timeout': 5\}"):
        dml.initialize(Twice, timeout=5)
    with pytest.warns(RuntimeWarning, match=r"\{'debug': True\} are ignored"):
        dml.initialize(Twice, debug=True)
    assert dml.get_distributed_backend(Twice) is first and first.timeout == 60.0


# -- the MPI watchdog's verdict, on canned answers -----------------------------------------


@pytest.fixture(autouse=True)
def _no_abort_alarm(monkeypatch: pytest.MonkeyPatch) -> None:
    """The fake MPI's Abort returns: no kernel alarm may end the test process after it."""
    monkeypatch.setattr(watchdog, "ABORT_GRACE", 0)


class _FakeMPI:
    """What the watchdog uses of mpi4py's MPI module; records aborts."""

    ANY_SOURCE = -1

    def __init__(self) -> None:
        self.aborts: list[int] = []
        self.COMM_WORLD = SimpleNamespace(Abort=self.aborts.append)

    @staticmethod
    def Status() -> None:
        return None

    @staticmethod
    def Is_finalized() -> bool:
        return False


class _QuietComm:
    """A private communicator on which nobody ever asks anything (or whose probe fails)."""

    def __init__(self, error: Exception | None = None) -> None:
        self.error = error

    def Iprobe(self, **_: Any) -> bool:
        if self.error is not None:
            raise self.error
        return False


RECORD_ARGS = ("allreduce", (4,), np.dtype(np.float32), dml.SUM, -1)
CALL = "allreduce(shape=(4,), dtype=float32, op=dml.SUM)"
MINE = f"in {CALL} #2"
EARLIER = "allreduce(shape=(2,), dtype=float64, op=dml.SUM)"
BCAST = "bcast(shape=(4,), dtype=float32, root=0)"


def _verdict(replies: dict[int, tuple[int, str, str, str]], *, ends_meanwhile: bool = False) -> list[int]:
    """Run rank 0's check of collective #2 (of 3 ranks) on the other ranks' ``replies``; return the aborts.

    A reply is (last started seq, what the rank is doing, what its #2 was, the last collective it started).
    """
    mpi = _FakeMPI()
    record = (2, *RECORD_ARGS, time.monotonic())
    backend = SimpleNamespace(MPI=mpi, rank=0, size=3, calls_started=2, call_in_flight=record, recent_calls=[record])
    dog = MPIWatchdog(backend, _QuietComm(), timeout=1000.0)

    def collect(seq: int) -> dict[int, tuple[int, str, str, str]]:
        assert seq == 2
        if ends_meanwhile:
            backend.call_in_flight = None
        return {0: (2, MINE, CALL, CALL), **replies}

    dog._collect = collect  # type: ignore[method-assign]
    try:
        dog._check(record, 1000.0)
    finally:
        dog.stop()
    return mpi.aborts


def test_every_rank_inside_the_collective_is_slow_not_stalled(capsys: pytest.CaptureFixture[str]) -> None:
    aborts, err = (
        _verdict({1: (2, MINE, CALL, CALL), 2: (3, "in barrier() #3", CALL, "barrier()")}),
        capsys.readouterr().err,
    )
    assert aborts == []
    assert f"[rank 0] distutils_ml: warning: waited 1000 s {MINE}, but every rank has joined it" in err, err


def test_a_rank_that_has_not_started_the_collective_ends_the_job(capsys: pytest.CaptureFixture[str]) -> None:
    aborts, err = (
        _verdict({1: (2, MINE, CALL, CALL), 2: (1, "not in a collective", "", EARLIER)}),
        capsys.readouterr().err,
    )
    assert aborts == [1]
    assert f"stall: waited 1000 s (timeout 1000 s) {MINE}; rank(s) [2] have not arrived:" in err, err
    assert f"  rank 2: not in a collective (last started #1: {EARLIER})" in err, err


def test_a_rank_without_answer_ends_the_job(capsys: pytest.CaptureFixture[str]) -> None:
    aborts, err = _verdict({1: (2, MINE, CALL, CALL)}), capsys.readouterr().err
    assert aborts == [1]
    assert "rank(s) [2] have not arrived" in err and "  rank 2: no answer" in err, err


def test_a_rank_in_a_different_collective_ends_the_job(capsys: pytest.CaptureFixture[str]) -> None:
    aborts, err = (
        _verdict(
            {
                1: (2, "in bcast(shape=(4,), dtype=float32, root=0) #2", BCAST, BCAST),
                2: (2, MINE, CALL, CALL),
            }
        ),
        capsys.readouterr().err,
    )
    assert aborts == [1]
    assert "rank(s) [1] called a different collective" in err, err


def test_a_rank_that_finished_a_different_collective_with_the_same_number_ends_the_job(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # Rank 1 ran `if rank == 1: dml.save(...)` (an object broadcast it could finish alone as root) as its #2,
    # then stopped communicating: not "slow", a stall naming rank 1 and both calls.
    other = "bcast_object(root=1)"
    aborts, err = (
        _verdict({1: (2, "not in a collective", other, other), 2: (2, MINE, CALL, CALL)}),
        capsys.readouterr().err,
    )
    assert aborts == [1], err
    assert "rank(s) [1] called a different collective" in err, err
    assert f"  rank 1: not in a collective (last started #2: {other}) (its #2 was {other}" in err, err
    assert MINE in err, err


def test_a_rank_that_went_on_past_a_different_collective_ends_the_job(capsys: pytest.CaptureFixture[str]) -> None:
    # Rank 1's #2 was another collective, and it is now blocked in its #3 (which nobody else reaches).
    aborts, err = (
        _verdict({1: (3, "in barrier() #3", BCAST, "barrier()"), 2: (2, MINE, CALL, CALL)}),
        capsys.readouterr().err,
    )
    assert aborts == [1], err
    assert f"  rank 1: in barrier() #3 (its #2 was {BCAST}: a different collective" in err, err


def test_a_collective_that_ends_while_the_answers_come_is_left_alone(capsys: pytest.CaptureFixture[str]) -> None:
    aborts = _verdict({1: (2, MINE, CALL, CALL), 2: (1, "not in a collective", "", EARLIER)}, ends_meanwhile=True)
    err = capsys.readouterr().err
    assert aborts == [] and err == ""


def test_a_failing_watchdog_says_so_before_stopping(capsys: pytest.CaptureFixture[str]) -> None:
    backend = SimpleNamespace(MPI=_FakeMPI(), rank=4, size=8, calls_started=0, call_in_flight=None, recent_calls=[])
    dog = MPIWatchdog(backend, _QuietComm(RuntimeError("probe failed")), timeout=0.2)
    dog._thread.join(5)
    assert not dog._thread.is_alive()
    err = capsys.readouterr().err
    assert (
        "[rank 4] distutils_ml: warning: stall detection stopped: the watchdog thread raised RuntimeError: probe failed"
        in err
    ), err


# -- under mpiexec -------------------------------------------------------------------------


@requires_mpi
def test_dml_timeout_stall_warns_names_the_rank_and_ends_the_job(monkeypatch: pytest.MonkeyPatch) -> None:
    # dml.initialize(dml.MPIBackend) with DML_TIMEOUT=3 in the job's environment; rank 2 never joins allreduce #2.
    monkeypatch.setenv("DML_TIMEOUT", "3")
    job = run_mpi(3, ["tests/watchdog_job.py", "stall"], timeout=120)
    out = job.output
    assert job.returncode != 0, out[-8000:]
    assert job.seconds < 3 + 30, f"took {job.seconds:.1f} s"
    assert len(re.findall(r"\] timeout=3\n", out)) == 3, out[-8000:]
    call = r"allreduce\(shape=\(4,\), dtype=float32, op=dml\.SUM\) #2"
    warning = (
        rf"\[rank [01]\] distutils_ml: warning: waiting \d+ s in {call}; the job ends after 3 s if a rank is missing"
    )
    assert re.search(warning, out), out[-8000:]
    stall = rf"distutils_ml: stall: waited \d+ s \(timeout 3 s\) in {call}; rank\(s\) \[2\] have not arrived \(on .+\):"
    assert re.search(stall, out), out[-8000:]
    assert "  rank 2: not in a collective (last started #1: allreduce(shape=(2,), dtype=float64, op=dml.SUM))" in out, (
        out[-8000:]
    )
    assert "NOT ABORTED" not in out


@requires_mpi
def test_slow_collective_that_every_rank_joined_is_not_ended() -> None:
    # dml.initialize(dml.MPIBackend, timeout=2); the root takes 3 s to pickle a broadcast object.
    job = run_mpi(3, ["tests/watchdog_job.py", "slow"], timeout=120)
    out = job.output
    assert job.returncode == 0, out[-8000:]
    assert len(re.findall(r"\] timeout=2\n", out)) == 3, out[-8000:]
    assert "in bcast_object(root=0) #2, but every rank has joined it: slow, not stalled" in out, out[-8000:]
    assert "stall:" not in out and out.count("NOT ABORTED") == 3, out[-8000:]
    assert out.count("rank(s) [0] called allreduce(shape=(2,), dtype=float64, op=dml.AVG)") == 3, out[-8000:]


@requires_mpi
def test_debug_mode_still_reports_a_stall() -> None:
    # debug=True, timeout=3: the last rank never joins; the others wait in the debug check's exchange.
    job = run_mpi(2, ["tests/core_job.py", "debug_stall"], timeout=120)
    out = job.output
    assert job.returncode != 0, out[-8000:]
    assert job.seconds < 3 + 30, f"took {job.seconds:.1f} s"
    call = "check of allreduce(shape=(4,), dtype=float32, op=dml.SUM) #3"
    assert f"stall: waited 3 s (timeout 3 s) in {call}; rank(s) [1] have not arrived" in out, out[-8000:]


@requires_mpi
def test_a_rank_that_finished_another_collective_with_the_same_number_is_named() -> None:
    # Rank 0 runs an object broadcast it can finish alone as root (`if rank == 0: dml.save(...)`) as its #2,
    # then stops communicating while rank 1 waits in allreduce #2: the job ends about timeout (3 s) later.
    job = run_mpi(2, ["tests/core_job.py", "other_call"], timeout=120)
    out = job.output
    assert job.returncode != 0, out[-8000:]
    assert job.seconds < 3 + 30, f"took {job.seconds:.1f} s"
    assert "slow, not stalled" not in out, out[-8000:]
    assert "in allreduce(shape=(4,), dtype=float32, op=dml.SUM) #2; rank(s) [0] called a different collective" in out
    assert "  rank 0: not in a collective (last started #2: bcast_object(root=0))" in out, out[-8000:]


BLOCKED_ABORT = """
import time, types
from distutils_ml import watchdog
watchdog.ABORT_GRACE = 1
# An MPI_Abort that never returns, as when mpiexec's daemon cannot reach a lost node.
mpi = types.SimpleNamespace(COMM_WORLD=types.SimpleNamespace(Abort=lambda code: time.sleep(60)))
watchdog.abort_job(mpi)
"""


@pytest.mark.skipif(not hasattr(signal, "SIGALRM"), reason="no SIGALRM on this system")
def test_an_abort_that_cannot_be_delivered_still_ends_the_rank_with_a_failure() -> None:
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", BLOCKED_ABORT], capture_output=True, timeout=30, check=False)
    assert proc.returncode == -signal.SIGALRM, (proc.returncode, proc.stderr)
    assert time.monotonic() - start < 15
