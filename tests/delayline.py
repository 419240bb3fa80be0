"""A shaped point-to-point link between two network namespaces: a rate and a one-way delay.

This kernel has no ``sch_netem``, so the delay comes from a small user-space relay (``delayline.c``, compiled on
demand with gcc into ``~/.cache/distutils_ml/``) owns a TUN device in each namespace and forwards every packet
read from one to the other after ``delay_s`` (one FIFO per direction, ``CLOCK_MONOTONIC`` and nanosecond
``ppoll`` timeouts, no busy spinning), at real-time priority (``SCHED_FIFO``) so busy MPI ranks cannot slow it.
A timer sleep overshoots by ~20-50 us on this VM, so the relay wakes that much early (the median overshoot
of its recent sleeps) and departures scatter around the due time instead of all coming late.

The rate comes from a ``tbf`` qdisc on each TUN (``shaper="tbf"``, the default: the sender's own queue backs up,
like a NIC at line rate, so TCP sees no loss) or from the relay itself (``shaper="relay"``: serialization at the
rate plus a drop-tail queue, like a switch port; more exact timing, but TCP meets losses).

Use::

    with DelayLine("node-a", "node-b", "10.99.0.1", "10.99.0.2", delay_s=1e-3, rate_bit_s=1e9) as link:
        ...  # 10.99.0.1 (in node-a) and 10.99.0.2 (in node-b) reach each other over device "dl0"
    print(link.stats)  # the relay's counters

Measure the shaping alone (creates and removes namespaces ``dmlshape-a``/``dmlshape-b``)::

    python tests/delayline.py check --rate 1gbit --delay-ms 1
    python tests/delayline.py check --rate 10gbit --delay-ms 0.1
    python tests/delayline.py check --veth            # an unshaped veth pair, for comparison

Needs root, ``ip netns``, ``/dev/net/tun``, gcc, and ``tc`` for the tbf shaper.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import fcntl
import hashlib
import json
import os
import re
import select
import shutil
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import TracebackType
from typing import Any

SOURCE = Path(__file__).resolve().with_name("delayline.c")
LOCK = "/tmp/dml-mpi.lock"  # shared with the cluster's MPI jobs: one heavy job at a time


def cache_dir() -> Path:
    """Where the compiled relay lives: ``$XDG_CACHE_HOME/distutils_ml`` or ``~/.cache/distutils_ml``."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "distutils_ml"


def build_relay() -> Path:
    """Compile ``delayline.c`` once per source version (keyed by its hash); return the binary's path."""
    source = SOURCE.read_bytes()
    exe = cache_dir() / f"delayline-{hashlib.sha256(source).hexdigest()[:16]}"
    if exe.exists():
        return exe
    gcc = shutil.which("gcc") or shutil.which("cc")
    if gcc is None:
        raise RuntimeError("delayline needs a C compiler (gcc) to build its relay")
    exe.parent.mkdir(parents=True, exist_ok=True)
    tmp = exe.with_name(f"{exe.name}.{os.getpid()}.tmp")
    result = subprocess.run(
        [gcc, "-O2", "-Wall", "-o", str(tmp), str(SOURCE)], check=False, capture_output=True, text=True
    )
    if result.returncode != 0:
        tmp.unlink(missing_ok=True)
        raise RuntimeError(f"compiling {SOURCE} failed:\n{result.stderr}")
    tmp.replace(exe)  # atomic: concurrent builders agree
    return exe


def missing_requirements(need_tc: bool = False) -> str | None:
    """Why a DelayLine cannot run here (one line), or None when it can."""
    if os.geteuid() != 0:
        return "needs root (network namespaces, TUN devices)"
    for tool in ("ip", "gcc", *(["tc"] if need_tc else [])):
        if shutil.which(tool) is None:
            return f"needs {tool} on PATH"
    if not os.path.exists("/dev/net/tun"):
        return "needs /dev/net/tun (TUN support)"
    probe = subprocess.run(["ip", "netns", "list"], check=False, capture_output=True, text=True)
    if probe.returncode != 0:
        return f"ip netns does not work: {probe.stderr.strip()}"
    return None


def parse_rate(text: str) -> float | None:
    """``"10gbit"``, ``"1g"``, ``"500mbit"``, ``"1e9"`` -> bit/s; ``"none"`` -> None."""
    if text.lower() in {"none", "0", "off", ""}:
        return None
    m = re.fullmatch(r"\s*([0-9.e+]+)\s*([kmgt]?)(?:bit|b|bps)?(?:/s)?\s*", text.lower())
    if not m:
        raise ValueError(f"not a rate: {text!r} (e.g. 10gbit, 1g, 500mbit)")
    return float(m[1]) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}[m[2]]


def run(cmd: list[str], check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run ``cmd``; raise with its message on failure when ``check``."""
    result = subprocess.run(cmd, check=False, capture_output=True, text=True)
    if check and result.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}: {result.stderr.strip()}")
    return result


def ip(*args: str, ns: str | None = None, check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run ``ip [-n ns] args...``; raise with its message on failure when ``check``."""
    return run(["ip", *(["-n", ns] if ns else []), *args], check=check)


def _addr_args(local: str, peer: str) -> list[str]:
    """``ip addr add`` arguments: ``a.b.c.d/len`` as is, a bare address as point-to-point to ``peer``."""
    if "/" in local:
        return [local]
    return [local, "peer", peer.split("/", maxsplit=1)[0]]


class DelayLine:
    """A link between namespaces ``ns_a`` and ``ns_b`` with a one-way ``delay_s`` and an optional rate.

    A context manager: ``__enter__`` starts the relay (which creates TUN device ``ifname`` in each namespace),
    assigns ``addr_a`` (in ``ns_a``) and ``addr_b`` (in ``ns_b``), sets the MTU and the rate, and brings the
    devices up; ``__exit__`` stops the relay, which removes both devices, and fills ``stats``.

    Addresses: a bare address (``"10.99.0.1"``) becomes point-to-point to the other one; with a prefix
    (``"10.99.0.1/30"``) it is assigned as is.  ``shaper="tbf"`` (default) limits the rate with a tbf qdisc on
    each TUN (bucket ``burst_bytes``, queue ``queue_s``); ``"relay"`` models serialization and a drop-tail queue
    of ``queue_s`` in the relay.  ``offload`` passes virtio headers through the relay (as between virtio guests):
    checksums stay partial and TCP sends 64 KiB TSO packets whatever the MTU, so the default MTU is 1500 and the
    relay handles ~20k packets/s at 10 Gbit/s; without it each packet is checksummed twice and the MTU defaults
    to 65000.  The relay runs at ``SCHED_FIFO`` priority ``rt_priority`` (0: normal scheduling); ``realtime``
    says whether it got it.  ``early_wake=False`` makes it sleep until each due time (departures come late by
    the timer's overshoot).  Stopping the relay (``close``, or this process ending: the relay's stdin is its
    lifeline) removes both devices; deleting either namespace stops the relay.
    """

    _serial = 0  # numbers the temporary device names

    def __init__(
        self,
        ns_a: str,
        ns_b: str,
        addr_a: str,
        addr_b: str,
        *,
        delay_s: float,
        rate_bit_s: float | None = None,
        mtu: int | None = None,
        ifname: str = "dl0",
        shaper: str = "tbf",
        queue_s: float | None = None,
        burst_bytes: int | None = None,
        offload: bool = True,
        early_wake: bool = True,
        rt_priority: int = 50,
    ) -> None:
        if delay_s < 0 or (rate_bit_s is not None and rate_bit_s <= 0):
            raise ValueError("delay_s must be >= 0 and rate_bit_s > 0 (or None)")
        if shaper not in {"tbf", "relay"}:
            raise ValueError(f"shaper must be 'tbf' or 'relay', not {shaper!r}")
        # With offload, TCP hands the relay 64 KiB TSO packets whatever the MTU: Ethernet's 1500 costs nothing.
        # Without it each packet is one MTU: a large one keeps the packet rate (the relay's cost) low.
        mtu = mtu or (1500 if offload else 65000)
        if not 68 <= mtu <= 65535 or len(ifname) > 15:
            raise ValueError("mtu must be in 68..65535 and ifname at most 15 characters")
        self.ns_a, self.ns_b, self.addr_a, self.addr_b = ns_a, ns_b, addr_a, addr_b
        self.delay_s, self.rate_bit_s, self.mtu, self.ifname = delay_s, rate_bit_s, mtu, ifname
        self.shaper, self.offload, self.early_wake, self.rt_priority = shaper, offload, early_wake, rt_priority
        # A buffer of one bandwidth-delay product (2 * delay * rate), and room for a few packets at least.
        bdp_s = 2 * delay_s
        pkt_s = 4 * (mtu + 64) * 8 / rate_bit_s if rate_bit_s else 0.0
        self.queue_s = queue_s if queue_s is not None else max(bdp_s, pkt_s, 1e-3)
        # tbf's bucket: >= 1 ms at the rate and >= 2 packets (a packet larger than the bucket is dropped).
        self.burst_bytes = burst_bytes or (max(int(rate_bit_s / 8 * 1e-3), 2 * (mtu + 64)) if rate_bit_s else 0)
        self.realtime = False
        self.stats: dict[str, Any] = {}
        self.error = ""  # what the relay said on stderr, if anything
        self._proc: subprocess.Popen[str] | None = None

    @property
    def relay_pid(self) -> int | None:
        """The relay's process id while it runs."""
        return self._proc.pid if self._proc and self._proc.poll() is None else None

    def __enter__(self) -> DelayLine:
        self.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def start(self) -> None:
        """Start the relay and configure both devices; on failure nothing is left behind."""
        if self._proc is not None:
            raise RuntimeError("DelayLine already started")
        # Created in this namespace under unique names, then moved: see delayline.c for why.
        DelayLine._serial += 1
        tmp = [f"dlt{os.getpid():x}n{DelayLine._serial % 4096:x}{side}" for side in "ab"]  # <= 15 characters
        cmd = [
            str(build_relay()),
            f"--dev-a={tmp[0]}",
            f"--dev-b={tmp[1]}",
            f"--delay-ns={round(self.delay_s * 1e9)}",
            f"--priority={self.rt_priority}",
        ]
        if self.offload:
            cmd.append("--vnet-hdr")
        if not self.early_wake:
            cmd.append("--no-early-wake")
        if self.shaper == "relay" and self.rate_bit_s:
            cmd += [f"--rate-bps={round(self.rate_bit_s)}", f"--queue-ns={round(self.queue_s * 1e9)}"]
        # stdin is the relay's lifeline: it exits when this end closes (or this process dies).
        self._proc = subprocess.Popen(
            cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        try:
            line = self._read_line(timeout=10)
            if not line.startswith("ready"):
                self.close()
                raise RuntimeError(f"delayline relay failed to start: {self.error or line.strip() or 'no answer'}")
            self.realtime = "rt=1" in line
            sides = ((self.ns_a, self.addr_a, self.addr_b), (self.ns_b, self.addr_b, self.addr_a))
            for (ns, local, peer), name in zip(sides, tmp, strict=True):
                ip("link", "set", "dev", name, "netns", ns, "name", self.ifname)
                # addrgenmode none: no IPv6 link-local address, so no IPv6 chatter through the relay.
                ip("link", "set", "dev", self.ifname, "mtu", str(self.mtu), "addrgenmode", "none", ns=ns)
                ip("addr", "add", *_addr_args(local, peer), "dev", self.ifname, ns=ns)
                if self.shaper == "tbf" and self.rate_bit_s:
                    self._tbf(ns)
                ip("link", "set", "dev", self.ifname, "up", ns=ns)
        except BaseException:
            self.close()
            raise

    def _tbf(self, ns: str) -> None:
        """Limit ``ifname``'s egress in ``ns`` to the rate with a tbf qdisc (queue: ``queue_s``)."""
        assert self.rate_bit_s
        latency_us = max(round(self.queue_s * 1e6), 1)
        cmd = ["tc", "-n", ns, "qdisc", "replace", "dev", self.ifname, "root", "tbf"]
        cmd += ["rate", f"{round(self.rate_bit_s)}bit", "burst", str(self.burst_bytes), "latency", f"{latency_us}us"]
        run(cmd)

    def _read_line(self, timeout: float) -> str:
        """The relay's next stdout line, or '' after ``timeout`` seconds or at EOF."""
        assert self._proc and self._proc.stdout
        ready, _, _ = select.select([self._proc.stdout], [], [], timeout)
        return self._proc.stdout.readline() if ready else ""

    def close(self) -> None:
        """Stop the relay (its devices go with it) and parse its final counters into ``stats``."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        assert proc.stdin and proc.stdout and proc.stderr
        with contextlib.suppress(OSError):
            proc.stdin.close()  # EOF: the relay prints its stats and exits
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        out = proc.stdout.read()  # a few hundred bytes: it never blocked on the pipe
        self.error = proc.stderr.read().strip()
        proc.stdout.close()
        proc.stderr.close()
        for line in out.splitlines():
            if line.startswith("stats "):
                self.stats = _parse_stats(line)


def _parse_stats(line: str) -> dict[str, Any]:
    """``stats k=v k=v1,v2`` -> dict (ints, lists for histograms)."""
    stats: dict[str, Any] = {}
    for item in line.split()[1:]:
        key, _, value = item.partition("=")
        stats[key] = [int(v) for v in value.split(",")] if "," in value else int(value)
    return stats


# ---------------------------------------------------------------------------------------------------------
# Namespaces and the measurement helpers (used by the check below and by test_delayline.py)


@contextlib.contextmanager
def namespaces(*names: str) -> Iterator[tuple[str, ...]]:
    """Create network namespaces ``names`` (loopback up); delete them by name on exit, also on failure."""
    made: list[str] = []
    try:
        for name in names:
            ip("netns", "add", name)
            made.append(name)
            ip("link", "set", "dev", "lo", "up", ns=name)
        yield names
    finally:
        for name in reversed(made):
            ip("netns", "del", name, check=False)


@contextlib.contextmanager
def veth(ns_a: str, ns_b: str, addr_a: str, addr_b: str, *, mtu: int = 1500, ifname: str = "dl0") -> Iterator[None]:
    """An unshaped veth pair between the namespaces, addressed as a DelayLine is (for comparison)."""
    ip("link", "add", ifname, "type", "veth", "peer", "name", ifname, "netns", ns_b, ns=ns_a)
    try:
        for ns, local, peer in ((ns_a, addr_a, addr_b), (ns_b, addr_b, addr_a)):
            ip("link", "set", "dev", ifname, "mtu", str(mtu), ns=ns)
            ip("addr", "add", *_addr_args(local, peer), "dev", ifname, ns=ns)
            ip("link", "set", "dev", ifname, "up", ns=ns)
        yield
    finally:
        ip("link", "del", "dev", ifname, ns=ns_a, check=False)


def in_ns(ns: str, *args: str) -> list[str]:
    """Command line running this file's helper ``args`` in namespace ``ns``."""
    return ["ip", "netns", "exec", ns, sys.executable, str(Path(__file__).resolve()), *args]


@contextlib.contextmanager
def server(ns: str, addr: str, port: int = 5201) -> Iterator[None]:
    """Run the echo/sink server in ``ns`` on ``addr:port`` until the block ends."""
    proc = subprocess.Popen(
        in_ns(ns, "_serve", addr, str(port)), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout
        ready, _, _ = select.select([proc.stdout], [], [], 20)
        if not ready or proc.stdout.readline().strip() != "ready":
            raise RuntimeError("the measurement server did not start")
        yield
    finally:
        assert proc.stdin
        proc.stdin.close()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def client(
    ns: str,
    addr: str,
    port: int = 5201,
    *,
    pings: int = 200,
    mib: float = 0,
    verify: bool = False,
    cc: str | None = None,
    timeout: float = 120,
) -> dict[str, Any]:
    """Run the client in ``ns`` against ``addr:port``; return its measurements (see ``_client``)."""
    args = ["_client", addr, str(port), f"--pings={pings}", f"--mib={mib}"]
    args += ["--verify"] * verify + ([f"--cc={cc}"] if cc else [])
    result = subprocess.run(in_ns(ns, *args), check=False, capture_output=True, text=True, timeout=timeout)
    if result.returncode != 0:
        raise RuntimeError(f"measurement client failed:\n{result.stderr[-4000:]}")
    return json.loads(result.stdout.splitlines()[-1])


def _serve(addr: str, port: int) -> None:
    """UDP echo and TCP service on ``addr:port`` until stdin closes.

    A TCP connection's first byte picks the service: ``P`` echoes 64-byte messages back (ping-pong);
    ``S`` reads to EOF and answers ``"<bytes> <sha256 or ->"`` (``s``: without hashing).
    """
    udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    udp.bind((addr, port))
    tcp = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    tcp.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    tcp.bind((addr, port))
    tcp.listen(8)

    def echo() -> None:
        while True:
            data, peer = udp.recvfrom(65536)
            udp.sendto(data, peer)

    def handle(conn: socket.socket) -> None:
        with conn:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            kind = conn.recv(1)
            if kind == b"P":
                while msg := _recv_exact(conn, 64):
                    conn.sendall(msg)
            elif kind in (b"S", b"s"):
                digest = hashlib.sha256() if kind == b"S" else None
                buf = memoryview(bytearray(4 << 20))
                total = 0
                while n := conn.recv_into(buf):
                    total += n
                    if digest:
                        digest.update(buf[:n])
                conn.sendall(f"{total} {digest.hexdigest() if digest else '-'}\n".encode())

    def accept() -> None:
        while True:
            conn, _ = tcp.accept()
            threading.Thread(target=handle, args=(conn,), daemon=True).start()

    threading.Thread(target=echo, daemon=True).start()
    threading.Thread(target=accept, daemon=True).start()
    print("ready", flush=True)
    sys.stdin.read()  # until the parent closes our stdin


def _recv_exact(conn: socket.socket, n: int) -> bytes:
    """Exactly ``n`` bytes from ``conn``, or b'' at EOF."""
    data = b""
    while len(data) < n:
        chunk = conn.recv(n - len(data))
        if not chunk:
            return b""
        data += chunk
    return data


def _client(addr: str, port: int, *, pings: int, mib: float, verify: bool, cc: str | None) -> dict[str, object]:
    """UDP and TCP ping-pong RTTs (64 bytes, ``pings`` each) and one TCP stream of ``mib`` MiB."""
    result: dict[str, object] = {}
    if pings:
        udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        udp.settimeout(2)
        udp.connect((addr, port))
        msg, rtts = b"p" * 64, []
        for _ in range(pings + 5):
            t = time.perf_counter_ns()
            udp.send(msg)
            udp.recv(65536)
            rtts.append((time.perf_counter_ns() - t) / 1e9)
        result["udp_rtt_s"] = rtts[5:]
        with socket.create_connection((addr, port), timeout=10) as conn:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn.sendall(b"P")
            rtts = []
            for _ in range(pings + 5):
                t = time.perf_counter_ns()
                conn.sendall(msg)
                _recv_exact(conn, 64)
                rtts.append((time.perf_counter_ns() - t) / 1e9)
            result["tcp_rtt_s"] = rtts[5:]
    if mib:
        total = int(mib * (1 << 20))
        block = os.urandom(1 << 20) * 4 if verify else bytes(4 << 20)
        digest = hashlib.sha256()
        with socket.create_connection((addr, port), timeout=60) as conn:
            if cc:
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, cc.encode())
            result["cc"] = conn.getsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, 16).rstrip(b"\0").decode()
            conn.sendall(b"S" if verify else b"s")
            t = time.perf_counter()
            view, sent = memoryview(block), 0
            while sent < total:
                part = view[: min(len(block), total - sent)]
                conn.sendall(part)
                if verify:
                    digest.update(part)
                sent += len(part)
            conn.shutdown(socket.SHUT_WR)
            reply = conn.makefile().readline().split()
            result["seconds"] = time.perf_counter() - t
        result["bytes"] = total
        result["received"] = int(reply[0])
        if verify:
            result["intact"] = reply[1] == digest.hexdigest()
    return result


# ---------------------------------------------------------------------------------------------------------
# The check: measure the shaping alone


def _cpu_seconds(pid: int | None = None) -> tuple[float, float]:
    """(busy, total) seconds of the machine (pid None) or (utime+stime, 0) of one process."""
    hz = os.sysconf("SC_CLK_TCK")
    if pid is not None:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / hz, 0.0
    cpu = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = cpu[3] + cpu[4]
    return (sum(cpu[:8]) - idle) / hz, sum(cpu[:8]) / hz


def _fmt_rate(bit_s: float | None) -> str:
    """10 Gbit/s, 500 Mbit/s, unlimited."""
    if bit_s is None:
        return "unlimited"
    return f"{bit_s / 1e9:.3g} Gbit/s" if bit_s >= 1e9 else f"{bit_s / 1e6:.3g} Mbit/s"


def check(args: argparse.Namespace) -> dict[str, Any]:
    """Bring up the link between fresh namespaces, measure RTT and one TCP stream, print configured vs measured."""
    ns_a, ns_b = f"{args.prefix}-a", f"{args.prefix}-b"
    addr_a, addr_b = "10.99.0.1", "10.99.0.2"
    rate = parse_rate(args.rate)
    delay_s = args.delay_ms / 1e3
    r: dict[str, Any] = {"link": "veth" if args.veth else "delayline", "delay_s": delay_s, "rate_bit_s": rate}
    with open(LOCK, "a") as lock:  # one heavy job at a time on this machine
        t_wait = time.monotonic()
        fcntl.flock(lock, fcntl.LOCK_EX)
        r["lock_wait_s"] = round(time.monotonic() - t_wait, 3)
        with namespaces(ns_a, ns_b):
            link: DelayLine | None = None
            ctx: contextlib.AbstractContextManager[object]
            if args.veth:
                ctx = veth(ns_a, ns_b, addr_a, addr_b, mtu=args.mtu or 1500)
            else:
                queue_s = args.queue_ms / 1e3 if args.queue_ms else None
                ctx = link = DelayLine(
                    ns_a, ns_b, addr_a, addr_b, delay_s=delay_s, rate_bit_s=rate, mtu=args.mtu, shaper=args.shaper,
                    queue_s=queue_s, burst_bytes=args.burst, offload=not args.no_offload,
                    early_wake=not args.no_early_wake, rt_priority=args.rt_priority,
                )  # fmt: skip
            with ctx, server(ns_b, addr_b), server(ns_a, addr_a):
                pings = client(ns_a, addr_b, pings=args.pings)
                busy0, total0 = _cpu_seconds()
                relay0 = _cpu_seconds(link.relay_pid)[0] if link else 0.0
                if args.duplex:  # a stream each way at once, as a ring allreduce's traffic is
                    with concurrent.futures.ThreadPoolExecutor(1) as pool:
                        back = pool.submit(client, ns_b, addr_a, pings=0, mib=args.mib, cc=args.cc)
                        stream = client(ns_a, addr_b, pings=0, mib=args.mib, cc=args.cc)
                        reverse = back.result()
                    r["reverse_throughput_bit_s"] = reverse["received"] * 8 / reverse["seconds"]
                else:
                    stream = client(ns_a, addr_b, pings=0, mib=args.mib, cc=args.cc)
                busy1, total1 = _cpu_seconds()
                relay1 = _cpu_seconds(link.relay_pid)[0] if link else 0.0
    for kind in ("udp", "tcp"):
        rtts = sorted(pings[f"{kind}_rtt_s"])
        r[f"{kind}_rtt_s"] = {"median": statistics.median(rtts), "p10": rtts[len(rtts) // 10],
                              "p90": rtts[len(rtts) * 9 // 10]}  # fmt: skip
    seconds, elapsed = stream["seconds"], (total1 - total0) / (os.cpu_count() or 1)
    r.update(throughput_bit_s=stream["received"] * 8 / seconds, stream_mib=args.mib, cc=stream["cc"])
    r["machine_busy"] = (busy1 - busy0) / (total1 - total0) if total1 > total0 else None
    if link:
        r.update(shaper=args.shaper, realtime=link.realtime, mtu=link.mtu, relay_stats=link.stats)
        r["relay_cpu"] = (relay1 - relay0) / elapsed if elapsed else None
        r["relay_pps"] = (link.stats.get("a2b_pkts", 0) + link.stats.get("b2a_pkts", 0)) / seconds
    _print_report(r)
    return r


def _print_report(r: dict[str, Any]) -> None:
    """Configured vs measured, one quantity a line."""
    what = "veth (unshaped)" if r["link"] == "veth" else f"delayline, shaper {r['shaper']}, MTU {r['mtu']}"
    print(f"link     : {what}, realtime relay: {r.get('realtime', '-')}")
    print(
        f"rate     : configured {_fmt_rate(r['rate_bit_s'])}  measured {_fmt_rate(r['throughput_bit_s'])} "
        f"(one TCP stream, {r['stream_mib']:g} MiB, {r['cc']})"
    )
    if r.get("reverse_throughput_bit_s"):
        print(f"  duplex : the other way at the same time {_fmt_rate(r['reverse_throughput_bit_s'])}")
    for kind in ("udp", "tcp"):
        q = {k: v * 1e3 for k, v in r[f"{kind}_rtt_s"].items()}
        print(
            f"{kind} rtt  : configured {2 * r['delay_s'] * 1e3:.3f} ms  measured median {q['median']:.3f} ms "
            f"(p10 {q['p10']:.3f}, p90 {q['p90']:.3f}; one way ~{q['median'] / 2:.3f} ms)"
        )
    if r["link"] == "delayline":
        st = r["relay_stats"]
        print(f"relay    : {r['relay_cpu'] * 100:.0f}% of a core during the stream, {r['relay_pps']:.0f} packets/s")
        for d in ("a2b", "b2a"):
            hist = st[f"{d}_err_hist"]
            n = max(sum(hist), 1)
            print(
                f"  {d}    : {st[f'{d}_pkts']} packets, {st[f'{d}_drops_queue']} queue drops; "
                f"departure - due: mean {st[f'{d}_err_sum_ns'] / n / 1e3:+.1f} us, "
                f"{st[f'{d}_early']} early (max {st[f'{d}_early_max_ns'] / 1e3:.0f} us), "
                f"late max {st[f'{d}_late_max_ns'] / 1e3:.0f} us"
            )
            print(f"           |error| <5,10,20,50,100,200,500 us,1,5 ms,more: {','.join(map(str, hist))}")
        print(f"  wakeup : sleeps end {st['wake_adv_ns'] / 1e3:.1f} us early (median timer overshoot)")
    if r["machine_busy"] is not None:
        print(
            f"machine  : {r['machine_busy'] * 100:.0f}% busy during the stream "
            f"({os.cpu_count()} cores; waited {r['lock_wait_s']} s for {LOCK})"
        )


def main(argv: list[str] | None = None) -> int:
    """``check`` (measure a link), or the internal ``_serve``/``_client`` helpers."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("check", help="measure a shaped link (or --veth) between two fresh namespaces")
    c.add_argument("--rate", default="none", help="e.g. 10gbit, 1gbit, none (default)")
    c.add_argument("--delay-ms", type=float, default=0.0, help="one-way delay in ms")
    c.add_argument("--shaper", choices=["tbf", "relay"], default="tbf")
    c.add_argument("--queue-ms", type=float, default=None, help="queue limit (default: one BDP, >= 1 ms)")
    c.add_argument("--mtu", type=int, default=None, help="default 1500 (65000 with --no-offload)")
    c.add_argument("--burst", type=int, default=None, help="tbf bucket in bytes (default: 1 ms at the rate, >= 2 MTU)")
    c.add_argument("--no-offload", action="store_true", help="checksum every packet (no vnet header)")
    c.add_argument("--rt-priority", type=int, default=50, help="the relay's SCHED_FIFO priority (0: none)")
    c.add_argument("--no-early-wake", action="store_true", help="sleep until the due time (departures late)")
    c.add_argument("--veth", action="store_true", help="an unshaped veth pair instead, for comparison")
    c.add_argument("--mib", type=float, default=512, help="MiB in the TCP stream")
    c.add_argument("--duplex", action="store_true", help="a second stream the other way at the same time")
    c.add_argument("--pings", type=int, default=1000)
    c.add_argument("--cc", default=None, help="TCP congestion control for the stream (default: the system's)")
    c.add_argument("--prefix", default="dmlshape", help="namespaces PREFIX-a and PREFIX-b (must not exist)")
    c.add_argument("--json", action="store_true", help="also print the report as JSON")
    s = sub.add_parser("_serve")
    s.add_argument("addr")
    s.add_argument("port", type=int)
    k = sub.add_parser("_client")
    k.add_argument("addr")
    k.add_argument("port", type=int)
    k.add_argument("--pings", type=int, default=200)
    k.add_argument("--mib", type=float, default=0)
    k.add_argument("--verify", action="store_true")
    k.add_argument("--cc", default=None)
    args = parser.parse_args(argv)
    if args.cmd == "_serve":
        _serve(args.addr, args.port)
    elif args.cmd == "_client":
        print(json.dumps(_client(args.addr, args.port, pings=args.pings, mib=args.mib, verify=args.verify, cc=args.cc)))
    else:
        reason = missing_requirements(need_tc=not args.veth)
        if reason:
            print(f"delayline check: {reason}", file=sys.stderr)
            return 2
        report = check(args)
        if args.json:
            print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
