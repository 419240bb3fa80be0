"""``distutils-ml launch --restarts N --min-nodes M`` (distutils_ml/restarts.py): a failed job starts again on the
nodes that answer and resumes through ``dml.TrainState`` (tests/restart_job.py), on the namespace cluster."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from distutils_ml.launch import parse_args
from distutils_ml.restarts import hosts_of, without_hosts

import cluster
from mpirun import mpi_env, requires_mpi

ROOT = Path(__file__).resolve().parent.parent
TESTS = ROOT / "tests"
JOB = str(TESTS / "restart_job.py")
LAUNCH = str(Path(sys.executable).parent / "distutils-ml")
STALL = 10


def test_the_options_and_the_nodes(tmp_path: Path) -> None:
    args = parse_args(["-n", "4", "--restarts", "3", "--min-nodes=2", "--hostfile", "h", "train.py"])
    assert (args.restarts, args.min_nodes, args.mpiexec_options) == (3, 2, ["--hostfile", "h"])
    with pytest.raises(ValueError, match="--restarts takes a whole number"):
        parse_args(["-n", "2", "--restarts", "x", "train.py"])
    hostfile = tmp_path / "hosts"
    hostfile.write_text("# nodes\nnode-a slots=2\nnode-b slots=2 max_slots=4\n\nnode-c\n")
    assert hosts_of(["--hostfile", str(hostfile)], {}) == [("node-a", 2), ("node-b", 2), ("node-c", 1)]
    assert hosts_of(["-H", "a:2,b"], {}) == [("a", 2), ("b", 1)]
    assert hosts_of(["--mca", "btl", "tcp"], {}) is None
    assert without_hosts(["--mca", "btl", "tcp", "--hostfile", "h", "-H", "a,b", "-x", "A"]) == [
        "--mca", "btl", "tcp", "-x", "A"
    ]  # fmt: skip


@requires_mpi
def test_a_failure_that_repeats_at_the_same_point_stops_the_restarts(tmp_path: Path) -> None:
    argv = [LAUNCH, "launch", "-n", "2", "--restarts", "5", "--allow-run-as-root", "--mca", "btl", "^ofi"]
    run = subprocess.run([*argv, JOB, "bug", str(tmp_path)], env={**mpi_env(), "PYTHONPATH": str(TESTS)},
                         capture_output=True, text=True, timeout=240, check=False)  # fmt: skip
    out = run.stderr + run.stdout
    assert run.returncode != 0, out[-6000:]
    # Attempt 1 fails from the start, attempt 2 resumed from step 8 and fails again: another point, so one more;
    # attempt 3 fails as attempt 2 did: a bug.
    assert "attempt 2 resumed from state-00000002.pt (epoch 0, step=8)" in out, out[-6000:]
    assert "attempt 3 failed as attempt 2 did" in out and "a bug in the job, not a lost node" in out, out[-6000:]
    assert "attempt 4 of 6" not in out, out[-6000:]


class Timeline:
    """Each line of a run's output with the time it arrived (``Cluster.run``'s ``on_line``). With a ``signal`` and a
    ``fault``: the first line holding ``signal`` calls ``fault`` (cut a cable, kill a node), at ``fault_at``."""

    def __init__(self, signal: str = "", fault: Callable[[], None] | None = None) -> None:
        self.lines: list[tuple[float, str]] = []
        self.signal, self.fault = signal, fault
        self.fault_at: float | None = None

    def __call__(self, line: str) -> None:
        self.lines.append((time.time(), line))
        if self.fault is not None and self.fault_at is None and self.signal in line:
            self.fault_at = time.time()
            self.fault()

    def arrived(self, text: str) -> float:
        """When the first line holding ``text`` arrived."""
        times = [t for t, line in self.lines if text in line]
        assert times, (text, "".join(line for _, line in self.lines)[-6000:])
        return times[0]


def _launch(c: cluster.Cluster, ranks: int, extra: list[str], fault: str, where: Path, **kw: object) -> cluster.Run:
    argv = [LAUNCH, "launch", "-n", str(ranks), "--hostfile", str(c.hostfile), *cluster.MCA_OPTIONS, *extra]
    argv += ["-x", f"PYTHONPATH={TESTS}", JOB, fault, str(where)]
    return c.run(argv, timeout=200, env={"DML_TIMEOUT": str(STALL)}, cwd=ROOT, **kw)  # type: ignore[arg-type]


def _plain(c: cluster.Cluster, ranks: int, where: Path) -> cluster.Run:
    """The job without a fault, by ``mpiexec`` itself, on the same nodes with the same settings (a run that never
    fails needs no launcher, and skips its start-up: it imports the library): the parameters a restart must end at."""
    argv = [*c.mpiexec_argv(ranks), "-x", f"PYTHONPATH={TESTS}", "-x", f"DML_TIMEOUT={STALL}"]
    argv += ["-x", "OMP_NUM_THREADS=1", sys.executable, JOB, "none", str(where)]
    return c.run(argv, timeout=200, cwd=ROOT)


def _at(text: str, label: str, last: bool = False) -> float:
    found = re.findall(rf"{label} AT (\d+\.\d+)", text)
    assert found, (label, text[-6000:])
    return float(found[-1 if last else 0])


def _recovery(what: str, run: cluster.Run, timeline: Timeline, fault_at: float) -> dict[str, float]:
    """The time from the failure to the first step after the resume, in its parts (printed); asserts the issue's
    bound: at most the stall timeout + the launch + the checkpoint load + 10 s."""
    failed, relaunched = timeline.arrived("attempt 1 failed"), timeline.arrived("attempt 2 of")
    started, resumed = _at(run.output, "STARTED", last=True), _at(run.output, "RESUMED")
    first = _at(run.output, "FIRST STEP AFTER RESUME")
    parts = {
        "noticed (the failure to the launcher knowing)": failed - fault_at,
        "probe (the nodes asked, stale directories removed)": relaunched - failed,
        "launch (mpiexec to MPI up on every rank)": started - relaunched,
        "load (the checkpoint read and placed)": resumed - started,
        "first step": first - resumed,
    }
    total = first - fault_at
    print(f"{what}: the first step after the resume came {total:.1f} s after the failure:")
    print("\n".join(f"  {name}: {seconds:.1f} s" for name, seconds in parts.items()))
    print("\n".join(line for line in run.output.splitlines() if line.startswith("distutils-ml launch:")))
    bound = STALL + parts["launch (mpiexec to MPI up on every rank)"] + parts["load (the checkpoint read and placed)"]
    assert total <= bound + 10, (total, parts)
    return parts


@requires_mpi
def test_a_killed_rank_restarts_on_the_same_nodes_and_ends_bit_identical(
    two_by_two: cluster.Cluster, tmp_path: Path
) -> None:
    c = two_by_two
    plain = _plain(c, 4, tmp_path / "plain")
    assert plain.returncode == 0, plain.output[-6000:]
    timeline = Timeline()
    run = _launch(c, 4, ["--restarts", "2"], "kill-rank", tmp_path / "killed", on_line=timeline)
    c.kill_all()
    assert run.returncode == 0, run.output[-8000:]
    assert "attempt 1 failed" in run.output and "restarting on node-a, node-b" in run.output, run.output[-8000:]
    assert "attempt 2 resumed from state-00000002.pt (epoch 0, step=8)" in run.output, run.output[-8000:]
    assert "FINISHED at step 24 on 4 ranks" in run.output, run.output[-8000:]  # 192 / 4 ranks / 4 a batch x 2
    same = np.load(tmp_path / "killed" / "final.npy"), np.load(tmp_path / "plain" / "final.npy")
    assert np.array_equal(*same), np.abs(same[0] - same[1]).max()
    _recovery("a killed rank", run, timeline, _at(run.output, "FAULT"))


@requires_mpi
@pytest.mark.slow
def test_a_node_cut_off_is_dropped_and_the_job_finishes_on_the_rest(
    three_by_one: cluster.Cluster, tmp_path: Path
) -> None:
    c = three_by_one
    timeline = Timeline("CUT ME", lambda: c.cut(2))
    try:
        run = _launch(c, 3, ["--restarts", "2", "--min-nodes", "2"], "cut", tmp_path, on_line=timeline)
    finally:
        c.mend(2)
        c.kill_all()
    assert run.returncode == 0, run.output[-8000:]
    out = run.output
    assert "restarting on node-a, node-b, without node-c (lost during the job, not answering)" in out, out[-8000:]
    resumed = re.search(r"RESUMED AT \S+ step (\d+) on 2 ranks", run.output)
    assert resumed, run.output[-8000:]
    assert int(resumed.group(1)) >= 10 - 4, resumed.group(0)  # the steps lost: at most the checkpoint interval
    assert "FINISHED at step" in run.output and "on 2 ranks" in run.output, run.output[-8000:]
    assert timeline.fault_at is not None
    _recovery("a node cut off", run, timeline, timeline.fault_at)


@requires_mpi
@pytest.mark.slow
def test_a_node_whose_processes_are_all_killed_is_used_again_and_the_job_ends_bit_identical(
    three_by_one: cluster.Cluster, tmp_path: Path
) -> None:
    """Every process on node-c killed (its daemon, its rank): the node still answers, so the job restarts on all
    three at the same world size, ends bit-identical to a run that never failed; the killed daemon's session
    directory, which would fail a later daemon with its process id, is removed by the probe."""
    c = three_by_one
    plain = _plain(c, 3, tmp_path / "plain")
    assert plain.returncode == 0, plain.output[-6000:]
    timeline = Timeline("KILL MY NODE", lambda: c.kill(2))
    try:
        run = _launch(c, 3, ["--restarts", "2", "--min-nodes", "3"], "kill-node", tmp_path / "killed",
                      on_line=timeline)  # fmt: skip
    finally:
        c.kill_all()
    out = run.output
    assert run.returncode == 0, out[-8000:]
    assert "restarting on node-a, node-b, node-c" in out and "without" not in out, out[-8000:]
    assert re.search(r"stale Open MPI session directory on node-c: removed \S+/prted\.\d+", out), out[-8000:]
    assert "attempt 2 resumed from state-00000002.pt (epoch 0, step=8)" in out, out[-8000:]
    assert "FINISHED at step 32 on 3 ranks" in out, out[-8000:]  # 192 / 3 ranks / 4 a batch x 2 epochs
    same = np.load(tmp_path / "killed" / "final.npy"), np.load(tmp_path / "plain" / "final.npy")
    assert np.array_equal(*same), np.abs(same[0] - same[1]).max()
    assert timeline.fault_at is not None
    _recovery("a node's processes all killed", run, timeline, timeline.fault_at)
