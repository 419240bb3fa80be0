"""``TrainState``: everything a run needs to resume, saved in the background and resumed in one call.

One object holds the model, the optimizer (unsharded or sharded), an LR scheduler and a ``GradScaler``, the
data position (the container's epoch and how far into it the ranks got), every rank's random number generator
states and the user's own values (the step, say: they are its attributes). In a training script::

    state = dml.TrainState(backend, model=model, optimizer=opt, data=ddc, every_steps=50, step=0)
    state.resume("checkpoints")                   # True when it resumed
    for epoch in state.epochs(EPOCHS):            # from the saved epoch on
        for xb, yb in state.batches(loader):      # the rest of the saved epoch first
            ...
            state.step += 1
            state.save_if_due("checkpoints")      # every 50 steps

The data position is counted, not asked of the loader: :meth:`TrainState.batches` counts the batches each rank
takes from its loader (which must read the container in order, ``shuffle=False``, as the container asks), so
after b batches of B each rank consumed its first ``k = min(b * B, len(share))`` observations of the epoch, and
those are the first ``k * W`` positions of the epoch's index list (rank r holds positions r, r + W, ...). A
resumed run calls ``data.set_epoch(epoch, start)`` with that number: at the same world size every rank gets the
rest of its own share, batch for batch as the uninterrupted run; at another, the rest of the epoch split over the
new ranks, each observation once.

Saving: the collectives (every rank's RNG states, a sharded optimizer's consolidated state) run at the call;
rank 0 then copies the state to host memory and a writer thread writes it (``torch.save`` with CRC-32s to a
temporary file, fsync, rename) while training goes on. A save waits for the previous write first, so two never
overlap; a failed write is raised on every rank at the next save (or :meth:`TrainState.wait`). A crash mid-write
leaves the earlier checkpoints as they were: files are ``state-<n>.pt`` in the directory, the newest ``keep``
are kept, and :meth:`TrainState.resume` takes the newest that reads back whole (CRC-checked), falling back to
older ones.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import io
import json
import os
import pickle
import re
import threading
import time
import warnings
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch

from distutils_ml.backends.base import Backend, check_backend
from distutils_ml.checkpoint import (
    DESCEND,
    check_path,
    check_resumable,
    consolidated_states,
    load,
    rebuilds,
    rebuilt,
    state_of,
    write_atomic,
)
from distutils_ml.data import DistributedDataContainer
from distutils_ml.objects import allgather_object, bcast_object, run_on_root
from distutils_ml.rng import rng_state, set_rng_state_all

__all__ = ["RESUME_REPORT_ENV", "TrainState"]

_FILE = re.compile(r"state-(\d{8,})\.pt")
#: Set by ``distutils-ml launch --restarts``: a file where rank 0 of a resumed job says where it resumed from.
RESUME_REPORT_ENV = "DML_RESUME_REPORT"
_FORMAT = 1
#: The state's own attributes (its methods are found on the class): no user value may take their names.
_OWN = frozenset({"backend", "epoch", "start", "saves", "keep"})


class TrainState:
    """The state of a training run: save it (in the background) and resume it, exactly at the same world size.

    Args:
        backend: from ``dml.get_distributed_backend``.
        model: a ``torch.nn.Module``.
        optimizer: a ``torch.optim.Optimizer`` or ``dml.DistributedOptimizer`` (``shard_state=True`` too: its state
            is consolidated when saved and resharded when resumed at any world size).
        data: the ``DistributedDataContainer`` the loader reads; its epoch and position are saved.
        scheduler: an LR scheduler.
        scaler: a ``torch.amp.GradScaler``.
        keep: how many checkpoints to keep in the directory (the newest).
        every_steps: :meth:`save_if_due` saves at every ``every_steps``-th call.
        every_seconds: :meth:`save_if_due` saves when this many seconds passed since the last save (rank 0's
            clock decides: one one-byte broadcast per call).
        **extra: the run's own values (``step=0``); they are attributes of the state, saved and restored.

    Raises:
        TypeError: ``backend`` is not a backend, ``data`` is not a ``DistributedDataContainer``, ``model`` is not a
            ``torch.nn.Module``, or ``optimizer``, ``scheduler`` or ``scaler`` has no ``state_dict`` and
            ``load_state_dict``.
        ValueError: ``keep``, ``every_steps`` or ``every_seconds`` out of range, or an ``extra`` name that the
            state uses itself.
    """

    def __init__(
        self,
        backend: Backend,
        *,
        model: torch.nn.Module | None = None,
        optimizer: Any = None,
        data: DistributedDataContainer | None = None,
        scheduler: Any = None,
        scaler: Any = None,
        keep: int = 3,
        every_steps: int | None = None,
        every_seconds: float | None = None,
        **extra: Any,
    ) -> None:
        check_backend(backend, "TrainState")
        if data is not None and not isinstance(data, DistributedDataContainer):
            raise TypeError(f"TrainState: data: got {type(data).__name__}; allowed: a dml.DistributedDataContainer")
        if model is not None and not isinstance(model, torch.nn.Module):
            raise TypeError(f"TrainState: model: got {type(model).__name__}; allowed: a torch.nn.Module")
        for name, obj in (("optimizer", optimizer), ("scheduler", scheduler), ("scaler", scaler)):
            if obj is not None and not all(callable(getattr(obj, m, None)) for m in ("state_dict", "load_state_dict")):
                raise TypeError(
                    f"TrainState: {name}: got {type(obj).__name__}, which has no state_dict() and load_state_dict(); "
                    "allowed: an optimizer, LR scheduler or GradScaler (put other values in as the state's own values)"
                )
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
            raise ValueError(f"TrainState: keep: got {keep!r}; allowed: an int >= 1")
        if every_steps is not None and (isinstance(every_steps, bool) or not isinstance(every_steps, int)
                                        or every_steps < 1):  # fmt: skip
            raise ValueError(f"TrainState: every_steps: got {every_steps!r}; allowed: an int >= 1, or None")
        if every_seconds is not None and not (isinstance(every_seconds, (int, float)) and every_seconds > 0):
            raise ValueError(f"TrainState: every_seconds: got {every_seconds!r}; allowed: a number > 0, or None")
        clash = sorted(set(extra) & (_OWN | {k for k in dir(type(self)) if not k.startswith("__")}))
        if clash or any(k.startswith("_") for k in extra):
            raise ValueError(f"TrainState: {clash or sorted(extra)} are names of the state itself; name them otherwise")
        self.backend = backend
        self.keep = keep
        self._objects = {
            name: obj
            for name, obj in (("model", model), ("optimizer", optimizer), ("scheduler", scheduler), ("scaler", scaler))
            if obj is not None
        }
        self._data = data
        self._every_steps, self._every_seconds = every_steps, every_seconds
        self._extra = list(extra)
        for name, value in extra.items():
            setattr(self, name, value)
        #: The epoch the run stands in (:meth:`epochs` advances it) and the positions of it consumed before this
        #: process took it up (a resumed epoch).
        self.epoch, self.start = (data.epoch, data.start) if data is not None else (0, 0)
        self._taken = 0  # observations this rank took this epoch, in this process (batches)
        self._ended = False  # this epoch's loop over batches is over (run out, or left by a break)
        self._looping = False  # inside a loop over batches() now
        self._loop_at: tuple[int, int] | None = None  # the container's (epoch, start) when that loop began
        self._counting = False  # epochs() keeps the epoch (else the container's set_epoch, by the user, does)
        self._calls = 0  # save_if_due calls, over the whole run
        self._last = time.monotonic()
        #: Checkpoints written by this run (counting those of the runs it resumed).
        self.saves = 0
        self._writer: threading.Thread | None = None
        self._warned_join = False  # a save inside dml.join after a rank left: warned once
        self._failed: BaseException | None = None
        self._host: dict[str, torch.Tensor] = {}  # rank 0's host copy, reused from save to save
        self._seq = 0  # the number of the last checkpoint this run wrote (as every rank saving learned it)

    # -- the loop ------------------------------------------------------------------------------------------------

    def epochs(self, count: int) -> Iterator[int]:
        """The epochs from the one the run stands in up to ``count`` (exclusive), each set on the container first
        (the resumed one part way)."""
        self._counting = True
        while self.epoch < count:
            if self._data is not None:
                self._data.set_epoch(self.epoch, self.start)
            yield self.epoch
            self.epoch, self.start, self._taken, self._ended = self.epoch + 1, 0, 0, False

    def batches(self, loader: Iterable[Any]) -> Iterator[Any]:
        """``loader``'s batches, counted: each batch's observations count as consumed once it is yielded. Use one
        such loop per epoch. Once it is over, the epoch counts as done: a save from then on (after the epoch's
        own closing code, a per-epoch scheduler step say) resumes at the next epoch; a loop left by ``break``
        counts as over too.

        Raises:
            RuntimeError: another loop over ``batches`` is running (count the training loader only: iterate an
                evaluation loader directly).
        """
        if self._looping:
            raise RuntimeError(
                "TrainState.batches: a loop over batches() is already running; it counts the training data's "
                "position, so use it for the training loader only (iterate an evaluation loader directly)"
            )
        self._taken, self._ended = 0, False
        self._loop_at = None if self._data is None else (self._data.epoch, self._data.start)
        self._looping = True
        try:
            for batch in loader:
                self._taken += _batch_len(batch)
                yield batch
            self._ended = True
        except GeneratorExit:  # closed by a break out of the loop (an error in it ends the run instead)
            self._ended = True
            raise
        finally:
            self._looping = False

    # -- saving --------------------------------------------------------------------------------------------------

    def save_if_due(self, path: str | os.PathLike[str]) -> bool:
        """:meth:`save` when ``every_steps`` calls or ``every_seconds`` passed since the last; whether it saved.
        Call it on every rank at the same points (after a step)."""
        self._calls += 1
        due = self._every_steps is not None and self._calls % self._every_steps == 0
        if self._every_seconds is not None and not due:
            clock = self.backend.acting_root(0)  # rank 0's; inside dml.join, once it has joined, a rank with data's
            late = time.monotonic() - self._last >= self._every_seconds
            due = bool(bcast_object(self.backend, late if self.backend.rank == clock else None, root=clock))
        if due:
            self.save(path)
        return due

    def save(self, path: str | os.PathLike[str]) -> None:
        """Save the state to a new checkpoint in the directory ``path`` (made if missing); every rank calls it.

        Waits for the previous write first (raising its failure on every rank), gathers what needs every rank,
        and returns once rank 0 holds a copy in host memory: the file is written in the background.
        """
        path = check_path(path, "TrainState.save")
        backend = self.backend
        self._settle(f"TrainState.save: in {path!r}")
        # Rank 0 writes; inside dml.join, once rank 0 has joined, the lowest rank with data does.
        writer = backend.acting_root(0)
        # The number after the newest on disk and after the last this run gave (inside dml.join a rank that has
        # joined may still be writing that one: another rank, now the writer, must not take its number).
        seq = run_on_root(
            backend, lambda: max(_newest(path), self._seq), root=writer, what=f"TrainState.save: in {path!r}"
        )
        self._seq = seq + 1
        obj = consolidated_states(backend, self._content())
        snapshots: list[Any] = []

        def snapshot() -> None:  # host memory: training may change the live tensors now
            state = rebuilt(state_of(obj), self._copy)
            check_resumable(state, "TrainState.save")
            snapshots.append(state)

        # Inside a collective: a copy that fails on the writer raises on every rank, none is left waiting for it.
        run_on_root(backend, snapshot, root=writer, what="TrainState.save: copying the state to host memory")
        self.saves += 1
        self._last = time.monotonic()
        if backend.rank != writer:
            return
        target = os.path.join(path, f"state-{seq + 1:08d}.pt")
        self._writer = threading.Thread(target=self._write, args=(snapshots[0], target, path), name="dml-trainstate")
        self._writer.start()

    def wait(self) -> None:
        """Wait for the last checkpoint to be written; its failure is raised on every rank. Call it on every rank
        before the run ends (at exit the writer finishes anyway, but a failure would go unreported)."""
        self._settle("TrainState.wait")

    def _settle(self, what: str) -> None:
        """The last write done (by the rank that wrote it: rank 0, or inside ``dml.join`` a rank with data), and its
        failure raised on every rank, in the form ``run_on_root`` raises a failure in. The wait runs inside that
        collective, so a slow write is not taken for a stall by the ranks waiting for it."""
        backend = self.backend
        writing = allgather_object(backend, self._writer is not None or self._failed is not None)
        for rank in (r for r, busy in enumerate(writing) if busy):  # one, but inside dml.join ranks take turns
            run_on_root(backend, self._join if rank == backend.rank else lambda: None, root=rank, what=what)

    def _content(self) -> dict[str, Any]:
        epoch, consumed = self.epoch, self.start
        taken, ended = self._taken, self._ended
        data = self._data
        if data is not None:
            if not self._counting:  # the user sets the container's epochs: it says where the run stands
                epoch, consumed = data.epoch, data.start
            if self._loop_at != (data.epoch, data.start):  # the last loop over batches was another epoch's
                taken, ended = 0, False
            own = min(taken, len(data))
            consumed = min(data.num_observations, consumed + own * self.backend.size)
        if ended:  # the loop over the epoch's batches is over: the epoch is done
            epoch, consumed = epoch + 1, 0
        rng, local = self._gathered()
        return {
            "format": _FORMAT,
            "world_size": self.backend.size,
            **self._objects,
            "data": {"epoch": epoch, "start": consumed},
            "rng": rng,
            "extra": {name: getattr(self, name) for name in self._extra},
            "local": local,
            "counters": {"calls": self._calls, "saves": self.saves + 1},
        }

    def _local_values(self) -> dict[str, Any]:
        """What may differ from rank to rank: the user's values and the model's buffers (BatchNorm's running
        statistics, which no collective keeps equal unless the layers are synchronized)."""
        local = {f"extra/{name}": getattr(self, name) for name in self._extra}
        model = self._objects.get("model")
        if isinstance(model, torch.nn.Module):
            params = {id(p) for p in model.parameters()}
            for key, value in model.state_dict(keep_vars=True).items():
                if isinstance(value, torch.Tensor) and id(value) not in params:
                    local[f"buffer/{key}"] = value
        return local

    def _gathered(self) -> tuple[list[dict[str, Any]], dict[str, list[Any]]]:
        """Every rank's RNG states, and every rank's value of each user value or buffer that is not the same on
        every rank (``{key: [rank 0's, rank 1's, ...]}``): one allgather, a second only when some differ."""
        local = self._local_values()
        backend = self.backend
        left = [r for r in range(backend.size) if backend.acting_root(r) != r]  # inside dml.join: ranks that joined
        if left and not self._warned_join:
            self._warned_join = True
            warnings.warn(
                f"TrainState.save inside dml.join after rank(s) {left} left the loop: the ranks with data cannot "
                "learn those ranks' own values (RNG streams, values and buffers that differ by rank); the checkpoint "
                f"holds rank {backend.acting_root(left[0])}'s for them, which a resume gives them. Everything that "
                "is the same on every rank (the model, the optimizer) is saved exactly",
                stacklevel=4,
            )
        every = allgather_object(backend, (rng_state(), {k: _fingerprint(v) for k, v in local.items()}))
        for rank, (_, prints) in enumerate(every):  # a value that cannot be pickled: named, on every rank
            bad = next((k for k, p in prints.items() if isinstance(p, str)), None)
            if bad is not None:
                kind, _, name = bad.partition("/")
                place = f"state['extra'][{name!r}]" if kind == "extra" else f"the model's {name!r}"
                raise TypeError(f"TrainState.save: {place} cannot be saved: {prints[bad]} (on rank {rank})")
        mine = every[self.backend.rank][1]
        keys = sorted(set().union(*(prints for _, prints in every)))
        differ = [k for k in keys if any(prints.get(k) != mine.get(k) for _, prints in every)]
        if not differ:
            return [state for state, _ in every], {}
        values = allgather_object(self.backend, {k: local.get(k) for k in differ})
        return [state for state, _ in every], {k: [v.get(k) for v in values] for k in differ}

    def _join(self) -> None:
        if self._writer is not None:
            self._writer.join()
            self._writer = None
        failed, self._failed = self._failed, None
        if failed is not None:
            raise failed

    def _copy(self, obj: Any, where: str) -> Any:
        """A tensor's copy in this state's host buffer for its place (the previous write is done: it is free).
        Reused, so a save after the first touches no fresh memory (fresh pages cost 2-20x the copy here)."""
        if not isinstance(obj, torch.Tensor):
            if rebuilds(obj):
                return DESCEND
            # NumPy arrays, sets, bytearrays, objects: copied as they are now (the writer runs later)
            return copy.deepcopy(obj)
        if obj.layout != torch.strided or _overlaps(obj):  # sparse; expand()ed: no buffer of its strides holds it
            return obj.detach().clone()
        have = self._host.get(where)
        if have is None or have.shape != obj.shape or have.dtype != obj.dtype or have.stride() != obj.stride():
            have = self._host[where] = torch.empty_strided(obj.shape, obj.stride(), dtype=obj.dtype, device="cpu")
        return have.copy_(obj.detach())

    def _write(self, snapshot: Any, target: str, directory: str) -> None:
        try:
            write_atomic(snapshot, target)
            for _, name in _checkpoints(directory)[: -self.keep]:
                os.unlink(os.path.join(directory, name))
        except BaseException as e:  # reported at the next save or wait, on every rank
            self._failed = e

    # -- resuming ------------------------------------------------------------------------------------------------

    def resume(self, path: str | os.PathLike[str]) -> bool:
        """Restore the newest checkpoint in the directory ``path`` that reads back whole; whether there was one.

        At the world size it was saved at, the run continues bit for bit as if it had not stopped (every rank's
        random streams restored; the loaders need a generator of their own, as the exact-resume recipe says). At
        another world size the model, optimizer (resharded), scheduler, scaler and user values are restored, the
        rest of the saved epoch is split over the new ranks, and the random streams start afresh (a warning).
        """
        path = check_path(path, "TrainState.resume")
        names = run_on_root(
            self.backend,
            lambda: [name for _, name in reversed(_checkpoints(path))] if os.path.isdir(path) else [],
            what=f"TrainState.resume: in {path!r}",
        )
        for k, name in enumerate(names):
            try:
                ckpt = load(self.backend, os.path.join(path, name))
            except Exception as e:  # unreadable (corrupted, cut short): every rank learns it from rank 0, alike
                if k + 1 == len(names):
                    raise
                warnings.warn(f"TrainState.resume: {name} is unreadable ({e}); trying an older one", stacklevel=2)
                continue
            self._restore(ckpt)
            if self.backend.rank == 0:
                _report(name, self.epoch, {k: getattr(self, k) for k in self._extra})
            return True
        return False

    def _restore(self, ckpt: dict[str, Any]) -> None:
        if ckpt.get("format") != _FORMAT:
            raise ValueError(f"TrainState.resume: not a TrainState checkpoint (format {ckpt.get('format')!r})")
        missing = sorted(set(self._objects) - set(ckpt))
        if missing:
            raise ValueError(f"TrainState.resume: the checkpoint holds no {missing}: another TrainState saved it")
        for name, obj in self._objects.items():
            obj.load_state_dict(ckpt[name])
        self.epoch, self.start, self._taken = ckpt["data"]["epoch"], ckpt["data"]["start"], 0
        if self._data is not None:
            self._data.set_epoch(self.epoch, self.start)
        for name, value in ckpt["extra"].items():
            if name in self._extra:
                setattr(self, name, value)
        self._calls, self.saves = ckpt["counters"]["calls"], ckpt["counters"]["saves"]
        local = ckpt.get("local") or {}
        if ckpt["world_size"] == self.backend.size:
            set_rng_state_all(self.backend, ckpt["rng"])
            self._set_local({key: values[self.backend.rank] for key, values in local.items()})  # each rank's own
        else:
            if local:
                warnings.warn(
                    f"TrainState.resume: saved on {ckpt['world_size']} ranks, resumed on {self.backend.size}: "
                    f"{', '.join(local)} differed from rank to rank when saved; every rank now holds rank 0's",
                    stacklevel=3,
                )
            warnings.warn(
                f"TrainState.resume: saved on {ckpt['world_size']} ranks, resumed on {self.backend.size}: the model, "
                "optimizer and data position are restored (the rest of the epoch split over these ranks), the random "
                "streams start afresh, so the run is correct but not the bitwise continuation of the saved one",
                stacklevel=3,
            )
        self._last = time.monotonic()
        self._ended = False

    def _set_local(self, values: dict[str, Any]) -> None:
        """Set this rank's own saved ``{key: value}`` (``extra/<name>``, ``buffer/<state dict key>``)."""
        model = self._objects.get("model")
        live = model.state_dict(keep_vars=True) if isinstance(model, torch.nn.Module) else {}
        for key, value in values.items():
            kind, _, name = key.partition("/")
            if kind == "extra":
                if name in self._extra:
                    setattr(self, name, value)
                continue
            target = live.get(name)
            if isinstance(target, torch.Tensor) and isinstance(value, torch.Tensor):
                with torch.no_grad():
                    target.copy_(value)


def _tensor_digest(t: torch.Tensor) -> bytes:
    t = t.detach()
    if t.layout != torch.strided:
        t = t.to_dense()
    t = t.resolve_conj().resolve_neg()
    head = repr((t.dtype, tuple(t.shape))).encode()
    if not t.numel():
        return head
    return head + hashlib.blake2b(t.reshape(-1).contiguous().view(torch.uint8).cpu().numpy(), digest_size=16).digest()


class _DigestPickler(pickle.Pickler):
    """Pickles a value with each tensor in place of a digest of its bytes (C speed for the builtin containers)."""

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            return bytes, (_tensor_digest(obj),)
        return NotImplemented


def _fingerprint(value: Any) -> bytes | str:
    """A digest of ``value`` that is the same on two ranks exactly when their values are (tensors by their bytes,
    the rest by its pickle); for a value that cannot be pickled, why (a str)."""
    out = io.BytesIO()
    try:
        _DigestPickler(out, protocol=pickle.HIGHEST_PROTOCOL).dump(value)
    except (pickle.PicklingError, TypeError, AttributeError) as e:
        return f"{type(e).__name__}: {e}"
    except Exception:  # a tensor that cannot be digested: gathered, as differing
        return os.urandom(16)
    return hashlib.blake2b(out.getbuffer(), digest_size=16).digest()


def _newest(path: str) -> int:
    """The writer: the directory made; the newest checkpoint's number in it (0: none)."""
    os.makedirs(path, exist_ok=True)
    found = _checkpoints(path)
    return found[-1][0] if found else 0


def _checkpoints(directory: str) -> list[tuple[int, str]]:
    """The checkpoints in ``directory``, oldest first: (number, file name)."""
    found = []
    for name in os.listdir(directory):
        match = _FILE.fullmatch(name)
        if match:
            found.append((int(match.group(1)), name))
    return sorted(found)


def _batch_len(batch: Any) -> int:
    """The number of observations in a batch as a loader yields it: its first tensor's length."""
    first = batch
    while isinstance(first, (list, tuple)) and first:
        first = first[0]
    if isinstance(first, dict) and first:
        first = next(iter(first.values()))
    if hasattr(first, "shape") and len(first.shape):
        return int(first.shape[0])
    raise TypeError(
        f"TrainState.batches: cannot tell how many observations a batch holds ({type(batch).__name__}); "
        "batches must hold tensors or arrays with the observations along their first axis"
    )


def _report(file: str, epoch: int, values: dict[str, Any]) -> None:
    """Rank 0 of a resumed job: where it resumed from, for the launcher's log (``RESUME_REPORT_ENV``), if it asked."""
    where = os.environ.get(RESUME_REPORT_ENV)
    if not where:
        return
    simple = {k: v for k, v in values.items() if isinstance(v, (int, float, str, bool))}
    with contextlib.suppress(OSError):  # for the log only
        Path(where).write_text(json.dumps({"file": file, "epoch": epoch, "values": simple}))


def _overlaps(t: torch.Tensor) -> bool:
    """Whether two elements of ``t`` share memory (a stride of 0 over a dimension of more than one element, as
    ``expand`` makes, or strides that fold back onto each other)."""
    dims = sorted((st, n) for st, n in zip(t.stride(), t.shape, strict=True) if n > 1)
    span = 1
    for stride, n in dims:
        if stride < span:
            return True
        span = stride * n
    return False
