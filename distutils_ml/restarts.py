"""Restarting a failed job on the nodes that still answer: ``distutils-ml launch --restarts N --min-nodes M``.

The launcher runs the job; when it fails, it asks every node whether a job can still start there (a one-process
``mpiexec -H node:1 true`` per node, in parallel, 20 s at most: the same way in as the job's), drops those that do
not answer, and starts the job again on the others with as many ranks per node as before, if at least M nodes are
left. The script resumes by itself through :class:`distutils_ml.TrainState`, which tells the launcher where it
resumed from (``DML_RESUME_REPORT``). Each restart is logged on stderr with its reason, the nodes dropped and the
point resumed from. A failure that repeats with the same status on the same nodes from the same point (a bug, not a
node) stops the restarts. The exit status is the last attempt's: 0 only if the job finished.

The nodes come from ``--hostfile``, ``-H``/``--host``, or the SLURM allocation the launcher runs in; without any,
the job runs on this machine and is restarted there.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from distutils_ml.mpiexec_options import HOST_OPTIONS, given_options, values_taken
from distutils_ml.trainstate import RESUME_REPORT_ENV

__all__ = ["allocation_hosts", "answering", "hosts_of", "run_with_restarts", "without_hosts"]

_PROBE_S = 20.0


def hosts_of(options: Sequence[str], environ: Mapping[str, str]) -> list[tuple[str, int]] | None:
    """The nodes and their slots from the options (``--hostfile``, ``-H``) or the SLURM allocation; None: none."""
    for name, values in given_options(list(options)):
        if name in ("hostfile", "machinefile"):
            hosts = []
            for line in Path(values[0]).read_text().splitlines():
                words = line.split("#", 1)[0].split()
                if words:
                    given = [w.split("=", 1)[1] for w in words[1:] if w.startswith("slots=")]
                    slots = int(given[0]) if given and given[0].isdigit() else 1
                    hosts.append((words[0], slots))
            return hosts
        if name in ("H", "host"):
            out: list[tuple[str, int]] = []
            for item in values[0].split(","):
                host, _, slots = item.partition(":")
                out.append((host, int(slots) if slots.isdigit() else 1))
            return out
    return allocation_hosts(environ)


def allocation_hosts(environ: Mapping[str, str]) -> list[tuple[str, int]] | None:
    """The nodes of the SLURM allocation and its tasks on each (``scontrol show hostnames``), or None."""
    nodelist = environ.get("SLURM_JOB_NODELIST") or environ.get("SLURM_NODELIST")
    if not environ.get("SLURM_JOB_ID") or not nodelist or shutil.which("scontrol") is None:
        return None
    shown = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, check=False)
    names = shown.stdout.split()
    counts: list[int] = []
    for part in environ.get("SLURM_TASKS_PER_NODE", "").split(","):  # "2(x3),1"
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if match:
            counts += [int(match.group(1))] * int(match.group(2) or 1)
    if len(counts) != len(names):
        counts = [1] * len(names)
    return list(zip(names, counts, strict=True)) or None


def without_hosts(options: Sequence[str]) -> list[str]:
    """``options`` without the ones that name hosts (and their values)."""
    out, i = [], 0
    while i < len(options):
        taken = values_taken(options[i], list(options[i + 1 :]))
        if options[i].lstrip("-").partition("=")[0] not in HOST_OPTIONS:
            out += options[i : i + 1 + taken]
        i += 1 + taken
    return out


def answering(mpiexec: str, hosts: Sequence[str], options: Sequence[str], env: Mapping[str, str]) -> list[str]:
    """The ``hosts`` on which a one-process job starts and ends within 20 s, in their order."""
    ok: dict[str, bool] = {}

    def probe(host: str) -> None:
        argv = [mpiexec, "-H", f"{host}:1", "-n", "1", *options, "true"]
        try:
            done = subprocess.run(argv, env=dict(env), capture_output=True, timeout=_PROBE_S, check=False)
            ok[host] = done.returncode == 0
        except subprocess.TimeoutExpired:
            ok[host] = False

    threads = [threading.Thread(target=probe, args=(h,), daemon=True) for h in hosts]
    for t in threads:
        t.start()
    for t in threads:
        t.join(_PROBE_S + 10)
    return [h for h in hosts if ok.get(h)]


def run_with_restarts(  # noqa: PLR0917 - the launcher's pieces, passed in by launch.main
    args: Any, mpiexec: str, python: str | None, open_mpi: bool, build: Any, supervise: Any
) -> int:
    """Run ``args`` (a ``LaunchArgs``), restarting it as the module says; the exit status of the last attempt."""
    environ = os.environ
    hosts = hosts_of(args.mpiexec_options, environ)
    local = hosts is None
    nodes = [h for h, _ in hosts] if hosts else ["localhost"]
    slots = dict(hosts) if hosts else {"localhost": args.ranks}
    per_node = -(-args.ranks // len(nodes))
    options = without_hosts(args.mpiexec_options)
    attempts, previous, code = args.restarts + 1, None, 1
    for attempt in range(1, attempts + 1):
        ranks = args.ranks if local else per_node * len(nodes)
        with tempfile.TemporaryDirectory(prefix="dml-launch-") as tmp:
            report = Path(tmp) / "resumed"
            placed = options
            if not local:
                hostfile = Path(tmp) / "hosts"
                hostfile.write_text("".join(f"{h} slots={max(per_node, slots.get(h, 1))}\n" for h in nodes))
                placed = [*options, "--hostfile", str(hostfile)]
            command = build(dataclasses.replace(args, ranks=ranks, mpiexec_options=placed), mpiexec=mpiexec,
                            python=python, open_mpi=open_mpi)  # fmt: skip
            argv = [command.argv[0], "-x", f"{RESUME_REPORT_ENV}={report}", *command.argv[1:]]
            _say(f"attempt {attempt} of {attempts}: {ranks} rank(s) on {', '.join(nodes)}")
            code = supervise(argv, command.env, Path(tmp))
            resumed = _read_report(report)
        if resumed is not None:
            _say(f"attempt {attempt} resumed from {resumed}")
        if code == 0:
            if attempt > 1:
                _say(f"the job finished after {attempt - 1} restart(s)")
            return 0
        point = (code, tuple(nodes), resumed)
        if previous is not None and point == previous:
            _say(
                f"attempt {attempt} failed as attempt {attempt - 1} did (exit status {code}, on the same nodes, "
                f"from the same point: {resumed or 'the start'}): a bug in the job, not a lost node; not restarting"
            )
            return code
        previous = point
        if attempt == attempts:
            _say(f"attempt {attempt} failed (exit status {code}); no restarts left (--restarts {args.restarts})")
            return code
        alive = nodes if local else answering(mpiexec, nodes, options, {**environ, **command.env})
        dropped = [h for h in nodes if h not in alive]
        if len(alive) < args.min_nodes:
            _say(
                f"attempt {attempt} failed (exit status {code}); only {len(alive)} node(s) answer "
                f"({', '.join(alive) or 'none'}; lost: {', '.join(dropped)}), fewer than --min-nodes "
                f"{args.min_nodes}: not restarting"
            )
            return code
        _say(
            f"attempt {attempt} failed (exit status {code}); restarting on {', '.join(alive)}"
            + (f", without {', '.join(dropped)} (not answering)" if dropped else "")
        )
        nodes = alive
    return code


def _read_report(path: Path) -> str | None:
    try:
        seen = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    values = ", ".join(f"{k}={v}" for k, v in seen.get("values", {}).items())
    return f"{seen.get('file')} (epoch {seen.get('epoch')}{', ' + values if values else ''})"


def _say(text: str) -> None:
    print(f"distutils-ml launch: {text}", file=sys.stderr, flush=True)
