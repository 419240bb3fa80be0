"""Checkpoints: ``save`` on rank 0, atomically; ``load`` on rank 0 and broadcast; RNG state.

``save`` turns live objects into their state (a module, optimizer, LR scheduler or
stateful data loader into its ``state_dict()``, a ``DistributedDataContainer`` into
``{"epoch": ...}``), so ``dml.save(backend, {"model": model, "opt": opt}, path)`` writes
what ``torch.load(path, weights_only=True)`` can read back. Rank 0 writes a temporary
file beside ``path``, flushes and fsyncs it, then renames it over ``path``: a crash
leaves either the old checkpoint or the new one, never half of one. A write that fails
removes its temporary file; one cut short by a signal (the job aborted, killed) leaves
it behind, and the next successful ``save`` to the same path removes it. Every rank
learns the outcome from rank 0, so an error is raised on every rank and no rank is left
waiting in the next collective.
"""

from __future__ import annotations

import builtins
import contextlib
import copy
import dataclasses
import os
import pickle
import random
import re
import secrets
from collections import OrderedDict
from typing import Any

import numpy as np
import torch

from distutils_ml.backends.base import Backend, check_backend
from distutils_ml.data import DistributedDataContainer

__all__ = ["load", "rng_state", "save", "set_rng_state"]

# Where the class of a rank-0 error is looked up to raise the same class on every rank.
_ERROR_MODULES = {"builtins": builtins, "pickle": pickle, "_pickle": pickle}


def _check_path(path: Any, caller: str) -> str:
    """``path`` as a str, or a ``TypeError`` / ``ValueError`` naming what was given."""
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"{caller}: path: got {type(path).__qualname__}; allowed: a str or os.PathLike file path")
    text = os.fspath(path)
    if not isinstance(text, str):
        raise TypeError(f"{caller}: path: got the bytes path {text!r}; allowed: a str or os.PathLike of str")
    if not text:
        raise ValueError(f"{caller}: path: got an empty string; allowed: a file path")
    return text


def _state_of(obj: Any) -> Any:
    """``obj`` with live objects replaced by their state, containers rebuilt recursively (same types)."""
    if isinstance(obj, (torch.Tensor, np.ndarray, type)):
        return obj
    if callable(getattr(obj, "state_dict", None)):  # modules, optimizers, schedulers, StatefulDataLoader
        return obj.state_dict()
    if isinstance(obj, DistributedDataContainer):
        return {"epoch": obj.epoch}
    if isinstance(obj, torch.utils.data.DataLoader):
        raise TypeError(
            "save: a torch.utils.data.DataLoader has no state to save (resumed, it starts its epoch from the "
            "beginning); save the DistributedDataContainer instead (its epoch), and for a mid-epoch resume "
            "use torchdata's StatefulDataLoader, which saves its position"
        )
    if type(obj) in (dict, OrderedDict):
        return type(obj)((k, _state_of(v)) for k, v in obj.items())
    if type(obj) is list:
        return [_state_of(v) for v in obj]
    if type(obj) is tuple:
        return tuple(_state_of(v) for v in obj)
    if isinstance(obj, tuple) and hasattr(type(obj), "_fields"):  # namedtuple
        return type(obj)(*(_state_of(v) for v in obj))
    if dataclasses.is_dataclass(obj):
        new = copy.copy(obj)
        for f in dataclasses.fields(obj):
            object.__setattr__(new, f.name, _state_of(getattr(obj, f.name)))  # frozen dataclasses too
        return new
    return obj


def _leftover_temporaries(path: str) -> list[str]:
    """Temporary files of earlier saves to ``path`` that were cut short (a killed or aborted job)."""
    directory, name = os.path.split(os.path.abspath(path))
    pattern = re.compile(rf"\.{re.escape(name)}\.[0-9a-f]{{12}}\.tmp")
    return [os.path.join(directory, n) for n in os.listdir(directory) if pattern.fullmatch(n)]


def _write_atomic(state: Any, path: str) -> None:
    """``torch.save(state)`` to a temporary file beside ``path``, fsync, then rename over ``path``."""
    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(directory):
        raise FileNotFoundError(f"the directory {directory!r} of {path!r} does not exist; create it first")
    leftovers = _leftover_temporaries(path)
    tmp = os.path.join(directory, f".{os.path.basename(path)}.{secrets.token_hex(6)}.tmp")
    # os.open, not tempfile: the checkpoint gets the usual permissions (0o666 less the umask).
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:  # any failure, KeyboardInterrupt included: leave no partial file behind
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    for old in leftovers:  # listed before this save began, so never its own
        with contextlib.suppress(OSError):
            os.unlink(old)
    if hasattr(os, "O_DIRECTORY"):  # make the rename itself durable (POSIX)
        dfd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)


def _describe_error(exc: BaseException) -> tuple[str, str, str]:
    return (type(exc).__module__, type(exc).__qualname__, str(exc))


def _raise_everywhere(status: tuple[str, str, str], message: str, cause: BaseException | None) -> None:
    """Raise the class of rank 0's error (a builtin or pickle error; else RuntimeError) with ``message``."""
    module, name, text = status
    cls = getattr(_ERROR_MODULES.get(module), name, None)
    full = f"{message}: {name}: {text}"
    err: Exception
    try:
        err = cls(full) if isinstance(cls, type) and issubclass(cls, Exception) else RuntimeError(full)
    except Exception:  # a class that cannot be built from one message
        err = RuntimeError(full)
    raise err from cause


def save(backend: Backend, obj: Any, path: str | os.PathLike[str]) -> None:
    """Write ``obj`` to ``path`` on rank 0, atomically; every rank returns once it is written.

    Live objects anywhere inside dicts, lists, tuples, namedtuples and dataclasses
    (rebuilt with the same types; ``load`` reads the last two back only with
    ``weights_only=False`` or ``torch.serialization.add_safe_globals``) are saved as
    their state: a ``torch.nn.Module``, a
    ``torch.optim.Optimizer`` (``dml.DistributedOptimizer`` included: the wrapped
    optimizer's), and anything else with a ``state_dict()`` method (LR schedulers,
    torchdata's ``StatefulDataLoader``: its position in the epoch) as its
    ``state_dict()``; a ``dml.DistributedDataContainer`` as ``{"epoch": container.epoch}``.
    Restore them with ``load_state_dict`` and ``set_epoch``. A plain
    ``torch.utils.data.DataLoader`` holds no position and is refused (``TypeError``):
    with it, a resumed run starts the saved epoch from its first batch. Only rank 0's
    ``obj`` is read; the other ranks' ``obj`` is ignored.

    The file is written by ``torch.save`` to a temporary file in the same directory,
    flushed, fsynced and renamed over ``path``, so ``path`` holds either the previous
    checkpoint or the complete new one, never a partial file. The temporary file is
    removed when the write fails; temporary files that earlier saves to ``path`` left
    behind when their job was killed are removed once this save succeeds.

    Args:
        backend: from ``dml.get_distributed_backend``.
        obj: what to save (the same structure on every rank, though only rank 0's counts).
        path: the checkpoint file; its directory must exist.

    Raises:
        TypeError: ``backend`` is not a backend instance, or ``path`` is not a str or
            os.PathLike (raised before any communication).
        ValueError: ``path`` is empty.
        Exception: if rank 0 fails to write (an unpicklable object, a plain
            DataLoader, a full disk, a missing directory), every rank raises the same class of error (a builtin
            or pickle error, else ``RuntimeError``) naming ``path`` and rank 0's error;
            an existing checkpoint at ``path`` is left as it was.

    Example:
        >>> model = torch.nn.Linear(4, 2)
        >>> opt = torch.optim.Adam(model.parameters())
        >>> dml.save(backend, {"model": model, "opt": opt, "step": 10, "rng": dml.rng_state()}, "ckpt.pt")
    """
    check_backend(backend, "save")
    path = _check_path(path, "save")
    status: tuple[str, str, str] | None = None
    cause: BaseException | None = None
    if backend.rank == 0:
        try:
            _write_atomic(_state_of(obj), path)
        except Exception as exc:
            status, cause = _describe_error(exc), exc
    status = backend._bcast_object(status, 0)
    if status is not None:
        _raise_everywhere(status, f"save: rank 0 could not write the checkpoint {path!r}", cause)


def load(backend: Backend, path: str | os.PathLike[str], *, weights_only: bool = True) -> Any:
    """Read the checkpoint at ``path`` on rank 0 and return it on every rank.

    Rank 0 reads it with ``torch.load(path, map_location="cpu", weights_only=weights_only)``
    and broadcasts the object, so only rank 0 needs to see the file. Tensors arrive
    on the CPU; ``load_state_dict`` copies them to the parameters' devices.

    Args:
        backend: from ``dml.get_distributed_backend``.
        path: the checkpoint file.
        weights_only: load only tensors, containers and plain values (``torch.load``'s
            safe mode, the default). Pass False only for a file you trust that holds
            other classes.

    Returns:
        The saved object, an independent copy on every rank.

    Raises:
        TypeError: ``backend`` is not a backend instance, ``path`` is not a str or
            os.PathLike, or ``weights_only`` is not a bool (raised before any communication).
        ValueError: ``path`` is empty.
        FileNotFoundError: no file at ``path`` on rank 0, raised on every rank.
        Exception: any other failure to read on rank 0 (``pickle.UnpicklingError`` for
            a class that ``weights_only`` rejects), raised with the same class on every
            rank, naming ``path`` and rank 0's error.

    Example:
        >>> model = torch.nn.Linear(4, 2)
        >>> opt = torch.optim.Adam(model.parameters())
        >>> dml.save(backend, {"model": model, "opt": opt, "step": 10}, "ckpt.pt")
        >>> ckpt = dml.load(backend, "ckpt.pt")  # read by rank 0, broadcast to every rank
        >>> model.load_state_dict(ckpt["model"]); opt.load_state_dict(ckpt["opt"]); ckpt["step"]
        <All keys matched successfully>
        10
    """
    check_backend(backend, "load")
    path = _check_path(path, "load")
    if not isinstance(weights_only, bool):
        raise TypeError(f"load: weights_only: got {type(weights_only).__qualname__}; allowed: True or False")
    message: tuple[tuple[str, str, str] | None, Any] = (None, None)
    cause: BaseException | None = None
    if backend.rank == 0:
        try:
            message = (None, torch.load(path, map_location="cpu", weights_only=weights_only))
        except Exception as exc:
            message, cause = (_describe_error(exc), None), exc
    status, obj = backend._bcast_object(message, 0)
    if status is not None:
        _raise_everywhere(status, f"load: rank 0 could not read the checkpoint {path!r}", cause)
    return obj


def rng_state() -> dict[str, Any]:
    """This process's random number generator states: torch (CPU, and the current CUDA
    device once CUDA is initialized), NumPy's global ``np.random`` and Python's ``random``.

    The result holds only tensors, lists and numbers, so ``dml.save`` writes it and
    ``dml.load`` reads it back with ``weights_only=True``. Restore it with
    :func:`set_rng_state` to make a resumed run draw the same numbers (dropout masks,
    augmentations) as an uninterrupted one.

    Returns:
        ``{"torch": uint8 tensor, "numpy": dict, "python": dict}``, plus ``"cuda"``
        where CUDA is initialized.

    Example:
        >>> dml.save(backend, {"model": torch.nn.Linear(4, 2), "rng": dml.rng_state()}, "ckpt.pt")
    """
    kind, key, pos, has_gauss, cached_gaussian = np.random.get_state()
    version, internal, gauss_next = random.getstate()
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "numpy": {
            "kind": kind,
            "key": torch.from_numpy(key.astype(np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached_gaussian),
        },
        "python": {"version": version, "internal": list(internal), "gauss_next": gauss_next},
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore the random number generator states captured by :func:`rng_state`.

    Args:
        state: a dict from :func:`rng_state` (possibly after ``dml.save`` / ``dml.load``).

    Raises:
        TypeError: ``state`` is not a dict.
        ValueError: ``state`` lacks one of the keys ``"torch"``, ``"numpy"``, ``"python"``.

    Example:
        >>> dml.save(backend, {"rng": dml.rng_state()}, "ckpt.pt")
        >>> first = torch.rand(2)
        >>> dml.set_rng_state(dml.load(backend, "ckpt.pt")["rng"])
        >>> torch.equal(torch.rand(2), first)  # the same draws again
        True
    """
    if not isinstance(state, dict):
        raise TypeError(f"set_rng_state: state: got {type(state).__qualname__}; allowed: a dict from dml.rng_state()")
    missing = [k for k in ("torch", "numpy", "python") if k not in state]
    if missing:
        raise ValueError(
            f"set_rng_state: state: missing keys {missing} (got {sorted(state)}); allowed: a dict from dml.rng_state()"
        )
    torch.set_rng_state(state["torch"])
    npy = state["numpy"]
    key = torch.as_tensor(npy["key"]).numpy().astype(np.uint32)
    np.random.set_state((npy["kind"], key, npy["pos"], npy["has_gauss"], npy["cached_gaussian"]))
    py = state["python"]
    random.setstate((py["version"], tuple(py["internal"]), py["gauss_next"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
