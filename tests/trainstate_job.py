"""The MPI job of tests/test_trainstate.py: ``mpiexec -n N python tests/trainstate_job.py CHECK...`` (in turn).

- ``exact``: hypothesis over the step a run is cut at (with dropout, shuffling, DataLoader workers, a sharded
  optimizer, saving every few steps): a run cut there, then resumed from its TrainState by a fresh build in the
  same job, ends with the parameters of the uninterrupted run, bit for bit.
- ``cut=DIR``: for each of several steps, a fresh run is cut there and saved to ``DIR/<step>``; it writes the
  sample indices each rank took in the cut epoch and the saved parameters to ``DIR/<step>/before.json``.
- ``resume=DIR``: on this (other) number of ranks, resumes each ``DIR/<step>``, checks the parameters are those
  saved, finishes the cut epoch, and writes the indices each rank took (padding left out) to
  ``DIR/<step>/after-<rank>.json``.

Rank 0 ends with ``TRAINSTATE CHECKS PASSED``.
"""

from __future__ import annotations

import faulthandler
import json
import os
import shutil
import signal
import sys
import tempfile
import warnings
from dataclasses import dataclass
from typing import Any

import torch
from hypothesis import strategies as st

import distutils_ml as dml

from mpi_main import hypothesis_check, run_checks

N = 38  # observations: not a multiple of 2 or 3, so the shares are padded
EPOCHS = 3


class Indexed(torch.utils.data.Dataset):
    """Observation i: (features, i): the batches say which observations they hold."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(5)
        self.x = torch.randn(N, 4, generator=g)

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i], torch.tensor(i)


@dataclass(frozen=True)
class Case:
    stop: int
    batch: int
    shuffle: bool
    dropout: bool
    workers: int
    sharded: bool
    adam: bool
    every: int


@st.composite
def cases(draw: st.DrawFn) -> Case:
    batch = draw(st.integers(2, 5))
    steps = EPOCHS * -(-19 // batch)  # the steps of the largest share (2 ranks: 19 observations)
    return Case(
        stop=draw(st.integers(1, steps)),
        batch=batch,
        shuffle=draw(st.booleans()),
        dropout=draw(st.booleans()),
        workers=draw(st.sampled_from([0, 0, 1])),
        sharded=draw(st.booleans()),
        adam=draw(st.booleans()),
        every=draw(st.integers(1, 4)),
    )


def build(world: dml.Backend, case: Case) -> tuple[dml.TrainState, Any]:
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = [torch.nn.Linear(4, 8), torch.nn.ReLU()]
    if case.dropout:
        layers.append(torch.nn.Dropout(0.3))
    model = dml.synchronize(world, torch.nn.Sequential(*layers, torch.nn.Linear(8, 1)))
    inner = (torch.optim.Adam(model.parameters(), lr=1e-2) if case.adam
             else torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9))  # fmt: skip
    opt = dml.DistributedOptimizer(world, inner, shard_state=case.sharded)
    data = dml.DistributedDataContainer(world, Indexed(), shuffle=case.shuffle, seed=3)
    loader = torch.utils.data.DataLoader(data, batch_size=case.batch, num_workers=case.workers,
                                         generator=torch.Generator())  # fmt: skip
    state = dml.TrainState(world, model=model, optimizer=opt, data=data, every_steps=case.every, step=0, seen=[])
    torch.manual_seed(100 + world.rank)  # each rank's own dropout masks
    return state, loader


def train(state: dml.TrainState, loader: Any, directory: str, stop: int | None = None) -> torch.Tensor | None:
    """Train to the end (None: return the parameters), or to ``stop`` steps (save there, return None)."""
    model = state._objects["model"]
    opt = state._objects["optimizer"]
    for epoch in state.epochs(EPOCHS):
        for xb, ib in state.batches(loader):
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(xb), xb[:, :1]).backward()
            opt.step()
            state.step += 1
            state.seen = [*state.seen, (epoch, ib.tolist())]
            state.save_if_due(directory)
            if state.step == stop:
                state.save(directory)
                state.wait()
                return None
    state.wait()
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def exact_body(world: dml.Backend, case: Case) -> None:
    root = dml.bcast_object(world, tempfile.mkdtemp(prefix="dml-ts-") if world.rank == 0 else None)
    _exact(world, case, root)
    dml.barrier(world)  # every rank is done with the checkpoints (a failed example leaves them to look at)
    if world.rank == 0:
        shutil.rmtree(root)


def _exact(world: dml.Backend, case: Case, root: str) -> None:
    whole = train(*build(world, case), os.path.join(root, "whole"))
    assert whole is not None
    cut, loader = build(world, case)
    if train(cut, loader, os.path.join(root, "cut"), stop=case.stop) is not None:
        return  # the run ended before the cut
    total = cut.step
    resumed, loader = build(world, case)
    torch.manual_seed(999)  # whatever streams the new process has
    assert resumed.resume(os.path.join(root, "cut")), "nothing to resume"
    assert resumed.step == total, (resumed.step, total)
    again = train(resumed, loader, os.path.join(root, "cut"))
    assert again is not None and torch.equal(again, whole), (case, (again - whole).abs().max())


def cut(world: dml.Backend, directory: str) -> None:
    case = Case(stop=0, batch=3, shuffle=True, dropout=True, workers=0, sharded=True, adam=True, every=1000)
    share = len(dml.DistributedDataContainer(world, Indexed()))
    per_epoch = -(-share // case.batch)
    for stop in (1, per_epoch + 2, 2 * per_epoch + per_epoch // 2):  # inside epochs 0, 1 and 2
        state, loader = build(world, case)
        where = os.path.join(directory, str(stop))
        train(state, loader, where, stop=stop)
        epoch = state.epoch
        mine = [i for e, ids in state.seen if e == epoch for i in ids]
        every = dml.allgather_object(world, mine)
        params = [p.detach().reshape(-1).tolist() for p in state._objects["model"].parameters()]
        if world.rank == 0:
            with open(os.path.join(where, "before.json"), "w") as f:
                json.dump({"epoch": epoch, "seen": every, "params": params, "ranks": world.size}, f)


def resume(world: dml.Backend, directory: str) -> None:
    case = Case(stop=0, batch=3, shuffle=True, dropout=True, workers=0, sharded=True, adam=True, every=1000)
    for stop in sorted(os.listdir(directory), key=int):
        where = os.path.join(directory, stop)
        with open(os.path.join(where, "before.json")) as f:
            before = json.load(f)
        state, loader = build(world, case)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert state.resume(where)
        assert any("resumed on" in str(w.message) for w in caught), [str(w.message) for w in caught]
        params = [p.detach().reshape(-1).tolist() for p in state._objects["model"].parameters()]
        assert params == before["params"], "the resumed parameters are not the saved ones"
        assert state.epoch == before["epoch"], (state.epoch, before["epoch"])
        data = state._data
        taken: list[int] = []
        for epoch in state.epochs(state.epoch + 1):  # the rest of the cut epoch only
            for xb, ib in state.batches(loader):
                opt = state._objects["optimizer"]
                opt.zero_grad()
                torch.nn.functional.mse_loss(state._objects["model"](xb), xb[:, :1]).backward()
                opt.step()  # the resharded optimizer steps
                taken += ib.tolist()
            keep = len(data) - data.num_padded  # the share's padding (its last observations) left out
            assert epoch == before["epoch"]
            taken = taken[:keep]
        with open(os.path.join(where, f"after-{world.rank}.json"), "w") as f:
            json.dump(taken, f)


def main(names: list[str]) -> None:
    faulthandler.register(signal.SIGUSR1)
    torch.set_num_threads(1)
    dml.initialize(dml.MPIBackend)
    world = dml.get_distributed_backend(dml.MPIBackend)
    checks = {
        "exact": lambda _: hypothesis_check(world, exact_body, cases(), 12),
        "cut": lambda directory: cut(world, directory),
        "resume": lambda directory: resume(world, directory),
    }

    def run_check(name: str) -> Any:
        check, _, directory = name.partition("=")
        return checks[check](directory)

    run_checks(world, names, "TRAINSTATE CHECKS PASSED", run_check)


if __name__ == "__main__":
    main(sys.argv[1:])
