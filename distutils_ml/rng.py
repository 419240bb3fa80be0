"""Random number generator states: this process's (``rng_state``), and every rank's (``rng_state_all``).

A checkpoint to resume from exactly holds every rank's torch, NumPy and Python streams
(docs/reliability.md, "Exact resume"): :func:`rng_state_all` gathers them in one collective,
:func:`set_rng_state_all` gives each rank its own back.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch

from distutils_ml.backends.base import Backend, check_backend
from distutils_ml.objects import allgather_object

__all__ = ["rng_state", "rng_state_all", "set_rng_state", "set_rng_state_all"]


def rng_state() -> dict[str, Any]:
    """This process's random number generator states: torch (CPU, and the current CUDA
    device once CUDA is initialized), NumPy's global ``np.random`` and Python's ``random``.

    The result holds only tensors, lists and numbers, so ``dml.save`` writes it and
    ``dml.load`` reads it back with ``weights_only=True``; :func:`set_rng_state` restores it
    in this process. For a checkpoint, save :func:`rng_state_all` instead: every rank's
    states, gathered in one collective. ``dml.save`` writes rank 0's object only, so a
    checkpoint holding ``dml.rng_state()`` holds rank 0's streams, and restoring them gives
    every rank rank 0's dropout masks: the resumed run is not the uninterrupted one. The
    exact-resume recipe (docs/reliability.md, "Exact resume") shows the whole checkpoint.

    Returns:
        ``{"torch": uint8 tensor, "numpy": dict, "python": dict}``, plus ``"cuda"``
        where CUDA is initialized.

    Example:
        >>> state = dml.rng_state()  # this process's streams
        >>> first = torch.rand(2)
        >>> dml.set_rng_state(state)
        >>> torch.equal(torch.rand(2), first)  # the same draws again
        True
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


def _check_rng_state(state: Any, name: str) -> None:
    """Raise unless ``state`` looks like a dict from :func:`rng_state`; ``name`` says which argument it is."""
    if not isinstance(state, dict):
        raise TypeError(f"{name}: got {type(state).__qualname__}; allowed: a dict from dml.rng_state()")
    missing = [k for k in ("torch", "numpy", "python") if k not in state]
    if missing:
        raise ValueError(f"{name}: missing keys {missing} (got {sorted(state)}); allowed: a dict from dml.rng_state()")


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore, in this process, the random number generator states captured by :func:`rng_state`.

    To resume from a checkpoint, restore the list that :func:`rng_state_all` saved with
    :func:`set_rng_state_all`, which sets each rank's own entry (docs/reliability.md, "Exact
    resume").

    Args:
        state: a dict from :func:`rng_state`.

    Raises:
        TypeError: ``state`` is not a dict.
        ValueError: ``state`` lacks one of the keys ``"torch"``, ``"numpy"``, ``"python"``.

    Example:
        >>> state = dml.rng_state()
        >>> first = np.random.rand(2)
        >>> dml.set_rng_state(state)
        >>> bool((np.random.rand(2) == first).all())  # the same draws again
        True
    """
    _check_rng_state(state, "set_rng_state: state")
    torch.set_rng_state(state["torch"])
    npy = state["numpy"]
    key = torch.as_tensor(npy["key"]).numpy().astype(np.uint32)
    np.random.set_state((npy["kind"], key, npy["pos"], npy["has_gauss"], npy["cached_gaussian"]))
    py = state["python"]
    random.setstate((py["version"], tuple(py["internal"]), py["gauss_next"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def rng_state_all(backend: Backend) -> list[dict[str, Any]]:
    """Every rank's :func:`rng_state`, in rank order, on every rank (one collective).

    The per-rank counterpart of ``torch.cuda.get_rng_state_all()``: save the list with
    ``dml.save`` (rank 0 writes it) and restore it with :func:`set_rng_state_all`. This is
    what a checkpoint holds, in the exact-resume recipe (docs/reliability.md, "Exact
    resume"); ``dml.rng_state()`` alone would save rank 0's streams only.

    Args:
        backend: from ``dml.get_distributed_backend``.

    Returns:
        ``[rng_state() of rank 0, rng_state() of rank 1, ...]``.

    Example:
        >>> model = torch.nn.Linear(3, 1)
        >>> dml.save(backend, {"model": model, "rng": dml.rng_state_all(backend)}, "ckpt.pt")
    """
    check_backend(backend, "rng_state_all")
    return allgather_object(backend, rng_state())


def set_rng_state_all(backend: Backend, states: list[dict[str, Any]]) -> None:
    """Restore this rank's entry of a list from :func:`rng_state_all`: rank ``r`` sets ``states[r]``.

    No communication: every rank checks the whole list the same way, so a list of the
    wrong length (a checkpoint of a job with another number of ranks) raises on every
    rank, and no rank restores anything unless every entry is a state. With the loaders'
    own generators, a run resumed so is bitwise the uninterrupted one (the exact-resume
    recipe, docs/reliability.md, "Exact resume").

    Args:
        backend: from ``dml.get_distributed_backend``.
        states: one :func:`rng_state` per rank, in rank order (e.g. ``dml.load(...)["rng"]``).

    Raises:
        TypeError: ``states`` is not a list or tuple, or an entry is not a dict.
        ValueError: ``len(states)`` is not the number of ranks, or an entry lacks a key.

    Example:
        >>> dml.save(backend, {"rng": dml.rng_state_all(backend)}, "ckpt.pt")
        >>> first = torch.rand(2)
        >>> dml.set_rng_state_all(backend, dml.load(backend, "ckpt.pt")["rng"])
        >>> torch.equal(torch.rand(2), first)  # the same draws again
        True
    """
    check_backend(backend, "set_rng_state_all")
    if not isinstance(states, (list, tuple)):
        raise TypeError(
            f"set_rng_state_all: states: got {type(states).__qualname__}; allowed: the list from "
            "dml.rng_state_all(backend)"
        )
    size = backend.size
    if len(states) != size:
        raise ValueError(
            f"set_rng_state_all: states: got {len(states)} states for {size} ranks; allowed: one per rank, from "
            f"dml.rng_state_all(backend) in a job of {size} ranks. A checkpoint of a job with another number of "
            "ranks cannot resume its random streams exactly: skip this call to keep the current ones"
        )
    for r, state in enumerate(states):
        _check_rng_state(state, f"set_rng_state_all: states[{r}]")
    set_rng_state(states[backend.rank])
