"""One mpiexec job per world size for the plain MPI jobs of many test modules (tests/shared_job.py runs them).

A test module registers its job as a part (``register``, at import) and marks its test
``@pytest.mark.shared_job("<part>")``, parametrized by ``ranks``; the test calls ``job(ranks, part)``. The first such
test of a world size runs one job with every part that the run selected at that size (tests/conftest.py tells
``want`` which, after ``-k`` and the rest); the others read their part of the same job. Each part asserts what it did
in its own job: its banner, its check lines (``Job.prefix``), and a return code of its own: 0 once every rank has
passed the barrier after it, unless every part ended and the job still failed (at exit: then every part fails).

Why: each job's start (every rank importing torch, MPI's start, torch._dynamo when an optimizer is made) took 6.8 s
with 2 ranks and 10.5 s with 3 on 2 cores (measured 2026-12-02), most of the time of a dozen jobs of a few seconds.
What it costs: a part that fails aborts the job, and the parts after it fail too, saying which part ended it.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass

import pytest
from hypothesis import settings

from mpirun import MARGIN_S, Job, run_mpi

#: The longest the ci profile's job may take, whatever its parts' own timeouts add up to (it takes 1-3 minutes).
CI_LIMIT_S = 900.0


@dataclass(frozen=True)
class Part:
    module: str  # a script of tests/ whose main(...) the part runs
    args: Callable[[int], list[str]]  # its command-line arguments at a world size
    timeout: float  # what its own job was given


PARTS: dict[str, Part] = {}
_wanted: dict[int, list[str]] = {}  # world size -> the parts this run selected, in registration order
_jobs: dict[int, Job | str] = {}  # world size -> the job, or why it failed (a timeout: not run again)


def register(name: str, module: str, args: Callable[[int], list[str]] = lambda ranks: [], timeout: float = 240) -> str:
    """Declare a part, at a test module's import; returns ``name`` for the test's marker."""
    assert name not in PARTS or PARTS[name].module == module, f"two parts named {name!r}"
    PARTS[name] = Part(module, args, timeout)
    return name


def want(items: list[pytest.Item]) -> None:
    """From tests/conftest.py: the parts of the selected tests, and each such test's timeout (the whole job's)."""
    _wanted.clear()
    marked = []  # (item, its world size)
    for item in items:
        marker = item.get_closest_marker("shared_job")
        if marker is not None:
            ranks = item.callspec.params["ranks"]  # type: ignore[attr-defined]
            marked.append((item, ranks))
            names = _wanted.setdefault(ranks, [])
            if marker.args[0] not in names:
                names.append(marker.args[0])
    for names in _wanted.values():
        names.sort(key=list(PARTS).index)
    for item, ranks in marked:
        item.add_marker(pytest.mark.timeout(limit(_wanted[ranks]) + MARGIN_S + 30))


def limit(names: list[str]) -> float:
    """A job's timeout: its parts' own timeouts together (capped under the ci profile)."""
    total = sum(PARTS[name].timeout for name in names)
    return total if settings.get_current_profile_name() == "dev" else min(total, CI_LIMIT_S)


def job(ranks: int, name: str) -> Job:
    """Part ``name`` of this run's shared job with ``ranks`` ranks (run now if it has not run)."""
    names = _wanted.get(ranks, [])
    if name not in names:
        pytest.fail(f"part {name!r} with {ranks} ranks was not selected: mark its test shared_job({name!r})")
    if ranks not in _jobs:
        try:
            _jobs[ranks] = _run(ranks, names)
        except pytest.fail.Exception as failed:
            _jobs[ranks] = f"the shared job with {ranks} ranks ({' '.join(names)}) failed: {failed}"
    whole = _jobs[ranks]
    if isinstance(whole, str):
        pytest.fail(whole)
    return _part(whole, names, name)


def _run(ranks: int, names: list[str]) -> Job:
    parts = [[n, PARTS[n].module, PARTS[n].args(ranks)] for n in names]
    return run_mpi(ranks, ["tests/shared_job.py", json.dumps(parts)], timeout=limit(names))


def _part(whole: Job, names: list[str], name: str) -> Job:
    out = whole.output
    ended = [n for n in names if f"SHARED PART {n} ENDS" in out]
    begun = [n for n in names if f"SHARED PART {n} BEGINS" in out]
    if name in ended:
        returncode = whole.returncode if len(ended) == len(names) else 0
        note = "" if returncode == 0 else f"every part ended, then the job exited with {returncode}"
    else:
        returncode = whole.returncode or 1
        if name in begun:
            note = f"part {name} failed (the output above)"
        else:
            note = f"part {name} did not begin: the job ended in part {begun[-1] if begun else '(none)'}, above"
    if note:
        out += f"\n[tests/shared_job.py, parts {' '.join(names)}, {whole.seconds:.0f} s: {note}]\n"
    return Job(returncode, out, whole.seconds, prefix=f"{name}: ")
