"""The ``distutils-ml launch`` command: argument handling (``--dry-run``), refusals, one real job."""

from __future__ import annotations

import importlib.util
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from distutils_ml import launch
from distutils_ml.launch import build_command, find_mpiexec, main, parse_args

ROOT = Path(__file__).resolve().parent.parent
ROOT_VARS = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}

requires_mpi = pytest.mark.skipif(
    find_mpiexec() is None or importlib.util.find_spec("mpi4py") is None,
    reason='needs mpi4py and mpiexec: pip install "distutils-ml[mpi]"',
)


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """Root allowed (as in containers), no thread settings inherited from the caller."""
    for name, value in ROOT_VARS.items():
        monkeypatch.setenv(name, value)
    for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        monkeypatch.delenv(name, raising=False)


def build(argv: list[str], cores: int = 8, environ: dict[str, str] | None = None) -> list[str]:
    """The Open MPI command for ``argv`` on a machine with ``cores`` cores."""
    args = parse_args(argv)
    return build_command(args, mpiexec="mpiexec", python="py", cores=cores, environ=environ or {}).argv


def dry_run(capsys: pytest.CaptureFixture[str], argv: list[str], **kwargs: str) -> list[str]:
    """The command ``main`` prints for ``argv`` with --dry-run, split into arguments."""
    assert main(["launch", "--dry-run", *argv], **kwargs) == 0
    return shlex.split(capsys.readouterr().out)


# --- argument handling ------------------------------------------------------------


def test_plain_run_gets_threads_and_the_same_interpreter() -> None:
    threads = ["-x", "OMP_NUM_THREADS=4", "-x", "MKL_NUM_THREADS=4", "-x", "THP_MEM_ALLOC_ENABLE=1"]
    expected = ["mpiexec", "-n", "2", "--bind-to", "none", *threads, "py", "-m", "mpi4py", "train.py"]
    assert build(["launch", "-n", "2", "train.py"]) == expected


@pytest.mark.parametrize(("ranks", "cores"), [(2, 2), (3, 2), (8, 8), (9, 8), (1, 1), (2, 1)])
def test_oversubscribe_only_past_the_core_count(ranks: int, cores: int) -> None:
    argv = build(["-n", str(ranks), "train.py"], cores=cores)
    assert ("--oversubscribe" in argv) is (ranks > cores)
    assert f"OMP_NUM_THREADS={max(1, cores // ranks)}" in argv


@pytest.mark.parametrize("given", [["--oversubscribe"], ["--hostfile", "hosts"], ["-H", "a,b"], ["--host=a:4,b:4"]])
def test_no_oversubscribe_when_the_user_placed_ranks(given: list[str]) -> None:
    argv = build(["-n", "16", *given, "train.py"], cores=2)
    assert argv.count("--oversubscribe") == given.count("--oversubscribe")


def test_threads_per_rank_and_binding() -> None:
    one = build(["-n", "8", "train.py"])
    assert "OMP_NUM_THREADS=1" in one and "MKL_NUM_THREADS=1" in one and "--bind-to" not in one
    explicit = build(["-n", "8", "--threads-per-rank", "3", "train.py"])
    assert "OMP_NUM_THREADS=3" in explicit and explicit[3:5] == ["--bind-to", "none"]
    assert "MKL_NUM_THREADS=5" in build(["-n", "8", "--threads-per-rank=5", "train.py"])
    for placement in (["--bind-to", "core"], ["--map-by", "slot:PE=2"], ["--bind-to=socket"]):
        argv = build(["-n", "2", *placement, "train.py"])
        assert "none" not in argv and "OMP_NUM_THREADS=4" in argv


def test_users_omp_num_threads_is_left_alone() -> None:
    argv = build(["-n", "2", "train.py"], environ={"OMP_NUM_THREADS": "3"})
    assert argv.count("-x") == 1 and "OMP_NUM_THREADS=3" not in argv and argv[3:5] == ["--bind-to", "none"]
    argv = build(["-n", "2", "train.py"], environ={"OMP_NUM_THREADS": "1"})
    assert argv.count("-x") == 1 and "--bind-to" not in argv  # -x THP_MEM_ALLOC_ENABLE=1 alone
    argv = build(["-n", "2", "-x", "OMP_NUM_THREADS=1", "train.py"])
    assert argv.count("-x") == 2 and "--bind-to" not in argv  # the user's, and THP_MEM_ALLOC_ENABLE
    argv = build(["-n", "2", "-x", "OMP_NUM_THREADS", "train.py"], environ={"OMP_NUM_THREADS": "2,1"})
    assert argv.count("-x") == 2 and argv[3:5] == ["--bind-to", "none"]


def test_explicit_threads_per_rank_beats_the_users_omp_num_threads() -> None:
    argv = build(["-n", "2", "--threads-per-rank", "2", "train.py"], environ={"OMP_NUM_THREADS": "7"})
    assert "OMP_NUM_THREADS=2" in argv  # Open MPI's -x NAME=VALUE overrides mpiexec's environment
    argv = build(["-n", "2", "-x", "OMP_NUM_THREADS=7", "--threads-per-rank", "2", "train.py"])
    assert argv.index("OMP_NUM_THREADS=2") < argv.index("OMP_NUM_THREADS=7")  # Open MPI keeps the first -x


def test_mpiexec_options_and_script_args_pass_through() -> None:
    options = ["--hostfile", "hosts", "-H", "a:2,b:2", "--map-by", "ppr:2:node"]
    options += ["-x", "NCCL_DEBUG", "--mca", "btl", "^ofi", "--report-bindings"]
    script = ["train.py", "-n", "5", "--dry-run", "--threads-per-rank", "9", "--", "x.py"]
    argv = build(["launch", *options[:4], "-np", "4", *options[4:], "--threads-per-rank", "1", *script])
    assert argv[:3] == ["mpiexec", "-n", "4"]
    assert argv[-len(script) - 3 :] == ["py", "-m", "mpi4py", *script]
    assert argv[argv.index("--hostfile") : argv.index("py")] == options
    assert "--oversubscribe" not in argv and "--bind-to" not in argv


def test_huge_pages_for_torch_unless_the_user_chose() -> None:
    assert "THP_MEM_ALLOC_ENABLE=1" in build(["-n", "2", "train.py"])
    assert "THP_MEM_ALLOC_ENABLE=1" not in build(["-n", "2", "train.py"], environ={"THP_MEM_ALLOC_ENABLE": "0"})
    argv = build(["-n", "2", "-x", "THP_MEM_ALLOC_ENABLE=0", "train.py"])
    assert argv.count("-x") == 3 and "THP_MEM_ALLOC_ENABLE=0" in argv


def test_option_values_ending_in_py_are_not_the_script() -> None:
    argv = build(["-n", "2", "-x", "PYTHONSTARTUP=init.py", "--hostfile", "hosts.py", "train.py", "a.py"])
    assert argv[argv.index("py") :] == ["py", "-m", "mpi4py", "train.py", "a.py"]
    assert argv[argv.index("PYTHONSTARTUP=init.py") - 1] == "-x" and "hosts.py" in argv


def test_module_and_double_dash_programs() -> None:
    module = ["-m", "pkg.train", "--epochs", "3", "-n", "1"]
    argv = build(["-n", "2", "--threads-per-rank", "1", *module])
    assert argv[argv.index("py") :] == ["py", "-m", "mpi4py", *module]
    assert build(["-n", "2", "--", "train", "a.py"])[-5:] == ["py", "-m", "mpi4py", "train", "a.py"]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["launch", "train.py"], "give the number of ranks with -n N"),
        (["launch", "-n", "0", "train.py"], "-n takes a positive whole number, got '0'"),
        (["launch", "-n", "two", "train.py"], "-n takes a positive whole number, got 'two'"),
        (["launch", "-n", "2", "--threads-per-rank", "-1", "train.py"], "--threads-per-rank takes a positive"),
        (["launch", "-n", "2", "--hostfile", "hosts"], "no program to run"),
        (["launch", "-n", "2", "-m"], "no program to run"),
        (["launch", "-n"], "-n needs a number"),
        (["run", "-n", "2", "train.py"], "unknown command 'run'"),
    ],
)
def test_bad_command_lines_exit_2_with_usage(capsys: pytest.CaptureFixture[str], argv: list[str], message: str) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and "usage: distutils-ml launch -n N" in err


def test_help(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["launch", "--help"]) == 0
    assert "--threads-per-rank K" in capsys.readouterr().out
    assert main([]) == 2


@requires_mpi
def test_dry_run_prints_the_command_with_this_environments_mpiexec(capsys: pytest.CaptureFixture[str]) -> None:
    ranks = launch.cpu_cores() + 1
    argv = dry_run(capsys, ["-n", str(ranks), "--mca", "btl", "^ofi", "train.py", "--lr", "0.1"])
    assert argv[0] == find_mpiexec() == str(Path(sys.executable).parent / "mpiexec")
    assert argv[1:4] == ["-n", str(ranks), "--oversubscribe"]
    assert argv[argv.index("--mca") :] == [
        "--mca",
        "btl",
        "^ofi",
        sys.executable,
        "-m",
        "mpi4py",
        "train.py",
        "--lr",
        "0.1",
    ]
    assert "OMP_NUM_THREADS=1" in argv


def test_hydra_mpiexec_gets_no_open_mpi_flags(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    fake = tmp_path / "mpiexec"
    fake.write_text("#!/bin/sh\necho 'HYDRA build details:'\n")
    fake.chmod(0o755)
    argv = dry_run(capsys, ["-n", "64", "train.py"], python=str(tmp_path / "python"))
    python = str(tmp_path / "python")
    env = ["OMP_NUM_THREADS=1", "MKL_NUM_THREADS=1", "THP_MEM_ALLOC_ENABLE=1"]
    assert argv == [*env, str(fake), "-n", "64", python, "-m", "mpi4py", "train.py"]


# --- refusals ---------------------------------------------------------------------


def test_missing_mpiexec_says_what_to_install(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    assert find_mpiexec(str(tmp_path / "python")) is None
    assert main(["launch", "-n", "2", "train.py"], python=str(tmp_path / "python")) == 127
    assert 'pip install "distutils-ml[mpi]"' in capsys.readouterr().err


@requires_mpi
@pytest.mark.parametrize(
    ("env", "options", "refused"),
    [
        ({}, [], True),
        ({"OMPI_ALLOW_RUN_AS_ROOT": "1"}, [], True),
        ({"OMPI_ALLOW_RUN_AS_ROOT": "yes", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}, [], True),
        (ROOT_VARS, [], False),
        ({}, ["--allow-run-as-root"], False),
    ],
)
def test_root_needs_permission(
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    env: dict[str, str],
    options: list[str],
    refused: bool,
) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    for name in ROOT_VARS:
        monkeypatch.delenv(name)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    code = main(["launch", "--dry-run", "-n", "2", *options, "train.py"])
    out, err = capsys.readouterr()
    assert code == (2 if refused else 0), err
    assert ("--allow-run-as-root" in err and "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1" in err) is refused
    assert bool(out) is not refused


def cli_env(**extra: str) -> dict[str, str]:
    """This environment without root permission or thread settings, plus ``extra``."""
    drop = {*ROOT_VARS, "OMP_NUM_THREADS", "MKL_NUM_THREADS"}
    return {name: value for name, value in os.environ.items() if name not in drop} | extra


@requires_mpi
@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0, reason="only root is refused")
def test_root_is_refused_before_launching() -> None:
    cmd = [sys.executable, "-m", "distutils_ml.launch", "launch", "-n", "2", "tests/launch_probe.py"]
    proc = subprocess.run(cmd, env=cli_env(), cwd=ROOT, capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1" in proc.stderr
    assert "rank" not in proc.stdout and "prterun" not in proc.stderr  # nothing was started


# --- running ----------------------------------------------------------------------


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP])
def test_signals_reach_mpiexec_and_its_status_comes_back(tmp_path: Path, signum: int) -> None:
    ready = tmp_path / "ready"
    fake = tmp_path / "mpiexec"
    script = (
        f"[ \"$1\" = --version ] && exit 0\ntrap 'exit 7' INT TERM HUP\ntouch {ready}\nwhile :; do sleep 0.05; done\n"
    )
    fake.write_text("#!/bin/sh\n" + script)
    fake.chmod(0o755)

    def send() -> None:
        deadline = time.monotonic() + 30
        while not ready.exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        if ready.exists():
            os.kill(os.getpid(), signum)

    sender = threading.Thread(target=send)
    sender.start()
    try:
        assert main(["launch", "-n", "2", "train.py"], python=str(tmp_path / "python")) == 7
    finally:
        sender.join()


@requires_mpi
def test_real_job_ranks_get_their_threads() -> None:
    cmd = [sys.executable, "-m", "distutils_ml.launch", "launch", "-n", "2", "--threads-per-rank", "2"]
    cmd += ["tests/launch_probe.py", "--tag", "x.py"]
    env = cli_env(**ROOT_VARS, OMPI_MCA_btl="^ofi")
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    cpus = len(os.sched_getaffinity(0))
    for rank in (0, 1):
        line = f"rank {rank} of 2: threads 2 cpus {cpus} args ['--tag', 'x.py']"
        assert line in proc.stdout, proc.stdout + proc.stderr


def _job_processes(pid: int) -> set[int]:
    """``pid``'s descendants (mpiexec and the ranks it started), found through /proc."""
    parents: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parents[int(stat.parent.name)] = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
    found = {pid}
    while grown := {child for child, parent in parents.items() if parent in found} - found:
        found |= grown
    return found - {pid}


def _running(pid: int) -> bool:
    """Whether ``pid`` is a live process (a zombie waiting for its parent is not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@requires_mpi
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the parent-death signal is Linux's")
@pytest.mark.parametrize("signum", [signal.SIGHUP, signal.SIGKILL])
def test_the_job_ends_with_the_launcher(tmp_path: Path, signum: int) -> None:
    """SIGHUP is passed on to mpiexec; SIGKILL of the launcher ends mpiexec (parent-death signal) and the ranks."""
    cmd = [sys.executable, "-m", "distutils_ml.launch", "launch", "-n", "2", "--threads-per-rank", "1"]
    cmd += [str(ROOT / "tests" / "launch_probe.py"), "--wait", str(tmp_path)]
    env = cli_env(**ROOT_VARS, OMPI_MCA_btl="^ofi")
    with (tmp_path / "out.txt").open("w") as out:  # run outside the checkout: the installed launcher
        launcher = subprocess.Popen(cmd, env=env, cwd=tmp_path, stdout=out, stderr=subprocess.STDOUT)
    pids = [tmp_path / f"rank{rank}.pid" for rank in (0, 1)]
    job: set[int] = set()
    try:
        deadline = time.monotonic() + 120
        while not all(p.exists() for p in pids) and launcher.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert all(p.exists() for p in pids), (tmp_path / "out.txt").read_text()
        ranks = {int(p.read_text()) for p in pids}
        job = _job_processes(launcher.pid) | ranks
        assert ranks <= job and len(job) > len(ranks)  # mpiexec, its helpers and the ranks
        launcher.send_signal(signum)
        launcher.wait(timeout=30)
        deadline = time.monotonic() + 10
        while any(map(_running, job)) and time.monotonic() < deadline:
            time.sleep(0.1)
        survivors = {pid: Path(f"/proc/{pid}/cmdline").read_bytes() for pid in job if _running(pid)}
        assert not survivors, f"still running after the launcher got signal {signum}: {survivors}"
    finally:
        launcher.kill()
        launcher.wait()
        for pid in job:
            if _running(pid):
                os.kill(pid, signal.SIGKILL)
