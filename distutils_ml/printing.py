"""Rank-aware printing (FluxMPI's ``fluxmpi_println``)."""

from __future__ import annotations

import datetime
import sys
from typing import IO, Any

from distutils_ml.backends.base import Backend, check_backend

__all__ = ["print"]


def print(  # noqa: A001 - dml.print mirrors the built-in on purpose
    backend: Backend,
    *args: Any,
    sep: str | None = " ",
    end: str | None = "\n",
    file: IO[str] | None = None,
    flush: bool = True,
    all_ranks: bool = True,
) -> None:
    """Print ``args`` with a ``[rank/size HH:MM:SS.mmm]`` prefix on every line, flushed at once.

    Every line of the message gets the prefix, including lines made by newlines inside
    an argument or ``sep``. The whole message, ``end`` included, goes out in one write,
    so lines of ranks sharing an output (simulated ranks on threads, a shared file) never
    interleave.

    Args:
        backend: from ``dml.get_distributed_backend``.
        *args: what to print, as with the built-in ``print``.
        sep: the separator between ``args`` (None: a space).
        end: written after the message, without a prefix (None: a newline).
        file: where to write; default ``sys.stdout``.
        flush: flush ``file`` after the write.
        all_ranks: False prints on rank 0 only.

    Raises:
        TypeError: ``sep`` or ``end`` is neither None nor a string.

    Example:
        >>> dml.print(backend, "epoch", 3, "loss", 0.25, all_ranks=False)  # [rank/size time]
        [0/1 ...] epoch 3 loss 0.25
        >>> dml.print(backend, "first line\\nsecond line")
        [0/1 ...] first line
        [0/1 ...] second line
    """
    check_backend(backend, "print")
    for name, value in (("sep", sep), ("end", end)):
        if value is not None and not isinstance(value, str):
            raise TypeError(f"print: {name}: got {type(value).__name__} {value!r}; allowed: None or a string")
    rank = backend.rank
    if not all_ranks and rank != 0:
        return
    out = sys.stdout if file is None else file
    if out is None:  # no console (pythonw), as the built-in print
        return
    stamp = datetime.datetime.now().strftime("%H:%M:%S.%f")[:-3]
    prefix = f"[{rank}/{backend.size} {stamp}] "
    text = (" " if sep is None else sep).join(map(str, args))
    out.write(prefix + text.replace("\n", "\n" + prefix) + ("\n" if end is None else end))
    if flush:
        out.flush()
