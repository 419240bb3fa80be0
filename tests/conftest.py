"""Shared pytest settings: hypothesis profiles, GPU skips, no silent skips in CI, the MPI helpers' deadline."""

from __future__ import annotations

import os
from collections.abc import Generator, Iterator
from typing import Any

import pytest
import torch
from hypothesis import settings

import cluster
import mpirun
import shared

pytest_plugins = ["pytester"]  # tests/test_harness.py runs pytest on generated files

# "ci": reproducible runs (CI and the default locally), so a failure seen once is seen again.
# "dev" (HYPOTHESIS_PROFILE=dev or --hypothesis-profile=dev), before each submission: fresh random
# examples on every run, DEV_EXAMPLES times as many per test, failures kept in .hypothesis/ and replayed first.
DEV_EXAMPLES = 20
settings.register_profile("ci", derandomize=True, print_blob=True)
settings.register_profile("dev", derandomize=False, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

#: Where CI must not skip: ``CI=true`` turns every skip of a test not marked ``gpu`` into a failure.
ON_CI = os.environ.get("CI") == "true"
_CI_SKIPS: dict[str, list[str]] = {}  # skip reason -> the tests it skipped (CI only)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked ``gpu`` skip, with the reason, where no CUDA device is visible; dev runs more examples.

    ``scripts/gpu-check.sh`` runs ``-m "gpu and not gpu_job"`` on a GPU machine and fails on any skip
    there; it runs the MPI jobs of the ``gpu_job`` tests itself, each under its own timeout.
    """
    if settings.get_current_profile_name() == "dev":
        _more_examples(items)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="no CUDA device on this machine (scripts/gpu-check.sh runs these on one)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_collection_finish(session: pytest.Session) -> None:
    """The selected tests' parts of the shared MPI jobs (tests/shared.py), once ``-k`` and the rest have chosen."""
    shared.want(session.items)


def _more_examples(items: list[pytest.Item]) -> None:
    """Each hypothesis test DEV_EXAMPLES times its own ``max_examples`` (the tests pin theirs, over any profile's).

    Hypothesis refuses a second ``@settings``; its ``given`` reads the settings from this attribute when called.
    """
    done: set[int] = set()
    for item in items:
        test = getattr(item, "obj", None)
        test = getattr(test, "__func__", test)  # a test method: its function
        if not getattr(test, "is_hypothesis_test", False) or id(test) in done:
            continue  # a parametrized test is one function for all its items
        done.add(id(test))
        own = test._hypothesis_internal_use_settings  # type: ignore[union-attr]
        more = settings(own, max_examples=own.max_examples * DEV_EXAMPLES)
        test._hypothesis_internal_use_settings = more  # type: ignore[union-attr]


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Generator[None, Any, Any]:
    """Under ``CI=true`` a skipped test fails with its skip reason, unless it is marked ``gpu``.

    Every other skip in the suite tests for something CI has: mpi4py and mpiexec (``pip install
    ".[mpi]"``), torchdata and matplotlib (``.[test]``), root, ``ip netns``, gcc and /dev/net/tun
    (the cluster and delay-line tests), Linux (SIGALRM, the parent-death signal), a git checkout
    and a venv with pip (tests/test_gpu_scripts.py). None is exempt: each such skip in CI means a
    whole area went untested while the run stayed green.
    """
    report: pytest.TestReport = yield
    if not (ON_CI and report.skipped) or hasattr(report, "wasxfail") or item.get_closest_marker("gpu"):
        return report
    reason = _skip_reason(report)
    _CI_SKIPS.setdefault(reason, []).append(item.nodeid)
    report.outcome = "failed"
    report.longrepr = f"skipped under CI=true, where only tests marked 'gpu' may skip: {reason}"
    return report


def pytest_collectreport(report: pytest.CollectReport) -> None:
    """Under ``CI=true``, a module that skips itself (``pytest.importorskip`` at its top) fails the run too."""
    if ON_CI and report.skipped:
        _CI_SKIPS.setdefault(_skip_reason(report), []).append(report.nodeid)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if _CI_SKIPS and session.exitstatus in (pytest.ExitCode.OK, pytest.ExitCode.NO_TESTS_COLLECTED):
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def _skip_reason(report: pytest.TestReport | pytest.CollectReport) -> str:
    longrepr = report.longrepr
    if isinstance(longrepr, tuple):  # (path, line, "Skipped: reason")
        return str(longrepr[2]).removeprefix("Skipped: ")
    return str(longrepr)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter, exitstatus: int, config: pytest.Config) -> None:
    """Under ``CI=true``, what was skipped (and so failed): each reason once, with how many tests it took out."""
    if not _CI_SKIPS:
        return
    terminalreporter.section("skipped under CI=true (failures: these areas did not run)", sep="=", red=True)
    for reason, tests in sorted(_CI_SKIPS.items(), key=lambda entry: -len(entry[1])):
        terminalreporter.write_line(f"{len(tests):4d} test(s): {reason}  (e.g. {tests[0]})")


@pytest.hookimpl(optionalhook=True)
def pytest_timeout_set_timer(item: pytest.Item, settings: Any) -> None:
    """pytest-timeout arms the test's timer: the MPI helpers (tests/mpirun.py) end their jobs before it fires."""
    mpirun.start_test_timer(settings.timeout)


@pytest.hookimpl(optionalhook=True)
def pytest_timeout_cancel_timer(item: pytest.Item) -> None:
    mpirun.start_test_timer(None)


# -- the namespace clusters of tests/cluster.py, one per module that asks (test_cluster, test_restarts) ---------


def _cluster(nodes: int, slots: int) -> Iterator[cluster.Cluster]:
    reason = cluster.unavailable()
    if reason:
        pytest.skip(reason)
    with cluster.cluster(nodes, slots) as c:
        yield c


@pytest.fixture(scope="module")
def two_by_two() -> Iterator[cluster.Cluster]:
    """2 nodes of 2 slots, up for the module's tests."""
    yield from _cluster(2, 2)


@pytest.fixture(scope="module")
def three_by_one() -> Iterator[cluster.Cluster]:
    """3 nodes of 1 slot, up for the module's tests."""
    yield from _cluster(3, 1)
