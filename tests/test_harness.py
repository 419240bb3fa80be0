"""The test harness itself (tests/conftest.py, tests/mpirun.py, tests/cluster.py, tests/mpi_main.py).

- Under ``CI=true`` a skip fails the run, naming its reason; only tests marked ``gpu`` may skip.
- A hung MPI job is ended by its helper before pytest's own timeout of the test: every rank's
  Python stack in the failure, no process left behind.
- The hypothesis "dev" profile draws fresh examples, more of them, in pytest and in MPI jobs
  (the same on every rank there); "ci" draws the same ones on every run.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hypothesis import settings

from distutils_ml import sessiondirs

import cluster
from mpirun import MARGIN_S, TESTS, mpi_env, requires_mpi, run_mpi

CONFTEST = TESTS / "conftest.py"


@pytest.fixture
def harness(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> pytest.Pytester:
    """A pytest project with this suite's conftest and markers; its runs find tests/ (the conftest imports mpirun)."""
    pytester.makeconftest(CONFTEST.read_text())
    pytester.makeini("[pytest]\nmarkers =\n    gpu: needs a CUDA device\n")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(TESTS), os.environ.get("PYTHONPATH")])))
    for name in ("CI", "HYPOTHESIS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    return pytester


def _runs(harness: pytest.Pytester, *runs: tuple[dict[str, str], tuple[str, ...]]) -> list[pytest.RunResult]:
    """What ``harness.runpytest_subprocess(*args)`` gives, for each (variables set, args), the runs started together:
    each is a fresh pytest whose conftest (this suite's) imports torch, most of its time, on one core; another core
    starts the next meanwhile. They run without the cache provider, whose files in the folder they would all write.
    """
    started = []
    for i, (variables, args) in enumerate(runs):
        with pytest.MonkeyPatch.context() as env:  # harness.popen copies os.environ when it starts the process
            for name, value in variables.items():
                env.setenv(name, value)
            out, err = harness.path / f"run{i}.stdout", harness.path / f"run{i}.stderr"
            cmd = [sys.executable, "-mpytest", f"--basetemp={harness.path / f'run{i}-tmp'}", "-p", "no:cacheprovider"]
            with out.open("w") as stdout, err.open("w") as stderr:
                proc = harness.popen([*cmd, *args], stdout=stdout, stderr=stderr, stdin=subprocess.DEVNULL)
            started.append((proc, out, err, time.monotonic()))
    results = []
    try:
        for proc, out, err, start in started:
            ret = proc.wait(timeout=120)
            lines = out.read_text().splitlines(), err.read_text().splitlines()
            results.append(pytest.RunResult(ret, *lines, time.monotonic() - start))
    finally:
        for proc, *_ in started:
            proc.kill()
            proc.wait()
    return results


AREAS = """
import pytest

@pytest.mark.skipif(True, reason="MPI tests need mpi4py and mpiexec")
def test_mpi():
    pass

def test_torchdata():
    pytest.importorskip("no_such_module_torchdata")

@pytest.mark.gpu
def test_gpu():
    pytest.skip("no CUDA device")

@pytest.mark.xfail(reason="a known bug")
def test_known_bug():
    raise AssertionError

def test_plain():
    pass
"""


def test_under_ci_a_skip_fails_the_run_naming_what_is_missing(harness: pytest.Pytester) -> None:
    harness.makepyfile(test_areas=AREAS, test_module_skip='import pytest\npytest.importorskip("no_such_cluster")\n')
    calm, ci = _runs(harness, ({}, ("-rs",)), ({"CI": "true"}, ("-rs",)))
    calm.assert_outcomes(passed=1, skipped=4, xfailed=1)
    assert calm.ret == 0

    assert ci.ret == pytest.ExitCode.TESTS_FAILED, ci.stdout.str()
    # The marker's skip fails at setup (an error), the test's own skip in its call; the gpu test still skips.
    ci.assert_outcomes(passed=1, failed=1, errors=1, skipped=2, xfailed=1)
    for line in [
        "*skipped under CI=true, where only tests marked 'gpu' may skip: MPI tests need*",  # the test's failure
        "*= skipped under CI=true (failures: these areas did not run) =*",  # the summary: each reason once
        "   1 test(s): MPI tests need mpi4py and mpiexec  (e.g. test_areas.py::test_mpi)",
        "   1 test(s): could not import 'no_such_module_torchdata'*(e.g. test_areas.py::test_torchdata)",
        "   1 test(s): could not import 'no_such_cluster'*(e.g. test_module_skip.py)",
    ]:
        ci.stdout.fnmatch_lines([line])
    assert "test_gpu" not in "\n".join(line for line in ci.outlines if "CI=true" in line)


HANG = """
import faulthandler, signal, sys, time

import numpy as np

import distutils_ml as dml

faulthandler.register(signal.SIGUSR1)
dml.initialize(dml.MPIBackend)
world = dml.get_distributed_backend(dml.MPIBackend)


def stall():
    time.sleep(600)


def wait_for_the_others():
    dml.allreduce(world, np.ones(2), dml.SUM)


print(f"rank {world.rank} READY", flush=True)
if world.rank == world.size - 1:
    stall()
else:
    wait_for_the_others()
"""


def _still_running(token: str, grace: float = 5) -> list[str]:
    """Command lines of processes that mention ``token`` and still run after ``grace`` s (SIGKILL takes a moment)."""
    end = time.monotonic() + grace
    while True:
        found = []
        for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
            try:
                text = cmdline.read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if token in text:
                found.append(f"{cmdline.parent.name}: {text}")
        if not found or time.monotonic() > end:
            return found
        time.sleep(0.2)


def _assert_every_rank_dumped(output: str, ranks: int) -> None:
    assert output.count("READY") == ranks, output[-4000:]
    assert output.count("Current thread") == ranks, output[-4000:]
    assert len(re.findall(r"line \d+ in stall\b", output)) == 1, output[-4000:]
    assert len(re.findall(r"line \d+ in wait_for_the_others\b", output)) == ranks - 1, output[-4000:]


# pytest's timeouts of the hang tests: their jobs get TIMEOUT_S - MARGIN_S to start and hang (9 s for 3 ranks on one
# node, which start in 3 s; 14 s for 4 ranks on the cluster's 2 nodes, which start in about 7 s)
TIMEOUT_S = 24
CLUSTER_TIMEOUT_S = 29


@requires_mpi
@pytest.mark.timeout(TIMEOUT_S)
def test_a_hung_job_ends_before_pytests_timeout_with_every_ranks_stack(tmp_path: Path) -> None:
    """run_mpi's own timeout (600 s) is cut to end before the test's: the helper, not pytest, ends the job;
    it asks the ranks for their stacks, kills them all and fails with the dumps."""
    job = tmp_path / "hang_job.py"
    job.write_text(HANG)
    start = time.monotonic()
    with pytest.raises(pytest.fail.Exception) as failed:
        run_mpi(3, [str(job)], timeout=600)
    message = str(failed.value)
    left = round(TIMEOUT_S - MARGIN_S)
    assert re.search(rf"timed out after ({left - 1}|{left}) s \(cut from 600 s to end before the test's own", message)
    _assert_every_rank_dumped(message, 3)
    assert time.monotonic() - start < TIMEOUT_S - 5
    assert not _still_running(str(job))
    assert not sessiondirs.stale(), "the killed mpiexec's session directory was left (it fails a later one)"


@requires_mpi
@pytest.mark.timeout(CLUSTER_TIMEOUT_S)
def test_a_hung_job_on_the_cluster_ends_before_pytests_timeout_with_every_ranks_stack(tmp_path: Path) -> None:
    """The same for tests/cluster.py's runs (tests/test_cluster.py): 2 nodes, 2 ranks each."""
    reason = cluster.unavailable()
    if reason:
        pytest.skip(reason)
    job = tmp_path / "hang_job.py"
    job.write_text(HANG)
    start = time.monotonic()
    with cluster.cluster(2, 2) as c:
        argv = [*c.mpiexec_argv(4), "-x", "OMP_NUM_THREADS=1", sys.executable, str(job)]
        run = c.run(argv, timeout=600, cwd=TESTS.parent)
    assert run.returncode is None, (run.returncode, run.output[-4000:])
    assert CLUSTER_TIMEOUT_S - MARGIN_S - 5 < run.seconds < CLUSTER_TIMEOUT_S - MARGIN_S + 1, run.seconds
    _assert_every_rank_dumped(run.output, 4)
    assert time.monotonic() - start < CLUSTER_TIMEOUT_S - 5
    assert not _still_running(str(job))


COUNT = """
import os

from hypothesis import given, settings, strategies as st

@settings(max_examples=5)
@given(st.integers(0, 2**62))
def test_draws(x):
    with open(os.environ["DRAWN"], "a") as f:
        f.write(f"{x}\\n")
"""


def _drawn(harness: pytest.Pytester, *runs: tuple[dict[str, str], tuple[str, ...]]) -> list[list[str]]:
    """What each run (variables, args) of COUNT drew, in order; the runs go together, each into a file of its own."""
    files = [harness.path / f"drawn{i}.txt" for i in range(len(runs))]
    for file in files:
        file.write_text("")
    results = _runs(harness, *(({**env, "DRAWN": str(f)}, args) for f, (env, args) in zip(files, runs, strict=True)))
    for result in results:
        result.assert_outcomes(passed=1)
    return [file.read_text().split() for file in files]


def test_the_dev_profile_draws_fresh_examples_and_more_of_them(harness: pytest.Pytester) -> None:
    harness.makepyfile(test_count=COUNT)
    ci, ci_again, dev, again = _drawn(
        harness, ({}, ()), ({}, ()), ({}, ("--hypothesis-profile=dev",)), ({"HYPOTHESIS_PROFILE": "dev"}, ())
    )
    assert len(ci) == 5 and ci_again == ci  # the same examples on every run
    assert len(dev) == len(again) == 5 * 20, (len(dev), len(again))  # tests/conftest.py's DEV_EXAMPLES
    assert set(dev) != set(again) and set(dev) != set(ci)  # fresh examples on every run


DRAW_JOB = """
from hypothesis import strategies as st
from mpi4py import MPI

from mpi_main import hypothesis_check

drawn = []


def body(backend, case):
    every = MPI.COMM_WORLD.allgather(case)
    assert every == [case] * len(every), every  # every rank draws the same example
    drawn.append(case)


count = hypothesis_check(None, body, st.integers(0, 2**62), 5)
if MPI.COMM_WORLD.Get_rank() == 0:
    print("DRAWN", count, drawn, flush=True)
"""


def _job_drew(job: Path) -> tuple[int, list[int], str]:
    """How many examples the job's ranks drew, which, and the seed rank 0 printed ("" under ci)."""
    done = run_mpi(2, [str(job)], timeout=120)
    assert done.returncode == 0, done.output[-4000:]
    count, drawn = re.search(r"DRAWN (\d+) (\[.*\])", done.output).groups()  # type: ignore[union-attr]
    seed = re.search(r"DML_HYPOTHESIS_SEED=(\d+)", done.output)
    return int(count), [int(x) for x in drawn.strip("[]").split(", ")], seed[1] if seed else ""


@requires_mpi
def test_mpi_jobs_follow_the_profile_the_same_on_every_rank(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    job = tmp_path / "draw_job.py"
    job.write_text(DRAW_JOB)
    monkeypatch.delenv("DML_HYPOTHESIS_SEED", raising=False)
    previous = settings.get_current_profile_name()
    settings.load_profile("ci")
    try:
        count, ci, seed = _job_drew(job)
        assert (count, seed) == (5, "") and len(set(ci)) > 1, (count, ci, seed)
        settings.load_profile("dev")
        assert mpi_env()["DML_HYPOTHESIS_SEED"] != mpi_env()["DML_HYPOTHESIS_SEED"]  # fresh for every job
        count, dev, seed = _job_drew(job)
        assert count == 5 * 4 and seed, (count, seed)  # tests/mpi_main.py's DEV_EXAMPLES
        assert set(dev) != set(ci)
        monkeypatch.setenv("DML_HYPOTHESIS_SEED", seed)  # the replay the job's output offers
        assert _job_drew(job) == (count, dev, seed)
    finally:
        settings.load_profile(previous)


PART_JOB = """
import os

import distutils_ml as dml
from mpi_main import guarded, run_checks


def fail() -> None:
    raise AssertionError("part {name} fails, as asked")


def main(checks: list[str]) -> None:
    dml.initialize(dml.MPIBackend)
    world = dml.get_distributed_backend(dml.MPIBackend)
    if world.rank == 0:
        with open(os.environ["PARTS_RAN"], "a") as ran:
            ran.write("{name}\\n")
    run_checks(world, checks, "PART {name} PASSED", lambda check: guarded(fail) if check == "boom" else 1)
"""

PART_TESTS = """
import pytest

import shared

PARTS = [
    shared.register("a", "part_a", lambda ranks: ["one", "two"]),
    shared.register("b", "part_b", lambda ranks: ["boom"] if ranks == 3 else ["one"]),
    shared.register("c", "part_c", lambda ranks: ["one"]),
]


@pytest.mark.parametrize("ranks", [2, 3])
@pytest.mark.parametrize("part", [pytest.param(p, marks=pytest.mark.shared_job(p)) for p in PARTS])
def test_part(part: str, ranks: int) -> None:
    job = shared.job(ranks, part)
    assert job.returncode == 0, job.output[-3000:]
    assert f"PART {part} PASSED" in job.output, job.output[-3000:]
    assert job.output.count(f"{part}: check one passed") == ranks, job.output[-3000:]
"""


@requires_mpi
def test_the_parts_of_a_shared_job_pass_or_fail_on_their_own(harness: pytest.Pytester) -> None:
    """tests/shared.py: one job per world size for every selected part; a part that fails (b, with 3 ranks) fails
    its own test and those of the parts after it (c), saying so; the parts before it pass; ``-k`` runs only the
    selected parts."""
    for name in "abc":
        harness.makepyfile(**{f"part_{name}": PART_JOB.replace("{name}", name)})
    harness.makepyfile(test_parts=PART_TESTS)
    ran_all, ran_c = harness.path / "ran_all.txt", harness.path / "ran_c.txt"
    path = os.pathsep.join([str(harness.path), str(TESTS)])
    every, only_c = _runs(
        harness,
        ({"PARTS_RAN": str(ran_all), "PYTHONPATH": path}, ("-q", "-p", "no:randomly")),
        ({"PARTS_RAN": str(ran_c), "PYTHONPATH": path}, ("-q", "-p", "no:randomly", "-k", "c")),
    )
    out = every.stdout.str()
    every.assert_outcomes(passed=4, failed=2)
    assert re.search(r"FAILED \S+test_part\[b-3\]", out) and re.search(r"FAILED \S+test_part\[c-3\]", out), out
    assert "part b failed (the output above)" in out and "part c did not begin: the job ended in part b" in out, out
    assert "part b fails, as asked" in out, out
    assert sorted(ran_all.read_text().split()) == ["a", "a", "b", "b", "c"], ran_all.read_text()  # a job a size
    only_c.assert_outcomes(passed=2, deselected=4)
    assert ran_c.read_text().split() == ["c", "c"], ran_c.read_text()
