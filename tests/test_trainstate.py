"""``dml.TrainState`` (distutils_ml/trainstate.py): save in the background, resume bit for bit at the same world size
and correctly at another. The exactness runs under mpiexec (tests/trainstate_job.py): simulated ranks share one
process's random streams."""

from __future__ import annotations

import dataclasses
import json
import os
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import distutils_ml as dml
import distutils_ml.trainstate as ts

from mpirun import Job, assert_checks_passed, requires_mpi, run_mpi

N = 38  # tests/trainstate_job.py's observations


# Three jobs hold the MPI checks of the tests below, to pay MPI's and torch's start-up three times instead of six: on
# 3 ranks, runs cut and saved (cut=DIR), then "exact"; on 2, runs cut, the 3-rank cuts resumed (resume=DIR), then
# "exact"; on 3 again, the 2-rank cuts resumed. Each test reads the lines of its own checks ("check NAME passed").
# The first test to ask may run all three: each test has the time of all three.
JOBS_TIMEOUT = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def cuts(tmp_path_factory: pytest.TempPathFactory) -> dict[int, Path]:
    """Where the runs cut by a job of 2 and of 3 ranks are saved."""
    root = tmp_path_factory.mktemp("trainstate-cuts")
    made = {ranks: root / f"cut-at-{ranks}" for ranks in (2, 3)}
    for path in made.values():
        path.mkdir()
    return made


@pytest.fixture(scope="module")
def jobs(cuts: dict[int, Path]) -> dict[str, Job]:
    """The three jobs by what they ran: "cut at 3" and "exact at 3" are one job, and so on."""
    at3 = run_mpi(3, ["tests/trainstate_job.py", f"cut={cuts[3]}", "exact"], timeout=280)
    at2 = run_mpi(2, ["tests/trainstate_job.py", f"cut={cuts[2]}", f"resume={cuts[3]}", "exact"], timeout=280)
    again = run_mpi(3, ["tests/trainstate_job.py", f"resume={cuts[2]}"], timeout=120)
    return {"cut at 3": at3, "exact at 3": at3, "cut at 2": at2, "resume at 2": at2, "exact at 2": at2,
            "resume at 3": again}  # fmt: skip


@requires_mpi
@JOBS_TIMEOUT
@pytest.mark.parametrize("ranks", [2, 3])
def test_a_run_cut_anywhere_and_resumed_is_the_uninterrupted_run_bit_for_bit(ranks: int, jobs: dict[str, Job]) -> None:
    job = jobs[f"exact at {ranks}"]
    assert_checks_passed(job, ["exact"], ranks)
    assert job.returncode == 0, job.output[-8000:]
    assert "TRAINSTATE CHECKS PASSED: " in job.output and f"exact on {ranks} ranks" in job.output, job.output[-8000:]


@requires_mpi
@JOBS_TIMEOUT
@pytest.mark.parametrize(("saved", "resumed"), [(2, 3), (3, 2)])
def test_resumed_at_another_world_size_every_observation_of_the_epoch_comes_once(
    cuts: dict[int, Path], jobs: dict[str, Job], saved: int, resumed: int
) -> None:
    directory = cuts[saved]
    assert_checks_passed(jobs[f"cut at {saved}"], [f"cut={directory}"], saved)
    assert_checks_passed(jobs[f"resume at {resumed}"], [f"resume={directory}"], resumed)
    stops = sorted(os.listdir(directory), key=int)
    assert len(stops) == 3, stops
    for stop in stops:
        before = json.loads((directory / stop / "before.json").read_text())
        assert before["ranks"] == saved
        after = [json.loads((directory / stop / f"after-{r}.json").read_text()) for r in range(resumed)]
        taken = [i for seen in before["seen"] for i in seen] + [i for seen in after for i in seen]
        assert all(after), f"a rank of {resumed} took nothing of the epoch's rest: {after}"
        # Each observation of the epoch once: those the cut run took, then the rest split over the new ranks.
        assert sorted(taken) == list(range(N)), (stop, sorted(taken))


# -- one process: simulated ranks --------------------------------------------------------------------------------


def _state(backend: dml.Backend, **kw: object) -> dml.TrainState:
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    opt = dml.DistributedOptimizer(backend, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    data = dml.DistributedDataContainer(backend, torch.arange(20.0).reshape(20, 1))
    return dml.TrainState(backend, model=model, optimizer=opt, data=data, **{"step": 0, **kw})


def _files(path: Path) -> list[str]:
    return sorted(p.name for p in path.iterdir())


@pytest.mark.parametrize("world", [1, 3])
def test_keeps_the_newest_checkpoints_and_resumes_the_newest(tmp_path: Path, world: int) -> None:
    def body(b: dml.Backend) -> tuple[int, int]:
        state = _state(b, keep=2)
        for step in range(1, 6):
            state.step = step
            state.save(tmp_path)
        state.wait()
        again = _state(b)
        assert again.resume(tmp_path)
        return again.step, again.saves

    assert dml.LocalBackend.spawn(world, body) == [(5, 5)] * world
    assert _files(tmp_path) == ["state-00000004.pt", "state-00000005.pt"]


class Unreadable(torch.Tensor):
    """A tensor whose copy (and digest) fails."""

    def detach(self) -> torch.Tensor:
        raise RuntimeError("no copy of this one")


def test_expanded_and_sparse_tensors_are_saved_and_a_failed_copy_raises_on_every_rank(tmp_path: Path) -> None:
    """An expand()ed or a sparse tensor among the values saves and resumes (rank 0's host copy raised alone after
    the collectives, and the other ranks went on to wait in their next one); a copy that fails raises on every
    rank."""

    def body(b: dml.Backend) -> None:
        mask = torch.arange(3.0).expand(2, 3)
        sparse = torch.sparse_coo_tensor([[0, 2]], [1.5, -2.0], (4,), check_invariants=True)
        state = dml.TrainState(b, model=torch.nn.Linear(2, 1), mask=mask, sparse=sparse)
        state.save(tmp_path)
        state.wait()
        again = dml.TrainState(b, model=torch.nn.Linear(2, 1), mask=torch.zeros(2, 3), sparse=torch.zeros(4))
        assert again.resume(tmp_path)
        assert torch.equal(again.mask, mask) and torch.equal(again.sparse.to_dense(), sparse.to_dense())

        broken = dml.TrainState(b, model=torch.nn.Linear(2, 1), bad=torch.zeros(2).as_subclass(Unreadable))
        with pytest.raises(RuntimeError, match="no copy of this one"):
            broken.save(tmp_path / "broken")
        dml.barrier(b)  # every rank raised: none waits for another

    dml.LocalBackend.spawn(2, body, timeout=60)


def test_an_unreadable_newest_checkpoint_falls_back_to_the_one_before(tmp_path: Path) -> None:
    def body(b: dml.Backend) -> int:
        state = _state(b)
        for step in (1, 2):
            state.step = step
            state.save(tmp_path)
        state.wait()
        if b.rank == 0:
            newest = tmp_path / "state-00000002.pt"
            newest.write_bytes(newest.read_bytes()[:-100])  # cut short (a disk that lost the end of it)
        dml.barrier(b)
        again = _state(b)
        with pytest.warns(UserWarning, match="state-00000002.pt is unreadable"):
            assert again.resume(tmp_path)
        return again.step

    assert dml.LocalBackend.spawn(1, body) == [1]  # one rank: warnings are caught per process, not per thread


def test_nothing_to_resume_returns_false(tmp_path: Path) -> None:
    assert dml.LocalBackend.spawn(2, lambda b: _state(b).resume(tmp_path / "none")) == [False, False]
    assert not (tmp_path / "none").exists()


def test_a_failed_write_is_raised_on_every_rank_at_the_next_save(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(state: object, path: str) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(ts, "write_atomic", broken)

    def body(b: dml.Backend) -> str:
        state = _state(b)
        state.save(tmp_path)  # returns: the write runs in the background
        with pytest.raises(OSError, match="No space left on device") as err:
            state.save(tmp_path)
        return str(err.value)

    messages = dml.LocalBackend.spawn(3, body)
    assert all("TrainState.save" in m and "rank 0" in m for m in messages), messages
    assert not list(tmp_path.glob("state-*.pt"))


def test_saves_run_in_the_background_and_never_overlap(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real = ts.write_atomic
    spans: list[tuple[float, float]] = []
    lock = threading.Lock()

    def slow(state: object, path: str) -> None:
        start = time.monotonic()
        time.sleep(0.3)
        real(state, path)
        with lock:
            spans.append((start, time.monotonic()))

    monkeypatch.setattr(ts, "write_atomic", slow)

    def body(b: dml.Backend) -> float:
        state = _state(b)
        start = time.monotonic()
        state.save(tmp_path)
        returned = time.monotonic() - start
        state._objects["model"].weight.data.add_(1.0)  # training goes on: the snapshot is not the live tensor
        state.save(tmp_path)
        state.wait()
        return returned

    returned = dml.LocalBackend.spawn(2, body)
    assert max(returned) < 0.25, returned  # the first save returned before its 0.3 s write
    first_write, second_write = sorted(spans)
    assert second_write[0] >= first_write[1], spans  # the second write started after the first ended
    first = torch.load(tmp_path / "state-00000001.pt", weights_only=True)
    second = torch.load(tmp_path / "state-00000002.pt", weights_only=True)
    assert torch.equal(second["model"]["weight"], first["model"]["weight"] + 1.0)


def test_save_if_due_every_n_calls_and_every_t_seconds(tmp_path: Path) -> None:
    def steps(b: dml.Backend) -> list[int]:
        state = _state(b, every_steps=3)
        return [k for k in range(1, 10) if state.save_if_due(tmp_path / "n")]

    assert dml.LocalBackend.spawn(2, steps) == [[3, 6, 9]] * 2

    def seconds(b: dml.Backend) -> list[int]:
        state = _state(b, every_seconds=0.2)
        due = []
        for k in range(8):
            if state.save_if_due(tmp_path / "t"):
                due.append(k)
            time.sleep(0.06)
        state.wait()
        return due

    due = dml.LocalBackend.spawn(2, seconds)
    assert due[0] == due[1] and 1 <= len(due[0]) <= 3, due  # rank 0's clock decides, for every rank


@pytest.mark.parametrize(
    ("kw", "error", "match"),
    [
        ({"keep": 0}, ValueError, "keep"),
        ({"every_steps": 0}, ValueError, "every_steps"),
        ({"every_seconds": -1}, ValueError, "every_seconds"),
        ({"save": 1}, ValueError, "names of the state itself"),
        ({"data": [1, 2]}, TypeError, "DistributedDataContainer"),
        ({"model": [torch.nn.Parameter(torch.ones(1))]}, TypeError, "model: got list; allowed: a torch.nn.Module"),
        ({"scheduler": 3}, TypeError, "scheduler: got int, which has no state_dict"),
    ],
)
def test_bad_arguments_raise_before_anything_is_sent(kw: dict[str, object], error: type, match: str) -> None:
    backend = dml.LocalBackend()
    with pytest.raises(error, match=match):
        dml.TrainState(backend, **kw)  # type: ignore[arg-type]


def test_user_values_are_attributes_and_come_back(tmp_path: Path) -> None:
    def body(b: dml.Backend) -> tuple[int, str]:
        state = _state(b, best=0.5, note="a")
        state.step, state.note = 7, "b"
        state.save(tmp_path)
        state.wait()
        again = _state(b, best=0.0, note="")
        again.resume(tmp_path)
        return again.step, again.note

    assert dml.LocalBackend.spawn(2, body) == [(7, "b")] * 2


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(1, 40), world=st.integers(1, 4), other=st.integers(1, 4), taken=st.integers(0, 12),
    shuffle=st.booleans(), drop_last=st.booleans(),
)  # fmt: skip
def test_an_epoch_resumed_part_way_holds_the_rest_once(  # noqa: PLR0917 - hypothesis's arguments
    n: int, world: int, other: int, taken: int, shuffle: bool, drop_last: bool
) -> None:
    data = np.arange(n)

    def shares(size: int, start: int) -> list[tuple[list[int], int]]:
        def body(b: dml.Backend) -> tuple[list[int], int]:
            ddc = dml.DistributedDataContainer(b, data, shuffle=shuffle, seed=1, drop_last=drop_last)
            ddc.set_epoch(2, start)
            return [int(ddc[i]) for i in range(len(ddc))], ddc.num_padded

        return dml.LocalBackend.spawn(size, body)

    whole = shares(world, 0)
    k = min(taken, len(whole[0][0]))  # each rank took its first k observations
    start = min(n, k * world)
    for (all_of_it, _), (rest, _) in zip(whole, shares(world, start), strict=True):
        if start < n:  # the same ranks: the rest of each one's own share, in order
            assert rest == all_of_it[k:], (all_of_it, k, rest)
    taken_ids = [i for mine, padded in whole for i in mine[: min(k, len(mine) - padded)]]
    rest = [i for mine, padded in shares(other, start) for i in mine[: len(mine) - padded]]
    combined = sorted(taken_ids + rest)
    assert len(combined) == len(set(combined)), (taken_ids, rest)  # nothing twice
    if not drop_last:
        assert combined == list(range(n)), (taken_ids, rest)  # nothing skipped (drop_last drops tails)


class _Versioned(torch.nn.Module):
    """A module whose state_dict format changed in version 2: version 1 stored ``w`` negated."""

    _version = 2

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.arange(3.0))

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, *args):  # type: ignore[no-untyped-def]
        if local_metadata.get("version", 1) < 2:  # a legacy checkpoint: convert it
            state_dict[prefix + "w"] = -state_dict[prefix + "w"]
        super()._load_from_state_dict(state_dict, prefix, local_metadata, *args)


def test_the_modules_versions_are_saved_so_loading_converts_nothing(tmp_path: Path) -> None:
    def body(b: dml.Backend) -> list[float]:
        state = dml.TrainState(b, model=_Versioned())
        state.save(tmp_path)
        state.wait()
        again = dml.TrainState(b, model=_Versioned())
        with torch.no_grad():
            again._objects["model"].w.zero_()
        assert again.resume(tmp_path)
        return again._objects["model"].w.tolist()

    assert dml.LocalBackend.spawn(2, body) == [[0.0, 1.0, 2.0]] * 2


@dataclasses.dataclass
class Point:
    """A class of the user's: torch.load(weights_only=True) refuses it unless allowed."""

    x: int = 1


def test_numpy_values_resume_and_a_value_resume_cannot_read_is_refused_when_saved(tmp_path: Path) -> None:
    def body(b: dml.Backend) -> list[object]:
        state = _state(b, best=np.float64(0.25), seen=np.arange(4, dtype=np.int32), tags=np.array(["a", "bc"]))
        state.save(tmp_path / "ok")
        state.wait()
        again = _state(b, best=None, seen=None, tags=None)
        assert again.resume(tmp_path / "ok")
        bad = _state(b, where={"points": [1, Point()]})
        with pytest.raises(ValueError, match=r"state\['extra'\]\['where'\]\['points'\]\[1\] \(Point\).*weights_only"):
            bad.save(tmp_path / "bad")
        return [again.best, again.seen.tolist(), again.tags.tolist(), type(again.best)]

    got = dml.LocalBackend.spawn(2, body)
    assert got == [[0.25, [0, 1, 2, 3], ["a", "bc"], np.float64]] * 2
    assert not list((tmp_path / "bad").glob("state-*.pt"))  # nothing written that cannot be resumed


@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step")  # a resumed epoch with no batch left
def test_a_save_after_the_epochs_batches_resumes_at_the_next_epoch(tmp_path: Path) -> None:
    """Saved inside the loop over batches (after its last batch), the epoch's closing code still runs once after
    resuming; saved after the loop (after that code), resuming starts the next epoch: each per-epoch scheduler step
    happens once either way, as in the uninterrupted run."""

    def run(b: dml.Backend, where: Path, inside: bool, stop: int | None, cap: int = 9) -> tuple[list[float], int]:
        torch.manual_seed(0)
        model = torch.nn.Linear(1, 1)
        opt = dml.DistributedOptimizer(b, torch.optim.SGD(model.parameters(), lr=1.0))
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        data = dml.DistributedDataContainer(b, torch.arange(8.0 * cap).reshape(-1, 1)[:8])
        loader = torch.utils.data.DataLoader(data, batch_size=2 if cap == 9 else 1)
        state = dml.TrainState(b, model=model, optimizer=opt, data=data, scheduler=sched, lrs=[], ends=0)
        state.resume(where)
        for epoch in state.epochs(3):
            for k, xb in enumerate(state.batches(loader)):
                if k == cap:  # steps per epoch capped: the loop is left by a break
                    break
                opt.zero_grad()
                model(xb).sum().backward()
                opt.step()
                state.lrs = [*state.lrs, opt.param_groups[0]["lr"]]
                if inside and len(state.lrs) % 2 == 0:
                    state.save(where)  # the last batch of the epoch
            sched.step()  # the epoch's closing code
            state.ends += 1
            if not inside:
                state.save(where)
            if epoch == stop:
                state.wait()
                return state.lrs, state.ends
        state.wait()
        return state.lrs, state.ends

    for inside, cap in ((True, 9), (False, 9), (False, 2)):
        where = tmp_path / f"inside-{inside}-{cap}"
        whole = dml.LocalBackend.spawn(2, run, tmp_path / f"whole-{inside}-{cap}", inside, None, cap)
        dml.LocalBackend.spawn(2, run, where, inside, 0, cap)
        if inside:  # as if the run had died between the save and the epoch's closing code
            newest = sorted(where.glob("state-*.pt"))[-1]
            for old in sorted(where.glob("state-*.pt"))[:-1]:
                old.unlink()
            assert newest.exists()
        resumed = dml.LocalBackend.spawn(2, run, where, inside, None, cap)
        assert resumed == whole, (inside, cap, resumed, whole)
        assert whole[0] == ([1.0] * 2 + [0.5] * 2 + [0.25] * 2, 3), whole
        again = dml.LocalBackend.spawn(2, run, where, inside, None, cap)  # a run saved at its end: nothing left
        assert again == whole, (inside, cap, again, whole)


def test_epochs_set_by_hand_and_a_loop_over_batches_inside_another(tmp_path: Path) -> None:
    def body(b: dml.Backend) -> tuple[dict[str, int], list[int]]:
        data = dml.DistributedDataContainer(b, torch.arange(8.0).reshape(8, 1))
        loader = torch.utils.data.DataLoader(data, batch_size=2)
        state = dml.TrainState(b, data=data)
        for epoch in range(2):  # the container's epochs set by hand, not by state.epochs
            data.set_epoch(epoch)
            if epoch == 1:
                state.save(tmp_path)  # before the epoch's first batch: the epoch is still all to do
            for _ in state.batches(loader):
                with pytest.raises(RuntimeError, match="already running"):
                    next(iter(state.batches(loader)))
        state.wait()
        again = dml.TrainState(b, data=dml.DistributedDataContainer(b, torch.arange(8.0).reshape(8, 1)))
        assert again.resume(tmp_path)
        return {"epoch": again.epoch, "start": again.start}, [again.epoch for _ in again.epochs(2)]

    assert dml.LocalBackend.spawn(2, body) == [({"epoch": 1, "start": 0}, [1])] * 2


def test_what_a_save_holds_is_the_state_at_the_call(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """NumPy arrays, sets and bytearrays among the values are copied at the call, as tensors are: the write runs
    later (slowed here), while training changes them."""
    real = ts.write_atomic

    def slow(state: object, path: str) -> None:
        time.sleep(0.3)
        real(state, path)

    monkeypatch.setattr(ts, "write_atomic", slow)

    def body(b: dml.Backend) -> list[object]:
        state = _state(b, hist=np.zeros(3), ids={1}, raw=bytearray(b"a"))
        state.save(tmp_path)
        state.hist[:] = 9.0
        state.ids.add(2)
        state.raw[:] = b"z"
        state.wait()
        again = _state(b, hist=None, ids=None, raw=None)
        assert again.resume(tmp_path)
        return [again.hist.tolist(), again.ids, bytes(again.raw)]

    assert dml.LocalBackend.spawn(2, body) == [[[0.0, 0.0, 0.0], {1}, b"a"]] * 2


def test_inside_join_a_rank_that_writes_after_a_joined_one_takes_the_next_number(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = ts.write_atomic

    def slow(state: object, path: str) -> None:
        if path.endswith("state-00000001.pt"):
            time.sleep(0.5)  # still writing when its rank has joined and another writes the next one
        real(state, path)

    monkeypatch.setattr(ts, "write_atomic", slow)

    def body(b: dml.Backend) -> int:
        model = torch.nn.Linear(2, 1)
        opt = dml.DistributedOptimizer(b, torch.optim.SGD(model.parameters(), lr=0.1))
        state = dml.TrainState(b, model=model, optimizer=opt, step=0)
        with dml.join(b, opt, model):
            for _ in range(1 + b.rank):
                opt.zero_grad()
                model(torch.ones(1, 2)).sum().backward()
                opt.step()
                state.step += 1
                state.save(tmp_path)
        state.wait()
        again = dml.TrainState(b, model=torch.nn.Linear(2, 1), step=0)
        assert again.resume(tmp_path)
        return again.step

    # A save after a rank left cannot learn that rank's own values: it says so, once.
    with pytest.warns(UserWarning, match=r"TrainState.save inside dml.join after rank\(s\) \[0\] left the loop"):
        assert dml.LocalBackend.spawn(2, body) == [2, 2]
    assert _files(tmp_path) == ["state-00000001.pt", "state-00000002.pt"]


def test_a_value_that_cannot_be_pickled_is_named(tmp_path: Path) -> None:
    def body(b: dml.Backend) -> None:
        state = _state(b, hook=(lambda: 1) if b.rank == 1 else 0)
        with pytest.raises(TypeError, match=r"state\['extra'\]\['hook'\] cannot be saved: .*pickle.*\(on rank 1\)"):
            state.save(tmp_path)

    dml.LocalBackend.spawn(2, body)


def test_values_and_buffers_that_differ_by_rank_come_back_to_each_rank(tmp_path: Path) -> None:
    def body(b: dml.Backend) -> tuple[object, ...]:
        model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.BatchNorm1d(2))
        opt = dml.DistributedOptimizer(b, torch.optim.SGD(model.parameters(), lr=0.1))
        odd = torch.tensor([1j, float(b.rank)]).conj()  # a conjugate view: its digest resolves the bit
        state = dml.TrainState(b, model=model, optimizer=opt, step=5, seen=[b.rank] * (b.rank + 1), odd=odd)
        model.train()
        model(torch.randn(4, 2, generator=torch.Generator().manual_seed(b.rank)))  # rank-local running statistics
        mean = model[1].running_mean.clone()
        state.save(tmp_path)
        state.wait()
        fresh = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.BatchNorm1d(2))
        again = dml.TrainState(b, model=fresh, step=0, seen=None, odd=None)
        assert again.resume(tmp_path)
        back = (again.step, again.seen, torch.equal(fresh[1].running_mean, mean), int(fresh[1].num_batches_tracked))
        return (*back, again.odd.tolist())

    got = dml.LocalBackend.spawn(3, body)
    assert got == [(5, [r] * (r + 1), True, 1, [-1j, complex(r)]) for r in range(3)], got

    def elsewhere(b: dml.Backend) -> object:
        again = dml.TrainState(
            b, model=torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.BatchNorm1d(2)), seen=0, odd=None
        )
        with pytest.warns(UserWarning, match=r"buffer/1.running_mean, buffer/1.running_var, extra/odd, extra/seen"):
            again.resume(tmp_path)
        return again.seen

    assert dml.LocalBackend.spawn(1, elsewhere) == [[0]]  # another world size: rank 0's


@pytest.mark.parametrize("how", ["dml.save", "TrainState"])
def test_a_slow_write_is_not_taken_for_a_stall_on_simulated_ranks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    """A write that takes longer than the stall timeout (slow storage): the ranks waiting for the writer count it
    inside the collective, as an MPI job's watchdog does (TrainState waited for its writer outside any)."""
    import distutils_ml.checkpoint as ck

    for module in (ck, ts):
        real = module.write_atomic
        monkeypatch.setattr(module, "write_atomic", lambda *a, _real=real, **k: (time.sleep(1.5), _real(*a, **k))[1])

    def body(backend: dml.Backend) -> int:
        model = torch.nn.Linear(2, 1)
        if how == "dml.save":
            dml.save(backend, {"m": model.state_dict()}, str(tmp_path / "slow.pt"))
            return 1
        state = dml.TrainState(backend, model=model, step=0)
        state.save(tmp_path / "ck")
        state.save(tmp_path / "ck")  # waits for the first write first
        state.wait()
        return state.saves

    assert dml.LocalBackend.spawn(2, body, stall_timeout=0.5, timeout=60) == ([1, 1] if how == "dml.save" else [2, 2])
