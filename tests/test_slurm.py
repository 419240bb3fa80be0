"""SLURM as users run it: ``sbatch``, ``srun`` and ``salloc`` on a real SLURM over the namespace cluster, 2 nodes x 2.

The daemons are Debian's (tests/slurm.py installs them where missing); the jobs are tests/slurm_job.py, run by the
documented templates ``examples/slurm/train.sbatch`` and ``train-gpu.sbatch`` themselves. Every command is bounded by
a timeout (tests/cluster.py kills what is left on the nodes after it).
"""

from __future__ import annotations

import json
import re
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

import cluster
import slurm
from mpirun import requires_mpi

ROOT = Path(__file__).resolve().parent.parent
TESTS = ROOT / "tests"
JOB = str(TESTS / "slurm_job.py")
PYTHON = sys.executable
LAUNCH = str(Path(PYTHON).parent / "distutils-ml")
TEMPLATE = ROOT / "examples" / "slurm" / "train.sbatch"
GPU_TEMPLATE = ROOT / "examples" / "slurm" / "train-gpu.sbatch"
STALL = 10  # DML_TIMEOUT of the node-death job
# What the templates read (VENV, SCRIPT) and what every task of a test job needs.
ENV = {"VENV": sys.prefix, "SCRIPT": JOB, "PYTHONPATH": str(TESTS), "OMPI_MCA_btl": "^ofi"}

pytestmark = requires_mpi


@pytest.fixture(scope="module")
def slurm_2x2() -> Iterator[slurm.Slurm]:
    reason = slurm.unavailable()
    if reason:
        pytest.skip(reason)
    with slurm.slurm_cluster(2, 2) as s:
        yield s


def _sbatch(
    s: slurm.Slurm,
    template: Path,
    out: Path,
    *args: str,
    env: dict[str, str] | None = None,
    sbatch: tuple[str, ...] = (),
) -> str:
    """Submit ``template`` with ``args`` (its output to ``out``, not waiting); the job's id."""
    argv = ["sbatch", "--parsable", f"--output={out}", *sbatch, str(template), *args]
    run = s.run(argv, 30, env={**ENV, **(env or {})})
    assert run.returncode == 0, run.output
    return run.output.split()[-1].split(";")[0]


def _wait(
    s: slurm.Slurm, job: str, timeout: float, *, settled: bool = True, requeued: bool = False
) -> tuple[str, float]:
    """Wait until ``job`` stops running (``settled``: and SLURM has finished ending it; ``requeued``: and it is not
    on its way back into the queue either); (its state, when)."""
    deadline = time.monotonic() + timeout
    going = ("PENDING", "CONFIGURING", "RUNNING", *(("COMPLETING",) if settled else ()))
    going += ("REQUEUED", "REQUEUE_FED", "REQUEUE_HOLD", "RESIZING") if requeued else ()
    while time.monotonic() < deadline:
        state = _state(s, job)
        if state not in going:
            return state, time.time()
        time.sleep(0.2)
    raise AssertionError(f"job {job} still {state} after {timeout} s:\n{s.logs()}")


def _state(s: slurm.Slurm, job: str) -> str:
    shown = s.command(["scontrol", "show", "job", "-o", job], check=False).stdout
    match = re.search(r"JobState=(\S+)", shown)
    return match.group(1) if match else "GONE"


def _exit_code(s: slurm.Slurm, job: str) -> str:
    match = re.search(r" ExitCode=(\S+)", s.command(["scontrol", "show", "job", "-o", job]).stdout)
    assert match, job
    return match.group(1)


def _until(path: Path, text: str, timeout: float) -> float:
    """Wait until ``path`` holds ``text``; the time it was seen."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and text in path.read_text(errors="replace"):
            return time.time()
        time.sleep(0.1)
    raise AssertionError(f"{text!r} not in {path} after {timeout} s:\n{path.read_text() if path.exists() else ''}")


def _job_processes(c: cluster.Cluster, nodes: list[int] | None = None) -> list[str]:
    """The test jobs' ranks still alive on ``nodes`` (default: every node): 'pid cmdline'."""
    found = []
    for ns in [c.namespaces[k] for k in (range(c.nodes) if nodes is None else nodes)]:
        for pid in cluster._ip("netns", "pids", ns, check=False).stdout.split():
            try:
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                continue
            if "slurm_job.py" in cmd and Path(cmd.split(" ")[0]).name.startswith("python"):  # a rank, not srun
                found.append(f"{pid} {cmd}")
    return found


def test_the_sbatch_template_trains_to_the_parameters_of_the_mpiexec_run(
    slurm_2x2: slurm.Slurm, tmp_path: Path
) -> None:
    s = slurm_2x2
    out = tmp_path / "job.out"
    job = _sbatch(s, TEMPLATE, out, "train", str(tmp_path / "slurm.npy"))
    state, _ = _wait(s, job, 120)
    assert state == "COMPLETED", (state, out.read_text())
    assert out.read_text().count("trained on 4 ranks") == 4, out.read_text()
    c = s.cluster
    argv = [*c.mpiexec_argv(4), "-x", f"PYTHONPATH={TESTS}", "-x", "OMP_NUM_THREADS=1", PYTHON, JOB, "train"]
    run = c.run([*argv, str(tmp_path / "mpiexec.npy")], timeout=120, cwd=ROOT)
    assert run.returncode == 0, run.output[-8000:]
    by_slurm, by_mpiexec = np.load(tmp_path / "slurm.npy"), np.load(tmp_path / "mpiexec.npy")
    assert by_slurm.shape == by_mpiexec.shape and np.array_equal(by_slurm, by_mpiexec), np.abs(
        by_slurm - by_mpiexec
    ).max()


def test_node_ranks_and_gpus_come_from_slurm_and_agree_with_mpiexec(slurm_2x2: slurm.Slurm, tmp_path: Path) -> None:
    s, c = slurm_2x2, slurm_2x2.cluster
    out = tmp_path / "job.out"
    job = _sbatch(s, GPU_TEMPLATE, out, "info", str(tmp_path / "slurm.json"), env={"DML_TIMEOUT": "17"})
    state, _ = _wait(s, job, 120)
    assert state == "COMPLETED", (state, out.read_text())
    under_srun = json.loads((tmp_path / "slurm.json").read_text())
    argv = [
        LAUNCH,
        "launch",
        "-n",
        "4",
        "--hostfile",
        str(c.hostfile),
        *cluster.MCA_OPTIONS,
        "-x",
        f"PYTHONPATH={TESTS}",
    ]
    run = c.run([*argv, JOB, "info", str(tmp_path / "mpiexec.json")], timeout=120, env={"DML_TIMEOUT": "17"}, cwd=ROOT)
    assert run.returncode == 0, run.output[-8000:]
    under_mpiexec = json.loads((tmp_path / "mpiexec.json").read_text())
    for mine, theirs in zip(under_srun, under_mpiexec, strict=True):
        r = mine["rank"]
        assert mine["host"] == c.hosts[r // 2], mine
        # What SLURM set for the task: its rank on the node, the node's tasks, one GPU of its own.
        assert mine["node_local_rank"] == int(mine["SLURM_LOCALID"]) == r % 2, mine
        assert mine["node_size"] == 2 and mine["SLURM_TASKS_PER_NODE"] == "2(x2)", mine
        assert mine["CUDA_VISIBLE_DEVICES"] == str(r % 2) and mine["gpu"] == f"{mine['host']}/gpu{r % 2}", mine
        # DML_* of the shell that ran sbatch reached every task.
        assert mine["timeout"] == 17.0, mine
        # The same placement, node ranks and GPU (node_local_rank % the node's 2 GPUs) under mpiexec.
        same = ("rank", "host", "node_local_rank", "node_size", "gpu", "timeout")
        assert {k: mine[k] for k in same} == {k: theirs[k] for k in same}, (mine, theirs)
        assert "CUDA_VISIBLE_DEVICES" not in theirs and len(theirs["visible"]) == 2, theirs


def test_launch_inside_an_allocation_uses_its_nodes_without_a_hostfile(slurm_2x2: slurm.Slurm, tmp_path: Path) -> None:
    s = slurm_2x2
    info = tmp_path / "launch.json"
    argv = ["salloc", "-N", "2", "--ntasks-per-node=2", LAUNCH, "launch", "--allow-run-as-root", *cluster.MCA_OPTIONS]
    run = s.run([*argv, "-x", f"PYTHONPATH={TESTS}", JOB, "info", str(info)], timeout=120, env=ENV, cwd=ROOT)
    assert run.returncode == 0, run.output[-8000:]
    said = re.search(r"distutils-ml launch: inside SLURM allocation \d+ \(nodes node-a,node-b\): mpiexec places the "
                     r"4 ranks on its nodes, no hostfile needed \(4: its SLURM_NTASKS\)", run.output)  # fmt: skip
    assert said, run.output[-8000:]
    ranks = json.loads(info.read_text())
    assert [(r["host"], r["node_local_rank"], r["node_size"]) for r in ranks] == [
        ("node-a", 0, 2), ("node-a", 1, 2), ("node-b", 0, 2), ("node-b", 1, 2)
    ], ranks  # fmt: skip


def test_a_dml_setting_that_differs_between_srun_tasks_is_refused(slurm_2x2: slurm.Slurm, tmp_path: Path) -> None:
    # Task 3 alone gets another stall timeout, as an environment that reached one node only would give.
    task3 = 'if [ "$SLURM_PROCID" = 3 ]; then export DML_TIMEOUT=7; fi; exec "$0" "$@"'
    argv = ["srun", "-N", "2", "-n", "4", "--mpi=pmix", "sh", "-c", task3, PYTHON, JOB, "info", str(tmp_path / "i")]
    run = slurm_2x2.run(argv, timeout=120, env={**ENV, "DML_TIMEOUT": "20"}, cwd=ROOT)
    assert run.returncode not in (0, None), run.output[-8000:]
    assert "the ranks were given different options" in run.output, run.output[-8000:]
    assert "20.0 on rank(s) [0, 1, 2] on node-a, node-b; 7.0 on rank(s) [3] on node-b" in run.output, run.output[-8000:]
    assert not (tmp_path / "i").exists()


@pytest.mark.parametrize("mpi", ["--mpi=pmi2", None])
def test_srun_with_another_pmi_or_none_is_refused_saying_what_to_type(
    slurm_2x2: slurm.Slurm, tmp_path: Path, mpi: str | None
) -> None:
    argv = ["srun", "-N", "2", "-n", "4", *([mpi] if mpi else []), PYTHON, JOB, "info", str(tmp_path / "i")]
    run = slurm_2x2.run(argv, timeout=120, env=ENV, cwd=ROOT)
    assert run.returncode not in (0, None), run.output[-8000:]
    said = f"srun started 4 tasks (SLURM_STEP_NUM_TASKS=4) with --mpi={(mpi or '--mpi=none').split('=')[1]}"
    assert run.output.count(said) == 4, run.output[-8000:]  # on every task
    assert run.output.count("srun --mpi=pmix python train.py") == 4, run.output[-8000:]
    # Open MPI's own message is readable too: the library points the wheel's MPI at its files (OPAL_PREFIX).
    assert "couldn't find that topic" not in run.output, run.output[-8000:]
    assert not (tmp_path / "i").exists()


def test_scancel_ends_every_rank_and_leaves_the_checkpoint_whole(slurm_2x2: slurm.Slurm, tmp_path: Path) -> None:
    s = slurm_2x2
    out, ckpt = tmp_path / "job.out", tmp_path / "ckpt.pt"
    job = _sbatch(s, TEMPLATE, out, "checkpoint", str(ckpt))
    _until(out, "saved 3", 120)  # the next checkpoint is being written when scancel comes
    start = time.time()
    s.command(["scancel", job])
    state, ended = _wait(s, job, 30)
    assert state == "CANCELLED", (state, out.read_text()[-4000:])
    deadline = time.monotonic() + 15
    while _job_processes(s.cluster) and time.monotonic() < deadline:
        time.sleep(0.1)
    gone = time.time()
    print(f"scancel: the ranks ended after {gone - start:.1f} s, the job after {ended - start:.1f} s")
    assert not _job_processes(s.cluster), _job_processes(s.cluster)
    assert gone - start < 10, f"the ranks ended {gone - start:.1f} s after scancel"
    # Complete: the checkpoint the last finished save wrote (a save cut short leaves the previous one).
    state_dict = torch.load(ckpt, weights_only=True)
    assert state_dict["step"] >= 3 and state_dict["model"]["weight"].shape == (2048, 2048), state_dict["step"]
    assert ended - start < 10, f"SLURM took {ended - start:.1f} s to end the job"


@pytest.mark.parametrize("how", ["killed", "cut"])
def test_a_node_that_dies_ends_the_job_naming_it(slurm_2x2: slurm.Slurm, tmp_path: Path, how: str) -> None:
    s = slurm_2x2
    out = tmp_path / "job.out"
    # --no-requeue: by default SLURM puts a job that lost a node back in the queue, to start again from the top.
    job = _sbatch(s, TEMPLATE, out, "steps", env={"DML_TIMEOUT": str(STALL)}, sbatch=("--no-requeue",))
    _until(out, "step 5 done", 120)
    lost = time.time()
    if how == "killed":
        s.kill_node(1)  # node-b: its slurmd and both its ranks, at once
    else:
        s.cluster.cut(1)  # node-b's cable: its slurmd and ranks live on, unreachable
    try:
        deadline = time.monotonic() + STALL + 30
        while _job_processes(s.cluster, [0]) and time.monotonic() < deadline:
            time.sleep(0.1)
        ranks_ended = time.time()
        state, ended = _wait(s, job, STALL + 60, settled=False)
        text = out.read_text(errors="replace")
        print(f"node-b {how}: node-a's ranks ended {ranks_ended - lost:.1f} s later, SLURM's job {ended - lost:.1f} s")
        assert ranks_ended - lost < STALL + 5, f"node-a's ranks ended {ranks_ended - lost:.1f} s after the loss"
        assert state in ("FAILED", "NODE_FAIL", "COMPLETING"), (state, text[-6000:])
        assert ended - lost < STALL + 15, f"the job ended {ended - lost:.1f} s after node-b was lost:\n{text[-6000:]}"
        named = r"rank\(s\) \[2, 3\] (on node-b|have not arrived \(on node-b\))|rank [23] on node-b ended"
        assert re.search(named, text), text[-6000:]
    finally:
        s.cluster.mend(1)
        s.kill_node(1)
        s.resume(1)
    assert _exit_code(s, job) != "0:0"


def test_launch_restarts_inside_the_allocation_without_a_node_that_died(slurm_2x2: slurm.Slurm, tmp_path: Path) -> None:
    """``salloc --no-kill ... distutils-ml launch --restarts 1``: node-b dies (its slurmd and every process on it)
    at step 10; the launcher starts the job again inside the same allocation on node-a alone, and it resumes from
    the checkpoint of step 8 and finishes (tests/restart_job.py)."""
    s = slurm_2x2
    killed_at: list[float] = []

    def kill_the_node(line: str) -> None:
        if "KILL MY NODE" in line and not killed_at:
            killed_at.append(time.time())
            s.kill_node(1)

    # --no-kill, as docs/slurm.md says: by SLURM's documentation it ends an allocation once it marks a node down.
    argv = ["salloc", "-N", "2", "--ntasks-per-node=2", "--no-kill", LAUNCH, "launch", "--allow-run-as-root",
            "--restarts", "1", "--min-nodes", "1", *cluster.MCA_OPTIONS, "-x", f"PYTHONPATH={TESTS}",
            str(TESTS / "restart_job.py"), "kill-node", str(tmp_path)]  # fmt: skip
    try:
        run = s.run(argv, timeout=180, env={**ENV, "DML_TIMEOUT": str(STALL)}, on_line=kill_the_node, cwd=ROOT)
    finally:
        s.kill_node(1)
        s.resume(1)
    out = run.output
    print("\n".join(line for line in out.splitlines() if line.startswith("distutils-ml launch:")))
    assert run.returncode == 0, out[-8000:]
    assert "attempt 1 of 2: 4 rank(s) on node-a, node-b" in out, out[-8000:]
    assert "restarting on node-a, without node-b" in out, out[-8000:]
    assert "attempt 2 of 2: 2 rank(s) on node-a" in out, out[-8000:]
    assert re.search(r"RESUMED AT \S+ step 8 on 2 ranks", out), out[-8000:]
    assert "FINISHED at step 40 on 2 ranks" in out, out[-8000:]  # 8 steps on 4 ranks, 8 + 24 on 2
    first = float(re.findall(r"FIRST STEP AFTER RESUME AT (\S+)", out)[0])
    print(f"node-b died: the first step after the resume came {first - killed_at[0]:.1f} s later")
    assert first - killed_at[0] < STALL + 20, first - killed_at[0]  # the stall timeout, a launch, a load


def test_a_requeued_batch_job_resumes_from_its_checkpoint(slurm_2x2: slurm.Slurm, tmp_path: Path) -> None:
    """SLURM's requeue (what it does by default to a batch job that lost a node; here ``scontrol requeue`` while the
    job runs) starts the script again from the top: ``TrainState`` resumes it from its last checkpoint at the same
    world size, and it ends bit-identical to a job that ran through (tests/restart_job.py, by the template)."""
    s = slurm_2x2
    env = {"SCRIPT": str(TESTS / "restart_job.py")}
    through, requeued = tmp_path / "through", tmp_path / "requeued"
    through.mkdir()
    requeued.mkdir()
    out = tmp_path / "requeued.out"
    job = _sbatch(s, TEMPLATE, out, "kill-node", str(requeued), env=env, sbatch=("--requeue", "--open-mode=append"))
    _until(out, "KILL MY NODE", 120)  # step 10: the checkpoint of step 8 is written (it goes on slowly)
    asked = time.time()
    s.command(["scontrol", "requeue", job])
    # SLURM holds the requeued job back until its credential expires (cred_expire + 1 = 11 s here): the job that
    # runs through runs meanwhile, on the nodes the requeued one left; the requeued one starts when it may and they
    # are free again.
    plain = _sbatch(s, TEMPLATE, tmp_path / "through.out", "none", str(through), env=env)
    state, _ = _wait(s, plain, 120)
    assert state == "COMPLETED", (state, (tmp_path / "through.out").read_text()[-4000:])
    state, _ = _wait(s, job, 240, requeued=True)
    text = out.read_text(errors="replace")
    assert state == "COMPLETED", f"{state}\n{text[-6000:]}\n{s.logs()}"
    assert text.count("STARTED AT") == 2, text[-6000:]  # the script ran twice, from the top
    resumed = re.search(r"RESUMED AT (\S+) step (\d+) on 4 ranks", text)
    assert resumed and int(resumed.group(2)) >= 8, text[-6000:]
    assert "FINISHED at step 24 on 4 ranks" in text, text[-6000:]  # 192 samples, 4 ranks of 4: 12 steps an epoch
    print(
        f"requeued at step >= 10: resumed from step {resumed.group(2)}, {float(resumed.group(1)) - asked:.1f} s later"
        " (the job that runs through held the nodes meanwhile)"
    )
    assert np.array_equal(np.load(through / "final.npy"), np.load(requeued / "final.npy"))


def test_only_open_mpis_init_race_is_run_again() -> None:
    """Slurm.run runs a job once more for one known Open MPI bug only: a segfault of ob1's in MPI_Init."""
    race = (
        "[node-a:4242] *** Process received signal ***\n[node-a:4242] Signal: Segmentation fault (11)\n"
        "[node-a:4242] [ 1] libmpi.so.40(mca_pml_ob1_recv_frag_callback_match+0x9b)[0x7f]\n"
        "[node-a:4242] [ 3] libopen-pal.so.80(opal_progress+0x30)[0x7f]\n"
        "[node-a:4242] [ 4] libmpi.so.40(ompi_mpi_init+0x5d1)[0x7f]\n"
    )
    assert slurm.mpi_init_race(race)
    after_init = race.replace("ompi_mpi_init+0x5d1", "PMPI_Allreduce+0x12")  # a crash in a collective is ours
    assert not slurm.mpi_init_race(after_init)
    assert not slurm.mpi_init_race("ompi_mpi_init: PMIx_Init failed\nmca_pml_ob1_recv_frag_callback_match")
