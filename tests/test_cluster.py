"""Across nodes: a real multi-node Open MPI cluster made of network namespaces (tests/cluster.py).

Two layouts, 2 nodes x 2 ranks and 3 nodes x 1 rank, joined by a bridge over TCP: what GPU
placement relies on (node_local_rank, node_size), every collective across the link
(segmented 64 MiB included), synchronize / DistributedOptimizer / allreduce_gradients
bit-identical across ranks and equal to one process, ``distutils-ml launch --hostfile``,
the launcher's DML_* forwarding, faults on the second node: a SIGKILL, an exception and
a pulled cable end the job with a failure status, naming the missing ranks and their host, and
a stray client (tests/stray_client.py: port scans, garbage, silent connections to every
listener) that neither hangs, slows nor corrupts a job whose buckets go over gloo.

Needs root and ``ip netns`` (CI has both); elsewhere every test skips with the reason.
"""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import cluster
from mpirun import requires_mpi

ROOT = Path(__file__).resolve().parent.parent
TESTS = ROOT / "tests"
PYTHON = sys.executable
LAUNCH = str(Path(PYTHON).parent / "distutils-ml")
# What every rank of a test job needs: the test helpers (the remote environment is clean) and one thread each.
EXPORTS = ["-x", f"PYTHONPATH={TESTS}", "-x", "OMP_NUM_THREADS=1"]
CHECKS = ["topology", "objects", "properties", "matrix", "segmented", "synchronize", "train", "gradients"]
# DML_TIMEOUT of the fault jobs: a rank that stops is named this long after.
STALL = 10
# DML_TIMEOUT of the pulled-cable job: its stall report's abort comes before mpiexec's keepalive would notice the
# lost node (11 s). mpiexec's order to end the ranks, unacknowledged on the cut link, then stops the keepalive, and
# mpiexec waits for TCP's retransmissions (about 15 minutes): the launcher ends it (supervise.run_supervised).
CABLE_STALL = 4
ENDED_S = 15  # a killed or raising rank ends its job within this many seconds of its fault

pytestmark = requires_mpi


@pytest.fixture(scope="module", params=["2x2", "3x1"])
def layout(request: pytest.FixtureRequest) -> cluster.Cluster:
    return request.getfixturevalue({"2x2": "two_by_two", "3x1": "three_by_one"}[request.param])


def _ranks(c: cluster.Cluster) -> int:
    return c.nodes * c.slots


def test_the_nodes_are_distinct_hosts_on_their_own_network(two_by_two: cluster.Cluster) -> None:
    c = two_by_two
    run = c.run(["sh", "-c", "hostname; ip -4 -o addr show dev eth0"], timeout=10, node=1)
    assert run.returncode == 0, run.output
    assert run.output.split()[0] == "node-b" and f"inet {c.addresses[1]}/24" in run.output, run.output
    # Nothing was added to the machine's own network: node-b reaches node-a, and only it.
    ping = c.run([PYTHON, "-c", PING, c.addresses[0]], timeout=20, node=1)
    assert ping.returncode == 0 and "reached" in ping.output, ping.output


PING = """
import socket, sys
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.connect((sys.argv[1], 9))  # fails at once if there is no route
print("reached")
"""


REDUCER_CHECKS = ["grads_ready", "errors", "collective_in_backward", "buffers", "unused_overlap"]


@pytest.fixture(scope="module")
def across_nodes(layout: cluster.Cluster) -> tuple[cluster.Cluster, cluster.Run]:
    """One job per layout for the two tests below (tests/cluster_job.py): tests/mpi_main.py's CHECKS, then
    tests/reducer_job.py's REDUCER_CHECKS, in the same ranks; each part prints its own banner. A job's start across
    the nodes (every rank importing torch, on two cores) is a large part of a short job: it is paid once."""
    argv = [*layout.mpiexec_argv(_ranks(layout)), *EXPORTS, PYTHON, str(TESTS / "cluster_job.py")]
    return layout, layout.run([*argv, ",".join(CHECKS), ",".join(REDUCER_CHECKS)], timeout=300, cwd=ROOT)


def test_collectives_and_training_across_nodes(across_nodes: tuple[cluster.Cluster, cluster.Run]) -> None:
    c, run = across_nodes
    n = _ranks(c)
    # Printed by rank 0 once every rank passed every check: what the job does after it is the next test's.
    assert f"MPI CHECKS PASSED: {' '.join(CHECKS)} on {n} ranks" in run.output, run.output[-8000:]
    # Rank r on node r // slots, numbered within its node: what GPU placement (NCCLBackend) uses.
    expected = " ".join(f"{r}:{c.hosts[r // c.slots]}:{r % c.slots}/{c.slots}" for r in range(n))
    assert f"TOPOLOGY {expected}" in run.output, run.output[-8000:]


def test_gradients_reduced_during_backward_across_nodes(across_nodes: tuple[cluster.Cluster, cluster.Run]) -> None:
    """The bodies of tests/reducer_job.py across the link, with the buckets reduced on the communication thread
    (overlap) and at the end of backward (after the collectives' checks, in the same job)."""
    c, run = across_nodes
    n = _ranks(c)
    first = f"MPI CHECKS PASSED: {' '.join(CHECKS)} on {n} ranks" in run.output
    assert first, f"the job failed in its collectives' checks, before these ran:\n{run.output[-8000:]}"
    assert run.returncode == 0, run.output[-8000:]
    assert f"REDUCER CHECKS PASSED: {' '.join(REDUCER_CHECKS)} on {n} ranks" in run.output, run.output[-8000:]


def test_gloo_that_cannot_connect_falls_back_to_mpi_with_overlap_off(two_by_two: cluster.Cluster) -> None:
    """Under DML_TRANSPORT=auto across nodes, a gloo group that cannot be made (no such interface) is a warning on
    every rank; the buckets go over MPI with overlap off, and training works."""
    c = two_by_two
    argv = [*c.mpiexec_argv(4), *EXPORTS, "-x", "DML_SOCKET_IFNAME=nosuch0", PYTHON, str(TESTS / "transport_job.py")]
    run = c.run([*argv, "fallback"], timeout=120, cwd=ROOT)
    assert run.returncode == 0, run.output[-8000:]
    assert run.output.count("fell back to MPI") == 4, run.output[-8000:]


def test_launch_with_a_hostfile_spreads_ranks_and_forwards_dml_variables(two_by_two: cluster.Cluster) -> None:
    c = two_by_two
    argv = [LAUNCH, "launch", "-n", "4", "--hostfile", str(c.hostfile), str(TESTS / "launch_probe.py"), "--x", "a.py"]
    run = c.run(argv, timeout=120, env={"DML_TIMEOUT": "20"}, cwd=ROOT)
    assert run.returncode == 0, run.output[-8000:]
    lines = sorted(line for line in run.output.splitlines() if line.startswith("rank "))
    assert len(lines) == 4, run.output[-8000:]
    for r, line in enumerate(lines):
        host = c.hosts[r // c.slots]
        # As on one node: the launcher's thread count and runner, the script's own arguments.
        assert line.startswith(f"rank {r} of 4: threads 1 "), line
        assert f"args ['--x', 'a.py'] host {host} DML_TIMEOUT 20 runner -m mpi4py" in line, line


def _fault(c: cluster.Cluster, mode: str, cut: bool = False, stall: int = STALL) -> cluster.Run:
    """A 2x2 training job (tests/fault_job.py) whose rank 3, on node-b, fails in ``mode``; DML_TIMEOUT ``stall``."""
    argv = [LAUNCH, "launch", "-n", "4", "--hostfile", str(c.hostfile), *cluster.MCA_OPTIONS]
    argv += ["-x", f"PYTHONPATH={TESTS}", str(TESTS / "fault_job.py"), mode, "3"]

    def pull_the_cable(line: str) -> None:
        if cut and "CUT ME" in line:
            c.cut(1)

    try:
        return c.run(argv, timeout=stall + 60, env={"DML_TIMEOUT": str(stall)}, on_line=pull_the_cable, cwd=ROOT)
    finally:
        c.mend(1)
        c.kill_all()  # what the lost node still runs, had it survived


def _seconds_after_fault(run: cluster.Run) -> float:
    """From the victim's ``FAULT AT <time>`` line (same machine, same clock) to the job's end."""
    match = re.search(r"FAULT AT (\d+\.\d+)", run.output)
    assert match, run.output[-8000:]
    return run.ended - float(match.group(1))


def test_a_rank_that_stops_on_another_node_is_named_by_the_stall_report(two_by_two: cluster.Cluster) -> None:
    run = _fault(two_by_two, "hang")
    assert run.returncode not in (0, None), (run.returncode, run.output[-8000:])
    assert "rank(s) [3] have not arrived (on node-b)" in run.output, run.output[-8000:]
    assert "  rank 3: not in a collective" in run.output and "[on node-b]" in run.output, run.output[-8000:]
    after = _seconds_after_fault(run)
    assert after < STALL + 10, f"ended {after:.1f} s after the rank stopped"


@pytest.mark.parametrize("mode", ["sigkill", "raise"])
def test_a_rank_killed_or_raising_on_another_node_ends_the_job(two_by_two: cluster.Cluster, mode: str) -> None:
    run = _fault(two_by_two, mode)
    assert run.returncode not in (0, None), (run.returncode, run.output[-8000:])
    assert "NOT ABORTED" not in run.output
    assert "FAULT AT" in run.output, run.output[-8000:]
    if mode == "raise":
        assert "uncaught exception on rank 3 of 4 (on node-b)" in run.output, run.output[-8000:]
        assert "RuntimeError: deliberate failure in training" in run.output, run.output[-8000:]
    else:
        assert re.search(r"rank 3 .*on node[ :]*node-b|node-b.*rank 3", run.output, re.S), run.output[-8000:]
    after = _seconds_after_fault(run)
    assert after < ENDED_S, f"ended {after:.1f} s after the fault"


@pytest.mark.slow
def test_a_pulled_cable_ends_the_job_with_a_failure_naming_the_lost_node(two_by_two: cluster.Cluster) -> None:
    """The stall report names the ranks of the cut-off node and aborts; mpiexec, waiting on that node's daemon, is
    ended by the launcher."""
    run = _fault(two_by_two, "cut", cut=True, stall=CABLE_STALL)
    assert run.returncode is not None, f"still running after {CABLE_STALL + 60} s:\n{run.output[-8000:]}"
    assert run.returncode != 0, run.output[-8000:]
    assert "NOT ABORTED" not in run.output
    assert "rank(s) [2, 3] have not arrived (on node-b)" in run.output, run.output[-8000:]
    assert "after a rank aborted the job" in run.output and "the launcher ended it" in run.output, run.output[-8000:]
    after = _seconds_after_fault(run)
    assert after < CABLE_STALL + 10, f"ended {after:.1f} s after the cable was pulled"


GLOO = ["-x", "DML_TRANSPORT=gloo", "-x", "DML_SOCKET_IFNAME=eth0"]
# tests/stray_job.py: bit for bit against the exact sums (12 of tests/transport_job.py's ring examples); a model's
# buckets over gloo
STRAY_CHECKS = ["ring", "buckets"]
STRAY_SLOWER_S = 20  # a stray client may cost this much more than the baseline: a hang or a stall costs more
_HIT = re.compile(r"STRAY HIT (\S+):(\d+) \(bound to (\S+)\) at \S+ s by \S+: (.*)")


@pytest.mark.timeout(480)
def test_a_stray_client_neither_hangs_slows_nor_corrupts_a_gloo_job(two_by_two: cluster.Cluster) -> None:
    """Port scans, garbage and silent connections to every listener on every node, before and during a 2x2 job
    whose buckets go over gloo (its store and pairs included): the job passes its checks, in about the time it
    takes alone; or, as issue 23 allows, setup fails with a clear error on every rank."""
    c = two_by_two
    argv = [*c.mpiexec_argv(4), *EXPORTS, *GLOO, PYTHON, str(TESTS / "stray_job.py"), *STRAY_CHECKS]
    passed = f"TRANSPORT CHECKS PASSED: {' '.join(STRAY_CHECKS)} on 4 ranks"
    baseline = c.run(argv, timeout=180, cwd=ROOT)
    assert baseline.returncode == 0 and passed in baseline.output, baseline.output[-8000:]
    with _stray_client(c) as stray:
        run = c.run(argv, timeout=180, cwd=ROOT)
    said = "".join(stray)
    print(f"alone {baseline.seconds:.1f} s, with a stray client {run.seconds:.1f} s (exit {run.returncode})\n{said}")
    assert run.returncode is not None, f"hung with a stray client:\n{said}\n{run.output[-8000:]}"
    if run.returncode == 0:
        assert passed in run.output, f"{said}\n{run.output[-8000:]}"
        slower = run.seconds - baseline.seconds
        assert slower < STRAY_SLOWER_S, (
            f"{run.seconds:.1f} s with a stray client, {baseline.seconds:.1f} s alone\n{said}"
        )
    else:  # setup refused: a clear error on every rank
        failed = set(re.findall(r"\[rank (\d)\] distutils_ml: uncaught exception", run.output))
        clear = run.output.count("the ranks could not make their gloo group")
        assert failed == {"0", "1", "2", "3"} and clear >= 4, f"{said}\n{run.output[-8000:]}"
    assert "STRAY DONE" in said, said
    for node, address in enumerate(c.addresses):
        # The gloo transport's listeners (its store on node 0, which listens for the whole job, and every rank's
        # pair listener) are bound to the node's address (DML_SOCKET_IFNAME); Open MPI's to any address. Each was
        # scanned, sent garbage, held silent.
        hit = [m for m in _HIT.finditer(said) if m[1] == address and m[3] == address]
        full = [m for m in hit if m[4] == "silent ok, garbage ok, scan ok"]
        assert len(full) >= c.slots + (node == 0), f"node {node}: the gloo listeners were not all hit\n{said}"


@contextlib.contextmanager
def _stray_client(c: cluster.Cluster) -> Iterator[list[str]]:
    """tests/stray_client.py on node 1, hitting the listeners of every node until the block ends; its lines (the
    list is complete after the block)."""
    sentinels = [c.popen(["sleep", "3600"], node=k) for k in range(c.nodes)]  # whose /proc/PID/net is the node's
    lines: list[str] = []
    stray: subprocess.Popen[str] | None = None
    reader: threading.Thread | None = None
    try:
        for k, sentinel in enumerate(sentinels):
            _wait_for_namespace(sentinel.pid, c.namespaces[k])
        nodes = [f"{s.pid}={address}" for s, address in zip(sentinels, c.addresses, strict=True)]
        stray = c.popen([PYTHON, str(TESTS / "stray_client.py"), *nodes], node=1)
        out = stray.stdout
        assert out is not None

        def read() -> None:
            for line in out:
                lines.append(line)

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        deadline = time.monotonic() + 30
        while not any(line.startswith("STRAY READY") for line in lines):
            assert stray.poll() is None and time.monotonic() < deadline, f"the stray client did not start: {lines}"
            time.sleep(0.05)
        yield lines
    finally:
        if stray is not None:
            stray.terminate()
            try:
                stray.wait(timeout=10)
            except subprocess.TimeoutExpired:
                stray.kill()
                stray.wait()
        if reader is not None:
            reader.join(timeout=5)
        for sentinel in sentinels:
            sentinel.kill()
            sentinel.wait()


def _wait_for_namespace(pid: int, namespace: str, timeout: float = 10) -> None:
    """Until process ``pid`` is in network namespace ``namespace`` (``ip netns exec`` entered it)."""
    want = os.stat(f"/run/netns/{namespace}").st_ino
    deadline = time.monotonic() + timeout
    while os.stat(f"/proc/{pid}/ns/net").st_ino != want:
        assert time.monotonic() < deadline, f"process {pid} did not enter {namespace}"
        time.sleep(0.01)
