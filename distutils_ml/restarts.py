"""Restarting a failed job on the nodes that still answer: ``distutils-ml launch --restarts N --min-nodes M``.

The launcher runs the job; when it fails, it asks every node whether a job can still start there (a one-process
``mpiexec -H node:1 python ...`` per node, in parallel, 20 s at most: the same way in as the job's, and one that
removes the session directories killed Open MPI processes left there, see distutils_ml/sessiondirs.py), drops
those that do not answer, and starts the job again on the others with as many ranks per node as before, if at
least M nodes are left. The script resumes by itself through :class:`distutils_ml.TrainState`, which tells the
launcher where it resumed from (``DML_RESUME_REPORT``). Each restart is logged on stderr with its reason, the nodes
dropped and the point resumed from. A failure that repeats with the same status on the same nodes from the same
point (a bug, not a node) stops the restarts. The exit status is the last attempt's: 0 only if the job finished.

The nodes come from ``--hostfile``, ``-H``/``--host``, or the SLURM allocation the launcher runs in; without any,
the job runs on this machine and is restarted there.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from distutils_ml import sessiondirs
from distutils_ml.mpiexec_options import HOST_OPTIONS, given_options, values_taken
from distutils_ml.trainstate import RESUME_REPORT_ENV

__all__ = ["Stopped", "allocation_hosts", "answering", "hosts_of", "run_with_restarts", "without_hosts"]

_PROBE_S = 20.0
_PROBE_TRIES = 3
_LOST_GRACE_S = 2.0


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


def answering(
    mpiexec: str,
    hosts: Sequence[str],
    options: Sequence[str],
    env: Mapping[str, str],
    *,
    python: str | None = None,
    lost: Sequence[str] = (),
) -> list[str]:
    """The ``hosts`` on which a one-process job starts and ends within 20 s, in their order.

    The job is ``python`` running distutils_ml/sessiondirs.py, which removes the session directories that killed
    Open MPI processes left on that node (they would fail a later daemon that gets the same process id); the
    directories removed are said on stderr. A probe that fails at once is tried again (twice at most, within the
    20 s): its own daemon may have met such a directory. Without ``python``, the job is ``true``.

    The hosts in ``lost`` (where mpiexec lost its daemon during the job) are asked too, but waited for only until
    the others have answered, and 2 s more: a node whose processes were killed answers as fast as the rest, while
    one cut off would cost the whole 20 s.
    """
    job = [python, "-c", Path(sessiondirs.__file__).read_text()] if python else ["true"]
    ok: dict[str, bool] = {}
    running: dict[str, subprocess.Popen[str]] = {}
    guard, stop = threading.Lock(), threading.Event()

    def probe(host: str) -> None:
        argv = [mpiexec, "-H", f"{host}:1", "-n", "1", *options, *job]
        deadline = time.monotonic() + _PROBE_S
        for _ in range(_PROBE_TRIES):
            with guard:
                if stop.is_set() or time.monotonic() >= deadline:
                    return
                proc = running[host] = subprocess.Popen(
                    argv, env=dict(env), stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
                )
            try:
                out, _ = proc.communicate(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _end(proc)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.communicate(timeout=5)
                return
            if proc.returncode == 0:
                ok[host] = True
                for line in out.splitlines():
                    if ": removed " in line:
                        _say(f"stale Open MPI session directory on {line}")
                return

    threads = {h: threading.Thread(target=probe, args=(h,), daemon=True) for h in hosts}
    for t in threads.values():
        t.start()
    for h, t in threads.items():
        if h not in lost:
            t.join(_PROBE_S + 10)
    until = time.monotonic() + _LOST_GRACE_S
    for h, t in threads.items():
        if h in lost:
            t.join(max(0.0, until - time.monotonic()))
    with guard:
        stop.set()
        for proc in running.values():
            _end(proc)
    sessiondirs.remove_stale()  # of a probe's mpiexec that had to be killed
    return [h for h in hosts if ok.get(h)]


def _end(proc: subprocess.Popen[str]) -> None:
    """End a probe's ``mpiexec``: SIGTERM (it ends its daemons and removes its session directory), SIGKILL 1 s later.
    Its output is left to the thread that reads it."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=1)
        except subprocess.TimeoutExpired:
            proc.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=5)


class Stopped(Exception):
    """Raised by the ``supervise`` of :func:`run_with_restarts` when a signal passed on to mpiexec ended the attempt
    (Ctrl-C, ``kill``, ``scancel``): restarting would undo what was asked, as torchrun does not restart either."""

    def __init__(self, code: int, signum: int) -> None:
        super().__init__(code, signum)
        self.code = code
        self.signal_name = signal.Signals(signum).name


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
            lost: list[str] = []  # the nodes where mpiexec lost its daemon
            try:
                code = supervise(argv, command.env, Path(tmp), lost)
            except Stopped as stop:  # the user's (or SLURM's) signal ended the attempt: the job is not restarted
                _say(f"attempt {attempt} was stopped by {stop.signal_name} (exit status {stop.code}); not restarting")
                return stop.code
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
        _say(f"attempt {attempt} failed (exit status {code})" + ("" if local else f"; asking {', '.join(nodes)}"))
        for path in sessiondirs.remove_stale():  # mpiexec's own, here: a killed one's would fail the next
            _say(f"stale Open MPI session directory here: removed {path}")
        probe_env = {**environ, **command.env}
        here = python or sys.executable
        alive = nodes if local else answering(mpiexec, nodes, options, probe_env, python=here, lost=lost)
        dropped = [h for h in nodes if h not in alive]
        if len(alive) < args.min_nodes:
            _say(
                f"only {len(alive)} node(s) answer ({', '.join(alive) or 'none'}; lost: {', '.join(dropped)}), "
                f"fewer than --min-nodes {args.min_nodes}: not restarting"
            )
            return code
        _say(
            f"restarting on {', '.join(alive)}"
            + "".join(
                f", without {', '.join(group)} ({why})"
                for group, why in (
                    ([h for h in dropped if h in lost], "lost during the job, not answering"),
                    ([h for h in dropped if h not in lost], "not answering"),
                )
                if group
            )
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
