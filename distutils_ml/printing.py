"""Rank-aware printing (FluxMPI's ``fluxmpi_println``)."""

from __future__ import annotations

import builtins
import datetime
from typing import Any

from distutils_ml.backends.base import Backend, check_backend

__all__ = ["print"]


def print(backend: Backend, *args: Any, all_ranks: bool = True, **kwargs: Any) -> None:  # noqa: A001
    """Print ``args`` with a ``[rank/size HH:MM:SS.mmm]`` prefix, flushed at once.

    Args:
        backend: from ``dml.get_distributed_backend``.
        *args: what to print, as with the built-in ``print``.
        all_ranks: False prints on rank 0 only.
        **kwargs: ``sep``, ``end``, ``file`` of the built-in ``print``.

    Example:
        >>> dml.print(backend, "epoch", 3, "loss", 0.25, all_ranks=False)  # [rank/size time]
        [0/1 ...] epoch 3 loss 0.25
    """
    check_backend(backend, "print")
    rank = backend.rank
    if not all_ranks and rank != 0:
        return
    stamp = datetime.datetime.now().strftime("%H:%M:%S.%f")[:-3]
    sep = kwargs.pop("sep", " ")
    kwargs.setdefault("flush", True)
    # One write per call, so lines of concurrent ranks (threads) never interleave.
    builtins.print(f"[{rank}/{backend.size} {stamp}] " + (" " if sep is None else sep).join(map(str, args)), **kwargs)
