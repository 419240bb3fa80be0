"""The MPI jobs of tests/test_checkpoint.py, and test bodies shared with its LocalBackend tests.

Run: ``mpiexec -n N python tests/checkpoint_job.py MODE ARGS... [MODE ARGS...]`` (the modes in turn, in one job)
where MODE is

- ``straight CHECKPOINT OUT``: train 10 steps;
- ``first-half CHECKPOINT OUT``: train 5 steps, then ``save`` everything to CHECKPOINT;
- ``second-half CHECKPOINT OUT``: build everything anew, ``load`` CHECKPOINT, restore, train the last 5 steps.

  The training touches every piece of state a resume must restore: Adam's moments
  (inside a DistributedOptimizer), a shuffled DistributedDataContainer read by a
  StatefulDataLoader (the checkpoint falls mid-epoch, the resumed run crosses into the
  next epoch), and three random streams that differ across ranks (torch: dropout;
  NumPy: input noise; Python's random: a loss scale). Rank 0 writes OUT: the model's and
  optimizer's state and the losses of this job's steps, for the test to compare bitwise.
- ``resume DIR OUT``: the exact-resume recipe against the one the docs gave before, with
  DataLoader workers (persistent or not), a checkpoint at an epoch boundary (plain
  DataLoader) and mid-epoch (StatefulDataLoader); rank 0 writes OUT: per case, whether the
  resumed run is bitwise the uninterrupted one. Also :func:`rng_helpers` and
  :func:`corrupted_load`, whose problems OUT lists too.
- ``slow DIR``: on a backend of its own with ``timeout=2``, ``save`` of an object whose pickling
  takes 3 s and ``load`` of one whose unpickling takes 3 s: rank 0 reads and writes inside the
  collective, so the job must not be ended as a stall. Prints ``SLOW OK`` at the end.
"""

from __future__ import annotations

import faulthandler
import os
import random
import signal
import sys
import time
import warnings
import zipfile
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

import distutils_ml as dml
from distutils_ml import checkpoint as dml_checkpoint  # new names looked up when called: "slow" runs on old code
from distutils_ml.checkpoint import load, rng_state, save, set_rng_state

STEPS = 10
HALF = 5
SLOW_S = 3.0  # longer than the slow job's timeout of 2 s


# -- straight / first-half / second-half: a resume in a fresh job ----------------------------


def build(backend: dml.Backend) -> tuple[torch.nn.Module, dml.DistributedOptimizer, Any, Any]:
    """Model, optimizer, data and loader, built the same way by every job."""
    from torchdata.stateful_dataloader import StatefulDataLoader

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 16), torch.nn.ReLU(), torch.nn.Dropout(0.3), torch.nn.Linear(16, 2))
    model = dml.synchronize(backend, model)
    opt = dml.DistributedOptimizer(backend, torch.optim.Adam(model.parameters(), lr=0.01))
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(64, 3, generator=g), torch.randn(64, 2, generator=g)
    ddc = dml.DistributedDataContainer(backend, (x, y), shuffle=True, seed=7)  # 32 per rank: 8 batches an epoch
    # The loader's own generator: starting an epoch then draws nothing from the global RNG.
    loader = StatefulDataLoader(ddc, batch_size=4, generator=torch.Generator())
    rank = dml.local_rank(backend)
    torch.manual_seed(1000 + rank)
    np.random.seed(2000 + rank)
    random.seed(3000 + rank)
    return model, opt, ddc, loader


def batches(ddc: Any, loader: Any) -> Iterator[Any]:
    """Batches forever, epoch after epoch, from the container's current epoch on."""
    epoch = ddc.epoch
    while True:
        ddc.set_epoch(epoch)
        yield from loader
        epoch += 1


def step_loss(model: torch.nn.Module, opt: dml.DistributedOptimizer, xb: torch.Tensor, yb: torch.Tensor) -> float:
    """One training step drawing from all three random streams; its loss."""
    xb = xb + 0.01 * torch.from_numpy(np.random.standard_normal(tuple(xb.shape))).float()
    loss = torch.nn.functional.mse_loss(model(xb), yb) * random.uniform(0.9, 1.1)
    opt.zero_grad()
    loss.backward()
    opt.step()
    return loss.item()


def halves(mode: str, checkpoint: str, out: str) -> None:
    backend = dml.get_distributed_backend(dml.MPIBackend)
    size = dml.total_workers(backend)
    model, opt, ddc, loader = build(backend)
    step, stop = 0, {"straight": STEPS, "first-half": HALF, "second-half": STEPS}[mode]
    if mode == "second-half":
        ckpt = load(backend, checkpoint)
        model.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["opt"])
        ddc.set_epoch(ckpt["data"]["epoch"])
        loader.load_state_dict(ckpt["loader"])
        step = ckpt["step"]
        dml_checkpoint.set_rng_state_all(backend, ckpt["rng"])
    model.train()
    losses = []
    stream = batches(ddc, loader)
    while step < stop:
        xb, yb = next(stream)
        losses.append(step_loss(model, opt, xb, yb))
        step += 1
    if mode == "first-half":
        state = {"model": model, "opt": opt, "data": ddc, "loader": loader, "step": step}
        save(backend, {**state, "rng": dml_checkpoint.rng_state_all(backend)}, checkpoint)
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    every = torch.empty(size, flat.numel())
    dml.allgather(backend, flat, every)
    assert bool((every == every[0]).all()), "replicas differ"
    save(backend, {"model": model, "opt": opt, "losses": losses, "epoch": ddc.epoch}, out)
    dml.print(backend, f"{mode}: {len(losses)} steps, now at step {step} of epoch {ddc.epoch}", all_ranks=False)


# -- RNG helpers: one body for LocalBackend and MPI --------------------------------------------


def seed_all(seed: int) -> None:
    torch.manual_seed(seed)
    np.random.seed(seed)
    random.seed(seed)


def draws() -> list[Any]:
    """Numbers from all three streams, as plain values (tensors as lists)."""
    return [torch.rand(3).tolist(), np.random.standard_normal(2).tolist(), random.random(), random.gauss(0, 1)]


def same_state(a: Any, b: Any) -> bool:
    """Equality of RNG states (nested dicts and lists of tensors and plain values)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same_state(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(map(same_state, a, b))
    return bool(a == b)


def outcome(fn: Any) -> tuple[str, str]:
    """``fn()``'s exception as (class name, message), or ("ok", "")."""
    try:
        fn()
    except Exception as exc:
        return type(exc).__name__, str(exc)
    return "ok", ""


def in_turn(backend: dml.Backend, fn: Any) -> Any:
    """``fn()`` on each rank, one rank after the other (simulated ranks share one process's generators)."""
    result = None
    for r in range(dml.total_workers(backend)):
        dml.barrier(backend)
        if dml.local_rank(backend) == r:
            result = fn()
    dml.barrier(backend)
    return result


def rng_helpers(backend: dml.Backend) -> list[str]:
    """Check ``rng_state_all`` / ``set_rng_state_all``; return the problems found (none: an empty list)."""
    rank, size = dml.local_rank(backend), dml.total_workers(backend)
    problems: list[str] = []

    def prepare() -> None:
        seed_all(100 + rank)
        draws()  # leaves cached Gaussians in NumPy's and Python's generators

    if isinstance(backend, dml.LocalBackend):
        # One process: every entry is the same, the process's state at the call.
        seed_all(5)
        states = dml_checkpoint.rng_state_all(backend)
        if not all(same_state(s, rng_state()) for s in states):
            problems.append("rng_state_all on simulated ranks: an entry is not the process's state")
        mine, expected = in_turn(backend, lambda: (prepare(), rng_state(), draws())[1:])
        states = dml.allgather_object(backend, mine)
    else:
        prepare()
        states = dml_checkpoint.rng_state_all(backend)  # each rank's state, gathered in one call
        mine, expected = rng_state(), draws()
    if len(states) != size or not same_state(states[rank], mine):
        problems.append(f"rank {rank}: rng_state_all()[{rank}] is not this rank's state")
    if size > 1 and same_state(states[0], states[1]):
        problems.append("rng_state_all: ranks 0 and 1 have the same state")

    def restore() -> list[Any]:
        seed_all(999)
        dml_checkpoint.set_rng_state_all(backend, states)
        return draws()

    if in_turn(backend, restore) != expected:
        problems.append(f"rank {rank}: set_rng_state_all did not restore this rank's streams")

    seed_all(7)
    before = rng_state()
    broken = [dict(s) for s in states]
    del broken[-1]["python"]
    set_all = dml_checkpoint.set_rng_state_all
    bad_calls = {
        "short": (lambda: set_all(backend, states[:-1]), "ValueError", f"got {size - 1} states for {size}"),
        "long": (lambda: set_all(backend, [*states, states[0]]), "ValueError", f"got {size + 1} states"),
        "not a list": (lambda: set_all(backend, states[0]), "TypeError", "states: got dict"),
        "bad entry": (lambda: set_all(backend, [*states[:-1], 3]), "TypeError", f"states[{size - 1}]"),
        "missing key": (lambda: set_all(backend, broken), "ValueError", "missing keys ['python']"),
        "not a backend": (lambda: set_all(dml.MPIBackend, states), "TypeError", "backend"),
    }
    seen = {name: outcome(call) for name, (call, _, _) in bad_calls.items()}
    for name, (_, kind, words) in bad_calls.items():
        got_kind, message = seen[name]
        if got_kind != kind or words not in message:
            problems.append(f"rank {rank}: set_rng_state_all, {name}: got {got_kind}: {message}")
    if not same_state(rng_state(), before):
        problems.append(f"rank {rank}: a refused set_rng_state_all changed the random streams")
    if outcome(lambda: dml_checkpoint.rng_state_all(None))[0] != "TypeError":
        problems.append("rng_state_all(None) is not a TypeError")
    every = dml.allgather_object(backend, seen)
    if any(s != every[0] for s in every):
        problems.append(f"set_rng_state_all's errors differ across ranks: {every}")
    return problems


# -- a corrupted checkpoint: one body for LocalBackend and MPI -----------------------------------


def record_spans(path: str) -> dict[str, tuple[int, int]]:
    """Where the bytes of each record of the checkpoint (a zip) lie in the file: name -> (start, end)."""
    spans = {}
    with zipfile.ZipFile(path) as archive, open(path, "rb") as f:
        for info in archive.infolist():
            f.seek(info.header_offset)
            header = f.read(30)  # a zip local file header: name and extra-field lengths at 26 and 28
            start = info.header_offset + 30 + sum(int.from_bytes(header[k : k + 2], "little") for k in (26, 28))
            spans[info.filename] = (start, start + info.compress_size)
    return spans


def flip(path: str, position: int, mask: int = 0x10) -> None:
    """XOR one byte of the file at ``path`` with ``mask``."""
    with open(path, "r+b") as f:
        f.seek(position)
        byte = f.read(1)[0]
        f.seek(position)
        f.write(bytes([byte ^ mask]))


def corrupted_load(backend: dml.Backend, directory: str) -> list[str]:
    """A flipped bit in a tensor of a saved checkpoint: ``load`` raises on every rank; the problems found."""
    path = os.path.join(directory, "corrupted.pt")
    save(backend, {"w": torch.arange(256.0), "step": 3}, path)
    if dml.local_rank(backend) == 0:
        start, end = next(span for name, span in record_spans(path).items() if name.endswith("/data/0"))
        flip(path, (start + end) // 2)
    dml.barrier(backend)
    kind, message = outcome(lambda: load(backend, path))
    problems = []
    if kind != "RuntimeError" or "the file is corrupted" not in message or "Bad CRC-32" not in message:
        problems.append(f"rank {dml.local_rank(backend)}: load of a corrupted file: {kind}: {message}")
    if f"load: could not read the checkpoint {path!r}: rank 0: RuntimeError:" not in message:
        problems.append(f"rank {dml.local_rank(backend)}: the error does not name the file: {message}")
    every = dml.allgather_object(backend, (kind, message))
    if any(e != every[0] for e in every):
        problems.append(f"ranks raise different errors: {every}")
    return problems


# -- resume: the exact recipe against the one the docs gave -----------------------------------

EPOCHS = 3
# (name, loader class name, persistent_workers, where the checkpoint falls: epoch, batches done in it)
CASES = [
    ("epoch boundary", "DataLoader", False, (2, 0)),
    ("epoch boundary, persistent workers", "DataLoader", True, (2, 0)),
    ("mid-epoch", "StatefulDataLoader", False, (1, 3)),
    ("mid-epoch, persistent workers", "StatefulDataLoader", True, (1, 3)),
]


def resume_build(backend: dml.Backend, loader_class: str, persistent: bool, recipe: str) -> tuple[Any, ...]:
    """Model with dropout, optimizer, a shuffled container and a loader with 2 workers."""
    from torch.utils.data import DataLoader
    from torchdata.stateful_dataloader import StatefulDataLoader

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 16), torch.nn.ReLU(), torch.nn.Dropout(0.5), torch.nn.Linear(16, 2))
    model = dml.synchronize(backend, model)
    opt = dml.DistributedOptimizer(backend, torch.optim.Adam(model.parameters(), lr=0.01))
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(40, 3, generator=g), torch.randn(40, 2, generator=g)
    ddc = dml.DistributedDataContainer(backend, (x, y), shuffle=True, seed=7)
    options: dict[str, Any] = {"batch_size": 4, "num_workers": 2, "persistent_workers": persistent}
    if recipe == "exact":
        options["generator"] = torch.Generator()  # creating an iterator draws from it, not from the global RNG
    loader = (DataLoader if loader_class == "DataLoader" else StatefulDataLoader)(ddc, **options)
    return model, opt, ddc, loader


def resume_run(
    backend: dml.Backend, case: tuple[Any, ...], recipe: str, path: str, part: str
) -> tuple[list[float], dict[str, Any]]:
    """``part``: "whole" (uninterrupted), "first" (to the checkpoint, then save) or "rest" (load, then on)."""
    _, loader_class, persistent, (stop_epoch, stop_batch) = case
    rank = dml.local_rank(backend)
    model, opt, ddc, loader = resume_build(backend, loader_class, persistent, recipe)
    seed_all(1000 + rank)
    epoch = 0
    if part == "rest":
        seed_all(5000 + rank)  # a fresh process's streams: the checkpoint must replace them
        ckpt = load(backend, path)
        model.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["opt"])
        epoch = ckpt["data"]["epoch"]
        ddc.set_epoch(epoch)
        if "loader" in ckpt:
            loader.load_state_dict(ckpt["loader"])
        if recipe == "exact":
            dml_checkpoint.set_rng_state_all(backend, ckpt["rng"])
        else:  # what docs/reliability.md said: this rank's state, restored before the loader's iterator exists
            set_rng_state(ckpt["rng"][rank])
    losses: list[float] = []
    while epoch < EPOCHS:
        ddc.set_epoch(epoch)
        for batch, (xb, yb) in enumerate(loader, start=1):
            losses.append(step_loss(model, opt, xb, yb))
            if part == "first" and (epoch, batch) == (stop_epoch, stop_batch):
                state = {"model": model, "opt": opt, "data": ddc, "loader": loader}
                save(backend, {**state, "rng": dml_checkpoint.rng_state_all(backend)}, path)
                return losses, model.state_dict()
        epoch += 1
        if part == "first" and (epoch, 0) == (stop_epoch, stop_batch):  # at the boundary: no loader state
            ddc.set_epoch(epoch)  # the epoch to resume at
            save(backend, {"model": model, "opt": opt, "data": ddc, "rng": dml_checkpoint.rng_state_all(backend)}, path)
            return losses, model.state_dict()
    return losses, model.state_dict()


def resume(directory: str, out: str) -> None:
    backend = dml.get_distributed_backend(dml.MPIBackend)
    results: dict[str, Any] = {"rng_helpers": rng_helpers(backend), "corrupted": corrupted_load(backend, directory)}
    for case in CASES:
        for recipe in ("exact", "old docs"):
            path = os.path.join(directory, "resume.pt")
            whole, final = resume_run(backend, case, recipe, path, "whole")
            first, _ = resume_run(backend, case, recipe, path, "first")
            rest, resumed = resume_run(backend, case, recipe, path, "rest")
            exact = first + rest == whole and all(torch.equal(resumed[k], v) for k, v in final.items())
            gap = max(float((resumed[k] - v).abs().max()) for k, v in final.items())
            verdicts = dml.allgather_object(backend, (exact, gap, len(first), len(rest)))
            results[f"{case[0]} / {recipe}"] = verdicts
    if dml.local_rank(backend) == 0:
        torch.save(results, out)
    dml.print(backend, f"resume: {len(CASES)} cases on {dml.total_workers(backend)} ranks", all_ranks=False)


# -- slow: reading and writing inside the collective ------------------------------------------


def slow_value(value: int) -> int:
    """Unpickling a SlowPickle calls this: a read that takes longer than the stall timeout."""
    time.sleep(SLOW_S)
    return value


class SlowPickle:
    """An object whose pickling (a write) and unpickling (a read) each take ``SLOW_S`` seconds."""

    def __init__(self, value: int) -> None:
        self.value = value

    def __reduce__(self) -> tuple[Any, tuple[int]]:
        time.sleep(SLOW_S)
        return slow_value, (self.value,)


def slow(directory: str) -> None:
    backend = dml.MPIBackend(timeout=2)  # the job's other modes keep the default timeout
    assert backend.timeout == 2, backend.timeout
    path = os.path.join(directory, "slow.pt")
    start = time.monotonic()
    save(backend, {"slow": SlowPickle(42), "w": torch.arange(3)}, path)
    wrote = time.monotonic() - start
    got = load(backend, path, weights_only=False)  # rank 0 takes SLOW_S s to unpickle it
    read = time.monotonic() - start - wrote
    assert got["slow"] == 42 and torch.equal(got["w"], torch.arange(3)), got
    assert min(wrote, read) >= SLOW_S, (wrote, read)
    dml.barrier(backend)
    dml.print(backend, f"SLOW OK: wrote in {wrote:.1f} s, read in {read:.1f} s with timeout=2")


#: The modes and how many arguments each takes.
MODES = {"straight": 2, "first-half": 2, "second-half": 2, "resume": 2, "slow": 1}


def main(argv: list[str]) -> None:
    faulthandler.register(signal.SIGUSR1)  # the test runner asks for stacks before killing a hung job
    warnings.filterwarnings("ignore", message="This DataLoader will create")  # 2 workers on a 1-core share
    warnings.filterwarnings("ignore", message="'set_vital' is deprecated")  # torchdata 0.11 on torch 2.13
    runs = []
    while argv:
        mode = argv[0]
        if mode not in MODES or len(argv) <= MODES[mode]:
            raise SystemExit(f"bad mode {mode!r} or too few arguments; allowed: {MODES} (mode: number of arguments)")
        runs.append((mode, argv[1 : 1 + MODES[mode]]))
        argv = argv[1 + MODES[mode] :]
    dml.initialize(dml.MPIBackend)
    for mode, args in runs:
        if mode in ("straight", "first-half", "second-half"):
            halves(mode, *args)
        elif mode == "resume":
            resume(*args)
        else:
            slow(*args)


if __name__ == "__main__":
    main(sys.argv[1:])
