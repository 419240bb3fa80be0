"""A stray client on the cluster's network, for tests/test_cluster.py: ``python tests/stray_client.py PID=ADDRESS ...``.

Every ``--interval`` s it reads the TCP listeners of each node (``/proc/PID/net/tcp`` and ``tcp6`` of a process
PID on that node: the node's network namespace) and, for each listener it has not seen that is reachable at the
node's ADDRESS (bound to it, or to any address; loopback is not reachable from another node), does what stray
clients do: connects and stays silent, keeping that connection open until it is told to end (SIGTERM or SIGINT),
connects and sends ``--garbage`` random bytes then closes, and connects and closes at once (a port scan).

One line per listener hit, as it is hit (what listens there is looked up afterwards, so setup's short-lived
listeners are hit first)::

    STRAY HIT 10.213.77.1:43139 (bound to 10.213.77.1) at 5.03 s by python[30824]: silent ok, garbage ok, scan ok

``STRAY CLOSED 10.213.77.1:43139 at 9.10 s by the other side`` when a silent connection is closed by the
listener's side, and at the end ``STRAY DONE: <n> listener(s) hit, <k> silent connection(s) open``.
"""

from __future__ import annotations

import argparse
import contextlib
import ipaddress
import os
import signal
import socket
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

_LISTEN = "0A"  # TCP_LISTEN in /proc/net/tcp's st column
_CONNECT_S = 1.0


@dataclass
class Stray:
    """The listeners seen, by (address, port), and the silent connections kept open."""

    nodes: list[tuple[int, str]]  # (PID on the node, the node's address)
    garbage: int
    seen: set[tuple[str, int]] = field(default_factory=set)
    silent: dict[socket.socket, str] = field(default_factory=dict)  # -> "address:port"
    start: float = field(default_factory=time.monotonic)

    def poll(self) -> None:
        """Hit every listener that appeared since the last poll, then say who they were; note silent connections
        that the other side closed."""
        hits = []
        for pid, address in self.nodes:
            for port, bound, inode in _listeners(pid, address):
                if (address, port) not in self.seen:
                    self.seen.add((address, port))
                    at = time.monotonic() - self.start
                    hits.append((f"{address}:{port} (bound to {bound})", inode, at, self.hit(address, port)))
        for where, inode, at, results in hits:
            print(f"STRAY HIT {where} at {at:.2f} s by {_owner(inode)}: {results}", flush=True)
        for s, where in list(self.silent.items()):
            if _closed_by_peer(s):
                print(f"STRAY CLOSED {where} at {time.monotonic() - self.start:.2f} s by the other side", flush=True)
                del self.silent[s]
                s.close()

    def hit(self, address: str, port: int) -> str:
        """A silent connection (kept), garbage and a scan to ``address:port``; how each went."""

        def keep() -> None:
            self.silent[_connect(address, port)] = f"{address}:{port}"

        return (
            f"silent {_try(keep)}, garbage {_try(lambda: _send_garbage(address, port, self.garbage))}, "
            f"scan {_try(lambda: _connect(address, port).close())}"
        )


def _connect(address: str, port: int) -> socket.socket:
    return socket.create_connection((address, port), timeout=_CONNECT_S)


def _send_garbage(address: str, port: int, size: int) -> None:
    with _connect(address, port) as s:
        s.sendall(os.urandom(size))


def _try(action: Callable[[], object]) -> str:
    """``ok``, or how ``action`` failed."""
    try:
        action()
    except OSError as e:
        return f"failed ({type(e).__name__}: {e})"
    return "ok"


def _closed_by_peer(s: socket.socket) -> bool:
    """Whether the other side closed (or reset) this connection."""
    s.setblocking(False)
    try:
        return s.recv(1, socket.MSG_PEEK) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True


def _listeners(pid: int, address: str) -> list[tuple[int, str, str]]:
    """(port, address bound to, socket inode) of each TCP listener in PID's network namespace reached at ``address``."""
    wanted = ipaddress.ip_address(address)
    found = []
    for table in ("tcp", "tcp6"):
        with contextlib.suppress(OSError):  # the process may be gone
            for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
                fields = line.split()
                if fields[3] != _LISTEN:
                    continue
                host, port = fields[1].split(":")
                bound = _address(host)
                if bound.is_unspecified or bound == wanted or getattr(bound, "ipv4_mapped", None) == wanted:
                    found.append((int(port, 16), str(bound), fields[9]))
    return found


def _address(hex_host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    """An address as /proc/net/tcp{,6} writes it: 32-bit words in the host's (little-endian) byte order."""
    raw = bytes.fromhex(hex_host)
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    return ipaddress.ip_address(words)


def _owner(inode: str) -> str:
    """``comm[pid]`` of the process holding socket ``inode``, or ``?`` (gone, or not found)."""
    target = f"socket:[{inode}]"
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            for fd in (proc / "fd").iterdir():
                with contextlib.suppress(OSError):
                    if os.readlink(fd) == target:
                        return f"{(proc / 'comm').read_text().strip()}[{proc.name}]"
    return "?"


def main(argv: list[str] | None = None) -> int:
    """Hit the listeners of the nodes given as ``PID=ADDRESS`` until SIGTERM or SIGINT."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("nodes", nargs="+", help="PID=ADDRESS: a process on a node, and the node's address")
    # Often: rank 0's rendezvous store listens for only a few milliseconds, while the ranks connect.
    parser.add_argument("--interval", type=float, default=0.0005, help="seconds between looks at the listeners")
    parser.add_argument("--garbage", type=int, default=4096, help="random bytes sent on the garbage connection")
    args = parser.parse_args(argv)
    nodes = [(int(pid), address) for pid, address in (node.split("=", 1) for node in args.nodes)]
    stray = Stray(nodes, args.garbage)
    ending = []
    signal.signal(signal.SIGTERM, lambda *_: ending.append(True))
    signal.signal(signal.SIGINT, lambda *_: ending.append(True))
    print(f"STRAY READY: watching {', '.join(address for _, address in nodes)}", flush=True)
    while not ending:
        stray.poll()
        time.sleep(args.interval)
    for s in stray.silent:
        s.close()
    print(f"STRAY DONE: {len(stray.seen)} listener(s) hit, {len(stray.silent)} silent connection(s) open", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
