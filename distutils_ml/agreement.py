"""The agreement before data moves: every rank raises if any rank cannot take part.

Anything that can fail on one rank (a structure that differs from root's, a value it
cannot unpickle, an array it cannot write) is prepared before the ranks agree; then one
small allgather tells every rank whether all are ready, and if not, every rank raises the
same error naming each failing rank. Nothing fails on one rank only.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from distutils_ml.backends.base import Backend
from distutils_ml.collectives import allgather
from distutils_ml.objects import allgather_object
from distutils_ml.tree import Mismatch, show

__all__ = ["agree"]


def agree(
    backend: Backend,
    caller: str,
    root: int,
    failure: Exception | None,
    *,
    signature: int = 0,
    listing: list[tuple[Any, ...]] | None = None,
    differs: str = "hold a structure that differs from",
    fix: str = "Pass the same containers, keys, lengths and array shapes on every rank",
) -> None:
    """Raise on every rank if any rank failed to prepare, or its ``signature`` differs from root's.

    One allgather of two int64 per rank when all is well. Otherwise every rank gathers
    every rank's report (and ``listing``, which names the first entry where a rank's
    signature differs from root's) and raises the same exception class: ``ValueError``
    when every failing rank differs from root, else that of the lowest failing rank
    where it is a ``TypeError``, ``ValueError`` or ``RuntimeError``, else ``RuntimeError``.
    """
    mine = np.array([failure is not None, signature], dtype=np.int64)
    every = np.empty((backend.size, 2), dtype=np.int64)
    allgather(backend, mine, every)
    bad = [r for r in range(backend.size) if every[r, 0] or every[r, 1] != every[root, 1]]
    if not bad:
        return
    report = None
    if failure is not None:
        report = ("mismatch" if isinstance(failure, Mismatch) else type(failure).__name__, str(failure))
    reports = allgather_object(backend, (report, listing))
    details: dict[str, list[int]] = {}
    kinds = []
    for r in bad:
        (kind, text), theirs = reports[r][0] or ("mismatch", None), reports[r][1]
        if text is None:
            text = _first_listed_difference(theirs or [], reports[root][1] or [])
        kinds.append(kind)
        details.setdefault(text if kind == "mismatch" else f"{kind}: {text}", []).append(r)
    detail = "; ".join(f"rank {rs[0]}: {t}" if len(rs) == 1 else f"ranks {rs}: {t}" for t, rs in details.items())
    if all(k == "mismatch" for k in kinds):
        raise ValueError(f"{caller}: rank(s) {bad} {differs} root {root}'s: {detail}. {fix}; nothing was sent")
    cls = {"TypeError": TypeError, "ValueError": ValueError, "mismatch": ValueError}.get(kinds[0], RuntimeError)
    raise cls(f"{caller}: rank(s) {bad} cannot take part (nothing was sent; every rank raises): {detail}")


def _first_listed_difference(mine: list[tuple[Any, ...]], roots: list[tuple[Any, ...]]) -> str:
    for a, b in zip(mine, roots, strict=False):
        if a != b:
            return f"{a[0]} is {show(('array', *a[1:]))}, root's {b[0]} is {show(('array', *b[1:]))}"
    return f"{len(mine)} entries, root's has {len(roots)}"
