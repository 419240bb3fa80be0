"""A real multi-node cluster on one Linux machine: network namespaces as nodes, Open MPI over TCP between them.

Each node is a network namespace with its own hostname (a UTS namespace entered by every
command run "on" it), its own address in a private /24 and an ``eth0`` plugged into a bridge
that lives in a switch namespace of its own: nothing is added to the machine's own network,
and traffic stays on the links made here. Open MPI's ``mpiexec`` runs on the first node and
starts its daemons on the others through an rsh agent (``plm_ssh_agent``) that does what ssh
would do: enter the node and run the command in a *clean* environment, so variables of the
launching shell do not reach remote ranks unless forwarded (``-x``), as on a real cluster.

Needs root, ``ip`` (iproute2) and ``unshare`` (util-linux). As a recipe, to rehearse a job::

    sudo python tests/cluster.py --nodes 2 --slots 2 -- \\
        distutils-ml launch -n 4 --hostfile {hostfile} --allow-run-as-root train.py

brings the nodes up, runs the command on the first node (``{hostfile}`` and ``{agent}`` are
replaced by their paths), and removes every namespace and file it made, also on Ctrl-C.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from distutils_ml import sessiondirs

#: Hostnames of the nodes, in order.
HOSTNAMES = tuple(f"node-{chr(ord('a') + i)}" for i in range(26))
_NETNS_ETC = Path("/etc/netns")  # ip netns exec bind-mounts /etc/netns/NS/hosts over /etc/hosts
_PREFIX = "dmlc"
_SERIAL = itertools.count()  # several clusters of one process get different names


_MPIEXEC_NAMES = ("prterun", "mpiexec", "mpirun")  # Open MPI 5's mpiexec runs as prterun

#: MCA settings every rank on every node gets (on the command line, which reaches remote ranks), and no binding:
#: each node's daemon binds its first rank to core 0 (Open MPI's default), so the ranks of three nodes of one rank
#: shared one of this machine's cores (measured: a start of torch on every rank 10.3 s, 5.5 s unbound). The nodes
#: share the machine's cores; on a real cluster each node's core 0 is its own.
MCA_OPTIONS = ("--mca", "btl", "^ofi", "--mca", "mpi_yield_when_idle", "1", "--bind-to", "none")


@dataclass
class Run:
    """What ``Cluster.run`` returns: the exit status (None: timed out and killed), the output, its seconds.

    ``ended`` is the wall-clock time (``time.time()``) at which the command exited or was killed.
    """

    returncode: int | None
    output: str
    seconds: float
    ended: float


def unavailable() -> str | None:
    """Why a cluster cannot be made here (one line), or None when it can."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "the cluster tests need root (network namespaces); run them as root or in CI"
    for tool in ("ip", "unshare"):
        if shutil.which(tool) is None:
            return f"the cluster tests need {tool!r} (iproute2, util-linux)"
    probe = f"{_PREFIX}probe{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True, check=False)
    if made.returncode != 0:
        return f"the cluster tests need 'ip netns add': {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True, check=False)
    return None


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


class Cluster:
    """N nodes joined by one bridge; ``up()`` makes them, ``down()`` removes them (also as a context manager).

    Args:
        nodes: number of nodes (namespaces), at most 26.
        slots: MPI slots per node in the hostfile.
        name: prefix of the namespaces' names (default ``dmlc<pid>-<k>``: unique on the machine).
        subnet: the first three octets of the private /24 the nodes' addresses are taken from.
        link: ``(rate in bit/s, one-way delay in s)``: 2 nodes joined by a shaped link (tests/delayline.py:
            a TUN device ``eth0`` in each, a real-time relay that delays every packet, tbf for the rate)
            instead of the bridge.

    Attributes:
        hosts: the nodes' hostnames (``node-a``, ``node-b``, ...).
        addresses: their addresses, in the same order.
        hostfile: path of an Open MPI hostfile listing every node with its slots.
        agent: path of the rsh agent (an executable) that runs a command on a node.
    """

    def __init__(
        self,
        nodes: int,
        slots: int = 1,
        *,
        name: str | None = None,
        subnet: str = "10.213.77",
        link: tuple[float, float] | None = None,
    ) -> None:
        if not 1 <= nodes <= len(HOSTNAMES):
            raise ValueError(f"nodes: got {nodes}; allowed: 1..{len(HOSTNAMES)}")
        if link is not None and nodes != 2:
            raise ValueError(f"link: a shaped link joins 2 nodes; got nodes={nodes}")
        self.link = link
        self._line: Any = None  # the DelayLine of a shaped link
        self.nodes, self.slots = nodes, slots
        self.name = name or f"{_PREFIX}{os.getpid()}-{next(_SERIAL)}"
        self.hosts = list(HOSTNAMES[:nodes])
        self.addresses = [f"{subnet}.{i + 1}" for i in range(nodes)]
        self.namespaces = [f"{self.name}-{host}" for host in self.hosts]
        self.switch = f"{self.name}-sw"
        self._dir = Path(tempfile.mkdtemp(prefix=f"{self.name}-"))
        self.hostfile = self._dir / "hostfile"
        self.agent = self._dir / "agent"

    # -- life cycle -------------------------------------------------------------------

    def __enter__(self) -> Cluster:
        self.up()
        return self

    def __exit__(self, *exc: object) -> None:
        self.down()

    def up(self) -> None:
        """Make the switch, the nodes, their links, hosts files, the hostfile and the agent."""
        try:
            _ip("netns", "add", self.switch)
            _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
            _ip("-n", self.switch, "link", "set", "br0", "up")
            hosts = "127.0.0.1 localhost\n" + "".join(
                f"{a} {h}\n" for a, h in zip(self.addresses, self.hosts, strict=True)
            )
            for i, (ns, address) in enumerate(zip(self.namespaces, self.addresses, strict=True)):
                _ip("netns", "add", ns)
                _ip("-n", ns, "link", "set", "lo", "up")
                if self.link is None:
                    port = self.port(i)
                    _ip("-n", self.switch, "link", "add", port, "type", "veth", "peer", "name", "eth0", "netns", ns)
                    _ip("-n", self.switch, "link", "set", port, "master", "br0", "up")
                    _ip("-n", ns, "addr", "add", f"{address}/24", "dev", "eth0")
                    _ip("-n", ns, "link", "set", "eth0", "up")
                etc = _NETNS_ETC / ns
                etc.mkdir(parents=True, exist_ok=True)
                (etc / "hosts").write_text(hosts)
            if self.link is not None:
                from delayline import DelayLine

                rate, delay = self.link
                self._line = DelayLine(*self.namespaces, *self.addresses, delay_s=delay, rate_bit_s=rate, ifname="eth0")
                self._line.start()
            self.hostfile.write_text("".join(f"{h} slots={self.slots}\n" for h in self.hosts))
            sessiondirs.remove_stale(hosts=self.hosts)  # left by a run that was killed before its kill_all
            self._write_agent()
        except BaseException:
            self.down()
            raise

    def down(self) -> None:
        """Kill every process on the nodes and remove the namespaces and files made by ``up`` (by name)."""
        self.kill_all()
        if self._line is not None:
            self._line.close()
        for ns in [*self.namespaces, self.switch]:
            _ip("netns", "del", ns, check=False)
            shutil.rmtree(_NETNS_ETC / ns, ignore_errors=True)
        shutil.rmtree(self._dir, ignore_errors=True)

    # -- use --------------------------------------------------------------------------

    def port(self, node: int) -> str:
        """The switch's port (a veth in the switch namespace) that node ``node`` is plugged into."""
        return f"p{node}"

    def cut(self, node: int) -> None:
        """Pull node ``node``'s cable: its switch port goes down (nothing reaches it or leaves it)."""
        _ip("-n", self.switch, "link", "set", self.port(node), "down")

    def mend(self, node: int, timeout: float = 15) -> None:
        """Plug node ``node``'s cable back in, and wait until another node reaches it again (a job started at once
        could otherwise find the link not yet passing traffic: "A daemon failed to report back")."""
        _ip("-n", self.switch, "link", "set", self.port(node), "up")
        if self.nodes < 2:
            return
        deadline = time.monotonic() + timeout
        while not self._reaches((node + 1) % self.nodes, node):
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.hosts[node]} is not reachable {timeout} s after its cable was plugged in")
            time.sleep(0.1)

    def _reaches(self, source: int, target: int) -> bool:
        """Whether node ``source`` reaches node ``target``: a TCP connection to a closed port is refused, not lost."""
        probe = (
            "import socket, sys\n"
            "try:\n    socket.create_connection((sys.argv[1], 9), 0.5)\n"
            "except ConnectionRefusedError:\n    sys.exit(0)\n"
            "except OSError:\n    sys.exit(1)\n"
        )
        argv = ["ip", "netns", "exec", self.namespaces[source], sys.executable, "-c", probe, self.addresses[target]]
        return subprocess.run(argv, capture_output=True, timeout=10, check=False).returncode == 0

    def command(self, argv: Sequence[str], node: int = 0) -> list[str]:
        """``argv`` as run on node ``node``: in its network namespace, under its hostname."""
        return ["ip", "netns", "exec", self.namespaces[node], *_on_host(self.hosts[node], argv)]

    def mpi_env(self, extra: Mapping[str, str] | None = None) -> dict[str, str]:
        """Environment for an mpiexec on the first node: this one, ``extra``, this cluster's agent, root allowed.

        Only the first node's processes see it: what remote ranks need goes on the command
        line (``mpiexec_argv``), as on a real cluster.
        """
        env = {**os.environ, **(extra or {})}
        env.update(
            PRTE_MCA_plm_ssh_agent=str(self.agent), OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1"
        )
        return env

    def mpiexec_argv(self, ranks: int, mpiexec: str | None = None) -> list[str]:
        """``mpiexec -n ranks --hostfile ...`` with the MCA settings every rank on every node needs here.

        ``--mca`` values reach every rank (unlike the launching shell's environment): no
        libfabric probe (slow, and no fabric here), and ranks that yield the core while they
        wait, so oversubscribed busy-polling ranks do not starve each other.
        """
        exe = mpiexec or str(Path(sys.executable).parent / "mpiexec")
        return [exe, "-n", str(ranks), "--hostfile", str(self.hostfile), *MCA_OPTIONS]

    def run(
        self,
        argv: Sequence[str],
        timeout: float,
        *,
        node: int = 0,
        env: Mapping[str, str] | None = None,
        on_line: Callable[[str], None] | None = None,
        cwd: str | os.PathLike[str] | None = None,
    ) -> Run:
        """Run ``argv`` on node ``node`` until it exits, or ``timeout`` s: then ask the ranks for their stacks
        (``ask_for_stacks``) and kill every process on the nodes. Under pytest, ``timeout`` is cut to end before
        the test's own timeout (tests/mpirun.py's ``time_left``), so that this happens before pytest's kill.

        ``on_line`` sees each line of output as it comes (e.g. to cut a cable at a given step).
        The result's ``seconds`` is the time until the command itself exited: processes it left
        on other nodes (holding its output open, as an ssh session would) do not count.
        """
        timeout = _within_the_test(timeout)
        start = time.monotonic()
        proc = self.popen(argv, node, env, cwd=cwd)
        lines: list[str] = []

        def read() -> None:
            assert proc.stdout is not None
            for line in proc.stdout:
                lines.append(line)
                if on_line is not None:
                    on_line(line)

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        try:
            code: int | None = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            code = None
        seconds, ended = time.monotonic() - start, time.time()
        if code is None:
            self.ask_for_stacks()
            self.kill_all()
        reader.join(timeout=5)
        return Run(code, "".join(lines), seconds, ended)

    def ask_for_stacks(self, wait: float = 3) -> None:
        """SIGUSR1 to every mpiexec on the nodes, which passes it to its ranks: those that registered
        faulthandler for it (the test jobs) print their Python stacks; then ``wait`` s for the output."""
        asked = False
        for ns in self.namespaces:
            for pid in _ip("netns", "pids", ns, check=False).stdout.split():
                with contextlib.suppress(OSError):  # gone meanwhile
                    if Path(f"/proc/{pid}/comm").read_text().strip() in _MPIEXEC_NAMES:
                        os.kill(int(pid), signal.SIGUSR1)
                        asked = True
        if asked:
            time.sleep(wait)

    def kill(self, node: int) -> None:
        """SIGKILL every process on node ``node`` (its daemon, its ranks, the launcher's agent into it), as when a
        node's processes are all killed; what they leave behind (session directories) stays, as it would."""
        for pid in _ip("netns", "pids", self.namespaces[node], check=False).stdout.split():
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(pid), signal.SIGKILL)

    def kill_all(self) -> None:
        """SIGKILL every process on the nodes (the cluster stays up), and remove the session directories that the
        killed ``mpiexec`` and daemons leave (``/tmp/ompi.<pid>``, ``/tmp/prted.<pid>``): a later one that gets the
        same process id would fail to start ("Daemon exit status: 213"; distutils_ml/sessiondirs.py)."""
        for node in range(self.nodes):
            self.kill(node)
        deadline = time.monotonic() + 5
        while any(_ip("netns", "pids", ns, check=False).stdout.split() for ns in self.namespaces):
            if time.monotonic() > deadline:
                return  # something survives SIGKILL for now: leave its files
            time.sleep(0.05)
        sessiondirs.remove_stale(hosts=self.hosts)

    def popen(
        self, argv: Sequence[str], node: int = 0, env: Mapping[str, str] | None = None, **kw: object
    ) -> subprocess.Popen[str]:
        """Start ``argv`` on node ``node`` with ``mpi_env(env)``; stdout and stderr together, as text."""
        return subprocess.Popen(  # type: ignore[call-overload]
            self.command(argv, node),
            env=self.mpi_env(env),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
            **kw,
        )

    def _write_agent(self) -> None:
        """The rsh agent: ``agent HOST COMMAND...`` runs COMMAND on HOST as ssh would (a clean environment)."""
        table = " ".join(f"{h}) ns={ns} ;;" for h, ns in zip(self.hosts, self.namespaces, strict=True))
        path = os.pathsep.join(
            [str(Path(sys.executable).parent), "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"]
        )
        self.agent.write_text(
            "#!/bin/sh\n"
            "# Open MPI's rsh agent for this cluster: run the command on the node, as ssh would.\n"
            "host=$1; shift\n"
            f'case "$host" in {table} *) echo "agent: unknown host $host" >&2; exit 255 ;; esac\n'
            # ssh gives a login environment, not the caller's: only what a user's shell profile would set.
            f"exec env -i PATH={shlex.quote(path)} HOME=/root LANG=C.UTF-8 "
            "OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 "
            'ip netns exec "$ns" unshare --uts sh -c \'hostname "$0" && exec sh -c "$1"\' "$host" "$*"\n'
        )
        self.agent.chmod(0o755)


def _within_the_test(timeout: float) -> float:
    """Under pytest, ``timeout`` cut to end before the test's own timeout; as given otherwise (the command line)."""
    mpirun = sys.modules.get("mpirun")  # loaded by tests/conftest.py; not imported here, it needs pytest
    return timeout if mpirun is None else mpirun.time_left(timeout)


def _on_host(hostname: str, argv: Sequence[str]) -> list[str]:
    """``argv`` in a UTS namespace of its own whose hostname is ``hostname``."""
    return ["unshare", "--uts", "sh", "-c", 'hostname "$0" && exec "$@"', hostname, *argv]


def remove_stale(prefix: str = _PREFIX) -> list[str]:
    """Remove namespaces named ``<prefix><pid>-...`` whose process is gone (left by a killed run); their names."""
    removed = []
    for line in _ip("netns", "list", check=False).stdout.splitlines():
        ns = line.split()[0] if line.split() else ""
        owner = ns[len(prefix) :].split("-", 1)[0]
        if ns.startswith(prefix) and owner.isdigit() and not Path(f"/proc/{owner}").exists():
            _ip("netns", "del", ns, check=False)
            shutil.rmtree(_NETNS_ETC / ns, ignore_errors=True)
            removed.append(ns)
    return removed


@contextlib.contextmanager
def cluster(nodes: int, slots: int = 1, **kw: object) -> Iterator[Cluster]:
    """``with cluster(2, slots=2) as c: ...``: a Cluster that is up inside the block and gone after it."""
    remove_stale()
    main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _terminate) if main_thread else None
    try:
        with Cluster(nodes, slots, **kw) as c:  # type: ignore[arg-type]
            yield c
    finally:
        if main_thread:
            signal.signal(signal.SIGTERM, previous)


def _terminate(signum: int, _frame: object) -> None:
    """SIGTERM (e.g. from ``timeout``) unwinds like Ctrl-C, so the cluster is still taken down."""
    raise SystemExit(128 + signum)


def main(argv: Sequence[str] | None = None) -> int:
    """``python tests/cluster.py --nodes N --slots K -- command ...``: run a command on a fresh cluster's first node."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--slots", type=int, default=1)
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the command, after --")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give a command to run on the first node, after --")
    reason = unavailable()
    if reason:
        print(f"cluster: {reason}", file=sys.stderr)
        return 2
    with cluster(args.nodes, args.slots) as c:
        argv = [part.format(hostfile=c.hostfile, agent=c.agent) for part in command]
        nodes = ", ".join(f"{h} {a}" for h, a in zip(c.hosts, c.addresses, strict=True))
        print(f"cluster: {nodes}; running on {c.hosts[0]}: {shlex.join(argv)}", file=sys.stderr)
        start = time.monotonic()
        proc = subprocess.run(c.command(argv), env=c.mpi_env(), check=False)
        print(f"cluster: exit status {proc.returncode} after {time.monotonic() - start:.1f} s", file=sys.stderr)
        return proc.returncode


if __name__ == "__main__":
    sys.exit(main())
