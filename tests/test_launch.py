"""The ``distutils-ml launch`` command: argument handling (``--dry-run``), refusals, one real job."""

from __future__ import annotations

import importlib.util
import itertools
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from distutils_ml import launch, mpiexec_options
from distutils_ml.launch import build_command, find_mpiexec, main, parse_args
from distutils_ml.supervise import run_supervised

ROOT = Path(__file__).resolve().parent.parent
ROOT_VARS = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
KEEPALIVE = ["oob_tcp_keepalive_time", "5", "oob_tcp_keepalive_intvl", "2", "oob_tcp_keepalive_probes", "3"]
# What the launcher adds to every Open MPI command: a daemon on a silent node is declared lost after 5 + 2 * 3 s,
# and an aborting rank waits 2 s, so mpiexec names the rank that died first.
KEEPALIVE_OPTIONS = [
    *(word for i in range(0, 6, 2) for word in ("--mca", *KEEPALIVE[i : i + 2])),
    *("--mca", "mpi_abort_delay", "2"),
]

requires_mpi = pytest.mark.skipif(
    find_mpiexec() is None or importlib.util.find_spec("mpi4py") is None,
    reason='needs mpi4py and mpiexec: pip install "distutils-ml[mpi]"',
)


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """Root allowed (as in containers), no thread, library or keepalive settings inherited from the caller."""
    for name, value in ROOT_VARS.items():
        monkeypatch.setenv(name, value)
    for name in list(os.environ):
        inherited = name.startswith("DML_") or name.partition("_MCA_")[2].startswith("oob_tcp_keepalive")
        if inherited or name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "THP_MEM_ALLOC_ENABLE"):
            monkeypatch.delenv(name)


def build(argv: list[str], cores: int = 8, environ: dict[str, str] | None = None) -> list[str]:
    """The Open MPI command for ``argv`` on a machine with ``cores`` cores."""
    args = parse_args(argv)
    return build_command(args, mpiexec="mpiexec", python="py", cores=cores, environ=environ or {}).argv


def exported(argv: list[str]) -> list[str]:
    """The values of the ``-x`` options in ``argv``, in order."""
    return [value for flag, value in itertools.pairwise(argv) if flag == "-x"]


def dry_run(capsys: pytest.CaptureFixture[str], argv: list[str], **kwargs: str) -> list[str]:
    """The command ``main`` prints for ``argv`` with --dry-run, split into arguments."""
    assert main(["launch", "--dry-run", *argv], **kwargs) == 0
    return shlex.split(capsys.readouterr().out)


# --- argument handling ------------------------------------------------------------


def test_plain_run_gets_threads_and_the_same_interpreter() -> None:
    threads = ["-x", "OMP_NUM_THREADS=4", "-x", "MKL_NUM_THREADS=4", "-x", "THP_MEM_ALLOC_ENABLE=1"]
    added = ["--bind-to", "none", *threads, *KEEPALIVE_OPTIONS]
    assert build(["launch", "-n", "2", "train.py"]) == ["mpiexec", "-n", "2", *added, "py", "-m", "mpi4py", "train.py"]


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
    # Passed on as it is (-x NAME: its value from mpiexec's environment), so ranks on other nodes get it too.
    argv = build(["-n", "2", "train.py"], environ={"OMP_NUM_THREADS": "3"})
    assert argv[3:5] == ["--bind-to", "none"] and "OMP_NUM_THREADS=3" not in argv
    assert exported(argv) == ["THP_MEM_ALLOC_ENABLE=1", "OMP_NUM_THREADS"]
    argv = build(["-n", "2", "train.py"], environ={"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "2"})
    assert exported(argv) == ["THP_MEM_ALLOC_ENABLE=1", "MKL_NUM_THREADS", "OMP_NUM_THREADS"]
    assert "--bind-to" not in argv
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
    argv = build(["-n", "2", "train.py"], environ={"THP_MEM_ALLOC_ENABLE": "0"})
    assert "THP_MEM_ALLOC_ENABLE=1" not in argv and "THP_MEM_ALLOC_ENABLE" in exported(argv)
    argv = build(["-n", "2", "-x", "THP_MEM_ALLOC_ENABLE=0", "train.py"])
    assert argv.count("-x") == 3 and "THP_MEM_ALLOC_ENABLE=0" in argv


def test_option_values_ending_in_py_are_not_the_script() -> None:
    argv = build(["-n", "2", "-x", "PYTHONSTARTUP=init.py", "--hostfile", "hosts.py", "train.py", "a.py"])
    assert argv[argv.index("py") :] == ["py", "-m", "mpi4py", "train.py", "a.py"]
    assert argv[argv.index("PYTHONSTARTUP=init.py") - 1] == "-x" and "hosts.py" in argv


def spellings(name: str, values: list[str]) -> list[list[str]]:
    """``name`` with ``values`` as a user may write them: -name, --name (long names) and --name=VALUE."""
    short = [[f"-{name}", *values]]
    long = [[f"--{name}", *values], [f"--{name}={values[0]}", *values[1:]]] if len(name) > 1 else []
    return short + long


TABLE = sorted(mpiexec_options.OPTION_VALUES.items())


@pytest.mark.parametrize(("name", "takes"), TABLE, ids=[name for name, _ in TABLE])
def test_every_value_taking_option_keeps_its_values(name: str, takes: mpiexec_options.Takes) -> None:
    values = [f"{word.lower()}.py" for word in takes.values.split()]  # values that look like scripts
    for given in spellings(name, values):
        args = parse_args(["-n", "2", *given, "train.py", "a.py"])
        assert args.program == ["train.py", "a.py"] and args.mpiexec_options == given
        argv = build(["-n", "2", *given, "train.py", "a.py"])
        script = argv.index("py")
        assert argv[script - len(given) : script] == given and argv[script:] == [
            "py",
            "-m",
            "mpi4py",
            "train.py",
            "a.py",
        ]


@pytest.mark.parametrize(("name", "takes"), TABLE, ids=[name for name, _ in TABLE])
def test_an_option_missing_its_values_exits_2_with_usage(
    capsys: pytest.CaptureFixture[str], name: str, takes: mpiexec_options.Takes
) -> None:
    values = [f"{word.lower()}.py" for word in takes.values.split()]
    for given in spellings(name, values):
        if len(given) == 1:
            continue  # --name=VALUE: nothing left to leave out
        assert main(["launch", "-n", "2", *given[:-1]]) == 2
        err = capsys.readouterr().err
        option = given[0].partition("=")[0]
        assert f"mpiexec option {option} takes {takes.values}, got " in err, err
        assert "usage: distutils-ml launch -n N" in err


def test_hydra_name_value_pairs_come_as_one_or_two_arguments() -> None:
    for given in (
        ["-genv", "A=b.py"],
        ["-genv", "A", "b.py"],
        ["-genv=A", "b.py"],
        ["-genv=A=b.py"],
        ["-env", "A=b.py"],
    ):
        assert parse_args(["-n", "2", *given, "train.py"]).mpiexec_options == given
    with pytest.raises(ValueError, match="mpiexec option -env takes NAME VALUE, got only 'A'"):
        parse_args(["-n", "2", "-env", "A"])


def test_two_value_options_before_the_script() -> None:
    """The issue's command: --mca takes a name and a value, so agent.py is not the script."""
    args = parse_args(["launch", "-n", "2", "--mca", "plm_ssh_agent", "/opt/agent.py", "train.py"])
    assert args.program == ["train.py"] and args.mpiexec_options == ["--mca", "plm_ssh_agent", "/opt/agent.py"]
    given = ["--prtemca", "plm_ssh_agent", "a.py", "-pmixmca", "x", "b.py", "-genv", "PYTHONSTARTUP", "c.py"]
    given += ["--append-env", "PYTHONPATH[:]", "d.py", "-x", "e.py", "--mca=btl", "f.py", "-H", "g.py"]
    args = parse_args(["-n", "2", *given, "-np", "3", "train.py", "--mca", "x", "y.py"])
    assert args.mpiexec_options == given and args.ranks == 3
    assert args.program == ["train.py", "--mca", "x", "y.py"]


def test_unknown_options_pass_through_without_values() -> None:
    given = ["--some-future-flag", "--unknown=x.py", "-q"]
    args = parse_args(["-n", "2", *given, "train.py", "a.py"])
    assert args.mpiexec_options == given and args.program == ["train.py", "a.py"]


# --- what reaches ranks on other nodes --------------------------------------------


def test_library_variables_reach_every_node() -> None:
    environ = {"DML_TIMEOUT": "20", "DML_DEBUG": "1", "DMLX": "no", "HOME": "/root", "PYTHONPATH": "src"}
    argv = build(["-n", "2", "train.py"], environ=environ)
    assert exported(argv) == [
        "OMP_NUM_THREADS=4",
        "MKL_NUM_THREADS=4",
        "THP_MEM_ALLOC_ENABLE=1",
        "DML_DEBUG",
        "DML_TIMEOUT",
    ]
    assert "DML_TIMEOUT=20" not in argv  # its value comes from mpiexec's environment, as the user set it


@pytest.mark.parametrize(
    "given",
    [["-x", "DML_TIMEOUT"], ["-x", "DML_TIMEOUT=30"], ["--x", "DML_TIMEOUT=30"], ["--x=DML_TIMEOUT"], ["-x", "DML_*"]],
)
def test_a_library_variable_the_user_exported_is_not_added(given: list[str]) -> None:
    argv = build(["-n", "2", *given, "train.py"], environ={"DML_TIMEOUT": "20", "DML_DEBUG": "1"})
    assert argv[argv.index("py") - len(given) : argv.index("py")] == given
    ours = exported(argv[: argv.index("py") - len(given)])
    assert "DML_TIMEOUT" not in ours and ("DML_DEBUG" in ours) is (given != ["-x", "DML_*"])


@requires_mpi
def test_dry_run_shows_the_library_variables(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DML_TIMEOUT", "20")
    argv = dry_run(capsys, ["-n", "2", "train.py"])
    assert "DML_TIMEOUT" in exported(argv)


def test_keepalive_defaults_unless_the_user_set_them() -> None:
    argv = build(["-n", "2", "train.py"])
    assert argv[argv.index("--mca") : argv.index("py")] == KEEPALIVE_OPTIONS
    users = ["--mca", "oob_tcp_keepalive_time", "60", "--prtemca=oob_tcp_keepalive_probes", "10"]
    argv = build(["-n", "2", *users, "train.py"])
    assert argv[argv.index("--mca") : argv.index("py")] == [
        *("--mca", "oob_tcp_keepalive_intvl", "2"),
        *("--mca", "mpi_abort_delay", "2"),
        *users,
    ]
    for prefix in ("PRTE_MCA_", "OMPI_MCA_"):
        argv = build(["-n", "2", "train.py"], environ={f"{prefix}oob_tcp_keepalive_intvl": "7"})
        assert argv[argv.index("--mca") : argv.index("py")] == [*KEEPALIVE_OPTIONS[:3], *KEEPALIVE_OPTIONS[6:]]
    argv = build(["-n", "2", "--mca", "mpi_abort_delay", "-1", "train.py"])  # a debugger's "never abort" wins
    assert argv[argv.index("--mca") : argv.index("py")] == [*KEEPALIVE_OPTIONS[:9], "--mca", "mpi_abort_delay", "-1"]


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
    assert argv[argv.index("btl") - 1 - len(KEEPALIVE_OPTIONS) :] == [
        *KEEPALIVE_OPTIONS,
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


def test_hydra_mpiexec_gets_no_open_mpi_flags(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    fake = tmp_path / "mpiexec"
    fake.write_text("#!/bin/sh\necho 'HYDRA build details:'\n")
    fake.chmod(0o755)
    monkeypatch.setenv("DML_TIMEOUT", "20")  # Hydra passes its whole environment on, to every node
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


def _signal_when_ready(ready: Path, signum: int) -> threading.Thread:
    """A started thread that sends ``signum`` to this process once ``ready`` exists (30 s at most)."""

    def send() -> None:
        deadline = time.monotonic() + 30
        while not ready.exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        if ready.exists():
            os.kill(os.getpid(), signum)

    sender = threading.Thread(target=send)
    sender.start()
    return sender


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP])
def test_signals_reach_mpiexec_and_its_status_comes_back(tmp_path: Path, signum: int) -> None:
    ready = tmp_path / "ready"
    fake = tmp_path / "mpiexec"
    script = (
        f"[ \"$1\" = --version ] && exit 0\ntrap 'exit 7' INT TERM HUP\ntouch {ready}\nwhile :; do sleep 0.05; done\n"
    )
    fake.write_text("#!/bin/sh\n" + script)
    fake.chmod(0o755)
    sender = _signal_when_ready(ready, signum)
    try:
        assert main(["launch", "-n", "2", "train.py"], python=str(tmp_path / "python")) == 7
    finally:
        sender.join()


def _fake_open_mpi(tmp_path: Path, on_signal: str) -> tuple[Path, Path]:
    """A stand-in Open MPI mpiexec (it says so to ``--version``) that counts its starts in a file, touches ``ready``,
    runs ``on_signal`` (a trap action) on SIGINT, SIGTERM and SIGHUP, and waits; (its path, the counter)."""
    ready, starts, fake = tmp_path / "ready", tmp_path / "starts", tmp_path / "mpiexec"
    fake.write_text(
        "#!/bin/sh\n"
        "[ \"$1\" = --version ] && { echo 'mpiexec (Open MPI) 5.0.0'; exit 0; }\n"
        f"echo started >> {starts}\ntrap '{on_signal}' INT TERM HUP\ntouch {ready}\n"
        "while :; do sleep 0.05; done\n"
    )
    fake.chmod(0o755)
    return fake, starts


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_that_ends_an_attempt_is_not_restarted(
    tmp_path: Path, signum: int, capfd: pytest.CaptureFixture[str]
) -> None:
    """Ctrl-C, kill or scancel during ``--restarts``: the job ends with the attempt (as torchrun's agent does)."""
    _fake_open_mpi(tmp_path, "exit 7")
    sender = _signal_when_ready(tmp_path / "ready", signum)
    try:
        code = main(["launch", "-n", "2", "--restarts", "3", "train.py"], python=str(tmp_path / "python"))
    finally:
        sender.join()
    err = capfd.readouterr().err
    assert code == 7, err
    assert (tmp_path / "starts").read_text().count("started") == 1, err
    assert f"attempt 1 was stopped by {signal.Signals(signum).name} (exit status 7); not restarting" in err, err


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="its processes are found through Linux's /proc")
def test_an_mpiexec_still_running_after_a_signal_is_ended(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    """An mpiexec that a passed-on SIGTERM does not end (its daemon on a node cut off never answers) is ended
    ``signal_wait`` s later, with what it started; the status is 128 + SIGTERM."""
    fake, _ = _fake_open_mpi(tmp_path, ":")  # the trap does nothing: it keeps waiting
    sender = _signal_when_ready(tmp_path / "ready", signal.SIGTERM)
    start = time.monotonic()
    try:
        code = run_supervised([str(fake)], {}, signal_wait=1.0)
    finally:
        sender.join()
    took = time.monotonic() - start
    err = capfd.readouterr().err
    assert code == 128 + signal.SIGTERM, err
    assert "mpiexec was still running 1 s after the launcher passed it SIGTERM" in err and "ended it" in err, err
    assert took < 10, took  # the wait and the grace, not forever


# What Open MPI 5's mpiexec writes when a node stops answering, and when the daemon it started on a node ends while
# the job runs (every process there killed); it may exit 0 after either (both seen on the namespace cluster).
_UNREACHABLE = """--------------------------------------------------------------------------
PRTE has lost communication with a remote daemon.

  HNP daemon   : [prterun-node-a-23148@0,0] on node node-a
  Remote daemon: [prterun-node-a-23148@0,2] on node node-c

This is usually due to either a failure of the TCP network
connection to the node, or possibly an internal failure of
the daemon itself. We cannot recover from this failure, and
therefore will terminate the job.
--------------------------------------------------------------------------
"""
_ENDED = """------------------------------------------------------------
A daemon failed to report back after being spawned. This could
be due to several factors, including inability to find the
daemon executable, or the executable was unable to find its
required supporting libraries. In some cases, the daemon was
able to execute, but was unable to complete a TCP connection
back to prterun:

  Local host:    node-a
  Remote host:   node-b
  Daemon exit status: 0

This may also be caused by a firewall on the remote host. Please
check that any firewall (e.g., iptables) has been disabled and
try again.
------------------------------------------------------------
"""


@pytest.mark.parametrize("split", [1, 97, 100_000])
def test_a_node_lost_fails_the_job_though_mpiexec_exits_0(
    tmp_path: Path, capfd: pytest.CaptureFixture[str], split: int
) -> None:
    """Both reports, written in pieces of ``split`` bytes (the first on standard error, the second on standard output,
    as Open MPI 5 does), are found: the job fails naming both nodes, which are handed to the restarts."""
    (tmp_path / "rank-hosts").write_text("node-a\nnode-b\nnode-c\n")
    writer = (
        "import sys\n"
        f"parts = (({_UNREACHABLE!r}, sys.stderr), ('other output\\n', sys.stdout), ({_ENDED!r}, sys.stdout))\n"
        "for text, to in parts:\n"
        f"    for i in range(0, len(text), {split}):\n"
        f"        to.buffer.write(text[i:i + {split}].encode()); to.buffer.flush()\n"
        "sys.exit(0)\n"
    )
    lost: list[str] = []
    code = run_supervised([sys.executable, "-c", writer], {}, tmp_path / "rank-hosts", lost)
    out, err = capfd.readouterr()
    assert out == "other output\n" + _ENDED, out
    assert code == 1, err[-3000:]
    said = [line for line in err.splitlines() if "the job lost node(s)" in line]
    assert len(said) == 1 and "mpiexec exited with status 0" in said[0], err[-3000:]
    assert "node-c (rank(s) [2])" in said[0] and "node-b (rank(s) [1])" in said[0], said
    assert sorted(lost) == ["node-b", "node-c"]


# A stand-in for an mpiexec left waiting after an abort: it starts a child (as mpiexec starts ranks and agents), prints
# what a rank's MPI_Abort prints, then ignores SIGTERM and waits, as mpiexec does for a daemon it cannot reach.
_STUCK = """
import signal, subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
print(child.pid, flush=True)
signal.signal(signal.SIGTERM, signal.SIG_IGN)
sys.stderr.write("MPI_ABORT was invoked on rank 1 in communicator MPI_COMM_WORLD\\n"); sys.stderr.flush()
time.sleep(int(sys.argv[1]))
sys.exit(5)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="its processes are found through Linux's /proc")
def test_an_mpiexec_still_running_after_an_abort_is_ended_with_what_it_started(
    capfd: pytest.CaptureFixture[str],
) -> None:
    """``abort_wait`` s after the abort's report, SIGTERM (ignored), SIGKILL a second later, to it and its child."""
    start = time.monotonic()
    code = run_supervised([sys.executable, "-c", _STUCK, "600"], {}, abort_wait=1.0)
    took = time.monotonic() - start
    out, err = capfd.readouterr()
    child = int(out.split()[0])
    assert code == 1, err
    assert "mpiexec was still running 1 s after a rank aborted the job" in err and "ended it" in err, err
    assert 2 < took < 10, took  # the wait and the grace, not the stand-in's 600 s
    deadline = time.monotonic() + 5
    while _running(child) and time.monotonic() < deadline:  # SIGKILLed: gone as soon as init reaps it
        time.sleep(0.05)
    assert not _running(child), "the stuck mpiexec's child is still running"


@pytest.mark.parametrize("wait", [None, 30.0])
def test_an_mpiexec_that_ends_within_the_wait_or_without_one_keeps_its_status(
    capfd: pytest.CaptureFixture[str], wait: float | None
) -> None:
    code = run_supervised([sys.executable, "-c", _STUCK, "2"], {}, abort_wait=wait)
    out, err = capfd.readouterr()
    child = int(out.split()[0])
    os.kill(child, signal.SIGKILL)  # not this test's: the stand-in leaves it, as a real mpiexec would not
    assert code == 5 and "ended it" not in err, err


def test_the_wait_after_an_abort_is_open_mpis_abort_delay_and_a_teardown() -> None:
    """The user's mpi_abort_delay (an option, else the environment), else the launcher's 2 s; a negative one (a
    debugger's "never abort") sets no limit."""
    teardown = launch.ABORT_TEARDOWN
    assert launch.abort_wait([], {}) == 2 + teardown
    assert launch.abort_wait([], {"PRTE_MCA_mpi_abort_delay": "10"}) == 10 + teardown
    given = ["-x", "A=1", "--mca", "mpi_abort_delay", "0.5", "--mca", "btl", "^ofi"]
    assert launch.abort_wait(given, {"OMPI_MCA_mpi_abort_delay": "10"}) == 0.5 + teardown
    assert launch.abort_wait(["--prtemca", "mpi_abort_delay", "-1"], {}) is None
    assert launch.abort_wait([], {"OMPI_MCA_mpi_abort_delay": "-1"}) is None
    assert launch.abort_wait(["--mca", "mpi_abort_delay", "soon"], {}) == 2 + teardown


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


@requires_mpi
def test_library_variables_reach_a_rank_on_another_node(tmp_path: Path) -> None:
    """A second node on this machine: Open MPI starts its daemon through an agent that clears the environment (as ssh).

    Without the launcher's -x, DML_TIMEOUT would reach only rank 0 (under mpiexec on this node). The daemon of the
    second node also talks to mpiexec over TCP, so the launcher's keepalive settings are in real use.
    """
    agent = tmp_path / "agent"
    agent.write_text('#!/bin/sh\nshift\nexec env -i PATH="$PATH" HOME="$HOME" sh -c "$*"\n')  # drops the host name
    agent.chmod(0o755)
    show = "import os; from mpi4py import MPI; "
    show += "print('rank', MPI.COMM_WORLD.rank, os.getenv('DML_TIMEOUT'), os.getenv('A'), flush=True)"
    cmd = [sys.executable, "-m", "distutils_ml.launch", "launch", "-n", "2", "--threads-per-rank", "1"]
    cmd += ["--host", "localhost:1,node-b.invalid:1", "--mca", "plm_ssh_agent", str(agent), "--mca", "btl", "^ofi"]
    env = cli_env(**ROOT_VARS, DML_TIMEOUT="20", A="here only")
    proc = subprocess.run(
        [*cmd, "--", "-c", show], env=env, cwd=ROOT, capture_output=True, text=True, timeout=120, check=False
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "rank 0 20 here only" in proc.stdout, proc.stdout + proc.stderr
    assert "rank 1 20 None" in proc.stdout, proc.stdout + proc.stderr  # DML_* travels, other variables do not
    assert "keepalive" not in proc.stderr, proc.stderr


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
    """SIGHUP is passed on to mpiexec; SIGKILL of the launcher ends mpiexec (parent-death signal) and the ranks.

    Under load too (CI failed that way once): busy processes keep both cores while the launcher dies.
    """
    cmd = [sys.executable, "-m", "distutils_ml.launch", "launch", "-n", "2", "--threads-per-rank", "1"]
    cmd += [str(ROOT / "tests" / "launch_probe.py"), "--wait", str(tmp_path)]
    env = cli_env(**ROOT_VARS, OMPI_MCA_btl="^ofi")
    with (tmp_path / "out.txt").open("w") as out:  # run outside the checkout: the installed launcher
        launcher = subprocess.Popen(cmd, env=env, cwd=tmp_path, stdout=out, stderr=subprocess.STDOUT)
    pids = [tmp_path / f"rank{rank}.pid" for rank in (0, 1)]
    job: set[int] = set()
    hogs: list[subprocess.Popen[bytes]] = []
    try:
        deadline = time.monotonic() + 120
        while not all(p.exists() for p in pids) and launcher.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert all(p.exists() for p in pids), (tmp_path / "out.txt").read_text()
        ranks = {int(p.read_text()) for p in pids}
        job = _job_processes(launcher.pid) | ranks
        assert ranks <= job and len(job) > len(ranks)  # mpiexec, its helpers and the ranks
        # The kernel sends the parent-death signal again for each launcher thread mpiexec passes to when
        # the launcher dies, and mpiexec takes a second SIGTERM as "abort now", leaving the ranks running.
        threads = sorted(os.listdir(f"/proc/{launcher.pid}/task"))
        assert threads == [str(launcher.pid)], (
            f"the launcher runs {len(threads)} threads; mpiexec would get 1 SIGTERM each"
        )
        hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(3)]
        launcher.send_signal(signum)
        launcher.wait(timeout=30)
        deadline = time.monotonic() + 10
        while any(map(_running, job)) and time.monotonic() < deadline:
            time.sleep(0.1)
        survivors = {pid: Path(f"/proc/{pid}/cmdline").read_bytes() for pid in job if _running(pid)}
        assert not survivors, f"still running after the launcher got signal {signum}: {survivors}"
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()
        launcher.kill()
        launcher.wait()
        for pid in job:
            if _running(pid):
                os.kill(pid, signal.SIGKILL)


# --- inside a SLURM allocation (the real thing: tests/test_slurm.py) --------------------

ALLOCATION = {"SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "node-[a-b]", "SLURM_JOB_NUM_NODES": "2", "SLURM_NTASKS": "8"}


def test_inside_an_allocation_mpiexec_places_the_ranks_and_threads_count_per_node() -> None:
    argv = build(["-n", "8", "train.py"], cores=8, environ=ALLOCATION)
    assert "--oversubscribe" not in argv  # 8 ranks on 8 cores of each of 2 nodes: 4 per node
    assert "OMP_NUM_THREADS=2" in argv and "--hostfile" not in argv
    assert "OMP_NUM_THREADS=3" in build(
        ["-n", "8", "train.py"], cores=8, environ={**ALLOCATION, "SLURM_CPUS_PER_TASK": "3"}
    )
    # A hostfile of the user's own: as outside an allocation.
    hosts = build(["-n", "16", "--hostfile", "h", "train.py"], cores=8, environ=ALLOCATION)
    assert "--oversubscribe" not in hosts and "OMP_NUM_THREADS=1" in hosts
    assert "--oversubscribe" in build(["-n", "16", "train.py"], cores=8, environ={})


@requires_mpi
def test_inside_an_allocation_n_defaults_to_its_tasks_and_the_launcher_says_so(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    for name, value in ALLOCATION.items():
        monkeypatch.setenv(name, value)
    argv = dry_run(capsys, ["train.py"])
    assert argv[1:3] == ["-n", "8"], argv
    assert main(["launch", "--dry-run", "train.py"]) == 0
    said = capsys.readouterr().err
    assert "inside SLURM allocation 7 (nodes node-[a-b]): mpiexec places the 8 ranks on its nodes" in said, said
    assert "(8: its SLURM_NTASKS)" in said
    assert main(["launch", "--dry-run", "-n", "4", "train.py"]) == 0
    assert "the 4 ranks" in capsys.readouterr().err
    monkeypatch.delenv("SLURM_JOB_ID")
    assert main(["launch", "--dry-run", "train.py"]) == 2
    assert "give the number of ranks with -n N" in capsys.readouterr().err
