"""The grammar of ``mpiexec``'s options, Open MPI's and Hydra's (MPICH, Intel MPI): which take values, and how many.

The launcher passes every option before the script to mpiexec as given; this table is how it
knows where an option's values end, so a value ending in ``.py`` is never taken for the script.
"""

from __future__ import annotations

import shlex
from collections.abc import Sequence
from typing import NamedTuple

__all__ = [
    "EXPORT_OPTION",
    "HOST_OPTIONS",
    "MCA_OPTIONS",
    "OPTION_VALUES",
    "OVERSUBSCRIBE_OPTIONS",
    "PLACEMENT_OPTIONS",
    "ROOT_OPTIONS",
    "Takes",
    "exports",
    "given_options",
    "values_taken",
]

# Options by their name without dashes, as both mpiexecs read them (Open MPI turns -name into --name).
ROOT_OPTIONS = {"allow-run-as-root"}
HOST_OPTIONS = {"H", "host", "hostfile", "machinefile"}
PLACEMENT_OPTIONS = {"bind-to", "bindto", "map-by", "mapby"}
OVERSUBSCRIBE_OPTIONS = {"oversubscribe"}
EXPORT_OPTION = "x"
MCA_OPTIONS = ("mca", "gmca", "omca", "gomca", "prtemca", "pmixmca")


class Takes(NamedTuple):
    """The values an mpiexec option takes: their names, one word per argument after the option.

    ``joined``: a single ``NAME=VALUE`` argument may stand for both (Hydra's ``-env`` and ``-genv``).
    """

    values: str
    joined: bool = False


_VALUE = Takes("VALUE")
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
OPTION_VALUES: dict[str, Takes] = {
    # Open MPI: two values.
    **dict.fromkeys(MCA_OPTIONS, Takes("NAME VALUE")),
    "amca": Takes("FILE VALUE"),  # ends in "mca", so PMIx's parser takes FILE and the argument after it
    **dict.fromkeys(("prepend-env", "append-env"), Takes("NAME[SEP] VALUE")),
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
    **dict.fromkeys(("env", "genv"), Takes("NAME VALUE", joined=True)),
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
    "pmi_args": Takes("PORT INTERFACE KEY PID"),  # given by a singleton MPI process that starts mpiexec
}  # fmt: skip


def values_taken(arg: str, following: Sequence[str]) -> int:
    """How many of the arguments ``following`` mpiexec option ``arg`` are its values (0 for unknown options).

    Raises:
        ValueError: when the command line ends before them.
    """
    name, joined, value = arg.lstrip("-").partition("=")
    takes = OPTION_VALUES.get(name) if arg.startswith("-") else None
    if takes is None:
        return 0
    values = [value, *following] if joined else list(following)
    needed = 1 if takes.joined and values and "=" in values[0] else len(takes.values.split())
    if len(values) < needed:
        option = arg.partition("=")[0]
        got = f"only {shlex.join(values)!r}" if values else "nothing"
        raise ValueError(
            f"mpiexec option {option} takes {takes.values}, got {got}; give all its values "
            f"before the script, e.g. {option} {takes.values} train.py"
        )
    return needed - bool(joined)


def given_options(options: Sequence[str]) -> list[tuple[str, list[str]]]:
    """The mpiexec options in ``options``, each by its name without dashes, with its values.

    Example:
        >>> given_options(["--mca", "btl", "tcp", "-x", "A=1", "--host=a,b", "--oversubscribe"])
        [('mca', ['btl', 'tcp']), ('x', ['A=1']), ('host', ['a,b']), ('oversubscribe', [])]
    """
    given = []
    i = 0
    while i < len(options):
        taken = values_taken(options[i], options[i + 1 :])
        name, joined, value = options[i].lstrip("-").partition("=")
        given.append((name, [value] * bool(joined) + list(options[i + 1 : i + 1 + taken])))
        i += 1 + taken
    return given


def exports(exported: Sequence[str], variable: str) -> bool:
    """Whether the ``-x`` values ``exported`` (NAME, NAME=VALUE, or PREFIX* for all such) name ``variable``."""
    return any(
        export.partition("=")[0] == variable or (export.endswith("*") and variable.startswith(export[:-1]))
        for export in exported
    )
