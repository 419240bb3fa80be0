"""A ``torch.compile``d model trained by DistributedOptimizer, both forms, overlap on and off: equal to the
eager model and compiled once, on LocalBackend.spawn and under mpiexec (tests/compile_job.py has the bodies).

The compiler is torch.compile's default, inductor, as a user runs it: it needs a C++ compiler, which the
CI image has (gcc). A cold compile of one small model takes about 10-20 s on 2 cores; its kernels are
then cached on disk (``/tmp/torchinductor_$USER``), so the MPI jobs after the LocalBackend tests mostly
load them.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator

import pytest
import torch

import distutils_ml as dml

import shared
from compile_job import CASES, Case, compare_body, graphs, name
from mpirun import assert_checks_passed, requires_mpi


@pytest.fixture(scope="module", autouse=True)
def _forget_compiled_code() -> Iterator[None]:
    """Leave no compiled code (or its guards on this module's models) to the tests after these."""
    yield
    torch._dynamo.reset()


def test_the_graph_count_sees_a_recompilation() -> None:
    """The count the cases rely on goes up when Dynamo compiles again (here: a new input shape)."""
    torch._dynamo.reset()
    double = torch.compile(lambda x: x * 2, backend="eager")
    before = graphs()
    double(torch.ones(2))
    double(torch.ones(2))
    assert graphs() == before + 1
    double(torch.ones(3))
    assert graphs() == before + 2


@pytest.mark.parametrize("case", CASES, ids=name)
def test_compiled_model_trains_as_eager_on_local(case: Case) -> None:
    torch._dynamo.reset()  # this case compiles afresh; the ranks are threads of this process
    results = dml.LocalBackend.spawn(2, compare_body, case, timeout=200)
    assert all(r["graphs"] >= 1 for r in results), results  # the checks ran on a compiled model


COMPILE_JOB = shared.register("compile", "compile_job", timeout=240)


@requires_mpi
@pytest.mark.parametrize("ranks", [2, 3])
@pytest.mark.shared_job(COMPILE_JOB)
def test_compiled_model_trains_as_eager_under_mpi(ranks: int) -> None:
    job = shared.job(ranks, COMPILE_JOB)
    assert job.returncode == 0, job.output[-12000:]
    checks = list(map(name, CASES))
    assert f"COMPILE CHECKS PASSED: {' '.join(checks)} on {ranks} ranks" in job.output, job.output[-12000:]
    assert_checks_passed(job, checks, ranks)


def test_importing_the_library_and_collectives_do_not_load_dynamo() -> None:
    """The hooks are kept out of Dynamo's tracing without importing torch._dynamo (1.4 s of every rank's start): a
    process that never compiles, nor makes a torch optimizer (which imports it), does not load it."""
    code = (
        "import sys, numpy as np, distutils_ml as dml\n"
        "dml.allreduce(dml.LocalBackend(), np.ones(3), dml.SUM)\n"
        "print('torch._dynamo' in sys.modules)\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == ["False"], run.stdout + run.stderr
